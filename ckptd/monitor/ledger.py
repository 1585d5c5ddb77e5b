"""The step ledger and the commit rule: plain Python, no Ray, no I/O.

These are Trinity-RFT's CheckpointMonitor semantics, made exact:

* Registrations of a step add up per kind; a registration carries an id, so a retried call
  counts once. ``register(S, monitored=K)`` also asks for kind K of S to be committed.
* Every save call is one unit (:class:`~ckptd.protocol.UnitId`); a retried notification of the
  same call counts once.
* The state dict of S commits when it is asked for (monitored as a state dict, or as a full
  checkpoint), at least one state-dict unit is registered, all registered state-dict units have
  finished, none is still running and none failed.
* The checkpoint of S commits when it is asked for, all registered units of S of both kinds have
  finished, none is running and none failed. Its commit moves both trackers.
* Once the state dict of S is committed, state-dict units of S may still come (Trinity's full
  checkpoint wraps the engine's save in one): they count toward the full checkpoint of S only.
  Once the checkpoint of S is committed, nothing more is admitted.
* More units than registered do not fail a step (a later registration may add the count, as
  Trinity's counters allow); they hold it, are flagged by :meth:`StepLedger.warnings`, and the
  step fails at its timeout.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError, RegistrationConflictError
from ckptd.manifest import FileEntry
from ckptd.monitor.records import CKPT, SD, KindRecord, StepRecord, StepState, Tally, UnitRecord
from ckptd.protocol import Registration, UnitFailure, UnitId

__all__ = ["CKPT", "SD", "KindRecord", "StepLedger", "StepRecord", "StepState", "Tally", "UnitRecord"]

class StepLedger:
    """Per step: registrations, units and the state of each kind.

    Args:
        step_timeout_s: A kind not settled this long after its step was first seen fails.
        unregistered_warning_s: A finished unit whose kind nobody registered (or asked to commit)
            this long is flagged by :meth:`warnings`.
    """

    def __init__(self, step_timeout_s: float, unregistered_warning_s: float = 60.0) -> None:
        self.step_timeout_s = step_timeout_s
        self.unregistered_warning_s = unregistered_warning_s
        self._records: dict[int, StepRecord] = {}
        # Steps dropped from the detailed records (see prune): enough to answer late callers.
        self._retired: dict[tuple[int, Kind], tuple[StepState, str | None, str | None]] = {}

    # -- lookups -------------------------------------------------------------------------------

    def get(self, step: int) -> StepRecord | None:
        return self._records.get(step)

    def records(self) -> list[StepRecord]:
        return [self._records[s] for s in sorted(self._records)]

    def state_of(self, step: int, kind: Kind) -> StepState | None:
        rec = self._records.get(step)
        if rec is not None:
            return rec[kind].state
        retired = self._retired.get((step, kind))
        return retired[0] if retired else None

    def could_settle(self, step: int, kind: Kind) -> bool:
        """Whether anything known of the step could still settle ``kind``: the kind has
        registrations, units or an outcome, or it is the state dict and the step's full checkpoint
        (whose commit commits the state dict for readers) is active and has not failed."""
        rec = self._records.get(step)
        if rec is None:
            return (step, kind) in self._retired
        if rec.active(kind):
            return True
        return kind is SD and rec.active(CKPT) and rec[CKPT].state is not StepState.FAILED

    def is_committed(self, step: int, kind: Kind) -> bool:
        return self.state_of(step, kind) is StepState.COMMITTED

    def failure_of(self, step: int, kind: Kind) -> tuple[str | None, str] | None:
        """(unit, cause) if the kind of the step failed, else None."""
        rec = self._records.get(step)
        if rec is not None:
            k = rec[kind]
            return (k.failed_unit, k.reason or "unknown reason") if k.state is StepState.FAILED else None
        retired = self._retired.get((step, kind))
        if retired and retired[0] is StepState.FAILED:
            return retired[1], retired[2] or "unknown reason"
        return None

    def newest_committed(self) -> int | None:
        """The newest step with a kind committed or being committed, among the detailed records."""
        return max((r.step for r in self._records.values()
                    if any(r[k].state in (StepState.COMMITTED, StepState.COMMITTING) for k in Kind)), default=None)

    def in_flight_steps(self) -> set[int]:
        """Steps with an active kind that is not settled yet, or a unit still running (a unit
        of a settled state dict counts toward a full checkpoint not registered yet)."""
        return {r.step for r in self._records.values()
                if r.has_running() or any(r.active(k) and not r[k].settled for k in Kind)}

    def committing_steps(self) -> set[int]:
        """Steps with a kind whose commit is in flight (its manifest may be visible already)."""
        return {r.step for r in self._records.values() if any(r[k].state is StepState.COMMITTING for k in Kind)}

    def withdrawing_steps(self) -> set[int]:
        """Steps whose committed state dict is being withdrawn (its manifest may still be there),
        or checked against storage, which may withdraw it: retention keeps them, uncounted."""
        return {r.step for r in self._records.values() if r[SD].withdrawing or r[SD].checks}

    def failed_steps(self) -> set[int]:
        failed = {r.step for r in self._records.values() if any(r[k].state is StepState.FAILED for k in Kind)}
        return failed | {s for (s, _), v in self._retired.items() if v[0] is StepState.FAILED}

    def _record(self, step: int, now: float) -> StepRecord:
        rec = self._records.get(step)
        if rec is None:
            rec = self._records[step] = StepRecord(step=step, first_seen=now)
            for kind in Kind:
                retired = self._retired.pop((step, kind), None)
                if retired is not None:
                    rec[kind].state, rec[kind].failed_unit, rec[kind].reason = retired
                    # What a committed state dict lists went with the details (its manifest says).
                    rec[kind].files_unknown = kind is SD and rec[kind].state is StepState.COMMITTED
        return rec

    # -- registrations -------------------------------------------------------------------------

    def check_registration(self, reg: Registration) -> None:
        """Raise CheckpointConfigError if ``reg`` can never be honoured; changes nothing."""
        rec = self._records.get(reg.step)
        if rec is not None and reg.reg_id in rec.registrations:
            return  # a retried call: already applied
        adds = {k: n for k, n in reg.counts.items() if n > 0}
        if self.is_committed(reg.step, CKPT) and adds:
            raise RegistrationConflictError(
                f"step {reg.step} is already committed as a checkpoint, so no more save units can be "
                "registered for it; save into a new step, or retire the newer steps first "
                "(ckptd.retire_steps / 'ckptd retire ROOT --after STEP') when a job resumes from an older one"
            )
        expected = {k: (rec[k].expected if rec else 0) + adds.get(k, 0) for k in Kind}
        needed = expected[SD] if reg.monitored is SD else expected[SD] + expected[CKPT]
        if needed == 0 and not self.is_committed(reg.step, reg.monitored):
            what = "state_dict_thread_count" if reg.monitored is SD else \
                "state_dict_thread_count or checkpoint_thread_count"
            raise CheckpointConfigError(
                f"register_and_monitor(global_step={reg.step}, is_state_dict={reg.monitored is SD}) "
                f"would commit step {reg.step} with no save units: pass {what} (the number of save "
                "units of the step across all workers)"
            )

    @staticmethod
    def kinds_concerned(reg: Registration) -> set[Kind]:
        """The kinds a registration adds units to or asks to be committed. (A full checkpoint
        asks for the state dict too, but a state dict with registered units was asked for by the
        registration that added them.)"""
        return {reg.monitored, *(k for k, n in reg.counts.items() if n > 0)}

    @classmethod
    def kinds_affected(cls, reg: Registration) -> set[Kind]:
        """The kinds whose outcome a registration can change: those it concerns, and the full
        checkpoint too when it adds state-dict units (a full checkpoint needs every unit of its
        step; after its state dict committed, state-dict units count toward it only)."""
        kinds = cls.kinds_concerned(reg)
        if reg.counts.get(SD, 0) > 0:
            kinds.add(CKPT)
        return kinds

    def registration_is_moot(self, reg: Registration) -> bool:
        """True if every kind ``reg`` can affect has settled (failed or committed), so applying it
        could change no outcome. Otherwise it must be applied even if one of its kinds failed:
        the state dict of a step commits whether a checkpoint unit of the step failed before or
        after the registration."""
        return all(self.state_of(reg.step, k) in (StepState.COMMITTED, StepState.FAILED)
                   for k in self.kinds_affected(reg))

    def register(self, reg: Registration, *, replay: bool = False) -> StepRecord:
        """Apply a registration (idempotent by ``reg_id``).

        Raises:
            CheckpointConfigError: see :meth:`check_registration` (not when ``replay``ing records).
        """
        if not replay:
            self.check_registration(reg)
        rec = self._record(reg.step, reg.at)
        if reg.reg_id in rec.registrations:
            return rec
        rec.registrations.add(reg.reg_id)
        rec.first_seen = min(rec.first_seen, reg.at)
        for kind, n in reg.counts.items():
            if n > 0:
                rec[kind].expected += n
                rec[kind].registered_at = rec[kind].registered_at or reg.at
        rec[reg.monitored].monitored = True
        return rec

    # -- units ---------------------------------------------------------------------------------

    def started(self, unit: UnitId, now: float) -> None:
        """Replay a unit known to have been admitted and not yet finished (a started receipt)."""
        if self.state_of(unit.step, CKPT) not in (StepState.COMMITTED, StepState.COMMITTING):
            self._unit(unit, now)

    def knows(self, unit: UnitId) -> bool:
        """Whether the unit was admitted before (its report now is a retry, or came late)."""
        rec = self._records.get(unit.step)
        return rec is not None and unit.key in rec.units

    def admit(self, unit: UnitId, now: float) -> str | None:
        """A unit is about to write: None if it may, else why not (nothing is recorded then)."""
        if self.state_of(unit.step, CKPT) in (StepState.COMMITTED, StepState.COMMITTING):
            return (f"step {unit.step} is already committed as a checkpoint; its files must not change. "
                    "Save into a new step, or retire the newer steps first (ckptd.retire_steps) when "
                    "a job resumes from an older one")
        # A state-dict unit after its state dict committed counts toward the full checkpoint only.
        sd_done = self.state_of(unit.step, SD) in (StepState.COMMITTED, StepState.COMMITTING)
        failure = self.failure_of(unit.step, CKPT if unit.kind is CKPT or sd_done else SD)
        if failure is not None:
            return f"step {unit.step} has already failed ({failure[1]})"
        self._unit(unit, now)
        return None

    def _unit(self, unit: UnitId, now: float) -> tuple[StepRecord, UnitRecord]:
        rec = self._record(unit.step, now)
        u = rec.units.get(unit.key)
        if u is None:
            after = (unit.kind is SD and rec[SD].state in (StepState.COMMITTING, StepState.COMMITTED)
                     and unit.key not in rec[SD].committed_units)
            u = UnitRecord(unit, now, after_sd_commit=after)
            rec.add_unit(u)
        rec.last_unit_at = now
        return rec, u

    def finish(self, unit: UnitId, files: list[FileEntry], now: float,
               found: bool = False) -> tuple[StepRecord | None, str | None]:
        """Record a finished unit. Returns (its step, None), or (None, why it cannot count) for a
        unit that arrived after its step was committed as a checkpoint."""
        rec = self._records.get(unit.step)
        if rec is not None and unit.key in rec.units and not rec.units[unit.key].running:
            return rec, None  # a retried notification
        if self.state_of(unit.step, CKPT) in (StepState.COMMITTED, StepState.COMMITTING):
            return None, (f"unit {unit.label} of step {unit.step} finished after the step was committed "
                          "as a checkpoint, so its files are in no manifest; register every unit of a "
                          "step before it commits, or save into a new step")
        rec, u = self._unit(unit, now)
        rec.set_finished(u, files, found)
        return rec, None

    def fail(self, unit: UnitId, failure: UnitFailure, now: float) -> StepRecord:
        rec, u = self._unit(unit, now)
        if u.failure is not None or u.files is not None:
            return rec  # a retried notification, or a late duplicate of a unit that finished
        rec.set_failed(u, failure)
        cause = failure.cause
        if unit.kind is SD and not u.after_sd_commit:
            self.fail_kind(rec, SD, cause, unit.label)
        self.fail_kind(rec, CKPT, cause, unit.label)  # a full checkpoint needs every unit of its step
        return rec

    def fail_kind(self, rec: StepRecord, kind: Kind, reason: str, unit: str | None = None, *,
                  force: bool = False) -> bool:
        """Fail one kind of a step unless it is settled or being committed; True if it changed.

        ``force`` is for the commit path only: a commit that failed, or a committed state dict
        withdrawn because its files changed.
        """
        k = rec[kind]
        if k.state is StepState.FAILED or (not force and k.state in (StepState.COMMITTED, StepState.COMMITTING)):
            return False
        k.state, k.reason, k.failed_unit, k.deferred = StepState.FAILED, reason, unit, False
        if kind is SD:
            self.fail_kind(rec, CKPT, reason, unit)
        return True

    def fence_state_dict(self, step: int, newest: int, now: float) -> StepRecord | None:
        """Retention is deleting ``step`` (its full checkpoint failed; ``newest`` is the newest
        committed step): fail its state dict too, unless that has settled or has registrations or
        units (then the step is in flight and kept), so that no unit of it can be admitted and
        commit into a directory being deleted. Returns the record if it changed."""
        if self.state_of(step, CKPT) is not StepState.FAILED:
            return None
        if self.state_of(step, SD) not in (None, StepState.PENDING):
            return None
        rec = self._record(step, now)
        if rec.active(SD):
            return None
        reason = (f"retention deletes step {step}: its full checkpoint failed ({rec[CKPT].reason}) and step "
                  f"{newest} is newer; save the state dict into a new step")
        return rec if self.fail_kind(rec, SD, reason, rec[CKPT].failed_unit) else None

    # -- the commit rule -----------------------------------------------------------------------

    def ready(self, rec: StepRecord) -> list[Kind]:
        """The kinds of ``rec`` that may be committed now (state dict first). O(1): it runs on
        every notification, so it reads the step's tallies, never its units."""
        out = []
        sd, ck = rec[SD], rec[CKPT]
        if (sd.state is StepState.PENDING and (sd.monitored or ck.monitored) and sd.expected > 0
                and rec.counted_sd.complete(sd.expected) and not (sd.deferred and rec.has_running((CKPT,)))):
            out.append(SD)
        sd_done = sd.state is StepState.COMMITTED or SD in out or sd.expected == 0
        if (ck.state is StepState.PENDING and ck.monitored and sd.expected + ck.expected > 0 and sd_done
                and sd.state is not StepState.FAILED and not sd.withdrawing
                and rec.tallies[SD].complete(sd.expected) and rec.tallies[CKPT].complete(ck.expected)):
            out.append(CKPT)
        return out

    def begin_commit(self, rec: StepRecord, kinds: list[Kind], now: float) -> None:
        for kind in kinds:
            rec[kind].state, rec[kind].ready_at, rec[kind].deferred = StepState.COMMITTING, now, False

    def defer(self, rec: StepRecord, kind: Kind) -> None:
        """Put a commit back: it waits until the other kind's running units are done."""
        rec[kind].state, rec[kind].deferred = StepState.PENDING, True

    def commit_done(self, rec: StepRecord, kind: Kind, now: float, units: list[str],
                    files: list[FileEntry]) -> None:
        k = rec[kind]
        k.state, k.committed_at = StepState.COMMITTED, now
        k.committed_units, k.committed_files = set(units), {f.path: f for f in files}

    def mark_committed(self, step: int, kind: Kind, at: float, units: list[str] | None = None,
                       files: list[FileEntry] | None = None) -> StepRecord:
        """Record a kind found committed in storage (its manifest exists)."""
        rec = self._record(step, at)
        k = rec[kind]
        k.state, k.committed_at, k.monitored = StepState.COMMITTED, at, True
        k.committed_units = set(units or ())
        k.committed_files = {f.path: f for f in files or ()}
        return rec

    # -- time ----------------------------------------------------------------------------------

    def expire(self, now: float) -> list[tuple[StepRecord, Kind]]:
        """Fail every active, unsettled kind of a step first seen more than ``step_timeout_s`` ago."""
        return self._fail_unsettled(
            lambda rec: now - rec.first_seen >= self.step_timeout_s,
            lambda rec, kind: f"timed out after {self.step_timeout_s:g} s: {self.describe(rec, kind)}")

    def fail_unsettled(self, reason: str) -> list[tuple[StepRecord, Kind]]:
        """Fail every active, unsettled kind of every step with ``reason`` (a fenced monitor can
        commit none of them)."""
        return self._fail_unsettled(lambda rec: True, lambda rec, kind: reason)

    def _fail_unsettled(self, which: Callable[[StepRecord], bool],
                        reason: Callable[[StepRecord, Kind], str]) -> list[tuple[StepRecord, Kind]]:
        failed = []
        for rec in self._records.values():
            if not which(rec):
                continue
            for kind in Kind:
                if not rec.active(kind) or rec[kind].settled or rec[kind].state is StepState.COMMITTING:
                    continue
                if self.fail_kind(rec, kind, reason(rec, kind)):
                    failed.append((rec, kind))
        return failed

    def describe(self, rec: StepRecord, kind: Kind) -> str:
        """Where a kind of a step stands, in words."""
        k = rec[kind]
        units = rec.counted(SD) if kind is SD else list(rec.units.values())
        expected = k.expected if kind is SD else rec[SD].expected + k.expected
        done = sorted(u.unit.label for u in units if u.files is not None)
        running = sorted(u.unit.label for u in units if u.running)
        parts = [f"{len(done)} of {expected} registered units finished (finished: {', '.join(done) or 'none'})"]
        if running:
            parts.append(f"still running: {', '.join(running)}")
        if len(units) > expected:
            parts.append(f"{len(units)} units saved but only {expected} were registered: register the "
                         "total number of save units of the step across all workers")
        if not (k.monitored or (kind is SD and rec[CKPT].monitored)):
            parts.append(f"nobody asked to commit it: call register_and_monitor(global_step={rec.step}, "
                         f"is_state_dict={kind is SD}, ...)")
        return "; ".join(parts)

    def warnings(self, now: float) -> list[str]:
        """Common mistakes, early: units finished but their kind unregistered or unasked for a
        while; registered units that never started; more units than registered."""
        out = []
        for rec in self._records.values():
            for kind in Kind:
                k = rec[kind]
                if k.settled or not rec.active(kind):
                    continue
                asked = k.monitored or (kind is SD and rec[CKPT].monitored)
                mine = rec.tallies[kind]
                if mine.total and (not asked or k.expected == 0) and rec.last_unit_at is not None \
                        and now - mine.first_seen >= self.unregistered_warning_s:
                    out.append(f"step {rec.step} ({kind.value}): {mine.total} units saved but the step is not "
                               f"registered for this kind: {self.describe(rec, kind)}")
                elif k.expected > 0 and not mine.total and k.registered_at is not None \
                        and now - k.registered_at >= self.unregistered_warning_s:
                    out.append(f"step {rec.step} ({kind.value}): {k.expected} units registered but none has "
                               "started; check is_state_dict of the saves and of the registration")
                elif asked and (rec.counted_sd if kind is SD else mine).total > k.expected > 0:
                    out.append(f"step {rec.step} ({kind.value}): {self.describe(rec, kind)}")
        return out

    def prune(self, keep: int, busy: Callable[[int], bool] | None = None) -> None:
        """Drop the details of all but the newest ``keep`` settled steps. A step whose state dict
        is being checked or withdrawn, or for which ``busy(step)`` is true (a failure still being
        recorded), stays: what is done to it must reach the ledger (until a later prune)."""
        done = [r for r in self._records.values()
                if all(r[k].settled or not r.active(k) for k in Kind) and not r.has_running()
                and not r[SD].checks and not r[SD].withdrawing and not (busy is not None and busy(r.step))]
        done.sort(key=lambda r: r.step)
        for rec in done[: max(0, len(done) - keep)]:
            del self._records[rec.step]
            for kind in Kind:
                k = rec[kind]
                if k.settled:
                    self._retired[(rec.step, kind)] = (k.state, k.failed_unit, k.reason)
