"""Session 15: the commit rule after commit 35b11c8 (a registration is applied, and the failure
still answered, unless every kind it concerns has settled), attacked on the ledger alone (no Ray,
no I/O).

Each test drives one step through every interleaving of its events (registrations, unit starts,
unit ends, with each unit's start before its end) with the monitor's registration gate as
``CheckpointMonitor.register`` applies it (``check_registration``; answered with the failure,
and dropped, only when a concerned kind failed and ``registration_is_moot``), committing every
kind the moment ``ready`` says so. Attacked:

* the outcome of each kind does not depend on the order (a full checkpoint registered in one
  call or split in two calls that add up; Trinity's state dict then full checkpoint of the same
  step with a state-dict unit each; a failing checkpoint unit, a failing state-dict unit);
* a failed state-dict unit fails both kinds, a failed checkpoint unit only the full checkpoint;
* a registration answered with a failure is applied only while a kind it concerns can commit,
  and one whose kinds have all settled changes nothing.

Held: every interleaving of every scenario below ends with the same state per kind, as the
contract's table says.
"""

from __future__ import annotations

import itertools

import pytest

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError
from ckptd.manifest import FileEntry
from ckptd.monitor.ledger import StepLedger, StepState
from ckptd.protocol import Registration, UnitFailure, UnitId

SD, CKPT = Kind.STATE_DICT, Kind.CHECKPOINT
STEP = 7


def _reg(name: str, monitored: Kind, sd: int = 0, ckpt: int = 0) -> Registration:
    return Registration(reg_id=name, step=STEP, counts={SD: sd, CKPT: ckpt}, monitored=monitored, at=0.0)


def _unit(name: str, kind: Kind) -> UnitId:
    return UnitId("w0", name, STEP, kind, f"call-{name}")


class _Run:
    """One interleaving: the ledger, and what each caller was answered."""

    def __init__(self) -> None:
        self.ledger = StepLedger(step_timeout_s=3600.0, unregistered_warning_s=60.0)
        self.answers: dict[str, str] = {}  # registration or unit -> "ok" / "failed" / "refused" / "dropped"
        self.admitted: set[str] = set()

    def register(self, reg: Registration) -> None:
        ledger = self.ledger
        try:
            ledger.check_registration(reg)
        except CheckpointConfigError:
            self.answers[reg.reg_id] = "refused"
            return
        failed = any(ledger.failure_of(STEP, k) for k in ledger.kinds_concerned(reg))
        if failed and ledger.registration_is_moot(reg):
            self.answers[reg.reg_id] = "dropped"
            return
        rec = ledger.register(reg)
        self._commit_ready(rec)
        self.answers[reg.reg_id] = "failed" if any(
            ledger.failure_of(STEP, k) for k in ledger.kinds_concerned(reg)) else "ok"

    def start(self, u: UnitId) -> None:
        why = self.ledger.admit(u, 0.0)
        if why is None:
            self.admitted.add(u.key)
        else:
            self.answers[u.name] = "refused"

    def end(self, u: UnitId, ok: bool) -> None:
        if u.key not in self.admitted:
            return  # refused before it ran: it wrote nothing and reports nothing
        if ok:
            rec, why = self.ledger.finish(u, [FileEntry(path=f"{u.name}.bin", size=1, crc32="00000000")], 0.0)
            assert why is None, why
        else:
            rec = self.ledger.fail(u, UnitFailure(unit=u.label, error_type="OSError", message="disk full"), 0.0)
        self._commit_ready(rec)

    def _commit_ready(self, rec) -> None:
        while kinds := self.ledger.ready(rec):
            self.ledger.begin_commit(rec, kinds, 0.0)
            for kind in kinds:
                units = [u.unit.key for u in (rec.counted(SD) if kind is SD else rec.units.values())
                         if u.files is not None]
                self.ledger.commit_done(rec, kind, 0.0, units, [])

    def state(self, kind: Kind) -> StepState | None:
        return self.ledger.state_of(STEP, kind)


def _interleavings(regs: list[Registration], units: list[tuple[UnitId, bool]], split: bool = False):
    """Every order of the events in which each unit starts before it ends. ``split``: the
    registrations add up to the step's counts, so each comes before any unit that succeeds ends
    (else the step commits on the first one's counts alone, as Trinity's counters would);
    failures may come anywhere."""
    events = [("reg", r) for r in regs] + [("start", u) for u, _ in units] + [("end", u) for u, _ in units]
    outcome = {u.key: ok for u, ok in units}
    for order in itertools.permutations(range(len(events))):
        pos = {events[i][0] + (events[i][1].key if events[i][0] != "reg" else events[i][1].reg_id): n
               for n, i in enumerate(order)}
        if any(pos["start" + u.key] > pos["end" + u.key] for u, _ in units):
            continue
        if split and any(pos["reg" + r.reg_id] > pos["end" + u.key] for r in regs for u, ok in units if ok):
            continue
        run = _Run()
        for i in order:
            what, x = events[i]
            if what == "reg":
                run.register(x)
            elif what == "start":
                run.start(x)
            else:
                run.end(x, outcome[x.key])
        yield [f"{w}:{getattr(x, 'reg_id', None) or x.name}" for w, x in (events[i] for i in order)], run


