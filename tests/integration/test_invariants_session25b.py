"""Session 25b: the three fixes of 54ccbd6 attacked (fenced retention and mirror, a withdrawal
that records its failure first, a commit that fails after publishing the state dict).

Real local Ray (``ray_local`` / ``make_monitor``), real monitors (SIGSTOP, SIGKILL and Ray's
restart; failpoints armed in the monitor's process only; RLIMIT_FSIZE set in the monitor's
process), real coordinators and files under ``tmp_path``; nothing mocked. Each test fails while
its break stands (each break failed 3 runs of 3).

Both breaks below are fixed: ``delete_step`` checks the fence after its failpoint, right before
the rename (break 1, root and mirror); a commit that fails after publishing the state dict marks
the full checkpoint's failure pending before the ledger is pruned (break 2).

What broke:

1. I3 (``test_i3_a_monitor_fenced_during_its_retention_pass_deletes_nothing_the_new_job_committed``):
   job 1 commits state dicts 1-3 (keeps 2); its retention pass plans to delete step 1, runs
   ``check_fence`` (job 1 still owns the root), removes step 1's ledger records and is held at
   ``before_step_delete`` (slow storage, a paused process). Job 1's monitor is frozen, job 2 takes
   the root over (max_state_dict_to_keep=None) and finds step 1 committed. Job 1's monitor goes on
   and renames step 1 into the trash: job 2's ``wait_committed(1, state dict)`` says committed, no
   manifest, no file. Cause: ``retention.run_plan`` calls ``fence()`` before ``before_delete`` and
   ``delete_step`` (whose failpoint, and the record I/O, sit between the check and the rename);
   ``Committer._publish`` checks at the last moment instead (after its failpoint).
   Same cause on the mirror (``test_i3_a_mirror_fenced_during_its_retention_pass_deletes_nothing_the_new_job_keeps``):
   ``Mirror._retention_pass`` -> ``run_plan`` deletes step 1 from the mirror job 2 keeps.
2. I2 (``test_i2_a_state_dict_withdrawn_after_a_half_failed_commit_is_not_reported_committed[1]``,
   ``status_history=1``): state dict 2 committed; step 1's commit of both kinds publishes the state
   dict, the checkpoint manifest fails (EFBIG); ``CommitFlow._committed`` (fix c) wakes the state
   dict's waiters ("committed") and calls ``StepLedger.prune`` while the checkpoint's forced failure
   is not yet in ``_failure_writes`` (``_pending_failures`` runs only after ``_commit``'s finally):
   step 1's record is pruned (step 2 newer and settled) to ``_retired`` (state dict COMMITTED).
   weights.bin is then replaced; recording the checkpoint's failure checks it and withdraws the
   state dict (failure recorded, manifest removed) on the detached record, so the ledger keeps
   COMMITTED: ``wait_committed(1, state dict)`` says committed with no manifest on storage, and
   "failed" after a restart. With the default status_history (``[100]``) it holds.

What held:

* A crash right after a half-failed commit, before the checkpoint's failure record
  (``before_failure_record=crash``): the restart keeps the state dict committed; the checkpoint's
  answer matches its manifest and does not change over a second restart.
* A new job after a half-failed commit: job 2's clean-up removes only the checkpoint's files; the
  state dict stays committed, verifies, and the tracker names it.
* A half-failed commit whose state dict is then replaced, the monitor crashing inside the
  withdrawal (``before_revoke=crash``, after the new failure record): the restart withdraws it,
  both kinds failed, no manifest, answers stable across another restart (default status_history).
  Until its start-up check has withdrawn it again, the restarted monitor still answers
  "committed" for that state dict (its manifest is still there): the documented withdrawal window.
* A takeover between the state-dict manifest and the checkpoint manifest of one commit
  (``after_publish`` held): job 1 says state dict committed / checkpoint failed (fenced), job 2
  finds the state dict committed, no checkpoint manifest, trackers verified.
* By reading: registrations and unit retries of a half-failed step are answered with the
  checkpoint's failure (``registration_is_moot``, ``StepLedger.admit``), and wait for the commit
  (``quiesce``) until ``_pending_failures`` has run; a Ray restart of a fenced monitor deletes
  nothing (the fence is checked before ``_pass`` scans).
"""

