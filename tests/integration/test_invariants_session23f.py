"""Session 23f: 1024543 (``_pending_failures``, ``checks`` from before the failure record, and
``StepLedger.prune(keep, busy)``), attacked.

Targets: every path on which a kind becomes FAILED and ``CommitFlow._pending_failures`` gives it a
``_failure_writes`` event (``durable()``, and so ``register``'s ``_failure_for`` and
``UnitReports._admit``, wait on it): is ``_record_new_failures`` / ``_record_failure`` always run
for it, on the same record, so that the event is set and popped (else a hang, and a record that
``prune`` keeps for ever)? And what ``prune`` still drops.

Real local Ray, real monitors (each test its own: ``status_history=1``), real coordinators, real
files; the failure record held in ``before_failure_record`` (armed in the monitor), the monitor
probed through ``__ray_call__``; nothing mocked.

What held (by reading, and by the runs here):

* Every caller of ``_pending_failures`` runs ``_record_new_failures`` on the same record when it
  returns True: inline (``_after_change``, ``_finished``), in a task (housekeeping's expiry, the
  retention fence), or, at start-up, through ``_resume`` -> ``_resume_step`` -> ``_after_change``
  for every rebuilt step (``_resume`` catches each check's exception). FAILED is terminal on a
  record (only ``rebuild`` marks a kind committed), so the state ``_pending_failures`` saw is the
  one ``_record_new_failures`` sees; a key already in ``_failures_recorded`` never gets a new
  event, and the task that recorded it sets the one it found (``setdefault``). Two tasks for one
  record (two kinds expired in one round) record each kind once.
* A failure is never visible without its event: ``ledger.fail`` in ``_failed`` reaches
  ``_after_change`` with no suspension in between when a new kind failed (``withdraw_if_changed``
  is skipped for a new CKPT failure, and returns at once for a failed state dict); the commit
  path's forced failures (and the withdrawal it awaits) happen while ``_committing`` holds the
  step, which ``register`` and ``_admit`` quiesce on; a revoke's ``fail_kind(SD, force=True)``
  is followed by ``_after_change`` at once.
* No deadlock: nothing that sets an event awaits ``durable()``; the CKPT check's ``quiesce``
  waits only for a commit, which never waits on a failure record. ``_record_new_failures``
  records CKPT before SD (``Kind`` order); a withdrawal found by the CKPT check records the SD
  failure inline, and ``durable()`` then finds SD's event gone.
* ``busy`` / ``checks`` / ``withdrawing`` go back to false on every path (``finally``, or the
  revoke loop's only exit), so ``prune`` drops the record later. Guarded here by
  ``test_i4_a_fenced_state_dict_of_a_pruned_step_is_told_once_recorded_and_then_pruned``: the
  retention fence fails the state dict of a step whose record was pruned (a new record from
  ``_retired``, recorded in a spawned task), a registration waits for that record, then answers,
  and the record goes at the next prune.

What broke, fixed since (the case below fails without its fix):

1. I1 (``test_i1_a_checkpoint_unit_that_replaces_a_file_of_a_pruned_state_dict_then_fails``):
   ``prune`` retires a settled step to ``_retired`` as (state, unit, reason) only; a step whose
   state dict alone committed (its full checkpoint not yet registered) is settled. When its full
   checkpoint comes later, ``StepLedger._record`` rebuilds the record from ``_retired`` with
   ``rec[SD].committed_files`` empty, and every check of the committed state dict
   (``_changed_state_dict``: ``withdraw_if_changed`` in ``_record_failure`` and ``_failed``,
   ``_finished``'s report check) returns "unchanged" without reading storage. A checkpoint unit
   that replaces the state dict's weights.bin and then fails leaves the manifest (and the
   state-dict tracker naming the step) claiming bytes that are gone; only a restart
   (``_resume``) would check it. With ``status_history=1`` one newer settled step suffices;
   by default 100. (A unit that finishes is caught at commit, where the committer reads the
   earlier manifest itself.) Code: ``StepLedger.prune`` / ``_record`` (ckptd/monitor/ledger.py)
   and ``UnitReports._changed_state_dict``. Candidate fix: keep a state dict's
   ``committed_files`` (and ``committed_units``) in ``_retired``, or keep the records of steps
   with a committed state dict and no settled full checkpoint out of ``prune``, or have
   ``_changed_state_dict`` read the step's state-dict manifest from storage when the record has
   no ``committed_files``.

Fixed: a record rebuilt from ``_retired`` with its state dict committed is marked
``files_unknown``; ``_changed_state_dict`` and ``_finished`` read the state dict's manifest back
(``_read_back_committed``) before they compare anything with it.
"""

