"""A fault-injecting fsspec filesystem for tests: ``faulty://`` in front of a real one (S3 here).

Requests pass through to the target filesystem; a request chosen by the ``faults`` storage
option fails (as a dropped connection would) or pauses first. Every fault names its request kind
and action; an unknown name, action or key raises ``ValueError``, so a typo cannot make a fault
test pass without injecting anything (PyTorch DCP's ``FaultyStorageWriter`` does the same).

    Storage("faulty://bucket/run", {"target_protocol": "s3", "target_options": {...},
                                     "faults": [{"request": "write", "at": 2}]})

Faults (a list of dicts):
    request: ``write`` (opening an object or file to write it), ``read``, ``info``, ``list``
        or ``remove``.
    at: the 1-based number of the first request of that kind the fault applies to.
    action: ``raise`` (default) or ``pause``.
    times: for ``raise``, how many requests from ``at`` on fail; -1 for all of them.
    while_exists: for ``raise``, fail from ``at`` on while this local file exists (an outage
        the test ends by deleting the file).
    marker, resume: for ``pause``, create ``marker``, then wait until ``resume`` exists.

Faults fire only in processes whose environment has ``CKPTD_TEST_FAULTS=1`` (the tests give it
to the monitor through ``runtime_env``); elsewhere, such as in the driver's checks in
``start_monitor``, requests pass straight through. The monitor's process gets this protocol
through Ray's ``worker_process_setup_hook`` (:func:`register`).
"""

from __future__ import annotations

import os
import threading
import time

import fsspec
from fsspec.implementations.dirfs import DirFileSystem

ARMED_ENV = "CKPTD_TEST_FAULTS"
ARMED = {"env_vars": {ARMED_ENV: "1"}}  # a runtime_env that arms the faults in an actor
REQUESTS = ("write", "read", "info", "list", "remove")
ACTIONS = ("raise", "pause")
_KEYS = {"request", "at", "action", "times", "while_exists", "marker", "resume"}


class InjectedFault(ConnectionResetError):
    """What a failing request raises: a transient network error."""


def check_faults(faults: list[dict]) -> list[dict]:
    out = []
    for fault in faults:
        unknown = set(fault) - _KEYS
        if unknown:
            raise ValueError(f"unknown fault keys {sorted(unknown)}; known: {sorted(_KEYS)}")
        if fault.get("request") not in REQUESTS:
            raise ValueError(f"unknown request kind {fault.get('request')!r}; known: {REQUESTS}")
        action = fault.get("action", "raise")
        if action not in ACTIONS:
            raise ValueError(f"unknown fault action {action!r}; known: {ACTIONS}")
        if not isinstance(fault.get("at", 1), int) or fault.get("at", 1) < 1:
            raise ValueError(f"fault 'at' must be an int >= 1, got {fault.get('at')!r}")
        if action == "pause" and not (fault.get("marker") and fault.get("resume")):
            raise ValueError("a pause fault needs 'marker' and 'resume' paths")
        out.append({"action": action, "at": 1, "times": 1, **fault})
    return out


class FaultyFileSystem(DirFileSystem):
    protocol = "faulty"

    def __init__(self, *args, faults: list[dict] | tuple = (), **kwargs) -> None:
        kwargs["path"] = kwargs["fo"] = ""  # paths are the target's own, unprefixed
        super().__init__(*args, **kwargs)
        self.faults = check_faults(list(faults))
        self._counts = dict.fromkeys(REQUESTS, 0)
        self._lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path):
        path = path[len("faulty://"):] if path.startswith("faulty://") else path
        return path.rstrip("/")

    def _request(self, kind: str, path: str) -> None:
        if os.environ.get(ARMED_ENV) != "1":
            return
        with self._lock:
            self._counts[kind] += 1
            n = self._counts[kind]
        for fault in self.faults:
            if fault["request"] != kind or n < fault["at"]:
                continue
            if fault["action"] == "pause":
                if n == fault["at"]:
                    open(fault["marker"], "w").close()
                    while not os.path.exists(fault["resume"]):
                        time.sleep(0.02)
                continue
            if "while_exists" in fault:
                failing = os.path.exists(fault["while_exists"])
            else:
                failing = fault["times"] < 0 or n < fault["at"] + fault["times"]
            if failing:
                raise InjectedFault(f"injected fault: {kind} request #{n} ({path}) failed")

    def open(self, path, mode="rb", *args, **kwargs):
        self._request("write" if "w" in mode else "read", path)
        return super().open(path, mode, *args, **kwargs)

    def cat_file(self, path, *args, **kwargs):
        self._request("read", path)
        return super().cat_file(path, *args, **kwargs)

    def pipe_file(self, path, *args, **kwargs):
        self._request("write", path)
        return super().pipe_file(path, *args, **kwargs)

    def info(self, path, **kwargs):
        self._request("info", path)
        return super().info(path, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        self._request("list", path)
        return super().ls(path, detail=detail, **kwargs)

    def find(self, path, *args, **kwargs):
        self._request("list", path)
        return super().find(path, *args, **kwargs)

    def rm(self, path, *args, **kwargs):
        self._request("remove", path)
        return super().rm(path, *args, **kwargs)


def register() -> None:
    """Make ``faulty://`` known in this process (Ray's worker_process_setup_hook calls this)."""
    fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
