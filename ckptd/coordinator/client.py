"""Talking to the monitor from a worker: calls that survive monitor restarts, and batched
notifications."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ckptd.coordinator.monitor_diagnosis import MonitorDiagnosis, require_ray
from ckptd.coordinator.notifier import Notifier
from ckptd.errors import CheckpointError
from ckptd.metrics import RETRIED_REQUESTS, RunMetrics
from ckptd.protocol import describe_attempt
from ckptd.storage import Storage

if TYPE_CHECKING:
    from ckptd.coordinator.relay import RelayRoute

log = logging.getLogger("ckptd.coordinator")

# One notifier per monitor and route in a process: the coordinators that a process hosts (a
# simulator, or an actor that drives several workers) batch their notifications together.
_notifiers: weakref.WeakValueDictionary[tuple, Notifier] = weakref.WeakValueDictionary()
_notifiers_lock = threading.Lock()


def _shared_notifier(client: MonitorClient) -> Notifier:
    actor_id = getattr(client._handle, "_actor_id", None)
    if actor_id is None:
        return Notifier(client.send_batch)
    key = (actor_id.hex(), client._relay is not None, client._timeout_s)
    with _notifiers_lock:
        notifier = _notifiers.get(key)
        if notifier is None:
            # The first client's send serves the others: they reach the same monitor, and each
            # would retry (and re-find a restarted monitor) alike.
            notifier = _notifiers[key] = Notifier(client.send_batch)
        return notifier


class RelayUnavailable(CheckpointError):
    """A node relay did not answer a coordinator's batch within the coordinator's own
    ``notify_timeout_s`` (it is held up by another batch, or died and none answered since)."""


class WatchedRoot(NamedTuple):
    """A root to look for newer attempts on (:meth:`MonitorClient.watch_root`), picklable."""

    url: str
    storage_options: dict
    attempt: int

    def storage(self) -> Storage:
        return Storage(self.url, self.storage_options)


class MonitorClient(MonitorDiagnosis):
    """Calls the monitor, retrying while the actor restarts or is unreachable.

    Ray already retries tasks of a restarting actor (the monitor is created with
    ``max_task_retries=-1``); this also covers a monitor that was re-created by name.

    Args:
        handle: The monitor's actor handle.
        timeout_s: How long a call is retried before its error is raised.
    """

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        self._run: str | None = None
        self._namespace: str | None = None
        self._attempt: str | None = None
        self._attempt_label: str | None = None
        self._root: tuple[Storage, int] | None = None  # watch_root
        self._lock = threading.Lock()
        self._notifier: Notifier | None = None
        self._relay: RelayRoute | None = None
        self.metrics = RunMetrics(None)

    def bind(self, run: str, namespace: str | None, attempt: str | None = None, label: str | None = None) -> None:
        """The run (and namespace) to re-attach to when the handle stops working; retries are
        counted in that run's metrics from now on. With ``attempt`` (the monitor's
        ``attempt_id``), only a monitor of that attempt of that root is re-attached to (Ray's
        restart of the same monitor keeps it; a new ``start_monitor`` opens another one, on
        the same root or another). ``label`` names that attempt in errors."""
        self._run, self._namespace, self._attempt = run, namespace, attempt
        self._attempt_label = label or (describe_attempt(attempt) if attempt else None)
        self.metrics = RunMetrics(run)

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def call(self, method: str, *args: Any, waits_s: float | None = 0.0, until: float | None = None) -> Any:
        """``method(*args)`` on the monitor, and its answer.

        The answer must come within the client's timeout of the first try, retries included;
        ``waits_s`` is added for a method that waits on the monitor by design (``wait_committed``'s
        own timeout). With None, it is waited for as long as the monitor is alive: as long as it
        answers a ping within the timeout, or Ray is restarting it (a wait the caller asked to be
        unbounded, or a writer slot, which comes when other writers end). ``until`` (a
        ``time.monotonic()``) replaces the bound on the answer, for calls that share one, and ends
        their retries too. Retries while the monitor is unreachable end at the client's timeout
        (plus ``waits_s``) in every case, the lookups of a monitor started again included.

        Raises:
            CheckpointTimeoutError: the monitor stayed unreachable (dead, restarting) until the
                deadline, or is alive but did not answer in time (stopped, say, or stuck): the
                call may still be applied later, as a retried one may. The message says which.
        """
        deadline = time.monotonic() + self._timeout_s + (waits_s or 0.0)  # for retries, whatever waits_s
        if until is not None:  # a bound shared with the calls queued behind one that timed out
            deadline = min(deadline, until)
        answer_by = until if until is not None else None if waits_s is None else deadline
        delay, retried = 0.1, False
        while True:
            require_ray()
            ref = getattr(self._handle, method).remote(*args)
            try:
                if answer_by is None:
                    return self._get_while_alive(ref, method)
                return ray.get(ref, timeout=max(0.0, answer_by - time.monotonic()))
            except GetTimeoutError:
                raise self._unanswered(method, waits_s) from None
            except RayActorError as e:
                if answer_by is None and not retried:
                    # An unbounded wait that outlived its monitor: the retries (and the lookup of a
                    # monitor started again, see _reattach) get the timeout from now.
                    deadline = max(deadline, time.monotonic() + self._timeout_s)
                retried = True
                self._raise_if_gone_for_good(e, deadline)
                if time.monotonic() >= deadline:
                    raise self._unreachable(method, e, waits_s) from e
                self.metrics.inc(RETRIED_REQUESTS, request="monitor_call")
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, 5.0)
                self._reattach(deadline)
                if time.monotonic() >= deadline:  # a retry now could only time out, and say "not answering"
                    raise self._unreachable(method, e, waits_s) from e

    def _get_while_alive(self, ref: Any, method: str) -> Any:
        """``ray.get(ref)`` for as long as the monitor answers a ping within the client's timeout,
        or Ray is restarting it (a ping waits for the restart, which may take longer).

        Each window of the timeout sends a ping alongside the wait. The monitor counts as stuck
        only when the pings of two windows in a row went unanswered while it was not being
        restarted: a process just killed stays ALIVE in the GCS until its raylet reports the
        death, which can take more than a second on a loaded node."""
        unanswered = 0
        while True:
            require_ray()
            ping = self._handle.ping.remote()
            if ray.wait([ref], timeout=self._timeout_s)[0]:
                return ray.get(ref)
            if ray.wait([ping], timeout=0)[0]:
                unanswered = 0  # answered, or the actor is gone: ``ref`` raises that too, and the caller retries
            elif self._restarting():
                unanswered = 0
            else:
                unanswered += 1
                if unanswered >= 2:
                    raise self._unanswered(method, None)

    async def call_async(self, method: str, *args: Any, bounded: bool = True) -> Any:
        """:meth:`call` for a coroutine, with the client's timeout as the bound on the answer;
        ``bounded=False`` waits for a live monitor's answer without one (a relay, whose every
        coordinator bounds its own wait for the relay), retrying while it is unreachable, and
        raises Ray's RayActorError once that ends (each coordinator then sends its batch again
        for as long as its own timeout allows)."""
        deadline = time.monotonic() + self._timeout_s
        delay = 0.1
        while True:
            require_ray()
            ref = getattr(self._handle, method).remote(*args)
            try:
                return await (asyncio.wait_for(ref, max(0.0, deadline - time.monotonic())) if bounded else ref)
            except asyncio.TimeoutError:
                raise self._unanswered(method, 0.0) from None
            except RayActorError as e:
                # Both look things up with blocking calls (the GCS, the root, a ping): on a thread,
                # so that a relay's event loop goes on with the batches of its other coordinators.
                await asyncio.to_thread(self._raise_if_gone_for_good, e, deadline)
                if time.monotonic() >= deadline:
                    if not bounded:
                        raise
                    raise await asyncio.to_thread(self._unreachable, method, e, 0.0) from e
                self.metrics.inc(RETRIED_REQUESTS, request="monitor_call")
                await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, 5.0)
                await asyncio.to_thread(self._reattach, deadline)
                if bounded and time.monotonic() >= deadline:  # as in call()
                    raise await asyncio.to_thread(self._unreachable, method, e, 0.0) from e

    def watch_root(self, storage: Storage, attempt: int) -> None:
        """The root (and this client's attempt number) that the monitor publishes into: where the
        monitor is dead for good, a newer attempt there ends the retries at once."""
        self._root = (storage, attempt)

    @property
    def watched_root(self) -> WatchedRoot | None:
        """What :meth:`watch_root` was given, in a form another process (a relay) can watch."""
        if self._root is None:
            return None
        storage, attempt = self._root
        return WatchedRoot(storage.url, storage.storage_options, attempt)

    def use_relay(self, node_id: str, zones: int = 0) -> None:
        """Send notifications through the node's relay actor (``start_monitor(node_relay=True)``,
        and ``relay_zones``) from now on; needs :meth:`bind` first."""
        from ckptd.coordinator.relay import RelayRoute  # the relay imports this module

        assert self._run is not None and self._attempt is not None, "bind() with the attempt first"
        self._relay = RelayRoute(self._run, self._namespace, self._attempt, self._handle, node_id, self._timeout_s,
                                 self.metrics, zones, root=self.watched_root)

    def notify(self, event: tuple) -> Any:
        """Deliver one notification (batched with those of this process's other save threads,
        of every coordinator of the run in it); its answer."""
        with self._lock:
            if self._notifier is None:
                self._notifier = _shared_notifier(self)
            notifier = self._notifier
        return notifier.deliver(event)

    def send_batch(self, events: list) -> list:
        """Deliver events now, retrying until the monitor applied them; one answer each.

        Through a relay that does not answer within this client's timeout, the events go
        straight to the monitor, for as long again: the relay may still deliver them, and the
        monitor answers a repeated event as it answered the first. Giving up on the relay alone
        would leave the unit's fate to a batch nobody waits for (a "started" admitted after its
        unit gave up, with the "failed" that follows lost with a relay)."""
        require_ray()
        if self._relay is not None:
            try:
                return self._relay.send(events)
            except RelayUnavailable as e:
                log.warning("%s; sending %d notification(s) straight to the monitor", e, len(events))
                self.metrics.inc(RETRIED_REQUESTS, request="relay_call")
        return self.call("notify_batch", events)

    def post_quietly(self, event: tuple) -> None:
        """Submit one notification without waiting for it or retrying it (observability data
        only: its loss costs a bar in ``ckptd timeline``, never a save)."""
        if not ray.is_initialized():
            return  # see require_ray: nowhere to send it
        if self._relay is not None:
            try:
                self._relay.post([event])
            except CheckpointError:  # Ray shut down since the check: as above
                return
        else:
            self._handle.notify_batch.remote([event])
