"""Defects an audit found in what users are told: a subscriber of a root that does not exist or is
a file, a served version that was never committed, an HF save into a folder holding an older
sharded save, resume's hints about optimizer states, and an HF export whose config does not fit
the weights. Real Ray, real files, tiny transformers models built from configs in code."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckptd

from .helpers import wait_for, weights

pytestmark = pytest.mark.usefixtures("ray_local")


def publish(coord: ckptd.CheckpointCoordinator, step: int) -> None:
    coord.save_state_async("model", weights(step), step, is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(step, is_state_dict=True, timeout_s=60)


# -- 1: a subscriber's root ------------------------------------------------------------------------


def test_a_subscriber_refuses_a_root_that_is_a_file_at_once(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    with pytest.raises(ckptd.CheckpointConfigError, match=r"is a file, not a directory: pass root= the directory"):
        ckptd.WeightSubscriber("nobody-runs-this", root=str(path))


def test_a_subscriber_of_a_root_not_created_yet_waits_and_says_so_at_the_timeout(make_monitor, tmp_path):
    """Started before the trainer, on a root the trainer has not created: a legitimate wait, which
    ends with the first commit; a wait that times out says the root does not exist."""
    root = str(tmp_path / "later" / "ckpt")
    sub = ckptd.WeightSubscriber("nobody-runs-this", root=root, poll_interval_s=0.05)
    with pytest.raises(ckptd.CheckpointTimeoutError, match=r"within 0.2 s; the checkpoint root .* cannot hold any: "
                                                          r"it does not exist\. Check root="):
        sub.wait_for_version(None, timeout_s=0.2)
    with pytest.raises(ckptd.CheckpointError, match="it does not exist"):
        sub.open()
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="trainer")
    publish(coord, 1)
    assert sub.wait_for_version(None, timeout_s=30) == 1
    with pytest.raises(ckptd.CheckpointTimeoutError) as e:  # the root exists now: a plain timeout
        sub.wait_for_version(1, timeout_s=0.2)
    assert "does not exist" not in str(e.value)
    sub.close()
    coord.close()


def test_an_async_wait_on_a_missing_root_says_so_too(tmp_path):
    import asyncio

    sub = ckptd.WeightSubscriber("nobody-runs-this", root=str(tmp_path / "nope"), poll_interval_s=0.05)
    with pytest.raises(ckptd.CheckpointTimeoutError, match="it does not exist"):
        asyncio.run(sub.wait_for_version_async(None, timeout_s=0.2))
    sub.close()


# -- 2: report_serving ---------------------------------------------------------------------------------


def test_report_serving_refuses_a_version_that_was_never_committed(make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    publish(coord, 1)
    for sub in (ckptd.WeightSubscriber(run_name, name="r0"),
                ckptd.WeightSubscriber("nobody-runs-this", root=root, name="plain")):
        with pytest.raises(ckptd.CheckpointConfigError, match=r"state_dict version 99 under .* is not committed "
                                                              r"\(nothing newer than it either\).*\(the newest "
                                                              r"committed is 1\).*Report the version you loaded"):
            sub.report_serving(99)
        with pytest.raises(ckptd.CheckpointConfigError, match="version 0 under .* is not committed now"):
            sub.report_serving(0)
        sub.report_serving(1)  # committed: accepted
        sub.close()
    sub = ckptd.WeightSubscriber(run_name, name="r1")
    with sub.open(1) as w:
        w.state_dict()
    publish(coord, 2)
    publish(coord, 3)  # retention (keep 2) deletes step 1, which sub loaded: still reportable
    wait_for(lambda: not os.path.isdir(ckptd.step_dir(root, 1)), what="retention to delete step 1")
    sub.report_serving(1)
    plain = ckptd.WeightSubscriber(run_name, name="r2")  # neither opened nor reported step 1 here
    with pytest.raises(ckptd.CheckpointConfigError, match="not committed now .*retention deleted it"):
        plain.report_serving(1)
    plain.report_serving(2)  # reported while committed: restated after retention deletes it too
    publish(coord, 4)
    wait_for(lambda: not os.path.isdir(ckptd.step_dir(root, 2)), what="retention to delete step 2")
    plain.report_serving(2)
    plain.close()
    ckpt = ckptd.WeightSubscriber(run_name, name="c", kind="checkpoint")
    with pytest.raises(ckptd.CheckpointConfigError, match=r"checkpoint version 3 under .* is not committed \(noth"):
        ckpt.report_serving(3)  # a state dict only
    ckpt.close()
    sub.close()
    coord.close()


# -- 3: save_hf_model over an older save -------------------------------------------------------------


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers, config, transformers.LlamaForCausalLM(config)


def test_save_hf_model_over_an_older_sharded_save_leaves_only_the_new_save(tmp_path):
    from ckptd.workers import save_hf_model

    transformers, config, model = _tiny_llama()
    out = tmp_path / "hf"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_hf_model(str(out), state, config, max_shard_size=4000)  # many shards
    old = sorted(n for n in os.listdir(out) if n.startswith("model-"))
    assert len(old) > 3
    (out / "pytorch_model.bin").write_bytes(b"not ours")  # not a safetensors shard: kept
    (out / "notes-00001-of-00002.safetensors").write_bytes(b"x")  # not a model shard: kept
    (out / "model-1-of-2.safetensors").write_bytes(b"x")  # not the shard pattern: kept
    written = save_hf_model(str(out), state, config, max_shard_size=20000)  # fewer shards
    new = sorted(n for n in os.listdir(out) if n.startswith("model-") and n != "model-1-of-2.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert new == sorted(set(index["weight_map"].values())) and len(new) < len(old)
    assert {os.path.basename(w.path) for w in written} >= set(new)
    for name in ("pytorch_model.bin", "notes-00001-of-00002.safetensors", "model-1-of-2.safetensors"):
        assert (out / name).exists(), name
    os.remove(out / "pytorch_model.bin")
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    # One file now: the shards and the index of the sharded save go.
    save_hf_model(str(out), state, config)
    assert sorted(n for n in os.listdir(out) if n.startswith("model")) == ["model-1-of-2.safetensors",
                                                                           "model.safetensors"]
    # Sharded again over the single file: from_pretrained would load model.safetensors first.
    changed = {k: v + 1 for k, v in state.items()}
    save_hf_model(str(out), changed, config, max_shard_size=20000)
    assert not (out / "model.safetensors").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out))
    assert all(torch.equal(loaded.state_dict()[k], changed[k]) for k in state)


def test_save_hf_model_in_a_checkpoint_root_leaves_the_committed_state_dicts_files(make_monitor, tmp_path):
    """Inside a checkpoint root, the folder may be a step's directory holding the files of its
    committed state dict (Trinity's save_state_dict, then save_checkpoint of the same step): nothing
    is removed there, or the state dict's manifest would list a file that is gone. Also from a
    thread the save function starts without its context (helper-67)."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptd.workers import save_hf_model

    _, config, model = _tiny_llama()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0")
    coord.register(1, is_state_dict=True, state_dict_thread_count=1)
    coord.save_sync(lambda: save_hf_model(coord.step_dir(1), state, config), 1, is_state_dict=True)
    coord.wait_committed(1, is_state_dict=True, timeout_s=60)
    coord.register(1, checkpoint_thread_count=1)
    with ThreadPoolExecutor(1) as pool:
        coord.save_sync(lambda: pool.submit(save_hf_model, coord.step_dir(1), state, config,
                                            max_shard_size=20000).result(), 1)
    coord.wait_committed(1, timeout_s=60)
    assert os.path.exists(f"{coord.step_dir(1)}/model.safetensors")
    ckptd.verify(root, 1)
    coord.close()


# -- 4: resume's messages ------------------------------------------------------------------------------


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _commit(monitor, step: int, save) -> None:
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    units = save(coord)
    coord.register(step, checkpoint_thread_count=units)
    coord.wait_committed(step, timeout_s=60)
    coord.close()


def test_the_optimizer_name_hint_names_only_states_that_can_be_an_optimizers(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    model, opt = _trained()

    def save(coord):
        coord.save_state_async("model", model.state_dict(), 1)  # weights: a flat state
        coord.save_state_async("optim", opt.state_dict(), 1)
        return 2

    _commit(make_monitor(root), 1, save)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(ckptd.CheckpointConfigError, match=r"pass optimizer_name= with the name it was saved under "
                                                          r"\(\['optim'\]\)") as e:
        ckptd.resume(root, optimizer=fresh)
    assert "'model'" not in str(e.value)
    with pytest.raises(ckptd.CheckpointConfigError, match=r"state 'model' is not this optimizer's state.*; the "
                                                          r"step's states that can be an optimizer's: \['optim'\]$"):
        ckptd.resume(root, optimizer=fresh, optimizer_name="model")
    assert ckptd.resume(root, optimizer=fresh, optimizer_name="optim", restore_rng=False).step == 1


def _sharded_step(make_monitor, root: str, with_a_copy: bool = False) -> torch.nn.Module:
    """Step 1: a trained model and its AdamW saved by sharded_state into actor/ (and with
    ``with_a_copy`` the model's weights in the step directory too, as an HF-style copy); a fresh
    model of the same layout is returned."""
    from ckptd.workers import sharded_state

    model, opt = _trained()

    def save(coord):
        sharded_state(model, opt, rank=0, world_size=1).save(coord, "sharded", 1, f"{coord.step_dir(1)}/actor")
        if with_a_copy:
            coord.save_state_async("model", model.state_dict(), 1)
        return 2 if with_a_copy else 1

    _commit(make_monitor(root), 1, save)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))


