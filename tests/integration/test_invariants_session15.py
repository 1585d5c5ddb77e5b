"""Session 15: the commit protocol after commit 35b11c8, attacked with a real local Ray, real
files, real coordinators and real monitor restarts (ray.kill and SIGKILL) and new jobs.

The change: ``CheckpointMonitor.register`` used to drop a registration whole when any kind it
concerns had failed; now it applies it (durable, then in the ledger) unless
``StepLedger.registration_is_moot`` says every kind it concerns has settled, and still answers
with the failure. Attacked:

1. Trackers name only steps that verify and have a manifest of the right kind, and never go
   back (checked after every phase, restart and new job).
2. A (step, kind) reported failed never gets a manifest of that kind: after ray.kill and SIGKILL
   restarts, a registration retried with the same id before and after a restart and after the
   state dict committed, and new jobs on the root (with and without ``retire_steps``).
3. Order: every order of {full-checkpoint registration, failing checkpoint unit, state-dict
   unit}, with a monitor restart (ray.kill, then SIGKILL) between each pair of events; a split
   registration whose two calls straddle the failure and a restart.
4. A registration of a step whose kinds have all settled writes nothing under the ledger and is
   answered with the failure.
5. Trinity: registrations add up; a full checkpoint with no checkpoint count waits for its
   state-dict unit.

Held: 1, 2, 3 and 5 in every order and fault above; 4 for every registration that concerns the
checkpoint kind.

Broke, and fixed in the same session (each test failed before its fix):

* ``test_a_state_dict_registration_of_a_settled_step_writes_nothing`` (invariant 4): a
  state-dict registration of a step whose state dict committed and whose checkpoint failed was
  answered "ok" and written under the ledger, although the unit it adds can count toward the
  failed checkpoint only. Now ``StepLedger.kinds_affected`` counts the full checkpoint among the
  kinds a state-dict count can change, and a registration whose affected kinds have all
  settled writes nothing and is answered with the failure.
* ``test_a_state_dict_of_a_failed_step_is_refused_once_retention_deletes_the_step``: retention
  deletes a step with a failed kind and no manifest at once, as a failed leftover; a state dict
  of that step saved and committed while the pass ran went to the trash with the step after
  ``wait_committed`` had said committed. Now the pass first fails the state dict of such a step
  (``StepLedger.fence_state_dict``, on the event loop, before the pass reads anything), so it can
  no longer be admitted, and says why.
* ``test_a_registration_waiting_for_a_failure_record_is_not_accepted_into_a_commit_in_flight``:
  ``register`` quiesced the step once, then awaited the failure record and its own write; a
  commit that began meanwhile did not stop it. Now it looks again after the failure record, and
  no commit of the step begins while a registration of it is being written.
"""

from __future__ import annotations

import asyncio
import glob
import itertools
import os
import threading

import pytest
import ray

import ckptd

