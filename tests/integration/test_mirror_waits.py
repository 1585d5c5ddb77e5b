"""``wait_mirrored`` on a step that nothing will upload: with ``state_dicts`` off the mirror
copies full checkpoints only, so a step that committed a state dict alone is never uploaded. The
wait answered only at its timeout, or never without one (found by helper-54's attack, session
34); it must say so once everything registered for the step has settled, and still wait while a
full checkpoint of the step may commit."""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd
from ckptd.layout import TRACKERS

from .helpers import (
    arm_in_monitor,
    commit_one,
    disk_full,
    held_at,
    in_thread,
    read_manifest,
    restart_monitor,
    save_one,
    status,
    tracker_of,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def _held_write(go: threading.Event, path: str):
    """A save that writes ``path`` once ``go`` is set."""
    def save() -> None:
        assert go.wait(DEADLINE_S), "the test never let the save go"
        write_file(path, os.urandom(64))
    return save


def _waiting_for_the_mirror(coord, step: int) -> tuple[threading.Thread, list]:
    """``wait_mirrored(step)`` without a timeout, in a thread (bounded, so that a wait nothing
    ends fails the test instead of hanging it), given a second to end; its outcome lands in the
    list."""
    outcome: list = []
    waiter = threading.Thread(target=lambda: outcome.append(
        in_thread(lambda: coord.wait_mirrored(step, timeout_s=None), DEADLINE_S)), daemon=True)
    waiter.start()
    waiter.join(1.0)
    return waiter, outcome


def test_a_step_that_committed_only_a_state_dict_is_answered_not_mirrored_once_it_settles(make_monitor, tmp_path):
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror})  # state_dicts off
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.wait_mirrored(1, timeout_s=DEADLINE_S)

    # A wait begun while step 2's state dict is still being saved: it waits, then is answered.
    go = threading.Event()
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    path = f"{coord.step_dir(2)}/weights.bin"
    coord.save_async("weights", _held_write(go, path), 2, is_state_dict=True)
    waiter, early = _waiting_for_the_mirror(coord, 2)
    assert not early, f"the wait on step 2 was answered while its state dict was still being saved: {early}"
    go.set()
    coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    waiter.join(DEADLINE_S)
    assert early and early[0][0] == "raised", early
    error = early[0][1]
    assert isinstance(error, ckptd.CheckpointError) and not isinstance(error, ckptd.CheckpointSaveError)
    assert "state dict only" in str(error) and "state_dicts" in str(error), error
    # A wait begun after it settled is answered at once, without a timeout.
    outcome, error = in_thread(lambda: coord.wait_mirrored(2, timeout_s=None), DEADLINE_S)
    assert outcome == "raised" and "state dict only" in str(error), (outcome, error)
    assert read_manifest(mirror, 2, SD) is None and tracker_of(mirror, CKPT) == 1
    coord.close()


def test_a_full_checkpoint_registered_after_the_state_dict_committed_is_still_waited_for(make_monitor, tmp_path):
    """Registrations add up: step 3's full checkpoint comes after its state dict committed, and
    is still on its way (in this coordinator's batch) when the wait begins."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 3, "weights.bin", is_state_dict=True)
    go = threading.Event()
    coord.register(3, checkpoint_thread_count=1)
    path = f"{coord.step_dir(3)}/optim.bin"
    coord.save_async("optim", _held_write(go, path), 3)
    waiter, result = _waiting_for_the_mirror(coord, 3)
    assert not result, f"the wait on step 3 was answered before its full checkpoint settled: {result}"
    go.set()
    waiter.join(DEADLINE_S)
    assert result == [("ok", None)], result
    assert read_manifest(mirror, 3, CKPT) is not None and tracker_of(mirror, CKPT) == 3
    coord.close()


def test_a_failed_state_dict_is_answered_failed_and_an_unregistered_step_still_waits(make_monitor, tmp_path):
    """A state dict's failure fails its step's full checkpoint too, so the step is answered as
    failed; a step nobody registered yet is waited on, as ``wait_committed`` does."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(4, is_state_dict=True, state_dict_thread_count=1)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(disk_full, 4, is_state_dict=True)
    outcome, error = in_thread(lambda: coord.wait_mirrored(4, timeout_s=None), DEADLINE_S)
    assert outcome == "raised" and "step 4 failed" in str(error) and "disk full" in str(error), (outcome, error)
    with pytest.raises(TimeoutError):  # a registration for step 9 may still come
        coord.wait_mirrored(9, timeout_s=0.5)
    coord.close()


