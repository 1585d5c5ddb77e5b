"""The commit rule, one test per row of the semantics table in docs/contract.md (no Ray, no I/O)."""

from __future__ import annotations

import contextlib
import itertools
import random

import pytest

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError
from ckptd.manifest import FileEntry
from ckptd.monitor.ledger import StepLedger, StepState
from ckptd.protocol import Registration, UnitFailure, UnitId

SD, CKPT = Kind.STATE_DICT, Kind.CHECKPOINT
_ids = itertools.count()


def unit(step: int, kind: Kind = CKPT, name: str = "model", worker: str = "w0") -> UnitId:
    return UnitId(worker, name, step, kind, f"c{next(_ids)}")


def reg(step: int, sd: int = 0, ckpt: int = 0, monitored: Kind = CKPT, reg_id: str | None = None) -> Registration:
    return Registration(reg_id=reg_id or f"r{next(_ids)}", step=step, counts={SD: sd, CKPT: ckpt},
                        monitored=monitored, at=0.0)


def files(name: str = "a.bin") -> list[FileEntry]:
    return [FileEntry(path=name, size=1, crc32="00000000")]


def run(ledger: StepLedger, u: UnitId) -> None:
    assert ledger.admit(u, 0.0) is None
    rec, why = ledger.finish(u, files(u.key), 0.0)
    assert why is None


@pytest.fixture
def ledger() -> StepLedger:
    return StepLedger(step_timeout_s=100.0, unregistered_warning_s=10.0)


def test_registrations_add_up_and_a_retried_one_counts_once(ledger):
    r1 = reg(1, ckpt=1)
    ledger.register(r1)
    ledger.register(r1)  # Ray retried the call
    ledger.register(reg(1, ckpt=1))  # a second registration of the same step adds
    rec = ledger.get(1)
    assert rec[CKPT].expected == 2
    run(ledger, unit(1))
    assert ledger.ready(rec) == []
    run(ledger, unit(1, name="optim"))
    assert ledger.ready(rec) == [CKPT]


def test_each_save_call_is_a_unit_even_with_the_same_name_and_a_retried_notification_counts_once(ledger):
    ledger.register(reg(1, ckpt=2))
    rec = ledger.get(1)
    a, b = unit(1, name="model"), unit(1, name="model")  # two calls, same name and step
    run(ledger, a)
    ledger.finish(a, files(), 0.0)  # the notification again
    assert ledger.ready(rec) == []
    run(ledger, b)
    assert ledger.ready(rec) == [CKPT]


def test_state_dict_commits_when_its_registered_units_finished(ledger):
    ledger.register(reg(1, sd=2, monitored=SD))
    rec = ledger.get(1)
    run(ledger, unit(1, SD, "r0"))
    assert ledger.ready(rec) == []
    run(ledger, unit(1, SD, "r1"))
    assert ledger.ready(rec) == [SD]


def test_order_does_not_matter_units_may_finish_before_the_registration(ledger):
    run(ledger, unit(3, SD))
    assert ledger.ready(ledger.get(3)) == []
    ledger.register(reg(3, sd=1, monitored=SD))
    assert ledger.ready(ledger.get(3)) == [SD]


def test_a_full_checkpoint_waits_for_the_state_dict_units_of_its_step(ledger):
    ledger.register(reg(1, sd=1, ckpt=1))
    rec = ledger.get(1)
    run(ledger, unit(1, CKPT))
    assert ledger.ready(rec) == []  # the step's weights are still being written
    run(ledger, unit(1, SD))
    assert ledger.ready(rec) == [SD, CKPT]


def test_trinity_save_checkpoint_sync_state_dict_unit_registered_as_a_full_checkpoint(ledger):
    # save_sync(..., is_state_dict=True) on rank 0, then register_and_monitor(S, state_dict_thread_count=1)
    run(ledger, unit(5, SD, "sync"))
    ledger.register(reg(5, sd=1, monitored=CKPT))
    assert ledger.ready(ledger.get(5)) == [SD, CKPT]


