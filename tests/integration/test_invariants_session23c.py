"""Session 23c: the four fixes of 5011168 (the withdrawal of a changed state dict), attacked.

Targets: ``CommitFlow._record_failure`` (a full checkpoint's failure, once recorded, awaits
``withdraw_if_changed`` before it wakes its waiters), ``UnitReports._changed_state_dict`` and
``_finished`` (they wait for a commit of the step's state dict in flight: ``quiesce``),
``CheckpointMonitor._resume`` with ``RetentionRunner.release`` (a starting monitor checks the
state dicts of its steps in flight before retention's first pass), and ``rebuild._repair_trackers``
(both kinds' trackers).

Real local Ray, real monitors (one shared by the module, each test in its own block of steps,
plus a test's own where retention by count is needed), real coordinators and real files; faults
through the named failpoints (``before_revoke``, ``before_tracker_rename``), the monitor probed
through ``__ray_call__``; nothing mocked. A "replaced" file holds other bytes of the same size, so
only a checksum tells.

What held (by reading, and by the runs of test_invariants_session23.py and these cases):

* I4: no deadlock from the new awaits. ``quiesce`` in ``_finished``/``_changed_state_dict`` waits
  for a commit task that never waits for them: a commit waits only for the I/O pool and the
  tracker lock, whose holders (``_advance_trackers``, ``_revoke_state_dict``) release it between
  retries and await nothing a notification or a failure record holds; a deferred state-dict
  commit returns (``Deferred``) instead of waiting for the checkpoint units; ``_registering``
  only keeps commits from beginning, and ``register`` waits for commits before it registers, never
  the other way round; the mirror is only enqueued. The commit task runs ``_record_failure``
  after it popped its ``_committing`` event, and a commit that withdraws the state dict itself
  fails that kind first, so the check it then reaches never waits for its own commit.
* ``_resume``: every check's exception is caught (retention is released), a fenced monitor's
  checks read only, and a commit begun by a notification before the checks is waited for.
* ``_repair_trackers`` over both kinds: a tracker naming a step without a manifest of its kind
  goes to the newest committed step, or away when none is (a checkpoint-only step counts for
  the state-dict tracker).
* Cost, by reading (no case: nothing promised): a full checkpoint's failure now reaches its
  waiters (and aborts its writer slots) only after every file of the step's committed state dict
  was read back (crc32 itself runs at ~18 GB/s here; storage bandwidth decides); a checkpoint
  unit's "finished" that arrives while its step's state dict commits waits for that commit, and
  so do the events batched behind it in the same ``notify_batch`` (other steps' included).

What broke, fixed since (each case below fails without its fix):

1. I5/I1 (``test_i5_a_waiter_hears_of_a_failed_full_checkpoint_only_after_its_state_dict_was_checked``):
   ``_record_failure`` adds the failure to ``_failures_durable`` before it awaits the check of
   the step's committed state dict, and ``_settled`` answers from that set: a ``wait_committed``
   of the full checkpoint that comes while the check or the withdrawal runs (here the withdrawal
   held in ``before_revoke``) is answered with the failure at once, while the state-dict tracker
   still names the step whose manifest lists bytes storage no longer holds. Only the waiters that
   came before the failure wait for the check (``_wake`` after it). A restarted monitor does the
   same: ``rebuilt.failures`` is durable before ``_resume`` checked.
2. I2 (``test_i2_a_state_dict_awaiting_its_check_is_not_counted_by_retention``): nothing marks
   a state dict whose check is pending: ``withdrawing`` is set only once ``_revoke_state_dict``
   begins, and the step (state dict committed, full checkpoint failed) is not in flight. A
   checkpoint unit replaces a file of the state dict being committed and fails inside that
   commit (session 23's first case): the failure's check waits for the commit (``quiesce``), the
   commit ends by scheduling retention, and that pass reads ``withdrawing_steps()`` before the
   check runs. If its scan sees the stale manifest (the check and withdrawal take longer than the
   scan: a big state dict's checksum; here ``before_revoke`` holds the withdrawal for 1 s), the
   stale state dict is counted among the newest ``max_state_dict_to_keep`` and an older valid one
   is deleted. The start-up check (``_resume``) marks a stale step before retention runs; the live
   checks (``_record_failure``, ``_failed``) do not.
3. I1 (``test_i1_a_listed_file_that_is_no_longer_a_file_withdraws_the_state_dict``): a
   check that raises (a listed file replaced by a directory of the same name, say a DCP save
   written over it; any read error of storage does the same) is logged and dropped by
   ``_record_failure`` ("the state dict is what it was"), and nothing looks again: the step's
   full checkpoint failed, so no later failure comes. The state-dict tracker keeps naming a step
   that ``ckptd.verify`` rejects. (``_resume``'s check drops it the same way at start-up; a named
   pipe in place of a listed file raises too: fsspec's local ``open`` seeks to learn the size.)

Each case passes with a candidate fix (tried on a copy of the tree): ``_failures_durable.add``
after the check; ``withdrawing`` set for the duration of ``_record_failure``'s check; a listed
path that is a directory counted as changed in ``changed_files``.

Fixes: (1) ``_record_failure`` marks a full checkpoint's failure durable (what ``wait_committed``
answers from) only after the check and any withdrawal, and a starting monitor holds the recorded
failures of the steps it checks until ``_resume_step``; (2) a state dict whose check is in flight
is kept but not counted by retention (``checks``, in ``ledger.withdrawing_steps``); (3)
``manifest.changed_files`` counts a listed path that is no longer a regular file as changed, and
``_changed_state_dict`` retries other storage errors until it has an answer.
"""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd

from .helpers import (
    arm_in_monitor,
    busy_coroutines,
    commit_one,
    fail_full_checkpoint,
    ledger_states,
    read_manifest,
    replace_same_size,
    revoke_loops,
    stale_files,
    tracker_of,
    wait_all,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0  # far beyond what any wait here needs: reaching it means a hang
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}  # no test's steps go while another runs


# -- 1. I5: a waiter hears of the failed full checkpoint before the state dict was checked ---------


def test_i5_a_waiter_hears_of_a_failed_full_checkpoint_only_after_its_state_dict_was_checked(env):
    """Step S+2's state dict is committed and its weights.bin replaced outside units; its full
    checkpoint then fails (a checkpoint unit fails). The withdrawal that ``_record_failure``'s
    check starts is held in ``before_revoke``; a trainer asks ``wait_committed`` meanwhile and,
    told the step failed, reads the state-dict tracker."""
    s, root, monitor = env.s, env.root, env.monitor
    coord = env.coord()
    commit_one(coord, s + 1, "model.bin", is_state_dict=False)
    commit_one(coord, s + 2, "weights.bin", is_state_dict=True)
    replace_same_size(f"{env.step_dir(s + 2)}/weights.bin")  # another rank's plain torch.save
    heard: dict = {}
    told = threading.Event()

    def trainer():
        try:
            coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
        except ckptd.CheckpointSaveError:
            # What the trainer finds when it is told: the state-dict tracker, and that step's files.
            step = tracker_of(root, SD)
            heard.update(tracker=step, stale=stale_files(root, step, SD) if step is not None else None)
        told.set()

    arm_in_monitor(monitor, "before_revoke", "delay:3")
    try:
        fail_full_checkpoint(coord, s + 2)
        wait_for(lambda: revoke_loops(monitor, s + 2), timeout_s=DEADLINE_S, what="the withdrawal of S+2")
        waiter = threading.Thread(target=trainer, daemon=True)
        waiter.start()  # while the withdrawal is held
        assert told.wait(DEADLINE_S)
    finally:
        arm_in_monitor(monitor, "before_revoke", None)
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the monitor to settle step S+2")
    assert wait_all(coord) is not None
    coord.close()
    assert read_manifest(root, s + 2, SD) is None and tracker_of(root, SD) == s + 1  # withdrawn in the end
    assert heard, "wait_committed did not report the failed full checkpoint"
    # I5/I1: when the trainer hears of the failure, the state-dict tracker names a valid step.
    assert heard["stale"] in (None, []), (
        f"told that step {s + 2} failed while the state-dict tracker named step {heard['tracker']}, "
        f"whose manifest lists {heard['stale']} with other bytes than storage holds"
    )


