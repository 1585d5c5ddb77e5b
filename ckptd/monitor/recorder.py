"""The monitor's timeline recorder: takes spans in (from notifications, commits, uploads), keeps
them in an :class:`~ckptd.monitor.events.EventLog` and flushes them to storage in batches.

Nothing here may slow or fail a save or a commit: recording only appends to memory (and catches
everything), and the flush runs every ``flush_s`` seconds in the monitor's I/O threads; a failed
write is logged and retried with the next batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ckptd import protocol
from ckptd.monitor.event_store import EventStore, read_events
from ckptd.monitor.events import (
    COMMIT,
    MIRROR,
    EventLog,
    Span,
    amendments_from_timing,
    spans_from_timing,
)
from ckptd.storage import Storage

log = logging.getLogger("ckptd.monitor")


class Recorder:
    """Records a run's timeline spans; lives on the monitor's event loop.

    Args:
        storage: The root; spans go under ``.ckptd/events/{run}/``.
        run: The run's name.
        attempt: Stamped on every span.
        max_steps: Steps kept in memory (and in the snapshots on storage).
        flush_s: How often new spans are written.
        in_thread: Runs a blocking function in the monitor's I/O threads.
    """

    def __init__(self, storage: Storage, run: str, attempt: int, max_steps: int, flush_s: float,
                 in_thread: Callable[..., Awaitable[Any]]) -> None:
        self.log = EventLog(max_steps)
        self._store = EventStore(storage, run)
        self._attempt = attempt
        self._flush_s = flush_s
        self._in_thread = in_thread
        self._flush_lock = asyncio.Lock()
        self.flush_errors = 0
        try:
            # Blocking I/O: for the monitor's constructor. A restarted monitor (or a new job of the
            # same run) goes on drawing what its predecessors flushed.
            self.log.add(read_events(storage, run), flushed=True)
        except Exception as e:  # the picture loses its past; the run does not care
            log.warning("could not read the run's earlier timeline events: %s: %s", type(e).__name__, e)

    # -- recording (never raises) --------------------------------------------------------------

    def notification(self, payload: Any) -> None:
        """Take the timing a worker's notification payload carries, if any."""
        try:
            timing = protocol.timing_of(payload)
            if timing is not None:
                self.log.add(spans_from_timing(timing, self._attempt))
                self.log.amend(amendments_from_timing(timing))
        except Exception:
            log.exception("could not record the timing of a notification")

    def commit(self, step: int, kinds: list[str], start: float, end: float, error: str | None,
               detail: str = "", phases: dict[str, float] | None = None) -> None:
        self._add(Span(COMMIT, step, start, end, name="+".join(kinds), error=error, detail=detail,
                       attempt=self._attempt, phases=phases or None))

    def upload(self, step: int, start: float, end: float, error: str | None, detail: str = "") -> None:
        self._add(Span(MIRROR, step, start, end, error=error, detail=detail, attempt=self._attempt))

    def _add(self, span: Span) -> None:
        try:
            self.log.add([span])
        except Exception:
            log.exception("could not record a timeline span")

    # -- persisting ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Flush every ``flush_s`` seconds, for as long as the monitor lives."""
        while True:
            await asyncio.sleep(self._flush_s)
            await self.flush()

    async def flush(self) -> bool:
        """Write the spans not persisted yet; False if that failed (they stay queued)."""
        async with self._flush_lock:  # one writer: chunk names and snapshots stay in order
            new = self.log.take_unflushed()
            if not new:
                return True
            try:
                await self._in_thread(self._store.write, new, self.log.spans())
                return True
            except Exception as e:
                self.flush_errors += 1
                self.log.give_back(new)
                log.warning("could not persist %d timeline spans (retrying with the next batch): %s: %s",
                            len(new), type(e).__name__, e)
                return False

    def spans(self) -> list[dict]:
        """Every span kept in memory, as dicts."""
        return [s.to_dict() for s in self.log.spans()]
