"""CheckpointCoordinator: runs save units in named background threads and reports them.

The API matches the coordinator that verl / Trinity-RFT style pipelines already use
(``save_async``, ``save_sync``, ``wait_all``, ``register_and_monitor``), so their code works
unchanged.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import ray

from ckptd import protocol
from ckptd.config import Kind, SaveStrategy
from ckptd.coordinator.client import MonitorClient
from ckptd.coordinator.lanes import Job, Lane
from ckptd.coordinator.staged_saves import StagedSaves
from ckptd.coordinator.staging import StagingArea
from ckptd.coordinator.trainer_calls import TrainerCalls
from ckptd.coordinator.unit_runner import UnitRunner
from ckptd.coordinator.writer_process import WRITERS, WriterProcess
from ckptd.errors import CheckpointConfigError, CheckpointError, CheckpointSaveError, add_note
from ckptd.metrics import SAVE_BLOCKED
from ckptd.protocol import UnitId
from ckptd.shared_root import remove_probe, where_am_i, write_probe
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate
from ckptd.units import check_count, check_name, check_step

log = logging.getLogger("ckptd.coordinator")

_CLOSED = ("this CheckpointCoordinator is closed: close() was called, and a save made after it would not be "
           "waited for; make saves before close()")
_live: weakref.WeakSet[CheckpointCoordinator] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    # Save threads are daemons so that a forgotten wait_all() cannot hang the interpreter, but a
    # save in flight at exit would be cut off: finish them here (errors are logged, not raised).
    for coord in list(_live):
        coord._drain()


class CheckpointCoordinator(TrainerCalls, StagedSaves):
    """Runs save units in background threads and reports them to the CheckpointMonitor.

    Args:
        checkpoint_monitor: The monitor's actor handle (:func:`ckptd.start_monitor` or
            :func:`ckptd.get_monitor`).
        worker_id: Names this coordinator in unit ids; defaults to the Ray actor id, or the node
            and process id outside an actor. Two coordinators must not share one.
        max_pending: How many units of one name may wait behind the running one before
            ``save_async`` blocks (back-pressure bounds the memory that queued saves hold).
        max_staged: How many staged snapshots of one name (:meth:`save_state_async`) may be in
            flight; the next save of that name waits for one to be written. Staging memory is
            at most this many copies of the state, allocated once and reused.
        notify_timeout_s: How long a call to the monitor may take, retries included: a monitor
            that stays unreachable (dead, restarting) or alive and not answering (stopped,
            stuck) for that long fails the call, and a save that needed it fails with the cause.
        writer: Where :meth:`save_state_async` writes its snapshots: ``"thread"`` (a save thread
            of this process) or ``"process"`` (a writer process of this coordinator, with the
            staging buffers in shared memory, so a GIL-bound training loop does not share its
            GIL with the write, CRC-32 and fsync; see :mod:`ckptd.coordinator.writer_process`).

    Raises:
        CheckpointConfigError: bad arguments, or this process does not see the same storage
            under the root as the monitor (a local path on a multi-node cluster): the message
            names this node. The check writes a probe file under ``root/.ckptd/probes`` and
            the monitor reads it back.

    NOTE: a save function runs while training goes on. If it reads tensors that the optimizer
    changes in place, copy them first (``{k: v.clone() for k, v in sd.items()}``), or the
    checkpoint mixes two steps.
    """

    def __init__(
        self,
        checkpoint_monitor: Any,
        *,
        worker_id: str | None = None,
        max_pending: int = 1,
        max_staged: int = 1,
        notify_timeout_s: float = 600.0,
        writer: str = "thread",
    ) -> None:
        if check_count(max_pending, "max_pending") < 1:
            raise CheckpointConfigError("max_pending must be >= 1")
        if check_count(max_staged, "max_staged") < 1:
            raise CheckpointConfigError("max_staged must be >= 1")
        if writer not in WRITERS:
            raise CheckpointConfigError(f"writer must be one of {', '.join(map(repr, WRITERS))}, got {writer!r}")
        if worker_id is not None:
            check_name(worker_id, "worker_id")
        if not isinstance(checkpoint_monitor, ray.actor.ActorHandle):
            hint = (f"; to attach to run {checkpoint_monitor!r}, pass ckptd.get_monitor({checkpoint_monitor!r})"
                    if isinstance(checkpoint_monitor, str) else "")
            raise CheckpointConfigError(
                f"checkpoint_monitor must be the monitor's actor handle, which ckptd.start_monitor(root) returns, "
                f"got {type(checkpoint_monitor).__name__}{hint}")
        self._client = MonitorClient(checkpoint_monitor, float(notify_timeout_s))
        cfg = self._client.call("worker_config")
        self._run = cfg["run"]
        self._attempt = int(cfg["attempt"])
        self._attempt_id = str(cfg["attempt_id"])
        self._client.bind(cfg["run"], cfg.get("namespace"), self._attempt_id,
                          f"attempt {self._attempt} of root {cfg['root']!r}")
        self._root_url = cfg["root"]
        self._storage = Storage(cfg["root"], cfg["storage_options"], cfg["options"].get("direct_io", "auto"))
        self._client.watch_root(self._storage, self._attempt)
        self._template = StepDirTemplate(cfg["step_dir_template"])
        ctx = ray.get_runtime_context()
        self._worker = check_name(worker_id or protocol.default_worker_id(ctx.get_node_id(), ctx.get_actor_id()),
                                  "worker_id")
        node = ctx.get_node_id()
        if cfg["options"].get("node_relay"):
            self._client.use_relay(node, int(cfg["options"].get("relay_zones") or 0))
        self._outbox = protocol.TimingOutbox()
        self._runner = UnitRunner(self._client, self._storage, self._template, self._attempt,
                                  SaveStrategy(cfg["save_strategy"]), float(cfg["slot_lease_s"]), node,
                                  f"{node}:{os.getpid()}", self._outbox)
        self._fence_step: int | None = None  # the step of the fenced copies before_update waits for
        self._max_pending = max_pending
        self._staging = StagingArea(max_staged, f"ckptd-stage-{self._worker}", shared=writer == "process")
        self._writer = WriterProcess(self._worker) if writer == "process" else None
        # Reentrant: close() may run in a signal handler that interrupted this thread in a save call.
        self._lock = threading.RLock()
        self._closing = False  # close() was called: no unit is queued any more
        self._stopped = False  # close() told the save threads to end: a job queued now never runs
        # Save calls between their closed check and their job in a lane, per thread.
        self._queueing: collections.Counter[int] = collections.Counter()
        self._queued = threading.Condition(self._lock)
        self._lanes: dict[str, Lane] = {}
        self._errors: list[CheckpointSaveError] = []
        self._last_saved: dict[Kind, int] = {}  # newest step each kind was asked to save
        self._has_mirror = cfg["options"].get("mirror") is not None
        self._closed = self._runner.closed
        self._check_shared_root()
        _live.add(self)

    def _check_shared_root(self) -> None:
        writer = f"worker {self._worker!r} on {where_am_i()}"
        probe = write_probe(self._storage, writer)  # raises if this worker cannot write the root
        try:
            result = self._client.call("check_shared_root", probe.rel, probe.token, writer)
        finally:
            remove_probe(self._storage, probe)
        if result["error"] is not None:
            raise CheckpointConfigError(result["error"])

    @property
    def worker_id(self) -> str:
        return self._worker

    @property
    def has_mirror(self) -> bool:
        """Whether the monitor uploads committed steps to a mirror (``start_monitor(mirror=...)``)."""
        return self._has_mirror

    def last_saved_step(self, is_state_dict: bool = False) -> int | None:
        """The newest step this coordinator was asked to save (by ``save_async``,
        ``save_state_async`` or ``save_sync``) for that kind, or None; the save may still run."""
        with self._lock:
            return self._last_saved.get(Kind.from_flag(is_state_dict))

    def _saw(self, unit: UnitId) -> None:
        with self._lock:
            self._last_saved[unit.kind] = max(unit.step, self._last_saved.get(unit.kind, unit.step))

    # -- worker side ---------------------------------------------------------------------------

    def save_async(
        self,
        name: str,
        save_fn: Callable[[], None],
        global_step: int,
        is_state_dict: bool = False,
    ) -> None:
        """Run ``save_fn`` in the background thread ``name``; return at once.

        Saves with the same ``name`` run one after another; different names run concurrently.
        A failure is reported to the monitor (the step is then never committed) and raised by
        the next :meth:`wait_all`.

        ``save_fn`` writes its files under :meth:`step_dir` (``ckptd.step_dir(root, step)``). It
        may return the paths it wrote, or :class:`ckptd.WrittenFile` records (the writers in
        :mod:`ckptd.workers` do); otherwise the files that appeared or changed in the step directory
        while it ran are attributed to it. Either way they are checksummed in this background
        thread, made durable (fsync on POSIX) and listed in the step's manifest.

        Args:
            name: The save's name, e.g. ``"model"``; a plain identifier without path separators.
            save_fn: Zero-argument callable that writes the files.
            global_step: The training step this save belongs to.
            is_state_dict: True for a state-dict (weights only) save, False for a part of a
                full checkpoint.

        Raises:
            CheckpointConfigError: bad name, step or save_fn; nothing was started.
        """
        started = time.time()
        unit = self._unit(name, global_step, is_state_dict)
        if not callable(save_fn):
            raise CheckpointConfigError(f"save_fn must be callable, got {type(save_fn).__name__}")
        self._queue(unit, save_fn)
        self._blocked(unit, started, "save_async")

    def _queue(self, unit: UnitId, save_fn: Callable[[], Any], finish: Callable[[], None] | None = None) -> None:
        with self._lock:
            if self._closing:
                raise CheckpointError(_CLOSED)
            lane = self._lanes.get(unit.name)
            if lane is None:
                lane = self._lanes[unit.name] = Lane(unit.name, self._run_job, self._max_pending)
            me = threading.get_ident()
            self._queueing[me] += 1
        try:
            # blocks while max_pending units are queued
            lane.queue.put(Job(unit, save_fn, finish, self._registration_barrier(unit.step)))
        finally:
            with self._lock:
                self._queueing -= collections.Counter({me: 1})
                self._queued.notify_all()
                stopped = self._stopped
        if stopped:
            # Queued behind the lane's end: close() ran in this very thread while it waited for
            # room (a signal handler), so close() could not wait for it. It never runs: say so.
            if finish is not None:
                finish()
            raise CheckpointError(f"save {unit.label} of step {unit.step} was not run: close() was called while "
                                  "it waited for room in its save thread's queue (from a signal handler?)")
        self._saw(unit)

    def _blocked(self, unit: UnitId, started: float, what: str) -> None:
        """The training thread was held up by a save call from ``started`` until now: for
        ``ckptd timeline`` and the ``ckptd_save_blocked_seconds`` histogram."""
        now = time.time()
        self._outbox.blocked(self._worker, unit.step, started, now, what)
        self._client.metrics.observe(SAVE_BLOCKED, now - started, kind=unit.kind)

    def save_sync(self, save_fn: Callable[[], None], global_step: int, is_state_dict: bool = False) -> None:
        """Run ``save_fn`` on the calling thread as one save unit (for saves that need barriers).

        Raises:
            CheckpointSaveError: ``save_fn`` raised; the original exception is chained.
            CheckpointError: :meth:`close` was called; nothing was started.
        """
        started = time.time()
        unit = self._unit("sync", global_step, is_state_dict)
        if not callable(save_fn):
            raise CheckpointConfigError(f"save_fn must be callable, got {type(save_fn).__name__}")
        with self._lock:
            if self._closing:  # as save_async: the writer-slot lease is no longer renewed, for one
                raise CheckpointError(_CLOSED)
        self._saw(unit)
        try:
            err = self._runner.run(Job(unit, save_fn, registered=self._registration_barrier(unit.step)),
                                   reraise_interrupts=True)
        finally:
            self._blocked(unit, started, "save_sync")
        if err is not None:
            raise err from err.__cause__

    def wait_all(self) -> None:
        """Block until every queued and running save of this coordinator has finished.

        It also waits until the registrations made with ``register(..., wait=False)`` were
        applied by the monitor.

        Raises:
            CheckpointSaveError: for the first save that failed since the last wait_all, naming
                its step, unit and cause, with the original exception chained. Failures are
                reported once.
            CheckpointError: a registration sent with ``wait=False`` failed (what ``register``
                would have raised, or the monitor could not be reached). It is raised before
                failed saves, which the next wait_all raises; a note on it names them.
        """
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.queue.join()
        self._send_timing()
        try:
            self._flush_registrations()
        except BaseException as e:
            # Raised first, but the saves that failed meanwhile must not go unseen: named on it
            # (close() raises nothing more), and kept for the next wait_all.
            with self._lock:
                failed = list(self._errors)
            for err in failed:
                add_note(e, f"a save failed too (the next wait_all() raises it): {err}")
            raise
        with self._lock:
            errors, self._errors = self._errors, []
        if not errors:
            return
        first = errors[0]
        cause = first.cause
        if len(errors) > 1:
            others = ", ".join(f"step {e.step} {e.unit}" for e in errors[1:])
            cause += f" (and {len(errors) - 1} more failed saves: {others})"
        err = CheckpointSaveError(first.step, first.kind, first.unit, cause)
        for other in errors[1:]:  # each with its own cause, which the summary above leaves out
            add_note(err, f"also failed: {other}")
        raise err from first.__cause__

    def close(self) -> None:
        """wait_all(), then stop the save threads. The coordinator cannot be used afterwards."""
        self._close_registrations()  # first: none can slip in after the wait
        me = threading.get_ident()
        with self._lock:
            # Saves too, from any thread: a save queued once the wait below began would not be
            # waited for (nor its failure raised), and one queued behind the lanes' end never runs.
            # Not this thread's: a signal handler's close() cannot wait for the call it interrupted.
            self._closing = True
            self._queued.wait_for(lambda: not any(n for t, n in self._queueing.items() if t != me))
        try:
            self.wait_all()
        finally:
            self._closed.set()
            with self._lock:
                lanes, self._lanes = list(self._lanes.values()), {}
                self._stopped = True
            for lane in lanes:
                lane.queue.put(None)
            if self._writer is not None:
                self._writer.close()
            _live.discard(self)

    def _send_timing(self) -> None:
        """Send what the outbox still holds (blocked time measured after the units' last
        notification): fire and forget, so neither a slow nor a dead monitor holds up the caller."""
        timing = self._outbox.drain()
        if timing is not None:
            try:
                self._client.post_quietly(("timing", None, {protocol.TIMING_KEY: timing}))
            except Exception as e:  # observability only: never fail wait_all for it
                log.warning("could not send save timings to the monitor: %s", e)

    def _drain(self) -> None:
        try:
            self.wait_all()
        except CheckpointSaveError as e:
            log.error("a checkpoint save failed before exit: %s", e)
        except Exception as e:  # a registration sent with wait=False: at exit, nobody to raise it to
            notes = "".join(f"; {n}" for n in getattr(e, "__notes__", ()))
            log.error("a checkpoint registration failed before exit: %s: %s%s", type(e).__name__, e, notes)

    # -- one unit ------------------------------------------------------------------------------

    def _unit(self, name: str, step: int, is_state_dict: bool) -> UnitId:
        return UnitId(self._worker, check_name(name), check_step(step), Kind.from_flag(is_state_dict),
                      protocol.new_id())

    def _run_job(self, job: Job) -> None:
        try:
            err = self._runner.run(job)
        except BaseException as e:  # a bug in ckptd: the unit did not end as it should
            log.exception("save %s of step %d ended abnormally", job.unit.label, job.unit.step)
            err = CheckpointSaveError(job.unit.step, job.unit.kind.value, job.unit.label,
                                      f"the save thread failed: {type(e).__name__}: {e}")
        finally:
            if job.finish is not None:
                job.finish()
        if err is not None:
            with self._lock:
                self._errors.append(err)

    def step_dir(self, global_step: int, epoch: int | None = None) -> str:
        """The directory save functions of ``global_step`` write into (see :func:`ckptd.step_dir`).

        Args:
            global_step: The training step.
            epoch: Required when the run's ``step_dir_template`` contains ``{epoch}``.
        """
        return f"{self._root_url.rstrip('/')}/{self._template.name(global_step, epoch)}"