def test_a_wait_begun_before_a_restarted_mirror_could_be_read_ends_once_it_is(make_monitor, tmp_path):
    """Step 1 is on the mirror; the monitor restarts while the mirror's tracker cannot be read,
    so the restarted mirror is still reading the mirror's state when the wait on step 1 begins.
    Only an upload of step 1 woke that wait, and step 1 is never uploaded again: it waited until
    its timeout, or forever. Found by helper-55's attack."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror, "retry_backoff_s": 0.2})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.wait_mirrored(1, timeout_s=DEADLINE_S)
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    tracker = os.path.join(mirror, TRACKERS[CKPT])
    os.rename(tracker, f"{tracker}.away")
    os.mkdir(tracker)  # the mirror's tracker cannot be read
    try:
        restart_monitor(monitor)
        wait_for(lambda: status(monitor).mirror.start_error, what="the restarted mirror failing to read the mirror")
        # Known locally, settled, a state dict only: answered without the mirror.
        outcome, error = in_thread(lambda: coord.wait_mirrored(2, timeout_s=None), DEADLINE_S)
        assert outcome == "raised" and "state dict only" in str(error), (outcome, error)
        waiter, result = _waiting_for_the_mirror(coord, 1)
        assert not result, f"the wait on step 1 was answered before the mirror could be read: {result}"
    finally:
        os.rmdir(tracker)
        os.rename(f"{tracker}.away", tracker)
    waiter.join(DEADLINE_S)
    assert result == [("ok", None)], result
    assert status(monitor).mirror.start_error is None
    coord.close()


def test_a_full_checkpoint_registration_held_behind_the_state_dicts_commit_is_waited_for(make_monitor, tmp_path):
    """Another worker's registration of step 2's full checkpoint reached the monitor while step
    2's state dict was committing, and waits there for that commit to end: the wait on the
    step's mirror, woken by the state dict's commit, must count it. It answered "state dict
    only", and the step was then mirrored. Found by helper-56's attack."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror})
    a = ckptd.CheckpointCoordinator(monitor, worker_id="a")
    b = ckptd.CheckpointCoordinator(monitor, worker_id="b")
    commit_one(a, 1, "model.bin", is_state_dict=False)
    a.wait_mirrored(1, timeout_s=DEADLINE_S)
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_manifest", f"until:{DEADLINE_S:g}:{gate}")
    try:
        save_one(a, 2, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "before_manifest"), what="step 2's state dict commit held")
        waiter, result = _waiting_for_the_mirror(a, 2)
        assert not result, f"the wait on step 2 was answered while its state dict was committing: {result}"
        registered: list = []
        registration = threading.Thread(target=lambda: registered.append(
            in_thread(lambda: b.register(2, checkpoint_thread_count=1), DEADLINE_S)), daemon=True)
        registration.start()
        wait_for(lambda: ray.get(monitor.__ray_call__.remote(lambda self: 2 in self._arriving)),
                 what="b's registration of step 2 in the monitor, behind the commit")
        assert not registered, registered
        arm_in_monitor(monitor, "before_manifest", None)
    finally:
        open(gate, "w").close()
    registration.join(DEADLINE_S)
    assert registered == [("ok", None)], registered
    path = f"{b.step_dir(2)}/optim.bin"
    b.save_async("optim", lambda: write_file(path, os.urandom(64)), 2)
    b.wait_committed(2, timeout_s=DEADLINE_S)
    waiter.join(DEADLINE_S)
    assert result == [("ok", None)], f"the wait said {result}, and step 2 was mirrored"
    assert read_manifest(mirror, 2, CKPT) is not None
    a.close()
    b.close()


def test_a_step_the_restarted_mirror_leaves_to_its_retention_is_answered_not_mirrored(make_monitor, tmp_path):
    """Step 1's upload failed and waits for its retry; steps 3 and 4 went up. A restarted monitor
    does not upload step 1, since the mirror, which keeps two steps, would delete it at once: the
    wait on step 1 waited for an upload that never came. Found by helper-56 (by reading)."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror, "max_ckpt_to_keep": 2, "retries": 0,
                                         "retry_after_s": 600})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    arm_in_monitor(monitor, "after_mirror_file", "raise")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    wait_for(lambda: any(s.step == 1 and s.error for s in status(monitor).mirror.steps),
             what="step 1's upload failing")
    arm_in_monitor(monitor, "after_mirror_file", None)
    for step in (3, 4):
        commit_one(coord, step, "model.bin", is_state_dict=False)
        coord.wait_mirrored(step, timeout_s=DEADLINE_S)
    restart_monitor(monitor)
    outcome, error = in_thread(lambda: coord.wait_mirrored(1, timeout_s=None), DEADLINE_S)
    assert outcome == "raised" and isinstance(error, ckptd.CheckpointError), (outcome, error)
    assert "retention" in str(error) and "local root only" in str(error), error
    assert read_manifest(mirror, 1, CKPT) is None and read_manifest(root, 1, CKPT) is not None
    coord.wait_mirrored(3, timeout_s=DEADLINE_S)  # the mirror's own steps still answer
    coord.close()
