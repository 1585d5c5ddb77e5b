"""Retention: which step directories to delete after a commit. Plain Python; the I/O is separate.

Everything is decided from what storage holds now (a scan of the root) plus what the monitor
knows is in flight, so retention works the same after a restart: there are no in-memory lists
of saved steps to lose.

Rules:
* Only committed steps older than the newest commit are deleted; the tracker targets and steps
  still being saved (protected) never are.
* A committed step is kept if it is one of the newest ``max_ckpt_to_keep`` full checkpoints, one
  of the newest ``max_state_dict_to_keep`` committed steps (a full checkpoint counts as a state
  dict: readers of the latest weights may be loading it), or a multiple of ``keep_every_n_steps``.
* A directory with no manifest that is older than the newest commit and not in flight is a
  leftover of a failed or crashed save: deleted at once if the monitor knows the step failed,
  else once nothing in it has changed for a grace period (a save the monitor has not heard of,
  after a restart, may still be writing it). Not one the root held before ckptd first used it,
  though (:func:`ckptd.layout.foreign_dirs`: another tool's checkpoint, a run switched to ckptd
  half-way), even if a save of ckptd's failed in it: those are never deleted.
* A step is claimed on the monitor's event loop right before its deletion: one that is in flight
  by then (a save of an older step that began after the pass read what is in flight, and may
  have committed its state dict before the scan) is kept, and a unit or registration of a
  claimed step waits until the deletion is over.
* Only the newest attempt of the root deletes anything (``check_fence`` before the scan and
  before each deletion): a monitor of an older job plans from its own view of the root, and
  would delete steps the newer job keeps (a step whose full checkpoint it is still saving).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptd import failpoints
from ckptd.config import Kind, MonitorOptions
from ckptd.fencing import FencedError
from ckptd.layout import MANIFESTS, StepEntry
from ckptd.storage import Storage

log = logging.getLogger("ckptd.retention")


@dataclass(frozen=True)
class RetentionPolicy:
    max_ckpt_to_keep: int | None = None
    max_state_dict_to_keep: int | None = 2
    keep_every_n_steps: int | None = None

    @classmethod
    def of(cls, opts: MonitorOptions) -> RetentionPolicy:
        return cls(opts.max_ckpt_to_keep, opts.max_state_dict_to_keep, opts.keep_every_n_steps)


@dataclass
class RetentionPlan:
    delete: list[StepEntry] = field(default_factory=list)  # committed, past the policy
    leftovers_failed: list[StepEntry] = field(default_factory=list)  # uncommitted, step failed
    leftovers_idle: list[StepEntry] = field(default_factory=list)  # uncommitted, delete if unchanged
    not_ours: list[StepEntry] = field(default_factory=list)  # uncommitted, another tool's: kept
    # The committed steps counted among the newest max_state_dict_to_keep: the deletions hold
    # only while each of them stays committed.
    counted_newest: set[int] = field(default_factory=set)
    # Likewise the checkpoints counted among the newest max_ckpt_to_keep.
    counted_checkpoints: set[int] = field(default_factory=set)


def _newest(steps: list[int], n: int | None) -> set[int]:
    return set(steps) if n is None else set(steps[-n:])


def plan_retention(
    entries: dict[int, StepEntry], policy: RetentionPolicy, *, protected: set[int], failed: set[int],
    withdrawing: set[int] = frozenset(), settling: set[int] = frozenset(), foreign: set[str] = frozenset(),
) -> RetentionPlan:
    """Decide what to delete.

    Args:
        entries: The step directories under the root (:func:`ckptd.layout.scan_steps`).
        policy: The limits.
        protected: Steps never to delete: tracker targets and steps in flight.
        failed: Steps whose leftovers go at once: the monitor knows that no kind of theirs can
            commit any more (and none is in flight).
        withdrawing: Steps whose state dict is being withdrawn: kept, but not counted among the
            newest ``max_state_dict_to_keep`` (an older state dict that stays must not go).
        settling: Steps with a commit in flight, whose manifest may be visible and still be taken
            back (an uncertain publish): kept, and counted neither as a checkpoint nor as a state
            dict, for the same reason.
        foreign: The names of the step directories another tool wrote (:func:`ckptd.layout.foreign_dirs`):
            uncommitted, they are not ckptd's to delete, failed or not.
    """
    plan = RetentionPlan()
    committed = sorted(s for s, e in entries.items() if e.committed)
    if not committed:
        return plan
    newest = committed[-1]
    checkpoints = [s for s in committed if Kind.CHECKPOINT in entries[s].kinds and s not in settling]
    plan.counted_checkpoints = _newest(checkpoints, policy.max_ckpt_to_keep)
    keep = set(protected) | plan.counted_checkpoints
    counted = [s for s in committed
               if s not in settling and (s not in withdrawing or Kind.CHECKPOINT in entries[s].kinds)]
    plan.counted_newest = _newest(counted, policy.max_state_dict_to_keep)
    keep |= plan.counted_newest | ((set(withdrawing) | set(settling)) & set(committed))
    if policy.keep_every_n_steps:
        keep |= {s for s in committed if s % policy.keep_every_n_steps == 0}
    for step in sorted(entries):
        if step >= newest or step in keep:
            continue
        entry = entries[step]
        if entry.committed:
            plan.delete.append(entry)
        elif entry.name in foreign:
            plan.not_ours.append(entry)
        elif step in failed:
            plan.leftovers_failed.append(entry)
        else:
            plan.leftovers_idle.append(entry)
    return plan


TRASH = ".ckptd/trash"


class StepKept(Exception):
    """The last look before a deletion found that the step must stay (see :func:`delete_step`)."""


def delete_step(storage: Storage, entry: StepEntry, fence: Callable[[], None] | None = None,
                confirm: Callable[[StepEntry], bool] | None = None) -> str | None:
    """Delete a step directory. Raises if the step is still in place (:class:`StepKept` if
    ``confirm(entry)``, the last look, says it must stay); returns what went wrong after it left
    the root (it stays in the trash, emptied again at the next pass), else None.

    POSIX: the directory is first renamed into ``.ckptd/trash`` (one atomic step: readers, and a
    monitor killed part-way, see the step whole or not at all), then removed. Elsewhere: manifests
    first, so a half-deleted step reads as uncommitted.
    """
    failpoints.hit("before_step_delete")
    if fence is not None:  # at the last moment, as a publish does: a stall before here is covered
        fence()
    if confirm is not None and not confirm(entry):
        raise StepKept(entry.name)
    path = storage.join(entry.name)
    if storage.is_posix:
        trash = storage.join(TRASH)
        os.makedirs(trash, exist_ok=True)
        target = f"{trash}/{entry.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, target)
        try:
            remove_tree(storage, target)
        except OSError as e:  # deleted for readers already: only the trash is left to empty
            return f"{entry.name} was deleted, but emptying it from {TRASH} failed: {e}"
        return None
    for kind in (Kind.CHECKPOINT, Kind.STATE_DICT):
        if kind in entry.kinds:
            storage.rm(f"{path}/{MANIFESTS[kind]}")
    storage.rm(path)
    return None


def empty_trash(storage: Storage) -> None:
    """Remove what a killed retention pass left in the trash (best effort)."""
    if storage.is_posix:
        remove_tree(storage, storage.join(TRASH))


_RM = shutil.which("rm")
_NICE = shutil.which("nice")


def remove_tree(storage: Storage, path: str) -> None:
    """Remove a local directory tree that nothing reads any more (the trash), in a niced ``rm``
    process where there is one: a step of 40,000 files takes seconds of shutil.rmtree, which
    would hold the monitor's GIL while commits wait for it."""
    if _RM is None:
        storage.rm(path)
        return
    cmd = ([_NICE, "-n", "10"] if _NICE else []) + [_RM, "-rf", "--", path]
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise OSError(f"rm -rf {path} failed (exit {done.returncode}): {done.stderr.decode(errors='replace')[-500:]}")


