"""A node's notification relay: one actor per node and run that forwards the notifications of
that node's coordinators to the monitor in batches (``start_monitor(node_relay=True)``).

Without it, every coordinator sends its own calls: at 10,000 ranks that is tens of thousands of
monitor calls per step, and the monitor, one process, pays Ray's cost of each. Through a relay the
monitor receives one call per node per batch instead.

What the relay may not do is lose a notification or answer for the monitor. So it holds nothing:
a coordinator's call returns only with the monitor's own answers to its events, after the monitor
applied them. A relay that dies mid-batch (its node's process that created it ended, or it was
killed) fails the calls of that batch; each coordinator sends its events again, through a new
relay, and the monitor, which counts every unit once by its id, applies a retried event as it
applied the first (see :mod:`ckptd.monitor.unit_reports`).

Nor may it carry one job's reports to another job's monitor. A relay belongs to one attempt of
its run (its actor name says which) and forwards to that attempt's monitor only: when that monitor
is gone and a new job has started one under the same run name, it refuses to re-attach, as a
coordinator's own calls do (``MonitorClient._reattach``), and the old job's coordinators are told.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ckptd import failpoints
from ckptd.coordinator.client import MonitorClient, RelayUnavailable, WatchedRoot, require_ray
from ckptd.errors import CheckpointError
from ckptd.metrics import RETRIED_REQUESTS, RunMetrics
from ckptd.protocol import relay_name

log = logging.getLogger("ckptd.coordinator")

#: The most events one forwarded call carries (a bound on the message, not on throughput).
MAX_BATCH = 20_000


class GroupSender:
    """Sends batches of events with one call in flight; what arrives meanwhile goes together.

    The asyncio twin of :class:`~ckptd.coordinator.notifier.Notifier`: a lone submission is sent
    at once, and submissions that arrive while a call is in flight are merged into the next
    call, so the batch grows with the load and a quiet relay adds no delay.

    Args:
        send: Delivers a list of events and returns one result per event, in order.
        max_batch: Submissions are merged up to this many events (a larger one goes alone).
    """

    def __init__(self, send: Callable[[list], Awaitable[list]], max_batch: int = MAX_BATCH) -> None:
        self._send = send
        self._max_batch = max_batch
        self._queue: deque[tuple[list, asyncio.Future]] = deque()
        self._drainer: asyncio.Task | None = None

    async def submit(self, events: list) -> list:
        """Deliver ``events``; their results once the call that carried them returned, or what
        that call raised."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((events, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            batch = [self._queue.popleft()]
            size = len(batch[0][0])
            while self._queue and size + len(self._queue[0][0]) <= self._max_batch:
                batch.append(self._queue.popleft())
                size += len(batch[-1][0])
            try:
                results = await self._send([e for events, _ in batch for e in events])
                if len(results) != size:
                    raise RuntimeError(f"the monitor answered {len(results)} of {size} notifications")
            except BaseException as e:  # every waiter of the batch gets it, and may send again
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            at = 0
            for events, future in batch:
                if not future.done():
                    future.set_result(results[at:at + len(events)])
                at += len(events)


