"""``CheckpointCoordinator(writer="process")``: staged snapshots are written by a separate process.

With the default ``writer="thread"``, the write, the CRC-32 and the fsync of a staged save run on
a save thread of the training process. Most of that work releases the GIL, but not all of it:
a training loop that is itself GIL-bound (many small ops, Python bookkeeping) loses time to it.
With ``writer="process"``, the staging buffers live in shared memory and one writer process per
coordinator (started on the first save, ``spawn``ed so it shares no state with the trainer)
serialises, checksums and fsyncs them; the training process only copies into the buffers and
then waits, without the GIL, for the writer's answer. Receipts and notifications stay in the
training process (a few small calls per save unit).

What a writer process runs must be picklable: the default writer (one safetensors file per save
name), or a module-level function given as ``write_fn``. It receives the snapshot, whose tensors
are the shared buffers (read-only by contract: they are reused by the next save of the name).

A writer process that dies (killed, out of memory) fails the save that was writing, with its exit
code in the error; the next save starts a new one.

Each buffer set is sent to the writer process once, the first time a save uses it: sending a
shared-memory tensor passes its file descriptor through multiprocessing's resource sharer, a
thread of the training process that takes the GIL several times per tensor. After that a job
names the set's tensors by position, so a save costs the training process two pipe messages
however many tensors it holds (measured with ``perf sched``: the resource sharer woke a GIL-bound
training thread about 500 times a second while saves ran; docs/benchmarks.md). The writer process
drops a set when the training process has dropped it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from functools import partial
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as tmp

from ckptd import direct_io, phases
from ckptd.commit import publish_guard
from ckptd.direct_io import DirectIO
from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.fencing import check_fence
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage

log = logging.getLogger("ckptd.coordinator")

WRITERS = ("thread", "process")


def write_flat_into(storage: Storage, path: str, snapshot: Any, metadata: dict[str, str],
                    ready: Callable | None = None, image: torch.Tensor | None = None) -> list[WrittenFile]:
    """The default writer of ``save_state_async``: the tensors into one safetensors file, and the
    structure of a state that is not a flat dict of tensors beside it (``ckptd.workers.state_file``);
    streamed behind the staging copy when ``ready`` is given, and from the staged file image when
    there is one (see ``write_safetensors``)."""
    from ckptd.workers.state_file import write_state

    storage.makedirs(path.rsplit("/", 1)[0])
    return write_state(storage, path, snapshot, metadata, ready, image)


def write_flat(root: str, storage_options: dict | None, path: str, snapshot: Any,
               metadata: dict[str, str], image: torch.Tensor | None = None) -> list[WrittenFile]:
    """:func:`write_flat_into` for a writer process, which opens the root itself."""
    return write_flat_into(Storage(root, storage_options), path, snapshot, metadata, image=image)


#: What a writer process needs to fence its writes: the root, its storage options, the attempt.
Fence = tuple[str, "dict | None", int]


def in_mode(mode: DirectIO, fence: Fence | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as a save unit runs its save function in its own process (a writer process
    has its own context): ``mode`` is the direct_io mode of the Storage it opens, and with
    ``fence`` nothing is published into the root once a newer attempt than its own exists."""
    guard = contextlib.nullcontext()
    if fence is not None:
        root, options, attempt = fence
        guard = publish_guard(partial(check_fence, Storage(root, options), attempt, "save"))
    with direct_io.mode(mode), guard:
        return fn(*args)


def check_picklable(write_fn: Callable) -> None:
    """Raise CheckpointConfigError unless ``write_fn`` can be sent to a writer process."""
    try:
        pickle.dumps(write_fn)
    except Exception as e:
        raise CheckpointConfigError(
            f"write_fn {getattr(write_fn, '__qualname__', write_fn)!r} cannot be sent to the writer process "
            f"({type(e).__name__}: {e}); with writer='process', pass a module-level function (or "
            "functools.partial of one), or None for the default safetensors writer"
        ) from e


class WriterProcessError(CheckpointError):
    """A write in the writer process raised, or the process died; the message says which."""


