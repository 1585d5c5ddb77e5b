"""The reader half of the CheckpointMonitor actor: weight versions for subscribers (long-polled,
woken the moment a tracker moves), read leases that keep retention off a step, and the version
each subscriber serves.

A mixin of :class:`~ckptd.monitor.actor.CheckpointMonitor`, over its
:class:`~ckptd.monitor.readers.ReaderRegistry`; what subscribers send is described in
:mod:`ckptd.rollout.subscriber`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

from ckptd import failpoints
from ckptd.config import Kind
from ckptd.layout import LEDGER_DIR, MANIFESTS, StepEntry, is_committed
from ckptd.storage import Storage

log = logging.getLogger("ckptd.monitor")

LEASES = f"{LEDGER_DIR}/leases"
_SEEDED_VERSIONS = 100  # publication times read back from manifests at start-up
_LEASE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a lease id names a file: nothing else


def lease_path(storage: Storage, lease_id: str) -> str:
    if not _LEASE_ID.fullmatch(lease_id):
        raise ValueError(f"lease id {lease_id!r} is not 1-64 letters, digits, '-' or '_'")
    return storage.join(LEASES, f"{lease_id}.json")


def write_lease(storage: Storage, lease_id: str, sub, step: int) -> None:
    record = {"lease": lease_id, "subscriber": sub.sub_id, "name": sub.name, "kind": sub.kind.value, "step": step}
    # Not fsynced: losing one to a power cut of the storage server loses a lease its reader, on
    # that storage, could not have kept reading anyway.
    storage.write_atomic(lease_path(storage, lease_id), json.dumps(record).encode(), durable=False)


def remove_lease(storage: Storage, lease_id: str) -> None:
    failpoints.hit("before_lease_record_removed")
    storage.rm(lease_path(storage, lease_id))


def read_leases(storage: Storage) -> list[tuple[str, object]]:
    """The lease records under the root, by file name; None for one that cannot be read
    (blocking I/O: for the monitor's constructor)."""
    out: list[tuple[str, object]] = []
    for name in storage.listdir(storage.join(LEASES)):
        try:
            text = storage.read_text_or_none(storage.join(LEASES, name)) if name.endswith(".json") else None
            if text:  # else a temp file of an atomic write, or a record removed meanwhile
                out.append((name, json.loads(text)))
        except (OSError, ValueError, RecursionError) as e:  # a damaged record must not stop the monitor
            log.warning("removing an unreadable lease record %s: %s", name, e)
            out.append((name, None))
    return out


def leased_steps(storage: Storage) -> set[int]:
    """The steps the lease records under the root pin (blocking I/O; for the command line, which
    has no monitor to ask: a recorded lease pins its step until a monitor expires it)."""
    return {rec["step"] for _, rec in read_leases(storage)
            if isinstance(rec, dict) and isinstance(rec.get("step"), int)}


class Publication:
    def _restore_readers(self, entries: dict[int, StepEntry]) -> None:
        """Leases recorded by earlier monitors, and when the versions still on the root (the step
        directories the rebuild found) were published, from their manifests. Blocking I/O: for the
        constructor, before retention."""
        now = time.time()
        for name, rec in read_leases(self._storage):
            try:
                if rec is None or lease_path(self._storage, rec["lease"]) != self._storage.join(LEASES, name):
                    raise ValueError("its lease id is not its file name")
                self._readers.restore(rec["lease"], rec["subscriber"], rec["name"], Kind(rec["kind"]), int(rec["step"]),
                                      now)
            except (KeyError, ValueError, TypeError, OverflowError) as e:
                log.warning("removing a malformed lease record %s (%s): %s", name, str(rec)[:200], e)
                try:
                    self._storage.rm(self._storage.join(LEASES, name))  # by its listed name: inside LEASES
                except OSError as err:  # best effort: it is skipped again at the next start
                    log.warning("could not remove %s: %s", name, err)
        for kind in Kind:
            newest = self._trackers[kind]
            counted = sorted(s for s, e in entries.items()
                             if e.committed and (kind is Kind.STATE_DICT or kind in e.kinds)
                             and (newest is None or s <= newest))[-_SEEDED_VERSIONS:]
            for step in counted:
                at = self._committed_at(entries[step].name, entries[step].kinds)
                if at is not None:
                    self._readers.published(kind, step, at)
            if counted:
                self._readers.known_from(kind, counted[0])

    def _committed_at(self, name: str, kinds) -> float | None:
        """When the step's first manifest was committed (only the lag figures of status depend on it)."""
        times = []
        for kind in kinds:
            try:
                text = self._storage.read_text_or_none(self._storage.join(name, MANIFESTS[kind]))
                if text is not None:
                    times.append(float(json.loads(text)["committed_at"]))
            except Exception as e:
                log.warning("could not read when %s was committed: %s", name, e)
        return min(times, default=None)

    def _published(self, kind: Kind, step: int) -> None:
        """The tracker of ``kind`` moved to ``step``: wake the subscribers waiting for a version."""
        self._readers.published(kind, step, time.time())
        self._announce()

    def _announce(self) -> None:
        event, self._version_changed = self._version_changed, asyncio.Event()
        event.set()

    async def wait_version(self, kind: str, after: int | None, timeout_s: float | None = None) -> dict:
        """Wait until the newest committed version of ``kind`` is newer than ``after`` (any, if
        None). Returns ``{"version": int, "published_at": float | None}``, or ``{"version": None}``
        when ``timeout_s`` ran out. A full checkpoint is a state-dict version too."""
        k = Kind(kind)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            newest = self._trackers[k]
            if newest is not None and (after is None or newest > after):
                return {"version": newest, "published_at": self._readers.published_at(k, newest)}
            event = self._version_changed
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return {"version": None, "published_at": None}
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                return {"version": None, "published_at": None}

    def _reader(self, reader: dict):
        return self._readers.heartbeat(reader["id"], reader["name"], Kind(reader["kind"]), reader["where"],
                                       time.time())

    async def reader_heartbeat(self, reader: dict, leases: list, serving: list | None) -> dict:
        """A subscriber is alive: renew its leases and restate what it serves. Returns
        ``{"lease_s": float, "lost": [lease ids]}``: the leases that were released or expired."""
        sub = self._reader(reader)
        lost = []
        for lease_id, step in leases:
            why = self._readers.renew(sub, lease_id, step, time.time())
            if why is not None:
                log.warning("subscriber %s lost its lease on step %d: %s", sub.name, step, why)
                lost.append(lease_id)
        if serving is not None:
            self._readers.report_serving(sub, int(serving[0]), float(serving[1]))
        return {"lease_s": self._opts.read_lease_s, "lost": lost}

    async def pin(self, reader: dict, lease_id: str, step: int) -> dict:
        """Take a read lease on ``step``: retention keeps it until the lease is released or expires.
        Returns ``{"error": None}`` or ``{"error": why}``.

        The lease is granted in memory first (retention's claim on the step is checked under the
        same lock), recorded under the root, and only then is storage asked whether the step is
        still committed: a step retention deleted just before is refused, never handed out.
        """
        sub = self._reader(reader)
        if not isinstance(lease_id, str) or not _LEASE_ID.fullmatch(lease_id):
            return {"error": f"lease id {lease_id!r} is not 1-64 letters, digits, '-' or '_'"}
        why = self._readers.pin(sub, lease_id, step, time.time())
        if why is not None:
            return {"error": why}
        try:
            await self._in_thread(write_lease, self._storage, lease_id, sub, step)
            committed = await self._in_thread(is_committed, self._storage, step, sub.kind)
        except Exception as e:
            await self._end_lease(lease_id)
            return {"error": f"could not record the lease on step {step}: {type(e).__name__}: {e}"}
        if not committed:
            await self._end_lease(lease_id)
            return {"error": f"step {step} is not committed as a {sub.kind.value} under {self._storage.url} "
                             "(retention deleted it, or it never committed)"}
        return {"error": None}

    async def release(self, lease_id: str) -> None:
        await self._end_lease(lease_id)

    async def _end_lease(self, lease_id: str) -> None:
        """Drop the lease (released, or a pin refused after it was granted in memory). Retention
        runs again: the step may be past the policy now, and a pass that ran while the lease
        stood kept the step for it. Scheduled before the first await, so whoever sees the lease
        gone (``status()``) and then calls ``wait_retention`` finds that pass already due."""
        self._readers.release(lease_id)
        self._retention.schedule()
        try:
            await self._in_thread(remove_lease, self._storage, lease_id)
        except Exception as e:  # best effort: a leftover record only restores a lease that then expires
            log.warning("could not remove the record of lease %s: %s", lease_id, e)

    async def reader_closed(self, reader: dict) -> None:
        """The subscriber closed (after releasing its leases): it is no longer live."""
        self._readers.gone(reader["id"])

    async def report_serving(self, reader: dict, version: int, since: float) -> None:
        """The subscriber serves ``version`` (since ``since``)."""
        self._readers.report_serving(self._reader(reader), int(version), float(since))

    def _expire_readers(self, now: float) -> None:
        """Housekeeping: drop leases nobody renews (and their records); run retention, since they
        no longer keep their steps."""
        expired = self._readers.expire(now)
        for lease in expired:
            log.warning("read lease %s on step %d expired: its subscriber stopped renewing", lease.lease_id,
                        lease.step)
            self._io.submit(_remove_quietly, self._storage, lease.lease_id)
        if expired:
            self._retention.schedule()

    def _reader_protected(self) -> set[int]:
        steps = self._readers.pinned_steps()
        if self._opts.keep_served:
            steps |= self._readers.served_steps(time.time())
        return steps


def _remove_quietly(storage: Storage, lease_id: str) -> None:
    try:
        remove_lease(storage, lease_id)
    except Exception as e:  # best effort: a leftover record only restores a lease that then expires
        log.warning("could not remove the record of lease %s: %s", lease_id, e)
