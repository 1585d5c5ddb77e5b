"""Retention in the running monitor: a pass after each commit, one at a time, on the monitor's
event loop (the scan and the deletions in a thread), with a claim on the loop right before each
deletion (:mod:`ckptd.monitor.claims`). What to delete is decided by :mod:`ckptd.monitor.retention`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from ckptd import failpoints
from ckptd.config import Kind, MonitorOptions
from ckptd.fencing import FencedError
from ckptd.layout import StepEntry, scan_steps
from ckptd.metrics import RETENTION_DELETIONS, RunMetrics
from ckptd.monitor.claims import DeletionClaims
from ckptd.monitor.records import StepState
from ckptd.monitor.retention import TRASH, PassResult, RetentionPolicy, empty_trash, plan_retention, run_plan
from ckptd.storage import Storage

log = logging.getLogger("ckptd.retention")

_HISTORY = 1000  # deleted steps reported by status()


class RetentionRunner:
    """Runs retention passes on the monitor's event loop, one at a time, after each commit.

    What is protected (tracker targets, steps in flight, steps not yet mirrored) is read on the
    event loop before the scan, and again for each step right before it is deleted: a save of
    an older step can begin in between, and commit its state dict before the scan sees it. The
    second look claims the step (:attr:`claims`) until its deletion is over; the monitor's
    admissions and registrations of a claimed step wait for that.

    Args:
        protected: Returns the steps never to delete now.
        cleanup: Removes the ledger records of a deleted step.
        mark_deleted: Records that a step with a failed kind was deleted, with its committed kinds.
        fence: Called on the event loop with the steps a pass may delete as failed leftovers,
            before the pass: it must make sure no unit of theirs can be admitted any more.
        metrics: Where deletions are counted.
        check_fence: Raises FencedError once a newer attempt owns the root; called before a
            pass scans and before each deletion. A fenced runner runs no pass any more
            (``fenced`` says why).
        foreign: The names of the step directories another tool wrote (:func:`ckptd.layout.foreign_dirs`):
            uncommitted, they stay.
    """

    def __init__(self, storage: Storage, template, opts: MonitorOptions, ledger, spawn, in_thread,
                 protected, cleanup, mark_deleted, readers=None, metrics: RunMetrics | None = None,
                 fence: Callable[[set[int]], None] | None = None,
                 check_fence: Callable[[], None] | None = None,
                 foreign: set[str] = frozenset()) -> None:
        self._fence = fence
        self._foreign = foreign
        self._not_ours_told: set[str] = set()  # another tool's directories, logged once each
        self._check_fence = check_fence
        self.fenced: str | None = None
        self._metrics = metrics or RunMetrics(None)
        self._storage = storage
        self._template = template
        self._policy = RetentionPolicy.of(opts)
        self._grace_s = opts.leftover_grace_s
        self._ledger = ledger
        self._spawn = spawn
        self._in_thread = in_thread
        self._protected = protected
        self._cleanup = cleanup
        self._mark_deleted = mark_deleted
        self._readers = readers  # a ReaderRegistry: its leases keep steps until the last moment
        self._running = False
        self._again = False
        self._released = asyncio.Event()  # no pass before release(): see its docstring
        self.idle = asyncio.Event()
        self.idle.set()
        self.passes = 0
        self.deleted: list[int] = []
        self.errors: list[str] = []
        self.claims = DeletionClaims(self._may_delete)
        self._counted: set[int] = set()  # the current plan's counted_newest and counted_checkpoints
        self._counted_kinds: dict[int, frozenset[Kind]] = {}  # the manifests the scan saw of those
        self._failed_before: set[tuple[int, Kind]] = set()  # the kinds of steps failed when the pass began
        self._replan = False  # a deletion was refused because the plan kept too few
        self._keeping = 0  # bodies of keeping_committed() running: no committed step is deleted

    @contextlib.asynccontextmanager
    async def keeping_committed(self) -> AsyncIterator[None]:
        """No committed step is deleted while the body runs (one that chooses a step to point a
        tracker at from a scan of its own, which a pass must not delete behind it): the body
        starts once the deletions of committed steps already claimed are over, and a pass runs
        after it for the deletions it held back."""
        self._keeping += 1
        try:
            for deleting in [self.claims.deleting[s] for s in self.claims.committed if s in self.claims.deleting]:
                await deleting.wait()
            yield
        finally:
            self._keeping -= 1
            if not self._keeping:
                self.schedule()

    def release(self) -> None:
        """Let passes run, and run one. Until then :meth:`schedule` only queues a pass: a monitor
        that starts checks the state dicts of its steps in flight first, so that one that was
        being withdrawn when the last monitor died is not counted among those it keeps."""
        self._released.set()
        self.schedule()

    def schedule(self) -> None:
        if self.fenced is not None:
            return
        if self._running:
            self._again = True  # one more pass after this one sees the new commit
            return
        self._running = True
        self.idle.clear()
        self._spawn(self._passes())

    async def _passes(self) -> None:
        self.claims.bind(asyncio.get_running_loop())
        try:
            await self._released.wait()
            replanned = False
            while True:
                self._again = self._replan = False
                in_flight = self._ledger.in_flight_steps()
                protected = self._protected() | in_flight
                failed = self._ledger.failed_steps() - in_flight
                if self._fence is not None:
                    self._fence(failed)  # no await since in_flight was read: nothing slipped in
                # Deleted at once: steps no kind of which can commit any more. A step whose state
                # dict the fence left alone (not older than the newest commit it knew) waits as an
                # idle leftover, like the directory of a save the monitor has not heard of.
                at_once = {s for s in failed if self._ledger.state_of(s, Kind.STATE_DICT) is StepState.FAILED}
                self._failed_before = {(s, k) for s in self._ledger.failed_steps() for k in Kind
                                       if self._ledger.state_of(s, k) is StepState.FAILED}
                try:
                    result = await self._in_thread(self._pass, protected, failed, at_once,
                                                   self._ledger.withdrawing_steps(), self._ledger.committing_steps())
                    self.deleted = (self.deleted + result.deleted)[-_HISTORY:]
                    self._metrics.inc(RETENTION_DELETIONS, len(result.deleted), tier="root")
                    self.errors = result.errors
                except FencedError as e:  # a newer job owns the root: its monitor runs retention now
                    self.fenced = str(e)
                    log.error("retention stops: %s", e)
                    self.errors = [f"{type(e).__name__}: {e}"]
                    break
                except Exception as e:  # best-effort: the next commit runs another pass
                    log.warning("retention pass failed: %s: %s", type(e).__name__, e)
                    self.errors = [f"{type(e).__name__}: {e}"]
                self.passes += 1
                if self._replan and not replanned:
                    replanned = True  # once: the next commit's pass looks again after that
                    continue
                if not self._again:
                    break
        finally:
            self._running = False
            self.idle.set()

    def _pass(self, protected: set[int], failed: set[int], at_once: set[int], withdrawing: set[int],
              settling: set[int]) -> PassResult:
        if self._check_fence is not None:
            self._check_fence()
        trash_error = None
        try:
            empty_trash(self._storage)
        except OSError as e:
            # Best-effort clean-up, retried at every pass: what the trash holds is deleted for
            # readers already, and one entry rm cannot remove must not stop the deletions below.
            trash_error = f"could not empty {TRASH}: {e}"
            log.warning("%s; retrying at the next pass", trash_error)
        failpoints.hit("before_retention_scan")
        entries = scan_steps(self._storage, self._template)
        plan = plan_retention(entries, self._policy, protected=protected, failed=at_once, withdrawing=withdrawing,
                              settling=settling, foreign=self._foreign)
        for entry in plan.not_ours:
            if entry.name not in self._not_ours_told:
                self._not_ours_told.add(entry.name)
                log.info("%s was in the root before ckptd (another tool's checkpoint): retention leaves it alone",
                         entry.name)
        self._counted = plan.counted_newest | plan.counted_checkpoints
        self._counted_kinds = {s: entries[s].kinds for s in self._counted}
        failpoints.hit("after_retention_plan")
        # A committed step's ledger records go before its directory: a monitor killed in between
        # still sees the manifest (committed), never records of a step whose files are gone. A
        # step with a failed kind keeps its records: they are what tells a restarted monitor it
        # failed; a marker says which of its kinds had committed.
        def before_delete(entry: StepEntry) -> None:
            if entry.step in failed:
                self._mark_deleted(entry.step, sorted(entry.kinds))
            else:
                self._cleanup(entry.step)

        readers = self._readers

        def claim(entry: StepEntry) -> bool:
            if not self.claims.claim(entry):
                return False
            if entry.committed and readers is not None and not readers.claim_for_delete(entry.step):
                self.claims.release(entry.step)
                return False
            return True

        def unclaim(entry: StepEntry) -> None:
            if entry.committed and readers is not None:
                readers.deleted(entry.step)
            self.claims.release(entry.step)

        def confirm(entry: StepEntry) -> bool:
            # A step looks again right before its deletion: a withdrawal that began since the claim
            # may need it kept. One with a failed kind had its deletion marked (before_delete): kept,
            # the mark lists no committed kind any more, so a restart goes by its manifests.
            if self.claims.confirm(entry):
                return True
            if entry.committed and entry.step in failed:
                self._mark_deleted(entry.step, [])
            return False

        result = run_plan(self._storage, plan, self._grace_s, before_delete=before_delete,
                          claim=claim, unclaim=unclaim, fence=self._check_fence, confirm=confirm)
        if trash_error is not None:
            result.errors.insert(0, trash_error)
        return result

    def _unsure(self, step: int) -> bool:
        """Whether a step the plan counted may not stay: a manifest the scan saw belongs to a commit
        still in flight (begun after the pass read what was: its publish may yet be taken back) or
        back to pending (taken back, its retry deferred), or its state dict or a kind the scan saw
        committed failed since the pass began (withdrawn, or a publish taken back)."""
        counted = self._counted_kinds.get(step, frozenset())
        for k in {*counted, Kind.STATE_DICT}:
            state = self._ledger.state_of(step, k)
            if state is StepState.FAILED and (step, k) not in self._failed_before:
                return True
            if state in (StepState.COMMITTING, StepState.PENDING) and k in counted:
                return True
        return False

    def _may_delete(self, entry: StepEntry) -> bool:
        """On the event loop, right before a deletion: not if the step is protected now (in
        flight, a registration or commit of it under way, a tracker target), being withdrawn,
        committed while :meth:`keeping_committed` runs, or if a kind the scan did not see
        committed has committed or is committing since. A committed step is not deleted either
        once a step the plan counted among the newest is being withdrawn, or may not stay
        (:meth:`_unsure`): the plan kept too few; another pass follows (once: then the next
        commit's)."""
        step = entry.step
        withdrawing = self._ledger.withdrawing_steps()
        if step in self._protected() or step in withdrawing or entry.committed and self._keeping:
            return False
        if any(self._ledger.state_of(step, k) in (StepState.COMMITTING, StepState.COMMITTED)
               for k in Kind if k not in entry.kinds):
            return False
        if entry.committed and any(s in withdrawing or self._unsure(s) for s in self._counted):
            self._replan = True
            return False
        return True
