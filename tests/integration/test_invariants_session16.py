"""Session 16: the fence that copies staging chunks itself (``StagedCopy.help``) and the writer
process that keeps the buffer sets it was sent, attacked with a real local Ray, real files,
monitor restarts and new jobs.

Invariants: (1) trackers name only steps that verify and whose files hold the state at the save
call; (2) a step reported failed never commits, also after a monitor restart or in a new job;
(3) registrations add up, and a full checkpoint waits for its step's state-dict units.
"""

from __future__ import annotations

import os
import threading
import time
from functools import partial

import pytest
import ray
import torch
from safetensors.torch import load_file

import ckptd
import ckptd.coordinator.staged_copy as staged_copy_mod
from ckptd.errors import FailpointError

from .helpers import (
    assert_trackers_verified,
    kill_gated_writer,
    read_manifest,
    restart_monitor,
    wait_all,
    write_step_file,
)
from .test_writer_process import write_with_pid

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
BIG = 5 << 20  # float32 elements: 20 MiB, two 16 MiB chunks


def big_state(seed: int, n: int = BIG) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g), "c": torch.randn(n, generator=g)}


def clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def model_file(root: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(ckptd.step_dir(root, step), "model.safetensors"))


def assert_holds(root: str, step: int, want: dict) -> None:
    got = model_file(root, step)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].shape == v.shape and torch.equal(got[k], v), f"step {step} {k}"


def patch_chunks(monkeypatch, fail_on: str, slow_other: float = 0.15):
    """Make the ``staging_chunk`` point raise on one side only: ``fail_on="fence"`` raises on the
    thread that called before_update (the main thread), ``"staging"`` on the staging thread (after
    the fence has begun helping). The other side sleeps ``slow_other`` per chunk, so both copy."""
    real = staged_copy_mod.failpoints.hit
    main = threading.main_thread()
    state = {"armed": True, "fired": []}

    def hit(name: str) -> None:
        if name != "staging_chunk" or not state["armed"]:
            return real(name)
        on_main = threading.current_thread() is main
        failing = on_main if fail_on == "fence" else not on_main
        if failing:
            if fail_on == "staging":
                time.sleep(slow_other)  # let the fence claim chunks from the back first
            state["fired"].append(threading.current_thread().name)
            raise FailpointError("failpoint 'staging_chunk' fired")
        time.sleep(slow_other)

    monkeypatch.setattr(staged_copy_mod.failpoints, "hit", hit)
    return state


