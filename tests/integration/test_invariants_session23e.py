"""Session 23e: 7df51e9 (and the session-23 commits before it), attacked.

Targets: ``CommitFlow._record_failure`` (a full checkpoint's failure: the record is written, then
``withdraw_if_changed`` checks the step's committed state dict, and only then is the failure
durable and its ``_failure_writes`` event set, which ``durable()`` waits for), a starting
monitor's ``_held_failures`` (``__init__``, ``_resume``, ``_resume_step``), the ``checks``
counter of ``UnitReports._changed_state_dict`` (retention keeps the state dict, uncounted) and
``StepLedger.prune``.

Real local Ray, real monitors (each test its own: retention by count, a small
``status_history`` or a restart), real coordinators, real files; faults through the named
failpoints (``before_failure_record`` armed in the monitor, ``before_revoke`` through the
monitor's runtime environment, fired once with a marker the test removes), SIGSTOP and SIGKILL,
the monitor probed through ``__ray_call__``; nothing mocked.

What held (by reading, and by these runs):

* No deadlock from ``durable()`` waiting for the check: the check waits only for a commit of the
  step in flight (``quiesce``), for the I/O pool and for the tracker lock, none of which an
  admission or a registration holds while it awaits ``durable()``. A registration awaits
  ``durable()`` only after its ``_registering`` block ended (its ``finally`` records the failures
  itself); the withdrawal's ``_after_change`` records the state dict's failure inline and never
  calls ``durable()``. SD and CKPT failures of one step are recorded one after the other in
  ``_record_new_failures`` (``_failures_recorded`` before the first await: one record each).
* ``_resume`` catches every check's exception and spawns ``_resume_step`` for every step it
  rebuilt, so each held failure is released; a fenced monitor's withdrawal stops (FencedError)
  and the release still follows (failure records are not fenced).
* ``MonitorClient._restarting``: a SIGSTOPed monitor stays ALIVE in the GCS, so calls still fail
  in about two ``notify_timeout_s`` (session 23b's case keeps guarding that).

What broke, fixed since (each case below fails without its fix):

1. I2 (``test_i2_a_state_dict_whose_failure_record_is_being_written_is_not_counted_by_retention``):
   ``_record_failure`` awaits the failure record (``_write_failure``, retried for as long as
   storage refuses it) before it calls ``withdraw_if_changed``; only then does ``checks`` mark
   the step's state dict. Meanwhile the stale state dict (a file replaced outside units) is
   counted by a retention pass that another step's commit starts, and the older valid one goes.
   Here the record is held in ``before_failure_record`` (delay:3: slow or refusing storage).
   Candidate fix: mark the state dict (``rec[SD].checks += 1``, or ``withdrawing``) in
   ``_record_failure`` from before the record's write until the check returns, for kind CKPT.
2. I1/I5 (``test_i1_a_state_dict_withdrawn_after_its_record_was_pruned_is_not_reported_committed``):
   ``StepLedger.prune`` (after every commit, ``status_history``) drops a settled step's record,
   and a step whose state dict committed and whose full checkpoint just failed is settled,
   whatever is still running for it: ``_record_failure``'s record write and check, a withdrawal.
   They go on with the detached record: ``checks`` and ``withdrawing`` no longer reach
   ``withdrawing_steps()``, and the withdrawal's ``fail_kind`` changes only the detached record,
   so ``_retired`` keeps saying COMMITTED: ``wait_committed(S, "state_dict")`` answers
   committed after the manifest was removed (and retention's ``failed``/``at_once`` see a state
   dict that is not there). Candidate fix: ``prune`` skips records with ``checks``,
   ``withdrawing`` or a key in ``_failure_writes`` / not in ``_failures_durable`` (the actor
   passes a predicate), or ``prune`` runs again when they end.
3. I5 (``test_i5_a_failure_found_at_start_up_is_told_only_after_the_check``): a starting monitor
   fails, in ``__init__`` (``ledger.expire``), the full checkpoint of a step that timed out while
   no monitor ran (the case), and, by reading, rebuilds as failed a step whose unit's failure
   receipt exists but whose failure record does not (a monitor that died in
   ``before_failure_record``). Neither is in ``_held_failures`` (only recorded failures are), so
   ``durable()`` has no event for them until ``_resume_step`` records them, after the start-up
   checks and the withdrawal: a registration of the step is answered "failed" while the
   state-dict tracker still names it and its manifest lists replaced bytes. Candidate fix: in
   ``__init__``, give every FAILED CKPT of a touched step that is not durable an event in
   ``_failure_writes`` (as held failures get one), set by ``_record_failure`` at its end.

Fixes: (1) ``_record_failure`` counts ``checks`` on the step's state dict from before the
failure record's write until its check ends; (2) ``ledger.prune`` keeps a record whose state
dict is checked or withdrawn, or whose failure is not reported yet (``_failure_unsettled``);
(3) a failure not recorded yet gets its ``durable()`` event as soon as it is known
(``_pending_failures``: from ``_after_change_sync``, the fence of failed leftovers, and a
starting monitor's rebuilt steps), not when the task that records it starts.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

import ckptd

from .helpers import (
    WindowMissed,
    arm_in_monitor,
    busy_coroutines,
    commit_one,
    disk_full,
    failpoint_env,
    read_manifest,
    replace_same_size,
    revoke_loops,
    tracker_of,
    wait_all,
    wait_for,
    what_the_trainer_finds,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0  # far beyond what any wait here needs: reaching it means a hang
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def _recording(monitor, step: int) -> bool:
    """Whether ``_record_failure`` of ``step``'s full checkpoint is still before its check."""
    def probe(self, step=step):
        import gc
        import inspect as _inspect
        names = {}
        for o in gc.get_objects():
            if _inspect.iscoroutine(o) and o.cr_frame is not None and o.cr_code.co_name in (
                    "_record_failure", "_changed_state_dict"):
                rec = o.cr_frame.f_locals.get("rec")
                if rec is not None and rec.step == step:
                    names[o.cr_code.co_name] = names.get(o.cr_code.co_name, 0) + 1
        return "_record_failure" in names and "_changed_state_dict" not in names
    return ray.get(monitor.__ray_call__.remote(probe))


