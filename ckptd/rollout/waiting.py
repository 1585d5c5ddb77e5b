"""A weight subscriber's wait for the next version: one loop, written once as a generator without
I/O, driven by a blocking twin (:meth:`Waiting.wait_for_version`) and an async one
(:meth:`Waiting.wait_for_version_async`), so both honour ``close()``, timeouts and a monitor that
restarts or goes away the same way.

A mixin of :class:`~ckptd.rollout.subscriber.WeightSubscriber` (it uses the subscriber's monitor
handle, root and poll interval), kept apart because it is one idea: waiting.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Generator
from functools import partial
from typing import Any

import ray
from ray.exceptions import RayActorError

from ckptd.config import Kind
from ckptd.errors import CheckpointError, CheckpointTimeoutError
from ckptd.layout import newest_committed
from ckptd.storage import Storage
from ckptd.units import check_step, check_timeout

_LONG_POLL_S = 30.0  # one wait_version call; the loop around it honours close() and timeouts
_CLOSE_CHECK_S = 0.25  # how soon a wait notices close()


class Waiting:
    """Uses the subscriber's attributes below, and its ``_note`` (a monitor's answer to a long
    poll), ``_detach`` / ``_reattach`` (the monitor gone, or back) and ``_why_nothing``."""

    name: str
    kind: Kind
    _monitor: Any
    _storage: Storage
    _stop: threading.Event
    _poll_s: float

    def wait_for_version(self, after: int | None = None, timeout_s: float | None = None) -> int:
        """The newest committed version newer than ``after`` (any, if None), as soon as it commits.

        Raises:
            CheckpointTimeoutError: none came within ``timeout_s``.
        """
        waiting = self._waiting(after, timeout_s)
        result: Any = None
        error: Exception | None = None
        while True:
            try:
                action = waiting.throw(error) if error is not None else waiting.send(result)
            except StopIteration as done:
                return done.value
            result, error = None, None
            try:
                if action[0] == "monitor":
                    ref = action[1].wait_version.remote(self.kind.value, after, action[2])
                    while not ray.wait([ref], timeout=_CLOSE_CHECK_S)[0]:
                        self._check_waiting(action[3], partial(ray.cancel, ref), after, timeout_s)
                    result = ray.get(ref)
                elif action[0] == "pause":
                    self._stop.wait(action[1])
                else:
                    result = self._look(action[0])
            except RayActorError as e:
                error = e

    async def wait_for_version_async(self, after: int | None = None, timeout_s: float | None = None) -> int:
        """:meth:`wait_for_version` for async code (an async Ray actor): never blocks the event loop."""
        waiting = self._waiting(after, timeout_s)
        result: Any = None
        error: Exception | None = None
        while True:
            try:
                action = waiting.throw(error) if error is not None else waiting.send(result)
            except StopIteration as done:
                return done.value
            result, error = None, None
            try:
                if action[0] == "monitor":
                    ref = action[1].wait_version.remote(self.kind.value, after, action[2])
                    answer = asyncio.wrap_future(ref.future())
                    while not (await asyncio.wait({answer}, timeout=_CLOSE_CHECK_S))[0]:
                        self._check_waiting(action[3], answer.cancel, after, timeout_s)
                    result = answer.result()
                elif action[0] == "pause":
                    await asyncio.sleep(action[1])
                else:
                    result = await asyncio.to_thread(self._look, action[0])
            except RayActorError as e:
                error = e

    def _look(self, what: str) -> Any:
        """The blocking actions of :meth:`_waiting` other than the long poll and the pause (both
        twins run them, the async one in a thread)."""
        if what == "storage":
            return newest_committed(self._storage, self.kind)
        if what == "reattach":
            return ray.is_initialized() and self._reattach()
        return self._why_nothing()  # "root"

    def _check_waiting(self, deadline: float | None, cancel, after: int | None, timeout_s: float | None) -> None:
        """While a long poll is out: stop at close(), and at the deadline even if the monitor is
        restarting (Ray would hold the call until it is back)."""
        if self._stop.is_set():
            cancel()
            raise CheckpointError(f"subscriber {self.name} was closed while it waited")
        if deadline is not None and time.monotonic() > deadline + _CLOSE_CHECK_S:
            cancel()
            raise CheckpointTimeoutError(
                f"no {self.kind.value} version newer than {after} was committed within {timeout_s} s "
                "(the monitor did not answer: it may be restarting)")

    def _waiting(self, after: int | None, timeout_s: float | None) -> Generator[tuple, Any, int]:
        """The wait loop of both twins, without I/O: it yields what to do next, and is sent the
        result (or thrown the RayActorError): ``("monitor", handle, seconds, deadline)`` long-polls
        the monitor, ``("storage",)`` reads the newest committed version from the root,
        ``("reattach",)`` looks for the monitor again, ``("pause", seconds)`` waits, ``("root",)``
        says why the root holds nothing (:meth:`_why_nothing`) before a timeout is raised."""
        _check_wait(after, timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            handle = self._monitor
            if handle is not None:
                try:
                    version = self._note((yield ("monitor", handle, _slice(remaining), deadline)))
                    if version is not None:
                        return version
                except RayActorError as e:  # gone for good: a restart is retried by Ray itself
                    self._detach(e)
            else:
                version = yield ("storage",)
                if version is not None and (after is None or version > after):
                    return version
                if not (yield ("reattach",)):
                    yield ("pause", self._poll_s if remaining is None else min(self._poll_s, remaining))
            if self._stop.is_set():
                raise CheckpointError(f"subscriber {self.name} is closed")
            if deadline is not None and time.monotonic() >= deadline:
                why = "" if self._monitor is not None else (yield ("root",))
                raise CheckpointTimeoutError(
                    f"no {self.kind.value} version newer than {after} was committed within {timeout_s} s{why}")

    async def versions(self, after: int | None = None) -> AsyncIterator[int]:
        """Each new version as it commits (the newest, when several committed meanwhile)::

            async for version in subscriber.versions():
                with subscriber.open(version) as weights:
                    weights.load_into(model)
                subscriber.report_serving(version)
        """
        while True:
            after = await self.wait_for_version_async(after)
            yield after


def _check_wait(after: int | None, timeout_s: float | None) -> None:
    if after is not None:
        check_step(after, "after")
    check_timeout(timeout_s)


def _slice(remaining: float | None) -> float:
    return _LONG_POLL_S if remaining is None else min(remaining, _LONG_POLL_S)
