"""The commit rule, in every order of arrival."""

from __future__ import annotations

import itertools

import pytest

from ckptd.config import Kind
from ckptd.errors import RegistrationConflictError
from ckptd.manifest import FileEntry
from ckptd.monitor.ledger import StepLedger, StepState, UnitFailure
from ckptd.units import UnitId

CK = Kind.CHECKPOINT


def unit(worker: str, step: int = 1, name: str = "model", kind: Kind = CK) -> UnitId:
    return UnitId(worker, name, step, kind)


def files(name: str) -> list[FileEntry]:
    return [FileEntry(path=name, size=1, crc32="00000000")]


def failure(u: UnitId) -> UnitFailure:
    return UnitFailure(unit=u.label, error_type="OSError", message="disk full")


def test_commits_only_when_all_registered_units_finished():
    ledger = StepLedger(step_timeout_s=60)
    rec = ledger.register(1, CK, 2, now=0)
    assert not ledger.is_ready(rec)
    ledger.finish(unit("a"), files("a"), now=1)
    assert not ledger.is_ready(rec)
    ledger.finish(unit("b"), files("b"), now=2)
    assert ledger.is_ready(rec)


@pytest.mark.parametrize("order", list(itertools.permutations(["register", "start_a", "finish_a", "finish_b"])))
def test_order_of_arrival_does_not_matter(order):
    ledger = StepLedger(step_timeout_s=60)
    events = {
        "register": lambda: ledger.register(1, CK, 2, now=0),
        "start_a": lambda: ledger.start(unit("a"), now=0),
        "finish_a": lambda: ledger.finish(unit("a"), files("a"), now=0),
        "finish_b": lambda: ledger.finish(unit("b"), files("b"), now=0),
    }
    needed = {"register", "finish_a", "finish_b"}  # a late "started" changes nothing
    seen = set()
    for name in order:
        rec = events[name]()
        seen.add(name)
        assert ledger.is_ready(rec) == (needed <= seen), (order, name)


def test_finish_before_registration_is_kept():
    ledger = StepLedger(step_timeout_s=60)
    ledger.finish(unit("a"), files("a"), now=0)
    rec = ledger.get(1, CK)
    assert not ledger.is_ready(rec)  # no registration yet: never commit
    assert ledger.is_ready(ledger.register(1, CK, 1, now=1))


def test_duplicate_notifications_count_once():
    ledger = StepLedger(step_timeout_s=60)
    rec = ledger.register(1, CK, 2, now=0)
    for _ in range(3):
        ledger.start(unit("a"), now=0)
        ledger.finish(unit("a"), files("a"), now=0)
    assert len(rec.finished) == 1 and not ledger.is_ready(rec)
    ledger.finish(unit("b"), files("b"), now=0)
    assert ledger.is_ready(rec)


def test_same_worker_and_name_in_other_step_or_kind_is_another_unit():
    ledger = StepLedger(step_timeout_s=60)
    ledger.register(1, CK, 1, now=0)
    ledger.register(2, CK, 1, now=0)
    ledger.register(1, Kind.STATE_DICT, 1, now=0)
    ledger.finish(unit("a", step=2), files("x"), now=0)
    ledger.finish(unit("a", kind=Kind.STATE_DICT), files("x"), now=0)
    assert not ledger.is_ready(ledger.get(1, CK))
    assert ledger.is_ready(ledger.get(2, CK)) and ledger.is_ready(ledger.get(1, Kind.STATE_DICT))


def test_a_failed_unit_fails_the_step_even_if_the_count_is_reached():
    ledger = StepLedger(step_timeout_s=60)
    rec = ledger.register(1, CK, 2, now=0)
    ledger.fail(unit("a"), failure(unit("a")), now=0)
    ledger.finish(unit("b"), files("b"), now=0)
    ledger.finish(unit("a"), files("a"), now=0)  # a retry reporting success does not undo it
    assert rec.state is StepState.FAILED and not ledger.is_ready(rec)
    assert ledger.failure_of(1, CK) == ("a/model", "OSError: disk full")


def test_failure_does_not_touch_other_steps():
    ledger = StepLedger(step_timeout_s=60)
    ledger.register(1, CK, 1, now=0)
    ledger.register(2, CK, 1, now=0)
    ledger.fail(unit("a", step=1), failure(unit("a", step=1)), now=0)
    assert ledger.is_ready(ledger.finish(unit("a", step=2), files("a"), now=0))


def test_conflicting_registration_is_refused_and_same_one_is_idempotent():
    ledger = StepLedger(step_timeout_s=60)
    ledger.register(1, CK, 2, now=0)
    ledger.register(1, CK, 2, now=5)
    assert ledger.get(1, CK).registered_at == 0
    with pytest.raises(RegistrationConflictError, match="already registered with 2 units"):
        ledger.register(1, CK, 3, now=0)
    assert ledger.get(1, CK).expected == 2


def test_more_units_than_registered_fails_the_step_instead_of_committing_early():
    ledger = StepLedger(step_timeout_s=60)
    ledger.start(unit("a"), now=0)
    ledger.start(unit("b"), now=0)
    ledger.finish(unit("a"), files("a"), now=0)
    rec = ledger.register(1, CK, 1, now=0)
    assert rec.state is StepState.FAILED
    assert "2 units saved step 1" in rec.reason


def test_timeout_fails_pending_steps_with_a_reason():
    ledger = StepLedger(step_timeout_s=10)
    ledger.register(1, CK, 2, now=0)
    ledger.finish(unit("a"), files("a"), now=1)
    ledger.finish(unit("z", step=2), files("z"), now=5)
    assert ledger.expire(now=9.9) == []
    expired = ledger.expire(now=10)
    assert [r.step for r in expired] == [1]
    assert "timed out after 10 s: 1 of 2 registered units finished" in expired[0].reason
    expired = ledger.expire(now=15)
    assert [r.step for r in expired] == [2] and "never registered" in expired[0].reason
    assert ledger.expire(now=100) == []


def test_committed_steps_ignore_late_notifications_and_survive_pruning():
    ledger = StepLedger(step_timeout_s=10)
    for step in range(5):
        rec = ledger.register(step, CK, 1, now=0)
        ledger.finish(unit("a", step=step), files("a"), now=0)
        ledger.begin_commit(rec)
        ledger.commit_done(rec, now=1)
    ledger.register(9, CK, 1, now=0)
    ledger.fail(unit("a", step=9), failure(unit("a", step=9)), now=0)
    ledger.prune(keep=2)
    assert [r.step for r in ledger.records()] == [4, 9]
    assert ledger.is_committed(0, CK)
    rec = ledger.finish(unit("late", step=0), files("x"), now=2)
    assert rec.state is StepState.COMMITTED and not ledger.is_ready(rec)
    assert ledger.expire(now=1000) == []


def test_pruned_failed_step_still_reports_its_failure():
    ledger = StepLedger(step_timeout_s=10)
    ledger.register(1, CK, 1, now=0)
    ledger.fail(unit("a"), failure(unit("a")), now=0)
    for step in range(2, 5):
        rec = ledger.register(step, CK, 1, now=0)
        ledger.finish(unit("a", step=step), files("a"), now=0)
        ledger.begin_commit(rec)
        ledger.commit_done(rec, now=1)
    ledger.prune(keep=1)
    assert ledger.get(1, CK) is None
    assert ledger.failure_of(1, CK) == ("a/model", "OSError: disk full")
