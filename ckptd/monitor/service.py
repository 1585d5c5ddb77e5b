"""Starting and finding the CheckpointMonitor actor of a run."""

from __future__ import annotations

import logging
from typing import Any

import ray

from ckptd import failpoints
from ckptd.config import MonitorOptions
from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.fencing import AttemptRecord, current_attempt, list_attempts, read_attempt
from ckptd.layout import LEDGER_DIR, check_template, record_template, scan_steps
from ckptd.monitor.actor import monitor_actor_class
from ckptd.monitor.attempts import open_attempt
from ckptd.monitor.start_checks import start_manifests, state_dicts_in_flight, withdrawals_cut_short
from ckptd.protocol import actor_name, monitor_actor, pending_attempts
from ckptd.shared_root import check_writable, remove_probe, where_am_i, write_probe
from ckptd.storage import Storage, explains_credentials
from ckptd.template import StepDirTemplate
from ckptd.units import check_name

log = logging.getLogger("ckptd.monitor")


@explains_credentials
def start_monitor(
    root: str,
    *,
    run: str = "default",
    namespace: str | None = None,
    storage_options: dict | None = None,
    mirror_storage_options: dict | None = None,
    runtime_env: dict | None = None,
    takeover: bool = False,
    **options: Any,
) -> Any:
    """Create the CheckpointMonitor actor of ``run``, or attach to it if it already exists.

    Creating a monitor opens a new attempt on the root (see :mod:`ckptd.monitor.attempts`): the
    records and uncommitted files older attempts left behind are discarded, and only this
    monitor may publish from now on. The actor restarts after a crash (``max_restarts=-1``),
    keeps its attempt and rebuilds its state from storage; calls to it are retried across
    restarts (``max_task_retries=-1``). It reserves no CPU.

    Args:
        root: Checkpoint root, a local path or fsspec URL. A relative path is made absolute
            here. One run per root.
        run: Names the monitor (actor ``ckptd-monitor-{run}``).
        namespace: Ray namespace of the actor; None for the job's namespace.
        storage_options: fsspec options for ``root`` (credentials, endpoint); never logged or
            shown in status.
        mirror_storage_options: fsspec options for the ``mirror`` URL, likewise.
        runtime_env: Ray runtime environment for the actor process (env vars, for instance).
        takeover: Another monitor (another run name or namespace) is live on this root: stop it
            and fence it out instead of refusing.
        **options: :class:`ckptd.config.MonitorOptions` fields, e.g. ``save_strategy``,
            ``step_timeout_s``, ``detached``, ``mirror="s3://bucket/run"``.

    Returns:
        The actor handle, to pass to :class:`ckptd.CheckpointCoordinator`.

    Raises:
        CheckpointConfigError: unknown or invalid options; a root or mirror that cannot be
            written or names its steps with another template; a mirror that overlaps the root;
            another live monitor on the root (without ``takeover``); an existing monitor of this
            run with another root or other options; a root the monitor's process does not see
            as this process does (``memory://``, or a local path on another node). Nothing is
            left under the root or the mirror in these cases.
        CorruptCheckpointError: a manifest the monitor's start-up reads is damaged (the newest
            of each kind, or a state dict's without its full checkpoint); nothing is written.
    """
    check_name(run, "run")
    opts = MonitorOptions.parse(options)
    # The namespace the actor really lives in (None means the caller's): recorded in the attempt, so
    # that a job in another namespace finds this monitor when it checks whether the root is in use.
    namespace = namespace if namespace is not None else ray.get_runtime_context().namespace
    storage = Storage(root, storage_options)
    root_url = root if "://" in root else storage.root
    template = StepDirTemplate(opts.step_dir_template)
    # Every check that can refuse runs before anything is written.
    check_template(storage, template)
    mirror = Storage(opts.mirror.url, mirror_storage_options) if opts.mirror is not None else None
    if mirror is not None:
        _check_mirror_overlap(storage, mirror)
        check_template(mirror, template)
    existing = _existing_actor(run, namespace)
    if existing is not None:
        return _attach(existing, storage, root_url, run, opts)
    # What the actor's start-up reads, and the files of the steps its trackers will name: damaged,
    # or changed outside ckptd? A state dict an older attempt was still saving into, or had begun
    # to withdraw, is its clean-up's.
    scanned = scan_steps(storage, template)
    attempts = pending_attempts(storage)
    start_manifests(storage, scanned, cleaned=state_dicts_in_flight(storage, scanned, attempts)
                    | withdrawals_cut_short(storage, scanned, attempts))
    live = _live_to_take_over(storage, takeover)  # refused here without takeover=True
    fresh = [s for s in (storage, mirror) if s is not None and not s.exists(s.join(LEDGER_DIR))]
    # The driver's shared-root probe is also the check that the root can be written at all.
    probe = write_probe(storage, f"the driver on {where_am_i()}")
    attempt: AttemptRecord | None = None
    handle = None
    try:
        if mirror is not None:
            check_writable(mirror, probe.writer)
        # Every check that can refuse before the attempt opens has passed: only now is the live
        # monitor stopped (refused later, the start is undone, but the new attempt fenced it).
        _take_over(storage, live)
        if mirror is not None:
            record_template(mirror, template)
        record_template(storage, template)
        failpoints.hit("before_open_attempt")
        attempt = open_attempt(storage, run, namespace)
        # A monitor that came alive since the check above wins: refused now, before its actor
        # starts, this call's attempt fences it for milliseconds, not for the seconds an actor
        # takes to be scheduled (two fence checks in a row would make that fence final).
        rival = _rival(storage, attempt, takeover)
        if rival is not None:
            raise _lost_race(storage, rival)
        failpoints.hit("before_monitor_actor")
        handle = _create_actor(root_url, run, namespace, storage_options, mirror_storage_options,
                               runtime_env, opts, attempt.attempt)
        result = ray.get(handle.check_shared_root.remote(probe.rel, probe.token, probe.writer))
    except BaseException:
        _undo(storage, handle, attempt, fresh)
        raise
    finally:
        remove_probe(storage, probe)
    if result["error"] is not None:
        _undo(storage, handle, attempt, fresh)
        raise CheckpointConfigError(result["error"])
    rival = _rival(storage, attempt, takeover)
    if rival is not None:
        _undo(storage, handle, attempt, [])
        raise _lost_race(storage, rival)
    return handle


