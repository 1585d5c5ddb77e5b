"""Starting and finding the CheckpointMonitor actor of a run."""

from __future__ import annotations

from typing import Any

import ray

from ckptd.config import MonitorOptions
from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.layout import record_template
from ckptd.monitor.actor import monitor_actor_class
from ckptd.monitor.shared_root import check_writable, remove_probe, where_am_i, write_probe
from ckptd.storage import Storage
from ckptd.units import StepDirTemplate, check_name


def actor_name(run: str) -> str:
    return f"ckptd-monitor-{run}"


def start_monitor(
    root: str,
    *,
    run: str = "default",
    namespace: str | None = None,
    storage_options: dict | None = None,
    mirror_storage_options: dict | None = None,
    runtime_env: dict | None = None,
    **options: Any,
) -> Any:
    """Create the CheckpointMonitor actor of ``run``, or attach to it if it already exists.

    The actor restarts after a crash (``max_restarts=-1``) and rebuilds its state from storage;
    calls to it are retried across restarts (``max_task_retries=-1``). It reserves no CPU.

    Args:
        root: Checkpoint root, a local path or fsspec URL. A relative path is made absolute
            here. One run per root.
        run: Names the monitor (actor ``ckptd-monitor-{run}``).
        namespace: Ray namespace of the actor; None for the job's namespace.
        storage_options: fsspec options for ``root`` (credentials, endpoint); never logged or
            shown in status.
        mirror_storage_options: fsspec options for the ``mirror`` URL, likewise.
        runtime_env: Ray runtime environment for the actor process (env vars, for instance).
        **options: :class:`ckptd.config.MonitorOptions` fields, e.g. ``save_strategy``,
            ``step_timeout_s``, ``detached``, ``mirror="s3://bucket/run"``.

    Returns:
        The actor handle, to pass to :class:`ckptd.CheckpointCoordinator`.

    Raises:
        CheckpointConfigError: unknown or invalid options, a root that cannot be written, a
            root the monitor's process does not see as this process does (``memory://``, or a
            local path on another node), or an existing monitor of this run with another root or
            other options. Nothing is written in these cases except the removed probe files.
    """
    check_name(run, "run")
    opts = MonitorOptions.parse(options)
    storage = Storage(root, storage_options)
    # The driver's shared-root probe is also the check that the root can be written at all.
    probe = write_probe(storage, f"the driver on {where_am_i()}")
    try:
        template = StepDirTemplate(opts.step_dir_template)
        if opts.mirror is not None:
            _check_mirror(storage, Storage(opts.mirror.url, mirror_storage_options), template, probe.writer)
        record_template(storage, template)
        handle, created = _create_actor(storage, root, run, namespace, storage_options, mirror_storage_options,
                                        runtime_env, opts)
        result = ray.get(handle.check_shared_root.remote(probe.rel, probe.token, probe.writer))
    finally:
        remove_probe(storage, probe)
    if result["error"] is not None:
        if created:
            ray.kill(handle, no_restart=True)
        raise CheckpointConfigError(result["error"])
    return handle


def _create_actor(storage: Storage, root: str, run: str, namespace: str | None, storage_options: dict | None,
                  mirror_storage_options: dict | None, runtime_env: dict | None,
                  opts: MonitorOptions) -> tuple[Any, bool]:
    """The monitor actor of ``run`` (new, or the existing one if its root and options are the
    same), and whether this call created it."""
    root_url = root if "://" in root else storage.root
    actor_options: dict[str, Any] = {
        "name": actor_name(run),
        "namespace": namespace,
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": -1,
        "num_cpus": 0,
        "max_concurrency": 4096,
    }
    if opts.detached:
        actor_options["lifetime"] = "detached"
    if runtime_env:
        actor_options["runtime_env"] = runtime_env
    try:
        ray.get_actor(actor_name(run), namespace=namespace)
        created = False
    except ValueError:
        created = True
    handle = monitor_actor_class().options(**actor_options).remote(
        root_url, run, storage_options, opts.model_dump(mode="json"), mirror_storage_options
    )
    existing = ray.get(handle.worker_config.remote())
    wanted = opts.model_dump(mode="json")
    if existing["root"] != root_url or existing["options"] != wanted:
        raise CheckpointConfigError(
            f"a CheckpointMonitor for run {run!r} already exists with root {existing['root']!r} "
            f"and options {existing['options']}; this call asked for root {root_url!r} and "
            f"options {wanted}. Use ckptd.get_monitor(run={run!r}) to attach, or another run name"
        )
    return handle, created


def _check_mirror(local: Storage, mirror: Storage, template: StepDirTemplate, writer: str) -> None:
    """Refuse a mirror that is the root, lies inside it or holds it, or cannot be written."""
    a, b = local.url.rstrip("/") + "/", mirror.url.rstrip("/") + "/"
    if a.startswith(b) or b.startswith(a):
        raise CheckpointConfigError(
            f"the mirror {mirror.url!r} overlaps the checkpoint root {local.url!r}; the mirror must be "
            "separate storage (for example s3://bucket/run for a local root)"
        )
    check_writable(mirror, writer)
    record_template(mirror, template)  # raises if the mirror already names its steps otherwise


def get_monitor(run: str = "default", namespace: str | None = None) -> Any:
    """Attach to the running CheckpointMonitor of ``run`` from any worker or driver.

    Raises:
        CheckpointError: no monitor of that run exists.
    """
    check_name(run, "run")
    try:
        return ray.get_actor(actor_name(run), namespace=namespace)
    except ValueError:
        raise CheckpointError(
            f"no CheckpointMonitor for run {run!r} in namespace {namespace!r}; start one with "
            f"ckptd.start_monitor(root, run={run!r}) first"
        ) from None
