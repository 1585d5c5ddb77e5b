"""The commit half of the CheckpointMonitor actor: when the ledger says a step is ready, run the
commit path, advance the trackers, wake the waiters; make failures durable before reporting them.

A mixin of :class:`~ckptd.monitor.actor.CheckpointMonitor` (it uses the actor's ledger, committer,
thread pool and waiters), kept apart because it is one idea: what happens after a change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ckptd import failpoints, phases, protocol
from ckptd.config import Kind
from ckptd.fencing import FencedError
from ckptd.metrics import COMMIT_LATENCY, FAILED_COMMITS, FAILED_STEPS, RETRIED_REQUESTS
from ckptd.monitor.commit import CommitCheckError, CommitPlan, Deferred, UndecidedPublish
from ckptd.monitor.ledger import CKPT, SD, StepRecord, StepState

log = logging.getLogger("ckptd.monitor")

_RETRY_BASE_S = 0.05  # storage retries of the commit path: the first delay, and the longest
_MAX_RETRY_S = 5.0
_NOT_RETRIED = (CommitCheckError, Deferred, FencedError)


class CommitFlow:
    def _event(self, step: int, kind: Kind) -> asyncio.Event:
        event = self._events.get((step, kind))
        if event is None:
            event = self._events[(step, kind)] = asyncio.Event()
            if self._settled(step, kind):
                event.set()
        return event

    def _settled(self, step: int, kind: Kind) -> bool:
        state = self._ledger.state_of(step, kind)
        if state is StepState.FAILED:
            return (step, kind) in self._failures_durable
        if kind is SD and state is StepState.COMMITTED:
            rec = self._ledger.get(step)  # None: its details were pruned, long settled
            if rec is not None and rec[SD].withdrawing:
                return False  # being withdrawn (its tracker may point back already): answered once failed
        # A full checkpoint holds the weights too: it commits the state dict of its step for readers.
        return state is StepState.COMMITTED or self._ledger.is_committed(step, Kind.CHECKPOINT)

    def _could_settle(self, step: int, kind: Kind) -> bool:
        """Whether anything known of the step could still settle ``kind``
        (:meth:`~ckptd.monitor.ledger.StepLedger.could_settle`). A full checkpoint's failure counts
        only once recorded, as in :meth:`_settled`: until then a restarted monitor could still
        commit it, and the state dict with it."""
        return self._ledger.could_settle(step, kind) or (
            kind is SD and self._ledger.state_of(step, CKPT) is StepState.FAILED
            and (step, CKPT) not in self._failures_durable)

    def _wake(self, step: int, kind: Kind) -> None:
        event = self._events.pop((step, kind), None)
        if event is not None:
            event.set()

    async def _after_change(self, rec: StepRecord) -> None:
        """Start the commits the step is ready for; make new failures durable, then report them."""
        if self._after_change_sync(rec):
            await self._record_new_failures(rec)

    async def _record_new_failures(self, rec: StepRecord) -> None:
        for kind in Kind:
            if rec[kind].state is StepState.FAILED and (rec.step, kind) not in self._failures_recorded:
                await self._record_failure(rec, kind)

    def _failure_on_storage(self, key: tuple[int, Kind]) -> None:
        event = self._failures_on_storage.pop(key, None)
        if event is not None:
            event.set()

    def _failure_unsettled(self, step: int) -> bool:
        """Whether a failure of ``step`` is known but not reported yet (being recorded or checked)."""
        return any((step, k) in self._failure_writes for k in Kind)

    def _after_change_sync(self, rec: StepRecord) -> bool:
        """Start the commits the step is ready for; True if a new failure is left to record
        (then await :meth:`_record_new_failures`). No await on the common path: it runs for
        every finished unit."""
        kinds = self._ledger.ready(rec)
        if kinds and rec.step not in self._registering:  # else the registration's end looks again
            self._ledger.begin_commit(rec, kinds, time.time())
            self._committing[rec.step] = asyncio.Event()
            self._spawn(self._commit(rec, kinds))
        return self._pending_failures(rec)

    def _pending_failures(self, rec: StepRecord) -> bool:
        """Whether the step has a failure not recorded yet (then :meth:`_record_new_failures`
        must run); from now on :meth:`on_storage` waits for it, and :meth:`_failure_unsettled`
        counts it, even before the task that records it has started."""
        new = [k for k in Kind if rec[k].state is StepState.FAILED and (rec.step, k) not in self._failures_recorded]
        for kind in new:
            self._failure_writes.add((rec.step, kind))
            self._failures_on_storage.setdefault((rec.step, kind), asyncio.Event())
        return bool(new)

    async def on_storage(self, step: int) -> None:
        """Wait until the failures of ``step`` known in memory are recorded in storage, whether or
        not they are reported yet (``_failures_durable``: then waits on the kind are answered):
        enough to refuse a unit, or to answer a unit's report or a registration. A full
        checkpoint's failure is reported only once its state dict is checked, and withdrawn if a
        file of it changed, which storage may hold up for long: meanwhile the state dict's failure
        record keeps ckptd's readers off it, and a restarted monitor fails both.

        A failure the ledger holds that nobody has marked pending yet is waited for too: a path
        that failed a kind and awaits something before it marks that failure pending (as
        :meth:`_failed` did while it checked the state dict) cannot have it told meanwhile. Every
        path that fails a kind records it once it is done (``_after_change``)."""
        rec = self._ledger.get(step)
        if rec is not None:
            self._pending_failures(rec)
        for kind in Kind:
            event = self._failures_on_storage.get((step, kind))
            if event is not None:
                await event.wait()

    def _write_failure(self, step: int, kind: Kind, reason: str) -> None:
        failpoints.hit("before_failure_record")
        protocol.write_step_failure(self._storage, self._attempt, step, kind, reason)

    async def _write_failure_durably(self, step: int, kind: Kind, reason: str) -> None:
        """Write the failure record of ``step``'s ``kind``, retried however long that takes."""
        tries = 0
        while True:
            try:
                await self._in_thread(self._write_failure, step, kind, reason)
                return
            except Exception as e:
                tries += 1
                await self._back_off(tries, "failure_record", e, f"could not record the failure of step {step} "
                                     f"({kind.value}); it is reported once it is recorded")

    async def _record_failure(self, rec: StepRecord, kind: Kind) -> None:
        key = (rec.step, kind)
        self._failures_recorded.add(key)  # before the await: one record per failure
        self._failure_writes.add(key)
        if kind is CKPT:
            # Checked below: until then retention keeps the state dict without counting it.
            rec[SD].checks += 1
        try:
            await self._record_and_check(rec, kind, key)
        finally:
            if kind is CKPT:
                rec[SD].checks -= 1

    async def _record_and_check(self, rec: StepRecord, kind: Kind, key: tuple[int, Kind]) -> None:
        reason = rec[kind].reason or "failed"
        # Nobody is told of the failure before it is recorded: a monitor restarted before then
        # rebuilds the step from its units' receipts and, with every unit finished, would commit
        # a step its callers had been told had failed.
        await self._write_failure_durably(rec.step, kind, reason)
        self._failure_on_storage(key)
        if kind is CKPT and self._why_fenced() is not None:
            # Not by a fenced monitor: the root is the newer job's, which may rewrite those files,
            # and whose monitor checks what it finds; this one could not withdraw anything anyway.
            # Checked if the fence is lifted (a losing start_monitor's attempt: no newer job).
            self._defer_check(rec, f"the step's full checkpoint failed ({reason})")
        elif kind is CKPT:
            # Whatever failed the full checkpoint (a unit, its commit, its timeout), a file of the
            # step's committed state dict may have been replaced meanwhile: storage is checked
            # (and the state dict withdrawn if so) before anyone hears of the failure.
            try:
                await self.withdraw_if_changed(rec, f"the step's full checkpoint failed ({reason})")
            except Exception:  # the check retries storage errors itself: this is a bug, and is not hidden
                log.exception("step %d: checking its committed state dict after the full checkpoint failed", rec.step)
        self._failures_durable.add(key)  # from now on wait_committed answers "failed"
        self._failure_writes.discard(key)  # reported: no longer unsettled (the ledger may prune the step)
        self._metrics.inc(FAILED_STEPS, kind=kind)
        log.error("step %d (%s) failed: %s", rec.step, kind.value, reason)
        self._slots.abort_prefix(f"{rec.step}/{kind.value}/", reason)
        self._wake(rec.step, kind)
        if kind is CKPT:
            self._wake(rec.step, SD)  # a wait on a state dict that only this checkpoint could commit

    def _plan(self, rec: StepRecord, kinds: list[Kind]) -> CommitPlan:
        reports = {key: u.files for key, u in rec.units.items() if u.files is not None}
        sd_units = [u.unit.key for u in rec.counted(SD) if u.files is not None]
        return CommitPlan(
            step=rec.step, kinds=kinds, reports=reports, sd_units=set(sd_units),
            units={SD: sd_units, Kind.CHECKPOINT: sorted(reports)},
            take_unclaimed=Kind.CHECKPOINT in kinds or not rec.has_running((Kind.CHECKPOINT,)),
            found={key for key, u in rec.units.items() if u.found},
            registered={k: rec[k].expected for k in Kind},
            registrations=sorted(rec.registrations),
        )

    def _busy(self, step: int) -> bool:
        """Whether a commit of ``step``, or retention's deletion of it, is in flight."""
        return step in self._committing or step in self._retention.claims.deleting

    async def quiesce(self, step: int) -> None:
        """Wait until no commit of ``step`` is in flight (a unit admitted or a registration
        accepted meanwhile could not be part of it, yet would be told it was), nor retention's
        deletion of it (the unit would write into a directory on its way to the trash)."""
        while (event := self._committing.get(step) or self._retention.claims.deleting.get(step)) is not None:
            await event.wait()

    async def _commit(self, rec: StepRecord, kinds: list[Kind]) -> None:
        started = time.time()
        times: dict[str, float] = {}
        try:
            await self._commit_once(rec, kinds, times)
        finally:
            event = self._committing.pop(rec.step, None)
            if event is not None:
                event.set()
            self._record_commit(rec, kinds, started, times)
        await self._after_change(rec)  # deferred, failed, or a checkpoint that waited for this

    def _record_commit(self, rec: StepRecord, kinds: list[Kind], started: float, times: dict[str, float]) -> None:
        """The commit's span for the timeline: committed, deferred, or failed (with why)."""
        try:
            states = {kind: rec[kind].state for kind in kinds}
            failed = [kind for kind, state in states.items() if state is StepState.FAILED]
            error = (rec[failed[0]].reason or "failed") if failed else None
            deferred = [k.value for k, state in states.items() if state is StepState.PENDING]
            detail = f"deferred: {', '.join(deferred)}" if deferred else ""
            self._recorder.commit(rec.step, [k.value for k in kinds], started, time.time(), error, detail, times)
        except Exception:  # observability must never break the commit path
            log.exception("could not record the commit of step %d for the timeline", rec.step)

    async def _commit_once(self, rec: StepRecord, kinds: list[Kind], times: dict[str, float]) -> None:
        """Commit ``kinds`` of the step; ``times`` gets the seconds of its phases (commit: checks,
        manifests written and renamed; trackers), for the timeline."""
        plan = self._plan(rec, kinds)
        t0 = time.perf_counter()
        try:
            await self._retrying("commit", self._committer.commit, plan)  # fills plan.published
        except Deferred:
            log.info("step %d: state dict commit waits for the checkpoint units writing beside it", rec.step)
            self._ledger.defer(rec, SD)
            return
        except Exception as e:
            if isinstance(e, FencedError):
                self._fenced_by(e)
            tries = "" if isinstance(e, _NOT_RETRIED) else f" after {self._opts.commit_retries + 1} attempts"
            reason = f"commit failed{tries}: {type(e).__name__}: {e}"
            # Manifests are published in the plan's order: an undecided one is the first not published.
            undecided = next(k for k in kinds if k not in plan.published) if isinstance(e, UndecidedPublish) else None
            for kind in kinds:
                if kind not in plan.published and kind is not undecided:
                    self._ledger.fail_kind(rec, kind, reason, force=True)
                    self._metrics.inc(FAILED_COMMITS, kind=kind)
            if undecided is not None:
                self._leave_undecided(rec, undecided, e)
            if plan.published:
                # The state dict's manifest went out before the checkpoint's failed: it is on
                # storage, readers may have taken it, and it verifies. It is committed; only the
                # full checkpoint failed (whose failure checks that state dict again).
                log.error("step %d: %s; its state dict committed before that", rec.step, reason)
                # Pending before _committed prunes the ledger: a record whose failure is not yet
                # recorded stays in it (a withdrawal then fails the record the ledger holds).
                self._pending_failures(rec)
                await self._committed(rec, [k for k in kinds if k in plan.published], plan, times, t0)
            if isinstance(e, CommitCheckError) and e.committed_changed and self._ledger.is_committed(rec.step, SD):
                # Begun, not awaited to its end: the step stays "being committed" (no admission
                # answered) until this returns. The full checkpoint's failure, recorded next,
                # is reported once the withdrawal has ended.
                await self._begin_withdrawal(rec, f"{reason} (the step's state dict listed that file, so it is "
                                              "withdrawn)")
            return
        await self._committed(rec, kinds, plan, times, t0)

    def _leave_undecided(self, rec: StepRecord, kind: Kind, e: UndecidedPublish) -> None:
        """The manifest of ``kind`` may be visible, and a newer job owns the root for good: its
        start-up decides whether the step is committed (it keeps a visible checkpoint manifest,
        and a state dict's whose files are unchanged).
        Failed here, so that nothing more is admitted into it, but with no failure record (that
        would hide a step the new job may count) and answered as undecided, never as failed:
        invariant 2, a step reported failed is never committed."""
        key = (rec.step, kind)
        if kind is SD:  # its full checkpoint, not committing now, could only commit in this monitor
            self._ledger.fail_kind(rec, CKPT, f"not committed: attempt {e.newer} of the root (run {e.run!r}) took "
                                   "the root over while the step's state dict was being committed")
        self._ledger.fail_kind(rec, kind, (
            f"step {rec.step}'s {kind.value.replace('_', ' ')} commit is undecided: its manifest {e.path} may be on "
            f"storage, but storage refused both the sync and the removal that would settle its publish, and attempt "
            f"{e.newer} of the root (run {e.run!r}) took the root over meanwhile. That job decides: its start-up keeps "
            f"the manifest (a state dict's if its files are unchanged), so ask it (ckptd.latest_step, or its monitor)"),
            force=True)
        self._metrics.inc(FAILED_COMMITS, kind=kind)
        self._undecided.add(key)
        self._failures_recorded.add(key)  # nothing to record, and may be answered at once
        self._failure_on_storage(key)
        self._failures_durable.add(key)
        log.error("step %d (%s) %s", rec.step, kind.value, rec[kind].reason)
        self._slots.abort_prefix(f"{rec.step}/{kind.value}/", rec[kind].reason)
        self._wake(rec.step, kind)
        if kind is CKPT:
            self._wake(rec.step, SD)  # which that checkpoint would commit for readers: undecided too

    def _undecided_cause(self, step: int, kind: Kind) -> str | None:
        """Why the outcome of ``kind`` of ``step`` is a newer job's to decide, or None: its own
        publish was left undecided, or, for a state dict not committed, its step's full
        checkpoint's was (a full checkpoint commits its step's state dict for readers). Every
        answer about such a kind says so instead of "failed" (:meth:`_leave_undecided`)."""
        key = (step, kind)
        if key not in self._undecided:
            key = (step, CKPT)
            if kind is not SD or key not in self._undecided or self._ledger.state_of(step, SD) is StepState.COMMITTED:
                return None
        failure = self._ledger.failure_of(*key)
        return failure[1] if failure is not None else f"step {step}'s commit is undecided: a newer job decides"

    async def _committed(self, rec: StepRecord, kinds: list[Kind], plan: CommitPlan, times: dict[str, float],
                         t0: float) -> None:
        """The manifests of ``kinds`` are published (``plan.published``): trackers, then waiters.

        The manifest makes the step committed for readers; the trackers only point at it. A
        tracker that cannot be advanced does not uncommit the step (the next commit, or the next
        start-up, moves it forward). Waiters are released only after both, so that latest_step()
        agrees with wait_committed()."""
        manifests = plan.published
        t1 = time.perf_counter()
        times[phases.COMMIT] = t1 - t0
        try:
            await self._advance_trackers(rec.step, Kind.CHECKPOINT if Kind.CHECKPOINT in kinds else SD)
            times[phases.TRACKERS] = time.perf_counter() - t1
        except Exception as e:
            if isinstance(e, FencedError):
                self._fenced_by(e)
                self._trackers_unrepaired = True  # moved forward if the fence is lifted
            for kind in kinds:
                rec[kind].reason = f"committed, but the tracker could not be advanced: {type(e).__name__}: {e}"
            log.error("step %d: %s", rec.step, rec[kinds[0]].reason)
        now = time.time()
        for kind in kinds:
            self._ledger.commit_done(rec, kind, now, plan.units[kind], manifests[kind].files)
            self._wake(rec.step, kind)
            if rec[kind].ready_at is not None:
                self._metrics.observe(COMMIT_LATENCY, now - rec[kind].ready_at, kind=kind)
        if Kind.CHECKPOINT in kinds:
            self._wake(rec.step, SD)
        if self._mirror is not None and (any(self._mirror.mirrors(k) for k in kinds)
                                         or self._ledger.is_committed(rec.step, Kind.CHECKPOINT)):
            # Before retention runs: the step is protected until mirrored. A state dict committed
            # after its step's checkpoint goes up too: readers of the step see both manifests.
            self._mirror.enqueue(rec.step)
        if Kind.CHECKPOINT in kinds:
            # Best-effort: records of a committed step are ignored and removed again at start-up.
            self._io.submit(self._cleanup, rec.step)
        self._ledger.prune(self._opts.status_history, self._failure_unsettled)
        self._retention.schedule()

    async def _back_off(self, failed: int, request: str, error: Exception, what: str) -> None:
        """After ``failed`` failed tries of a storage request that is retried until it succeeds:
        log it, count it (``request`` labels the retry) and wait before the next try. The caller
        counts its tries itself, before this wait, so that the count is current while it waits."""
        delay = min(_RETRY_BASE_S * 2**failed, _MAX_RETRY_S)
        log.error("%s: %s: %s; retry %d in %.2f s", what, type(error).__name__, error, failed, delay)
        self._metrics.inc(RETRIED_REQUESTS, request=request)
        await asyncio.sleep(delay)

    async def _retrying(self, request: str, fn, *args) -> Any:
        """``fn(*args)`` in the I/O pool, retried with backoff; ``request`` labels the retries."""
        for attempt in range(self._opts.commit_retries + 1):
            try:
                return await self._in_thread(fn, *args)
            except _NOT_RETRIED:
                raise
            except Exception as e:
                if attempt == self._opts.commit_retries:
                    raise
                log.warning("%s failed (%s: %s); retrying", fn.__name__, type(e).__name__, e)
                self._metrics.inc(RETRIED_REQUESTS, request=request)
                await asyncio.sleep(_RETRY_BASE_S * 2**attempt)

    async def _advance_trackers(self, step: int, kind: Kind) -> None:
        # A full checkpoint holds the weights too, so it also advances the state-dict tracker.
        kinds = (Kind.CHECKPOINT, SD) if kind is Kind.CHECKPOINT else (SD,)
        async with self._tracker_lock:  # trackers only move forward, one writer at a time
            for k in kinds:
                current = self._trackers[k]
                if current is not None and step <= current:
                    continue
                await self._retrying("tracker", self._committer.advance_tracker, k, step)
                self._trackers[k] = step
                self._published(k, step)

    def _fence_failed_leftovers(self, failed: set[int]) -> None:
        """Retention may delete these steps (a kind failed, nothing of theirs in flight) as failed
        leftovers, at once, when they are older than the newest commit. A state dict of such a
        step that nobody has registered or saved yet could still come and commit into a
        directory being deleted: it is failed first, so that none can be admitted any more."""
        # The newest committed step of either kind: the tracker, or a commit whose tracker could
        # not move (or has not yet), whose manifest the pass may find all the same.
        newest = max([s for s in (self._trackers.get(SD), self._ledger.newest_committed()) if s is not None],
                     default=None)
        if newest is None:
            return
        for step in failed:
            rec = self._ledger.fence_state_dict(step, newest, time.time()) if step < newest else None
            if rec is not None and self._pending_failures(rec):
                self._spawn(self._record_new_failures(rec))

    def _cleanup(self, step: int) -> None:
        try:
            protocol.remove_step_records(self._storage, self._attempt, step)
        except Exception as e:
            log.warning("could not remove ledger records of step %d: %s", step, e)