from __future__ import annotations

import os

import pytest
import ray

import ckptd

from .helpers import (
    WindowMissed,
    arm_in_monitor,
    busy_coroutines,
    commit_one,
    fail_full_checkpoint,
    in_thread,
    read_manifest,
    replace_same_size,
    wait_all,
    wait_for,
    what_the_trainer_finds,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0  # far beyond what any wait here needs: reaching it means a hang
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def _probe(monitor, fn):
    return ray.get(monitor.__ray_call__.remote(fn))


def _has_record(monitor, step: int) -> bool:
    return _probe(monitor, lambda self, step=step: self._ledger.get(step) is not None)


def _failure_writes(monitor) -> list[tuple[int, str]]:
    return _probe(monitor, lambda self: sorted((s, k.value) for s, k in self._failure_writes))


# -- guard: the retention fence of a pruned step's state dict -----------------------------------------


def test_i4_a_fenced_state_dict_of_a_pruned_step_is_told_once_recorded_and_then_pruned(make_monitor, tmp_path):
    """``status_history=1``. Step 3's full checkpoint fails (its state dict was never asked for);
    step 4's state dict commits, which prunes step 3's record, and retention's pass fences step
    3's state dict (a new record from ``_retired``), whose failure record is held 2 s. A
    registration of step 3's state dict made meanwhile waits for that record, then is refused;
    nothing is left waiting, and the next commit prunes step 3 again."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, status_history=1, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    fail_full_checkpoint(coord, 3)
    assert wait_all(coord) is not None
    arm_in_monitor(monitor, "before_failure_record", "delay:2")
    try:
        commit_one(coord, 4, "weights.bin", is_state_dict=True)
        assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
        if (3, SD.value) not in _failure_writes(monitor):
            raise WindowMissed("the fence's failure record of step 3 was written before the registration")
    finally:
        arm_in_monitor(monitor, "before_failure_record", None)
    outcome, error = in_thread(lambda: coord.register(3, is_state_dict=True, state_dict_thread_count=1), DEADLINE_S)
    assert outcome == "raised" and isinstance(error, ckptd.CheckpointSaveError), (
        f"register(3) after retention fenced its state dict: {outcome} {error!r}")
    assert _failure_writes(monitor) == []
    assert _probe(monitor, lambda self: (3, SD) in self._failures_durable)
    assert ray.get(monitor.wait_committed.remote(3, "state_dict", DEADLINE_S))["committed"] is False
    commit_one(coord, 5, "weights.bin", is_state_dict=True)
    assert not _has_record(monitor, 3), "step 3's record is kept for ever"
    coord.close()


# -- 1. I1: a pruned state dict's record has no committed files to check --------------------------


def test_i1_a_checkpoint_unit_that_replaces_a_file_of_a_pruned_state_dict_then_fails(make_monitor, tmp_path):
    """``status_history=1``. Step 6's full checkpoint fails (settled); step 5's state dict commits
    (the state-dict tracker names 5) and, step 6 being newer and settled, step 5's record is
    pruned. Then step 5's full checkpoint is registered (Trinity's save_checkpoint after
    save_state_dict) and its checkpoint unit replaces weights.bin, then fails."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, status_history=1, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    fail_full_checkpoint(coord, 6)
    assert wait_all(coord) is not None
    commit_one(coord, 5, "weights.bin", is_state_dict=True)
    if _has_record(monitor, 5):
        raise WindowMissed("step 5's record was not pruned")
    weights = f"{ckptd.step_dir(root, 5)}/weights.bin"

    def replace_then_fail():
        replace_same_size(weights)  # the full checkpoint's model under the state dict's name
        raise OSError("disk full")

    coord.register(5, checkpoint_thread_count=1)
    coord.save_async("optim", replace_then_fail, 5)
    assert wait_all(coord) is not None
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the monitor to settle step 5")
    coord.close()
    assert os.path.exists(weights)
    heard = what_the_trainer_finds(root)
    assert read_manifest(root, 5, SD) is None and heard["stale"] in (None, []), (
        f"the state-dict tracker names step {heard['tracker']}, whose manifest lists {heard['stale']} with other "
        "bytes than storage holds: the unit that replaced them failed and the state dict was not withdrawn")