def is_idle(storage: Storage, entry: StepEntry, grace_s: float, now: float | None = None) -> bool:
    """Nothing in the directory changed for ``grace_s`` seconds."""
    now = time.time() if now is None else now
    path = storage.join(entry.name)
    times = [st.mtime_ns or 0 for st in storage.walk_files(path).values()]
    try:
        # The directory's own time too: a save that has just created it has no file in it yet.
        times.append(storage.stat(path).mtime_ns or 0)
    except OSError:
        pass
    return now - max(times, default=0) / 1e9 >= grace_s


@dataclass
class PassResult:
    deleted: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def run_plan(storage: Storage, plan: RetentionPlan, grace_s: float,
             before_delete: Callable[[StepEntry], None] | None = None,
             claim: Callable[[StepEntry], bool] | None = None, unclaim: Callable[[StepEntry], None] | None = None,
             fence: Callable[[], None] | None = None,
             confirm: Callable[[StepEntry], bool] | None = None) -> PassResult:
    """Carry out a plan. A deletion that fails is logged and left for the next pass (which sees
    the step again in storage); it never stops the deletions after it. ``before_delete`` runs
    before each committed step is deleted. ``claim(entry)`` is asked first for each step: False
    keeps it (in flight now, or a reader holds it); ``confirm(entry)`` is asked again right
    before the deletion, after ``before_delete`` (False keeps it); ``unclaim(entry)`` follows a
    claimed deletion, done or not. ``fence()`` runs right before each deletion: the FencedError
    it raises ends the pass."""
    result = PassResult()
    todo = plan.delete + plan.leftovers_failed
    for entry in plan.leftovers_idle:
        try:
            if is_idle(storage, entry, grace_s):
                todo.append(entry)
        except OSError as e:
            log.warning("could not inspect leftover %s: %s", entry.name, e)
    for entry in sorted(todo, key=lambda e: e.step):
        if claim is not None and not claim(entry):
            continue  # in flight or pinned since the plan was made: the next pass sees it again
        try:
            failpoints.hit("after_delete_claim")
            if fence is not None:
                fence()
            if before_delete is not None and entry.committed:
                before_delete(entry)
            leftover = delete_step(storage, entry, fence, confirm)
            result.deleted.append(entry.step)
            if leftover is not None:
                log.warning("%s; retrying at the next pass", leftover)
                result.errors.append(leftover)
        except FencedError:
            raise
        except StepKept:
            pass  # needed since the claim: the next pass sees it again
        except Exception as e:  # best-effort clean-up: retried on the next pass
            msg = f"could not delete {entry.name}: {type(e).__name__}: {e}"
            log.warning("%s; retrying after the next commit", msg)
            result.errors.append(msg)
        finally:
            if claim is not None and unclaim is not None:
                unclaim(entry)
    return result
