"""What the trainer asks the monitor through a coordinator: how many save units a step has
(``register``, ``register_and_monitor``), and whether a step is committed or mirrored."""

from __future__ import annotations

from typing import Any

from ckptd import protocol
from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError, CheckpointError, CheckpointSaveError, RegistrationConflictError
from ckptd.units import check_count, check_step


class TrainerCalls:
    """The trainer-side half of :class:`~ckptd.CheckpointCoordinator` (it provides ``_client``)."""

    _client: Any

    def register(
        self,
        global_step: int,
        is_state_dict: bool = False,
        state_dict_thread_count: int = 0,
        checkpoint_thread_count: int = 0,
    ) -> None:
        """Register how many save units step ``global_step`` has, across all workers.

        The step of a kind is committed once that many distinct units of the kind have finished
        and none has failed. Registrations of a step add up per kind, as Trinity's counters do:
        two calls with ``checkpoint_thread_count=1`` expect two units. Each call carries an id,
        so a call that Ray or this coordinator retries counts once. Blocking twin of
        :meth:`register_and_monitor`.

        Raises:
            CheckpointConfigError: bad step or counts.
            RegistrationConflictError: it adds units to a step already committed as a checkpoint.
            CheckpointSaveError: the step already failed.
        """
        args = self._registration(global_step, is_state_dict, state_dict_thread_count, checkpoint_thread_count)
        _raise_for(self._client.call("register", *args))

    async def register_and_monitor(
        self,
        global_step: int,
        is_state_dict: bool = False,
        state_dict_thread_count: int = 0,
        checkpoint_thread_count: int = 0,
    ) -> None:
        """Async form of :meth:`register`; returns once the registration is durable."""
        args = self._registration(global_step, is_state_dict, state_dict_thread_count, checkpoint_thread_count)
        _raise_for(await self._client.call_async("register", *args))

    def wait_committed(self, global_step: int, is_state_dict: bool = False, timeout_s: float | None = None) -> None:
        """Block until step ``global_step`` is committed.

        Raises:
            CheckpointSaveError: the step failed.
            TimeoutError: it was neither committed nor failed within ``timeout_s``.
            CheckpointError: the monitor knows nothing of the step and it is older than the
                newest commit (deleted by retention before the monitor restarted, or never saved).
        """
        kind = Kind.from_flag(is_state_dict)
        result = self._client.call("wait_committed", check_step(global_step), kind.value, timeout_s)
        if result["committed"]:
            return
        if result["cause"] is None:
            raise TimeoutError(f"step {global_step} ({kind.value}) not committed within {timeout_s} s")
        if result.get("unknown"):
            raise CheckpointError(result["cause"])
        raise CheckpointSaveError(global_step, kind.value, result["unit"], result["cause"])

    def wait_mirrored(self, global_step: int, timeout_s: float | None = None) -> None:
        """Block until step ``global_step`` is committed on the monitor's mirror (before a job
        ends, say, so the last checkpoint is not only on a node's local disk).

        Raises:
            TimeoutError: not mirrored within ``timeout_s``; the upload may still be retrying
                (``monitor.status.remote().mirror`` says why).
            CheckpointError: the monitor has no mirror, or the step cannot be mirrored.
        """
        result = self._client.call("wait_mirrored", check_step(global_step), timeout_s)
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
    raise CheckpointConfigError(err["message"])