def _rival(storage: Storage, attempt: AttemptRecord, takeover: bool) -> AttemptRecord | None:
    """Two start_monitor calls that raced past the live-monitor check: the newer attempt wins only
    if no older one came alive meanwhile. The attempt this call lost to, or None."""
    older = [n for n in list_attempts(storage) if n < attempt.attempt]
    previous = read_attempt(storage, older[-1]) if older else None
    newest = current_attempt(storage)
    if newest is not None and newest.attempt != attempt.attempt:
        return newest
    if previous is not None and not takeover and _live_monitor_of(previous) is not None:
        return previous
    return None


def _lost_race(storage: Storage, rival: AttemptRecord) -> CheckpointConfigError:
    """The error of a start_monitor that lost the race; the caller has taken back its attempt."""
    return CheckpointConfigError(
        f"another start_monitor opened attempt {rival.attempt} of {storage.url!r} (run {rival.run!r}) "
        "while this one was starting; one job per root. Attach to it with ckptd.get_monitor"
    )


def _undo(storage: Storage, handle: Any, attempt: AttemptRecord | None, fresh: list[Storage]) -> None:
    """Take back what a refused start_monitor wrote: its actor, its attempt, and the ``.ckptd``
    directory of a root or mirror that had none before, unless another start_monitor has
    opened an attempt in the root since (its ledger directory, and its mirror's, stay)."""
    if handle is not None:
        ray.kill(handle, no_restart=True)
    try:
        if attempt is not None:
            storage.rm(storage.join(LEDGER_DIR, "attempts", f"{attempt.attempt}.json"))
            storage.rm(storage.join(LEDGER_DIR, "attempts", f"{attempt.attempt}.started"))
        if fresh and list_attempts(storage):
            fresh = []
        for s in fresh:
            s.rm(s.join(LEDGER_DIR))
    except OSError as e:
        log.warning("could not remove what a refused start_monitor wrote: %s", e)


def _existing_actor(run: str, namespace: str | None) -> Any | None:
    try:
        return ray.get_actor(actor_name(run), namespace=namespace)
    except ValueError:
        return None


