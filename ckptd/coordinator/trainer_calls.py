"""What the trainer asks the monitor through a coordinator: how many save units a step has
(``register``, ``register_and_monitor``), and whether a step is committed or mirrored."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from ckptd import protocol
from ckptd.config import Kind
from ckptd.coordinator.registrar import Registrar
from ckptd.errors import CheckpointConfigError, CheckpointError, CheckpointSaveError, RegistrationConflictError
from ckptd.units import check_count, check_step, check_timeout


class TrainerCalls:
    """The trainer-side half of :class:`~ckptd.CheckpointCoordinator` (it provides ``_client``)."""

    _client: Any
    _lock: threading.Lock
    _worker: str
    _registrar: Registrar | None = None
    _registrations_closed = False

    def register(
        self,
        global_step: int,
        is_state_dict: bool = False,
        state_dict_thread_count: int = 0,
        checkpoint_thread_count: int = 0,
        *,
        wait: bool = True,
    ) -> None:
        """Register how many save units step ``global_step`` has, across all workers.

        The step of a kind is committed once that many distinct units of the kind have finished
        and none has failed. Registrations of a step add up per kind, as Trinity's counters do:
        two calls with ``checkpoint_thread_count=1`` expect two units. Each call carries an id,
        so a call that Ray or this coordinator retries counts once. Blocking twin of
        :meth:`register_and_monitor`.

        ``wait=False`` returns once the arguments are checked, and the registration goes to the
        monitor from a background thread, in order with this coordinator's other registrations:
        the training thread does not wait for the round trip (15 ms in a GIL-bound loop). The
        step commits as it would otherwise. What the monitor answers is raised by the next
        ``register(wait=True)`` (which then does not send its own registration: call it
        again), :meth:`wait_all`, :meth:`wait_committed` or ``close()``, which first wait until
        every registration made before them was applied. A save unit this coordinator starts
        after a ``wait=False`` call reports itself finished only once that registration was
        applied, so ``register(S, 1, wait=False)`` twice, then two saves, commits S with both
        units, as blocking calls would. A process that dies before its registration arrived
        leaves the step uncommitted, never committed short.

        Raises:
            CheckpointConfigError: bad step or counts (at once, also with ``wait=False``).
            RegistrationConflictError: it adds units to a step already committed as a checkpoint.
            CheckpointSaveError: the step already failed.
            CheckpointError: a newer job took the root over while the step's commit was being
                settled (that job decides whether it is committed).
        """
        args = self._registration(global_step, is_state_dict, state_dict_thread_count, checkpoint_thread_count)
        if not wait:
            self._background_registrar().submit(args)
            return
        self._flush_registrations()
        _raise_for(self._client.call("register", *args))

    def _background_registrar(self) -> Registrar:
        with self._lock:
            if self._registrations_closed:
                raise CheckpointError("this CheckpointCoordinator is closed")
            if self._registrar is None:
                self._registrar = Registrar(
                    lambda args, until: _raise_for(self._client.call("register", *args, until=until)),
                    f"ckptd-register-{self._worker}", self._client.timeout_s)
            return self._registrar

    def _registration_barrier(self, step: int) -> Callable[[], None] | None:
        """For a save unit of ``step`` started now: waits for the registrations made before it
        (see :mod:`ckptd.coordinator.registrar`), or None if there are none in flight."""
        registrar = self._registrar
        return None if registrar is None else registrar.barrier(step)

    def _close_registrations(self) -> None:
        """Refuse registrations with ``wait=False`` from now on; the queued ones still go."""
        with self._lock:
            self._registrations_closed = True
            registrar = self._registrar
        if registrar is not None:
            registrar.close()

    def _flush_registrations(self) -> None:
        """Wait for the registrations sent with ``wait=False``; raise the first that failed."""
        if self._registrar is not None:
            self._registrar.flush()

    async def register_and_monitor(
        self,
        global_step: int,
        is_state_dict: bool = False,
        state_dict_thread_count: int = 0,
        checkpoint_thread_count: int = 0,
    ) -> None:
        """Async form of :meth:`register`; returns once the registration is durable."""
        args = self._registration(global_step, is_state_dict, state_dict_thread_count, checkpoint_thread_count)
        if self._registrar is not None:
            # Only the wait goes to a thread: a failure taken there by a caller cancelled meanwhile
            # (asyncio.wait_for, a shutdown) would be raised into a future nobody reads.
            await asyncio.to_thread(self._registrar.wait)
            self._registrar.raise_failures()
        _raise_for(await self._client.call_async("register", *args))

    def wait_committed(self, global_step: int, is_state_dict: bool = False, timeout_s: float | None = None) -> None:
        """Block until step ``global_step`` is committed.

        Raises:
            CheckpointSaveError: the step failed.
            TimeoutError: it was neither committed nor failed within ``timeout_s``.
            CheckpointError: the monitor knows nothing of the step and it is older than the
                newest commit (deleted by retention before the monitor restarted, or never saved),
                or a newer job took the root over before the step's commit could be settled: that
                job decides whether it is committed (``ckptd.latest_step``); the step is not
                reported failed, as it may be committed.
        """
        kind, step, timeout_s = Kind.from_flag(is_state_dict), check_step(global_step), check_timeout(timeout_s)
        self._flush_registrations()  # a registration still on its way could be the step's last
        result = self._client.call("wait_committed", step, kind.value, timeout_s,
                                   waits_s=timeout_s)
        if result["committed"]:
            return
        if result["cause"] is None:
            detail = f": {result['detail']}" if result.get("detail") else ""  # older monitors send none
            raise TimeoutError(f"step {global_step} ({kind.value}) not committed within {timeout_s} s{detail}")
        if result.get("unknown") or result.get("undecided"):
            raise CheckpointError(result["cause"])
        raise CheckpointSaveError(global_step, kind.value, result["unit"], result["cause"])

    def wait_mirrored(self, global_step: int, timeout_s: float | None = None) -> None:
        """Block until step ``global_step`` is committed on the monitor's mirror (before a job
        ends, say, so the last checkpoint is not only on a node's local disk).

        Raises:
            TimeoutError: not mirrored within ``timeout_s``; the upload may still be retrying
                (``monitor.status.remote().mirror`` says why).
            CheckpointError: the monitor has no mirror, or the step cannot be mirrored: it failed,
                or it committed a state dict only and the mirror copies full checkpoints only.
        """
        step, timeout_s = check_step(global_step), check_timeout(timeout_s)
        self._flush_registrations()  # a registration still on its way could be the step's full checkpoint
        result = self._client.call("wait_mirrored", step, timeout_s, waits_s=timeout_s)
        if result["mirrored"]:
            return
        if result["error"] is None:
            raise TimeoutError(f"step {global_step} not mirrored within {timeout_s} s")
        raise CheckpointError(result["error"])

    @staticmethod
    def _registration(step: int, is_state_dict: bool, sd_count: int, ckpt_count: int) -> tuple:
        step = check_step(step)
        counts = {
            Kind.STATE_DICT.value: check_count(sd_count, "state_dict_thread_count"),
            Kind.CHECKPOINT.value: check_count(ckpt_count, "checkpoint_thread_count"),
        }
        # The id makes a call that Ray or this coordinator retries count once: registrations add up.
        return step, counts, Kind.from_flag(is_state_dict).value, protocol.new_id()


def _raise_for(result: dict) -> None:
    err = result.get("error")
    if err is None:
        return
    if err["type"] == "CheckpointSaveError":
        raise CheckpointSaveError(err["step"], err["kind"], err["unit"], err["cause"])
    if err["type"] == "RegistrationConflictError":
        raise RegistrationConflictError(err["message"])
    if err["type"] == "CheckpointError":  # a step whose outcome a newer job decides
        raise CheckpointError(err["message"])
    raise CheckpointConfigError(err["message"])