def test_an_optimizer_sharded_with_the_weights_without_model_says_to_pass_the_model(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    fresh_model = _sharded_step(make_monitor, root)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.01)
    with pytest.raises(ckptd.CheckpointConfigError, match=r"step 1 holds the optimizer state sharded with the "
                                                          r"weights \(actor/\).*pass model="):
        ckptd.resume(root, optimizer=fresh, restore_rng=False)
    assert not fresh.state
    assert ckptd.resume(root, model=fresh_model, optimizer=fresh, restore_rng=False).step == 1
    assert fresh.state


def test_optimizer_groups_that_differ_only_in_length_name_what_differs(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    fresh_model = _sharded_step(make_monitor, root)
    fewer = torch.optim.AdamW(list(fresh_model.parameters())[:3], lr=0.01)  # the same names, one missing
    with pytest.raises(ckptd.CheckpointConfigError) as e:
        ckptd.resume(root, model=fresh_model, optimizer=fewer, restore_rng=False)
    assert "[]" not in str(e.value) and "'1.bias'" in str(e.value), str(e.value)


# -- 5: export_hf_step with a config that does not fit ------------------------------------------------


def test_an_export_whose_config_does_not_fit_the_weights_is_refused_before_anything_is_written(
        make_monitor, tmp_path):
    from ckptd.workers.export import export_hf_step

    transformers, config, model = _tiny_llama()
    root = str(tmp_path / "ckpt")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def save(coord):
        coord.save_state_async("model", state, 1)
        return 1

    _commit(make_monitor(root), 1, save)
    good = config.to_dict()
    for change, said in (({"hidden_size": 32}, r"'model.embed_tokens.weight' has shape \(64, 16\) in the step, and "
                                               r"\(64, 32\) in the LlamaForCausalLM the config describes; the config "
                                               r"has hidden_size=32"),
                         ({"vocab_size": 100}, r"'model.embed_tokens.weight' has shape \(64, 16\) in the step, and "
                                               r"\(100, 16\)"),
                         ({"num_key_value_heads": 1}, r".*k_proj.weight' has shape \(16, 16\) in the step, "
                                                      r"and \(8, 16\)"),
                         ({"num_hidden_layers": 1}, r"the step has 'model.layers.1.* which the LlamaForCausalLM the "
                                                    r"config describes lacks \(another number of layers"),
                         ({"num_hidden_layers": 3}, r".*describes has 'model.layers.2.* which the step lacks")):
        out = tmp_path / f"hf-{next(iter(change))}-{next(iter(change.values()))}"
        with pytest.raises(ckptd.CheckpointConfigError, match="the config does not fit step 1's weights: " + said):
            export_hf_step(root, 1, str(out), {**good, **change})
        assert not out.exists(), change
    wrong = transformers.LlamaConfig(**{**good, "intermediate_size": 48})  # a config object, as model.config
    with pytest.raises(ckptd.CheckpointConfigError, match=r"mlp.gate_proj.weight' has shape \(32, 16\) in the step"):
        export_hf_step(root, 1, str(tmp_path / "hf-obj"), wrong)
    out = str(tmp_path / "hf")
    export_hf_step(root, 1, out, config)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())


def test_an_optimizer_sharded_in_another_folder_than_the_models_says_which_model_dir(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    fresh_model = _sharded_step(make_monitor, root, with_a_copy=True)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.01)
    with pytest.raises(ckptd.CheckpointConfigError, match=r"sharded with the weights \(actor/\).*pass model_dir= "
                                                          r"that folder \('actor'\)"):
        ckptd.resume(root, model=fresh_model, optimizer=fresh, model_dir="", restore_rng=False)
    assert not fresh.state
    assert ckptd.resume(root, model=fresh_model, optimizer=fresh, model_dir="actor", restore_rng=False).step == 1
    assert fresh.state
