"""The CheckpointMonitor Ray actor: a thin async shell over the ledger, slots and journal.

The actor is asynchronous. Its request handlers only touch memory; every piece of storage I/O
(registrations, manifests, trackers, clean-up) runs in a thread pool, so slow storage never
delays notifications from other workers or other steps. Unit receipts are written by the
workers themselves, which is what lets a restarted monitor rebuild its ledger from storage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import ray

from ckptd import failpoints
from ckptd.config import Kind, MonitorOptions
from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.layout import MANIFESTS, TRACKERS, find_step_dir, read_tracker, record_template, scan_steps
from ckptd.manifest import FileEntry, build_manifest, merge_unit_files
from ckptd.monitor import journal
from ckptd.monitor.ledger import StepLedger, StepRecord, StepState, UnitFailure
from ckptd.monitor.mirror import Mirror
from ckptd.monitor.retention import PassResult, RetentionPolicy, plan_retention, run_plan
from ckptd.monitor.shared_root import probe_visible, unshared_message, where_am_i
from ckptd.monitor.status import (
    MonitorStatus,
    RetentionStatus,
    StepStatus,
    StorageStatus,
    Trackers,
    WriterSlotsStatus,
)
from ckptd.monitor.throttle import SlotRequest, WriterSlots
from ckptd.storage import Storage
from ckptd.units import StepDirTemplate, UnitId, check_count, check_step

log = logging.getLogger("ckptd.monitor")

_RETRY_BASE_S = 0.05
_HISTORY = 1000  # deleted steps reported by status()


def _slot_key(unit: UnitId) -> str:
    return f"{unit.step}/{unit.kind.value}/{unit.label}"


class CheckpointMonitor:
    """Decides when a step is committed, and commits it. One per run, named ``ckptd-monitor-{run}``.

    Create it with :func:`ckptd.start_monitor`; talk to it through
    :class:`ckptd.CheckpointCoordinator`, except for :meth:`status` and :meth:`wait_committed`.
    """

    def __init__(self, root: str, run: str, storage_options: dict | None, options: dict,
                 mirror_storage_options: dict | None = None) -> None:
        self._opts = MonitorOptions.parse(options)
        self._root_url = root
        self._run = run
        self._storage = Storage(root, storage_options)
        self._template = StepDirTemplate(self._opts.step_dir_template)
        record_template(self._storage, self._template)
        self._started_at = time.time()
        self._ledger = StepLedger(self._opts.step_timeout_s)
        self._slots = WriterSlots(self._opts.save_strategy)
        self._slot_waiters: dict[str, asyncio.Future] = {}
        self._leases: dict[str, float] = {}
        self._events: dict[tuple[int, Kind], asyncio.Event] = {}
        self._tracker_lock = asyncio.Lock()
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckptd-monitor-io")
        self._tasks: set[asyncio.Task] = set()
        self._policy = RetentionPolicy.of(self._opts)
        self._retention_running = False
        self._retention_again = False
        self._retention_idle = asyncio.Event()
        self._retention_idle.set()
        self._retention_passes = 0
        self._retention_deleted: list[int] = []
        self._retention_errors: list[str] = []
        self._notifications = 0  # requests from coordinators, for throughput figures
        self._where = where_am_i()
        self._probes_checked = 0
        self._unshared: list[str] = []  # processes that do not see this monitor's root
        self._trackers: dict[Kind, int | None] = {k: read_tracker(self._storage, k) for k in Kind}
        ready = self._rebuild()
        self._mirror: Mirror | None = None
        if self._opts.mirror is not None:
            self._mirror = Mirror(self._storage, Storage(self._opts.mirror.url, mirror_storage_options),
                                  self._opts.mirror, self._template, self._committed_at_start, self._schedule_retention)
            self._spawn(self._mirror.run())
        self._spawn(self._housekeeping())
        for rec in ready:
            self._spawn(self._commit(rec))
        self._schedule_retention()

    # -- start-up ------------------------------------------------------------------------------

    def _rebuild(self) -> list[StepRecord]:
        """Rebuild the ledger from storage; return the steps that are ready to commit.

        Runs once, before the actor serves any request, so blocking I/O is fine here.
        """
        now = time.time()
        newest: dict[Kind, int] = {}
        scanned = scan_steps(self._storage, self._template)
        self._committed_at_start = {step: entry.kinds for step, entry in scanned.items() if entry.committed}
        for step, entry in scanned.items():
            for kind in entry.kinds:
                self._ledger.mark_committed(step, kind, now)
                newest[kind] = max(newest.get(kind, -1), step)
        # A monitor that died between the manifest and the tracker left a committed step the
        # tracker does not point at yet: move the trackers forward to what is committed.
        newest[Kind.STATE_DICT] = max(newest.get(Kind.STATE_DICT, -1), newest.get(Kind.CHECKPOINT, -1))
        for kind, step in newest.items():
            current = self._trackers[kind]
            if step >= 0 and (current is None or step > current):
                self._write_tracker(kind, step)
                self._trackers[kind] = step
        ready = []
        for pending in journal.load_pending(self._storage):
            if self._ledger.is_committed(pending.step, pending.kind):
                self._io.submit(self._cleanup, pending.step, pending.kind)
                continue
            first_seen = pending.first_seen() or now
            if pending.count is not None:
                self._ledger.register(pending.step, pending.kind, pending.count, first_seen)
            for unit, (t, files) in pending.finished.items():
                self._ledger.finish(unit, files, t)
            for unit, (t, failure) in pending.failed.items():
                self._ledger.fail(unit, failure, t)
            rec = self._ledger.get(pending.step, pending.kind)
            if rec is None:
                continue
            rec.first_seen = min(rec.first_seen, first_seen)
            if pending.failure_reason:
                self._ledger.fail_step(rec, pending.failure_reason)
            if self._ledger.is_ready(rec):
                ready.append(rec)
        self._ledger.prune(self._opts.status_history)
        return ready

    def _spawn(self, coro) -> None:
        task = asyncio.get_event_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, partial(fn, *args))

    # -- requests ------------------------------------------------------------------------------

    async def ping(self) -> dict:
        """Who is answering: the process and when it started (changes on restart)."""
        return {"pid": os.getpid(), "started_at": self._started_at}

    async def worker_config(self) -> dict:
        """What a coordinator needs to write receipts and honour throttling."""
        return {
            "root": self._root_url,
            "storage_options": self._storage.storage_options,
            "run": self._run,
            "save_strategy": self._opts.save_strategy.value,
            "step_dir_template": self._template.template,
            "slot_lease_s": self._opts.slot_lease_s,
            "options": self._opts.model_dump(mode="json"),
        }

    async def check_shared_root(self, rel: str, token: str, writer: str) -> dict:
        """Read back a probe file that ``writer`` wrote under the root (see
        :mod:`ckptd.monitor.shared_root`). Returns ``{"error": None}`` or ``{"error": message}``."""
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

    async def register(self, step: int, counts: dict[str, int], monitored: str) -> dict:
        """Register how many units each kind of ``step`` expects.

        Returns ``{"error": None}`` on success, or ``{"error": {...}}`` describing a conflict,
        bad input, or a failure of the step, which the coordinator raises as an exception.
        """
        self._notifications += 1
        try:
            step = check_step(step)
            parsed = {Kind(k): check_count(v, f"{k}_thread_count") for k, v in counts.items()}
            monitored_kind = Kind(monitored)
            todo = {k: n for k, n in parsed.items() if n > 0}
            known = self._ledger.get(step, monitored_kind) is not None
            if not todo and not known and not self._ledger.is_committed(step, monitored_kind):
                raise CheckpointConfigError(
                    f"register_and_monitor(global_step={step}) got no unit counts and step {step} "
                    f"has no {monitored_kind.value} registration; pass state_dict_thread_count or "
                    "checkpoint_thread_count (the total number of save units of the step)"
                )
            for kind, n in todo.items():  # validate everything before changing anything
                if not self._ledger.is_committed(step, kind):
                    self._ledger.check_registration(step, kind, n)
        except (CheckpointConfigError, ValueError) as e:
            return {"error": {"type": type(e).__name__, "message": str(e)}}
        now = time.time()
        for kind, n in todo.items():
            if self._ledger.is_committed(step, kind):
                continue
            rec = self._ledger.register(step, kind, n, now)
            # Durable before acknowledged: a restarted monitor must still know what to expect.
            await self._in_thread(journal.write_registration, self._storage, step, kind, n,
                                  rec.registered_at or now)
            self._after_change(rec)
        for kind in {monitored_kind, *todo}:
            failure = self._ledger.failure_of(step, kind)
            if failure is not None:
                unit, cause = failure
                return {"error": {"type": "CheckpointSaveError", "step": step, "kind": kind.value,
                                  "unit": unit, "cause": cause}}
        return {"error": None}

    async def notify_started(self, unit: dict) -> None:
        self._notifications += 1
        self._ledger.start(UnitId.from_dict(unit), time.time())

    async def notify_finished(self, unit: dict, files: list[dict]) -> None:
        self._notifications += 1
        uid = UnitId.from_dict(unit)
        rec = self._ledger.finish(uid, [FileEntry(**f) for f in files], time.time())
        self._release(_slot_key(uid))
        self._after_change(rec)

    async def notify_failed(self, unit: dict, failure: dict) -> None:
        self._notifications += 1
        uid = UnitId.from_dict(unit)
        rec = self._ledger.fail(uid, UnitFailure(**failure), time.time())
        self._release(_slot_key(uid))
        self._after_change(rec)

    async def notify_batch(self, events: list[tuple[str, dict, Any]]) -> None:
        """Several notifications in one call, applied in order: ``("started", unit, None)``,
        ``("finished", unit, files)`` or ``("failed", unit, failure)``. Coordinators batch what
        their save threads report at the same moment, which saves Ray calls under load."""
        for event, unit, payload in events:
            if event == "started":
                await self.notify_started(unit)
            elif event == "finished":
                await self.notify_finished(unit, payload)
            elif event == "failed":
                await self.notify_failed(unit, payload)
            else:
                log.error("ignoring unknown notification %r", event)

    async def acquire_slot(self, unit: dict, node: str, process: str) -> dict:
        """Wait for a writer slot. Returns ``{"granted": True}``, or ``{"aborted": cause}`` when
        the unit's step failed meanwhile (nothing should be written for it then)."""
        self._notifications += 1
        uid = UnitId.from_dict(unit)
        key = _slot_key(uid)
        self._ledger.start(uid, time.time())
        failure = self._ledger.failure_of(uid.step, uid.kind)
        if failure is not None:
            return {"aborted": failure[1]}
        if not self._slots.holds(key):
            fut = self._slot_waiters.get(key)
            if fut is None or fut.done():
                fut = asyncio.get_running_loop().create_future()
                self._slot_waiters[key] = fut
            self._grant(self._slots.request(SlotRequest(key, node, process)))
            result = await asyncio.shield(fut)
            if "aborted" in result:
                return result
        self._leases[key] = time.monotonic() + self._opts.slot_lease_s
        return {"granted": True}

    async def renew_slots(self, held: list[tuple[str, str, str]]) -> None:
        """Extend the leases of slots a coordinator still holds (its writers are alive)."""
        deadline = time.monotonic() + self._opts.slot_lease_s
        for key, node, process in held:
            if not self._slots.holds(key) and key not in self._slots.waiting():
                # A writer granted by the monitor before it restarted: count it again.
                self._slots.adopt(SlotRequest(key, node, process))
            if self._slots.holds(key):
                self._leases[key] = deadline

    async def status(self) -> MonitorStatus:
        return MonitorStatus(
            run=self._run,
            root=self._storage.url,
            trackers=Trackers(checkpoint=self._trackers[Kind.CHECKPOINT],
                              state_dict=self._trackers[Kind.STATE_DICT]),
            steps=[StepStatus.of(r) for r in self._ledger.records()],
            writers=WriterSlotsStatus(strategy=self._opts.save_strategy,
                                      holders=self._slots.holders(), waiting=self._slots.waiting()),
            retention=RetentionStatus(passes=self._retention_passes,
                                      deleted_steps=list(self._retention_deleted),
                                      errors=list(self._retention_errors)),
            notifications=self._notifications,
            storage=StorageStatus(commit_strategy=self._storage.commit.name, monitor=self._where,
                                  probes_checked=self._probes_checked, unshared=list(self._unshared)),
            mirror=None if self._mirror is None else self._mirror.status(),
            started_at=self._started_at,
        )

    async def wait_committed(self, step: int, kind: str = "checkpoint", timeout_s: float | None = None) -> dict:
        """Wait until (step, kind) is committed or failed.

        Returns ``{"committed": bool, "unit": str | None, "cause": str | None}``; ``committed``
        is False with ``cause`` None when the wait timed out, and with ``"unknown": True`` when
        the step is older than the newest commit and nothing of it is known (retention deleted
        it before this monitor started, or it was never saved).
        """
        k = Kind(kind)
        newest = self._trackers[k]
        if self._ledger.get(step, k) is None and not self._settled(step, k) and newest is not None and step < newest:
            # Nothing in flight, and older than what is committed: it was deleted by retention
            # before this monitor started, or never saved. Waiting would only time out.
            return {"committed": False, "unit": None, "unknown": True,
                    "cause": f"step {step} is unknown to the monitor: no save of it is in flight and it is older "
                             f"than the newest committed step ({newest}); retention deleted it or it was never saved"}
        event = self._event(step, k)
        if not self._settled(step, k):
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return {"committed": False, "unit": None, "cause": None}
        failure = self._ledger.failure_of(step, k)
        if failure is not None:
            return {"committed": False, "unit": failure[0], "cause": failure[1]}
        return {"committed": True, "unit": None, "cause": None}

    async def wait_mirrored(self, step: int, timeout_s: float | None = None) -> dict:
        """Wait until ``step`` is committed on the mirror.

        Returns ``{"mirrored": bool, "error": str | None}``: ``error`` is None when the wait
        timed out, and says why otherwise (no mirror configured, or a local copy that cannot be
        uploaded).
        """
        if self._mirror is None:
            return {"mirrored": False, "error": "this monitor has no mirror; start it with mirror=URL"}
        return await self._mirror.wait(step, timeout_s)

    async def retry_mirror(self) -> None:
        """Try failed uploads to the mirror again now, instead of after ``retry_after_s``."""
        if self._mirror is not None:
            self._mirror.retry_now()

    # -- commit --------------------------------------------------------------------------------

    def _event(self, step: int, kind: Kind) -> asyncio.Event:
        event = self._events.get((step, kind))
        if event is None:
            event = self._events[(step, kind)] = asyncio.Event()
            if self._settled(step, kind):
                event.set()
        return event

    def _settled(self, step: int, kind: Kind) -> bool:
        return self._ledger.is_committed(step, kind) or self._ledger.failure_of(step, kind) is not None

    def _after_change(self, rec: StepRecord) -> None:
        if self._ledger.is_ready(rec):
            self._ledger.begin_commit(rec, time.time())
            self._spawn(self._commit(rec))
        elif rec.state is StepState.FAILED:
            self._on_failed(rec)

    def _on_failed(self, rec: StepRecord) -> None:
        self._abort_waiters(rec.step, rec.kind, rec.failure_summary()[1])
        event = self._events.pop(rec.key, None)
        if event is not None:
            event.set()

    async def _commit(self, rec: StepRecord) -> None:
        if rec.state is StepState.PENDING:
            self._ledger.begin_commit(rec, time.time())
        finished = dict(rec.finished)
        try:
            await self._retrying(self._write_manifest, rec.step, rec.kind, finished)
        except Exception as e:
            reason = f"commit failed after {self._opts.commit_retries + 1} attempts: {type(e).__name__}: {e}"
            log.error("step %d (%s): %s", rec.step, rec.kind.value, reason)
            self._ledger.fail_step(rec, reason)
            self._on_failed(rec)
            await self._record_step_failure(rec, reason)
            return
        # The manifest makes the step committed for readers; the trackers only point at it. A
        # tracker that cannot be advanced does not uncommit the step (the next commit, or the
        # next start-up, moves it forward). Waiters are released only after both, so that
        # latest_step() agrees with wait_committed().
        try:
            await self._advance_trackers(rec.step, rec.kind)
        except Exception as e:
            rec.reason = f"committed, but the tracker could not be advanced: {type(e).__name__}: {e}"
            log.error("step %d (%s): %s", rec.step, rec.kind.value, rec.reason)
        self._ledger.commit_done(rec, time.time())
        event = self._events.pop(rec.key, None)
        if event is not None:
            event.set()
        self._ledger.prune(self._opts.status_history)
        if self._mirror is not None and (self._mirror.mirrors(rec.kind)
                                         or self._ledger.is_committed(rec.step, Kind.CHECKPOINT)):
            # Before retention runs: the step is protected until mirrored. A state dict committed
            # after its step's checkpoint goes up too: readers of the step see both manifests.
            self._mirror.enqueue(rec.step)
        # Best-effort clean-up: leftovers of a committed step are ignored by every reader and
        # removed again at the next start-up, so a failure here is only logged.
        self._io.submit(self._cleanup, rec.step, rec.kind)
        self._schedule_retention()

    async def _retrying(self, fn, *args) -> Any:
        for attempt in range(self._opts.commit_retries + 1):
            try:
                return await self._in_thread(fn, *args)
            except Exception as e:
                if attempt == self._opts.commit_retries:
                    raise
                log.warning("%s failed (%s: %s); retrying", fn.__name__, type(e).__name__, e)
                await asyncio.sleep(_RETRY_BASE_S * 2**attempt)

    def _write_manifest(self, step: int, kind: Kind, finished: dict[str, list[FileEntry]]) -> None:
        failpoints.hit("before_manifest")
        name = find_step_dir(self._storage, step, self._template)
        if name is None:
            raise CheckpointError(
                f"no directory of step {step} matches {self._template.template!r}: its save units "
                "wrote no files, and the directory name needs the epoch"
            )
        step_path = self._storage.join(name)
        files = merge_unit_files(self._storage, step_path, finished)
        manifest = build_manifest(step, kind, list(finished), files)
        self._storage.makedirs(step_path)
        self._storage.write_atomic(f"{step_path}/{MANIFESTS[kind]}",
                                   manifest.to_bytes())

    async def _advance_trackers(self, step: int, kind: Kind) -> None:
        # A full checkpoint holds the weights too, so it also advances the state-dict tracker.
        kinds = (Kind.CHECKPOINT, Kind.STATE_DICT) if kind is Kind.CHECKPOINT else (Kind.STATE_DICT,)
        async with self._tracker_lock:  # trackers only move forward, one writer at a time
            for k in kinds:
                current = self._trackers[k]
                if current is not None and step <= current:
                    continue
                await self._retrying(self._write_tracker, k, step)
                self._trackers[k] = step

    def _write_tracker(self, kind: Kind, step: int) -> None:
        self._storage.write_atomic(self._storage.join(TRACKERS[kind]), f"{step}\n".encode(),
                                   before_publish=partial(failpoints.hit, "before_tracker_rename"))

    def _cleanup(self, step: int, kind: Kind) -> None:
        try:
            journal.remove_pending(self._storage, step, kind)
        except Exception as e:
            log.warning("could not remove ledger records of step %d (%s): %s", step, kind.value, e)

    async def _record_step_failure(self, rec: StepRecord, reason: str) -> None:
        try:
            await self._in_thread(journal.write_step_failure, self._storage, rec.step, rec.kind, reason)
        except Exception as e:
            # The step is failed in memory and uncommitted in storage either way; without this
            # record a restarted monitor would only time the step out again.
            log.error("could not record the failure of step %d (%s): %s", rec.step, rec.kind.value, e)

    # -- retention -----------------------------------------------------------------------------

    async def wait_retention(self, timeout_s: float | None = None) -> bool:
        """Wait until no retention pass is running or due, on the root and on the mirror; False if
        ``timeout_s`` ran out first."""
        async def idle() -> None:
            await self._retention_idle.wait()
            if self._mirror is not None:
                await self._mirror.retention_idle.wait()

        try:
            await asyncio.wait_for(idle(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _schedule_retention(self) -> None:
        if self._retention_running:
            self._retention_again = True  # one more pass after this one sees the new commit
            return
        self._retention_running = True
        self._retention_idle.clear()
        self._spawn(self._retention_loop())

    async def _retention_loop(self) -> None:
        try:
            while True:
                self._retention_again = False
                # What is protected is read here, on the event loop, before the scan: a step
                # that starts saving after this is newer than the newest commit, or still being
                # written (so not idle), and is left alone either way.
                in_flight = self._ledger.in_flight_steps()
                protected = in_flight | {s for s in self._trackers.values() if s is not None}
                if self._mirror is not None:
                    protected |= self._mirror.protected()
                failed = self._ledger.failed_steps() - in_flight
                try:
                    result = await self._in_thread(self._retention_pass, protected, failed)
                    self._retention_deleted = (self._retention_deleted + result.deleted)[-_HISTORY:]
                    self._retention_errors = result.errors
                except Exception as e:  # best-effort: the next commit runs another pass
                    log.warning("retention pass failed: %s: %s", type(e).__name__, e)
                    self._retention_errors = [f"{type(e).__name__}: {e}"]
                self._retention_passes += 1
                if not self._retention_again:
                    break
        finally:
            self._retention_running = False
            self._retention_idle.set()

    def _retention_pass(self, protected: set[int], failed: set[int]) -> PassResult:
        entries = scan_steps(self._storage, self._template)
        plan = plan_retention(entries, self._policy, protected=protected, failed=failed)
        result = run_plan(self._storage, plan, self._opts.leftover_grace_s)
        for entry in plan.leftovers_failed:
            if entry.step in result.deleted:
                for kind in Kind:
                    self._cleanup(entry.step, kind)
        return result

    # -- writer slots --------------------------------------------------------------------------

    def _grant(self, keys: list[str]) -> None:
        for key in keys:
            fut = self._slot_waiters.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result({"granted": True})

    def _release(self, key: str) -> None:
        self._leases.pop(key, None)
        fut = self._slot_waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result({"aborted": "the unit reported its outcome before it was granted a slot"})
        self._grant(self._slots.release(key))

    def _abort_waiters(self, step: int, kind: Kind, cause: str) -> None:
        prefix = f"{step}/{kind.value}/"
        for key in [k for k in self._slot_waiters if k.startswith(prefix)]:
            fut = self._slot_waiters.pop(key)
            if not fut.done():
                fut.set_result({"aborted": cause})
            self._grant(self._slots.release(key))

    # -- housekeeping --------------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        period = min(1.0, self._opts.step_timeout_s / 4, self._opts.slot_lease_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                for rec in self._ledger.expire(time.time()):
                    log.error("step %d (%s) failed: %s", rec.step, rec.kind.value, rec.reason)
                    self._on_failed(rec)
                    await self._record_step_failure(rec, rec.reason or "timed out")
                now = time.monotonic()
                for key in [k for k, t in self._leases.items() if t < now]:
                    log.warning("writer slot %s expired: its writer stopped renewing it", key)
                    self._release(key)
            except Exception:  # keep housekeeping alive whatever one round hit
                log.exception("monitor housekeeping round failed")


def monitor_actor_class():
    """The Ray actor class (built lazily so that importing ckptd does not need Ray running)."""
    return ray.remote(CheckpointMonitor)

