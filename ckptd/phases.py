"""Where a save's time goes: per-phase wall-clock totals, measured on the thread that runs it.

The save path marks its phases with ``with phase("write"):`` (the writers in
:mod:`ckptd.workers.files`), ``phase("fsync")`` (:meth:`ckptd.storage.Storage.make_durable`) and
so on. The unit runner opens an accumulator around one unit with :func:`collect`; the totals go
into the unit's span for ``ckptd timeline`` and the benchmark. Outside :func:`collect` (a
writer called from user code, a reader) ``phase`` does nothing but look up one thread-local.

Phases are exclusive: time inside a nested phase counts for the inner phase only, never for
the outer one too, so the phases of a unit add up to at most its duration. An fsync inside a
write is ``fsync``; the CRC-32 a writer computes inline, or waits for after its own write of
the same slice, is ``checksum``; the rest of the writer's time (serialising, writing, the
rename) is ``write``.

Cheap by construction: one accumulator per thread, no lock, a few ``perf_counter`` calls per
phase (phases are per file or per 64 MiB slice, never per tensor element). Measurement must
never fail a save: the accumulator only adds floats.

Phase names (see bench/README.md for how the benchmark reads them):

* unit side: ``staging`` (the copy into the staging buffers, wherever it ran; for a fenced
  save streamed behind its copy, only the time its write waited for the copy), ``write``,
  ``checksum``, ``fsync``, ``receipt`` (the unit's ledger record), ``notification`` (the
  finished notification's round trip to the monitor);
* monitor side: ``commit`` (checks, manifest write and rename) and ``trackers`` (advancing the
  tracker files).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

STAGING, WRITE, CHECKSUM, FSYNC, RECEIPT, NOTIFICATION = (
    "staging", "write", "checksum", "fsync", "receipt", "notification")
COMMIT, TRACKERS = "commit", "trackers"
#: Every phase, in the order a save goes through them.
ALL = (STAGING, WRITE, CHECKSUM, FSYNC, RECEIPT, NOTIFICATION, COMMIT, TRACKERS)


class _Accumulator:
    """The totals of one thread's open :func:`collect`, and its stack of open phases."""

    __slots__ = ("stack", "totals")

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        # One entry per open phase: [name, start, seconds spent in nested phases].
        self.stack: list[list] = []


_local = threading.local()


@contextmanager
def collect() -> Iterator[dict[str, float]]:
    """Accumulate this thread's phases into the yielded dict (seconds per phase name) until the
    block ends. Nests: an inner ``collect`` gets its own totals, the outer one does not see them."""
    previous = getattr(_local, "acc", None)
    acc = _local.acc = _Accumulator()
    try:
        yield acc.totals
    finally:
        _local.acc = previous


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the time of the block for ``name`` in this thread's :func:`collect`, if one is open."""
    acc = getattr(_local, "acc", None)
    if acc is None:
        yield
        return
    entry = [name, time.perf_counter(), 0.0]
    acc.stack.append(entry)
    try:
        yield
    finally:
        elapsed = time.perf_counter() - entry[1]
        acc.stack.pop()
        acc.totals[name] = acc.totals.get(name, 0.0) + max(0.0, elapsed - entry[2])
        if acc.stack:
            acc.stack[-1][2] += elapsed  # the parent's own time excludes this phase


def add(name: str, seconds: float) -> None:
    """Add ``seconds`` measured elsewhere (another thread did the work) to ``name`` in this
    thread's :func:`collect`, if one is open. The enclosing phase, if any, is not reduced."""
    acc = getattr(_local, "acc", None)
    if acc is not None and seconds >= 0:
        acc.totals[name] = acc.totals.get(name, 0.0) + seconds