from __future__ import annotations

import os
import signal

import pytest
import ray

import ckptd
from tests.integration.helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    file_size_limit,
    ledger_records,
    read_manifest,
    restart_monitor,
    tracker_of,
    wait_all,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

SD, CKPT = ckptd.Kind.STATE_DICT, ckptd.Kind.CHECKPOINT


def told(coord, step: int, kind: ckptd.Kind, timeout_s: float = 20) -> str:
    """What wait_committed tells a caller: committed, failed: ..., unknown: ... or timeout."""
    try:
        coord.wait_committed(step, is_state_dict=kind is SD, timeout_s=timeout_s)
        return "committed"
    except ckptd.CheckpointSaveError as e:
        return f"failed: {e.cause[:100]}"
    except TimeoutError:
        return "timeout"
    except ckptd.CheckpointError as e:
        return f"unknown: {str(e)[:100]}"


# -- I3/I4: a takeover while an old monitor's retention pass is past its fence check ---------------


def test_i3_a_monitor_fenced_during_its_retention_pass_deletes_nothing_the_new_job_committed(
        make_monitor, tmp_path, run_name):
    """Job 1 (max_state_dict_to_keep=2) commits state dicts 1, 2 and 3; its retention pass plans
    to delete step 1, checks the fence (job 1 still owns the root), removes step 1's ledger records
    (``before_delete``) and is held right before the rename (``before_step_delete``: a slow disk,
    a paused process). Job 2 takes the root over (job 1's monitor frozen, so not found live); its
    monitor starts with steps 1 to 3 committed, and keeps them all (max_state_dict_to_keep=None). Job 1's
    monitor then goes on: it must delete nothing, being fenced."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    m1 = make_monitor(root)  # keeps the 2 newest state dicts
    c1 = ckptd.CheckpointCoordinator(m1, worker_id="job1")
    commit_one(c1, 1, "weights.bin", is_state_dict=True)
    commit_one(c1, 2, "weights.bin", is_state_dict=True)
    assert ledger_records(root, 1), "step 1 should have ledger records until retention deletes it"
    arm_in_monitor(m1, "before_step_delete", f"until:30:{gate}")
    commit_one(c1, 3, "weights.bin", is_state_dict=True)
    # before_delete removed step 1's records: the pass is past its fence check for step 1.
    wait_for(lambda: not ledger_records(root, 1), what="job 1's retention to reach step 1's deletion")
    pid1 = ray.get(m1.ping.remote())["pid"]
    os.kill(pid1, signal.SIGSTOP)
    try:
        m2 = make_monitor(root, run=run_name + "-b", takeover=True, max_state_dict_to_keep=None)
        c2 = ckptd.CheckpointCoordinator(m2, worker_id="job2")
        before = told(c2, 1, SD), read_manifest(root, 1, SD) is not None
    finally:
        open(gate, "w").close()
        os.kill(pid1, signal.SIGCONT)
    assert before == ("committed", True), before  # job 2 found step 1 committed
    assert ray.get(m1.wait_retention.remote(30))
    after = (told(c2, 1, SD), read_manifest(root, 1, SD) is not None,
             os.path.exists(os.path.join(ckptd.step_dir(root, 1), "weights.bin")))
    c1.close()
    c2.close()
    assert after == ("committed", True, True), (
        f"job 1's monitor, fenced by job 2 while its retention pass was held between its fence check and "
        f"the deletion, deleted step 1 which job 2 had found committed and keeps: job 2's wait_committed says "
        f"{after[0]!r}, manifest present {after[1]}, weights.bin present {after[2]}")
    assert_trackers_verified(root)


# -- I2: a commit that fails after publishing the state dict's manifest (fix c) ---------------------


def _stage_both_kinds(coord, step: int) -> str:
    """A checkpoint unit (150 files under long paths: a checkpoint manifest past 200 kB) and a
    state-dict unit (weights.bin) of ``step`` finish before any registration; weights.bin's path."""
    d = coord.step_dir(step)
    deep = "/".join(c * 200 for c in "abcdefghi")

    def optim() -> list[str]:
        return [p for i in range(150) for p in write_file(f"{d}/{deep}/optim{i}.bin", b"o")]

    coord.save_async("optim", optim, step)
    coord.save_async("model", lambda: write_file(f"{d}/weights.bin", os.urandom(256)), step, is_state_dict=True)
    assert wait_all(coord) is None
    return f"{d}/weights.bin"


