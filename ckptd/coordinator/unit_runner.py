"""The life of one save unit in a worker: admitted by the monitor, run, its files described and
made durable, its receipt written, then reported."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ckptd import direct_io, failpoints, phases, protocol
from ckptd.commit import publish_guard
from ckptd.config import SaveStrategy
from ckptd.coordinator.client import MonitorClient
from ckptd.coordinator.files import describe_returned_files, discover_files, step_path_of
from ckptd.coordinator.lanes import Job
from ckptd.errors import CheckpointConfigError, CheckpointError, CheckpointSaveError
from ckptd.fencing import check_fence
from ckptd.layout import find_step_dir
from ckptd.manifest import FileEntry, WrittenFile
from ckptd.metrics import UNIT_BYTES, UNIT_DURATION, WRITTEN_BYTES
from ckptd.protocol import UnitFailure, UnitId
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate

log = logging.getLogger("ckptd.coordinator")


class UnitRunner:
    """Runs units for one coordinator (from its save threads, or the caller's for save_sync).

    Args:
        client: The monitor client.
        storage, template, attempt: Where the run's files and records go.
        strategy, lease_s, node, process: Write throttling: slots are held with a lease, renewed
            by a heartbeat thread while any is held.
        outbox: Where each unit's span goes; what it holds rides along with the notifications.
    """

    def __init__(self, client: MonitorClient, storage: Storage, template: StepDirTemplate, attempt: int,
                 strategy: SaveStrategy, lease_s: float, node: str, process: str,
                 outbox: protocol.TimingOutbox | None = None) -> None:
        self._client = client
        self._storage = storage
        self._template = template
        self._attempt = attempt
        self._strategy = strategy
        self._lease_s = lease_s
        self._node = node
        self._process = process
        self._lock = threading.Lock()
        self._held: dict[str, tuple[str, str, str]] = {}
        self._heartbeat: threading.Thread | None = None
        self.closed = threading.Event()
        self.outbox = outbox if outbox is not None else protocol.TimingOutbox()

    def run(self, job: Job, *, reraise_interrupts: bool = False) -> CheckpointSaveError | None:
        """Run one unit to its end and report it; return the error if it failed.

        ``reraise_interrupts``: a KeyboardInterrupt or SystemExit raised by ``save_fn`` goes on
        up (after the failure is reported), for save_sync's caller. A save thread has nobody to
        hand it to: there it is returned as the unit's error, which wait_all() raises."""
        # Its own records are not subject to the publish guard of a unit it may run inside (a
        # save_sync called from another coordinator's save_fn): its save_fn gets its own.
        with publish_guard(None):
            return self._run(job, reraise_interrupts)

    def _run(self, job: Job, reraise_interrupts: bool) -> CheckpointSaveError | None:
        unit = job.unit
        slot = f"{unit.step}/{unit.kind.value}/{unit.key}"
        span = _Span(time.time())
        t0 = time.perf_counter()
        # The registrations this coordinator made before the unit (register(wait=False)) must be
        # applied before its finished receipt, from which a restarted monitor counts it. With
        # writer slots it waits before taking one (a slot held meanwhile would hold up other
        # writers); without, it writes meanwhile (its staging buffers go back when the write
        # ends) and waits just before the receipt.
        registered_first = job.registered is not None and self._strategy is not SaveStrategy.UNRESTRICTED
        try:
            if registered_first:
                job.registered()  # raises if one of them went unanswered: the unit fails
        except Exception as e:
            return self._report_failure(unit, e, span)
        try:
            self._start(unit, slot)
        except _Refused as e:
            # Nothing was written, and nothing is reported: the monitor has recorded what the
            # refusal means for the step (nothing, or its failure when a fence refused it).
            log.error("save %s of step %d (%s) refused: %s", unit.label, unit.step, unit.kind.value, e)
            self._ended(unit, span, f"refused: {e}")
            return CheckpointSaveError(unit.step, unit.kind.value, unit.label, f"not saved: {e}")
        except Exception as e:
            return self._report_failure(unit, e, span)
        span.admitted = time.time()
        try:
            with phases.collect() as span.phases:
                files, found = self._execute(unit, job.save_fn)
                failpoints.hit("after_unit_write")
                if job.registered is not None and not registered_first:
                    job.registered()
                with phases.phase(phases.RECEIPT):
                    protocol.write_finished(self._storage, self._attempt, unit, files, found)
            self._ended(unit, span)
            sent = time.perf_counter()
            answer = self._client.notify(("finished", unit.to_dict(),
                                          {"files": [f.model_dump() for f in files], "found": found,
                                           **self._timing()}))
            # Known only now, after the span left with that notification: it follows with the next.
            self.outbox.amend(unit, span.start, {phases.NOTIFICATION: time.perf_counter() - sent})
        except Exception as e:
            return self._report_failure(unit, e, span)
        except BaseException as e:
            # Not an Exception, and yet the save failed: DCP's CheckpointException, a save_fn
            # that calls sys.exit, Ctrl-C during save_sync. The step must hear of it.
            err = self._report_failure(unit, e, span)
            if reraise_interrupts and isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            return err
        finally:
            with self._lock:
                self._held.pop(slot, None)
        if answer and "refused" in answer:
            # The monitor has recorded what this means for the step (nothing, or its failure).
            log.error("save %s of step %d (%s) does not count: %s", unit.label, unit.step, unit.kind.value,
                      answer["refused"])
            return CheckpointSaveError(unit.step, unit.kind.value, unit.label, answer["refused"])
        metrics = self._client.metrics
        metrics.observe(UNIT_DURATION, time.perf_counter() - t0, kind=unit.kind)
        written = sum(f.size for f in files)
        metrics.observe(UNIT_BYTES, written, kind=unit.kind)
        metrics.inc(WRITTEN_BYTES, written, kind=unit.kind)
        return None

    def _start(self, unit: UnitId, slot: str) -> None:
        """Ask the monitor whether the unit may write (its step is neither committed nor failed)
        and, with a save strategy, wait for a writer slot.

        Raises:
            _Refused: the unit must not write.
        """
        # Before asking: a monitor that restarts after admitting the unit finds it still running.
        protocol.write_started(self._storage, self._attempt, unit)
        if self._strategy is SaveStrategy.UNRESTRICTED:
            answer = self._client.notify(("started", unit.to_dict(), self._timing() or None))
            refused = answer["refused"] if answer and "refused" in answer else None
        else:
            result = self._client.call("acquire_slot", unit.to_dict(), self._node, self._process, waits_s=None)
            refused = result.get("aborted")
        if refused is not None:
            protocol.remove_receipt(self._storage, self._attempt, unit)
            raise _Refused(refused)
        if self._strategy is SaveStrategy.UNRESTRICTED:
            return
        with self._lock:
            self._held[slot] = (slot, self._node, self._process)
            if self._heartbeat is None:
                self._heartbeat = threading.Thread(target=self._renew_loop, name="ckptd-slot-heartbeat", daemon=True)
                self._heartbeat.start()

    def _execute(self, unit: UnitId, save_fn: Callable[[], Any]) -> tuple[list[FileEntry], bool]:
        """Run save_fn; its files, and whether they were found by time (it returned None)."""
        started_ns = time.time_ns()
        listed_before = None
        if not self._storage.is_posix:
            # Object stores: which files are new is found by comparing listings (see discover_files).
            name = find_step_dir(self._storage, unit.step, self._template)
            listed_before = {} if name is None else self._storage.walk_files(self._storage.join(name))
        # The writers' own Storage follows the monitor's direct_io mode, and nothing they publish
        # into the root lands once a newer job has started there (this process outlived its job).
        fence = partial(check_fence, self._storage, self._attempt, "save")
        with direct_io.mode(self._storage.direct_io), publish_guard(fence):
            returned = save_fn()
            if returned is not None:
                if isinstance(returned, (str, bytes, Mapping)) or not isinstance(returned, Iterable):
                    raise CheckpointConfigError(
                        f"save_fn returned {type(returned).__name__}; return None or a list of the paths it wrote"
                    )
                returned = list(returned)  # in the block: a generator may still write as it is read
        # Looked up after save_fn ran: with an epoch template, save_fn created the directory.
        step_path = self._step_path(unit.step, returned)
        if step_path is None:
            if returned:  # it says it wrote files, and none is where the step's files go
                first = returned[0].path if isinstance(returned[0], WrittenFile) else returned[0]
                raise CheckpointConfigError(
                    f"save_fn returned {len(returned)} paths (the first: {first!r}), but no directory of step "
                    f"{unit.step} matching {self._template.template!r} exists under {self._storage.url}: write "
                    "every file of a step under ckptd.step_dir(root, step, epoch=...) and return those paths"
                )
            if returned is None:
                _wrote_nothing(unit, self._template.template)
            return [], returned is None
        if returned is not None:
            return describe_returned_files(self._storage, step_path, returned), False
        found = discover_files(self._storage, step_path, started_ns, listed_before)
        if not found:
            _wrote_nothing(unit, self._template.template)
        return found, True

    def _step_path(self, step: int, returned: list | None) -> str | None:
        if returned and self._template.needs_epoch:
            path = step_path_of(self._storage, returned)
            # Only a directory of this step: one of another step is not where this unit's files go.
            if path is not None and self._template.parse(path.rsplit("/", 1)[-1]) == step:
                return path
        name = find_step_dir(self._storage, step, self._template)
        return None if name is None else self._storage.join(name)

    def _timing(self) -> dict:
        """The payload entry carrying what the outbox holds (older monitors ignore it)."""
        timing = self.outbox.drain()
        return {} if timing is None else {protocol.TIMING_KEY: timing}

    def _ended(self, unit: UnitId, span: _Span, error: str | None = None) -> None:
        if not span.recorded:  # once: a unit that fails after its receipt was written keeps that end
            span.recorded = True
            self.outbox.unit(unit, span.start, span.admitted, time.time(), error, span.phases)

    def _report_failure(self, unit: UnitId, exc: BaseException, span: _Span | None = None) -> CheckpointSaveError:
        failure = UnitFailure(
            unit=unit.label, error_type=type(exc).__qualname__, message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )
        if span is not None:
            self._ended(unit, span, failure.cause)
        log.error("save %s of step %d (%s) failed: %s", unit.label, unit.step, unit.kind.value, failure.cause)
        # The error reaches the caller through wait_all() whatever happens below. The receipt is
        # durable before the monitor hears of the failure, so no restarted monitor can commit the
        # step; if it cannot be written, the monitor records the failure itself when told.
        try:
            protocol.write_failed(self._storage, self._attempt, unit, failure)
        except Exception as e:
            log.error("could not write the failure receipt of %s: %s", unit.label, e)
        cause = failure.cause
        try:
            answer = self._client.notify(("failed", unit.to_dict(), failure.model_dump()))
        except Exception as e:
            log.error("could not report the failure of %s to the monitor: %s", unit.label, e)
        else:
            if isinstance(answer, dict) and answer.get("kept"):  # the step goes on without the unit
                cause = f"{cause} ({answer['kept']})"
        err = CheckpointSaveError(unit.step, unit.kind.value, unit.label, cause)
        err.__cause__ = exc
        return err

    # -- writer slots --------------------------------------------------------------------------

    def _renew_loop(self) -> None:
        while not self.closed.wait(self._lease_s / 3):
            with self._lock:
                held = list(self._held.values())
            if held:
                try:
                    self._client.call("renew_slots", held)
                except Exception as e:
                    log.warning("could not renew writer slots: %s", e)


@dataclass
class _Span:
    """When a unit asked to be admitted, and when its save function started (for the timeline)."""

    start: float
    admitted: float | None = None
    recorded: bool = False
    phases: dict[str, float] | None = None  # seconds per phase (ckptd.phases), filled as it runs


def _wrote_nothing(unit: UnitId, template: str) -> None:
    """A save_fn that returned None (its files found by time) and changed no file of its step: it
    most likely wrote elsewhere, and the step would commit without its data."""
    log.warning("save %s of step %d (%s) returned None and no file under its step's directory (%s) changed "
                "while it ran: if it wrote its files elsewhere, write them under coord.step_dir(step); if it "
                "writes nothing on purpose, return [] to say so", unit.label, unit.step, unit.kind.value, template)


class _Refused(CheckpointError):
    """The monitor refused a unit before it wrote anything."""