@pytest.mark.parametrize("writer", ["thread", "process"])
@pytest.mark.parametrize("fail_on", ["fence", "staging"])
def test_a_fenced_copy_failing_on_either_side_fails_the_step_for_good(make_monitor, tmp_path, run_name,
                                                                      monkeypatch, writer, fail_on):
    """A fenced staged save whose copy fails on the fence's thread (or on the staging thread while
    the fence helps): the save and the step fail, nothing is committed, also after a monitor
    restart and in a new job; the next step (different shapes) commits the state at its call."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", writer=writer)
    state = big_state(1)
    fp = patch_chunks(monkeypatch, fail_on)
    coord.register(1, checkpoint_thread_count=1)
    coord.save_state_async("model", state, 1, fenced=True)
    coord.before_update()  # a copy error is not raised here
    for v in state.values():
        v.add_(1.0)
    fp["armed"] = False
    assert fp["fired"], "the copy never failed"
    if fail_on == "fence":
        assert threading.main_thread().name in fp["fired"]
    error = wait_all(coord)
    assert error is not None and "staging" in error, error
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    assert assert_trackers_verified(root) == {CKPT: None, SD: None}

    # The next save: shapes changed, the same name; the fence helps again and the copy is good.
    state2 = big_state(2, n=BIG + 12345)
    want2 = clone(state2)
    coord.register(2, checkpoint_thread_count=1)
    coord.save_state_async("model", state2, 2, fenced=True)
    coord.before_update()
    for v in state2.values():
        v.mul_(-3.0)
    assert wait_all(coord) is None
    coord.wait_committed(2, timeout_s=60)
    assert_holds(root, 2, want2)
    # And the first shapes again (its buffer set may be re-used, or re-sent to the writer).
    state3 = big_state(3)
    want3 = clone(state3)
    coord.register(3, checkpoint_thread_count=1)
    coord.save_state_async("model", state3, 3, fenced=True)
    coord.before_update()
    for v in state3.values():
        v.zero_()
    assert wait_all(coord) is None
    coord.wait_committed(3, timeout_s=60)
    assert_holds(root, 3, want3)
    assert assert_trackers_verified(root) == {CKPT: 3, SD: 3}

    restart_monitor(monitor, how="sigkill")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    assert read_manifest(root, 1, CKPT) is None and read_manifest(root, 1, SD) is None
    coord.close()
    ray.kill(monitor, no_restart=True)

    job = make_monitor(root, run=f"{run_name}-b", max_state_dict_to_keep=None)
    new = ckptd.CheckpointCoordinator(job, worker_id="w1")
    assert assert_trackers_verified(root) == {CKPT: 3, SD: 3}
    assert ckptd.latest_step(root) == 3
    with pytest.raises(ckptd.CheckpointError):
        ckptd.verify(root, 1)
    assert_holds(root, 3, want3)
    new.close()


def test_a_killed_writer_then_a_monitor_restart_then_a_new_job_never_commit_the_killed_step(
        make_monitor, tmp_path, run_name):
    """writer="process": step 1's write is SIGKILLed mid-write (its buffer set was sent to the
    dead writer); the monitor restarts; step 2 with the same name and shapes (the same buffer set,
    re-sent to the new writer) and step 3 with new shapes commit exactly their states; step 1 stays
    failed across another restart and a new job."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", writer="process")
    gate = str(tmp_path / "gate")
    model = {"w": torch.randn(1000), "b": torch.arange(10)}
    # Step 0 first: the buffer set of "model" reaches the first writer before it dies.
    want0 = clone(model)
    coord.register(0, checkpoint_thread_count=1)
    coord.save_state_async("model", model, 0, fenced=True)
    coord.before_update()
    model["w"].add_(1.0)
    assert wait_all(coord) is None
    coord.wait_committed(0, timeout_s=60)
    assert_holds(root, 0, want0)
    first_writer = coord._writer.pid

    coord.register(1, checkpoint_thread_count=2)
    coord.save_state_async("model", model, 1, fenced=True)
    coord.save_state_async("optim", {"t": torch.ones(4)}, 1, partial(write_with_pid, coord.step_dir(1), gate),
                           fenced=True)
    coord.before_update()
    model["w"].add_(1.0)
    assert kill_gated_writer(gate) == first_writer
    error = wait_all(coord)
    assert error is not None and "died" in error, error
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    restart_monitor(monitor, how="sigkill")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)

    open(gate, "w").close()
    wants = {}
    for step, shape in ((2, None), (3, 777), (4, None)):
        if shape is not None:
            model = {"w": torch.randn(shape), "b": torch.arange(10) * step, "extra": torch.ones(3, 3)}
        wants[step] = clone(model)
        coord.register(step, checkpoint_thread_count=2)
        coord.save_state_async("model", model, step, fenced=True)
        coord.save_state_async("optim", {"t": torch.full((4,), float(step))}, step,
                               partial(write_with_pid, coord.step_dir(step), None), fenced=True)
        coord.before_update()
        for v in model.values():
            v.add_(100)
    assert wait_all(coord) is None
    for step, want in wants.items():
        coord.wait_committed(step, timeout_s=60)
        assert_holds(root, step, want)
        ckptd.verify(root, step)
    assert coord._writer.pid not in (None, first_writer)
    assert assert_trackers_verified(root) == {CKPT: 4, SD: 4}
    restart_monitor(monitor, how="ray.kill")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    coord.close()
    ray.kill(monitor, no_restart=True)

    job = make_monitor(root, run=f"{run_name}-b", max_state_dict_to_keep=None)
    new = ckptd.CheckpointCoordinator(job, worker_id="w1", writer="process")
    with pytest.raises(ckptd.CheckpointError):
        ckptd.verify(root, 1)
    model5 = {"w": torch.randn(50)}
    want5 = clone(model5)
    new.register(5, checkpoint_thread_count=1)
    new.save_state_async("model", model5, 5, fenced=True)
    new.before_update()
    model5["w"].zero_()
    assert wait_all(new) is None
    new.wait_committed(5, timeout_s=60)
    assert_holds(root, 5, want5)
    with pytest.raises(ckptd.CheckpointError):
        ckptd.verify(root, 1)
    assert assert_trackers_verified(root) == {CKPT: 5, SD: 5}
    new.close()


