"""A monitor that a newer job fenced out while it had nothing to publish.

A job started on the root from another Ray cluster cannot see the old monitor, so it neither
refuses nor stops it; the old monitor would learn of the newer attempt only when it next
publishes (:func:`ckptd.fencing.check_fence`), and an idle one would keep its callers waiting
until ``step_timeout_s``. The housekeeping loop looks every :data:`FENCE_CHECK_S` seconds
instead; once two looks in a row found the same newer attempt, every step it has not committed
fails, naming it. A fence that a publish ran into is lifted by the next look that finds no newer
attempt (a losing ``start_monitor``'s short-lived one); until then only what it refuses fails.

A mixin of :class:`~ckptd.monitor.actor.CheckpointMonitor`.
"""

from __future__ import annotations

import logging

from ckptd import failpoints
from ckptd.config import Kind
from ckptd.fencing import FencedError, newer_attempts
from ckptd.monitor.rebuild import repair_trackers
from ckptd.monitor.records import SD, StepRecord

log = logging.getLogger("ckptd.monitor")

#: How often a monitor looks for a newer attempt on its root while it publishes nothing.
FENCE_CHECK_S = 5.0


class FenceWatch:
    """Looks for a newer attempt, and fails what a fenced monitor can no longer commit.

    A fence learned at a first start, or seen by two looks in a row, is for good. One that a publish,
    retention or the mirror's upload ran into is lifted by the next look that finds no newer
    attempt: a ``start_monitor`` that lost a race on the root took its attempt back (what failed
    meanwhile stays failed; the mirror uploads what waited)."""

    def _fenced_by(self, e: FencedError) -> None:
        """A publish found a newer attempt on the root."""
        self._fence_seen += 1
        if self._fenced is None:
            self._fenced = str(e)

    async def _look_for_newer_attempt(self) -> None:
        """Fenced for good once two checks in a row found the same record of an attempt newer
        than this one: a ``start_monitor`` that lost a race takes its attempt back within
        seconds, and the next loser reuses its number (with another record). Every newer record
        counts, not only the newest: losers coming and going above a newer job that stays must
        not keep the fence from being final."""
        seen, retention_fence = self._fence_seen, self._retention.fenced
        mirror_fence = None if self._mirror is None else self._mirror.fenced
        try:
            newer = await self._in_thread(self._list_newer_attempts)
        except Exception as e:  # storage unreachable: the next check, or the next publish, tells
            log.debug("could not look for a newer attempt: %s: %s", type(e).__name__, e)
            return
        if not newer:
            self._newer_attempt, self._newer_seen = None, frozenset()
            # Lifted only where no refusal came while this look ran: it may have seen an attempt
            # that this look's listing missed.
            if self._fenced is not None and self._fence_seen == seen:
                log.warning("no newer attempt on the root any more (%s): publishing again", self._fenced)
                self._fenced = None
            if retention_fence is not None and self._retention.fenced is retention_fence:
                self._retention.fenced = None
                self._retention.schedule()
            if mirror_fence is not None and self._mirror.fenced is mirror_fence:
                self._mirror.lift_fence()
            if self._why_fenced() is None:
                self._run_deferred()
            return
        again = self._newer_seen & frozenset(newer)
        if again:
            self._fence_for_good = True
            if self._fenced is None:
                stays = max(again, key=lambda r: r.attempt)
                self._fenced = str(FencedError(self._attempt, stays.attempt, stays.run))
                log.error("%s", self._fenced)
        self._newer_attempt, self._newer_seen = newer[-1], frozenset(newer)

    def _list_newer_attempts(self) -> list:
        failpoints.hit("before_fence_look")
        return newer_attempts(self._storage, self._attempt)

    def _defer_check(self, rec: StepRecord, after: str) -> None:
        """Check the committed state dict of ``rec`` against storage if the fence is lifted
        (:meth:`withdraw_if_changed`); retention keeps it meanwhile without counting it."""
        if rec.step not in self._deferred_checks:
            rec[SD].checks += 1
            self._deferred_checks[rec.step] = (rec, after)

    def _defer_withdrawal(self, rec: StepRecord) -> None:
        """Remove the state dict's manifest of ``rec``, which a fence refused, if the fence is
        lifted; it stays "withdrawing" (uncounted by retention) meanwhile."""
        self._deferred_withdrawals[rec.step] = rec

    def _run_deferred(self) -> None:
        """Once no fence is left: the work that a fence that was lifted had put off."""
        for rec, after in self._deferred_checks.values():
            rec[SD].checks -= 1
            self._spawn(self.withdraw_if_changed(rec, after))
        self._deferred_checks.clear()
        for rec in self._deferred_withdrawals.values():
            self._spawn(self._withdraw_deferred(rec))
        self._deferred_withdrawals.clear()
        if self._trackers_unrepaired:
            self._trackers_unrepaired = False
            self._spawn(self._repair_trackers_after_lift())

    async def _withdraw_deferred(self, rec: StepRecord) -> None:
        if not await self._withdraw_manifest(rec) and self._final_fence() is None:
            self._defer_withdrawal(rec)  # fenced again, by a look that may lift it again
            return
        rec[SD].withdrawing = False
        await self._after_change(rec)

    async def _repair_trackers_after_lift(self) -> None:
        """A monitor restarted under a fence did not repair its trackers at start-up (one left
        behind its step's manifest by a monitor that died between the two): now it does."""
        # The step it falls back to comes from its own scan: no retention pass may delete it meanwhile.
        async with self._retention.keeping_committed(), self._tracker_lock:
            try:
                await self._retrying("tracker", repair_trackers, self._storage, self._template, self._committer,
                                     self._trackers, self._trusted_manifests, set(self._foreign.values()))
            except FencedError as e:
                self._fenced_by(e)
                self._trackers_unrepaired = True  # at the next lift
                return
            except Exception:  # the next commit moves them; a tracker left behind names a committed step
                log.exception("could not repair the trackers after the fence was lifted")
                return
            self._announce()

    def _final_fence(self) -> str | None:
        """A fence no look will lift (found at a first start, or by two looks in a row), or None.
        Only it fails what is in flight and answers waits that nothing registered could settle:
        one that a look lifts would leave those answers wrong."""
        return self._fenced if self._fence_for_good else None

    def _why_fenced(self) -> str | None:
        """Why this monitor may no longer publish (a newer attempt, however it learned of it:
        this watch, a publish, retention), or None."""
        return self._fenced or self._retention.fenced

    def _fail_if_fenced(self) -> list[tuple[StepRecord, Kind]]:
        """Once fenced for good: fail every active, unsettled kind of every step (a step registered
        since too), and wake the waits that nothing known can settle any more: on steps nobody
        registered, or on the state dict of a step registered only for a full checkpoint
        (``wait_committed`` tells them why). The kinds failed, for the caller to record. Under a
        fence that a look may lift, only what the fence refuses fails."""
        fenced = self._final_fence()
        if fenced is None:
            return []
        failed = self._ledger.fail_unsettled(f"not committed: {fenced}")
        for step, kind in list(self._events):
            if not self._could_settle(step, kind):
                self._wake(step, kind)
        return failed
