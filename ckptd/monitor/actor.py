"""The CheckpointMonitor Ray actor: a thin async shell over the ledger, the commit path, the
writer slots and retention.

The actor is asynchronous. Its request handlers only touch memory, except where a record must be
durable before the caller is answered (a registration, a failure); every piece of storage I/O runs
in a thread pool, so slow storage never delays notifications from other workers or other steps.
Unit receipts are written by the workers themselves, which is what lets a restarted monitor
rebuild its ledger from storage.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial

import ray

from ckptd import protocol
from ckptd.config import Kind, MonitorOptions
from ckptd.errors import CheckpointConfigError, RegistrationConflictError
from ckptd.fencing import AttemptRecord, FencedError, check_fence
from ckptd.layout import foreign_dirs, read_tracker
from ckptd.metrics import RunMetrics
from ckptd.monitor.attempts import clean_up_older_attempts, mark_started, started_before
from ckptd.monitor.commit import Committer
from ckptd.monitor.commit_flow import CommitFlow
from ckptd.monitor.fence_watch import FENCE_CHECK_S, FenceWatch
from ckptd.monitor.gauges import Gauges
from ckptd.monitor.ledger import StepLedger, StepRecord
from ckptd.monitor.mirror import Mirror
from ckptd.monitor.publication import Publication
from ckptd.monitor.readers import ReaderRegistry
from ckptd.monitor.rebuild import rebuild
from ckptd.monitor.recorder import Recorder
from ckptd.monitor.retention_runner import RetentionRunner
from ckptd.monitor.slots import SlotLeases
from ckptd.monitor.startup import Startup
from ckptd.monitor.status import build_status
from ckptd.monitor.unit_reports import UnitReports, slot_key
from ckptd.monitor.waits import Waits
from ckptd.monitor.withdrawal import Withdrawal, Withdrawals
from ckptd.protocol import Registration, UnitId
from ckptd.shared_root import probe_visible, unshared_message, where_am_i
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate
from ckptd.units import check_count, check_step

log = logging.getLogger("ckptd.monitor")

_HISTORY = 1000  # unshared writers reported by status()


class CheckpointMonitor(Startup, UnitReports, Withdrawals, CommitFlow, Publication, FenceWatch, Waits):
    """Decides when a step is committed, and commits it. One per run, named ``ckptd-monitor-{run}``.

    Create it with :func:`ckptd.start_monitor`; talk to it through
    :class:`ckptd.CheckpointCoordinator`, except for :meth:`status` and :meth:`wait_committed`.
    """

    def __init__(self, root: str, run: str, storage_options: dict | None, options: dict,
                 mirror_storage_options: dict | None = None, attempt: int = 0,
                 namespace: str | None = None) -> None:
        self._opts = MonitorOptions.parse(options)
        # The monitor's process holds a large, long-lived heap (a record per unit: 40,000 a step at
        # 10,000 ranks) and allocates a few objects per notification: with the default thresholds
        # the cyclic collector walks that heap again and again, a third of a big commit's time.
        # Collect the young generation 100x less often; reference counting still frees the rest.
        gc.set_threshold(70_000, 20, 20)
        self._root_url = root
        self._run = run
        self._namespace = namespace
        self._attempt = attempt
        self._metrics = RunMetrics(run)
        self._gauges = Gauges(self._metrics)
        self._storage = Storage(root, storage_options)
        self._attempt_id = protocol.attempt_id(attempt, self._storage.url)
        self._template = StepDirTemplate(self._opts.step_dir_template)
        self._committer = Committer(self._storage, self._template, attempt, lambda: self._fence_for_good)
        self._started_at = time.time()
        self._ledger = StepLedger(self._opts.step_timeout_s, self._opts.unregistered_warning_s)
        self._events: dict[tuple[int, Kind], asyncio.Event] = {}
        self._committing: dict[int, asyncio.Event] = {}  # steps with a commit in flight
        self._registering: dict[int, int] = {}  # steps with registrations being written: no commit begins
        self._arriving: dict[int, int] = {}  # steps with registrations received, not yet answered (Waits)
        self._arrived: dict[int, asyncio.Event] = {}  # set once a step has none arriving any more
        self._failure_writes: set[tuple[int, Kind]] = set()  # failures known, not reported yet
        self._failures_on_storage: dict[tuple[int, Kind], asyncio.Event] = {}  # awaited by a unit's report
        self._withdrawals: dict[int, Withdrawal] = {}  # state dicts being withdrawn
        self._cut_short: dict[int, str] = {}  # withdrawals a restart found recorded, and why (Rebuilt)
        self._tracker_lock = asyncio.Lock()
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckptd-monitor-io")
        self._tasks: set[asyncio.Task] = set()
        self._notifications = 0  # requests from coordinators, for throughput figures
        self._where = where_am_i()
        self._probes_checked = 0
        self._unshared: list[str] = []  # processes that do not see this monitor's root
        self._failures_recorded: set[tuple[int, Kind]] = set()  # being recorded, or recorded
        self._failures_durable: set[tuple[int, Kind]] = set()  # recorded: may be reported
        self._undecided: set[tuple[int, Kind]] = set()  # publishes a newer job's attempt left to it (CommitFlow)
        self._warned: set[str] = set()
        self._fenced: str | None = None
        self._newer_attempt: AttemptRecord | None = None  # found by the last fence check (FenceWatch)
        self._newer_seen: frozenset[AttemptRecord] = frozenset()  # every newer one it found
        self._fence_seen = 0  # refusals of a publish by a newer attempt (FenceWatch)
        try:
            check_fence(self._storage, attempt)
        except FencedError as e:
            self._fenced = str(e)
            log.error("%s", e)
        restarted = started_before(self._storage, attempt)
        # A first start that found itself fenced did not do its start-up's work (below): for good.
        self._fence_for_good = self._fenced is not None and not restarted
        self._deferred_checks: dict[int, tuple[StepRecord, str]] = {}  # FenceWatch
        self._deferred_withdrawals: dict[int, StepRecord] = {}
        self._trackers_unrepaired = self._fenced is not None  # rebuild() leaves them to a lift
        if not restarted and self._fenced is None:
            clean_up_older_attempts(self._storage, attempt, self._template)
            mark_started(self._storage, attempt)
        self._slots = SlotLeases(self._opts.save_strategy, self._opts.slot_lease_s, restarted)
        self._trackers: dict[Kind, int | None] = {k: read_tracker(self._storage, k) for k in Kind}
        self._readers = ReaderRegistry(self._opts.read_lease_s)
        self._version_changed = asyncio.Event()
        # Another tool's step directories: never deleted, never saved into (see _admit).
        self._foreign: dict[int, str] = {step: name for name in foreign_dirs(self._storage) or ()
                                         if (step := self._template.parse(name)) is not None}
        # Runs before the actor serves any request, so blocking I/O is fine here.
        rebuilt = rebuild(self._storage, self._template, self._attempt, self._ledger,
                          None if self._fenced else self._committer, self._trackers, set(self._foreign.values()))
        self._committed_at_start = rebuilt.committed_at_start
        self._restore_readers(rebuilt.scanned)  # before retention: leases recorded by earlier monitors hold their steps
        self._failures_recorded |= rebuilt.failures
        for step in rebuilt.settled:
            self._io.submit(self._cleanup, step)
        self._recorder = Recorder(self._storage, run, attempt, self._opts.timeline_steps,
                                  self._opts.timeline_flush_s, self._in_thread)
        self._spawn(self._recorder.run())
        self._mirror: Mirror | None = None
        self._retention = RetentionRunner(self._storage, self._template, self._opts, self._ledger,
                                          self._spawn, self._in_thread, self._protected, self._cleanup,
                                          partial(protocol.write_step_deleted, self._storage, self._attempt),
                                          self._readers, self._metrics, self._fence_failed_leftovers,
                                          partial(check_fence, self._storage, attempt),
                                          set(self._foreign.values()))
        if self._opts.mirror is not None:
            self._mirror = Mirror(self._storage, Storage(self._opts.mirror.url, mirror_storage_options),
                                  self._opts.mirror, self._template, self._committed_at_start,
                                  self._retention.schedule, self._recorder.upload, self._metrics,
                                  partial(check_fence, self._storage, attempt))
            self._spawn(self._mirror.run())
        self._spawn(self._housekeeping())
        # Steps that timed out while no monitor ran (or before the last one recorded it) fail
        # before anything can commit them.
        self._ledger.expire(time.time())
        self._hold_failures(rebuilt.steps, rebuilt.failures)
        self._cut_short = dict(rebuilt.withdrawals)
        self._spawn(self._resume(rebuilt.steps, rebuilt.withdrawals))

    def _spawn(self, coro) -> None:
        task = asyncio.get_event_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, partial(fn, *args))

    # -- requests ------------------------------------------------------------------------------

    async def ping(self) -> dict:
        """Who is answering: the process, when it started (changes on restart), the attempt."""
        return {"pid": os.getpid(), "started_at": self._started_at, "attempt": self._attempt,
                "attempt_id": self._attempt_id, "root": self._storage.url, "run": self._run}

    async def worker_config(self) -> dict:
        """What a coordinator needs to write receipts and honour throttling."""
        return {
            "root": self._root_url,
            "storage_options": self._storage.storage_options,
            "run": self._run,
            "namespace": self._namespace,
            "attempt": self._attempt,
            "attempt_id": self._attempt_id,
            "save_strategy": self._opts.save_strategy.value,
            "step_dir_template": self._template.template,
            "slot_lease_s": self._opts.slot_lease_s,
            "options": self._opts.model_dump(mode="json"),
        }

    async def check_shared_root(self, rel: str, token: str, writer: str) -> dict:
        """Read back a probe file that ``writer`` wrote under the root (see
        :mod:`ckptd.shared_root`). Returns ``{"error": None}`` or ``{"error": message}``."""
        self._probes_checked += 1
        try:
            visible = await self._in_thread(probe_visible, self._storage, rel, token)
        except OSError as e:
            visible = False
            log.warning("could not read the probe of %s: %s", writer, e)
        if visible:
            return {"error": None}
        message = unshared_message(self._storage.url, writer, self._where)
        log.error("%s", message)
        self._unshared = (self._unshared + [writer])[-_HISTORY:]
        return {"error": message}

    async def register(self, step: int, counts: dict[str, int], monitored: str, reg_id: str) -> dict:
        """Add unit counts to ``step`` and ask for its ``monitored`` kind to be committed.

        Registrations of a step add up; ``reg_id`` makes a retried call count once. Returns
        ``{"error": None}``, or ``{"error": {...}}`` describing bad input or a failure of the
        step, which the coordinator raises as an exception.
        """
        self._notifications += 1
        try:
            reg = Registration(
                reg_id=reg_id, step=check_step(step), monitored=Kind(monitored), at=time.time(),
                counts={Kind(k): check_count(v, f"{k}_thread_count") for k, v in counts.items()},
            )
        except (CheckpointConfigError, ValueError) as e:
            return {"error": {"type": type(e).__name__, "message": str(e)}}
        # Until answered, it may be what a wait on the step's mirror needs to know of (Waits).
        self._arriving[reg.step] = self._arriving.get(reg.step, 0) + 1
        try:
            return await self._register(reg)
        finally:
            left = self._arriving.pop(reg.step) - 1
            if left:
                self._arriving[reg.step] = left
            else:
                arrived = self._arrived.pop(reg.step, None)
                if arrived is not None:
                    arrived.set()

    async def _register(self, reg: Registration) -> dict:
        while True:
            await self.quiesce(reg.step)  # a commit in flight must not be told about new units
            try:
                self._ledger.check_registration(reg)
            except RegistrationConflictError as e:
                # Committed meanwhile: a call that Ray retried across a restart was counted already.
                if await self._in_thread(self._committer.registered_before, reg.step, reg.reg_id):
                    return {"error": None}
                return {"error": {"type": type(e).__name__, "message": str(e)}}
            except CheckpointConfigError as e:
                return {"error": {"type": type(e).__name__, "message": str(e)}}
            failed = await self._failure_for(reg)  # waits for failure records being written
            if not self._busy(reg.step):
                break  # else a commit (or a deletion) began while that record was written: look again
        if self._ledger.registration_is_moot(reg):
            # Every kind it could change has settled: nothing is written, and a failure among
            # them is the answer (the units it announces would count toward nothing).
            return failed or await self._failure_for(reg, self._ledger.kinds_affected(reg)) or {"error": None}
        # A kind it concerns may still commit (the state dict of a step whose checkpoint unit
        # failed first): apply it, then report the failure, so that the outcome does not depend
        # on whether the failure came before or after the registration.
        rec = self._ledger.get(reg.step)
        if rec is None or reg.reg_id not in rec.registrations:
            # Durable before acknowledged: a restarted monitor must still know what to expect.
            # No commit of the step may begin meanwhile: it could not count this registration.
            self._registering[reg.step] = self._registering.get(reg.step, 0) + 1
            try:
                await self._in_thread(protocol.write_registration, self._storage, self._attempt, reg)
                self._ledger.register(reg)
            finally:
                left = self._registering.pop(reg.step) - 1
                if left:
                    self._registering[reg.step] = left
                held = self._ledger.get(reg.step)
                if held is not None:  # the commits it held back, if any: also when the write failed
                    await self._after_change(held)
        return await self._failure_for(reg) or {"error": None}

    async def _failure_for(self, reg: Registration, kinds: set[Kind] | None = None) -> dict | None:
        """The error to answer a registration with if one of ``kinds`` (by default those it
        concerns) failed, once that failure is recorded on storage: not once it is reported
        (:meth:`on_storage`), which for a full checkpoint waits for its state dict's check, and
        any withdrawal that sets off. A state dict being withdrawn counts as failed."""
        await self.on_storage(reg.step)
        kinds = self._ledger.kinds_concerned(reg) if kinds is None else kinds
        for kind in sorted(kinds, key=lambda k: k is not reg.monitored):
            undecided = self._undecided_cause(reg.step, kind)
            if undecided is not None:  # never "failed": a newer job may commit it
                return {"error": {"type": "CheckpointError", "message": undecided}}
            failure = self._ledger.failure_of(reg.step, kind)
            if failure is None and kind is Kind.STATE_DICT:
                withdrawn = await self.withdrawn_because(reg.step)
                failure = None if withdrawn is None else (None, withdrawn)
            if failure is not None:
                unit, cause = failure
                return {"error": {"type": "CheckpointSaveError", "step": reg.step, "kind": kind.value,
                                  "unit": unit, "cause": cause}}
        return None

    async def acquire_slot(self, unit: dict, node: str, process: str) -> dict:
        """Admit the unit, then wait for a writer slot. Returns ``{"granted": True}``, or
        ``{"aborted": cause}`` when the unit may not write (its step is committed or failed)."""
        self._notifications += 1
        uid = UnitId.from_dict(unit)
        why = await self._admit(uid)
        if why is not None:
            return {"aborted": why}
        return await self._slots.acquire(slot_key(uid), node, process)

    async def renew_slots(self, held: list[tuple[str, str, str]]) -> None:
        """Extend the leases of slots a coordinator still holds (its writers are alive)."""
        self._slots.renew(held)

    async def status(self):
        return build_status(self)

    async def timeline(self, flush: bool = False) -> dict:
        """The run's timeline spans kept in memory (see :mod:`ckptd.monitor.events`), for
        ``ckptd timeline``: ``{"run", "root", "spans": [...], "flushed": bool | None}``. With
        ``flush``, the spans not persisted yet are written under the root first."""
        flushed = await self._recorder.flush() if flush else None
        return {"run": self._run, "root": self._storage.url, "spans": self._recorder.spans(), "flushed": flushed}

    async def retry_mirror(self) -> None:
        """Try failed uploads to the mirror again now, instead of after ``retry_after_s``."""
        if self._mirror is not None:
            self._mirror.retry_now()

    async def wait_retention(self, timeout_s: float | None = None) -> bool:
        """Wait until no retention pass is running or due, on the root and on the mirror; False if
        ``timeout_s`` ran out first."""
        async def idle() -> None:
            await self._retention.idle.wait()
            if self._mirror is not None:
                await self._mirror.retention_idle.wait()

        try:
            await asyncio.wait_for(idle(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _protected(self) -> set[int]:
        protected = self._ledger.in_flight_steps() | {s for s in self._trackers.values() if s is not None}
        protected |= self._committing.keys() | self._registering.keys()  # no record may say so yet
        protected |= self._reader_protected()
        if self._mirror is not None:
            protected |= self._mirror.protected()
        return protected

    # -- housekeeping --------------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        period = min(1.0, self._opts.step_timeout_s / 4, self._opts.slot_lease_s / 4, self._opts.read_lease_s / 4)
        fence_check: asyncio.Task | None = None
        next_fence_check = time.monotonic() + FENCE_CHECK_S
        while True:
            await asyncio.sleep(period)
            try:
                if not self._fence_for_good and time.monotonic() >= next_fence_check and (
                        fence_check is None or fence_check.done()):
                    next_fence_check = time.monotonic() + FENCE_CHECK_S
                    fence_check = asyncio.get_running_loop().create_task(self._look_for_newer_attempt())
                for rec, _kind in self._fail_if_fenced() + self._ledger.expire(time.time()):
                    if self._after_change_sync(rec):
                        # In a task of its own: recording the failure retries for as long as storage
                        # refuses it, and slot and lease expiry below must go on meanwhile.
                        self._spawn(self._record_new_failures(rec))
                self._slots.expire()
                self._expire_readers(time.time())
                self._warn()
            except Exception:  # keep housekeeping alive whatever one round hit
                log.exception("monitor housekeeping round failed")
            self._gauges.refresh(partial(build_status, self, units=False))

    def _warn(self) -> None:
        warnings = self._ledger.warnings(time.time())
        for w in set(warnings) - self._warned:
            log.warning("%s", w)
        self._warned = set(warnings)


@cache
def monitor_actor_class():
    """The Ray actor class (built lazily so that importing ckptd does not need Ray running).

    One class for the process: Ray exports a class to the cluster once per job, fingerprinting
    its code first (about 0.15 s here), so a new class per monitor would pay that on every start.
    """
    return ray.remote(CheckpointMonitor)
