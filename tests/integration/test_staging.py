"""Staging: a save of live tensors is a snapshot, buffers are reused, memory is bounded."""

from __future__ import annotations

import copy
import logging
import os
import re
import threading

import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.workers.safetensors_io import plan_safetensors

pytestmark = pytest.mark.usefixtures("ray_local")


def _coord(make_monitor, tmp_path, **kwargs):
    root = str(tmp_path / "ckpt")
    return root, ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0", **kwargs)


@pytest.mark.parametrize("fenced", [False, True])
def test_the_checkpoint_holds_the_state_as_it_was_at_the_call(make_monitor, tmp_path, fenced):
    """The write is held until training has changed the tensors in place: only a real copy
    made before the change gives back the old values."""
    root, coord = _coord(make_monitor, tmp_path)
    weights = {"w": torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256), "step": torch.tensor(1)}
    expected = {k: v.clone() for k, v in weights.items()}
    mutated = threading.Event()
    out = coord.step_dir(1)

    def write(snapshot):
        mutated.wait()
        from ckptd.workers import save_hf_model

        return save_hf_model(out, snapshot, {"model_type": "llama"})

    coord.save_state_async("model", weights, 1, write, fenced=fenced)
    if fenced:
        coord.before_update()
    with torch.no_grad():
        weights["w"].mul_(-1)  # the optimizer step
        weights["step"] += 1
    mutated.set()
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=60)
    saved = load_file(f"{out}/model.safetensors")
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    coord.close()


def test_default_writer_and_buffers_reused_across_saves(make_monitor, tmp_path):
    root, coord = _coord(make_monitor, tmp_path)
    sd = {"a": torch.zeros(128, 64), "b": torch.ones(7, dtype=torch.int64)}
    size = plan_safetensors(sd, {"format": "pt"}).size  # the header and the tensors' bytes
    assert size > 128 * 64 * 4 + 7 * 8
    for step in range(1, 6):
        sd["a"].fill_(step)
        coord.save_state_async("model", sd, step)
        coord.register(step, checkpoint_thread_count=1)
        coord.wait_all()
        assert coord.staged_bytes() == size  # one set, allocated once: the file's image
    for step in range(1, 6):
        coord.wait_committed(step, timeout_s=60)
    for step in (4, 5):  # the rest were removed by retention
        saved = load_file(f"{root}/global_step_{step}/model.safetensors")["a"]
        assert torch.equal(saved, torch.full((128, 64), float(step)))
    pointers = []

    def record(snapshot):
        pointers.append(snapshot["a"].data_ptr())
        return []

    for step in (6, 7, 8):
        coord.save_state_async("model", sd, step, record)
    coord.wait_all()
    assert len(set(pointers)) == 1  # the same host buffer every time: nothing allocated
    coord.close()


def test_back_pressure_bounds_snapshots_in_flight(make_monitor, tmp_path):
    root, coord = _coord(make_monitor, tmp_path, max_staged=1)
    sd = {"a": torch.zeros(1024)}
    gate = threading.Event()
    coord.save_state_async("model", sd, 1, lambda s: gate.wait() and [])
    second_returned = threading.Event()

    def second():
        coord.save_state_async("model", sd, 2, lambda s: [])
        second_returned.set()

    t = threading.Thread(target=second)
    t.start()
    # Bounded check that it is still blocked; the release below is what lets it through.
    assert not second_returned.wait(0.5)
    assert coord.staged_bytes() == 4096  # no second copy was allocated meanwhile
    gate.set()
    assert second_returned.wait(30)
    t.join()
    coord.wait_all()
    coord.close()


