"""Session 26b: attacks on retention's claim before each deletion (1781cc9).

Two breaks, both fixed, each test failing while its break stands: a withdrawal that began and
ended between a pass's scan and its claims made it delete a state dict the policy keeps
(``RetentionRunner._may_delete`` now checks the steps the plan counted among the newest); a
unit's "started" report that reached the monitor after a deletion of its step had removed its
receipt (here: retried into a monitor restarted mid-deletion) ran with no receipt (``_admit``
writes it again for every unit of a step older than the newest commit). The third test (a pass
of 199 deletions does not stall a commit) held.

Real local Ray, real monitors (failpoints armed, and probes run, in the monitor's process only
through ``__ray_call__``), real coordinators and files under ``tmp_path``; nothing mocked.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import ray

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    held_at,
    in_thread,
    ledger_states,
    restart_monitor,
    status,
    step_dirs,
    two_state_dicts,
    unit_receipt,
    wait_all,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")



def _committed_state_dicts(root: str) -> list[int]:
    return sorted(s for s in step_dirs(root)
                  if os.path.exists(os.path.join(ckptd.step_dir(root, s), MANIFESTS[Kind.STATE_DICT])))


def _withdrawing(monitor) -> set[int]:
    return ray.get(monitor.__ray_call__.remote(lambda self: self._ledger.withdrawing_steps()))


def test_a_withdrawal_that_ends_between_the_scan_and_the_claim_does_not_cost_an_older_state_dict(
        make_monitor, tmp_path):
    """State dicts 2 and 3 are committed (2 kept); step 1 is an idle leftover (a directory with
    no manifest, older than the grace period). Step 4 saves a full checkpoint: its state dict
    commits while its checkpoint unit is held; that commit runs a pass, which reads what is in
    flight (nothing withdrawn), scans (manifest 4 there: state dicts 3 and 4 are the 2 newest)
    and plans to delete leftover 1 and state dict 2. It claims leftover 1 first and is held
    there. The checkpoint unit then replaces weights.bin and fails: the monitor withdraws state
    dict 4, to the end (manifest gone, tracker back at 3, ``withdrawing`` cleared again). The
    pass goes on and claims step 2: it must keep it (state dict 4, which the plan counted among
    the 2 newest, failed), else the committed state dicts left are 3 only, though the policy
    keeps 2 and state dict 2 was committed."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root, max_state_dict_to_keep=2, max_ckpt_to_keep=None, leftover_grace_s=5.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    commit_one(coord, 3, "weights.bin", is_state_dict=True)
    assert ray.get(monitor.wait_retention.remote(30))
    # An idle leftover older than the newest commit: deleted first by the next pass.
    left = ckptd.step_dir(root, 1)
    write_file(f"{left}/partial.bin", b"x" * 64)
    old = time.time() - 3600
    os.utime(f"{left}/partial.bin", (old, old))
    os.utime(left, (old, old))

    d = coord.step_dir(4)
    coord.register(4, is_state_dict=True, state_dict_thread_count=1)
    coord.register(4, checkpoint_thread_count=1)
    admitted, go = threading.Event(), threading.Event()

    def replace_then_fail():
        admitted.set()
        assert go.wait(60)
        path = f"{d}/weights.bin"
        write_file(path, os.urandom(os.path.getsize(path)))
        raise OSError("disk full after replacing weights.bin")

    coord.save_async("optim", replace_then_fail, 4)
    assert admitted.wait(30)
    arm_in_monitor(monitor, "after_delete_claim", f"until:60:{gate}")
    try:
        coord.save_async("weights", lambda: write_file(f"{d}/weights.bin", os.urandom(4096)), 4, is_state_dict=True)
        coord.wait_committed(4, is_state_dict=True, timeout_s=30)
        wait_for(lambda: held_at(monitor, "after_delete_claim"), what="the pass to claim leftover 1")
        go.set()
        wait_for(lambda: ckptd.latest_step(root, "state_dict") == 3 and not _withdrawing(monitor),
                 what="state dict 4 to be withdrawn, to the end")
    finally:
        open(gate, "w").close()
    in_thread(lambda: wait_all(coord), timeout_s=30)
    assert ray.get(monitor.wait_retention.remote(30))
    deleted = status(monitor).retention.deleted_steps
    committed_sd = _committed_state_dicts(root)
    assert 2 not in deleted and committed_sd == [2, 3], (
        f"retention deleted state dict 2, planned while state dict 4 still counted, after 4 was withdrawn: "
        f"committed state dicts left {committed_sd}, deleted {deleted}")
    assert_trackers_verified(root)
    coord.close()


