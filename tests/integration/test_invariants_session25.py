"""Session 25: the commit protocol attacked across a fenced old monitor, a crash inside a
withdrawal, and a commit that fails half-way.

Real local Ray (``ray_local`` / ``make_monitor``), real monitors (SIGSTOP, SIGKILL and Ray's
restart; a failpoint armed in the monitor's process only; a real RLIMIT_FSIZE set in the monitor's
process), real coordinators and real files under ``tmp_path``; nothing mocked. Each test fails
while its break stands (each failed 3 runs of 3).

Fixed in session 25: retention and the mirror check the fence before they scan and before each
deletion (break 1); a withdrawal records the state dict's failure before its manifest goes
(break 2; the case now also crashes after that record, ``before_revoke``); a commit that fails
after publishing the state dict's manifest keeps that state dict committed, tells its waiters so,
and fails only the full checkpoint (break 3: the test asserts that outcome).

What broke:

1. I4 (``test_i4_a_fenced_monitor_restarted_by_ray_deletes_nothing_the_new_job_keeps``): job 1's
   monitor is frozen; job 2 takes the root over (``takeover=True``: the frozen monitor misses its
   10 s ping, so it is neither found live nor stopped); job 2 commits the state dict of step 1,
   registers its full checkpoint with a unit still writing, and commits state dicts 2 and 3 (its
   own retention keeps step 1: in flight). Job 1's monitor process dies and Ray restarts it: it
   is fenced (``status().fenced``), yet ``CheckpointMonitor.__init__`` -> ``Startup._resume`` ->
   ``RetentionRunner.release`` runs a pass from job 1's view (its ledger, trackers, policy), and
   ``retention.run_plan`` / ``delete_step`` delete step 1: a committed state dict of job 2, and
   job 2's full checkpoint of step 1 then fails. Retention checks no fence anywhere (only
   publishes do, ``Committer._publish``).
2. I3/I4 (``test_i3_a_state_dict_withdrawn_before_a_crash_is_not_committed_again_with_the_replaced_file``):
   state dict of step 1 committed (weights.bin); a checkpoint unit of step 1 rewrites weights.bin
   and reports it. ``UnitReports._finished`` withdraws the state dict
   (``CommitFlow._revoke_state_dict``: manifest removed, tracker moved back) and fails both kinds,
   and the monitor dies before the failure record (``before_failure_record=crash``). Ray's restart
   (``rebuild``) sees no manifest, no failure record and every unit finished (the rewriting unit's
   finished receipt included) and commits step 1 again: the state-dict manifest now counts the
   state-dict unit but lists none of its files (``Committer._check_reports`` gives weights.bin to
   the unit whose report matches storage, the rewriter), the full checkpoint commits the rewritten
   bytes, and the rewriting unit's ``wait_all`` returns None. Cause: the manifest is removed before
   the failure is durable.
3. I3 (``test_i3_a_full_checkpoint_whose_commit_failed_after_the_state_dict_keeps_that_state_dict_committed``): one
   commit of both kinds of step 1 (Trinity's full checkpoint, units finished before the
   registration) publishes the state-dict manifest, then the checkpoint manifest fails on every
   try (EFBIG past the monitor's file-size limit: a nearly full disk). ``CommitFlow._commit_once``
   fails both kinds (``wait_committed`` raises for both) but leaves the state-dict manifest it
   published: ``ckptd.latest_step(root, "state_dict")`` returns step 1 at once, and after a
   restart ``rebuild`` marks it committed (``StepLedger.fail_kind`` there is not forced, so the
   failure record is ignored), ``_repair_trackers`` points the state-dict tracker at it, and
   ``wait_committed(1, is_state_dict=True)`` says committed.

What held (tried here, or by reading):

* Job 2's own retention keeps a step whose full checkpoint is in flight; the restarted fenced
  monitor knows it is fenced and admits nothing (``_admit``), publishes nothing (``check_fence``).
* The fault in case 3 surfaces: both kinds are reported failed to ``wait_committed`` (I5).
* By reading: a retried "failed" of a unit whose step committed is a no-op (``StepLedger.fail``);
  a registration retried after its step committed and the monitor restarted counts once
  (``registered_before``); admissions and registrations wait for a commit in flight
  (``quiesce``) and no commit begins while a registration is written (``_registering``); the
  tracker only moves forward (``advance_tracker`` re-reads storage).
"""

