"""Talking to the monitor from a worker: calls that survive monitor restarts, and batched
notifications."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from ckptd.coordinator.notifier import Notifier
from ckptd.errors import CheckpointError, CheckpointTimeoutError
from ckptd.fencing import AttemptRecord, newer_attempts
from ckptd.metrics import RETRIED_REQUESTS, RunMetrics
from ckptd.protocol import actor_name, describe_attempt
from ckptd.storage import Storage

if TYPE_CHECKING:
    from ckptd.coordinator.relay import RelayRoute

log = logging.getLogger("ckptd.coordinator")

# One notifier per monitor and route in a process: the coordinators that a process hosts (a
# simulator, or an actor that drives several workers) batch their notifications together.
_notifiers: weakref.WeakValueDictionary[tuple, Notifier] = weakref.WeakValueDictionary()
_notifiers_lock = threading.Lock()


def _within(timeout_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread, which a call that never returns (a GCS that
    does not answer) leaves behind without holding the caller or the process's exit.

    Raises:
        TimeoutError: no answer within ``timeout_s``; what ``fn`` raised otherwise.
    """
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))

    thread = threading.Thread(target=run, name="ckptd-gcs-query", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not box:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _last_line(e: BaseException) -> str:
    """The last line of an error's text: where Ray's actor errors say why the actor died."""
    return next((line.strip() for line in reversed(str(e).splitlines()) if line.strip()), "")


def _process_exists(pid: int) -> bool:
    """Whether process ``pid`` runs on this node (a killed one its parent has not reaped yet,
    a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True  # another user's process
        return True


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


def require_ray() -> None:
    """Refuse a call once this process left Ray: Ray would start a new local cluster for it (its
    auto-init), where the monitor is not, and an answer awaited there never comes."""
    if not ray.is_initialized():
        raise CheckpointError(
            "Ray is not running in this process (ray.shutdown() was called while a save or a registration was "
            "in flight), so the checkpoint monitor cannot be reached and the save does not count: call "
            "coord.wait_all() or coord.close() before ray.shutdown()")


class WatchedRoot(NamedTuple):
    """A root to look for newer attempts on (:meth:`MonitorClient.watch_root`), picklable."""

    url: str
    storage_options: dict
    attempt: int

    def storage(self) -> Storage:
        return Storage(self.url, self.storage_options)


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

    def _actor_info(self) -> dict | None:
        """What the GCS says of the monitor's actor, or None where it cannot say. A private Ray
        API (``ray._private.state``, as in ``drain_watch``)."""
        try:
            from ray._private import state

            # Bounded: a GCS that does not answer (stopped, failing over) must not hold the wait.
            info = _within(self._timeout_s, state.actors, actor_id=self._handle._actor_id.hex())
        except Exception:
            return None
        return info if isinstance(info, dict) else None

    def _restarting(self) -> bool:
        """Whether Ray is restarting the monitor's actor (the GCS says so, or says it is alive in
        a process on this node that no longer exists), which a ping that goes unanswered cannot
        tell from a stopped process. Where the GCS cannot say, False."""
        info = self._actor_info()
        if info is None:
            return False
        try:
            here = ray.get_runtime_context().get_node_id()
        except Exception:
            return False
        if info.get("State") in ("RESTARTING", "PENDING_CREATION", "DEPENDENCIES_UNREADY"):
            return True
        pid = info.get("Pid")
        return (info.get("State") == "ALIVE" and isinstance(pid, int) and pid > 0
                and (info.get("Address") or {}).get("NodeID") == here and not _process_exists(pid))

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

    def _raise_if_gone_for_good(self, e: RayActorError, deadline: float) -> None:
        """Raise a :class:`CheckpointError` at once where the monitor's actor will never answer
        again, instead of retrying until the deadline: it died in its start-up, or it is dead
        (Ray does not restart it) and a newer attempt has opened on its root (a newer job's
        ``start_monitor(takeover=True)`` kills the old monitor so). A monitor killed with no newer
        attempt is waited for: a new job may start under the run's name, and :meth:`_reattach`
        then says so. A dead monitor of a client not bound to its run (a coordinator still asking
        for its configuration) cannot be looked up again at all: that too raises at once.
        ``deadline``: the call's, which bounds the lookup of a monitor started again."""
        if e.actor_init_failed:
            raise self._died_starting(e) from e
        if not isinstance(e, ActorDiedError) or self._root is None and self._run is not None:
            return
        info = self._actor_info()
        if info is None or info.get("State") != "DEAD":
            return  # being restarted, or the GCS cannot say: retried
        if self._run is None:
            raise CheckpointError(
                f"the checkpoint monitor this actor handle names is dead and Ray does not restart it "
                f"({_last_line(e)}): nothing can answer through this handle. If a newer job took the root over, "
                "or the job was started again, pass that job's monitor (ckptd.get_monitor(run), or what its "
                "ckptd.start_monitor returned)"
            ) from e
        dead = self._handle
        self._reattach(deadline)  # a new job's monitor under the run's name raises its own error
        newer = self._newer_attempt()
        if self._handle is not dead or newer is None:
            return  # no newer job on the root: one may yet start under this run's name, and is waited for
        raise CheckpointError(
            f"the checkpoint monitor of run {self._run!r} ({self._attempt_label}) is dead and Ray does not "
            f"restart it ({_last_line(e)}), and attempt {newer.attempt} of the root (run {newer.run!r}) has opened "
            "since: a newer job took the root over, as start_monitor(takeover=True) does. This coordinator's saves "
            "cannot count there, and the steps its monitor had not committed are that job's to keep or not. "
            "Create a new CheckpointCoordinator for the new job's monitor") from e

    def _newer_attempt(self) -> AttemptRecord | None:
        """The newest attempt opened on the root after this client's, or None (none, or storage
        could not say)."""
        storage, attempt = self._root
        try:
            newer = newer_attempts(storage, attempt)
        except Exception as e:  # unreachable storage: the retries go on until the deadline
            log.debug("could not look for a newer attempt on the root: %s: %s", type(e).__name__, e)
            return None
        return newer[-1] if newer else None

    def _died_starting(self, e: RayActorError) -> CheckpointError:
        """The monitor's actor raised in its start-up (Ray restarted it after a crash, and its
        rebuild from storage failed: a damaged .ckptd/layout.json, say): it stays dead, so waiting for it
        until the timeout would only delay the error."""
        said = _last_line(e)
        return CheckpointError(
            f"the checkpoint monitor{'' if self._run is None else f' of run {self._run!r}'} died in its start-up "
            f"(restarted after a crash, it could not rebuild its state): {said}. Ray does not restart it again: "
            "fix what that says, then start the job again (ckptd.start_monitor)")

    def _unreachable(self, method: str, e: RayActorError, waits_s: float | None) -> CheckpointTimeoutError:
        """The error of a call whose monitor could not be reached until its deadline (``e``, Ray's
        last error, is its cause): dead and not started again, or still being restarted."""
        info = self._actor_info()
        if info is not None and info.get("State") == "DEAD" and self._other_under_run_name():
            how = (f"is dead and Ray does not restart it ({_last_line(e)}); a monitor was started again under its "
                   "run's name but did not say in time which job it serves (stopped, stuck or still starting),")
            todo = ("if that monitor is a new job's, create new coordinators for it (ckptd.get_monitor); else raise "
                    "the coordinator's notify_timeout_s")
        elif info is not None and info.get("State") == "DEAD":
            how = (f"is dead and Ray does not restart it ({_last_line(e)}), and no monitor was started again under "
                   "its run's name")
            todo = ("if the job was stopped, start it again (ckptd.start_monitor) and create new coordinators for "
                    "its monitor")
        else:
            how = "could not be reached (Ray was restarting it, or its node was unreachable)"
            todo = "raise the coordinator's notify_timeout_s if its restarts take longer"
        return CheckpointTimeoutError(
            f"the checkpoint monitor{'' if self._run is None else f' of run {self._run!r}'} {how} for "
            f"notify_timeout_s={self._timeout_s:g} s" + (f" (+ the {waits_s:g} s {method} waits)" if waits_s else "")
            + f", so {method} got no answer and may or may not have been applied: {todo}")

    def _other_under_run_name(self) -> bool:
        """Whether an actor other than this client's monitor now holds the run's name."""
        if self._run is None or not ray.is_initialized():
            return False
        try:
            found = ray.get_actor(actor_name(self._run), namespace=self._namespace)
        except ValueError:
            return False
        return found._actor_id != self._handle._actor_id

    def _unanswered(self, method: str, waits_s: float | None) -> CheckpointTimeoutError:
        if waits_s is None:
            what = f"a ping within {self._timeout_s:g} s while {method} waited"
        else:
            what = f"{method} within {self._timeout_s:g} s" + (f" (+ the {waits_s:g} s it waits)" if waits_s else "")
        return CheckpointTimeoutError(
            f"the checkpoint monitor{'' if self._run is None else f' of run {self._run!r}'} did not answer {what}: "
            "it is alive but not answering (stopped, stuck, or still restarting). The call may still take effect "
            "when it resumes; raise the coordinator's notify_timeout_s if it is only slow.")

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

    def _reattach(self, deadline: float | None = None) -> None:
        """Look the monitor up again by its run's name; a monitor found there is asked which
        attempt it serves within the client's timeout, and no later than ``deadline`` (a call's).

        Raises:
            CheckpointError: the monitor now under that name belongs to another attempt (a new
                job, on the same root or another): what this coordinator saves or registers must
                not count there, as its receipts and registrations belong to the attempt it was
                created in.
        """
        if self._run is None:
            return
        require_ray()  # ray.shutdown() during the retries: get_actor would start a new Ray
        try:
            handle = ray.get_actor(actor_name(self._run), namespace=self._namespace)
        except ValueError:
            return  # not re-created (yet); keep retrying the old handle until the deadline
        if self._attempt is not None:
            left = self._timeout_s if deadline is None else min(self._timeout_s, deadline - time.monotonic())
            if left <= 0:
                return  # no time left to ask: the call ends (see _unreachable)
            try:
                now = ray.get(handle.ping.remote(), timeout=left)
            except (RayActorError, GetTimeoutError):
                return  # not answering yet: tried again at the next retry
            if now.get("attempt_id") != self._attempt:
                raise CheckpointError(
                    f"the monitor of run {self._run!r} was started again, as attempt {now['attempt']} of root "
                    f"{now['root']!r} (a new job), and this coordinator belongs to {self._attempt_label}: "
                    "its saves and registrations cannot count in the new job. Create a new CheckpointCoordinator "
                    "for it.")
        self._handle = handle