def _fail_full_checkpoint_with_a_slow_record(monitor, coord, root: str, step: int) -> None:
    """Step ``step``'s state dict is committed; its weights.bin is replaced outside units; its
    full checkpoint fails (a checkpoint unit fails) and the failure record is held 3 s."""
    commit_one(coord, step, "weights.bin", is_state_dict=True)
    replace_same_size(f"{ckptd.step_dir(root, step)}/weights.bin")  # another rank's plain torch.save
    arm_in_monitor(monitor, "before_failure_record", "delay:3")
    coord.register(step, checkpoint_thread_count=1)
    coord.save_async("optim", disk_full, step)
    wait_for(lambda: _recording(monitor, step), timeout_s=DEADLINE_S, what=f"the failure record of step {step}")


# -- 1. I2: the state dict is unmarked while its full checkpoint's failure record is written -------


def test_i2_a_state_dict_whose_failure_record_is_being_written_is_not_counted_by_retention(make_monitor, tmp_path):
    """Window of 2 state dicts. Step 1 is a valid state dict; step 2's state dict commits, a
    file of it is replaced, its full checkpoint fails and the failure record takes 3 s to write.
    Meanwhile another worker's state dict of step 3 commits, and retention runs."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)  # max_state_dict_to_keep=2
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    other = ckptd.CheckpointCoordinator(monitor, worker_id="w1", notify_timeout_s=599)  # its own notifier
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    try:
        _fail_full_checkpoint_with_a_slow_record(monitor, coord, root, 2)
        commit_one(other, 3, "weights.bin", is_state_dict=True)
        assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
        if not _recording(monitor, 2):
            raise WindowMissed("the failure record of step 2 was written before retention's pass")
    finally:
        arm_in_monitor(monitor, "before_failure_record", None)
    assert wait_all(coord) is not None
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the withdrawal of step 2")
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    coord.close()
    other.close()
    assert read_manifest(root, 2, SD) is None and tracker_of(root, SD) == 3  # withdrawn in the end
    # I2: steps 3 and 1 are the newest 2 valid state dicts: step 1 must still be there.
    assert read_manifest(root, 1, SD) is not None, (
        "retention deleted step 1, counting step 2 (its full checkpoint's failure being recorded, its state dict "
        "not checked yet) in its place")


# -- 2. I1/I5: prune drops the record of a step whose check and withdrawal are still to come --------


def test_i1_a_state_dict_withdrawn_after_its_record_was_pruned_is_not_reported_committed(make_monitor, tmp_path):
    """``status_history=1``, no retention by count. Step 2's state dict commits and a file of it
    is replaced; its full checkpoint fails and the failure record takes 3 s to write. Meanwhile
    step 3's state dict commits (which prunes the settled steps but the newest); then step 2's
    state dict is found changed and withdrawn. Who waits for step 2's state dict is told?"""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, status_history=1, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    other = ckptd.CheckpointCoordinator(monitor, worker_id="w1", notify_timeout_s=599)
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    try:
        _fail_full_checkpoint_with_a_slow_record(monitor, coord, root, 2)
        commit_one(other, 3, "weights.bin", is_state_dict=True)
        if not _recording(monitor, 2):
            raise WindowMissed("the failure record of step 2 was written before step 3 committed")
    finally:
        arm_in_monitor(monitor, "before_failure_record", None)
    assert wait_all(coord) is not None
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the withdrawal of step 2")
    coord.close()
    other.close()
    assert read_manifest(root, 2, SD) is None and tracker_of(root, SD) == 3  # withdrawn
    answer = ray.get(monitor.wait_committed.remote(2, "state_dict", 5.0))
    assert not answer["committed"], (
        f"wait_committed(2, 'state_dict') answers {answer}, but step 2's state-dict manifest was withdrawn")


