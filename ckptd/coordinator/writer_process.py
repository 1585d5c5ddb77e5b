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
"""

from __future__ import annotations

import logging
import pickle
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as tmp

from ckptd import direct_io, phases
from ckptd.direct_io import DirectIO
from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage

log = logging.getLogger("ckptd.coordinator")

WRITERS = ("thread", "process")


def write_flat_into(storage: Storage, path: str, snapshot: dict, metadata: dict[str, str],
                    ready: Callable | None = None) -> list[WrittenFile]:
    """The default writer of ``save_state_async``: a flat dict of tensors into one safetensors
    file (streamed behind the staging copy when ``ready`` is given: see ``write_safetensors``)."""
    from ckptd.workers.safetensors_io import write_safetensors

    storage.makedirs(path.rsplit("/", 1)[0])
    return [write_safetensors(storage, path, snapshot, metadata, ready)]


def write_flat(root: str, storage_options: dict | None, path: str, snapshot: dict,
               metadata: dict[str, str]) -> list[WrittenFile]:
    """:func:`write_flat_into` for a writer process, which opens the root itself."""
    return write_flat_into(Storage(root, storage_options), path, snapshot, metadata)


def in_mode(mode: DirectIO, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with ``mode`` as the direct_io mode of the Storage it opens (what a save
    unit does in its own process; a writer process has its own context)."""
    with direct_io.mode(mode):
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


def _serve(jobs: Any, results: Any) -> None:
    """The writer process: run each job, send back (ok, value or error text, phase totals)."""
    import torch

    torch.set_num_threads(1)
    while True:
        try:
            job = jobs.recv()
        except EOFError:  # the training process is gone
            return
        if job is None:
            return
        fn, args = job
        with phases.collect() as totals:
            try:
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

    def _start(self) -> None:
        child_jobs, self._jobs = self._ctx.Pipe(duplex=False)
        self._results, child_results = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(target=_serve, args=(child_jobs, child_results),
                                       name=f"ckptd-writer-{self._label}", daemon=True)
        self._proc.start()
        child_jobs.close()
        child_results.close()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the writer process (started if need be); its return value.

        Raises:
            WriterProcessError: ``fn`` raised there (its traceback is in the message), or the
                process died before answering.
        """
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            try:
                self._jobs.send((fn, args))
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
