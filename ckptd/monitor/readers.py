"""The readers of a run, as the monitor sees them: weight subscribers, their read leases (pins) and
the version each serves. Plain Python; the actor calls it on its event loop, and retention's
thread asks it (under a lock) whether a step may be deleted.

Invariants:
* A step is never deleted while a lease on it is live: a pin is either seen by retention before
  it deletes the step, or refused because the step is being (or was) deleted. The monitor checks
  storage after it registered a pin, so a pin on a step that is already gone is refused too.
* A lease that is not renewed for ``lease_s`` expires (its holder died); a released lease is never
  brought back by a late renewal.
* Leases outlive the monitor: each is recorded under the root (``.ckptd/leases/``) before it is
  granted and removed when it is released or expires, and a monitor that starts (restarted by
  Ray, or a new job on the root) restores them before retention can run. A renewal never grants
  a lease by itself, so a lease released before a restart stays released.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ckptd.config import Kind

_RELEASED_HISTORY = 10_000
_PUBLISHED_HISTORY = 10_000
_GONE_AFTER_LEASES = 10  # a subscriber unseen this many lease periods is forgotten


@dataclass
class Lease:
    lease_id: str
    holder: str  # the subscriber's id
    step: int
    expires: float


@dataclass
class Subscriber:
    sub_id: str
    name: str
    kind: Kind
    where: str
    last_seen: float
    serving: int | None = None
    serving_since: float | None = None
    leases: set[str] = field(default_factory=set)


class ReaderRegistry:
    """Subscribers, leases and published versions of one monitor.

    Args:
        lease_s: How long a lease (and a subscriber's liveness) lasts without renewal.
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()  # pins (event loop) against deletions (retention's thread)
        self._leases: dict[str, Lease] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self._deleting: set[int] = set()
        self._subs: dict[str, Subscriber] = {}
        self._published: dict[Kind, list[tuple[int, float]]] = {k: [] for k in Kind}
        self._known_from: dict[Kind, int] = {}  # publication times are known from this version on

    # -- subscribers -----------------------------------------------------------------------------

    def heartbeat(self, sub_id: str, name: str, kind: Kind, where: str, now: float) -> Subscriber:
        sub = self._known(sub_id, name, kind, where)
        sub.last_seen = now
        return sub

    def _known(self, sub_id: str, name: str, kind: Kind, where: str) -> Subscriber:
        sub = self._subs.get(sub_id)
        if sub is None:
            sub = self._subs[sub_id] = Subscriber(sub_id, name, kind, where, last_seen=0.0)
        return sub

    def gone(self, sub_id: str) -> None:
        """The subscriber closed: it is no longer live (its leases were released already)."""
        sub = self._subs.get(sub_id)
        if sub is not None:
            sub.last_seen = 0.0

    def report_serving(self, sub: Subscriber, version: int, since: float) -> None:
        if sub.serving != version:
            sub.serving, sub.serving_since = version, since

    def live(self, sub: Subscriber, now: float) -> bool:
        return now - sub.last_seen <= self.lease_s

    def subscribers(self) -> list[Subscriber]:
        return sorted(self._subs.values(), key=lambda s: (s.name, s.sub_id))

    def served_steps(self, now: float) -> set[int]:
        """The versions live subscribers serve (kept by retention if the run asks for it)."""
        return {s.serving for s in self._subs.values() if s.serving is not None and self.live(s, now)}

    # -- leases ----------------------------------------------------------------------------------

    def pin(self, sub: Subscriber, lease_id: str, step: int, now: float) -> str | None:
        """Grant or renew a lease on ``step``; the reason if refused."""
        with self._lock:
            if lease_id in self._released:
                return f"lease {lease_id} was released"
            if step in self._deleting:
                return f"step {step} is being deleted by retention"
            self._leases[lease_id] = Lease(lease_id, sub.sub_id, step, now + self.lease_s)
            sub.leases.add(lease_id)
        return None

    def restore(self, lease_id: str, sub_id: str, name: str, kind: Kind, step: int, now: float) -> None:
        """A lease recorded under the root by an earlier monitor: live for one more lease period,
        in which its holder renews it (or it expires)."""
        sub = self._known(sub_id, name, kind, "")
        with self._lock:
            self._leases[lease_id] = Lease(lease_id, sub_id, step, now + self.lease_s)
        sub.leases.add(lease_id)

    def renew(self, sub: Subscriber, lease_id: str, step: int, now: float) -> str | None:
        """Extend a lease ``sub`` holds; the reason it is gone, or None. A renewal never grants a
        lease: subscribers renew only leases they were granted, so one this registry does not know
        (nor restored from its record) was released or expired."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return f"lease {lease_id} on step {step} was released or expired"
            lease.expires = now + self.lease_s
        return None

    def release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            self._ended(lease_id)
        if lease is not None and lease.holder in self._subs:
            self._subs[lease.holder].leases.discard(lease_id)

    def _ended(self, lease_id: str) -> None:
        """Remember a released or expired lease, so that no renewal revives it (under the lock)."""
        self._released[lease_id] = None
        while len(self._released) > _RELEASED_HISTORY:
            self._released.popitem(last=False)

    def expire(self, now: float) -> list[Lease]:
        """Drop leases and subscribers whose holders stopped renewing; the leases dropped."""
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.expires < now]
            for lease in gone:
                del self._leases[lease.lease_id]
                self._ended(lease.lease_id)
        for lease in gone:
            sub = self._subs.get(lease.holder)
            if sub is not None:
                sub.leases.discard(lease.lease_id)
        for sub_id in [s.sub_id for s in self._subs.values()
                       if now - s.last_seen > _GONE_AFTER_LEASES * self.lease_s and not s.leases]:
            del self._subs[sub_id]
        return gone

    def leases(self) -> list[Lease]:
        with self._lock:
            return sorted(self._leases.values(), key=lambda x: (x.step, x.lease_id))

    def pinned_steps(self) -> set[int]:
        with self._lock:
            return {lease.step for lease in self._leases.values()}

    def claim_for_delete(self, step: int) -> bool:
        """Retention is about to delete ``step``: False if a lease holds it (then keep it)."""
        with self._lock:
            if any(lease.step == step for lease in self._leases.values()):
                return False
            self._deleting.add(step)
            return True

    def deleted(self, step: int) -> None:
        """Retention is done with ``step`` (deleted, or failed to: a pin re-checks storage)."""
        with self._lock:
            self._deleting.discard(step)

    # -- versions --------------------------------------------------------------------------------

    def published(self, kind: Kind, step: int, at: float) -> None:
        """The tracker of ``kind`` moved to ``step`` at ``at``."""
        history = self._published[kind]
        history.append((step, at))
        del history[:-_PUBLISHED_HISTORY]

    def known_from(self, kind: Kind, step: int) -> None:
        """Publication times of ``kind`` are known for ``step`` and every later version (those of
        older ones were lost with an earlier monitor)."""
        self._known_from[kind] = step

    def published_at(self, kind: Kind, step: int) -> float | None:
        return next((t for s, t in reversed(self._published[kind]) if s == step), None)

    def lag(self, sub: Subscriber, newest: int | None, now: float) -> tuple[int | None, float | None]:
        """Steps and seconds the version ``sub`` serves is behind the newest commit of its kind.

        The seconds count from the first publication of a newer version (None if that is older
        than this monitor knows of, or nothing is served yet).
        """
        if sub.serving is None or newest is None:
            return None, None
        if sub.serving >= newest:
            return 0, 0.0
        newer = [t for s, t in self._published[sub.kind] if s > sub.serving]
        known = sub.serving >= self._known_from.get(sub.kind, 0)
        return newest - sub.serving, (now - min(newer)) if newer and known else None
