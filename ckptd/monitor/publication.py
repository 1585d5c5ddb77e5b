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
import time

from ckptd.config import Kind
from ckptd.layout import MANIFESTS, find_step_dir, is_committed

log = logging.getLogger("ckptd.monitor")


class Publication:
    def _seed_versions(self) -> None:
        """The current versions, with the time their manifests were committed (blocking I/O: for
        the constructor)."""
        for kind, step in self._trackers.items():
            if step is None:
                continue
            at = time.time()
            try:
                name = find_step_dir(self._storage, step, self._template)
                text = self._storage.read_text_or_none(self._storage.join(name, MANIFESTS[kind])) if name else None
                if text is not None:
                    at = float(json.loads(text)["committed_at"])
            except Exception as e:  # only the lag figures of status() depend on it
                log.warning("could not read when step %d was committed: %s", step, e)
            self._readers.published(kind, step, at)

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

    async def _pin_checked(self, sub, lease_id: str, step: int) -> str | None:
        """Grant a lease, then confirm on storage that the step is still there; the reason if not."""
        why = self._readers.pin(sub, lease_id, step, time.time())
        if why is None and not await self._in_thread(is_committed, self._storage, step, sub.kind):
            self._readers.release(lease_id)
            why = (f"step {step} is not committed as a {sub.kind.value} under {self._storage.url} (retention "
                   "deleted it, or it never committed)")
        return why

    async def reader_heartbeat(self, reader: dict, leases: list, serving: list | None) -> dict:
        """A subscriber is alive: renew its leases (re-granting those a restarted monitor does not
        know) and restate what it serves. Returns ``{"lease_s": float, "lost": [lease ids]}``."""
        sub = self._reader(reader)
        known = {lease.lease_id for lease in self._readers.leases()}
        lost = []
        for lease_id, step in leases:
            if lease_id in known:
                why = self._readers.pin(sub, lease_id, step, time.time())
            else:
                why = await self._pin_checked(sub, lease_id, step)
            if why is not None:
                log.warning("subscriber %s lost its lease on step %d: %s", sub.name, step, why)
                lost.append(lease_id)
        if serving is not None:
            self._readers.report_serving(sub, int(serving[0]), float(serving[1]))
        return {"lease_s": self._opts.read_lease_s, "lost": lost}

    async def pin(self, reader: dict, lease_id: str, step: int) -> dict:
        """Take a read lease on ``step``: retention keeps it until the lease is released or expires.
        Returns ``{"error": None}`` or ``{"error": why}``."""
        return {"error": await self._pin_checked(self._reader(reader), lease_id, step)}

    async def release(self, lease_id: str) -> None:
        self._readers.release(lease_id)
        self._retention.schedule()  # the step may be past the policy now

    async def report_serving(self, reader: dict, version: int, since: float) -> None:
        """The subscriber serves ``version`` (since ``since``)."""
        self._readers.report_serving(self._reader(reader), int(version), float(since))

    def _expire_readers(self, now: float) -> None:
        """Housekeeping: drop leases nobody renews; run retention when they or the post-restart
        hold no longer keep steps."""
        expired = self._readers.expire(now)
        for lease in expired:
            log.warning("read lease %s on step %d expired: its subscriber stopped renewing", lease.lease_id,
                        lease.step)
        held = self._hold_pending and not self._readers.holding(now)
        if held:
            self._hold_pending = False
        if expired or held:
            self._retention.schedule()

    def _reader_protected(self) -> set[int]:
        steps = self._readers.pinned_steps()
        if self._opts.keep_served:
            steps |= self._readers.served_steps(time.time())
        return steps
