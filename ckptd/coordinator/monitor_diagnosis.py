"""What a worker's client finds out about a monitor that does not answer: whether Ray is
restarting it, whether it is dead for good (and a newer job took the root over, or started again
under the run's name), and the errors that say so. A mixin of
:class:`~ckptd.coordinator.client.MonitorClient`, kept apart because it is one idea: diagnosis.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from ckptd.errors import CheckpointError, CheckpointTimeoutError
from ckptd.fencing import AttemptRecord, newer_attempts
from ckptd.protocol import actor_name
from ckptd.storage import Storage

log = logging.getLogger("ckptd.coordinator")


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


def require_ray() -> None:
    """Refuse a call once this process left Ray: Ray would start a new local cluster for it (its
    auto-init), where the monitor is not, and an answer awaited there never comes."""
    if not ray.is_initialized():
        raise CheckpointError(
            "Ray is not running in this process (ray.shutdown() was called while a save or a registration was "
            "in flight), so the checkpoint monitor cannot be reached and the save does not count: call "
            "coord.wait_all() or coord.close() before ray.shutdown()")


class MonitorDiagnosis:
    """The client's state these read: its monitor's handle and timeout, and (once bound) its
    run, namespace, attempt and the root it watches."""

    _handle: Any
    _timeout_s: float
    _run: str | None
    _namespace: str | None
    _attempt: str | None
    _attempt_label: str | None
    _root: tuple[Storage, int] | None

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
