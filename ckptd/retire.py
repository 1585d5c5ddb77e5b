"""Retiring steps: the explicit way for a job that resumes from an older step to save the newer
step numbers again.

Committed steps are immutable, and trackers only move forward, so a job that resumes from step
15 while step 20 is committed could never save 16..20, and ``latest`` would keep naming the old
timeline's 20. :func:`retire_steps` removes the newer steps and points the trackers back at what
is left, on the root and (if given) on its mirror. Run it before starting the new job's monitor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError
from ckptd.layout import (
    LEDGER_DIR,
    MANIFESTS,
    TRACKERS,
    StepEntry,
    foreign_dirs,
    read_template,
    read_tracker,
    scan_steps,
)
from ckptd.storage import Storage, explains_credentials
from ckptd.units import check_step

log = logging.getLogger("ckptd.retire")


@explains_credentials
def retire_steps(root: str, after: int, *, storage_options: dict | None = None, mirror: str | None = None,
                 mirror_storage_options: dict | None = None) -> list[int]:
    """Remove every step newer than ``after`` and point the trackers at the newest step left.

    Order keeps readers safe at every moment: manifests go first, newest step first (a step
    without a manifest is not committed, and what stays committed is always a prefix), then the
    trackers are rewritten, then the directories are removed. A crash part-way leaves a root that
    a restarted monitor or a second call repairs.

    Args:
        root: The checkpoint root.
        after: Keep steps up to and including this one.
        storage_options: fsspec options for ``root``.
        mirror: The mirror URL, if the run has one: retired there too, or ``resume`` would pick
            the mirror's newer step.
        mirror_storage_options: fsspec options for ``mirror``.

    Returns:
        The retired committed steps of the root, oldest first.

    Raises:
        CheckpointConfigError: a bad step, or a live monitor owns the root (stop it first).
    """
    after = check_step(after, "after")
    storage = Storage(root, storage_options)
    require_ckptd_root(storage)
    refuse_live(storage, "retiring steps")
    retired = _retire(storage, after)
    if mirror is not None:
        _retire(Storage(mirror, mirror_storage_options), after)
    return retired


def refuse_live(storage: Storage, doing: str) -> None:
    """Raise CheckpointConfigError if the monitor of the root's newest attempt is live in this Ray
    cluster (nothing to check when Ray is not initialised)."""
    import ray

    if not ray.is_initialized():
        return
    from ckptd.fencing import current_attempt
    from ckptd.monitor.service import _live_monitor_of

    rec = current_attempt(storage)
    if rec is not None and _live_monitor_of(rec) is not None:
        raise CheckpointConfigError(
            f"the monitor of run {rec.run!r} (attempt {rec.attempt}) is live on {storage.url}; stop it "
            f"(ray.kill) before {doing}, then start the new job's monitor"
        )


def require_ckptd_root(storage: Storage) -> None:
    """Raise :class:`CheckpointConfigError` unless ckptd has saved into the root (it has a ledger)."""
    storage.require_root()
    if not storage.exists(storage.join(LEDGER_DIR)):
        raise CheckpointConfigError(
            f"nothing under {storage.url} was saved by ckptd (it has no {LEDGER_DIR} directory): ckptd only "
            "retires the steps it saved. Check the path")


def steps_to_retire(root: str, after: int, *, storage_options: dict | None = None) -> list[int]:
    """The step directories :func:`retire_steps` would remove, oldest first (nothing is changed).

    Raises:
        CheckpointConfigError: as :func:`retire_steps` (but a live monitor is not looked for).
    """
    after = check_step(after, "after")
    storage = Storage(root, storage_options)
    require_ckptd_root(storage)
    return sorted(_plan(storage, after)[2])


def _plan(storage: Storage, after: int) -> tuple[dict[int, StepEntry], Callable[[int], bool], list[int]]:
    """The root's steps, which of them are ckptd's, and the steps newer than ``after`` to retire."""
    template = read_template(storage)
    entries = scan_steps(storage, template)
    foreign = foreign_dirs(storage) or set()

    def ours(step: int) -> bool:
        """Not another tool's step directory (:func:`ckptd.layout.foreign_dirs`), which stays (with
        a tracker that names it)."""
        return bool(entries[step].kinds) or entries[step].name not in foreign

    return entries, ours, sorted((s for s in entries if s > after and ours(s)), reverse=True)


def _retire(storage: Storage, after: int) -> list[int]:
    entries, ours, newer = _plan(storage, after)
    for step in newer:
        path = storage.join(entries[step].name)
        for kind in (Kind.CHECKPOINT, Kind.STATE_DICT):
            storage.rm(f"{path}/{MANIFESTS[kind]}")
    for kind in Kind:
        kept = [s for s, e in entries.items() if s <= after and (Kind.CHECKPOINT in e.kinds or kind in e.kinds)]
        tracker = storage.join(TRACKERS[kind])
        named = read_tracker(storage, kind)
        if named is not None and named in entries and not ours(named):
            continue  # another tool's tracker, naming its own step
        if kept:
            storage.write_atomic(tracker, f"{max(kept)}\n".encode())
        else:
            storage.rm(tracker)
    for step in newer:
        storage.rm(storage.join(entries[step].name))
    retired = sorted(s for s in newer if entries[s].committed)
    if newer:
        log.warning("retired steps %s under %s", sorted(newer), storage.url)
    return retired
