"""CheckpointCoordinator(writer="process"): staged snapshots written by a separate process from
shared-memory buffers; what it writes, where it runs, what it refuses, and a writer that dies."""

from __future__ import annotations

import logging
import os
import re
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.coordinator.writer_process import in_mode, write_flat
from ckptd.direct_io import ALIGN
from ckptd.storage import Storage
from ckptd.workers.files import write_torch

from .helpers import kill_gated_writer, wait_all, wait_for


def write_with_pid(out: str, gate: str | None, snapshot: dict) -> list:
    """Writes the snapshot and the writing process's pid; with ``gate``, waits for that file first."""
    if gate is not None:
        with open(f"{gate}.waiting", "w") as f:
            f.write(str(os.getpid()))
        wait_for(lambda: os.path.exists(gate), timeout_s=60, what="the gate")
    storage = Storage(out)
    storage.makedirs(storage.root)
    with open(os.path.join(out, "pid.txt"), "w") as f:
        f.write(str(os.getpid()))
    return [write_torch(storage, storage.join("optim.pt"), snapshot), os.path.join(out, "pid.txt")]


def test_the_writer_process_writes_the_fenced_snapshot_not_the_changed_tensors(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0", writer="process")
    model = {"w": torch.randn(1000), "b": torch.arange(10)}
    optim = {"state": {0: {"exp_avg": torch.randn(50)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    expected = []
    for step in (1, 2):
        expected.append({k: v.clone() for k, v in model.items()})
        out = coord.step_dir(step)
        coord.save_state_async("model", model, step, fenced=True)
        coord.save_state_async("optim", optim, step, partial(write_with_pid, out, None), fenced=True)
        coord.register(step, checkpoint_thread_count=2)
        coord.before_update()
        model["w"].add_(1.0)  # the optimizer step: the snapshot must not see it
        optim["state"][0]["exp_avg"].mul_(2)
    assert wait_all(coord) is None
    for step, want in zip((1, 2), expected, strict=True):
        coord.wait_committed(step, timeout_s=60)  # steps commit independently, in either order
        got = load_file(os.path.join(root, f"global_step_{step}", "model.safetensors"))
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
        ckptd.verify(root, step)
    with open(os.path.join(root, "global_step_2", "pid.txt")) as f:
        writer_pid = int(f.read())
    assert writer_pid != os.getpid() and writer_pid == coord._writer.pid
    coord.close()
    assert coord._writer.pid is None  # closed with the coordinator


def test_a_write_fn_a_writer_process_cannot_run_is_refused_before_anything_is_written(make_monitor, tmp_path):
    coord = ckptd.CheckpointCoordinator(make_monitor(str(tmp_path / "ckpt")), worker_id="w0", writer="process")
    with pytest.raises(ckptd.CheckpointConfigError, match="module-level function"):
        coord.save_state_async("optim", {"t": torch.ones(2)}, 1, lambda sd: [])
    assert coord._writer.pid is None  # nothing started
    with pytest.raises(ckptd.CheckpointConfigError, match="writer must be one of"):
        ckptd.CheckpointCoordinator(make_monitor(str(tmp_path / "ckpt")), writer="fork")
    coord.close()


def test_a_writer_process_killed_mid_write_fails_that_save_and_the_next_gets_a_new_one(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0", writer="process")
    gate = str(tmp_path / "gate")
    coord.register(1, checkpoint_thread_count=1)
    coord.save_state_async("optim", {"t": torch.ones(4)}, 1, partial(write_with_pid, coord.step_dir(1), gate))
    kill_gated_writer(gate)
    error = wait_all(coord)
    assert error is not None and "writer process of w0 died" in error and "exit code -9" in error
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)  # the step failed, never committed

    open(gate, "w").close()
    coord.register(2, checkpoint_thread_count=1)
    coord.save_state_async("optim", {"t": torch.ones(4)}, 2, partial(write_with_pid, coord.step_dir(2), gate))
    assert wait_all(coord) is None
    coord.wait_committed(2, timeout_s=60)
    assert ckptd.latest_step(root) == 2
    coord.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_large_fenced_save_with_direct_io_is_the_snapshot_and_commits(make_monitor, tmp_path, caplog, writer):
    """A 40 MiB state written with O_DIRECT (direct_io="on" reaches each coordinator and its
    writer process): the file holds the fenced snapshot, not the tensors changed after it, and
    it verifies against its manifest."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root, direct_io="on"), worker_id="w0", writer=writer)
    assert coord._storage.direct_io == "on"
    state = {"w": torch.randn(10 << 20), "odd": torch.arange(1001, dtype=torch.int16)}
    want = {k: v.clone() for k, v in state.items()}
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        coord.save_state_async("model", state, 1, fenced=True)
        coord.register(1, checkpoint_thread_count=1)
        coord.before_update()
        state["w"].add_(1.0)
        assert wait_all(coord) is None
        coord.wait_committed(1, timeout_s=60)
    got = load_file(os.path.join(root, "global_step_1", "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    ckptd.verify(root, 1)
    if writer == "thread":  # the process writer logs in its own process
        # Written from the staged image of the file: nothing but the last partial block copied.
        m = re.search(r"model\.safetensors: (\d+) bytes written with O_DIRECT, (\d+) of them through bounce",
                      caplog.text)
        assert m and int(m[1]) > 40 << 20 and int(m[2]) == int(m[1]) % ALIGN
    coord.close()


def test_a_writer_process_job_opens_storage_in_the_units_direct_io_mode(tmp_path, caplog):
    """What the writer process runs (``in_mode``): the Storage that write_flat opens there takes
    the mode the coordinator passed along."""
    state = {"w": torch.randn(9 << 20)}
    for mode in ("on", "off"):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
            [written] = in_mode(mode, None, write_flat, str(tmp_path), None, f"{tmp_path}/{mode}.safetensors",
                                state, {})
        assert written.size > 36 << 20
        assert ("with O_DIRECT" in caplog.text) == (mode == "on")