class _JobPickler(ForkingPickler):
    """Pickles a job with the tensors of the buffer sets the writer process holds as references:
    ``persistent`` maps ``id(tensor)`` to (set uid, position)."""

    def __init__(self, file: io.BytesIO, persistent: dict[int, tuple[int, int]]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._persistent = persistent

    def persistent_id(self, obj: Any) -> tuple[int, int] | None:
        return self._persistent.get(id(obj)) if isinstance(obj, torch.Tensor) else None


class _JobUnpickler(pickle.Unpickler):
    """The writer process's side: references become the buffer sets' tensors it holds."""

    def __init__(self, data: bytes, sets: dict[int, list]) -> None:
        super().__init__(io.BytesIO(data))
        self._sets = sets

    def persistent_load(self, pid: Any) -> Any:
        uid, index = pid
        try:
            # A new alias of the held tensor for every job: a write_fn that changes its view in
            # place (unsqueeze_, t_) must not change the next job's.
            return self._sets[uid][index].detach()
        except (KeyError, IndexError):
            raise pickle.UnpicklingError(f"the job names buffer set {uid} tensor {index}, which this "
                                         "writer process was never sent") from None


def _serve(jobs: Any, results: Any) -> None:
    """The writer process: hold the buffer sets it is sent, run each job, send back (ok, value
    or error text, phase totals)."""
    torch.set_num_threads(1)
    sets: dict[int, list] = {}
    while True:
        try:
            message = jobs.recv()
        except EOFError:  # the training process is gone
            return
        if message is None:
            return
        kind, payload = message
        if kind == "buffers":
            uid, tensors = payload
            sets[uid] = tensors
            continue
        if kind == "forget":
            for uid in payload:
                sets.pop(uid, None)
            continue
        with phases.collect() as totals:
            try:
                fn, args = _JobUnpickler(payload, sets).load()
                value: Any = fn(*args)
                ok = True
            except BaseException as e:  # reported to the save, which fails with it
                value = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()
                ok = False
        try:
            results.send((ok, value, dict(totals)))
        except Exception as e:  # an unpicklable return value: report that instead
            results.send((False, f"the write_fn's return value could not be sent back: {e}", dict(totals)))


class WriterProcess:
    """One coordinator's writer process; jobs run one at a time, in submission order.

    Args:
        label: Names the process in errors and logs (the coordinator's worker id).
    """

    def __init__(self, label: str) -> None:
        self._label = label
        self._ctx = tmp.get_context("spawn")
        self._lock = threading.Lock()
        self._proc: Any = None
        self._jobs: Any = None
        self._results: Any = None
        self._sent: set[int] = set()  # the buffer sets the running process holds
        self._watched: set[int] = set()  # the buffer sets whose end is watched (weakref.finalize)
        # Sets dropped here since the last job, for the process to drop. A SimpleQueue: its put is
        # reentrant, and weakref callbacks run wherever a collection happens, run() included.
        self._dropped: queue.SimpleQueue[int] = queue.SimpleQueue()

    def _start(self) -> None:
        self._sent = set()
        child_jobs, self._jobs = self._ctx.Pipe(duplex=False)
        self._results, child_results = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(target=_serve, args=(child_jobs, child_results),
                                       name=f"ckptd-writer-{self._label}", daemon=True)
        self._proc.start()
        child_jobs.close()
        child_results.close()

    def run(self, fn: Callable[..., Any], *args: Any, buffers: Any = None) -> Any:
        """``fn(*args)`` in the writer process (started if need be); its return value.

        Args:
            buffers: The shared-memory buffer set (:class:`~ckptd.coordinator.staging.BufferSet`)
                whose tensors ``args`` holds: sent to the process the first time, named by
                position after that.

        Raises:
            WriterProcessError: ``fn`` raised there (its traceback is in the message), or the
                process died before answering.
        """
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            try:
                self._send_dropped()
                persistent: dict[int, tuple[int, int]] = {}
                if buffers is not None:
                    self._hold(buffers)
                    persistent = {id(t): (buffers.uid, i) for i, t in enumerate(buffers.shared_tensors)}
                payload = io.BytesIO()
                _JobPickler(payload, persistent).dump((fn, args))
                self._jobs.send(("job", payload.getvalue()))
                while not self._results.poll(0.5):
                    if not self._proc.is_alive():
                        raise EOFError
                ok, value, totals = self._results.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as e:
                self._proc.join(5)  # its pipe closes before the process is reaped
                code = self._proc.exitcode
                self._proc = None
                raise WriterProcessError(
                    f"the writer process of {self._label} died while writing (exit code {code}); this save "
                    "failed, the next one starts a new writer process") from e
        for name, seconds in totals.items():
            phases.add(name, seconds)
        if not ok:
            raise WriterProcessError(f"the writer process of {self._label} failed:\n{value}")
        return value

    def _hold(self, buffers: Any) -> None:
        """Send ``buffers`` to the process unless it holds them; once dropped here, they are
        dropped there with the next job."""
        if buffers.uid in self._sent:
            return
        self._jobs.send(("buffers", (buffers.uid, buffers.shared_tensors)))
        self._sent.add(buffers.uid)
        if buffers.uid not in self._watched:
            self._watched.add(buffers.uid)
            weakref.finalize(buffers, self._on_dropped, buffers.uid)

    def _on_dropped(self, uid: int) -> None:
        self._dropped.put(uid)

    def _send_dropped(self) -> None:
        dropped = []
        while True:
            try:
                dropped.append(self._dropped.get_nowait())
            except queue.Empty:
                break
        self._watched.difference_update(dropped)
        gone = [uid for uid in dropped if uid in self._sent]
        if gone:
            self._sent.difference_update(gone)
            self._jobs.send(("forget", gone))

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        """Stop the process (after the job it runs, if any)."""
        with self._lock:
            if self._proc is None:
                return
            try:
                self._jobs.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.terminate()
            self._proc = None
