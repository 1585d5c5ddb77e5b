"""The waits of the CheckpointMonitor actor: ``wait_committed`` and ``wait_mirrored``, which a
caller blocks on until a step settles, and when nothing known could settle it, answer at once.

A mixin of :class:`~ckptd.monitor.actor.CheckpointMonitor` (it reads the actor's ledger,
trackers, fence and mirror).
"""

from __future__ import annotations

import asyncio
import time

from ckptd.config import Kind
from ckptd.monitor.ledger import StepState


class Waits:
    async def wait_committed(self, step: int, kind: str = "checkpoint", timeout_s: float | None = None) -> dict:
        """Wait until (step, kind) is committed or failed.

        Returns ``{"committed": bool, "unit": str | None, "cause": str | None}``; ``committed``
        is False with ``cause`` None when the wait timed out, and with ``"unknown": True`` when
        the step is older than the newest commit and nothing of it is known (retention deleted
        it before this monitor started, or it was never saved), and with ``"undecided": True``
        when a newer job took the root over while its manifest's publish could not be settled
        (that job decides whether it is committed).
        """
        k = Kind(kind)
        newest = self._trackers[k]
        if (self._ledger.state_of(step, k) is None and newest is not None and step < newest
                and not self._settled(step, k)):  # a state dict its step's full checkpoint committed
            return {"committed": False, "unit": None, "unknown": True,
                    "cause": f"step {step} is unknown to the monitor: no save of it is in flight and it is older "
                             f"than the newest committed step ({newest}); retention deleted it or it was never saved"}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._settled(step, k):
            if self._undecided_cause(step, k) is not None:
                break  # answered below
            fenced = self._final_fence()
            if fenced is not None and not self._could_settle(step, k):
                # Nothing known of the step can settle the kind, and this monitor will accept
                # nothing new that could.
                return {"committed": False, "unit": None, "cause": f"not committed: {fenced}"}
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                await asyncio.wait_for(self._event(step, k).wait(), left)
            except asyncio.TimeoutError:
                return {"committed": False, "unit": None, "cause": None, "detail": self._where_it_stands(step, k)}
        undecided = self._undecided_cause(step, k)
        if undecided is not None:  # a newer job decides (CommitFlow)
            return {"committed": False, "unit": None, "cause": undecided, "undecided": True}
        failure = self._ledger.failure_of(step, k)
        if failure is not None:
            return {"committed": False, "unit": failure[0], "cause": failure[1]}
        return {"committed": True, "unit": None, "cause": None}

    def _where_it_stands(self, step: int, kind: Kind) -> str:
        """What the monitor knows of a step a wait gave up on, for the caller's TimeoutError."""
        rec = self._ledger.get(step)
        if rec is None or not rec.active(kind):
            return (f"nothing of its {kind.value.replace('_', ' ')} has reached the monitor: no registration and no "
                    "save unit of that kind (check the step number and is_state_dict of the saves and registration)")
        return self._ledger.describe(rec, kind)

    async def wait_mirrored(self, step: int, timeout_s: float | None = None) -> dict:
        """Wait until ``step`` is committed on the mirror.

        Returns ``{"mirrored": bool, "error": str | None}``: ``error`` is None when the wait
        timed out, and says why otherwise (no mirror configured, a local copy that cannot be
        uploaded, or a step none of whose saves is one the mirror copies: every mirrored kind
        failed, or everything registered for it settled and none of it is a mirrored kind).
        """
        if self._mirror is None:
            return {"mirrored": False, "error": "this monitor has no mirror; start it with mirror=URL"}
        kinds = [k for k in Kind if self._mirror.mirrors(k)]
        mirrored = asyncio.ensure_future(self._mirror.wait(step, timeout_s))
        try:
            while True:
                why = self._never_mirrored(step, kinds)
                if why is not None:
                    # Unless an earlier monitor mirrored it: the mirror looks without waiting.
                    found = await self._mirror.wait(step, 0.0)
                    return found if found["mirrored"] or found["error"] else {"mirrored": False, "error": why}
                settling = [asyncio.ensure_future(self._event(step, k).wait()) for k in Kind
                            if not self._settled(step, k)]
                if step in self._arriving:
                    arrived = self._arrived.setdefault(step, asyncio.Event())
                    settling.append(asyncio.ensure_future(arrived.wait()))
                try:
                    await asyncio.wait([mirrored, *settling], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiting in settling:
                        waiting.cancel()
                if mirrored.done():
                    return mirrored.result()
        finally:
            mirrored.cancel()

    def _never_mirrored(self, step: int, kinds: list[Kind]) -> str | None:
        """Why nothing of ``step`` will be uploaded, or None while something may be. No upload
        would end the wait on such a step. A failure counts only once recorded, as for
        ``wait_committed``: until then a restarted monitor could still commit the step."""
        def failed(k: Kind) -> bool:
            return self._ledger.state_of(step, k) is StepState.FAILED and self._settled(step, k)

        def failure(k: Kind) -> str:
            return f"not mirrored: step {step} failed: {self._ledger.failure_of(step, k)[1]}"

        undecided = next((cause for k in kinds if (cause := self._undecided_cause(step, k)) is not None), None)
        if undecided is not None and not any(self._settled(step, k) and not failed(k) for k in kinds):
            # Never "failed": the newer job may commit it, and its monitor mirror it. (A mirrored
            # state dict that committed is uploaded all the same: its upload ends the wait.)
            return f"not mirrored by this monitor: {undecided}"
        if all(failed(k) for k in kinds):
            return failure(kinds[0])
        if step in self._arriving:
            return None  # a registration of the step the monitor has not applied yet (a full checkpoint?)
        known = [k for k in Kind if self._settled(step, k) or self._could_settle(step, k)]
        if not known or not all(self._settled(step, k) for k in known):
            return None  # nothing of the step registered yet (one may come), or some of it in flight
        if any(self._settled(step, k) and not failed(k) for k in kinds):
            return None  # a mirrored kind committed: its upload ends the wait
        committed = [k for k in known if not failed(k)]
        if not committed:
            return failure(known[0])
        return (f"not mirrored: step {step} committed a state dict only, and nothing else of it has reached the "
                f"monitor; this mirror copies full checkpoints only. Register a full checkpoint of the step before "
                f"waiting, or start the monitor with mirror={{'url': ..., 'state_dicts': True}} to mirror state "
                f"dicts too")
