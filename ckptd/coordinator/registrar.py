"""Registrations sent from a background thread, for ``register(..., wait=False)``.

A training loop that registers every checkpoint waits a round trip to the monitor each time: 3 ms
on an idle machine, 15 ms in the bench's GIL-bound loop, where every reply waits for the GIL. The
registration can go in the background as long as two orders are kept:

* the registrations of one coordinator reach the monitor in the order they were made (one
  thread sends them), so additive counts and refusals come out as with blocking calls;
* a save unit that this coordinator starts after a registration does not report itself
  finished (its receipt, then its notification) before that registration was applied
  (:meth:`Registrar.barrier`). Otherwise ``register(S, 1); register(S, 1); save(a)`` could
  commit S with one unit: ``a`` finishing while the second registration is still queued meets
  a count of one. The unit writes meanwhile; with writer slots (a throttling save strategy) it
  waits before it asks for one instead, so that it never holds a slot other writers wait for.

What the monitor answers (an error) is kept and raised by the caller's next ``register``,
``wait_all``, ``wait_committed`` or ``close``, which also wait until every registration made
before them was applied. Once the monitor has not answered one registration in time, those
queued behind it by then share one more timeout, rather than one each: a stopped monitor holds
``close()`` for about two timeouts, however many registrations were queued.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from functools import partial

from ray.exceptions import RayActorError

from ckptd.errors import CheckpointError, CheckpointTimeoutError, add_note


class Registrar:
    """One thread that applies registrations in the order they were made.

    Args:
        send: Sends one registration and raises what the monitor answered, if it was an error;
            its second argument is None or the ``time.monotonic()`` by which the answer must come.
        name: The thread's name.
        timeout_s: The bound shared by the registrations queued behind one that went unanswered.
    """

    def __init__(self, send: Callable[[tuple, float | None], None], name: str, timeout_s: float) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self._cond = threading.Condition()
        self._submitted = 0  # registrations queued so far
        self._done = 0  # of those, applied or failed
        self._errors: list[BaseException] = []
        self._uncertain: list[tuple[int, int]] = []  # (position, step) of registrations that went unanswered
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, args: tuple) -> None:
        """Queue one registration (already validated); it is sent after every one before it.

        Raises:
            CheckpointError: after :meth:`close`.
        """
        with self._cond:
            if self._closed:
                raise CheckpointError("this CheckpointCoordinator is closed")
            self._submitted += 1
            self._queue.put(args)

    def barrier(self, step: int) -> Callable[[], None] | None:
        """What a save unit of ``step`` started now calls before it reports itself finished: it
        returns once every registration queued before this call was applied or failed. None when
        there is nothing to wait for.

        It raises :class:`CheckpointError` if one of those registrations, of the unit's step, went
        unanswered (a timeout, an unreachable monitor): Ray may still deliver it, after a monitor
        restart say, so the step's count is not known. Had the unit reported itself finished, a
        restarted monitor could count it against the registrations that arrived first and commit
        the step short of the rest."""
        with self._cond:
            ticket = self._submitted
            if self._done >= ticket and not self._unanswered(step, ticket):
                return None
        return partial(self._wait_done, ticket, step)

    def _unanswered(self, step: int, ticket: int) -> bool:
        return any(seq <= ticket and s == step for seq, s in self._uncertain)

    def _wait_done(self, ticket: int, step: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done >= ticket)
            unanswered = self._unanswered(step, ticket)
        if unanswered:
            raise CheckpointError(
                f"a registration of step {step} made before this save went unanswered (the monitor did not answer "
                "in notify_timeout_s, or could not be reached) and may still be applied, so the step's number of "
                "units is not known: this unit is not reported finished, and the step fails rather than commit "
                "with fewer units than registered. Save into a new step once the monitor answers (this coordinator "
                "fails every later unit of this step)")

    def flush(self) -> None:
        """Wait until every queued registration was applied or failed; raise the first failure
        not yet raised, with a note for each later one (each is raised once)."""
        self.wait()
        self.raise_failures()

    def wait(self) -> None:
        """Wait until every queued registration was applied or failed (raises nothing)."""
        self._queue.join()

    def raise_failures(self) -> None:
        """Raise the first failure not yet raised, with a note for each later one. Apart from
        :meth:`wait` so that an asyncio caller waits in a thread and takes the failures on its
        own: cancelled in its wait, it leaves them for the next call."""
        with self._cond:
            errors, self._errors = self._errors, []
        if not errors:
            return
        for extra in errors[1:]:
            add_note(errors[0], f"a later registration sent in the background failed too: "
                                f"{type(extra).__name__}: {extra}")
        raise errors[0]

    def close(self) -> None:
        """Refuse new registrations; the thread stops after sending the queued ones (which
        :meth:`flush` still waits for). Idempotent."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._queue.put(None)

    def _run(self) -> None:
        sent = 0
        shared: tuple[int, float] | None = None  # (the last ticket queued, its bound) after one went unanswered
        while True:
            args = self._queue.get()
            try:
                if args is None:
                    return
                sent += 1
                until = shared[1] if shared is not None and sent <= shared[0] else None
                self._send(args, until)
            except BaseException as e:  # noqa: BLE001 - kept for the caller, whatever it is
                if isinstance(e, CheckpointTimeoutError) and (shared is None or sent > shared[0]):
                    with self._cond:
                        shared = (self._submitted, time.monotonic() + self._timeout_s)
                with self._cond:
                    self._errors.append(e)
                    if isinstance(e, (CheckpointTimeoutError, RayActorError)):  # not an answer: may still apply
                        self._uncertain.append((sent, args[0]))
            finally:
                if args is not None:
                    with self._cond:
                        self._done += 1
                        self._cond.notify_all()
                self._queue.task_done()
