"""Timeline spans under the root: :class:`EventStore` writes a run's spans as immutable chunk
and snapshot files (the layout is in :mod:`ckptd.monitor.events`), :func:`read_events` reads them
back. Plain Python, no Ray."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from ckptd.layout import LEDGER_DIR
from ckptd.monitor.events import Span
from ckptd.storage import Storage

log = logging.getLogger("ckptd.monitor")

FORMAT = 1
EVENTS_DIR = f"{LEDGER_DIR}/events"


@dataclass
class EventStore:
    """The persisted spans of one run under a root (see the module docstring for the layout).

    Args:
        storage: The root.
        run: The run's name (a safe file name: :func:`ckptd.units.check_name`).
        max_chunks: Past this many chunk files, :meth:`write` writes a snapshot instead and
            deletes what it supersedes.
    """

    storage: Storage
    run: str
    max_chunks: int = 32
    _nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _seq: int = 0
    _chunks: int | None = None  # chunk files since the newest snapshot, once known
    _last_ms: int = 0  # names never go below this: the newest file's time, from any writer

    @property
    def directory(self) -> str:
        return self.storage.join(EVENTS_DIR, self.run)

    def _name(self, snapshot: bool) -> str:
        self._seq += 1
        # Never before an existing file: an earlier monitor of the run on a node whose clock ran
        # ahead would otherwise leave the newest snapshot, and readers would ignore what follows.
        self._last_ms = max(int(time.time() * 1000), self._last_ms)
        return f"{self._last_ms:013d}-{self._nonce}-{self._seq:06d}-{'s' if snapshot else 'c'}.json"

    def _publish(self, spans: list[Span], snapshot: bool) -> str:
        body = {"format": FORMAT, "run": self.run, "snapshot": snapshot, "spans": [s.to_dict() for s in spans]}
        name = self._name(snapshot)
        # Not fsynced: losing the newest chunk to a power cut loses a few seconds of the picture.
        self.storage.write_atomic(f"{self.directory}/{name}", json.dumps(body).encode(), durable=False)
        return name

    def write(self, new: list[Span], everything: list[Span]) -> None:
        """Persist ``new`` as a chunk, or, once there are ``max_chunks`` chunks, ``everything``
        (what the log holds) as a snapshot, then delete the files it supersedes.

        Raises:
            OSError (or the backend's error): the write failed; nothing was deleted.
        """
        if self._chunks is None:
            current = _current_files(self.storage.listdir(self.directory))
            self._chunks = sum(n.endswith("-c.json") for n in current)
            self._last_ms = max([self._last_ms] + [_ms_of(n) + 1 for n in current])
        if self._chunks < self.max_chunks:
            self._publish(new, snapshot=False)
            self._chunks += 1
            return
        name = self._publish(everything, snapshot=True)
        self._chunks = 0
        for old in self.storage.listdir(self.directory):
            if old.endswith(".json") and old < name:
                try:
                    self.storage.rm(f"{self.directory}/{old}")
                except OSError as e:  # a leftover is superseded anyway; the next snapshot retries
                    log.warning("could not remove superseded timeline file %s: %s", old, e)


def _ms_of(name: str) -> int:
    """The time in a file's name (0 for a name that has none)."""
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def _current_files(names: list[str]) -> list[str]:
    """The files a reader takes: the newest snapshot and the chunks after it, in order."""
    names = sorted(n for n in names if n.endswith(("-c.json", "-s.json")))
    snapshots = [i for i, n in enumerate(names) if n.endswith("-s.json")]
    return names[snapshots[-1]:] if snapshots else names


def runs_with_events(storage: Storage) -> list[str]:
    """The runs that have persisted timeline events under the root."""
    return sorted(storage.listdir(storage.join(EVENTS_DIR)))


def read_events(storage: Storage, run: str) -> list[Span]:
    """The persisted spans of ``run`` under the root, by step then start time.

    A file removed while this reads (a snapshot superseded it) makes it list again; an
    unreadable file is skipped with a warning.
    """
    directory = storage.join(EVENTS_DIR, run)
    for _ in range(5):
        names = _current_files(storage.listdir(directory))
        spans: list[Span] = []
        vanished = False
        for name in names:
            try:
                text = storage.read_text_or_none(f"{directory}/{name}")
                if text is None:
                    vanished = True
                    break
                body = json.loads(text)
                if not isinstance(body, dict) or body.get("format") != FORMAT:
                    found = body.get("format") if isinstance(body, dict) else type(body).__name__
                    raise ValueError(f"format {found!r}, this ckptd reads {FORMAT}")
                spans += [Span.from_dict(d) for d in body["spans"]]
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
                # Damage from outside ckptd (a truncated or overwritten file, UnicodeDecodeError
                # included): the file's spans are lost, the others are still drawn.
                log.warning("skipping unreadable timeline file %s: %s: %s", name, type(e).__name__, e)
        if not vanished:
            latest = {s.identity: s for s in spans}  # files in written order: a later record wins
            return sorted(latest.values(), key=lambda s: (s.step, s.start))
    raise OSError(f"the timeline files under {directory} kept changing while being read; try again")