# -- 2. I2: retention while the state dict of a failed full checkpoint is being checked -------------


def test_i2_a_state_dict_awaiting_its_check_is_not_counted_by_retention(make_monitor, tmp_path):
    """Default window of 2 state dicts; steps 1 and 2 are state dicts. Step 3: a checkpoint unit
    is admitted (and held) before the state dict commits; the state dict's commit checks
    weights.bin, publishes its manifest and is held in its tracker move; the unit then replaces
    weights.bin and fails, so the full checkpoint's failure is recorded while the state dict still
    commits, and its check waits for that commit (``quiesce``). The commit ends by scheduling
    retention, whose pass runs before the check."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    commit_one(coord, 2, "weights.bin", is_state_dict=True)

    d3 = ckptd.step_dir(root, 3)
    coord.register(3, is_state_dict=True, state_dict_thread_count=1)
    coord.register(3, checkpoint_thread_count=1)
    admitted, go = threading.Event(), threading.Event()

    def replace_then_fail():
        admitted.set()
        assert go.wait(DEADLINE_S)
        replace_same_size(f"{d3}/weights.bin")
        raise OSError("disk full after replacing weights.bin")

    coord.save_async("optim", replace_then_fail, 3)
    assert admitted.wait(DEADLINE_S)
    # The withdrawal is held as a long check would hold it (a big state dict's checksum takes
    # seconds; this one's takes a millisecond, a race with the pass's scan).
    arm_in_monitor(monitor, "before_revoke", "delay:1")
    arm_in_monitor(monitor, "before_tracker_rename", "delay:2.5")
    try:
        coord.save_async("weights", lambda: write_file(f"{d3}/weights.bin", os.urandom(4096)), 3, is_state_dict=True)
        wait_for(lambda: read_manifest(root, 3, SD) is not None, timeout_s=DEADLINE_S, what="step 3's manifest")
        go.set()
        during = wait_for(lambda: (st := ledger_states(monitor, 3))["checkpoint"] == "failed" and st,
                          timeout_s=DEADLINE_S, what="the monitor to hear of the unit's failure")
    finally:
        arm_in_monitor(monitor, "before_tracker_rename", None)
    assert during["state_dict"] == "committing", during  # the failure came inside the commit
    assert wait_all(coord) is not None
    try:
        wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the monitor to settle step 3")
    finally:
        arm_in_monitor(monitor, "before_revoke", None)
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    coord.close()
    assert read_manifest(root, 3, SD) is None and tracker_of(root, SD) == 2  # withdrawn in the end
    # I2: steps 2 and 1 are the newest 2 valid state dicts: step 1 must still be there.
    assert stale_files(root, 1, SD) == [], "retention deleted step 1, counting step 3 (awaiting its check) in its place"


# -- 3. I1: a check that raises is dropped, and nothing looks again --------------------------------


def test_i1_a_listed_file_that_is_no_longer_a_file_withdraws_the_state_dict(env):
    """Step S+2's state dict is committed; its weights.bin is replaced by a directory of the same
    name (a sharded save written over it, outside units); its full checkpoint then fails (a
    checkpoint unit fails)."""
    s, root, monitor = env.s, env.root, env.monitor
    coord = env.coord()
    commit_one(coord, s + 1, "model.bin", is_state_dict=False)
    commit_one(coord, s + 2, "weights.bin", is_state_dict=True)
    weights = f"{env.step_dir(s + 2)}/weights.bin"
    os.remove(weights)
    write_file(f"{weights}/shard-0.bin", os.urandom(4096))
    fail_full_checkpoint(coord, s + 2)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the monitor to settle step S+2")
    assert wait_all(coord) is not None
    coord.close()
    step = tracker_of(root, SD)
    try:
        ckptd.verify(root, step)
    except (ckptd.CheckpointError, OSError) as e:
        pytest.fail(f"the state-dict tracker names step {step}, which does not verify: {type(e).__name__}: {e}")
    assert step == s + 1
