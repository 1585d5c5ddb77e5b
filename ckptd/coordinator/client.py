"""Talking to the monitor from a worker: calls that survive monitor restarts, and batched
notifications."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from ckptd.coordinator.notifier import Notifier
from ckptd.metrics import RETRIED_REQUESTS, RunMetrics
from ckptd.protocol import actor_name

log = logging.getLogger("ckptd.coordinator")


class MonitorClient:
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
        self._lock = threading.Lock()
        self._notifier: Notifier | None = None
        self.metrics = RunMetrics(None)

    def bind(self, run: str, namespace: str | None) -> None:
        """The run (and namespace) to re-attach to when the handle stops working; retries are
        counted in that run's metrics from now on."""
        self._run, self._namespace = run, namespace
        self.metrics = RunMetrics(run)

    def call(self, method: str, *args: Any) -> Any:
        deadline = time.monotonic() + self._timeout_s
        delay = 0.1
        while True:
            try:
                return ray.get(getattr(self._handle, method).remote(*args))
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                self.metrics.inc(RETRIED_REQUESTS, request="monitor_call")
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                self._reattach()

    async def call_async(self, method: str, *args: Any) -> Any:
        deadline = time.monotonic() + self._timeout_s
        delay = 0.1
        while True:
            try:
                return await getattr(self._handle, method).remote(*args)
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                self.metrics.inc(RETRIED_REQUESTS, request="monitor_call")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                self._reattach()

    def notify(self, event: tuple) -> Any:
        """Deliver one notification (batched with those of other save threads); its answer."""
        with self._lock:
            if self._notifier is None:
                self._notifier = Notifier(lambda events: self.call("notify_batch", events))
            notifier = self._notifier
        return notifier.deliver(event)

    def post_quietly(self, event: tuple) -> None:
        """Submit one notification without waiting for it or retrying it (observability data
        only: its loss costs a bar in ``ckptd timeline``, never a save)."""
        self._handle.notify_batch.remote([event])

    def _reattach(self) -> None:
        if self._run is None:
            return
        try:
            self._handle = ray.get_actor(actor_name(self._run), namespace=self._namespace)
        except ValueError:
            pass  # not re-created (yet); keep retrying the old handle until the deadline
