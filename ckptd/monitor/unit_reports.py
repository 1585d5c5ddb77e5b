"""What workers report about their save units (started, finished, failed), as the monitor
receives it: ``notify_batch`` and what each report does to the step's ledger."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ckptd import protocol
from ckptd.config import Kind, SaveStrategy
from ckptd.layout import MANIFESTS, find_step_dir
from ckptd.manifest import FileEntry, Manifest, read_manifest
from ckptd.metrics import FAILED_UNITS
from ckptd.monitor.ledger import CKPT, SD, StepRecord, StepState
from ckptd.protocol import UnitFailure, UnitId

log = logging.getLogger("ckptd.monitor")

_YIELD_EVERY = 32  # events of one batch handled before the event loop runs other tasks


def slot_key(unit: UnitId) -> str:
    return f"{unit.step}/{unit.kind.value}/{unit.key}"


class UnitReports:
    """The unit-report half of :class:`~ckptd.monitor.actor.CheckpointMonitor` (a mixin: the
    actor provides the ledger, storage, committer, slots, recorder, metrics and commit flow)."""

    async def notify_batch(self, events: list[tuple[str, dict, Any]]) -> list[dict | None]:
        """Several notifications in one call, applied in order; one result each.

        ``("started", unit, None)`` asks whether the unit may write: ``{"refused": why}`` if its
        step is committed or failed, else ``{"admitted": True}``. ``("finished", unit,
        {"files": [...], "found": bool})`` (``found``: the files were found by time) answers
        ``{"refused": why}`` for a unit that cannot count (its step committed meanwhile, or it
        changed a committed file), else None. ``("failed", unit, failure)`` answers None when
        the unit's kind of its step fails with it (the usual case), or ``{"kept": why}`` when it
        does not: that kind was committed, or being committed, without the unit.
        A notification the monitor cannot read is refused alone (and fails its unit if it reports
        the unit's end); the others of its batch still apply.
        """
        results = []
        for i, (event, unit, payload) in enumerate(events):
            if i and not i % _YIELD_EVERY:
                # Let a commit waiting for its next step (a manifest written, a tracker moved) go on
                # between the events of a large batch: under a flood it would otherwise wait for
                # every batch ahead of it to finish, once per step of the commit.
                await asyncio.sleep(0)
            self._notifications += 1
            self._recorder.notification(payload)
            if event not in ("started", "finished", "failed"):
                # "timing": spans only (what a worker measured after its last notification). Any
                # other event is from a newer coordinator: skipped, so that the events batched
                # with it (other units') still count; its unit, if any, is not parsed.
                if event != "timing":
                    log.error("ignoring unknown notification %r", event)
                results.append(None)
                continue
            try:
                uid, parsed = _parse(event, unit, payload)
            except (KeyError, TypeError, ValueError) as e:  # pydantic's ValidationError is a ValueError
                # Answered for this event alone: raising would fail every event batched with it
                # (through a relay, other coordinators' too) after applying those before it.
                results.append(await self._unreadable(event, unit, e))
                continue
            if event == "started":
                why = await self._admit(uid)
                results.append({"refused": why} if why else {"admitted": True})
            elif event == "finished":
                files, found = parsed
                results.append(await self._finished(uid, files, found))
            else:
                kept = await self._failed(uid, parsed)
                results.append(None if kept is None else {"kept": kept})
        return results

    def _why_foreign(self, step: int) -> str | None:
        """Why no unit may save into ``step``: its directory is another tool's checkpoint."""
        name = self._foreign.get(step)
        if name is None:
            return None
        return (f"step {step}'s directory {name} holds another tool's checkpoint (it was in the root before ckptd "
                "first used it): ckptd does not save into it, so as not to mix its files with that checkpoint's, or "
                "delete them with it later. Save this step under another number, or move that directory out of "
                "the root")

    async def _unreadable(self, event: str, unit: Any, error: Exception) -> dict | None:
        """The answer to a notification the monitor cannot parse (a newer coordinator's, say): a
        refusal, so that it does not count. A report of an end ("finished" or "failed") whose unit
        can be named fails that unit, so that its step fails now rather than at its timeout."""
        why = (f"the monitor cannot read this {event!r} notification ({type(error).__name__}: {error}); "
               "are the coordinators and the monitor the same version of ckptd?")
        log.error("%s", why)
        if event in ("finished", "failed"):
            try:
                uid = UnitId.from_dict(unit)
            except (KeyError, TypeError, ValueError):
                uid = None
            if uid is not None:
                await self._failed(uid, UnitFailure(unit=uid.label, error_type="UnreadableReport", message=why))
        return None if event == "failed" else {"refused": why}

    async def _admit(self, uid: UnitId) -> str | None:
        # Whether retention may have deleted the step's ledger records, the unit's receipt with
        # them: while the unit waited for a deletion, or before its report arrived (a slow report,
        # or one retried after a monitor died mid-deletion). Retention deletes only steps older
        # than the newest commit (which the state-dict tracker names, a full checkpoint moving it
        # too): the units of newer steps cost nothing more.
        newest = self._trackers.get(SD)
        deleted = newest is not None and uid.step < newest
        restored = False
        while True:
            # A unit admitted during a commit would not be in it; one admitted while retention
            # deletes the step would write into a directory on its way to the trash.
            claimed = self._retention.claims.deleting.get(uid.step)
            deleted = deleted or claimed is not None
            event = self._committing.get(uid.step) or claimed
            if event is not None:
                await event.wait()
                continue
            if not deleted or self._ledger.knows(uid):
                break
            # A restarted monitor must still know that the unit runs: its receipt is written again
            # where it is gone. Then look again (the write let others run).
            deleted = False
            restored = await self._restore_receipt(uid) or restored
        # A step whose outcome a newer job decides is named so, not as fenced: its unit is refused,
        # and the step must not read as failed (it may be committed).
        why = self._undecided_cause(uid.step, uid.kind) or self._why_foreign(uid.step)
        if why is None:
            # A unit admitted before (a relay's late copy of its "started", a retry) is answered
            # as it was: it may be writing, and a fence refuses its publish on storage anyway.
            known = self._ledger.knows(uid)
            why = self._ledger.admit(uid, time.time())
            fenced = self._why_fenced() if why is None and not known else None
            if fenced is not None:
                # The unit will not write, so its step can never be complete: it fails now (and
                # stays failed if a look lifts the fence), rather than at step_timeout_s.
                why = fenced
                await self._failed(uid, UnitFailure(unit=uid.label, error_type="FencedError",
                                                    message=f"not admitted: {fenced}"))
            if why is not None:
                await self.on_storage(uid.step)  # "already failed" is said only once it is recorded
        if why is not None and restored:
            # Refused: the worker removes its receipt once told, but this report may be a late
            # copy (through a relay, after the worker timed out) that nobody waits for.
            try:
                await self._in_thread(protocol.remove_receipt, self._storage, self._attempt, uid)
            except Exception as e:  # a restarted monitor then waits for the unit until its timeout
                log.warning("step %d: could not remove the receipt of refused %s: %s: %s",
                            uid.step, uid.label, type(e).__name__, e)
        return why

    async def _restore_receipt(self, uid: UnitId) -> bool:
        try:
            return await self._in_thread(protocol.restore_started, self._storage, self._attempt, uid)
        except Exception as e:  # only a restart before the unit ends would miss it
            log.warning("step %d: could not write the receipt of %s again: %s: %s",
                        uid.step, uid.label, type(e).__name__, e)
            return False

    def _release_slot(self, uid: UnitId) -> None:
        if self._opts.save_strategy is not SaveStrategy.UNRESTRICTED:  # else no unit holds a slot
            self._slots.release(slot_key(uid))

    async def _finished(self, uid: UnitId, files: list[FileEntry], found: bool = False) -> dict | None:
        self._release_slot(uid)
        if self._ledger.state_of(uid.step, SD) is StepState.COMMITTING:
            # Its committed files are known once that commit ends: the report is checked against them.
            await self.quiesce(uid.step)
        rec = self._ledger.get(uid.step)
        if rec is not None and rec[SD].files_unknown:
            try:
                await self._read_back_committed(rec)
            except Exception as e:  # this report goes unchecked here; the commit reads the manifest itself
                log.error("step %d: could not read its committed state dict's manifest: %s: %s", rec.step,
                          type(e).__name__, e)
        counts = self._ledger.state_of(uid.step, Kind.CHECKPOINT) not in (StepState.COMMITTED, StepState.COMMITTING)
        changed = [] if rec is None or not counts else self._changed_committed_files(rec, files)
        if changed:
            # Storage decides, not the report: are the bytes the state dict's manifest lists gone?
            gone = await self._changed_state_dict(rec, [rec[SD].committed_files[p] for p in changed])
            if gone:
                why = (f"unit {uid.label} rewrote {gone[0]} of step {uid.step} with other content, but the step's "
                       "committed state dict lists that file: committed files must not change, so that state "
                       "dict is withdrawn. Write the full checkpoint's files under other names, or save into a "
                       "new step")
                # Take that commit back, so that no manifest (and no tracker) claims what is not on
                # storage, then fail the unit. Answered once the withdrawal's failure is recorded:
                # the manifest's removal, which storage may refuse for a while, goes on without
                # holding back this worker's later notifications.
                await self._begin_withdrawal(rec, why)
            elif self._ledger.state_of(uid.step, SD) is StepState.FAILED:
                # Withdrawn since (by this unit's own report, whose answer was lost, say): storage
                # is no longer compared with what it listed.
                why = (f"unit {uid.label} reported {changed[0]} of step {uid.step} with other content than the "
                       f"step's state dict listed when it committed, and that state dict is withdrawn: "
                       f"{rec[SD].reason}")
            else:
                why = (f"unit {uid.label} reported {changed[0]} of step {uid.step} with other content than "
                       "storage holds (the step's committed state dict); its report is wrong")
            await self._failed(uid, UnitFailure(unit=uid.label, error_type="CommittedFileChanged", message=why))
            return {"refused": why}
        rec, why = self._ledger.finish(uid, files, time.time(), found=found)
        if why is not None and await self._in_thread(self._counted_in_manifest, uid, files):
            # A retried report of a unit the commit counted: the monitor committed the step, then
            # restarted before its answer reached the worker (a rebuilt ledger does not hold the
            # units of committed checkpoints), or the step's record was pruned since.
            return None
        if rec is not None and self._after_change_sync(rec):
            await self._record_new_failures(rec)
        return None if why is None else {"refused": why}

    def _counted_in_manifest(self, uid: UnitId, files: list[FileEntry]) -> bool:
        """Whether a committed manifest of the unit's kind lists the unit and every file it
        reports (blocking I/O).

        A commit lists every file its units reported, so a retried report matches; a report
        naming the unit and a file the manifest lacks is not that retry, and is refused.
        NOTE: sizes and CRC-32s are not compared: two units may report one file (one found by
        time saw an older version) and the commit keeps the report that matches storage, so a
        counted unit's retried report may hold content the manifest does not list.
        """
        # A state-dict unit counts in the full checkpoint too; a checkpoint unit only there.
        kinds = (Kind.CHECKPOINT,) if uid.kind is Kind.CHECKPOINT else tuple(Kind)
        for kind in kinds:
            try:
                manifest = self._manifest_of(uid.step, kind)
            except ValueError as e:
                # A damaged manifest cannot vouch for the unit: it is refused as late, and the
                # rest of its batch (other units' reports) still applies.
                log.error("step %s: unreadable %s while checking a retried report: %s",
                          uid.step, MANIFESTS[kind], e)
                continue
            if manifest is None or uid.key not in manifest.units:
                continue
            listed = {f.path for f in manifest.files}
            if all(f.path in listed for f in files):
                return True
        return False

    def _manifest_of(self, step: int, kind: Kind) -> Manifest | None:
        """The step's committed manifest of ``kind``, or None (blocking I/O).

        Raises:
            ValueError: it cannot be read as a manifest.
        """
        name = find_step_dir(self._storage, step, self._template)
        return None if name is None else read_manifest(self._storage, self._storage.join(name, MANIFESTS[kind]))

    async def _read_back_committed(self, rec: StepRecord) -> None:
        """Fill in what the step's committed state dict lists, when its record was rebuilt after a
        prune (``files_unknown``): from its manifest, as a restarted monitor does."""
        try:
            manifest = await self._in_thread(self._manifest_of, rec.step, SD)
        except ValueError as e:  # damaged: it vouches for nothing, and no retry will mend it
            log.error("step %d: unreadable %s: %s", rec.step, MANIFESTS[SD], e)
            manifest = None
        if rec[SD].files_unknown and manifest is not None:
            rec[SD].committed_units = set(manifest.units)
            rec[SD].committed_files = {f.path: f for f in manifest.files}
        rec[SD].files_unknown = False

    @staticmethod
    def _changed_committed_files(rec: StepRecord, files: list[FileEntry]) -> list[str]:
        """Files a unit reported with other content than the step's committed state dict lists."""
        committed = rec[SD].committed_files
        return [f.path for f in files
                if f.path in committed and (committed[f.path].size, committed[f.path].crc32) != (f.size, f.crc32)]

    async def _failed(self, uid: UnitId, failure: UnitFailure) -> str | None:
        """Record the failure of a unit; None if its kind of its step fails with it, else why not."""
        self._release_slot(uid)
        rec = self._ledger.fail(uid, failure, time.time())
        unit = rec.units.get(uid.key)
        if unit is not None and unit.failure is failure:  # recorded now, not a retried notification
            self._metrics.inc(FAILED_UNITS, kind=uid.kind)
        # Read before anything below awaits: what this failure did to the unit's kind, and
        # whether it failed the full checkpoint now (recording that checks the state dict).
        kept = _kept_without(rec, uid)
        checked_by_record = rec[CKPT].state is StepState.FAILED and (rec.step, CKPT) not in self._failures_recorded
        # Recorded at once, before the checks below: a registration, admission or report of the
        # step waits for the record (on_storage), not for a read of the whole state dict.
        if self._pending_failures(rec):
            self._spawn(self._record_new_failures(rec))
        # The committed state dict is checked (and withdrawn if a file changed) here unless the
        # full checkpoint failed now, whose recording checks it (_record_failure); a state-dict
        # unit's answer must not say it stays, so that unit's failure checks it here too. Both
        # checks then run at once: whichever finds a change withdraws it (one withdrawal per step).
        if (not checked_by_record or (kept is not None and uid.kind is SD)) and await self.withdraw_if_changed(
                rec, f"unit {uid.label} failed", whole=False):
            # A withdrawal fails the step's state dict, and with it this unit's kind.
            kept = None
        if self._after_change_sync(rec):  # the commits the failure let go; a failure found since
            self._spawn(self._record_new_failures(rec))
        # Answered once the failures are on storage (a restarted monitor then knows of them), not
        # once they are reported: a full checkpoint's failure is reported after a check of its
        # state dict, and any withdrawal that check sets off (see the withdrawal module).
        await self.on_storage(rec.step)
        return None if rec[uid.kind].state is StepState.FAILED else kept


def _kept_without(rec: StepRecord, uid: UnitId) -> str | None:
    """Why the failure of ``uid`` leaves its kind of the step as it is, or None if it does not:
    that kind was committed, or being committed, without the unit (it was not admitted into that
    commit), or the unit's report of its files came first and counts."""
    what = "checkpoint" if uid.kind is CKPT else "state dict"
    state = rec[uid.kind].state
    if state is StepState.FAILED:  # by this unit, or before it: the step fails either way
        return None
    unit = rec.units.get(uid.key)
    if unit is not None and unit.files is not None:  # a "failed" after its own "finished" is ignored
        return (f"this does not fail step {rec.step}'s {what}: the monitor already had this unit's report of "
                "its files, which count; wait_committed says how the step ends")
    if state not in (StepState.COMMITTED, StepState.COMMITTING):
        return None
    how = "was committed" if state is StepState.COMMITTED else "was already being committed"
    also = ""
    if uid.kind is SD and rec[CKPT].state is StepState.FAILED and rec[CKPT].failed_unit == uid.label:
        also = f"; step {rec.step}'s full checkpoint, which needed this unit, fails"
    return (f"this does not fail step {rec.step}'s {what}, which {how} without this unit (it was not admitted "
            f"into that commit){also}; wait_committed says how the step ends")


def _parse(event: str, unit: Any, payload: Any) -> tuple[UnitId, Any]:
    """A notification's unit, and what its event carries: (files, found) for "finished", the
    UnitFailure for "failed". Raises KeyError, TypeError or ValueError for one it cannot read."""
    uid = UnitId.from_dict(unit)
    if event == "finished":
        body = payload if isinstance(payload, dict) else {"files": payload}
        return uid, ([FileEntry(**f) for f in body["files"]], bool(body.get("found", False)))
    if event == "failed":
        return uid, UnitFailure(**payload)
    return uid, None
