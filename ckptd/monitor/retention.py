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
  after a restart, may still be writing it).
* A step is claimed on the monitor's event loop right before its deletion: one that is in flight
  by then (a save of an older step that began after the pass read what is in flight, and may
  have committed its state dict before the scan) is kept, and a unit or registration of a
  claimed step waits until the deletion is over.
* Only the newest attempt of the root deletes anything (``check_fence`` before the scan and
  before each deletion): a monitor of an older job plans from its own view of the root, and
  would delete steps the newer job keeps (a step whose full checkpoint it is still saving).
"""

from __future__ import annotations

import asyncio
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
from ckptd.layout import MANIFESTS, StepEntry, scan_steps
from ckptd.metrics import RETENTION_DELETIONS, RunMetrics
from ckptd.monitor.claims import DeletionClaims
from ckptd.monitor.records import StepState
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
    # The committed steps counted among the newest max_state_dict_to_keep: the deletions hold
    # only while each of them stays committed.
    counted_newest: set[int] = field(default_factory=set)


def _newest(steps: list[int], n: int | None) -> set[int]:
    return set(steps) if n is None else set(steps[-n:])


def plan_retention(
    entries: dict[int, StepEntry], policy: RetentionPolicy, *, protected: set[int], failed: set[int],
    withdrawing: set[int] = frozenset(),
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
    """
    plan = RetentionPlan()
    committed = sorted(s for s, e in entries.items() if e.committed)
    if not committed:
        return plan
    newest = committed[-1]
    checkpoints = [s for s in committed if Kind.CHECKPOINT in entries[s].kinds]
    keep = set(protected) | _newest(checkpoints, policy.max_ckpt_to_keep)
    counted = [s for s in committed if s not in withdrawing or Kind.CHECKPOINT in entries[s].kinds]
    plan.counted_newest = _newest(counted, policy.max_state_dict_to_keep)
    keep |= plan.counted_newest | (set(withdrawing) & set(committed))
    if policy.keep_every_n_steps:
        keep |= {s for s in committed if s % policy.keep_every_n_steps == 0}
    for step in sorted(entries):
        if step >= newest or step in keep:
            continue
        entry = entries[step]
        if entry.committed:
            plan.delete.append(entry)
        elif step in failed:
            plan.leftovers_failed.append(entry)
        else:
            plan.leftovers_idle.append(entry)
    return plan


TRASH = ".ckptd/trash"


def delete_step(storage: Storage, entry: StepEntry, fence: Callable[[], None] | None = None) -> str | None:
    """Delete a step directory. Raises if the step is still in place; returns what went wrong
    after it left the root (it stays in the trash, emptied again at the next pass), else None.

    POSIX: the directory is first renamed into ``.ckptd/trash`` (one atomic step: readers, and a
    monitor killed part-way, see the step whole or not at all), then removed. Elsewhere: manifests
    first, so a half-deleted step reads as uncommitted.
    """
    failpoints.hit("before_step_delete")
    if fence is not None:  # at the last moment, as a publish does: a stall before here is covered
        fence()
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
             fence: Callable[[], None] | None = None) -> PassResult:
    """Carry out a plan. A deletion that fails is logged and left for the next pass (which sees
    the step again in storage); it never stops the deletions after it. ``before_delete`` runs
    before each committed step is deleted. ``claim(entry)`` is asked first for each step: False
    keeps it (in flight now, or a reader holds it); ``unclaim(entry)`` follows a claimed
    deletion, done or not. ``fence()`` runs right before each deletion: the FencedError it
    raises ends the pass."""
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
            leftover = delete_step(storage, entry, fence)
            result.deleted.append(entry.step)
            if leftover is not None:
                log.warning("%s; retrying at the next pass", leftover)
                result.errors.append(leftover)
        except FencedError:
            raise
        except Exception as e:  # best-effort clean-up: retried on the next pass
            msg = f"could not delete {entry.name}: {type(e).__name__}: {e}"
            log.warning("%s; retrying after the next commit", msg)
            result.errors.append(msg)
        finally:
            if claim is not None and unclaim is not None:
                unclaim(entry)
    return result


_HISTORY = 1000  # deleted steps reported by status()


