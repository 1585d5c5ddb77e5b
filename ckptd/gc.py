"""Collecting what a root no longer needs: leftovers of saves that never committed, and (only
when asked) committed steps past a retention policy.

A live monitor cleans up after its own run; ``ckptd gc`` is for a root whose job is gone: a
crash, a preempted cluster, a run abandoned half-way. What counts as a leftover:

* a step directory with no manifest (a save that never committed, of this attempt or an older
  one), unless the root held it before ckptd first used it (another tool's checkpoint,
  :func:`ckptd.layout.foreign_dirs`): that one is kept, and listed as such;
* files in a step committed only as a state dict that its manifest does not list (the rest of a
  full checkpoint that never committed);
* temp files of atomic writes (``.ckptd-tmp-*``) anywhere under the root, the retention trash,
  shared-root probe files, and the ledger records of attempts older than the newest.

Each of these must also have been idle (nothing in it changed) for ``min_idle_s``: a save that
is still running keeps touching its files. Committed steps are deleted only under an explicit
:class:`~ckptd.monitor.retention.RetentionPolicy`, with the same rules as the monitor's
retention; tracker targets and steps pinned by a read lease are never deleted, nor, when the
run's mirror is given, steps the mirror does not hold yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptd.commit import TMP_PREFIX
from ckptd.config import Kind
from ckptd.fencing import list_attempts
from ckptd.layout import StepEntry, foreign_dirs, kinds_in, listed_files, read_template, read_tracker, scan_steps
from ckptd.manifest import is_internal
from ckptd.monitor.retention import TRASH, RetentionPolicy, delete_step, plan_retention
from ckptd.protocol import attempt_pending_dir, pending_attempts
from ckptd.retire import refuse_live
from ckptd.shared_root import PROBE_DIR
from ckptd.storage import FileStat, Storage, explains_credentials
from ckptd.template import StepDirTemplate

DEFAULT_MIN_IDLE_S = 600.0


@dataclass(frozen=True)
class Garbage:
    """One thing to remove: a path relative to the root, why, and its size."""

    path: str
    reason: str
    bytes: int
    step: int | None = None
    committed: bool = False


@dataclass
class GcPlan:
    root: str
    items: list[Garbage] = field(default_factory=list)
    kept_busy: list[str] = field(default_factory=list)  # leftovers not idle long enough yet
    not_ours: list[str] = field(default_factory=list)  # another tool's step directories: kept

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.items)


@explains_credentials
def plan_gc(root: str, *, policy: RetentionPolicy | None = None, min_idle_s: float = DEFAULT_MIN_IDLE_S,
            mirror: str | None = None, storage_options: dict | None = None,
            mirror_storage_options: dict | None = None, now: float | None = None) -> GcPlan:
    """What :func:`run_gc` would remove from ``root`` (nothing is changed).

    Args:
        root: The checkpoint root.
        policy: Delete committed steps past this policy too; None deletes no committed step.
        min_idle_s: A leftover is removed only once nothing in it changed for this long.
        mirror: The run's mirror: committed steps it does not hold are kept.
        now: The time idleness is measured against (default: now).
    """
    storage = Storage(root, storage_options)
    storage.require_root()
    now = time.time() if now is None else now
    plan = GcPlan(storage.url)
    template = read_template(storage)
    entries = scan_steps(storage, template)
    foreign = foreign_dirs(storage)

    def theirs(name: str) -> bool:  # without a manifest: was it there before ckptd (or is ckptd not here)?
        return foreign is None or name in foreign

    _hidden_duplicates(plan, storage, template, entries, now, min_idle_s, theirs)
    for step, entry in sorted(entries.items()):
        if not entry.committed and theirs(entry.name):
            plan.not_ours.append(entry.name)
            continue
        files = storage.walk_files(storage.join(entry.name))
        if not entry.committed:
            _add_if_idle(plan, storage, entry.name, files, now, min_idle_s,
                         Garbage(entry.name, "no manifest: a save that never committed", _size(files), step))
        elif Kind.CHECKPOINT not in entry.kinds:
            listed = listed_files(storage, entry)
            for rel, st in files.items():
                if rel not in listed and not is_internal(rel):
                    _add_if_idle(plan, storage, f"{entry.name}/{rel}", {rel: st}, now, min_idle_s,
                                 Garbage(f"{entry.name}/{rel}", "not in the state dict's manifest: the rest of a "
                                         "checkpoint that never committed", st.size, step))
        for rel, st in files.items() if entry.committed else ():
            if rel.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
                _add_if_idle(plan, storage, f"{entry.name}/{rel}", {rel: st}, now, min_idle_s,
                             Garbage(f"{entry.name}/{rel}", "temp file of a write that never finished", st.size, step))
    _internal_leftovers(plan, storage, now, min_idle_s)
    if policy is not None:
        _past_policy(plan, storage, entries, policy, mirror, mirror_storage_options)
    return plan


@explains_credentials
def run_gc(plan: GcPlan, *, storage_options: dict | None = None,
           progress: Callable[[Garbage], None] | None = None, check_live: bool = True) -> list[Garbage]:
    """Remove what ``plan`` lists. Committed steps go the way retention deletes them (never
    half-readable); the rest is removed directly. Returns what was removed; raises on the first
    failure (what was removed before it stays removed, and a second run picks up the rest).

    ``check_live=False`` skips the check below, for a caller that asked the right cluster itself.
    A live job this process cannot see (on another cluster) is never harmed either way: what it
    commits after the plan was made is kept, and a file removed from a save in flight fails its
    step instead of committing it.

    Raises:
        CheckpointConfigError: the monitor of the root's newest attempt is live in this process's
            Ray cluster (its saves in flight look like leftovers): nothing is removed.
    """
    storage = Storage(plan.root, storage_options)
    if check_live:
        refuse_live(storage, "collecting garbage")
    removed = []
    for item in plan.items:
        if item.committed:
            if item.step in _pinned(storage):
                continue  # a tracker or a reader's lease came to it since the plan was made: keep it
            leftover = delete_step(storage, StepEntry(item.step, item.path, kinds_in(storage, item.path)))
            if leftover is not None:
                raise OSError(leftover)  # the step is gone; a second run empties the trash
        else:
            if item.step is not None and _committed_since(storage, item.path):
                continue  # committed since the plan was made (a job came back): keep it
            storage.rm(storage.join(item.path))
        removed.append(item)
        if progress is not None:
            progress(item)
    return removed


def _committed_since(storage: Storage, path: str) -> bool:
    """Whether a leftover of a step (its directory, or a file in it) is committed now: the
    directory has a manifest, or the file is listed by one (the step's full checkpoint committed
    after the plan listed the file as the rest of a checkpoint that never committed)."""
    name, _, rel = path.partition("/")
    kinds = kinds_in(storage, name)
    if not rel or not kinds:
        return bool(kinds)
    return rel in listed_files(storage, StepEntry(0, name, kinds))


def _size(files: dict[str, FileStat]) -> int:
    return sum(st.size for st in files.values())


def _add_if_idle(plan: GcPlan, storage: Storage, rel: str, files: dict[str, FileStat], now: float,
                 min_idle_s: float, item: Garbage) -> None:
    times = [st.mtime_ns or 0 for st in files.values()]
    try:
        times.append(storage.stat(storage.join(rel)).mtime_ns or 0)  # an empty directory has its own time
    except OSError:
        pass
    if now - max(times, default=0) / 1e9 >= min_idle_s:
        plan.items.append(item)
    else:
        plan.kept_busy.append(rel)


def _internal_leftovers(plan: GcPlan, storage: Storage, now: float, min_idle_s: float) -> None:
    for rel, reason in ((TRASH, "retention trash a killed pass left"),
                        (PROBE_DIR, "shared-root probe files")):
        files = storage.walk_files(storage.join(rel))
        if files:
            _add_if_idle(plan, storage, rel, files, now, min_idle_s, Garbage(rel, reason, _size(files)))
    attempts = list_attempts(storage)
    for attempt in pending_attempts(storage):
        if attempts and attempt < attempts[-1]:
            d = attempt_pending_dir(storage, attempt)
            files = storage.walk_files(d)
            rel = d[len(storage.root):].lstrip("/")
            plan.items.append(Garbage(rel, f"ledger records of attempt {attempt} (superseded by {attempts[-1]})",
                                      _size(files)))
    for name in storage.listdir(storage.root):
        if name.startswith(TMP_PREFIX):
            st = storage.stat(storage.join(name))
            _add_if_idle(plan, storage, name, {name: st}, now, min_idle_s,
                         Garbage(name, "temp file of a write that never finished", st.size))


def _hidden_duplicates(plan: GcPlan, storage: Storage, template: StepDirTemplate, entries: dict[int, StepEntry],
                       now: float, min_idle_s: float, theirs: Callable[[str], bool]) -> None:
    """Uncommitted directories of a step that another directory holds (an epoch template, with a
    crashed attempt left under another epoch): scan_steps shows one directory per step, so these
    would never be collected."""
    shown = {e.name for e in entries.values()}
    for name in storage.listdir(storage.root):
        step = template.parse(name)
        if step is None or name in shown or kinds_in(storage, name):
            continue  # not a step directory, the one shown, or a second committed one (not ours to pick)
        if theirs(name):
            plan.not_ours.append(name)
            continue
        files = storage.walk_files(storage.join(name))
        _add_if_idle(plan, storage, name, files, now, min_idle_s,
                     Garbage(name, f"no manifest: a save that never committed (step {step} has another "
                                   f"directory, {entries[step].name})", _size(files), step))


def _pinned(storage: Storage) -> set[int]:
    """Committed steps no policy may delete: the trackers' targets and the steps of recorded leases."""
    from ckptd.monitor.publication import leased_steps

    return {s for k in Kind if (s := read_tracker(storage, k)) is not None} | leased_steps(storage)


def _past_policy(plan: GcPlan, storage: Storage, entries: dict[int, StepEntry], policy: RetentionPolicy,
                 mirror: str | None, mirror_storage_options: dict | None) -> None:
    protected = _pinned(storage)
    if mirror is not None:
        held = {s for s, e in scan_steps(Storage(mirror, mirror_storage_options)).items() if e.committed}
        protected |= {s for s, e in entries.items() if e.committed and s not in held}
    for entry in plan_retention(entries, policy, protected=protected, failed=set()).delete:
        files = storage.walk_files(storage.join(entry.name))
        kinds = ", ".join(sorted(k.value for k in entry.kinds))
        plan.items.append(Garbage(entry.name, f"committed ({kinds}), past the retention policy", _size(files),
                                  entry.step, committed=True))


