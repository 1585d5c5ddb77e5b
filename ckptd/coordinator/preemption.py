"""PreemptionGuard: a final save at the step boundary after SIGTERM or a Ray node drain.

The signal handler (and the drain watch thread) only record the notice. The training loop asks
at its step boundary; there the guard saves the step just completed (unless a save of it is
already in flight), waits for its commit and mirror upload within a grace deadline, and ends the
process with a documented exit code.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from ckptd.coordinator.coordinator import CheckpointCoordinator
from ckptd.coordinator.drain_watch import DrainWatch
from ckptd.coordinator.notice import (
    Notice,
    NoticeSource,
    PreemptionOutcome,
    already_saved,
    deadline_of,
    decode_agreement,
    earliest,
    encode_for_agreement,
)
from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.units import check_step

log = logging.getLogger("ckptd.preemption")

#: Default seconds from the notice to the end of the final save: Kubernetes sends SIGKILL 30 s
#: after SIGTERM (``terminationGracePeriodSeconds``), and Slurm 30 s after its SIGTERM
#: (``KillWait``); 5 s are left for the process to exit.
DEFAULT_GRACE_S = 25.0


class PreemptionGuard:
    """Makes a final save when the job is told to stop: on SIGTERM, or when Ray drains its node.

    Use it as a context manager around the training loop, and call :meth:`at_step_boundary`
    after each step::

        with ckptd.PreemptionGuard(coord, save) as guard:
            for step in range(start + 1, total + 1):
                train_one_step()
                if step % 100 == 0:
                    save(step)
                guard.at_step_boundary(step)  # after a notice: final save, then exit

    ``save_fn(step)`` is the job's own save for one step: the ``save_async`` calls of this rank
    (and, on the rank that does it, the ``register`` call), as the loop makes for a periodic save.

    Args:
        coordinator: This rank's coordinator.
        save_fn: Saves step ``step`` of this rank; called at most once, on the thread that calls
            :meth:`at_step_boundary`.
        grace_s: Seconds from the notice until the final save must be committed (and mirrored);
            a Ray drain deadline that comes sooner wins.
        signals: Signals that mean "stop". The handler only records the notice; the previous
            handler is not called, and is put back by :meth:`close`. Python installs signal
            handlers only in the main thread: elsewhere pass ``signals=()`` and rely on the
            drain watch or :meth:`notify`.
        watch_ray_drain: Poll Ray for a drain of this process's node, every ``drain_poll_s``.
        drain_poll_s: Seconds between polls (one small request to Ray's GCS each).
        wait_for_mirror: Also wait for the mirror upload when the monitor has a mirror.
        exit: End the process once the final save is over (``SystemExit`` with
            :data:`ckptd.PREEMPTED_EXIT_CODE`, or ``os._exit`` with
            :data:`ckptd.PREEMPTION_INCOMPLETE_EXIT_CODE`). False: :meth:`at_step_boundary`
            returns the :class:`PreemptionOutcome` instead.
        sync: Agree on the notice with the other ranks of ``torch.distributed``'s default process
            group, when one is initialised with more than one rank: one all-reduce of two numbers
            at each checked boundary. Every rank must then call :meth:`at_step_boundary` with the
            same steps. Without a process group each rank acts on its own notices.
        check_every: Check for a notice (and all-reduce) only when ``step % check_every == 0``.
        is_state_dict: The kind of the final save (a full checkpoint by default).

    Raises:
        CheckpointConfigError: bad arguments, or ``signals`` given off the main thread.

    NOTE: the exit with :data:`ckptd.PREEMPTION_INCOMPLETE_EXIT_CODE` uses ``os._exit``: save threads
    still running at the deadline would otherwise keep the interpreter from exiting until the
    scheduler's SIGKILL. Logs and ``sys.stdout``/``sys.stderr`` are flushed first.
    """

    def __init__(
        self,
        coordinator: CheckpointCoordinator,
        save_fn: Callable[[int], Any],
        *,
        grace_s: float = DEFAULT_GRACE_S,
        signals: Iterable[int] = (signal.SIGTERM,),
        watch_ray_drain: bool = True,
        drain_poll_s: float = 2.0,
        wait_for_mirror: bool = True,
        exit: bool = True,
        sync: bool = True,
        check_every: int = 1,
        is_state_dict: bool = False,
    ) -> None:
        if not isinstance(coordinator, CheckpointCoordinator):
            raise CheckpointConfigError(
                f"coordinator must be a CheckpointCoordinator, got {type(coordinator).__name__}")
        if not callable(save_fn):
            raise CheckpointConfigError(f"save_fn must be callable, got {type(save_fn).__name__}")
        if not _positive(grace_s):
            raise CheckpointConfigError(f"grace_s must be a positive number of seconds, got {grace_s!r}")
        if not _positive(drain_poll_s):
            raise CheckpointConfigError(f"drain_poll_s must be a positive number of seconds, got {drain_poll_s!r}")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise CheckpointConfigError(f"check_every must be an int >= 1, got {check_every!r}")
        try:
            signals = tuple(signal.Signals(s) for s in signals)
        except (TypeError, ValueError) as e:
            raise CheckpointConfigError(f"signals must be signal numbers such as signal.SIGTERM: {e}") from e
        if signals and threading.current_thread() is not threading.main_thread():
            raise CheckpointConfigError(
                "PreemptionGuard installs signal handlers, which Python allows only in the main thread; create it "
                "there, or pass signals=() off the main thread and rely on watch_ray_drain or guard.notify()")
        self._coord = coordinator
        self._save_fn = save_fn
        self._grace_s = float(grace_s)
        self._wait_mirror = bool(wait_for_mirror)
        self._exit = bool(exit)
        self._sync = bool(sync)
        self._every = check_every
        self._is_state_dict = bool(is_state_dict)
        self._notice: Notice | None = None  # written by handlers and the watch thread, read by the loop
        self._outcome: PreemptionOutcome | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._watch: DrainWatch | None = None
        try:
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            if watch_ray_drain:
                import ray

                self._watch = DrainWatch(ray.get_runtime_context().get_node_id(), float(drain_poll_s), self._record)
        except BaseException:
            self.close()  # put back the handlers already replaced
            raise

    # -- notices -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only record: the main thread may have been interrupted inside a lock (logging's, the
        # coordinator's), so nothing here may take one.
        self._record(Notice(NoticeSource.SIGNAL, time.time(), None, signal.Signals(signum).name))

    def _record(self, notice: Notice) -> None:
        # One reference assignment (atomic in CPython); a second notice keeps the first's
        # arrival time and the sooner deadline.
        self._notice = earliest(self._notice, notice)

    def notify(self, detail: str = "notify() was called", deadline: float | None = None) -> None:
        """Record a preemption notice by hand (from a scheduler hook, or Ray Train's
        ``get_preemption_info()``); safe from any thread.

        Args:
            detail: Why, for the log.
            deadline: When the final save must be done (``time.time()`` scale), if sooner than
                the grace period.
        """
        self._record(Notice(NoticeSource.MANUAL, time.time(), deadline, detail))

    @property
    def preempted(self) -> bool:
        """Whether this process has had a notice (not yet agreed with other ranks)."""
        return self._notice is not None

    @property
    def notice(self) -> Notice | None:
        """This process's notice, if any."""
        return self._notice

    # -- the step boundary ---------------------------------------------------------------------

    def at_step_boundary(self, step: int) -> PreemptionOutcome | None:
        """Call after each training step; returns None (at once) unless the job must stop.

        After a notice (on any rank, with a process group), makes the final save of ``step`` as
        :meth:`final_save` does, then ends the process (``exit=True``) or returns the outcome.
        Once an outcome exists, later calls return it again without saving.

        Args:
            step: The step the loop just completed.

        Raises:
            SystemExit: with ``exit=True``, after the final step was committed (and mirrored).
        """
        check_step(step)
        if self._outcome is not None:
            return self._outcome
        if step % self._every:
            return None
        notice = self._agree(self._notice)
        if notice is None:
            return None
        outcome = self._final_save(step, notice)
        if self._exit:
            self.exit(outcome)
        return outcome

    def final_save(self, step: int) -> PreemptionOutcome:
        """Save ``step`` now, as after a notice, and wait for its commit (no process group vote).

        A save of ``step`` already started by this rank's coordinator is waited for instead of
        repeated. Waits end at the deadline: the notice's grace period (or, without a notice,
        ``grace_s`` from now), or a sooner Ray drain deadline. Nothing is raised: the outcome
        says what happened, and is logged.
        """
        check_step(step)
        notice = self._notice or Notice(NoticeSource.MANUAL, time.time(), None, "final_save() was called")
        return self._final_save(step, notice)

    def _agree(self, mine: Notice | None) -> Notice | None:
        group = _process_group() if self._sync else None
        if group is None:
            return mine
        import torch
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        vote = torch.tensor(encode_for_agreement(mine, self._grace_s), dtype=torch.float64, device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN)
        flag, deadline = vote.tolist()
        return decode_agreement(flag, deadline, mine, time.time())

    def _final_save(self, step: int, notice: Notice) -> PreemptionOutcome:
        deadline = deadline_of(notice, self._grace_s)
        log.warning("preemption notice (%s: %s): saving step %d, due in %.1f s", notice.source.value,
                    notice.detail, step, deadline - time.time())
        saved = not already_saved(step, self._coord.last_saved_step(self._is_state_dict))
        errors: list[str] = []
        committed = False
        mirrored: bool | None = None
        try:
            if saved:
                self._save_fn(step)
            finished, failures = self._wait_saves(deadline)
            errors += failures
            if not finished:
                raise TimeoutError("this rank's saves were still running")
            self._coord.wait_committed(step, self._is_state_dict, timeout_s=_left(deadline))
            committed = True
            if self._wait_mirror and self._coord.has_mirror:
                mirrored = False
                self._coord.wait_mirrored(step, timeout_s=_left(deadline))
                mirrored = True
        except TimeoutError as e:
            errors.append(f"the deadline passed: {e}")
        except Exception as e:  # reported in the outcome, the log and the exit code, never dropped
            log.exception("the final save of step %d failed", step)
            errors.append(f"{type(e).__name__}: {e}")
        outcome = PreemptionOutcome(step=step, source=notice.source, detail=notice.detail, saved=saved,
                                    committed=committed, mirrored=mirrored, deadline=deadline,
                                    elapsed_s=time.time() - notice.received_at,
                                    error="; ".join(errors) or None)
        self._outcome = outcome
        if outcome.complete:
            log.warning("preemption: step %d is committed%s after %.1f s%s", step,
                        " and mirrored" if mirrored else "", outcome.elapsed_s,
                        f" (an earlier save failed: {outcome.error})" if outcome.error else "")
        else:
            log.error("preemption: step %d is NOT %s (%.1f s after the notice): %s; the job will resume from "
                      "the newest earlier commit", step, "mirrored" if committed else "committed",
                      outcome.elapsed_s, outcome.error)
        return outcome

    def _wait_saves(self, deadline: float) -> tuple[bool, list[str]]:
        """wait_all() on a helper thread, so that a stuck save cannot hold the loop past the
        deadline. Returns whether the saves finished, and the failures wait_all() reported."""
        failures: list[str] = []

        def wait() -> None:
            try:
                self._coord.wait_all()
            except CheckpointError as e:
                failures.append(str(e))  # an earlier step's failure; the final step's shows in wait_committed
                failures.extend(getattr(e, "__notes__", ()))  # the failures beside it (a failed save, say)

        waiter = threading.Thread(target=wait, name="ckptd-preemption-wait", daemon=True)
        waiter.start()
        waiter.join(_left(deadline))
        return not waiter.is_alive(), failures

    def exit(self, outcome: PreemptionOutcome) -> NoReturn:
        """End the process with ``outcome.exit_code``.

        A complete outcome raises ``SystemExit`` (so ``finally`` blocks, context managers and
        ``atexit`` run); an incomplete one flushes logs and standard streams, then calls
        ``os._exit``, because save threads still running would hold up a normal exit.
        """
        self.close()
        if outcome.complete:
            raise SystemExit(outcome.exit_code)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(outcome.exit_code)

    # -- life cycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the drain watch and put back the previous signal handlers (where ours is still
        installed: a handler installed after ours is left alone). Idempotent."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, handler)

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.time())


def _process_group() -> Any:
    """The default torch.distributed group when one is initialised with more than one rank."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD
