"""Session 23: the withdrawal of a committed state dict, retention beside it, and the start-up
repairs (e8f701d and the two commits before it), attacked.

Targets: ``plan_retention(..., withdrawing=)`` and ``ledger.withdrawing_steps()`` (a state dict
being withdrawn is kept but not counted among the newest ``max_state_dict_to_keep``), set by
``CommitFlow._revoke_state_dict``; the wrong-report check of ``Committer.commit`` and
``UnitReports._finished``; ``CheckpointMonitor._resume_step`` and ``withdraw_if_changed``;
``rebuild._repair_trackers`` and ``attempts.clean_up_older_attempts``.

Real local Ray, real monitors (one shared by the module, each test in its own block of steps,
plus the tests' own where an option, a restart or a new job needs one), real coordinators and
real files; faults through the named failpoints (``before_revoke``, ``before_tracker_rename``,
``before_manifest``), the monitor probed through ``__ray_call__``; nothing mocked. Throughout, a
"replaced" file holds other bytes of the same size, so only a checksum tells.

What held:

* Retention while a withdrawal is retried, live: an older state dict that commits meanwhile is
  kept (the session-22 "older" case, run again here as the first half of the restart case).
* A withdrawal cannot race a new commit of its step (by reading): the unit that triggers it stays running (or
  failed) in the ledger, a commit-check withdrawal fails the full checkpoint first, and a state-dict
  registration of a settled step is moot; a duplicate report after the withdrawal only withdraws
  again (no-op).
* Wrong reports (by reading ``_finished``, ``_check_reports`` and the wrong-report check): a report
  of a committed file with its CRC-32 but another size, or the other way round, fails the unit
  live, and fails the commit after a restart, the state dict staying; a ``WrittenFile`` of the
  wrong size never leaves the worker (``describe_returned_files`` checks it). A file listed by both
  manifests keeps the state dict's entry, and the checkpoint's equals it.
* A new job's ``clean_up_older_attempts`` withdraws a changed state dict before the first
  retention pass (it runs in the constructor).

What broke, fixed since (each case below fails without its fix):

1. I1 (``test_i1_a_unit_that_replaces_a_file_of_the_state_dict_being_committed_then_fails``): a
   checkpoint unit of step S, admitted before S's state dict commits, replaces weights.bin of that
   state dict after the commit checked it and fails while the commit is still moving the tracker.
   ``withdraw_if_changed`` returns at once (the state dict is COMMITTING, not COMMITTED) and
   nothing looks again once the commit ends: the state-dict tracker names S, whose manifest lists
   bytes storage no longer holds. (A unit that reports the replaced file instead, while the state
   dict commits, is missed the same way by ``_finished``, whose ``committed_files`` are still empty;
   it is caught only if the step's full checkpoint later commits.)
2. I1 (``test_i1_a_full_checkpoint_that_fails_without_a_failed_unit_...``): a committed state-dict
   file is replaced outside units (another rank's plain ``torch.save``) and the full checkpoint of
   the step then fails for another reason: a commit check that runs before the committed files are
   checked (a symbolic link into another step), or the step timeout. Neither path checks storage
   (only a failed unit, a committed-file change found by the commit, and a restart's failed units
   do), so the stale state dict and its tracker stay.
3. I2 (``test_i2_a_restart_during_a_withdrawal_keeps_the_state_dict_retention_must_keep``): the
   monitor is SIGKILLed while it retries the withdrawal of step 3 (found by the full checkpoint's
   commit check) after an older state dict, step 1, committed and was kept. The restarted monitor
   runs its first retention pass before it finds step 3 stale again (the ``withdrawing`` flag died
   with the process): step 3 is counted among the newest 2, and step 1 is deleted, leaving one
   valid state dict where the policy keeps two. The failpoint only fixes the order: without it the
   pass wins the race about one run in three here.
4. I1 (``test_i1_a_new_job_points_the_checkpoint_tracker_at_no_uncommitted_step``): a retirement
   killed after its first phase (manifests removed, trackers not yet rewritten) leaves the
   checkpoint tracker on a step with no manifest while only state dicts stay committed. The new
   job's ``_repair_trackers`` repairs the state-dict tracker, but ``newest`` has no checkpoint
   entry when no checkpoint is committed, so the checkpoint tracker is never looked at and keeps
   naming the uncommitted step.

Fixes: (1) ``_changed_state_dict`` (behind ``withdraw_if_changed``) and ``_finished`` wait for a
commit of the step's state dict in flight before they look; (2) every failure of a full checkpoint
is checked against its step's committed state dict when it is recorded (``_record_failure``),
before its waiters hear of it; (3) a starting monitor checks the committed state dict of each
step in flight whose full checkpoint was under way (``actor._resume``), marks a stale one as being
withdrawn, and only then lets retention run (``RetentionRunner.release``); (4)
``_repair_trackers`` looks at both kinds' trackers whatever is committed.
"""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd
from ckptd.layout import MANIFESTS

