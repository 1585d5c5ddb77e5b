"""A cross-process event for the tests, in a module of its own: an actor's process imports the
module that defines its class, and this one imports neither torch nor ckptd (the Signal actor's
process starts in a third of the CPU time that importing helpers.py's torch would take)."""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class Signal:
    """A cross-process event: tests wait on it instead of sleeping."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    async def send(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
