"""Named failpoints in the save and commit path, for fault-injection tests and drills.

A failpoint is armed with an action, either in-process with :func:`arm` or for every process of
a job through the environment variable ``CKPTD_FAILPOINTS`` (``name=action[,name=action]``), which
reaches Ray actors through ``runtime_env={"env_vars": {...}}``. Actions:

* ``raise``: raise :class:`~ckptd.errors.FailpointError` at that point.
* ``crash``: end the process at once with ``os._exit(137)``, as a SIGKILL would.
* ``delay:SECONDS``: sleep, as slow storage would.
* ``until:SECONDS:PATH``: wait until the file PATH exists, at most SECONDS: a hold that a test
  (or a drill) releases when it is done looking.
* ``raise_until:PATH``: raise at every hit until the file PATH exists: storage that refuses a
  request, retried, for as long as a test (or a drill) needs. Not limited to one hit by
  ``CKPTD_FAILPOINTS_ONCE``: the file ends it.

With ``CKPTD_FAILPOINTS_ONCE=DIR`` set, each failpoint fires once across every process that
shares DIR (a marker file records it). That is what a crash drill needs: the restarted process
inherits the same environment and must not crash again at the same point.

Unknown failpoint names and actions raise ``ValueError``, so a typo cannot make a fault test pass
without injecting anything.
"""

from __future__ import annotations

import os
import threading
import time

from ckptd.errors import FailpointError

#: Every failpoint ckptd has, and where it sits.
FAILPOINTS: dict[str, str] = {
    "staging_chunk": "worker: a staging copy copied one chunk of a large tensor, before a streaming write may use it",
    "direct_io_write": ("worker: an O_DIRECT write of a large file is about to run; 'raise' here acts as a "
                        "kernel that refuses O_DIRECT (EINVAL): the file is written buffered instead"),
    "before_open_attempt": "driver: start_monitor passed its checks, before it opens its attempt on the root",
    "before_monitor_actor": "driver: start_monitor opened its attempt and found no rival, before it creates the actor",
    "before_discarding_older_records": ("monitor: a new job's start-up cleaned the steps older attempts left, "
                                        "before it discards their ledger records"),
    "after_unit_write": "worker: save_fn returned and files were checksummed, before the receipt",
    "relay_before_forward": "node relay: a batch of notifications arrived, before it is sent to the monitor",
    "relay_after_forward": "node relay: the monitor applied a batch, before its answers go back",
    "before_manifest": "monitor: a step is complete, before its manifest is written",
    "before_tracker_rename": "monitor: the new tracker file is durable, before it is renamed into place",
    "after_publish": "monitor: a manifest or tracker was published, then its publish raised (outcome uncertain)",
    "settle_read": "monitor: a publish raised (outcome uncertain), before it is read back to settle it",
    "settle_sync": "monitor: settling an uncertain publish found it on storage, before syncing it again",
    "settle_remove": "monitor: settling an uncertain publish could not sync it, before taking it back",
    "before_failure_record": "monitor: a step failed, before its failure record is written",
    "before_fence_look": "monitor: a periodic look for a newer attempt on the root, before it lists the attempts",
    "state_dict_check": ("monitor: a committed state dict's files are about to be checksummed against its manifest "
                         "(a step failed while its full checkpoint could still come, or a restart found it in flight)"),
    "before_revoke": "monitor: a committed state dict whose files changed is withdrawn, before its tracker moves back",
    "before_revoke_rm": "monitor: a withdrawal pointed the tracker back, before the manifest goes",
    "before_lease_record_removed": "monitor: a read lease was released, before its record under the root is deleted",
    "before_retention_scan": "monitor: a retention pass read what is in flight, before it scans the root",
    "after_retention_plan": "monitor: a retention pass scanned the root and planned, before its first claim",
    "after_delete_claim": "monitor: retention claimed a step, before its ledger records go and it is deleted",
    "before_step_delete": "monitor: retention is about to delete a step directory",
    "after_mirror_file": "monitor: one file of a step was uploaded to the mirror and verified",
    "before_mirror_manifest": "monitor: every file of a step is on the mirror, before its manifest",
    "before_mirror_publish": "monitor: a manifest or tracker is about to be written to the mirror (each try)",
}
ACTIONS = ("raise", "crash")
ENV_VAR = "CKPTD_FAILPOINTS"
ONCE_ENV_VAR = "CKPTD_FAILPOINTS_ONCE"

_lock = threading.Lock()
_armed: dict[str, str] = {}


def _check(name: str, action: str) -> None:
    if name not in FAILPOINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(FAILPOINTS))}")
    if action in ACTIONS:
        return
    kind, _, arg = action.partition(":")
    seconds, _, path = arg.partition(":")
    try:
        if (kind == "delay" and float(arg) >= 0 or kind == "until" and float(seconds) >= 0 and path
                or kind == "raise_until" and arg):
            return
    except ValueError:
        pass
    raise ValueError(f"unknown failpoint action {action!r} for {name!r}; known: {ACTIONS}, delay:SECONDS, "
                     "until:SECONDS:PATH or raise_until:PATH")


def _from_env() -> dict[str, str]:
    spec = os.environ.get(ENV_VAR, "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, action = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV_VAR} entry {item!r} must look like name=action")
        _check(name.strip(), action.strip())
        out[name.strip()] = action.strip()
    return out


def arm(name: str, action: str = "raise") -> None:
    """Arm failpoint ``name`` in this process."""
    _check(name, action)
    with _lock:
        _armed[name] = action


def disarm(name: str | None = None) -> None:
    """Disarm one failpoint, or all of them, in this process."""
    with _lock:
        if name is None:
            _armed.clear()
        else:
            _check(name, "raise")
            _armed.pop(name, None)


def hit(name: str) -> None:
    """Run failpoint ``name``: nothing unless it is armed here or in ``CKPTD_FAILPOINTS``."""
    if name not in FAILPOINTS:
        raise ValueError(f"unknown failpoint {name!r}")
    with _lock:
        action = _armed.get(name)
    if action is None and ENV_VAR in os.environ:
        action = _from_env().get(name)
    if action is not None and action.startswith("raise_until:"):
        gate = action.split(":", 1)[1]
        if not os.path.exists(gate):
            raise FailpointError(f"failpoint {name!r} fired (until {gate} exists)")
        return
    if action is not None and not _first_time(name):
        return
    if action == "raise":
        raise FailpointError(f"failpoint {name!r} fired")
    if action == "crash":
        os._exit(137)
    if action is not None and action.startswith("delay:"):
        time.sleep(float(action.split(":", 1)[1]))
    if action is not None and action.startswith("until:"):
        _, seconds, path = action.split(":", 2)
        deadline = time.monotonic() + float(seconds)
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)


def _first_time(name: str) -> bool:
    once_dir = os.environ.get(ONCE_ENV_VAR)
    if not once_dir:
        return True
    os.makedirs(once_dir, exist_ok=True)
    try:
        fd = os.open(os.path.join(once_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.fsync(fd)  # the marker must outlive the crash it announces
    os.close(fd)
    return True