class RelayCore:
    """What a relay does, without the actor around it: forward batches upstream, retrying while
    upstream is unreachable or restarting.

    Upstream is the monitor, or a zone relay (``relay_zones``), or any ``upstream`` coroutine
    function: a load generator hosts many cores in one process to stand for many nodes, and
    passes the next core's :meth:`relay`.

    Args:
        run, namespace: The run (its monitor is found by name again after it restarts).
        attempt: The attempt whose reports this relay carries (its monitor's ``attempt_id``,
            which names the root too): it forwards to a monitor of that attempt only.
        monitor: That attempt's monitor (the handle the coordinators were given).
        timeout_s: How long a batch is retried while upstream is unreachable.
        zone: Forward through the zone relay with this number instead of to the monitor.
        upstream: Forward to this instead (for a load generator).
        root: The root the coordinators publish into (``MonitorClient.watched_root``): once the
            monitor is dead for good and a newer attempt opened there, the batch fails at once
            with the coordinators' own CheckpointError, instead of being retried for
            ``timeout_s``.
    """

    def __init__(self, run: str, namespace: str | None, attempt: str, monitor: Any, timeout_s: float,
                 zone: int | None = None, upstream: Callable[[list], Awaitable[list]] | None = None,
                 root: WatchedRoot | None = None) -> None:
        if upstream is None and zone is not None:
            route = _Route(partial(start_relay, run, namespace, attempt, monitor, f"zone{zone}", timeout_s, root=root),
                           timeout_s, RunMetrics(run), run)
            upstream = route.send_async
        if upstream is None:
            client = MonitorClient(monitor, timeout_s)
            label = None if root is None else f"attempt {root.attempt} of root {root.url!r}"  # as a coordinator's
            client.bind(run, namespace, attempt, label)
            if root is not None:
                client.watch_root(root.storage(), root.attempt)
            # No bound on a live monitor's answer here: one batch carries several coordinators'
            # events, and each bounds its own wait for the relay (``_Route.send``).
            upstream = partial(client.call_async, "notify_batch", bounded=False)
        self._upstream = upstream
        self._sender = GroupSender(self._forward)
        self.forwarded = 0  # events
        self.calls = 0  # upstream calls

    async def _forward(self, events: list) -> list:
        failpoints.hit("relay_before_forward")
        results = await self._upstream(events)
        failpoints.hit("relay_after_forward")
        self.forwarded += len(events)
        self.calls += 1
        return results

    async def relay(self, events: list) -> list:
        """Forward ``events`` (one coordinator's batch, or a node relay's); the monitor's answers."""
        return await self._sender.submit(events)


@ray.remote(num_cpus=0, max_restarts=0)
class NodeRelay:
    """A relay actor: of one node, or of one zone of nodes (see :class:`RelayCore` for the
    arguments)."""

    def __init__(self, run: str, namespace: str | None, attempt: str, monitor: Any, timeout_s: float,
                 zone: int | None = None, root: WatchedRoot | None = None) -> None:
        self._core = RelayCore(run, namespace, attempt, monitor, timeout_s, zone, root=root)

    async def relay(self, events: list) -> list:
        return await self._core.relay(events)

    async def post(self, events: list) -> None:
        """Forward ``events`` without an answer (timing data only: losing it costs no save)."""
        try:
            await self._core.relay(events)
        except Exception as e:
            log.warning("could not forward timing data to the monitor: %s", e)

    async def stats(self) -> dict:
        return {"forwarded": self._core.forwarded, "calls": self._core.calls, "pid": os.getpid()}


def zone_of(node_id: str, zones: int) -> int:
    """The zone relay a node's relay sends through (the same in every process)."""
    return zlib.crc32(node_id.encode()) % zones