from .helpers import (
    SaveWorker,
    arm_in_monitor,
    assert_trackers_verified,
    disk_full,
    fail_checkpoint_unit,
    read_manifest,
    restart_monitor,
    status,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
ORDERS = list(itertools.permutations(("reg", "fail", "sd")))


def _reg_records(root: str, step: int) -> list[str]:
    """Every registration record of ``step`` under the root's ledger, all attempts."""
    return sorted(os.path.basename(p) for p in glob.glob(f"{root}/.ckptd/pending/*/{step}/reg-*.json"))


def _settle(monitor) -> None:
    """No retention pass running (so it cannot race the next event: that race has its own test)."""
    assert ray.get(monitor.wait_retention.remote(30))


def _check_outcome(root: str, coord, steps: list[int]) -> None:
    """Each step: its state dict committed (sd.bin only), its full checkpoint failed and absent."""
    for step in steps:
        coord.wait_committed(step, is_state_dict=True, timeout_s=30)
        with pytest.raises(ckptd.CheckpointSaveError, match="disk full") as info:
            coord.wait_committed(step, timeout_s=30)
        assert info.value.step == step
        assert [f.path for f in read_manifest(root, step, SD).files] == ["sd.bin"], step
        assert read_manifest(root, step, CKPT) is None, step
        ckptd.verify(root, step)
    assert assert_trackers_verified(root) == {SD: max(steps), CKPT: None}


def test_every_order_of_registration_failure_and_state_dict_unit_with_restarts_between(
        make_monitor, tmp_path, run_name):
    """Steps 1-6, one order each of: the full-checkpoint registration
    ``register(S, state_dict_thread_count=1, checkpoint_thread_count=1)``, a checkpoint unit that
    fails, the state-dict unit. The first event of every step, then ray.kill, the second, then
    SIGKILL, the third. In every order the state dict commits and the checkpoint fails; the
    registration raises exactly when the failure came first. Two more restarts and a new job
    change nothing; retiring, then a third job, re-saves step 4 from scratch."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    steps = list(range(1, len(ORDERS) + 1))
    trackers_seen = []

    def event(step: int, what: str, failed_before: bool) -> None:
        if what == "fail":
            with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
                coord.save_sync(disk_full, step)
        elif what == "sd":
            coord.save_sync(lambda: write_step_file(root, step, "sd.bin"), step, is_state_dict=True)
        elif failed_before:
            with pytest.raises(ckptd.CheckpointSaveError, match="disk full") as info:
                coord.register(step, state_dict_thread_count=1, checkpoint_thread_count=1)
            assert info.value.kind == "checkpoint"
            # Applied all the same: its state dict can still commit.
            assert len(_reg_records(root, step)) == 1 or read_manifest(root, step, SD) is not None
        else:
            coord.register(step, state_dict_thread_count=1, checkpoint_thread_count=1)

    for phase in range(3):
        for step, order in zip(steps, ORDERS, strict=True):
            event(step, order[phase], failed_before="fail" in order[:phase])
            _settle(monitor)
        trackers_seen.append(assert_trackers_verified(root))
        if phase < 2:
            restart_monitor(monitor, how="ray.kill" if phase == 0 else "sigkill")
    _check_outcome(root, coord, steps)
    for how in ("sigkill", "ray.kill"):
        restart_monitor(monitor, how=how)
        _check_outcome(root, coord, steps)
        trackers_seen.append(assert_trackers_verified(root))
    sd_trackers = [t[SD] or -1 for t in trackers_seen]
    assert sd_trackers == sorted(sd_trackers)  # never backwards
    coord.close()

    # A new job on the root: the old attempt's failures and registrations do not carry over, and
    # nothing of theirs commits a checkpoint.
    ray.kill(monitor, no_restart=True)
    job = make_monitor(root, run=f"{run_name}-b", max_state_dict_to_keep=None)
    new = ckptd.CheckpointCoordinator(job, worker_id="w1")
    for step in steps:
        new.wait_committed(step, is_state_dict=True, timeout_s=30)
    restart_monitor(job, how="sigkill")
    for step in steps:
        assert read_manifest(root, step, CKPT) is None
        assert [f.path for f in read_manifest(root, step, SD).files] == ["sd.bin"]
    assert assert_trackers_verified(root) == {SD: 6, CKPT: None}
    new.close()

    # Resuming from step 3: steps 4-6 retired, and a third job saves step 4 afresh.
    ray.kill(job, no_restart=True)
    ckptd.retire_steps(root, after=3)
    assert assert_trackers_verified(root) == {SD: 3, CKPT: None}
    third = make_monitor(root, run=f"{run_name}-c", max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(third, worker_id="w2")
    coord.save_async("model", lambda: write_step_file(root, 4, "model.bin"), 4, is_state_dict=True)
    coord.save_async("optim", lambda: write_step_file(root, 4, "optim.bin"), 4)
    coord.register(4, state_dict_thread_count=1, checkpoint_thread_count=1)
    coord.wait_all()
    coord.wait_committed(4, timeout_s=30)
    assert sorted(f.path for f in read_manifest(root, 4, CKPT).files) == ["model.bin", "optim.bin"]
    for step in (5, 6):
        assert not os.path.exists(ckptd.step_dir(root, step))
    assert assert_trackers_verified(root) == {SD: 4, CKPT: 4}
    coord.close()


def test_a_split_registration_straddling_the_failure_and_a_restart(make_monitor, tmp_path):
    """Trinity's counters in two calls: ``register(S, checkpoint_thread_count=1)`` (the failure
    came first: every kind it concerns has settled, so nothing is written), a SIGKILL, then
    ``register(S, state_dict_thread_count=1)`` (a full-checkpoint registration: applied, and
    answered with the failure). The state dict of S waits for its unit and commits; the other
    order of the two calls gives the same outcome at step S+1."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step, calls in ((10, ({"checkpoint_thread_count": 1}, {"state_dict_thread_count": 1})),
                        (11, ({"state_dict_thread_count": 1}, {"checkpoint_thread_count": 1}))):
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.save_sync(disk_full, step)
        before = _reg_records(root, step)
        with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
            coord.register(step, **calls[0])
        applied_first = "state_dict_thread_count" in calls[0]
        assert len(_reg_records(root, step)) == len(before) + applied_first
        restart_monitor(monitor, how="sigkill")
        with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
            coord.register(step, **calls[1])
        assert len(_reg_records(root, step)) == len(before) + 1
        with pytest.raises(TimeoutError):  # it waits for its state-dict unit
            coord.wait_committed(step, is_state_dict=True, timeout_s=0.3)
        assert status(monitor).step(step, SD).expected == 1
        coord.save_sync(lambda s=step: write_step_file(root, s, "sd.bin"), step, is_state_dict=True)
        _check_outcome(root, coord, [step])
    coord.close()