from __future__ import annotations

import os
import signal

import pytest
import ray

import ckptd
from tests.integration.helpers import (
    Gate,
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    file_size_limit,
    read_manifest,
    restart_monitor,
    status,
    tracker_of,
    wait_all,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

SD, CKPT = ckptd.Kind.STATE_DICT, ckptd.Kind.CHECKPOINT


# -- I4: a fenced monitor of an old job runs retention on the new job's root -------------------------


def test_i4_a_fenced_monitor_restarted_by_ray_deletes_nothing_the_new_job_keeps(make_monitor, tmp_path, run_name):
    """Job 1's monitor is frozen (a stalled node) when job 2 takes the root over; later Ray
    restarts job 1's monitor (its process died). That monitor is fenced (attempt 1 < 2), yet its
    start-up releases a retention pass, which plans from job 1's view of the root and deletes a
    step job 2 keeps: the state dict of step 1, whose full checkpoint job 2 is still saving."""
    root = str(tmp_path / "ckpt")
    m1 = make_monitor(root)
    pid1 = ray.get(m1.ping.remote())["pid"]
    os.kill(pid1, signal.SIGSTOP)
    try:
        # Job 1's monitor does not answer its ping (10 s): job 2 does not find it live.
        m2 = make_monitor(root, run=run_name + "-b", takeover=True)
        coord = ckptd.CheckpointCoordinator(m2, worker_id="job2")
        commit_one(coord, 1, "weights.bin", is_state_dict=True)
        coord.register(1, checkpoint_thread_count=1)
        gate = Gate(root, 1, "optim.bin")
        coord.save_async("optim", gate, 1)  # the full checkpoint of step 1: in flight
        assert gate.entered.wait(30)
        commit_one(coord, 2, "weights.bin", is_state_dict=True)
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
        assert ray.get(m2.wait_retention.remote(30))
        assert read_manifest(root, 1, SD) is not None, "job 2's own retention deleted step 1 (in flight)"
    finally:
        os.kill(pid1, signal.SIGKILL)  # job 1's monitor process dies; Ray restarts it
    wait_for(lambda: ray.get(m1.ping.remote())["pid"] != pid1, what="job 1's monitor to restart")
    assert status(m1).fenced, "job 1's restarted monitor should know it is fenced"
    assert ray.get(m1.wait_retention.remote(30))
    try:
        kept = (read_manifest(root, 1, SD) is not None,
                os.path.exists(os.path.join(ckptd.step_dir(root, 1), "weights.bin")))
    finally:
        gate.open()
    outcome = wait_all(coord)
    try:
        coord.wait_committed(1, timeout_s=60)
        full = "committed"
    except ckptd.CheckpointSaveError as e:
        full = f"failed: {e.cause[:120]}"
    coord.close()
    assert kept == (True, True) and full == "committed", (
        f"job 1's fenced monitor (restarted by Ray) ran a retention pass on job 2's root: step 1's state-dict "
        f"manifest kept: {kept[0]}, weights.bin kept: {kept[1]}; job 2's full checkpoint of step 1 is {full} "
        f"(its unit: {outcome!r})")
    assert_trackers_verified(root)


# -- I3/I4: a withdrawal whose failure record a crash cut short ---------------------------------------


@pytest.mark.parametrize("crash_at", ["before_failure_record", "before_revoke"])
def test_i3_a_state_dict_withdrawn_before_a_crash_is_not_committed_again_with_the_replaced_file(
        make_monitor, tmp_path, crash_at):
    """Step 1's state dict is committed (weights.bin). A checkpoint unit of step 1 rewrites
    weights.bin with other bytes and reports it: the monitor withdraws the state dict (manifest
    removed, tracker pointed back) and fails both kinds of step 1, then dies before the failure
    record is written (``before_failure_record=crash``, armed in that process only), or, with the
    failure now recorded first, after that record and before the manifest is removed
    (``before_revoke``). Ray restarts it: the restarted monitor must not commit step 1 (either
    kind) with the replaced bytes."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    before = read_manifest(root, 1, SD)
    assert [f.path for f in before.files] == ["weights.bin"]
    coord.register(1, checkpoint_thread_count=1)
    pid = ray.get(monitor.ping.remote())["pid"]
    arm_in_monitor(monitor, crash_at, "crash")
    path = f"{coord.step_dir(1)}/weights.bin"
    coord.save_async("optim", lambda: write_file(path, os.urandom(4096)), 1)
    outcome = wait_all(coord)
    wait_for(lambda: ray.get(monitor.ping.remote())["pid"] != pid, what="the monitor to restart")
    try:
        coord.wait_committed(1, timeout_s=20)
        full = "committed"
    except ckptd.CheckpointSaveError as e:
        full = f"failed: {e}"
    after_sd, after_ck = read_manifest(root, 1, SD), read_manifest(root, 1, CKPT)
    assert_trackers_verified(root)
    coord.close()
    assert full.startswith("failed") and after_sd is None and after_ck is None, (
        f"step 1 rewritten by a checkpoint unit after its state dict committed; after the restart its full "
        f"checkpoint is {full}, the unit's wait_all said {outcome!r}, the state dict manifest lists "
        f"{None if after_sd is None else [f.path for f in after_sd.files]} (before: weights.bin), the "
        f"checkpoint manifest {None if after_ck is None else [(f.path, f.crc32) for f in after_ck.files]} "
        f"(committed weights.bin had CRC-32 {before.files[0].crc32})")


# -- I3: a commit that fails after publishing the state dict's manifest -----------------------------


def test_i3_a_full_checkpoint_whose_commit_failed_after_the_state_dict_keeps_that_state_dict_committed(
        make_monitor, tmp_path):
    """Trinity's full checkpoint: a state-dict unit and a checkpoint unit of step 1 finish, then
    the step is registered (both counts, monitored as a checkpoint), so one commit publishes both
    manifests, the state dict's first. The checkpoint manifest (it lists every file of the step,
    so it is the larger) cannot be written: the monitor process may not write files past 200 kB
    (RLIMIT_FSIZE, EFBIG, as a nearly full disk or a quota does), on every retry.

    Before the fix both kinds were reported failed while the state-dict manifest stayed on
    storage: readers took step 1 as committed (``latest_step``), and a restarted monitor committed
    it, its waiters having been told it failed. Now what storage shows is what callers are told,
    before and after a restart: the state dict (published, verified) is committed and its tracker
    names step 1; only the full checkpoint failed."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    d = coord.step_dir(1)
    deep = "/".join(c * 200 for c in "abcdefghi")  # long paths: a large checkpoint manifest

    def optim() -> list[str]:
        return [p for i in range(150) for p in write_file(f"{d}/{deep}/optim{i}.bin", b"o")]

    coord.save_async("optim", optim, 1)
    coord.save_async("model", lambda: write_file(f"{d}/weights.bin", os.urandom(256)), 1, is_state_dict=True)
    assert wait_all(coord) is None
    file_size_limit(monitor, 200_000)
    try:
        coord.register(1, state_dict_thread_count=1, checkpoint_thread_count=1)
        told = {}
        for kind in (SD, CKPT):
            try:
                coord.wait_committed(1, is_state_dict=kind is SD, timeout_s=30)
                told[kind.value] = "committed"
            except ckptd.CheckpointSaveError as e:
                told[kind.value] = f"failed: {e.cause[:90]}"
    finally:
        file_size_limit(monitor, None)
    assert told[CKPT.value].startswith("failed"), told  # the fault took effect
    live = (read_manifest(root, 1, SD) is not None, ckptd.latest_step(root, "state_dict"), tracker_of(root, SD))
    restart_monitor(monitor)
    after = {}
    for kind in (SD, CKPT):
        try:
            coord.wait_committed(1, is_state_dict=kind is SD, timeout_s=10)
            after[kind.value] = "committed"
        except ckptd.CheckpointSaveError:
            after[kind.value] = "failed"
    sd_tracker = tracker_of(root, SD)
    assert_trackers_verified(root)
    coord.close()
    assert told[SD.value] == "committed" and live == (True, 1, 1), (
        f"step 1 was reported {told}; its state-dict manifest on storage: {live[0]}, "
        f"ckptd.latest_step(root, 'state_dict') = {live[1]}, state-dict tracker {live[2]}")
    assert after == {SD.value: "committed", CKPT.value: "failed"} and sd_tracker == 1, (
        f"after a monitor restart wait_committed says {after} and the state-dict tracker names {sd_tracker}")
    assert read_manifest(root, 1, CKPT) is None