def start_relay(run: str, namespace: str | None, attempt: str, monitor: Any, where: str, timeout_s: float,
                zone: int | None = None, node_id: str | None = None, root: WatchedRoot | None = None) -> Any:
    """The relay of ``run``'s ``attempt`` named ``where`` (a node id, or ``zone{N}``): the running
    one, or a new one, on ``node_id`` if given, sending through zone ``zone`` if given, else to
    ``monitor`` (that attempt's).

    A relay is owned by the process that started it and ends with it; whoever needs it next
    starts another. Failpoints armed through the environment reach it too.
    """
    env = {k: os.environ[k] for k in (failpoints.ENV_VAR, failpoints.ONCE_ENV_VAR) if k in os.environ}
    placement = {} if node_id is None else {
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
    return NodeRelay.options(
        name=relay_name(run, attempt, where), namespace=namespace, get_if_exists=True, max_concurrency=4096,
        runtime_env={"env_vars": env} if env else None, **placement,
    ).remote(run, namespace, attempt, monitor, timeout_s, zone, root)


def _raise_unless_retried(e: RayTaskError | RayActorError) -> None:
    """After a relay call raised ``e``: return if the call is to be sent again (the relay died,
    or could not reach upstream within its own timeout, which may be shorter than the caller's);
    raise a CheckpointError that the relay raised (the monitor is gone for good, or another
    job's) as the caller would have raised it itself, not inside Ray's wrapper; anything else as
    it came."""
    if isinstance(e, RayTaskError) and isinstance(e.cause, CheckpointError):
        raise e.cause from None
    if not isinstance(e, RayActorError):
        raise e


class _Route:
    """Calls a relay actor, starting it when there is none, and calls again through a new one
    when it dies (or could not reach upstream) until ``timeout_s`` has passed: the monitor answers
    a retried event as it answered the first."""

    def __init__(self, start: Callable[[], Any], timeout_s: float, metrics: RunMetrics, run: str) -> None:
        self._start = start
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._run = run
        self._lock = threading.Lock()
        self._handle: Any = None

    def handle(self) -> Any:
        with self._lock:
            if self._handle is None:
                require_ray()  # starting a relay after ray.shutdown() would start a new Ray
                self._handle = self._start()
            return self._handle

    def _failed(self, handle: Any, error: BaseException) -> None:
        """The relay behind ``handle`` died: the next call starts (or finds) another."""
        log.warning("a notification relay of run %s failed (%s); sending again", self._run, type(error).__name__)
        self._metrics.inc(RETRIED_REQUESTS, request="relay_call")
        with self._lock:
            if self._handle is handle:
                self._handle = None

    def send(self, events: list) -> list:
        """A coordinator's call: waits at most this route's timeout, across relay restarts (the
        relay retries upstream for the timeout of the coordinator that started it, which may be
        longer than this one's).

        Raises:
            RelayUnavailable: no relay answered in time (the caller goes to the monitor directly).
        """
        deadline, delay = time.monotonic() + self._timeout_s, 0.05
        while True:
            handle = self.handle()
            try:
                return ray.get(handle.relay.remote(events), timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                raise RelayUnavailable(f"the notification relay of run {self._run!r} did not answer within "
                                       f"notify_timeout_s={self._timeout_s:g} s") from None
            except (RayTaskError, RayActorError) as e:
                _raise_unless_retried(e)
                if time.monotonic() > deadline:
                    raise RelayUnavailable(f"the notification relays of run {self._run!r} kept failing for "
                                           f"notify_timeout_s={self._timeout_s:g} s ({type(e).__name__})") from e
                self._failed(handle, e)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def send_async(self, events: list) -> list:
        """A node relay's call to its zone relay. Unlike :meth:`send`, no deadline on the wait:
        the batch carries the events of every coordinator of the node, each with its own
        timeout, and each gives up on its own (a timeout here would cut them all short at the
        timeout of the coordinator that started the node relay)."""
        deadline, delay = time.monotonic() + self._timeout_s, 0.05
        while True:
            handle = self.handle()
            try:
                return await handle.relay.remote(events)
            except (RayTaskError, RayActorError) as e:
                _raise_unless_retried(e)
                if time.monotonic() > deadline:
                    raise
                self._failed(handle, e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


class RelayRoute(_Route):
    """A coordinator's way to the monitor: through its node's relay (and that relay's zone relay
    when ``zones`` > 0)."""

    def __init__(self, run: str, namespace: str | None, attempt: str, monitor: Any, node_id: str,
                 timeout_s: float, metrics: RunMetrics, zones: int = 0, root: WatchedRoot | None = None) -> None:
        zone = zone_of(node_id, zones) if zones else None
        super().__init__(partial(start_relay, run, namespace, attempt, monitor, node_id, timeout_s, zone, node_id,
                                 root),
                         timeout_s, metrics, run)

    def post(self, events: list) -> None:
        self.handle().post.remote(events)
