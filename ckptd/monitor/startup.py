"""What a starting monitor does with the steps in flight when the last one stopped: their
committed state dicts are checked again before retention runs or anyone hears of a failure.

A mixin of :class:`~ckptd.monitor.actor.CheckpointMonitor` (it uses the actor's ledger,
retention runner, unit reports and commit flow), kept apart because it is one idea: resuming.
"""

from __future__ import annotations

import asyncio
import logging

from ckptd.config import Kind
from ckptd.monitor.ledger import CKPT, StepRecord

log = logging.getLogger("ckptd.monitor")


class Startup:
    def _hold_failures(self, steps: list[StepRecord], recorded: set[tuple[int, Kind]]) -> None:
        """Called in ``__init__``, once the ledger is rebuilt. A failure of a full checkpoint whose
        state dict :meth:`_resume` checks is reported only after that check, as a live one is
        (see ``_record_failure``): a recorded one is held until :meth:`_resume_step`, one not
        recorded yet (a step that timed out while no monitor ran, or of which a unit's failure
        receipt is all there is) until it is recorded and checked."""
        self._held_failures = {(rec.step, CKPT) for rec in steps if (rec.step, CKPT) in recorded and self._touched(rec)}
        self._failures_durable |= recorded - self._held_failures
        self._failure_writes |= self._held_failures  # unsettled (kept from pruning) until reported
        for rec in steps:
            self._pending_failures(rec)

    async def _resume(self, steps: list[StepRecord], withdrawals: dict[int, str]) -> None:
        """The steps in flight when this monitor started. A committed state dict whose full
        checkpoint was under way may have had a file replaced since it committed (by a unit, or
        by anything else): its files are checked again (see ``withdraw_if_changed``), and
        retention's first pass waits for these checks, so that it never counts a stale state
        dict among those it keeps. The last monitor may have died withdrawing one (its failure
        is recorded, ``withdrawals``, with the reasons): that withdrawal is finished.

        Each withdrawal begins as soon as it is known (its failure recorded, then a registration
        of the step is answered "withdrawn"), not once every step is checked: another step's
        check may take long (a large state dict, storage that refuses reads)."""
        begun: dict[int, asyncio.Task] = {}

        async def begin(rec: StepRecord, reason: str) -> None:
            begun[rec.step] = await self._begin_withdrawal(rec, reason)

        async def check(rec: StepRecord) -> None:
            try:
                gone = await self._changed_state_dict(rec)  # storage errors are retried there
            except Exception:  # a bug: logged, and retention must still run
                log.exception("step %d: checking its committed state dict at start-up", rec.step)
                return
            if gone:
                await begin(rec, self._withdrawn_because(rec, gone,
                                                         "the step was in flight when the monitor restarted"))

        await asyncio.gather(*(begin(rec, withdrawals[rec.step]) for rec in steps if rec.step in withdrawals),
                             *(check(rec) for rec in steps if self._touched(rec) and rec.step not in withdrawals))
        self._retention.release()
        for rec in steps:
            self._spawn(self._resume_step(rec, begun.get(rec.step)))

    def _touched(self, rec: StepRecord) -> bool:
        """Whether a unit or the full checkpoint of the step may have changed its committed state
        dict: a state dict alone (no checkpoint registered or saved) is not checked again."""
        return rec.active(Kind.CHECKPOINT) or any(
            u.failure is not None or (u.files and self._changed_committed_files(rec, u.files))
            for u in rec.units.values())

    async def _resume_step(self, rec: StepRecord, withdrawal: asyncio.Task | None) -> None:
        """Let the withdrawal of the step's state dict (begun by :meth:`_resume`, if it must go)
        end, release its held failure, and go on as after any change (commits, failures to
        record)."""
        if withdrawal is not None:
            if self._pending_failures(rec):
                # Recorded now, not once the withdrawal ends (storage may refuse it for long): a
                # unit of the step is refused once they are (on_storage), and they are reported
                # once it has ended (_record_failure joins it).
                self._spawn(self._record_new_failures(rec))
            await asyncio.shield(withdrawal)
        held = (rec.step, CKPT)
        if held in self._held_failures:
            self._held_failures.discard(held)
            self._failures_durable.add(held)
            self._failure_writes.discard(held)
            self._wake(*held)
        await self._after_change(rec)