SCENARIOS = {
    # Trinity's save_checkpoint: one call registers both kinds; the checkpoint unit fails.
    "one_call_ckpt_unit_fails": (
        [_reg("R", CKPT, sd=1, ckpt=1)],
        [(_unit("sd", SD), True), (_unit("optim", CKPT), False)],
        {SD: StepState.COMMITTED, CKPT: StepState.FAILED},
    ),
    # The same counts in two calls that add up (the state-dict count in the second).
    "split_ckpt_first_ckpt_unit_fails": (
        [_reg("R1", CKPT, ckpt=1), _reg("R2", CKPT, sd=1)],
        [(_unit("sd", SD), True), (_unit("optim", CKPT), False)],
        {SD: StepState.COMMITTED, CKPT: StepState.FAILED},
    ),
    # A state dict registered on its own, and the full checkpoint registered apart.
    "split_sd_then_ckpt_ckpt_unit_fails": (
        [_reg("R1", SD, sd=1), _reg("R2", CKPT, ckpt=1)],
        [(_unit("sd", SD), True), (_unit("optim", CKPT), False)],
        {SD: StepState.COMMITTED, CKPT: StepState.FAILED},
    ),
    # A failed state-dict unit fails both kinds, in every order.
    "one_call_sd_unit_fails": (
        [_reg("R", CKPT, sd=1, ckpt=1)],
        [(_unit("sd", SD), False), (_unit("optim", CKPT), True)],
        {SD: StepState.FAILED, CKPT: StepState.FAILED},
    ),
    "split_sd_unit_fails": (
        [_reg("R1", CKPT, ckpt=1), _reg("R2", CKPT, sd=1)],
        [(_unit("sd", SD), False), (_unit("optim", CKPT), True)],
        {SD: StepState.FAILED, CKPT: StepState.FAILED},
    ),
    # Everything succeeds: both kinds commit in every order.
    "one_call_all_finish": (
        [_reg("R", CKPT, sd=1, ckpt=1)],
        [(_unit("sd", SD), True), (_unit("optim", CKPT), True)],
        {SD: StepState.COMMITTED, CKPT: StepState.COMMITTED},
    ),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_interleaving_of_a_step_ends_with_the_same_outcome_per_kind(scenario):
    regs, units, expected = SCENARIOS[scenario]
    seen = 0
    for order, run in _interleavings(regs, units, split=len(regs) > 1):
        seen += 1
        assert {k: run.state(k) for k in Kind} == expected, order
        for r in regs:
            # Told "ok" only if no kind it concerns had failed by then; dropped only if the
            # failure came before it (and applied otherwise, whatever it was answered).
            if run.answers[r.reg_id] == "dropped":
                assert order.index(f"reg:{r.reg_id}") > min(order.index("end:sd"), order.index("end:optim")), order
            else:
                assert r.reg_id in run.ledger.get(STEP).registrations, order
    assert seen >= 20


def test_trinity_state_dict_then_full_checkpoint_with_a_failing_checkpoint_unit_in_every_order():
    """save_state_dict(S) (one state-dict unit), then save_checkpoint(S) (its own state-dict unit
    and a checkpoint unit that fails), registered as Trinity does: the state dict of S commits in
    every order (before the change it never did when the failure came before the second
    registration and both state-dict units had started), and the full checkpoint fails."""
    regs = [_reg("Rsd", SD, sd=1), _reg("Rck", CKPT, sd=1, ckpt=1)]
    units = [(_unit("sd1", SD), True), (_unit("sd2", SD), True), (_unit("optim", CKPT), False)]
    seen = 0
    for order, run in _interleavings(regs, units):
        seen += 1
        assert run.state(SD) is StepState.COMMITTED and run.state(CKPT) is StepState.FAILED, order
        rec = run.ledger.get(STEP)
        # What the state dict committed is every unit admitted before its commit: never a unit
        # refused, never fewer units than the registrations applied before the commit asked for.
        assert rec[SD].committed_units <= run.admitted
        assert len(rec[SD].committed_units) in (1, 2), order
        if run.answers["Rck"] == "dropped":
            # Dropped only when the state dict had committed and the checkpoint had failed.
            assert order.index("reg:Rck") > order.index("end:optim"), order
    assert seen > 1000


def test_a_registration_of_a_settled_step_changes_nothing_in_the_ledger():
    """Once the state dict committed and the full checkpoint failed, any registration of the step
    is moot: the gate drops it when a concerned kind failed, so the step's counts stay put."""
    run = _Run()
    run.register(_reg("R", CKPT, sd=1, ckpt=1))
    run.start(_unit("sd", SD))
    run.end(_unit("sd", SD), True)
    run.start(_unit("optim", CKPT))
    run.end(_unit("optim", CKPT), False)
    rec = run.ledger.get(STEP)
    before = (rec[SD].expected, rec[CKPT].expected, set(rec.registrations))
    for r in (_reg("A", CKPT, sd=1, ckpt=1), _reg("B", CKPT, ckpt=1), _reg("C", SD, ckpt=1)):
        assert run.ledger.registration_is_moot(r)
        run.register(r)
        assert run.answers[r.reg_id] == "dropped"
    assert (rec[SD].expected, rec[CKPT].expected, set(rec.registrations)) == before