def test_a_registration_retried_with_its_id_across_restarts_counts_once(make_monitor, tmp_path):
    """The same registration (same id, as Ray retries it) after the checkpoint unit failed:
    applied once, answered with the failure each time, before and after a SIGKILL, and after its
    state dict committed (then it is moot and writes nothing). A ray.kill restart does not commit
    the checkpoint."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(disk_full, 20)
    call = (20, {"state_dict": 1, "checkpoint": 1}, "checkpoint", "reg-s15-retried")

    def answer() -> dict:
        err = ray.get(monitor.register.remote(*call))["error"]
        assert err is not None and err["type"] == "CheckpointSaveError" and err["kind"] == "checkpoint", err
        return err

    answer()
    assert _reg_records(root, 20) == ["reg-reg-s15-retried.json"]
    restart_monitor(monitor, how="sigkill")
    answer()
    assert status(monitor).step(20, SD).expected == 1 and status(monitor).step(20, CKPT).expected == 1
    coord.save_sync(lambda: write_step_file(root, 20, "sd.bin"), 20, is_state_dict=True)
    coord.wait_committed(20, is_state_dict=True, timeout_s=30)
    assert read_manifest(root, 20, SD).registered == 1
    answer()
    assert _reg_records(root, 20) == ["reg-reg-s15-retried.json"]
    assert status(monitor).step(20, SD).expected == 1
    restart_monitor(monitor, how="ray.kill")
    answer()
    _check_outcome(root, coord, [20])
    coord.close()


def test_a_registration_of_a_settled_step_writes_nothing_and_reports_the_failure(make_monitor, tmp_path):
    """The state dict of step 30 committed, its full checkpoint failed: every registration that
    concerns the checkpoint (one call or apart, is_state_dict either way) is answered with the
    failure and writes no ledger record; a state-dict unit then is refused before it runs (it
    could only count toward the failed checkpoint). Also after a restart."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(30, state_dict_thread_count=1, checkpoint_thread_count=1)
    coord.save_sync(lambda: write_step_file(root, 30, "sd.bin"), 30, is_state_dict=True)
    coord.wait_committed(30, is_state_dict=True, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(disk_full, 30)
    records = _reg_records(root, 30)
    for restarted in (False, True):
        if restarted:
            restart_monitor(monitor, how="sigkill")
        for kwargs in ({"state_dict_thread_count": 1, "checkpoint_thread_count": 1},
                       {"checkpoint_thread_count": 1}, {"state_dict_thread_count": 1},
                       {"is_state_dict": True, "checkpoint_thread_count": 1}):
            with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
                coord.register(30, **kwargs)
            assert _reg_records(root, 30) == records, kwargs
        with pytest.raises(ckptd.CheckpointSaveError, match="already failed"):
            coord.save_sync(lambda: write_step_file(root, 30, "late.bin"), 30, is_state_dict=True)
    assert not os.path.exists(f"{ckptd.step_dir(root, 30)}/late.bin")
    _check_outcome(root, coord, [30])
    coord.close()


def test_a_state_dict_registration_of_a_settled_step_writes_nothing(make_monitor, tmp_path):
    """Invariant 4 for ``register(S, is_state_dict=True, state_dict_thread_count=1)``: the state
    dict of S committed and its full checkpoint failed, so the unit it adds can count toward
    nothing (it is refused when it starts). It must write nothing under the ledger and be answered
    with the failure (or a clear error), not "ok"."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(31, state_dict_thread_count=1, checkpoint_thread_count=1)
    coord.save_sync(lambda: write_step_file(root, 31, "sd.bin"), 31, is_state_dict=True)
    coord.wait_committed(31, is_state_dict=True, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(disk_full, 31)
    records = _reg_records(root, 31)
    try:
        with pytest.raises(ckptd.CheckpointError):
            coord.register(31, is_state_dict=True, state_dict_thread_count=1)
        assert _reg_records(root, 31) == records
    finally:
        coord.close()


def test_a_full_checkpoint_with_no_checkpoint_count_waits_for_its_state_dict_unit_after_a_failure(
        make_monitor, tmp_path):
    """Trinity's ``register_and_monitor(S, state_dict_thread_count=2)`` is a full-checkpoint
    registration; with one of its two state-dict units failed before it came, it is answered with
    the failure of both kinds and writes nothing, and the other unit is refused; with a
    checkpoint unit failed first (step 41), it waits for both state-dict units (it adds up with a
    second call of one)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(disk_full, 40, is_state_dict=True)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full") as info:
        asyncio.run(coord.register_and_monitor(40, state_dict_thread_count=2))
    assert info.value.kind == "checkpoint"
    assert _reg_records(root, 40) == []
    with pytest.raises(ckptd.CheckpointSaveError, match="already failed"):
        coord.save_sync(lambda: write_step_file(root, 40, "sd.bin"), 40, is_state_dict=True)
    for kind in (SD, CKPT):
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(40, is_state_dict=kind is SD, timeout_s=30)
        assert read_manifest(root, 40, kind) is None

    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(disk_full, 41)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.register(41, state_dict_thread_count=1)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.register(41, state_dict_thread_count=1)  # adds up: two state-dict units
    coord.save_sync(lambda: write_step_file(root, 41, "sd-a.bin"), 41, is_state_dict=True)
    with pytest.raises(TimeoutError):
        coord.wait_committed(41, is_state_dict=True, timeout_s=0.3)
    assert read_manifest(root, 41, SD) is None
    coord.save_sync(lambda: write_step_file(root, 41, "sd-b.bin"), 41, is_state_dict=True)
    coord.wait_committed(41, is_state_dict=True, timeout_s=30)
    assert sorted(f.path for f in read_manifest(root, 41, SD).files) == ["sd-a.bin", "sd-b.bin"]
    assert read_manifest(root, 41, SD).registered == 2 and read_manifest(root, 41, CKPT) is None
    assert assert_trackers_verified(root) == {SD: 41, CKPT: None}
    coord.close()


@pytest.mark.parametrize("registration", ["full_checkpoint", "state_dict"])
def test_a_state_dict_of_a_failed_step_is_refused_once_retention_deletes_the_step(
        make_monitor, tmp_path, registration):
    """Step 3's checkpoint unit fails (it had created the step directory) before anything else of
    step 3 is registered or saved; step 5's state dict then commits, and its retention pass
    (slowed by the before_step_delete failpoint, as slow storage would) deletes step 3 as a
    failed leftover. A state dict of step 3 saved during that pass used to be admitted, commit,
    be reported committed, and then go to the trash with the step. Now the pass fails step 3's
    state dict before it starts: the save and the registration (as a full checkpoint, or as a
    state dict) are refused with the reason, nothing of step 3 is committed, and a restarted
    monitor still says so."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None, keep_every_n_steps=3)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")

    fail_checkpoint_unit(coord, root, 3)
    arm_in_monitor(monitor, "before_step_delete", "delay:4")
    try:
        coord.save_sync(lambda: write_step_file(root, 5, "sd.bin"), 5, is_state_dict=True)
        coord.register(5, is_state_dict=True, state_dict_thread_count=1)
        coord.wait_committed(5, is_state_dict=True, timeout_s=30)
        assert not ray.get(monitor.wait_retention.remote(0))  # the pass that deletes step 3 runs
        # ...and has fenced step 3's state dict (it may not have got that far yet on a loaded machine)
        wait_for(lambda: "retention deletes step 3" in (getattr(status(monitor).step(3, SD), "reason", None)
                                                       or ""), what="the retention pass to fence step 3")
        with pytest.raises(ckptd.CheckpointSaveError, match="retention deletes step 3"):
            coord.save_sync(lambda: write_step_file(root, 3, "sd.bin"), 3, is_state_dict=True)
        with pytest.raises(ckptd.CheckpointSaveError, match="disk full|retention deletes step 3"):
            if registration == "full_checkpoint":
                coord.register(3, state_dict_thread_count=1, checkpoint_thread_count=1)
            else:
                coord.register(3, is_state_dict=True, state_dict_thread_count=1)
        assert ray.get(monitor.wait_retention.remote(60))
    finally:
        arm_in_monitor(monitor, "before_step_delete", None)
    try:
        assert not os.path.exists(ckptd.step_dir(root, 3))  # deleted as a failed leftover
        assert_trackers_verified(root)
        for _ in range(2):
            with pytest.raises(ckptd.CheckpointSaveError, match="retention deletes step 3"):
                coord.wait_committed(3, is_state_dict=True, timeout_s=30)
            restart_monitor(monitor)  # the failure is recorded: a restarted monitor knows it
        ckptd.verify(root, 5)
    finally:
        coord.close()


def test_a_registration_waiting_for_a_failure_record_is_not_accepted_into_a_commit_in_flight(
        make_monitor, tmp_path, run_name):
    """Step 50: the state dict is registered (one unit); the checkpoint unit fails while storage
    refuses the failure record, so the full-checkpoint registration that comes next waits for that
    record. Meanwhile the state-dict unit finishes and its commit starts (held by the
    before_manifest failpoint). Then the failure record goes through. The waiting registration
    must not be accepted into the commit in flight: it waits for it, finds every kind it
    concerns settled, and writes nothing; the committed state dict's manifest and the ledger agree
    on the count."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    failing = ckptd.CheckpointCoordinator(monitor, worker_id="w1")  # its notification blocks
    # The state-dict unit comes from another process: this one's notifications queue up behind the
    # blocked one (group commit).
    worker = SaveWorker.remote(run_name, 0)
    ray.get(worker.pid.remote())
    coord.register(50, is_state_dict=True, state_dict_thread_count=1)
    arm_in_monitor(monitor, "before_failure_record", "raise")
    errors = []

    def fail_unit() -> None:
        try:
            failing.save_sync(disk_full, 50)
        except ckptd.CheckpointSaveError as e:
            errors.append(e)

    t = threading.Thread(target=fail_unit)
    t.start()
    try:
        wait_for(lambda: ray.get(monitor.__ray_call__.remote(
            lambda self: (50, CKPT) in self._failures_recorded and (50, CKPT) not in self._failures_durable)),
            what="the failure record's retry loop")
        ref = monitor.register.remote(50, {"state_dict": 1, "checkpoint": 1}, "checkpoint", "reg-s15-waiting")
        ready, _ = ray.wait([ref], timeout=0.5)
        assert not ready  # it waits for the failure record
        arm_in_monitor(monitor, "before_manifest", "delay:8")
        ray.get(worker.save.remote(50, "model", is_state_dict=True))
        assert ray.get(worker.wait_all.remote()) is None
        wait_for(lambda: ray.get(monitor.__ray_call__.remote(lambda self: 50 in self._committing)),
                 what="the state dict commit")
        arm_in_monitor(monitor, "before_failure_record", None)
        err = ray.get(ref, timeout=60)["error"]
        assert err is not None and err["kind"] == "checkpoint"
        t.join(60)
        coord.wait_committed(50, is_state_dict=True, timeout_s=30)
    finally:
        arm_in_monitor(monitor, "before_failure_record", None)
        arm_in_monitor(monitor, "before_manifest", None)
        t.join(60)
    try:
        assert errors and read_manifest(root, 50, SD).registered == 1
        assert status(monitor).step(50, SD).expected == 1  # no count added into the commit
        assert "reg-reg-s15-waiting.json" not in _reg_records(root, 50)
    finally:
        coord.close()
        failing.close()
        ray.kill(worker)