from .helpers import (
    Env,
    actor_gone,
    arm_in_monitor,
    busy_coroutines,
    commit_one,
    failpoint_env,
    ledger_states,
    read_manifest,
    replace_same_size,
    restart_monitor,
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


# -- helpers ---------------------------------------------------------------------------------------


def _assert_trackers_verify(root: str) -> dict[ckptd.Kind, int | None]:
    """I1: each tracker names a step with a manifest of its kind (a full checkpoint counts as a
    state dict), and each of that step's manifests verifies on its own against storage."""
    named = {}
    for kind in (CKPT, SD):
        step = named[kind] = tracker_of(root, kind)
        if step is None:
            continue
        present = [k for k in ([CKPT] if kind is CKPT else [SD, CKPT]) if read_manifest(root, step, k) is not None]
        assert present, f"the {kind.value} tracker names step {step}, which has no {kind.value} manifest"
        for k in present:
            stale = stale_files(root, step, k)
            assert stale == [], (
                f"the {kind.value} tracker names step {step}, whose {k.value} manifest lists "
                f"{stale} with other bytes than storage holds"
            )
    return named


# -- 1. I1: a file of the state dict being committed, replaced by a unit that then fails -----------


def test_i1_a_unit_that_replaces_a_file_of_the_state_dict_being_committed_then_fails(env):
    """Step S+2: a checkpoint unit is admitted (and held) before the state dict commits; the state
    dict's commit checks weights.bin, publishes its manifest and is held in its tracker move; the
    unit then replaces weights.bin and fails, and the monitor hears of it while still committing."""
    s, root, monitor = env.s, env.root, env.monitor
    coord = env.coord()
    commit_one(coord, s + 1, "model.bin", is_state_dict=False)
    d = env.step_dir(s + 2)
    coord.register(s + 2, is_state_dict=True, state_dict_thread_count=1)
    coord.register(s + 2, checkpoint_thread_count=1)
    admitted, go = threading.Event(), threading.Event()

    def replace_then_fail():
        admitted.set()
        assert go.wait(DEADLINE_S)
        replace_same_size(f"{d}/weights.bin")
        raise OSError("disk full after replacing weights.bin")

    coord.save_async("optim", replace_then_fail, s + 2)
    assert admitted.wait(DEADLINE_S)
    arm_in_monitor(monitor, "before_tracker_rename", "delay:2")
    try:
        coord.save_async("weights", lambda: write_file(f"{d}/weights.bin", os.urandom(4096)), s + 2, is_state_dict=True)
        wait_for(
            lambda: read_manifest(root, s + 2, SD) is not None, timeout_s=DEADLINE_S, what="the state dict's manifest"
        )
        go.set()
        during = wait_for(
            lambda: (st := ledger_states(monitor, s + 2))["checkpoint"] == "failed" and st,
            timeout_s=DEADLINE_S,
            what="the monitor to hear of the unit's failure",
        )
    finally:
        arm_in_monitor(monitor, "before_tracker_rename", None)
    assert during["state_dict"] == "committing", during  # the failure came inside the commit
    assert wait_all(coord) is not None
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the monitor to settle step S+2")
    assert stale_files(root, s + 2, SD) in (None, []), "the state dict of S+2 lists the replaced weights.bin"
    assert _assert_trackers_verify(root) == {CKPT: s + 1, SD: s + 1}
    coord.close()


# -- 2. I1: a full checkpoint that fails with no failed unit never checks the state dict ------------


@pytest.mark.parametrize("how", ["commit-check", "timeout"])
def test_i1_a_full_checkpoint_that_fails_without_a_failed_unit_withdraws_a_changed_state_dict(
    env, make_monitor, tmp_path, how
):
    """Step S+2's state dict is committed; its weights.bin is replaced outside units; its full
    checkpoint then fails with no unit failing: a commit check that runs before the committed files
    are checked, or the step timeout."""
    if how == "timeout":  # a monitor of its own: a short step timeout would fail the module's steps
        root = str(tmp_path / "ckpt")
        env = Env(root, make_monitor(root, step_timeout_s=3), 0)
    s, root, monitor = env.s, env.root, env.monitor
    coord = env.coord()
    commit_one(coord, s + 1, "model.bin", is_state_dict=False)
    commit_one(coord, s + 2, "weights.bin", is_state_dict=True)
    d = env.step_dir(s + 2)
    replace_same_size(f"{d}/weights.bin")  # another rank's plain torch.save, outside any unit
    if how == "commit-check":
        # The one checkpoint unit links a file of step S+1: the commit check refuses the link
        # before it looks at the committed files.
        def link():
            os.symlink(f"{env.step_dir(s + 1)}/model.bin", f"{d}/shared.bin")
            return [f"{d}/shared.bin"]

        coord.register(s + 2, checkpoint_thread_count=1)
        coord.save_async("link", link, s + 2)
    else:  # one of two registered checkpoint units finishes; the other never comes
        coord.register(s + 2, checkpoint_thread_count=2)
        coord.save_async("optim", lambda: write_file(f"{d}/optim.bin", os.urandom(100)), s + 2)
    with pytest.raises(ckptd.CheckpointSaveError, match="symbolic link" if how == "commit-check" else "timed out"):
        coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the monitor to settle step S+2")
    assert stale_files(root, s + 2, SD) in (None, []), "the state dict of S+2 lists the replaced weights.bin"
    assert _assert_trackers_verify(root) == {CKPT: s + 1, SD: s + 1}
    coord.close()


# -- 3. I2: a restart during a withdrawal, and retention's first pass -------------------------------


def test_i2_a_restart_during_a_withdrawal_keeps_the_state_dict_retention_must_keep(make_monitor, tmp_path):
    """Default window of 2 state dicts. Step 2: a full checkpoint; step 3: a state dict, whose
    weights.bin is replaced outside units; its full checkpoint's commit finds that and withdraws
    the state dict, refused by storage (retried). Step 1's state dict commits meanwhile and is kept.
    Then the monitor is SIGKILLed; the restarted one commits step 3 again, held in
    ``before_manifest`` (armed for the restarted process only) so that its first retention pass
    runs before it finds the change."""
    root = str(tmp_path / "ckpt")
    once = tmp_path / "once"
    once.mkdir()
    (once / "before_manifest").touch()  # spent already: the first process never waits there
    monitor = make_monitor(root, runtime_env=failpoint_env("before_manifest=delay:2", once))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 2, "model.bin", is_state_dict=False)
    commit_one(coord, 3, "weights.bin", is_state_dict=True)
    coord.register(3, checkpoint_thread_count=1)
    d3 = ckptd.step_dir(root, 3)
    # Refused until the restart (this process only): a plain "raise" fires once here (the once
    # directory), and its retry 0.1 s later succeeded before a loaded machine's poll saw it.
    arm_in_monitor(monitor, "before_revoke", f"raise_until:{tmp_path / 'never'}")

    def outside_write_and_optim():
        replace_same_size(f"{d3}/weights.bin")  # as another rank's plain torch.save would
        return write_file(f"{d3}/optim.bin", os.urandom(100))

    coord.save_async("optim", outside_write_and_optim, 3)
    wait_for(
        lambda: min(revoke_loops(monitor, 3), default=0) >= 1,
        timeout_s=DEADLINE_S,
        what="the withdrawal to be retried",
    )
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    assert stale_files(root, 1, SD) == []  # kept live: step 3 is not counted while it is withdrawn
    os.remove(once / "before_manifest")
    restart_monitor(monitor, how="sigkill")
    wait_for(
        lambda: read_manifest(root, 3, SD) is None and not busy_coroutines(monitor),
        timeout_s=DEADLINE_S,
        what="the restarted monitor to withdraw step 3",
    )
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    assert _assert_trackers_verify(root) == {CKPT: 2, SD: 2}
    # I2: steps 1 and 2 are the newest 2 valid state dicts: step 1 must still be there.
    assert stale_files(root, 1, SD) == [], "retention deleted step 1, counting the stale step 3 in its place"
    coord.close()


# -- 4. I1: a new job and a checkpoint tracker left on a step with no manifest ---------------------


def test_i1_a_new_job_points_the_checkpoint_tracker_at_no_uncommitted_step(make_monitor, tmp_path):
    """Job 1: step 1 a state dict, step 2 a full checkpoint. ``retire_steps(root, after=1)`` is
    killed after its first phase (step 2's manifests removed, newest first; the trackers not yet
    rewritten), as its docstring allows. Job 2 starts on the root."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    commit_one(coord, 2, "model.bin", is_state_dict=False)
    coord.close()
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), timeout_s=DEADLINE_S, what="job 1's monitor to be gone")
    for kind in (CKPT, SD):  # what retire's first phase does to step 2
        path = f"{ckptd.step_dir(root, 2)}/{MANIFESTS[kind]}"
        if os.path.exists(path):
            os.remove(path)
    monitor2 = make_monitor(root)
    wait_for(lambda: not busy_coroutines(monitor2), timeout_s=DEADLINE_S, what="job 2's monitor's start-up")
    assert tracker_of(root, SD) == 1  # repaired
    assert _assert_trackers_verify(root) == {CKPT: None, SD: 1}