def test_state_dict_then_full_checkpoint_of_the_same_step(ledger):
    ledger.register(reg(2, sd=2, monitored=SD))
    rec = ledger.get(2)
    run(ledger, unit(2, SD, "r0"))
    run(ledger, unit(2, SD, "r1"))
    assert ledger.ready(rec) == [SD]
    ledger.begin_commit(rec, [SD], 0.0)
    ledger.commit_done(rec, SD, 0.0, ["a", "b"], [])
    # save_checkpoint(S): the engine's save is a state-dict unit, after the state dict committed
    late_sd = unit(2, SD, "sync")
    assert ledger.admit(late_sd, 0.0) is None
    ledger.finish(late_sd, files("full.bin"), 0.0)
    assert rec.units[late_sd.key].after_sd_commit
    assert ledger.ready(rec) == []  # not registered yet: Trinity's counter is at -1
    ledger.register(reg(2, sd=1, monitored=CKPT))
    assert rec[SD].expected == 3
    assert ledger.ready(rec) == [CKPT]


def test_a_running_unit_holds_the_commit(ledger):
    ledger.register(reg(1, ckpt=1))
    a, b = unit(1), unit(1, name="extra")
    run(ledger, a)
    assert ledger.admit(b, 0.0) is None  # admitted, still writing
    assert ledger.ready(ledger.get(1)) == []


def test_more_units_than_registered_hold_the_step_are_flagged_and_time_out(ledger):
    ledger.register(reg(1, ckpt=1))
    run(ledger, unit(1))
    run(ledger, unit(1, name="extra"))
    rec = ledger.get(1)
    assert ledger.ready(rec) == []
    assert any("2 units saved but only 1 were registered" in w for w in ledger.warnings(1.0))
    expired = ledger.expire(1000.0)
    assert [(r.step, k) for r, k in expired] == [(1, CKPT)]
    assert "only 1 were registered" in rec[CKPT].reason


def test_a_failed_state_dict_unit_fails_both_kinds(ledger):
    ledger.register(reg(1, sd=1, ckpt=1))
    u = unit(1, SD)
    ledger.admit(u, 0.0)
    rec = ledger.fail(u, UnitFailure(unit=u.label, error_type="OSError", message="disk full"), 0.0)
    assert rec[SD].state is StepState.FAILED and rec[CKPT].state is StepState.FAILED
    assert ledger.failure_of(1, CKPT) == ("w0/model", "OSError: disk full")
    assert ledger.admit(unit(1, CKPT), 0.0) is not None  # nothing more is written for it


def test_a_failed_unit_after_the_state_dict_commit_fails_only_the_full_checkpoint(ledger):
    ledger.register(reg(1, sd=1, monitored=SD))
    rec = ledger.get(1)
    run(ledger, unit(1, SD))
    ledger.begin_commit(rec, [SD], 0.0)
    ledger.commit_done(rec, SD, 0.0, [], [])
    u = unit(1, SD, "sync")
    ledger.admit(u, 0.0)
    ledger.fail(u, UnitFailure(unit=u.label, error_type="OSError", message="x"), 0.0)
    assert rec[SD].state is StepState.COMMITTED and rec[CKPT].state is StepState.FAILED


@pytest.mark.parametrize("failure_first", [False, True])
def test_a_failed_checkpoint_unit_leaves_the_state_dict_of_its_step_to_commit_in_either_order(
        ledger, failure_first):
    """Found by the chaos test (seed 2510326555): a full checkpoint registered with state-dict
    units, whose checkpoint unit failed before the registration came, kept its state dict from
    ever committing. The outcome may not depend on that order."""
    ck = unit(1, CKPT, "optim")
    r = reg(1, sd=1, ckpt=1)

    def fail_ck():
        ledger.admit(ck, 0.0)
        ledger.fail(ck, UnitFailure(unit=ck.label, error_type="OSError", message="disk full"), 0.0)

    if failure_first:
        fail_ck()
        assert not ledger.registration_is_moot(r)  # its state dict can still commit: apply it
        ledger.register(r)
    else:
        ledger.register(r)
        fail_ck()
    rec = ledger.get(1)
    run(ledger, unit(1, SD))
    assert ledger.ready(rec) == [SD] and rec[CKPT].state is StepState.FAILED
    # A registration whose every kind has settled changes nothing: it is not applied.
    assert ledger.registration_is_moot(reg(1, ckpt=1))
    ledger.begin_commit(rec, [SD], 0.0)
    ledger.commit_done(rec, SD, 0.0, [], [])
    assert ledger.registration_is_moot(reg(1, sd=1, ckpt=1))
    assert not ledger.registration_is_moot(reg(2, ckpt=1))