# -- 3. I5: a failure a starting monitor finds unrecorded is told before the start-up check --------


def _pid(monitor) -> int:
    return ray.get(monitor.ping.remote())["pid"]


def test_i5_a_failure_found_at_start_up_is_told_only_after_the_check(make_monitor, tmp_path):
    """``step_timeout_s=3``. Step 2's state dict commits, its full checkpoint is registered (its
    unit never comes) and its weights.bin is replaced. The monitor is stopped (SIGSTOP) until
    the step's timeout has passed, then SIGKILLed: Ray restarts it, and it fails step 2's full
    checkpoint at start-up; its check finds the state dict stale and withdraws it (held 2 s in
    ``before_revoke``). Meanwhile the trainer registers step 2 again (a retried
    ``save_checkpoint``)."""
    root, once = str(tmp_path / "ckpt"), tmp_path / "once"
    os.makedirs(once)
    marker = once / "before_revoke"
    marker.touch()  # fired already, as far as the failpoint knows: until the marker goes
    monitor = make_monitor(root, step_timeout_s=3, runtime_env=failpoint_env("before_revoke=delay:2", once))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    t0 = time.time()
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    coord.register(2, checkpoint_thread_count=1)
    replace_same_size(f"{ckptd.step_dir(root, 2)}/weights.bin")
    wait_all(coord)
    coord.close()
    pid = _pid(monitor)
    os.kill(pid, signal.SIGSTOP)
    if time.time() - t0 > 2.5:
        os.kill(pid, signal.SIGKILL)
        raise WindowMissed("step 2 may have timed out before the monitor was stopped")
    time.sleep(max(0.0, t0 + 3.5 - time.time()))  # the step's timeout passes while no monitor runs
    marker.unlink()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _pid(monitor) != pid, timeout_s=DEADLINE_S, what="the restart")
    wait_for(lambda: revoke_loops(monitor, 2), timeout_s=DEADLINE_S, what="the withdrawal of step 2 at start-up")
    later = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    with pytest.raises(ckptd.CheckpointSaveError):
        later.register(2, checkpoint_thread_count=1)
    heard = what_the_trainer_finds(root)
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the monitor to settle step 2")
    later.close()
    assert read_manifest(root, 2, SD) is None and tracker_of(root, SD) == 1  # withdrawn in the end
    assert heard["stale"] in (None, []), (
        f"told that step 2 failed while the state-dict tracker named step {heard['tracker']}, whose manifest "
        f"lists {heard['stale']} with other bytes than storage holds")