class RetentionRunner:
    """Runs retention passes on the monitor's event loop, one at a time, after each commit.

    What is protected (tracker targets, steps in flight, steps not yet mirrored) is read on the
    event loop before the scan, and again for each step right before it is deleted: a save of
    an older step can begin in between, and commit its state dict before the scan sees it. The
    second look claims the step (:attr:`claims`) until its deletion is over; the monitor's
    admissions and registrations of a claimed step wait for that.

    Args:
        protected: Returns the steps never to delete now.
        cleanup: Removes the ledger records of a deleted step.
        mark_deleted: Records that a step with a failed kind was deleted, with its committed kinds.
        fence: Called on the event loop with the steps a pass may delete as failed leftovers,
            before the pass: it must make sure no unit of theirs can be admitted any more.
        metrics: Where deletions are counted.
        check_fence: Raises FencedError once a newer attempt owns the root; called before a
            pass scans and before each deletion. A fenced runner runs no pass any more
            (``fenced`` says why).
    """

    def __init__(self, storage: Storage, template, opts: MonitorOptions, ledger, spawn, in_thread,
                 protected, cleanup, mark_deleted, readers=None, metrics: RunMetrics | None = None,
                 fence: Callable[[set[int]], None] | None = None,
                 check_fence: Callable[[], None] | None = None) -> None:
        self._fence = fence
        self._check_fence = check_fence
        self.fenced: str | None = None
        self._metrics = metrics or RunMetrics(None)
        self._storage = storage
        self._template = template
        self._policy = RetentionPolicy.of(opts)
        self._grace_s = opts.leftover_grace_s
        self._ledger = ledger
        self._spawn = spawn
        self._in_thread = in_thread
        self._protected = protected
        self._cleanup = cleanup
        self._mark_deleted = mark_deleted
        self._readers = readers  # a ReaderRegistry: its leases keep steps until the last moment
        self._running = False
        self._again = False
        self._released = asyncio.Event()  # no pass before release(): see its docstring
        self.idle = asyncio.Event()
        self.idle.set()
        self.passes = 0
        self.deleted: list[int] = []
        self.errors: list[str] = []
        self.claims = DeletionClaims(self._may_delete)
        self._counted: set[int] = set()  # the current plan's counted_newest

    def release(self) -> None:
        """Let passes run, and run one. Until then :meth:`schedule` only queues a pass: a monitor
        that starts checks the state dicts of its steps in flight first, so that one that was
        being withdrawn when the last monitor died is not counted among those it keeps."""
        self._released.set()
        self.schedule()

    def schedule(self) -> None:
        if self.fenced is not None:
            return
        if self._running:
            self._again = True  # one more pass after this one sees the new commit
            return
        self._running = True
        self.idle.clear()
        self._spawn(self._passes())

    async def _passes(self) -> None:
        self.claims.bind(asyncio.get_running_loop())
        try:
            await self._released.wait()
            while True:
                self._again = False
                in_flight = self._ledger.in_flight_steps()
                protected = self._protected() | in_flight
                failed = self._ledger.failed_steps() - in_flight
                if self._fence is not None:
                    self._fence(failed)  # no await since in_flight was read: nothing slipped in
                # Deleted at once: steps no kind of which can commit any more. A step whose state
                # dict the fence left alone (not older than the newest commit it knew) waits as an
                # idle leftover, like the directory of a save the monitor has not heard of.
                at_once = {s for s in failed if self._ledger.state_of(s, Kind.STATE_DICT) is StepState.FAILED}
                try:
                    result = await self._in_thread(self._pass, protected, failed, at_once,
                                                   self._ledger.withdrawing_steps())
                    self.deleted = (self.deleted + result.deleted)[-_HISTORY:]
                    self._metrics.inc(RETENTION_DELETIONS, len(result.deleted), tier="root")
                    self.errors = result.errors
                except FencedError as e:  # a newer job owns the root: its monitor runs retention now
                    self.fenced = str(e)
                    log.error("retention stops: %s", e)
                    self.errors = [f"{type(e).__name__}: {e}"]
                    break
                except Exception as e:  # best-effort: the next commit runs another pass
                    log.warning("retention pass failed: %s: %s", type(e).__name__, e)
                    self.errors = [f"{type(e).__name__}: {e}"]
                self.passes += 1
                if not self._again:
                    break
        finally:
            self._running = False
            self.idle.set()

    def _pass(self, protected: set[int], failed: set[int], at_once: set[int], withdrawing: set[int]) -> PassResult:
        if self._check_fence is not None:
            self._check_fence()
        trash_error = None
        try:
            empty_trash(self._storage)
        except OSError as e:
            # Best-effort clean-up, retried at every pass: what the trash holds is deleted for
            # readers already, and one entry rm cannot remove must not stop the deletions below.
            trash_error = f"could not empty {TRASH}: {e}"
            log.warning("%s; retrying at the next pass", trash_error)
        failpoints.hit("before_retention_scan")
        entries = scan_steps(self._storage, self._template)
        plan = plan_retention(entries, self._policy, protected=protected, failed=at_once, withdrawing=withdrawing)
        self._counted = plan.counted_newest
        # A committed step's ledger records go before its directory: a monitor killed in between
        # still sees the manifest (committed), never records of a step whose files are gone. A
        # step with a failed kind keeps its records: they are what tells a restarted monitor it
        # failed; a marker says which of its kinds had committed.
        def before_delete(entry: StepEntry) -> None:
            if entry.step in failed:
                self._mark_deleted(entry.step, sorted(entry.kinds))
            else:
                self._cleanup(entry.step)

        readers = self._readers

        def claim(entry: StepEntry) -> bool:
            if not self.claims.claim(entry):
                return False
            if entry.committed and readers is not None and not readers.claim_for_delete(entry.step):
                self.claims.release(entry.step)
                return False
            return True

        def unclaim(entry: StepEntry) -> None:
            if entry.committed and readers is not None:
                readers.deleted(entry.step)
            self.claims.release(entry.step)

        result = run_plan(self._storage, plan, self._grace_s, before_delete=before_delete,
                          claim=claim, unclaim=unclaim, fence=self._check_fence)
        if trash_error is not None:
            result.errors.insert(0, trash_error)
        return result

    def _may_delete(self, entry: StepEntry) -> bool:
        """On the event loop, right before a deletion: not if the step is protected now (in
        flight, a registration or commit of it under way, a tracker target), being withdrawn,
        or if a kind the scan did not see committed has committed or is committing since. A
        committed step is not deleted either once a state dict the plan counted among the
        newest is being withdrawn, or was (its state dict failed): the plan kept too few;
        another pass follows."""
        step = entry.step
        withdrawing = self._ledger.withdrawing_steps()
        if step in self._protected() or step in withdrawing:
            return False
        if any(self._ledger.state_of(step, k) in (StepState.COMMITTING, StepState.COMMITTED)
               for k in Kind if k not in entry.kinds):
            return False
        if entry.committed and any(s in withdrawing or self._ledger.state_of(s, Kind.STATE_DICT) is StepState.FAILED
                                   for s in self._counted):
            self._again = True
            return False
        return True