def test_nothing_is_admitted_into_a_committed_checkpoint_and_late_units_do_not_count(ledger):
    ledger.register(reg(1, ckpt=1))
    rec = ledger.get(1)
    u = unit(1)
    ledger.admit(u, 0.0)
    ledger.finish(u, files(), 0.0)
    ledger.begin_commit(rec, [CKPT], 0.0)
    ledger.commit_done(rec, CKPT, 0.0, [u.key], [])
    assert "already committed as a checkpoint" in ledger.admit(unit(1), 0.0)
    assert "already committed as a checkpoint" in ledger.admit(unit(1, SD), 0.0)
    rec2, why = ledger.finish(unit(1, name="late"), files(), 0.0)  # never admitted (monitor restarted)
    assert rec2 is None and "after the step was committed" in why
    with pytest.raises(CheckpointConfigError, match="retire"):
        ledger.register(reg(1, ckpt=1))


def test_a_registration_that_would_commit_nothing_is_refused(ledger):
    with pytest.raises(CheckpointConfigError, match="no save units"):
        ledger.register(reg(1, monitored=CKPT))
    with pytest.raises(CheckpointConfigError, match="state_dict_thread_count"):
        ledger.register(reg(1, ckpt=2, monitored=SD))


def test_timeout_names_what_is_missing(ledger):
    ledger.register(reg(4, ckpt=3))
    run(ledger, unit(4, name="a"))
    assert ledger.expire(99.0) == []
    (rec, kind), = ledger.expire(101.0)
    assert kind is CKPT and rec[CKPT].reason.startswith("timed out after 100 s: 1 of 3 registered units finished")


def test_warnings_for_an_unregistered_kind_and_for_registered_units_that_never_started(ledger):
    u = unit(1, SD)
    assert ledger.admit(u, 0.0) is None
    ledger.finish(u, files(), 0.0)
    ledger.register(reg(2, ckpt=2))
    assert ledger.warnings(5.0) == []
    warnings = ledger.warnings(20.0)
    assert any(w.startswith("step 1 (state_dict): 1 units saved but the step is not registered") for w in warnings)
    assert any(w.startswith("step 2 (checkpoint): 2 units registered but none has started") for w in warnings)


def test_a_deferred_state_dict_waits_for_the_checkpoint_units_writing_beside_it(ledger):
    ledger.register(reg(1, sd=1, ckpt=1, monitored=SD))
    rec = ledger.get(1)
    run(ledger, unit(1, SD))
    ck = unit(1, CKPT)
    ledger.admit(ck, 0.0)
    assert ledger.ready(rec) == [SD]
    ledger.begin_commit(rec, [SD], 0.0)
    ledger.defer(rec, SD)  # the commit path found files no unit reported
    assert ledger.ready(rec) == []
    ledger.finish(ck, files("opt.bin"), 0.0)
    assert ledger.ready(rec) == [SD]


def test_replayed_records_rebuild_the_same_state(ledger):
    r = reg(7, sd=1, ckpt=1)
    a, b = unit(7, SD), unit(7, CKPT)
    fresh = StepLedger(100.0)
    for led in (ledger, fresh):
        led.register(r, replay=led is fresh)
        led.finish(a, files(), 0.0)
        led.finish(b, files("b"), 0.0)
    assert ledger.ready(ledger.get(7)) == fresh.ready(fresh.get(7)) == [SD, CKPT]


def test_pruned_steps_still_answer(ledger):
    for step in range(5):
        ledger.register(reg(step, ckpt=1))
        u = unit(step)
        run(ledger, u)
        rec = ledger.get(step)
        ledger.begin_commit(rec, [CKPT], 0.0)
        ledger.commit_done(rec, CKPT, 0.0, [u.key], [])
    ledger.prune(2)
    assert [r.step for r in ledger.records()] == [3, 4]
    assert ledger.is_committed(0, CKPT)
    assert ledger.admit(unit(0), 0.0) is not None