@pytest.mark.parametrize("status_history", [100, 1])
def test_i2_a_state_dict_withdrawn_after_a_half_failed_commit_is_not_reported_committed(
        make_monitor, tmp_path, status_history):
    """State dict 2 is committed. Step 1's full checkpoint (Trinity's: both kinds in one commit)
    publishes its state-dict manifest, then fails (EFBIG on the larger checkpoint manifest): the
    state dict stays committed and its waiters are told so (fix c). While the checkpoint's
    failure is being recorded (held at ``before_failure_record``) weights.bin is replaced; the
    check that follows withdraws the state dict (manifest removed, failure recorded). From then
    on wait_committed(1, state dict) must say failed, as storage does (no manifest) and as a
    restarted monitor does. With ``status_history=1`` the step's record was pruned by
    ``_committed`` (step 2 is newer and settled; the checkpoint's failure not yet pending)."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root, status_history=status_history)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    weights = _stage_both_kinds(coord, 1)
    arm_in_monitor(monitor, "before_failure_record", f"until:30:{gate}")
    file_size_limit(monitor, 200_000)
    try:
        coord.register(1, state_dict_thread_count=1, checkpoint_thread_count=1)
        first = told(coord, 1, SD, 30)  # told before the checkpoint's failure is recorded
        write_file(weights, os.urandom(256))  # replaced after the state dict committed
    finally:
        file_size_limit(monitor, None)
        open(gate, "w").close()
    assert first == "committed", first
    full = told(coord, 1, CKPT, 30)  # reported once recorded and the state dict checked
    assert full.startswith("failed"), full
    live = told(coord, 1, SD, 5), read_manifest(root, 1, SD) is not None
    restart_monitor(monitor)
    after = told(coord, 1, SD, 10)
    assert_trackers_verified(root)
    coord.close()
    assert live == (after, False) and after.startswith("failed"), (
        f"step 1's state dict was withdrawn (weights.bin replaced; its manifest present: {live[1]}), yet the "
        f"live monitor's wait_committed says {live[0]!r}; after a restart it says {after!r}")


def _half_failed_commit(monitor, coord, step: int) -> dict[str, str]:
    """Register ``step`` (both kinds, units finished) under a 200 kB file-size limit: the
    state-dict manifest is published, the checkpoint manifest fails on every try. What each kind
    was told."""
    file_size_limit(monitor, 200_000)
    try:
        coord.register(step, state_dict_thread_count=1, checkpoint_thread_count=1)
        return {k.value: told(coord, step, k, 30) for k in (SD, CKPT)}
    finally:
        file_size_limit(monitor, None)


def test_i2_a_crash_before_the_failed_checkpoint_is_recorded_keeps_the_state_dict_committed(make_monitor, tmp_path):
    """Step 1's commit publishes the state dict, its checkpoint manifest fails (EFBIG); the state
    dict's waiters are told committed; the monitor dies before the checkpoint's failure record
    (``before_failure_record=crash``, in the monitor only). Ray's restart (no file-size limit any
    more) may commit the full checkpoint (nobody was told it failed), but the state dict must stay
    committed, and each kind's answer must agree with its manifest and never change."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    _stage_both_kinds(coord, 1)
    pid = ray.get(monitor.ping.remote())["pid"]
    arm_in_monitor(monitor, "before_failure_record", "crash")
    file_size_limit(monitor, 200_000)
    coord.register(1, state_dict_thread_count=1, checkpoint_thread_count=1)
    first_sd = told(coord, 1, SD, 30)
    wait_for(lambda: ray.get(monitor.ping.remote())["pid"] != pid, what="the monitor to restart")
    answers = {k.value: told(coord, 1, k, 30) for k in (SD, CKPT)}
    manifests = {k.value: read_manifest(root, 1, k) is not None for k in (SD, CKPT)}
    restart_monitor(monitor)
    again = {k.value: told(coord, 1, k, 10) for k in (SD, CKPT)}
    assert_trackers_verified(root)
    coord.close()
    assert first_sd == "committed" and answers[SD.value] == "committed" and again == answers, (
        first_sd, answers, again)
    assert {k: a == "committed" for k, a in answers.items()} == manifests, (answers, manifests)