def test_a_unit_that_waited_for_a_deletion_the_monitor_died_in_keeps_its_receipt(make_monitor, tmp_path):
    """The pass claims step 1 and is held before the step's ledger records go. A unit of step 1
    writes its "started" receipt and asks to be admitted: it waits for the deletion. The pass
    goes on: the step's records go (the unit's receipt with them), and the monitor dies right
    before the directory is renamed away (failpoint ``before_step_delete`` = crash). Ray
    restarts it and retries the unit's "started" there: the new monitor holds no claim, so
    ``_admit`` does not know the unit waited for a deletion. The unit must have its receipt
    all the same, else a monitor restarted again does not know it runs (invariant 5). (Before
    the fix this failed 5 runs in 6: it passed when the retried report landed while the
    restarted monitor's first pass held its own claim of step 1.)"""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor, coord = two_state_dicts(make_monitor, root)
    attempt = ray.get(monitor.ping.remote())["attempt"]
    first = ray.get(monitor.ping.remote())["started_at"]
    writing, may_finish = threading.Event(), threading.Event()
    d = coord.step_dir(1)

    def optim() -> list[str]:
        writing.set()
        assert may_finish.wait(60)
        return write_file(f"{d}/optim.bin", os.urandom(512))

    arm_in_monitor(monitor, "after_delete_claim", f"until:60:{gate}")
    try:
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "after_delete_claim"), what="the pass to claim step 1")
        coord.save_async("optim", optim, 1)
        wait_for(lambda: unit_receipt(root, attempt, 1, "w") is not None, what="the unit's receipt")
        assert not writing.wait(0.5)
        arm_in_monitor(monitor, "before_step_delete", "crash")
    finally:
        open(gate, "w").close()
    try:
        wait_for(lambda: ray.get(monitor.ping.remote())["started_at"] != first, timeout_s=60,
                 what="the monitor to restart")
        assert writing.wait(60), "the unit was never admitted by the restarted monitor"
        receipt = unit_receipt(root, attempt, 1, "w")
        known = ledger_states(monitor, 1)
        known_after = known
        if receipt is None:
            restart_monitor(monitor)  # what a second restart knows of the running unit
            known_after = ledger_states(monitor, 1)
        assert receipt is not None and receipt["status"] == "started", (
            f"the unit of step 1 runs (admitted by the restarted monitor after waiting for step 1's "
            f"deletion), with no receipt: {receipt}; the monitor knew {known}, one restarted again knows "
            f"{known_after}")
    finally:
        may_finish.set()
    in_thread(lambda: wait_all(coord), timeout_s=30)
    coord.close()


def test_a_pass_deleting_200_old_state_dicts_after_a_new_job_starts_is_quick_and_commits_go_on(
        make_monitor, tmp_path, run_name):
    """(Throughput.) 200 committed state dicts (copies of one, under real step directories) and
    a new job's monitor that keeps 2: its first pass claims and deletes 199 steps, one event-loop
    round trip each. It must finish in reasonable time, and a commit of a new step made while it
    runs must not wait for it."""
    root = str(tmp_path / "ckpt")
    old = make_monitor(root, run=f"{run_name}-old", max_state_dict_to_keep=None, max_ckpt_to_keep=None)
    coord = ckptd.CheckpointCoordinator(old, worker_id="w")
    commit_one(coord, 1000, "weights.bin", is_state_dict=True)
    coord.close()
    ray.kill(old, no_restart=True)
    src = ckptd.step_dir(root, 1000)
    for s in range(1, 200):
        shutil.copytree(src, ckptd.step_dir(root, s))
    assert len(_committed_state_dicts(root)) == 200
    monitor = make_monitor(root, run=f"{run_name}-new", max_state_dict_to_keep=2, max_ckpt_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    t1 = time.monotonic()
    commit_one(coord, 1001, "weights.bin", is_state_dict=True)
    commit_s = time.monotonic() - t1
    assert ray.get(monitor.wait_retention.remote(60))
    left = _committed_state_dicts(root)
    assert left == [1000, 1001], left
    # A loose bound against a stall, not a speed target: a commit does not wait for the pass.
    assert commit_s < 15, f"a commit made while the pass deleted 198 steps took {commit_s:.2f} s"
    assert_trackers_verified(root)
    coord.close()
