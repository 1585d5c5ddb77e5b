"""Withdrawing a committed state dict whose files changed: the check against storage, the
failure record, the tracker pointed back and the manifest removed.

A mixin of :class:`~ckptd.monitor.actor.CheckpointMonitor` (it uses the actor's ledger,
committer, retention runner and trackers). One withdrawal runs per step, as a task of its own:
whoever finds the step changed while one is under way joins it. A unit's report, and a
registration of the step, wait only until the withdrawal's failure record is durable, not for the
manifest's removal, which storage may refuse for a long while: the worker's later notifications
and registrations (its other steps' saves) go on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from ckptd.config import Kind
from ckptd.fencing import FencedError
from ckptd.manifest import FileEntry
from ckptd.monitor.ledger import CKPT, SD, StepRecord, StepState

log = logging.getLogger("ckptd.monitor")


class Withdrawal(NamedTuple):
    """The withdrawal of a step's state dict under way (``_withdrawals``)."""

    task: asyncio.Task  # ends once the manifest is gone (or a fence put its removal off)
    recorded: asyncio.Event  # set once the state dict's failure record is on storage
    reason: str  # the state dict's failure: what a withdrawal that joins it says too


class Withdrawals:
    """The withdrawal half of the monitor's commit path (a mixin: the actor provides the ledger,
    storage, committer, retention runner, trackers and ``_withdrawals``)."""

    async def withdraw_if_changed(self, rec: StepRecord, after: str, whole: bool = True) -> bool:
        """Withdraw the committed state dict of ``rec`` if storage no longer holds the files its
        manifest lists (True if it did, or a withdrawal of the step is under way), while the
        step's full checkpoint may still come.

        Called on every failure of the step: a failed unit (which reports no files, but may have
        replaced one before it failed: a writer that publishes two files, a ``save_fn`` that
        writes and then raises), a full checkpoint that failed (its commit, or its timeout), and a
        restart (``startup._resume``); a finished unit's report is checked against the same list in
        ``_finished``. Storage decides: every listed file is checksummed, which only happens for
        a step whose state dict committed.

        ``whole``: return once the withdrawal has ended (the manifest is gone, or a fence put its
        removal off); else once its failure is recorded (a unit's report: see the module)."""
        if rec.step not in self._withdrawals:
            gone = await self._changed_state_dict(rec)
            if not gone:
                return False
            if rec.step not in self._withdrawals and self._ledger.state_of(rec.step, SD) is not StepState.COMMITTED:
                return True  # a withdrawal ended while storage was read: this one found what it did
            reason = self._withdrawn_because(rec, gone, after)
        else:
            reason = ""  # joined: the withdrawal under way keeps its own reason
        task = await self._begin_withdrawal(rec, reason)
        if whole:
            await asyncio.shield(task)
        return True

    async def _changed_state_dict(self, rec: StepRecord, entries: list[FileEntry] | None = None) -> list[str]:
        """The files of the step's committed state dict (or of ``entries``, some of them) that
        storage no longer holds as listed, while its full checkpoint may still come (else nothing
        is checked). Meanwhile retention keeps the state dict without counting it (``checks``).
        A read that storage refuses is retried, however long that takes: until the answer,
        nothing is known of the files."""
        rec[SD].checks += 1
        try:
            if self._ledger.state_of(rec.step, SD) is StepState.COMMITTING:
                # The commit may have checked a file before it was replaced: look once it has ended.
                await self.quiesce(rec.step)
            tries = 0
            while True:
                try:
                    if rec[SD].files_unknown:
                        await self._read_back_committed(rec)
                    if (self._ledger.state_of(rec.step, SD) is not StepState.COMMITTED
                            or self._ledger.state_of(rec.step, CKPT) in (StepState.COMMITTED, StepState.COMMITTING)
                            or not rec[SD].committed_files):
                        return []
                    listed = list(rec[SD].committed_files.values()) if entries is None else entries
                    return await self._in_thread(self._committer.differs, rec.step, listed)
                except Exception as e:
                    tries += 1
                    await self._back_off(tries, "check", e, f"step {rec.step}: could not check its committed state "
                                         "dict against storage")
        finally:
            rec[SD].checks -= 1

    @staticmethod
    def _withdrawn_because(rec: StepRecord, gone: list[str], after: str) -> str:
        return (f"{after}, and {gone[0]} of step {rec.step} is no longer what the step's committed state dict "
                "lists (replaced since it committed): committed files must not change, so that state dict is "
                "withdrawn. Write the full checkpoint's files under other names, or save into a new step")

    async def _revoke_state_dict(self, rec: StepRecord, reason: str) -> None:
        """Withdraw the committed state dict of ``rec`` (:meth:`_begin_withdrawal`) and wait until
        that has ended."""
        await asyncio.shield(await self._begin_withdrawal(rec, reason))

    async def _begin_withdrawal(self, rec: StepRecord, reason: str) -> asyncio.Task:
        """Start withdrawing the committed state dict of ``rec``, or join the withdrawal of its
        step under way; return once its failure is recorded. The task returned ends once the
        manifest is gone and the kind failed with ``reason`` (or a fence put the removal off)."""
        held = self._withdrawals.get(rec.step)
        if held is None:
            rec[SD].withdrawing = True  # from now on: retention must not count it among those it keeps
            recorded = asyncio.Event()
            task = asyncio.get_running_loop().create_task(self._withdraw(rec, reason, recorded))
            held = self._withdrawals[rec.step] = Withdrawal(task, recorded, reason)
            self._tasks.add(task)
            task.add_done_callback(self._withdrawal_ended)
        await held.recorded.wait()
        return held.task

    async def withdrawn_because(self, step: int) -> str | None:
        """Why the state dict of ``step`` is being withdrawn, once that failure is on storage (the
        answer a registration gets meanwhile: the kind fails only once the manifest is gone,
        which storage may hold up); None if no withdrawal of the step is under way."""
        held = self._withdrawals.get(step)
        if held is None:
            # One a restart cut short (its failure is recorded) that the start-up has not begun
            # again yet (``startup._resume`` does so first thing, once the event loop runs it).
            rec = self._ledger.get(step)
            return self._cut_short.get(step) if rec is not None and rec[SD].withdrawing else None
        await held.recorded.wait()
        return held.reason

    def _withdrawal_ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        for step, held in list(self._withdrawals.items()):
            if held.task is task:
                del self._withdrawals[step]
        if not task.cancelled() and task.exception() is not None:  # a bug: the withdrawal retries storage itself
            log.error("a withdrawal of a state dict ended with an error", exc_info=task.exception())

    async def _withdraw(self, rec: StepRecord, reason: str, recorded: asyncio.Event) -> None:
        """The manifest goes, the state-dict tracker is pointed back at the newest step still
        committed, and the kind is failed with ``reason``.

        Storage errors are retried until the manifest is gone, however long that takes: until
        then the manifest (and a tracker naming the step) claims files that are no longer there.
        A fenced monitor stops: it publishes nothing any more, and the newer job's monitor checks
        what it finds when it starts; if the fence is lifted (no newer job after all), the
        manifest goes then."""
        try:
            # The failure is recorded before the manifest goes. A monitor that died between the
            # two would otherwise find no manifest, no failure and every unit of the step finished
            # (the one that replaced the file too), and commit it again over the replaced bytes.
            # Recorded first, a restart finds the state dict failed (its full checkpoint with it),
            # or, with the manifest still there, withdraws it again at start-up
            # (``startup._resume``).
            await self._write_failure_durably(rec.step, SD, reason)
        finally:
            recorded.set()
        if await self._withdraw_manifest(rec) or self._final_fence() is not None:
            rec[SD].withdrawing = False
        else:  # still withdrawing (retention keeps it uncounted) until the fence is lifted
            self._defer_withdrawal(rec)
        self._ledger.fail_kind(rec, SD, reason, force=True)
        if (rec.step, SD) in self._failures_durable:
            self._wake(rec.step, SD)  # recorded before a restart: nothing below reports it again
        # Ended: a failure recorded below (its full checkpoint's) checks the state dict, which no
        # longer reads as committed, rather than joining this task.
        self._withdrawals.pop(rec.step, None)
        await self._after_change(rec)

    def _trusted_manifests(self, step: int, kinds: frozenset[Kind]) -> frozenset[Kind]:
        """Of the manifests storage shows for ``step``, those a tracker may fall back to: not a
        step retention is deleting, nor a kind whose commit is still in flight (an uncertain
        publish may yet be taken back) or failed, nor a state dict being withdrawn. (One being
        checked against storage counts, as it does while the tracker names it: leaving it out
        would leave the tracker behind it once the check finds it intact.) Runs in the I/O
        threads: it only looks up (no iteration over what the event loop changes)."""
        if step in self._retention.claims.deleting:
            return frozenset()
        rec = self._ledger.get(step)
        return frozenset(k for k in kinds if self._ledger.state_of(step, k) in (StepState.COMMITTED, None)
                         and not (k is SD and rec is not None and rec[SD].withdrawing))

    async def _withdraw_manifest(self, rec: StepRecord) -> bool:
        """Remove the state dict's manifest of ``rec`` and point its tracker back; False if a
        newer attempt on the root refused it (fenced)."""
        tries = 0
        while True:
            # The step the tracker falls back to must stay: a committed step retention claimed
            # before this withdrawal began may be on its way to the trash (those deletions end
            # first), and none is deleted until the tracker names it (it may be older than every
            # step a pass counts among those it keeps: the walk passes over changed ones).
            try:
                async with self._retention.keeping_committed(), self._tracker_lock:
                    before = self._trackers[SD]
                    newest = await self._in_thread(self._committer.revoke, rec.step, SD, self._trusted_manifests)
                    self._trackers[SD] = newest
                    if newest is not None and (before is None or newest > before):
                        self._published(SD, newest)  # a commit that found the tracker ahead of it
                    self._announce()
                return True
            except FencedError as e:
                self._fenced_by(e)
                log.error("could not withdraw the state dict of step %d: %s", rec.step, e)
                return False
            except Exception as e:
                tries += 1
                await self._back_off(tries, "revoke", e, f"could not withdraw the state dict of step {rec.step}")
