"""The tracker repair that a monitor restarted under a fence does once the fence lifts (its
start-up could not write): it reads the root again, trackers and steps, checks what the
trackers may name as a start-up does, and no retention pass deletes the step it falls back to.
Found by helpers' attacks (sessions 43 and 44)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import ray

import ckptd
from ckptd.layout import MANIFESTS, TRACKERS
from ckptd.monitor.attempts import open_attempt
from ckptd.monitor.fence_watch import FENCE_CHECK_S
from ckptd.storage import Storage

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    held_at,
    read_manifest,
    replace_same_size,
    restart_monitor,
    tracker_of,
    wait_for,
    write_file,
)
from .test_fenced_idle_monitor import DEADLINE_S, _looks_held, _take_back

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
LIFT_S = 3 * FENCE_CHECK_S + 5


def _fenced_restart(monitor, storage: Storage, tmp_path):
    """Restart the monitor while a losing ``start_monitor``'s attempt is on the root: it starts
    fenced, by a fence a look may lift, and leaves its trackers to the repair after the lift.
    Returns what lifts it, in two parts: one takes the attempt back (the monitor may publish
    again), the other lets the held looks go (one of them then lifts the fence)."""
    loser = open_attempt(storage, "a-racing-job", None)
    restart_monitor(monitor, how="sigkill")
    release_looks = _looks_held(monitor, tmp_path)
    assert "superseded" in ray.get(monitor.status.remote()).fenced

    return lambda: _take_back(storage, loser.attempt), release_looks


def _repair_done(monitor) -> bool:
    """The tracker repair that a lifted fence starts has run (none is due or running)."""
    return ray.get(monitor.__ray_call__.remote(lambda self: not self._trackers_unrepaired and not any(
        t.get_coro().__name__ == "_repair_trackers_after_lift" for t in self._tasks)))


def _held_after_its_manifest(monitor, coord, step: int, gate) -> str:
    """Save checkpoint ``step`` (one file) and hold its commit right after its manifest is
    published, its tracker not yet moved, until ``gate`` exists. Returns the file's path."""
    arm_in_monitor(monitor, "after_publish", f"until:{DEADLINE_S:g}:{gate}")
    coord.register(step, checkpoint_thread_count=1)
    path = f"{coord.step_dir(step)}/model.bin"
    coord.save_async("model", lambda: write_file(path, os.urandom(64)), step)
    wait_for(lambda: held_at(monitor, "after_publish"), DEADLINE_S, f"step {step} held after its manifest")
    return path


def test_the_repair_after_a_lift_checks_the_step_it_names_while_a_newer_commit_is_in_flight(make_monitor, tmp_path):
    """Steps 1 and 2 are committed; step 3's monitor dies between its manifest and its tracker, a
    losing ``start_monitor``'s attempt is on the root, so the restarted monitor is fenced and leaves
    the trackers to be repaired after the lift. Step 3's file is then changed outside ckptd, and
    step 4's commit (its unit admitted before the restart) has published its manifest and is held
    when the fence lifts. The repair must not move the trackers to step 3: it checked step 4, the
    newest manifest on storage, but chose among the steps it trusts, of which step 4 (in flight)
    is not one, so step 3 went unchecked (helper-80)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    for step in (1, 2):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    coord4 = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    coord4.register(4, checkpoint_thread_count=1)
    admitted, go = threading.Event(), threading.Event()

    def save4() -> list[str]:
        admitted.set()
        assert go.wait(DEADLINE_S)
        return write_file(f"{coord.step_dir(4)}/model.bin", os.urandom(64))

    coord4.save_async("model", save4, 4)
    assert admitted.wait(DEADLINE_S)
    path3 = _held_after_its_manifest(monitor, coord, 3, tmp_path / "gate3")
    take_back, release_looks = _fenced_restart(monitor, storage, tmp_path)
    replace_same_size(path3)
    take_back()
    gate4 = tmp_path / "gate4"
    arm_in_monitor(monitor, "after_publish", f"until:{DEADLINE_S:g}:{gate4}")
    try:
        go.set()
        wait_for(lambda: held_at(monitor, "after_publish"), DEADLINE_S, "step 4's manifest published, held")
        assert read_manifest(root, 4, CKPT) is not None
        # Step 4 stays held until gate4 exists; the repair's own tracker writes must not be.
        arm_in_monitor(monitor, "after_publish", None)
        release_looks()
        wait_for(lambda: ray.get(monitor.status.remote()).fenced is None, LIFT_S, "the fence lifted")
        wait_for(lambda: _repair_done(monitor), DEADLINE_S, "the repair after the lift")
        assert held_at(monitor, "after_publish"), "step 4's commit is still in flight"
        assert (tracker_of(root, CKPT), tracker_of(root, SD)) == (2, 2)
        assert_trackers_verified(root)
    finally:
        gate4.touch()
    coord4.wait_committed(4, timeout_s=DEADLINE_S)
    assert tracker_of(root, CKPT) == 4
    assert_trackers_verified(root)
    coord.close()
    coord4.close()


@pytest.mark.parametrize("removed", ["directory", "manifest", "tracker edited"])
def test_the_repair_after_a_lift_reads_the_trackers_and_steps_again(make_monitor, tmp_path, removed):
    """Checkpoints 1 to 3 are committed; the monitor restarts fenced, its ledger built with step
    3 committed. While it is fenced, step 3's directory or manifest is removed, or the tracker is
    edited to name a step that never was. The repair after the lift went by what the start-up had
    read: the trackers stayed on a step no loader finds (helper-81)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    for step in (1, 2, 3):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    take_back, release_looks = _fenced_restart(monitor, storage, tmp_path)
    if removed == "directory":
        shutil.rmtree(coord.step_dir(3))
    elif removed == "manifest":
        os.remove(os.path.join(coord.step_dir(3), MANIFESTS[CKPT]))
    else:
        write_file(os.path.join(root, TRACKERS[CKPT]), b"7\n")
    take_back()
    release_looks()
    wait_for(lambda: ray.get(monitor.status.remote()).fenced is None, LIFT_S, "the fence lifted")
    wait_for(lambda: _repair_done(monitor), DEADLINE_S, "the repair after the lift")
    expected = 3 if removed == "tracker edited" else 2
    assert (tracker_of(root, CKPT), tracker_of(root, SD)) == (expected, expected)
    assert_trackers_verified(root)
    commit_one(coord, 4, "model.bin", is_state_dict=False)  # the monitor's trackers moved with the files
    assert (tracker_of(root, CKPT), tracker_of(root, SD)) == (4, 4)
    coord.close()