def _attach(handle: Any, storage: Storage, root_url: str, run: str, opts: MonitorOptions) -> Any:
    existing = ray.get(handle.worker_config.remote())
    wanted = opts.model_dump(mode="json")
    have = existing["options"]
    differ = [f"root: {existing['root']!r} there, {root_url!r} asked"] if existing["root"] != root_url else []
    differ += [f"{key}: {have.get(key)!r} there, {wanted.get(key)!r} asked"
               for key in sorted(have.keys() | wanted.keys()) if have.get(key) != wanted.get(key)]
    if differ:
        raise CheckpointConfigError(
            f"a CheckpointMonitor for run {run!r} already exists, and this call asks for something else: "
            f"{'; '.join(differ)}. Use ckptd.get_monitor(run={run!r}) to attach, or another run name"
        )
    return handle


def _live_monitor_of(rec: AttemptRecord) -> Any | None:
    """The actor of an attempt, if it is alive in this Ray cluster and still serves it."""
    try:
        handle = ray.get_actor(actor_name(rec.run), namespace=rec.namespace)
        info = ray.get(handle.ping.remote(), timeout=10)
    except Exception:
        return None
    return handle if info.get("attempt") == rec.attempt and info.get("root") == rec.root else None


def _live_to_take_over(storage: Storage, takeover: bool) -> tuple[AttemptRecord, Any] | None:
    """The live monitor of the root's newest attempt (its record and handle), to stop with
    :func:`_take_over`, or None if there is none.

    Raises:
        CheckpointConfigError: there is one, and ``takeover`` is False.
    """
    rec = current_attempt(storage)
    if rec is None:
        return None
    handle = _live_monitor_of(rec)
    if handle is None:
        return None
    if not takeover:
        raise CheckpointConfigError(
            f"checkpoint root {storage.url!r} is in use by the live monitor of run {rec.run!r} (namespace "
            f"{rec.namespace!r}, attempt {rec.attempt}, started on {rec.host}); two monitors on one root "
            f"would overwrite each other's trackers. Use ckptd.get_monitor({rec.run!r}, namespace="
            f"{rec.namespace!r}) to attach to it, another root, or start_monitor(..., takeover=True) to "
            "stop it and take the root over"
        )
    return rec, handle


def _take_over(storage: Storage, live: tuple[AttemptRecord, Any] | None) -> None:
    if live is not None:
        rec, handle = live
        log.warning("taking over %s from run %r (attempt %d)", storage.url, rec.run, rec.attempt)
        ray.kill(handle, no_restart=True)  # the new attempt fences it out even if this is too late


def _create_actor(root_url: str, run: str, namespace: str | None, storage_options: dict | None,
                  mirror_storage_options: dict | None, runtime_env: dict | None,
                  opts: MonitorOptions, attempt: int) -> Any:
    actor_options: dict[str, Any] = {
        "name": actor_name(run),
        "namespace": namespace,
        "max_restarts": -1,
        "max_task_retries": -1,
        "num_cpus": 0,
        "max_concurrency": 4096,
    }
    if opts.detached:
        actor_options["lifetime"] = "detached"
    if runtime_env:
        actor_options["runtime_env"] = runtime_env
    handle = monitor_actor_class().options(**actor_options).remote(
        root_url, run, storage_options, opts.model_dump(mode="json"), mirror_storage_options, attempt, namespace
    )
    ray.get(handle.ping.remote())  # surface constructor errors here
    return handle


def _check_mirror_overlap(local: Storage, mirror: Storage) -> None:
    """Refuse a mirror that is the root, lies inside it or holds it."""
    a, b = local.url.rstrip("/") + "/", mirror.url.rstrip("/") + "/"
    if a.startswith(b) or b.startswith(a):
        raise CheckpointConfigError(
            f"the mirror {mirror.url!r} overlaps the checkpoint root {local.url!r}; the mirror must be "
            "separate storage (for example s3://bucket/run for a local root)"
        )


def get_monitor(run: str = "default", namespace: str | None = None) -> Any:
    """Attach to the running CheckpointMonitor of ``run`` from any worker or driver: in
    ``namespace``, or with None in this job's namespace, or else the only namespace that has one
    (another driver's ``ray.init()`` without a namespace runs in an anonymous one).

    Raises:
        CheckpointConfigError: with ``namespace=None``, several other namespaces have one.
        CheckpointError: no monitor of that run exists.
    """
    check_name(run, "run")
    try:
        return monitor_actor(run, namespace)
    except ValueError:
        where = f"in namespace {namespace!r}" if namespace is not None else "in any Ray namespace of this cluster"
        raise CheckpointError(
            f"no CheckpointMonitor for run {run!r} {where}; start one with "
            f"ckptd.start_monitor(root, run={run!r}) first"
        ) from None
