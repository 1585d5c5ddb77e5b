"""What ckptd writes loads with the tools people already use: transformers, peft, safetensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import ckptd
from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError
from ckptd.layout import MANIFESTS
from ckptd.storage import Storage
from ckptd.verify import open_step
from ckptd.workers import (
    export_hf,
    save_hf_model,
    save_lora_adapter,
    save_sharded,
    select_prefix,
    shard_dim0,
    snapshot,
)
from ckptd.workers.weights import read_weights

from .. import tiny

transformers = pytest.importorskip("transformers")


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("max_shard_size", ["1GB", "20KB"])
def test_hf_model_and_tokenizer_load_with_from_pretrained(make_monitor, tmp_path, max_shard_size):
    """Written inside a save unit, committed by the monitor, loaded by transformers offline."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    model, tok = tiny.llama(), tiny.tokenizer()
    sd = snapshot(model.state_dict())
    out = coord.step_dir(7)
    gen = {"bos_token_id": 1, "eos_token_id": [2, 1], "max_new_tokens": 8}  # two EOS ids, as OLMo has
    coord.save_async("hf", lambda: save_hf_model(out, sd, model.config, generation_config=gen, tokenizer=tok,
                                                 max_shard_size=max_shard_size), 7)
    coord.register(7, checkpoint_thread_count=1)
    coord.wait_committed(7, timeout_s=60)
    coord.close()

    names = set(os.listdir(out))
    if max_shard_size == "1GB":
        assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    else:
        shards = sorted(n for n in names if n.startswith("model-"))
        assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.load(open(f"{out}/model.safetensors.index.json"))
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
        assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(shards)
    manifest = json.load(open(f"{out}/{MANIFESTS[Kind.CHECKPOINT]}"))
    assert {f["path"] for f in manifest["files"]} == names - {MANIFESTS[Kind.CHECKPOINT]}

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    _assert_same_weights(model, loaded)
    loaded_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded_tok("w1 w7 w60")["input_ids"] == tok("w1 w7 w60")["input_ids"] == [4, 10, 63]
    assert loaded_tok.eos_token == "</s>"
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [2, 1]
    assert ckptd.verify(root).step == 7


def test_hf_writer_refuses_bad_input_before_writing(tmp_path):
    sd = {"w": torch.zeros(2)}
    cases = [
        (dict(config={"hidden_size": 4}), "model_type"),
        (dict(config={"model_type": "llama"}, max_shard_size="5 parsecs"), "max_shard_size"),
        (dict(config={"model_type": "llama"}, tokenizer=str(tmp_path / "nope")), "tokenizer"),
        (dict(config={"model_type": "llama"}, prefix="policy"), "top-level names are \\['w'\\]"),
    ]
    for kwargs, match in cases:
        with pytest.raises(CheckpointConfigError, match=match):
            save_hf_model(str(tmp_path / "out"), sd, **kwargs)
    with pytest.raises(CheckpointConfigError, match="not a tensor"):
        save_hf_model(str(tmp_path / "out"), {"w": [1.0]}, {"model_type": "llama"})
    assert not (tmp_path / "out").exists()


def test_safetensors_written_by_ckptd_match_the_library(tmp_path):
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16), "i64": torch.arange(7), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "strided": torch.randn(4, 6).t(),
    }
    save_hf_model(str(tmp_path), tensors, {"model_type": "llama"})
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, t in tensors.items():
            assert torch.equal(f.get_tensor(k), t), k


def test_attribute_filtering_saves_one_submodule(tmp_path):
    class PPO(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = tiny.llama(seed=1)
            self.value_head = torch.nn.Linear(32, 1)

    ppo = PPO()
    save_hf_model(str(tmp_path), snapshot(ppo.state_dict()), ppo.policy.config, prefix="policy")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == set(ppo.policy.state_dict())  # prefix stripped, value head left out
    _assert_same_weights(ppo.policy, transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)))
    assert select_prefix({"policy.a": 1, "policyx.b": 2}, "policy.") == {"a": 1}


def test_lora_adapter_round_trip_with_peft(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny.llama(seed=0), config)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()  # lora_B moves off zero, so a lost adapter would show

    written = save_lora_adapter(str(tmp_path), snapshot(model.state_dict()), model.peft_config["default"])
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in keys)  # adapters only
    assert sum(w.size for w in written) < 20_000  # the base model is ~100 KB

    reloaded = peft.PeftModel.from_pretrained(tiny.llama(seed=0), str(tmp_path))
    _assert_same_weights(model, reloaded)
    assert torch.equal(model(input_ids=x).logits, reloaded(input_ids=x).logits)
    with pytest.raises(CheckpointConfigError, match="no LoRA weights"):
        save_lora_adapter(str(tmp_path / "x"), tiny.llama().state_dict(), config)


def test_sharded_state_reassembles_on_any_world_size_and_exports_to_hf(make_monitor, tmp_path):
    """Four ranks each write a shard and rank 0 the metadata, as units of one committed step;
    the reader assembles the full tensors, reshards them for 3 ranks, and exports HF format."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    model = tiny.llama(seed=3)
    full = snapshot(model.state_dict())
    coords = [ckptd.CheckpointCoordinator(monitor, worker_id=f"rank{r}") for r in range(4)]
    out = f"{coords[0].step_dir(2)}/actor"
    for r, coord in enumerate(coords):
        shards = shard_dim0(full, r, 4)
        coord.save_async("shard", lambda shards=shards, r=r: save_sharded(out, shards, rank=r, world_size=4), 2)
    coords[0].register(2, checkpoint_thread_count=4)
    coords[0].wait_committed(2, timeout_s=60)
    for coord in coords:
        coord.close()
    assert sorted(os.listdir(out)) == [f"shard-0000{r}.safetensors" for r in range(4)] + ["sharded_metadata.json"]

    ckptd.verify(root)
    storage = Storage(root)
    assembled = read_weights(storage, open_step(storage, 2, None), "actor").state_dict()
    assert assembled.keys() == full.keys() and all(torch.equal(assembled[k], full[k]) for k in full)
    pieces = [shard_dim0(assembled, r, 3) for r in range(3)]
    for k, t in full.items():
        assert torch.equal(torch.cat([p[k].tensor for p in pieces if k in p]), t.reshape(t.shape) if t.dim() else t)

    export_hf(out, str(tmp_path / "hf"), model.config, max_shard_size="30KB")
    _assert_same_weights(model, transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")))
