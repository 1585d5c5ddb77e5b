"""Following a run's weight versions from a rollout worker (any Ray actor, or a plain process).

With the run's monitor reachable, a subscriber long-polls it: ``wait_version`` returns the moment
a tracker moves, and nothing reads the root in a loop. While the monitor restarts, Ray retries
the call on the new instance, which rebuilt its trackers from storage, so the newest version is
never missed. Without a monitor (none was started in this Ray cluster, Ray is not initialised, the
monitor is gone for good, or ``root`` names another copy such as the mirror) the subscriber reads
the committed state of the root every ``poll_interval_s``, and reattaches when a monitor appears.

What a subscriber sends the monitor: ``reader_heartbeat(reader, leases, serving)`` every third of
the lease (it renews the leases, and re-grants them after a monitor restart), ``pin`` and
``release`` around each opened version, and ``report_serving``. ``reader`` is
``{"id", "name", "kind", "where"}``; a lease is ``[lease_id, step]``; ``serving`` is
``[version, since]``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.layout import is_committed, newest_committed, parse_kind
from ckptd.protocol import monitor_actor, new_id
from ckptd.rollout.waiting import Waiting
from ckptd.rollout.weights import Weights
from ckptd.shared_root import where_am_i
from ckptd.storage import Storage
from ckptd.units import check_name, check_step

log = logging.getLogger("ckptd.rollout")

_CALL_TIMEOUT_S = 60.0


class WeightSubscriber(Waiting):
    """Waits for new weight versions of a run, opens them verified and pinned, and reports the
    version it serves.

    Args:
        run: The run whose monitor to follow (``ckptd.start_monitor(..., run=...)``).
        namespace: The monitor's Ray namespace (None: this job's).
        kind: ``"state_dict"`` (every published version; full checkpoints count) or
            ``"checkpoint"``.
        root: The checkpoint root. None takes the monitor's. Another root (the mirror, a copy)
            is read directly, without leases.
        storage_options: fsspec options for ``root`` (None: the monitor's, for its root).
        name: How status shows this subscriber (default: host and pid).
        model_dir: Where in a step directory the weights are (None: found from the manifest).
        poll_interval_s: How often the root is read when there is no monitor to wait on.

    Raises:
        CheckpointError: no monitor of ``run`` is reachable and no ``root`` was given.
        CheckpointConfigError: bad arguments.
    """

    def __init__(self, run: str = "default", *, namespace: str | None = None, kind: str = "state_dict",
                 root: str | None = None, storage_options: dict | None = None, name: str | None = None,
                 model_dir: str | None = None, poll_interval_s: float = 1.0) -> None:
        check_name(run, "run")
        if not poll_interval_s > 0:
            raise CheckpointConfigError(f"poll_interval_s must be > 0 seconds, got {poll_interval_s}")
        self.kind: Kind = parse_kind(kind)
        self.run, self._namespace = run, namespace
        self._model_dir = model_dir
        self._poll_s = poll_interval_s
        self._where = where_am_i()
        self.name = name or self._where
        self._info = {"id": new_id(), "name": self.name, "kind": self.kind.value, "where": self._where}
        self._lock = threading.Lock()
        self._leases: dict[str, int] = {}
        self._serving: tuple[int, float] | None = None
        self._published: dict[int, float] = {}
        # Versions open() handed out or report_serving accepted (the newest 1000): reportable even
        # once retention deleted them.
        self._known: dict[int, None] = {}
        self._lease_s = 30.0
        self._stop = threading.Event()
        self._monitor: Any = None
        self._wanted_root = None if root is None else Storage(root, storage_options).url
        handle, cfg = self._find_monitor()
        if handle is None and root is None:
            raise CheckpointError(
                f"no monitor of run {run!r} is reachable{'' if ray.is_initialized() else ' (Ray is not initialised)'}; "
                "pass root= to follow the committed versions under a root directly"
            )
        if root is None:
            root, storage_options = cfg["root"], storage_options or cfg["storage_options"]
        self._storage = Storage(root, storage_options)
        if handle is None:
            self._check_root()
        else:
            self._attach(handle)
        self._renewer = threading.Thread(target=self._renew_loop, name=f"ckptd-subscriber-{self.name}", daemon=True)
        self._renewer.start()

    def _check_root(self) -> None:
        """Refuse a root that is a file at once. A root that does not exist yet may be one the
        trainer has not created (a rollout worker started first, or an object-store prefix before
        its first object): waiting for it is allowed, with a warning, and a wait that times out
        says so."""
        problem = self._storage.root_problem()
        if problem == Storage.IS_A_FILE:
            raise CheckpointConfigError(
                f"checkpoint root {self._storage.url!r} is a file, not a directory: pass root= the directory the "
                "trainer's monitor saves into")
        if problem is not None:
            log.warning("subscriber %s: checkpoint root %s does not exist (yet); waiting for the trainer's first "
                        "commit there. If the trainer already saves, check root=", self.name, self._storage.url)

    def _why_nothing(self) -> str:
        """What to add when nothing was found under the root: that it does not exist, if so."""
        if self._monitor is not None:
            return ""
        try:
            problem = self._storage.root_problem()
        except OSError:  # only an addition to another error: never replace that error by this one
            return ""
        if problem is None:
            return ""
        return (f"; the checkpoint root {self._storage.url!r} cannot hold any: {problem}. Check root= (the directory "
                "the trainer's monitor saves into), or start the trainer first")

    # -- the monitor -----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"monitor"`` (long-polling the run's monitor, with leases) or ``"storage"`` (reading
        the root)."""
        return "monitor" if self._monitor is not None else "storage"

    def _find_monitor(self) -> tuple[Any, dict | None]:
        """The run's monitor and its config, if it is reachable and serves the root asked for."""
        if not ray.is_initialized():
            return None, None
        try:
            handle = monitor_actor(self.run, self._namespace)
            cfg = ray.get(handle.worker_config.remote(), timeout=_CALL_TIMEOUT_S)
        except (ValueError, RayActorError, GetTimeoutError):
            return None, None
        except CheckpointConfigError as e:  # several namespaces have one: the root it is then
            log.warning("%s; reading the root instead", e)
            return None, None
        if self._wanted_root is not None and Storage(cfg["root"], cfg["storage_options"]).url != self._wanted_root:
            return None, None  # another copy (the mirror): read it directly
        return handle, cfg

    def _attach(self, handle: Any) -> None:
        with self._lock:
            leases = list(self._leases.items())
            serving = self._serving
        answer = ray.get(handle.reader_heartbeat.remote(self._info, leases, serving), timeout=_CALL_TIMEOUT_S)
        self._lease_s = float(answer["lease_s"])
        self._monitor = handle
        self._lost(answer["lost"])

    def _reattach(self) -> bool:
        handle, _ = self._find_monitor()
        if handle is None:
            return False
        try:
            self._attach(handle)
        except (RayActorError, GetTimeoutError):
            return False
        log.info("subscriber %s follows the monitor of run %r again", self.name, self.run)
        return True

    def _detach(self, error: Exception) -> None:
        if self._monitor is not None:
            log.warning("subscriber %s lost the monitor of run %r (%s); reading %s until it is back", self.name,
                        self.run, type(error).__name__, self._storage.url)
        self._monitor = None

    def _lost(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            with self._lock:
                step = self._leases.pop(lease_id, None)
            if step is not None:
                log.warning("subscriber %s lost its read lease on step %d", self.name, step)

    def _renew_loop(self) -> None:
        # Every third of the lease, also while the monitor is away: leases must be renewed as soon
        # as a monitor is back (a restarted one, or a new job's), within one lease period.
        while not self._stop.wait(self._lease_s / 3):
            handle = self._monitor
            if handle is None:
                if ray.is_initialized():
                    self._reattach()
                continue
            with self._lock:
                leases = list(self._leases.items())
                serving = self._serving
            try:
                answer = ray.get(handle.reader_heartbeat.remote(self._info, leases, serving), timeout=self._lease_s)
                self._lost(answer["lost"])
            except GetTimeoutError:  # a restarting monitor answers late: keep renewing, do not detach
                log.info("subscriber %s: the monitor is slow to answer (restarting?)", self.name)
            except RayActorError as e:
                self._detach(e)
            except Exception:  # keep renewing whatever one round hit
                log.exception("subscriber %s: renewing its leases failed", self.name)

    # -- versions --------------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest committed version now (None if there is none)."""
        handle = self._monitor
        if handle is not None:
            try:
                answer = ray.get(handle.wait_version.remote(self.kind.value, None, 0), timeout=_CALL_TIMEOUT_S)
                return self._note(answer)
            except (RayActorError, GetTimeoutError) as e:
                self._detach(e)
        return newest_committed(self._storage, self.kind)

    def _note(self, answer: dict) -> int | None:
        version = answer["version"]
        if version is not None and answer.get("published_at") is not None:
            self._published[version] = answer["published_at"]
            if len(self._published) > 1000:
                self._published.pop(next(iter(self._published)))
        return version

    def published_at(self, version: int) -> float | None:
        """When the monitor published ``version`` (its tracker moved), if this subscriber heard it."""
        return self._published.get(version)

    # -- reading ---------------------------------------------------------------------------------

    def open(self, version: int | None = None, *, model_dir: str | None = None) -> Weights:
        """Open a committed version (the newest if None), pinned until the handle is closed.

        With a monitor, the pin is a read lease: retention does not delete the step while it is
        held, and it expires if this process dies. Without one there is no pin.

        Raises:
            CheckpointError: nothing is committed yet, or ``version`` is not (any longer) committed.
        """
        if version is None:
            version = self.latest()
            if version is None:
                raise CheckpointError(f"no {self.kind.value} is committed under {self._storage.url} yet"
                                      f"{self._why_nothing()}; wait_for_version() first")
        check_step(version, "version")
        lease_id = None
        handle = self._monitor
        if handle is not None:
            lease_id = new_id()
            try:
                answer = ray.get(handle.pin.remote(self._info, lease_id, version), timeout=_CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError) as e:  # read without a lease, as with no monitor
                self._detach(e)
                lease_id, answer = None, {"error": None}
            if answer["error"] is not None:
                raise CheckpointError(answer["error"])
            if lease_id is not None:
                with self._lock:
                    self._leases[lease_id] = version  # granted: renewals carry it from now on
        self._remember(version)
        return Weights(self, version, lease_id, model_dir if model_dir is not None else self._model_dir)

    def _remember(self, version: int) -> None:
        with self._lock:
            self._known[version] = None
            if len(self._known) > 1000:
                self._known.pop(next(iter(self._known)))

    def _drop(self, lease_id: str | None) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def _release(self, lease_id: str) -> None:
        self._drop(lease_id)
        handle = self._monitor
        if handle is not None:
            handle.release.remote(lease_id)  # no need to wait: the lease would expire anyway

    def report_serving(self, version: int) -> None:
        """Say that this worker now serves ``version``; status shows it, with the lag behind the
        newest commit. Sent at once, and again with every renewal (so a restarted monitor knows).

        Raises:
            CheckpointConfigError: ``version`` is not a step committed (as this subscriber's kind)
                under the root now, and this subscriber neither opened nor reported it before:
                never committed (no worker can serve it), or deleted by retention before anything
                here read it.
        """
        check_step(version, "version")
        with self._lock:
            known = version in self._known
        # A version opened (or reported) here may be deleted by retention since: its lease ends
        # with the with block, before the report, and a served version is restated after a monitor
        # restart. It was loaded all the same, so only the others are looked up.
        if not known and not is_committed(self._storage, version, self.kind):
            newest = newest_committed(self._storage, self.kind)
            why = ("is not committed (nothing newer than it either)" if newest is None or version > newest else
                   "is not committed now (never was, or retention deleted it)")
            raise CheckpointConfigError(
                f"report_serving({version}): {self.kind.value} version {version} under {self._storage.url} {why}, "
                f"and this subscriber did not open it (the newest committed is {newest}), so no worker can serve it "
                "from here. Report the version you loaded: the one wait_for_version() returned and open() read")
        self._remember(version)
        with self._lock:
            if self._serving is None or self._serving[0] != version:
                self._serving = (version, time.time())
            serving = self._serving
        handle = self._monitor
        if handle is not None:
            try:
                ray.get(handle.report_serving.remote(self._info, *serving), timeout=_CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError) as e:
                self._detach(e)

    def close(self) -> None:
        """Stop renewing, release every lease still held, and tell the monitor (no longer live)."""
        self._stop.set()
        with self._lock:
            leases = list(self._leases)
        for lease_id in leases:
            self._release(lease_id)
        handle = self._monitor
        if handle is not None:
            handle.reader_closed.remote(self._info)  # after the releases: calls run in order

    def _holds(self, lease_id: str) -> bool:
        with self._lock:
            return lease_id in self._leases

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