def test_nested_state_keeps_its_structure_and_plain_values(make_monitor, tmp_path):
    root, coord = _coord(make_monitor, tmp_path)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    got = {}

    def keep(snapshot):
        got["s"] = snapshot
        return []

    coord.save_state_async("optim", opt.state_dict(), 1, keep, fenced=True)
    coord.before_update()
    opt.step()  # changes exp_avg in place
    coord.wait_all()
    snap = got["s"]
    assert snap["param_groups"][0]["lr"] == 0.1 and snap["param_groups"][0]["betas"] == (0.9, 0.999)
    assert not torch.equal(snap["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    coord.close()


def test_bad_input_is_refused_before_anything_starts(make_monitor, tmp_path):
    root, coord = _coord(make_monitor, tmp_path)
    with pytest.raises(ckptd.CheckpointConfigError, match="holds no tensors, so nothing is staged for its write_fn"):
        coord.save_state_async("model", {"lr": 0.1}, 1, write_fn=lambda sd: [])
    with pytest.raises(ckptd.CheckpointConfigError, match=r"state\['x'\] is a object"):
        coord.save_state_async("model", {"lr": 0.1, "x": object()}, 1)  # no tensors: refused the same way
    with pytest.raises(ckptd.CheckpointConfigError, match=r"state\['meta'\]\['x'\] is a object"):
        coord.save_state_async("model", {"w": torch.ones(2), "meta": {"x": object()}}, 1)
    with pytest.raises(ckptd.CheckpointConfigError, match="global_step"):
        coord.save_state_async("model", {"w": torch.ones(2)}, -1)
    with pytest.raises(ckptd.CheckpointConfigError, match="max_staged"):
        ckptd.CheckpointCoordinator(make_monitor(root), max_staged=0)
    assert coord.staged_bytes() == 0
    coord.close()


def test_a_state_without_tensors_is_saved_and_resumed_by_the_default_writer(make_monitor, tmp_path):
    """An optimizer before its first step, and SGD without momentum, hold no tensors: the default
    writer saves their plain values as they were at the call (a tensors file holding none, and
    the structure), load_state gives them back and resume restores them."""
    root, coord = _coord(make_monitor, tmp_path)
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    adam = torch.optim.AdamW(model.parameters(), lr=0.01).state_dict()  # never stepped: no state
    coord.save_state_async("sgd", sgd, 1, fenced=True)
    coord.before_update()
    coord.save_state_async("adam", adam, 1)
    want = copy.deepcopy(sgd)
    sgd["param_groups"][0]["lr"] = 0.5  # after the call: not in the checkpoint
    coord.register(1, checkpoint_thread_count=2)
    coord.wait_committed(1, timeout_s=60)
    assert sorted(os.listdir(f"{root}/global_step_1")) == [
        "adam.safetensors", "adam.state.json", "ckptd_manifest.json", "sgd.safetensors", "sgd.state.json"]
    assert ckptd.load_state(root, "sgd") == want and ckptd.load_state(root, "adam") == adam
    fresh = torch.optim.SGD(model.parameters(), lr=0.9)
    assert ckptd.resume(root, optimizer=fresh, optimizer_name="sgd").step == 1
    assert fresh.param_groups[0]["lr"] == 0.1
    coord.close()


def test_a_fenced_save_streams_its_write_behind_the_copy(make_monitor, tmp_path):
    """With fenced staging and the default writer, the file receives the staged chunks while
    the copy is still running, and still holds the state as it was at the call."""
    from ckptd import failpoints

    root, coord = _coord(make_monitor, tmp_path)
    sd = {"w": torch.randn(4 * (16 << 20) // 4)}  # four chunks of the staging copy
    expected = sd["w"].clone()
    copied = threading.Event()
    failpoints.arm("staging_chunk", "delay:0.5")  # the copy takes >= 1.5 s after its first chunk
    try:
        coord.save_state_async("model", sd, 1, fenced=True)

        def fence():
            coord.before_update()
            copied.set()

        threading.Thread(target=fence, daemon=True).start()
        step_dir = coord.step_dir(1)
        streamed_before_copied = False
        while not copied.is_set():
            sizes = [e.stat().st_size for e in os.scandir(step_dir)] if os.path.isdir(step_dir) else []
            if any(size >= 16 << 20 for size in sizes):
                streamed_before_copied = not copied.is_set()
                break
            copied.wait(0.01)  # poll the file while the copy runs
        assert streamed_before_copied, "the write waited for the whole copy instead of streaming"
        assert copied.wait(30)
    finally:
        failpoints.disarm()
    with torch.no_grad():
        sd["w"].mul_(-1)  # the optimizer step, after the fence
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=60)
    assert torch.equal(load_file(f"{coord.step_dir(1)}/model.safetensors")["w"], expected)
    coord.close()


def test_a_streamed_write_that_fails_keeps_its_buffers_until_the_copy_ends(make_monitor, tmp_path):
    """The write fails at once while the fenced copy still runs: the next save of the name must
    not get those buffers until the copy stops writing into them, or its snapshot is torn."""
    from ckptd import failpoints

    root, coord = _coord(make_monitor, tmp_path, max_staged=1)
    zeros = {"w": torch.zeros(4 * (16 << 20) // 4)}
    ones = {"w": torch.ones(4 * (16 << 20) // 4)}
    os.makedirs(root, exist_ok=True)
    with open(coord.step_dir(1), "w") as f:  # a file where step 1's directory must go
        f.write("in the way")
    gate = threading.Event()
    seen = {}

    def check(snapshot):
        gate.wait()
        seen["all ones"] = bool(torch.equal(snapshot["w"], ones["w"]))
        return []

    failpoints.arm("staging_chunk", "delay:1.0")  # the copy sleeps 1 s after each chunk
    try:
        coord.save_state_async("model", zeros, 1, fenced=True)
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_all()  # the write failed while the copy sleeps after its first chunk
    finally:
        failpoints.disarm()  # the next copy runs at full speed, well inside that sleep
    second = threading.Thread(target=coord.save_state_async, args=("model", ones, 2, check))
    second.start()
    coord.before_update()  # the first copy has ended
    gate.set()
    second.join(30)
    coord.wait_all()
    assert seen == {"all ones": True}
    coord.close()


@pytest.mark.parametrize("writer, fenced", [("thread", True), ("thread", False), ("process", True)])
def test_an_optimizer_state_saved_by_the_default_writer_loads_back_into_the_optimizer(
        make_monitor, tmp_path, caplog, writer, fenced):
    """An optimizer's state dict (int keys, tuples, plain values) with no write_fn: its tensors go
    to one safetensors file written from the staged image and its structure to JSON; load_state
    gives back the state as it was at the call. ckptd.resume, given the save's name, restores a
    fresh model and optimizer from the two saves, and they step on exactly as the originals would
    have."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root, direct_io="on"), worker_id="w0", writer=writer)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.Linear(4096, 1024))  # 24 MiB of moments
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step(model, opt):
        opt.zero_grad()
        model(torch.ones(8, 512)).square().mean().backward()
        opt.step()

    step(model, opt)
    want = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        coord.save_state_async("model", model.state_dict(), 1, fenced=fenced)
        coord.save_state_async("optim", opt.state_dict(), 1, fenced=fenced)
        coord.before_update()
        step(model, opt)  # changes the weights and moments in place after the fence
        coord.register(1, checkpoint_thread_count=2)
        coord.wait_committed(1, timeout_s=120)
    assert sorted(os.listdir(f"{root}/global_step_1")) == [
        "ckptd_manifest.json", "model.safetensors", "optim.safetensors", "optim.state.json"]
    got = ckptd.load_state(root, "optim")
    assert got["param_groups"] == want["param_groups"] and list(got["state"]) == list(want["state"])
    for i, per in want["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in per.items())
    if writer == "thread":  # written from the staged image: no bounce copy but the last block's
        m = re.search(r"optim\.safetensors: (\d+) bytes written with O_DIRECT, (\d+) of them", caplog.text)
        assert m and int(m[2]) == int(m[1]) % 4096
    # A fresh model and optimizer resume exactly where the checkpoint left them.
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.Linear(4096, 1024))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    state = ckptd.resume(root, model=fresh, optimizer=fresh_opt, optimizer_name="optim", restore_rng=False)
    assert state.step == 1
    step(fresh, fresh_opt)
    again = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.Linear(4096, 1024))
    again.load_state_dict(weights)
    ref = torch.optim.AdamW(again.parameters(), lr=0.01)
    ref.load_state_dict(want)
    step(again, ref)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), again.parameters(), strict=True))
    coord.close()


def test_load_state_refuses_a_missing_name_and_a_changed_structure(make_monitor, tmp_path):
    root, coord = _coord(make_monitor, tmp_path)
    coord.save_state_async("optim", {"state": {0: {"m": torch.ones(3)}}, "lr": 0.5}, 1)
    coord.save_state_async("model", {"w": torch.ones(2)}, 1)
    coord.register(1, checkpoint_thread_count=2)
    coord.wait_committed(1, timeout_s=60)
    assert torch.equal(ckptd.load_state(root, "model", 1)["w"], torch.ones(2))  # a flat state: its tensors
    with pytest.raises(ckptd.CheckpointConfigError, match=r"no state saved as 'optimizer'.*\['model', 'optim'\]"):
        ckptd.load_state(root, "optimizer")
    path = f"{root}/global_step_1/optim.state.json"
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text.replace("0.5", "0.7"))  # same size: only the checksum tells
    # resume: a wrong name, or none, is refused before the optimizer changes, naming the states.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ckptd.CheckpointConfigError, match=r"no state saved as 'optimizer'.*\['model', 'optim'\]"):
        ckptd.resume(root, optimizer=opt, optimizer_name="optimizer")
    with pytest.raises(ckptd.CheckpointConfigError, match=r"pass optimizer_name= .*\['optim'\]"):
        ckptd.resume(root, optimizer=opt)
    with pytest.raises(ckptd.CheckpointConfigError, match="together with optimizer="):
        ckptd.resume(root, optimizer_name="optim")
    assert opt.state_dict() == before
    with pytest.raises(ckptd.CorruptCheckpointError, match="optim.state.json"):
        ckptd.load_state(root, "optim")
    with pytest.raises(ckptd.CorruptCheckpointError, match="optim.state.json"):
        ckptd.resume(root, optimizer=opt, optimizer_name="optim")
    assert opt.state_dict() == before
    coord.close()