def test_i2_a_new_job_after_a_half_failed_commit_keeps_the_committed_state_dict(make_monitor, tmp_path, run_name):
    """Job 1's commit of step 1 publishes the state dict and fails the checkpoint (EFBIG): state
    dict committed, checkpoint failed, both recorded. Job 1 ends; job 2 starts on the root (its
    clean-up removes what job 1 left uncommitted: the checkpoint's files). The state dict must stay
    committed and verify (job 2 says so, the tracker names it), no checkpoint manifest appears."""
    root = str(tmp_path / "ckpt")
    m1 = make_monitor(root)
    c1 = ckptd.CheckpointCoordinator(m1, worker_id="job1")
    _stage_both_kinds(c1, 1)
    first = _half_failed_commit(m1, c1, 1)
    assert first[SD.value] == "committed" and first[CKPT.value].startswith("failed"), first
    c1.close()
    ray.kill(m1, no_restart=True)
    m2 = make_monitor(root, run=run_name + "-b")
    c2 = ckptd.CheckpointCoordinator(m2, worker_id="job2")
    sd2 = told(c2, 1, SD, 5)
    ckptd.verify(root, 1)
    state = (read_manifest(root, 1, SD) is not None, read_manifest(root, 1, CKPT) is not None, tracker_of(root, SD))
    assert_trackers_verified(root)
    c2.close()
    assert sd2 == "committed" and state == (True, False, 1), (sd2, state)


def test_i2_a_crash_in_the_withdrawal_after_a_half_failed_commit_withdraws_it_again(make_monitor, tmp_path):
    """Step 1's commit publishes the state dict and fails the checkpoint (EFBIG); while that
    failure is being recorded (held) weights.bin is replaced; the check withdraws the state dict,
    records its failure and the monitor dies before the manifest goes (``before_revoke=crash``).
    Ray's restart must withdraw it (manifest gone, failed, trackers verified), and the full
    checkpoint must not commit over the replaced bytes."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    weights = _stage_both_kinds(coord, 1)
    pid = ray.get(monitor.ping.remote())["pid"]
    arm_in_monitor(monitor, "before_failure_record", f"until:30:{gate}")
    arm_in_monitor(monitor, "before_revoke", "crash")
    file_size_limit(monitor, 200_000)
    try:
        coord.register(1, state_dict_thread_count=1, checkpoint_thread_count=1)
        first = told(coord, 1, SD, 30)
        write_file(weights, os.urandom(256))
    finally:
        open(gate, "w").close()
    assert first == "committed", first
    wait_for(lambda: ray.get(monitor.ping.remote())["pid"] != pid, what="the monitor to restart")
    # The checkpoint first: its recorded failure is held until the start-up check has withdrawn the
    # state dict again (until then the restarted monitor still says the state dict is committed,
    # as its manifest does: the documented withdrawal window).
    answers = {k.value: told(coord, 1, k, 30) for k in (CKPT, SD)}
    manifests = {k.value: read_manifest(root, 1, k) is not None for k in (SD, CKPT)}
    restart_monitor(monitor)
    again = {k.value: told(coord, 1, k, 10) for k in (SD, CKPT)}
    assert_trackers_verified(root)
    coord.close()
    assert all(a.startswith("failed") for a in answers.values()), (answers, manifests)
    assert manifests == {SD.value: False, CKPT.value: False}, (answers, manifests)
    assert {k: a[:6] for k, a in again.items()} == {k: a[:6] for k, a in answers.items()}, (answers, again)


def _in_delete_step(monitor) -> bool:
    """Whether a thread of the monitor is inside ``retention.delete_step`` (held at its failpoint)."""
    def probe(_self):
        import sys
        for frame in sys._current_frames().values():
            while frame is not None:
                if frame.f_code.co_name == "delete_step":
                    return True
                frame = frame.f_back
        return False
    return ray.get(monitor.__ray_call__.remote(probe))


def test_i3_a_mirror_fenced_during_its_retention_pass_deletes_nothing_the_new_job_keeps(
        make_monitor, tmp_path, run_name):
    """The mirror's side of the first test: job 1 mirrors state dicts (the mirror keeps 2); after
    state dict 3 is mirrored its mirror retention checks the fence, and is held before deleting
    step 1 on the mirror (``before_step_delete``). Job 2 takes the root over (job 1's monitor
    frozen), mirroring to the same mirror and keeping everything there. Job 1's monitor then goes
    on: being fenced, it must delete nothing on the mirror either."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    gate = str(tmp_path / "gate")
    m1 = make_monitor(root, max_state_dict_to_keep=None,
                      mirror={"url": mirror, "state_dicts": True, "max_state_dict_to_keep": 2})
    c1 = ckptd.CheckpointCoordinator(m1, worker_id="job1")
    for step in (1, 2):
        commit_one(c1, step, "weights.bin", is_state_dict=True)
        c1.wait_mirrored(step, timeout_s=30)
    arm_in_monitor(m1, "before_step_delete", f"until:30:{gate}")
    commit_one(c1, 3, "weights.bin", is_state_dict=True)
    wait_for(lambda: _in_delete_step(m1), what="job 1's mirror retention to reach step 1's deletion")
    pid1 = ray.get(m1.ping.remote())["pid"]
    os.kill(pid1, signal.SIGSTOP)
    try:
        make_monitor(root, run=run_name + "-b", takeover=True, max_state_dict_to_keep=None,
                     mirror={"url": mirror, "state_dicts": True})
        before = read_manifest(mirror, 1, SD) is not None
    finally:
        open(gate, "w").close()
        os.kill(pid1, signal.SIGCONT)
    assert before, "step 1 should be on the mirror when job 2 takes over"
    assert ray.get(m1.wait_retention.remote(30))
    kept = (read_manifest(mirror, 1, SD) is not None,
            os.path.exists(os.path.join(ckptd.step_dir(mirror, 1), "weights.bin")))
    c1.close()
    assert kept == (True, True), (
        f"job 1's mirror, fenced by job 2 while its retention pass was held between its fence check and the "
        f"deletion, deleted step 1 from the mirror job 2 keeps everything on: manifest {kept[0]}, file {kept[1]}")