def _scanned_ready(ledger: StepLedger, rec) -> list[Kind]:
    """The commit rule computed the slow way, from the units themselves (the reference the
    tallies must agree with)."""
    def complete(units, expected):
        return len(units) == expected and all(u.files is not None for u in units)

    out = []
    sd, ck = rec[SD], rec[CKPT]
    ck_running = any(u.running for u in rec.units.values() if u.unit.kind is CKPT)
    if (sd.state is StepState.PENDING and (sd.monitored or ck.monitored) and sd.expected > 0
            and complete(rec.counted(SD), sd.expected) and not (sd.deferred and ck_running)):
        out.append(SD)
    sd_done = sd.state is StepState.COMMITTED or SD in out or sd.expected == 0
    if (ck.state is StepState.PENDING and ck.monitored and sd.expected + ck.expected > 0 and sd_done
            and sd.state is not StepState.FAILED
            and complete([u for u in rec.units.values() if u.unit.kind is SD], sd.expected)
            and complete([u for u in rec.units.values() if u.unit.kind is CKPT], ck.expected)):
        out.append(CKPT)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_commit_rule_reads_tallies_that_always_agree_with_the_units(seed):
    """ready() runs on every notification and must not scan a step's units (40,000 at 10,000
    ranks x 4). Its per-step tallies must say what a scan would, after any sequence of
    registrations, admissions, finishes, failures, duplicates and commits."""
    rnd = random.Random(seed)
    ledger = StepLedger(step_timeout_s=1e9, unregistered_warning_s=1e9)
    units: list[UnitId] = []
    for _ in range(120):
        op = rnd.random()
        if op < 0.15:
            with contextlib.suppress(CheckpointConfigError):  # refused: nothing changes
                ledger.register(reg(1, sd=rnd.randint(0, 2), ckpt=rnd.randint(0, 2),
                                    monitored=rnd.choice([SD, CKPT])))
        elif op < 0.45:
            u = unit(1, rnd.choice([SD, CKPT]), f"n{len(units)}")
            if ledger.admit(u, 0.0) is None:
                units.append(u)
        elif op < 0.75 and units:
            u = rnd.choice(units)  # a duplicate now and then: it counts once
            ledger.finish(u, files(u.key), 0.0)
        elif op < 0.80 and units:
            u = rnd.choice(units)
            ledger.fail(u, UnitFailure(unit=u.label, error_type="OSError", message="disk full"), 0.0)
        rec = ledger.get(1)
        if rec is None:
            continue
        for kind in Kind:
            mine = [u for u in rec.units.values() if u.unit.kind is kind]
            t = rec.tallies[kind]
            assert (t.total, t.finished, t.failed) == (
                len(mine), sum(u.files is not None for u in mine), sum(u.failure is not None for u in mine))
            assert rec.active(kind) == (rec[kind].expected > 0 or rec[kind].monitored
                                        or rec[kind].state is not StepState.PENDING or bool(mine))
        counted = rec.counted(SD)
        assert (rec.counted_sd.total, rec.counted_sd.finished) == (
            len(counted), sum(u.files is not None for u in counted))
        expected = _scanned_ready(ledger, rec)
        assert ledger.ready(rec) == expected
        if expected and rnd.random() < 0.5:  # commit what is ready; later units come after it
            ledger.begin_commit(rec, expected, 0.0)
            for kind in expected:
                keys = [u.unit.key for u in rec.counted(kind) if u.files is not None]
                ledger.commit_done(rec, kind, 0.0, keys, [])


def test_retention_fences_only_a_state_dict_nobody_has_asked_for_of_a_failed_checkpoint(ledger):
    def failed_checkpoint(step: int) -> None:
        u = unit(step, CKPT, "optim")
        ledger.admit(u, 0.0)
        ledger.fail(u, UnitFailure(unit=u.label, error_type="OSError", message="disk full"), 0.0)

    failed_checkpoint(1)
    rec = ledger.fence_state_dict(1, newest=5, now=0.0)
    assert rec is not None and rec[SD].state is StepState.FAILED
    assert "retention deletes step 1" in rec[SD].reason and "disk full" in rec[SD].reason
    assert "retention deletes step 1" in ledger.admit(unit(1, SD), 0.0)  # nothing more is admitted
    assert ledger.fence_state_dict(1, newest=5, now=0.0) is None  # once
    failed_checkpoint(2)
    ledger.register(reg(2, sd=1, monitored=SD))  # asked for: the step is in flight, never fenced
    assert ledger.fence_state_dict(2, newest=5, now=0.0) is None and ledger.get(2)[SD].state is StepState.PENDING
    ledger.register(reg(3, ckpt=1))  # the full checkpoint did not fail
    assert ledger.fence_state_dict(3, newest=5, now=0.0) is None


def test_a_state_dict_count_can_affect_the_full_checkpoint(ledger):
    assert StepLedger.kinds_affected(reg(1, sd=1, monitored=SD)) == {SD, CKPT}
    assert StepLedger.kinds_affected(reg(1, ckpt=1)) == {CKPT}
    assert StepLedger.kinds_concerned(reg(1, sd=1, monitored=SD)) == {SD}