def _retention_passes(monitor) -> int:
    return ray.get(monitor.__ray_call__.remote(lambda self: self._retention.passes))


def test_no_retention_pass_deletes_the_step_the_repair_after_a_lift_falls_back_to(make_monitor, tmp_path):
    """Two checkpoints are kept; 1 to 3 are committed (1 deleted), step 4's manifest is published
    when the monitor restarts fenced. Steps 3 and 4 are then changed outside ckptd, so the repair
    after the lift moves the trackers back to step 2, which the retention pass that the same lift
    starts planned to delete (3 and 4 are the newest two). The pass deleted it behind the repair:
    the trackers named a step that no longer existed (helper-81)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_ckpt_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    for step in (1, 2, 3):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    wait_for(lambda: not os.path.exists(coord.step_dir(1)), DEADLINE_S, "step 1 deleted by retention")
    path4 = _held_after_its_manifest(monitor, coord, 4, tmp_path / "gate4")
    take_back, release_looks = _fenced_restart(monitor, storage, tmp_path)
    assert (tracker_of(root, CKPT), tracker_of(root, SD)) == (3, 3)
    replace_same_size(f"{coord.step_dir(3)}/model.bin")
    replace_same_size(path4)
    passes = _retention_passes(monitor)
    plan_gate, repair_gate = tmp_path / "plan.gate", tmp_path / "repair.gate"
    arm_in_monitor(monitor, "after_retention_plan", f"until:{DEADLINE_S:g}:{plan_gate}")
    arm_in_monitor(monitor, "after_publish", f"until:{DEADLINE_S:g}:{repair_gate}")
    try:
        take_back()
        release_looks()
        # The pass has planned step 2's deletion; the repair has written its tracker and is held.
        wait_for(lambda: held_at(monitor, "after_retention_plan") and held_at(monitor, "after_publish"),
                 DEADLINE_S, "the pass and the repair held")
        assert tracker_of(root, CKPT) == 2
        arm_in_monitor(monitor, "after_retention_plan", None)
        plan_gate.touch()
        wait_for(lambda: _retention_passes(monitor) > passes, DEADLINE_S, "the pass over")
        assert held_at(monitor, "after_publish"), "the repair is still under way"
        assert os.path.isdir(coord.step_dir(2))
    finally:
        plan_gate.touch()
        repair_gate.touch()
    wait_for(lambda: _repair_done(monitor), DEADLINE_S, "the repair after the lift")
    assert (tracker_of(root, CKPT), tracker_of(root, SD)) == (2, 2)
    assert_trackers_verified(root)
    coord.close()