def test_i2_a_takeover_between_the_two_manifests_of_one_commit_keeps_the_answers_and_storage_in_step(
        make_monitor, tmp_path, run_name):
    """Job 1 commits both kinds of step 1 in one commit; it is held right after the state dict's
    manifest is published (``after_publish``), frozen, and job 2 takes the root over. Released,
    job 1's checkpoint manifest is fenced: its state dict is committed (published before the
    takeover), its full checkpoint failed. Job 2 must find the state dict committed too, and no
    checkpoint manifest may appear."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    m1 = make_monitor(root)
    c1 = ckptd.CheckpointCoordinator(m1, worker_id="job1")
    _stage_both_kinds(c1, 1)
    arm_in_monitor(m1, "after_publish", f"until:30:{gate}")
    c1.register(1, state_dict_thread_count=1, checkpoint_thread_count=1)
    wait_for(lambda: read_manifest(root, 1, SD) is not None, what="the state dict's manifest")
    pid1 = ray.get(m1.ping.remote())["pid"]
    os.kill(pid1, signal.SIGSTOP)
    try:
        m2 = make_monitor(root, run=run_name + "-b", takeover=True)
    finally:
        open(gate, "w").close()
        os.kill(pid1, signal.SIGCONT)
    job1 = {k.value: told(c1, 1, k, 30).split(":")[0] for k in (SD, CKPT)}
    c2 = ckptd.CheckpointCoordinator(m2, worker_id="job2")
    job2 = told(c2, 1, SD, 5)
    state = (read_manifest(root, 1, SD) is not None, read_manifest(root, 1, CKPT) is not None)
    assert_trackers_verified(root)
    c1.close()
    c2.close()
    assert job1 == {SD.value: "committed", CKPT.value: "failed"} and job2 == "committed" \
        and state == (True, False), (job1, job2, state)