def test_a_failing_write_fn_in_the_writer_process_fails_its_step_across_restarts(make_monitor, tmp_path):
    """A write_fn that raises in the writer process: the step fails (its state dict too, when the
    unit counts toward it) and never commits after a restart; the writer survives and the next
    step commits its state."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", writer="process")
    coord.register(1, checkpoint_thread_count=1)
    # A write_fn that raises there: write_with_pid into a path under a regular file.
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    coord.save_state_async("optim", {"t": torch.ones(4)}, 1, partial(write_with_pid, str(blocker / "sub"), None),
                           fenced=True)
    coord.before_update()
    error = wait_all(coord)
    assert error is not None, "the write should have failed"
    pid = coord._writer.pid
    restart_monitor(monitor, how="sigkill")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    model = {"w": torch.randn(64)}
    want = clone(model)
    coord.register(2, checkpoint_thread_count=1)
    coord.save_state_async("model", model, 2, fenced=True)
    coord.before_update()
    model["w"].zero_()
    assert wait_all(coord) is None
    coord.wait_committed(2, timeout_s=60)
    assert_holds(root, 2, want)
    assert coord._writer.pid == pid  # a failing job does not cost the writer
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    assert assert_trackers_verified(root) == {CKPT: 2, SD: 2}
    coord.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_full_checkpoint_waits_for_its_fenced_state_dict_and_registrations_add_up(make_monitor, tmp_path,
                                                                                    writer):
    """Trinity: two checkpoint registrations of one step add up (two units); a full checkpoint with
    a state-dict count waits for the state-dict unit (a fenced staged save whose copy the fence
    helps), and both commit the state at the call."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", writer=writer)
    coord.register(7, checkpoint_thread_count=1)
    coord.register(7, checkpoint_thread_count=1)
    coord.register(7, state_dict_thread_count=1)
    coord.save_async("optim", lambda: write_step_file(root, 7, "optim.bin"), 7)
    coord.save_async("extra", lambda: write_step_file(root, 7, "extra.bin"), 7)
    coord.wait_all()
    with pytest.raises(TimeoutError):  # the state-dict unit has not run
        coord.wait_committed(7, timeout_s=0.5)
    state = big_state(7)
    want = clone(state)
    coord.save_state_async("model", state, 7, is_state_dict=True, fenced=True)
    coord.before_update()
    for v in state.values():
        v.neg_()
    assert wait_all(coord) is None
    coord.wait_committed(7, is_state_dict=True, timeout_s=60)
    coord.wait_committed(7, timeout_s=60)
    assert_holds(root, 7, want)
    ckptd.verify(root, 7)
    assert assert_trackers_verified(root) == {CKPT: 7, SD: 7}
    coord.close()


def test_a_full_checkpoint_whose_fenced_state_dict_copy_fails_on_the_fence_never_commits(
        make_monitor, tmp_path, monkeypatch):
    """The state-dict unit of a full checkpoint fails in the fence's own copy: the checkpoint
    units all succeed, yet neither kind of the step commits, also after a restart."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(8, state_dict_thread_count=1, checkpoint_thread_count=1)
    coord.save_async("optim", lambda: write_step_file(root, 8, "optim.bin"), 8)
    assert wait_all(coord) is None
    fp = patch_chunks(monkeypatch, "fence")
    coord.save_state_async("model", big_state(8), 8, is_state_dict=True, fenced=True)
    coord.before_update()
    fp["armed"] = False
    assert fp["fired"]
    assert wait_all(coord) is not None
    for is_sd in (True, False):
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(8, is_state_dict=is_sd, timeout_s=30)
    restart_monitor(monitor, how="sigkill")
    for is_sd in (True, False):
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(8, is_state_dict=is_sd, timeout_s=30)
    assert assert_trackers_verified(root) == {CKPT: None, SD: None}
    coord.close()
