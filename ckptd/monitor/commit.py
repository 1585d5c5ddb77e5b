"""The commit path: check a step's directory against what its units reported, write its
manifest(s), then move the trackers. Runs in the monitor's I/O threads; no Ray here. The checks
of the directory are :mod:`ckptd.monitor.commit_check`'s.

Invariants it keeps:

* A step is its directory. A manifest lists every file of the step directory that belongs to
  its kind, including files the job wrote outside any unit (Trinity's other ranks save their
  shards with a plain ``torch.save``); those are checksummed here.
* Every file a unit reported must still have the size (and modification time, where the
  backend keeps one) it was reported with, and every file an earlier manifest of the step lists
  must be unchanged. Otherwise the commit fails, naming the file: no manifest ever carries a
  checksum of bytes that are not on storage.
* Only the newest attempt publishes (:func:`~ckptd.fencing.check_fence` right before
  each manifest and tracker), and a tracker never moves back: the value in storage is read
  before it is replaced.
* A publish whose outcome is uncertain (it raised, but the rename may have happened) is settled
  by reading storage back before anyone is told.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from ckptd import failpoints
from ckptd.config import Kind
from ckptd.errors import CheckpointError
from ckptd.fencing import FencedError, check_fence
from ckptd.layout import (
    MANIFESTS,
    TRACKERS,
    StepEntry,
    Trusted,
    find_step_dir,
    is_committed,
    kinds_in,
    newest_committed,
    read_tracker,
)
from ckptd.manifest import FileEntry, Manifest, build_manifest, changed_files, is_internal, read_manifest
from ckptd.monitor.commit_check import CommitCheckError, StepChecks
from ckptd.monitor.start_checks import changed_in
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate

log = logging.getLogger("ckptd.monitor")

OUTSIDE_UNITS = "(written outside save units)"
# Files reported from which a step is walked outside the monitor's process (ckptd.walk): below,
# starting that process costs more than the walk.
LARGE_STEP = 2000
#: Backoff between tries to settle a publish that raised, while storage refuses both the sync and the removal.
_SETTLE_BACKOFF_S = 0.1
_SETTLE_MAX_BACKOFF_S = 30.0
#: How often a publish being settled looks again while a newer attempt that may be taken back holds it.
_SETTLE_FENCED_S = 1.0


class _NotNeeded(Exception):
    """A tracker publish found a newer committed step there already."""


class Deferred(Exception):
    """The commit must wait: files no unit reported may belong to a unit still running."""


class UndecidedPublish(FencedError):
    """A publish raised, storage refused both the sync and the removal that would have settled
    it, and a newer attempt now owns the root for good: ``path`` may be visible, so whether what
    it publishes is committed is for that attempt's job to decide (its start-up keeps a visible
    checkpoint manifest, and a state dict's whose files are unchanged). The monitor must not
    report it failed, nor committed."""

    def __init__(self, mine: int, newer: int, run: str, path: str) -> None:
        super().__init__(mine, newer, run)
        self.path = path

    def __reduce__(self):
        return (type(self), (self.mine, self.newer, self.run, self.path))


@dataclass
class CommitPlan:
    """What one commit of a step publishes.

    Attributes:
        kinds: The kinds committed now, state dict first.
        reports: Unit key -> the files it reported, for every finished unit of the step.
        units: Kind -> the unit keys its manifest counts.
        sd_units: Keys of the units whose files go into a state-dict manifest.
        take_unclaimed: Whether files no unit reported, or that a unit only found by time, may
            be attributed now (no unit of the step that could be writing them is running).
        found: Keys of the units whose files were found by time (their save_fn returned None).
        registered: Kind -> the registered unit count, recorded in the manifest.
        registrations: The ids of the registrations counted (a retried one is recognised after
            the commit).
        published: Kind -> the manifest this plan has published already. A commit of both
            kinds that fails after the state dict's manifest is visible leaves it here: a retry
            publishes only the rest, and a commit that fails for good still counts these kinds
            as committed (readers may have taken them), failing only the others.
    """

    step: int
    kinds: list[Kind]
    reports: dict[str, list[FileEntry]]
    units: dict[Kind, list[str]]
    sd_units: set[str]
    take_unclaimed: bool = True
    found: set[str] = field(default_factory=set)
    registered: dict[Kind, int] = field(default_factory=dict)
    registrations: list[str] = field(default_factory=list)
    published: dict[Kind, Manifest] = field(default_factory=dict)


class Committer(StepChecks):
    """Publishes manifests and trackers for one monitor (one attempt) of one root."""

    def __init__(self, storage: Storage, template: StepDirTemplate, attempt: int,
                 fence_is_final: Callable[[], bool] = lambda: True) -> None:
        self.storage = storage
        self.template = template
        self.attempt = attempt
        # Whether a newer attempt that fenced this one out stays (the monitor's FenceWatch): a
        # losing start_monitor's attempt is taken back within seconds, and a publish being
        # settled then goes on.
        self.fence_is_final = fence_is_final

    # -- manifests -----------------------------------------------------------------------------

    def commit(self, plan: CommitPlan) -> dict[Kind, Manifest]:
        """Check the step directory and write the manifests of ``plan.kinds``.

        Raises:
            Deferred: unreported files appeared while another unit of the step is running.
            CommitCheckError: a reported or committed file is missing or changed.
            FencedError: a newer attempt owns the root.
        """
        failpoints.hit("before_manifest")
        name = find_step_dir(self.storage, plan.step, self.template)
        if name is None:
            raise CheckpointError(
                f"no directory of step {plan.step} matches {self.template.template!r}: its save units "
                "wrote no files, and the directory name needs the epoch"
            )
        step_path = self.storage.join(name)
        committed: dict[str, FileEntry] = {}  # what the step's earlier manifests list
        for kind in Kind:
            # A manifest this plan published in an earlier try is committed now, like any other.
            unpublished = kind in plan.kinds and kind not in plan.published
            manifest = None if unpublished else read_manifest(self.storage, f"{step_path}/{MANIFESTS[kind]}")
            if manifest is not None:
                committed.update({f.path: f for f in manifest.files})
        links: list[str] = []
        reported = sum(map(len, plan.reports.values()))
        on_storage = self.storage.walk_files(step_path, skip=is_internal, links=links, large=reported >= LARGE_STEP)
        self._check_links(step_path, links)
        # Committed files first: one that changed withdraws its commit (committed_changed), whatever
        # the reports say (a stale report of it would otherwise fail the commit without saying so).
        for rel, entry in committed.items():
            st = on_storage.get(rel)
            if st is None or not self._unchanged(f"{step_path}/{rel}", entry, st):
                raise CommitCheckError(
                    f"{step_path}/{rel} is listed by a committed manifest of step {plan.step} but is "
                    f"{'gone' if st is None else f'now {st.size} bytes'}; a later save rewrote it. "
                    "Committed files must not change: save into a new step", committed_changed=True
                )
        claimed = self._check_reports(plan, step_path, on_storage)
        if committed:
            # A report of a committed file must say what that manifest lists, which storage holds
            # (checked above): any other is wrong, and the commit fails on it, keeping the committed
            # state dict (a unit known only from its receipt after a restart, say).
            for unit, entries in sorted(plan.reports.items()):
                for e in entries:
                    c = committed.get(e.path)
                    if c is not None and (c.size, c.crc32) != (e.size, e.crc32):
                        raise CommitCheckError(
                            f"{step_path}/{e.path} is reported by {unit} as {e.size} bytes with CRC-32 {e.crc32}, "
                            f"but a committed manifest of step {plan.step} lists it as {c.size} bytes with "
                            f"CRC-32 {c.crc32}, which storage holds: that report is wrong")
        # Every claimed and committed file is on storage (checked above): when they are as many as
        # the files there, none is unclaimed, and the sets need not be built (40,000 files).
        if not committed and len(claimed) == len(on_storage):
            unclaimed = []
        else:
            unclaimed = sorted(on_storage.keys() - claimed.keys() - committed.keys())
        uncertain = unclaimed
        if plan.found:
            uncertain = unclaimed + sorted(rel for rel, (_e, unit) in claimed.items() if unit in plan.found)
        if uncertain and not plan.take_unclaimed:
            # A unit still running beside this commit may be writing these: wait for it.
            raise Deferred(uncertain)
        outside = self._checksum_unclaimed(step_path, unclaimed, on_storage)
        manifests = {}
        for kind in plan.kinds:
            if kind in plan.published:
                manifests[kind] = plan.published[kind]
                continue
            if kind is Kind.STATE_DICT:
                files = [e for e, unit in claimed.values() if unit in plan.sd_units]
                files += outside.values()
            elif committed or outside:
                merged = dict(committed)
                merged.update({rel: e for rel, (e, _unit) in claimed.items()})
                merged.update(outside)
                files = list(merged.values())
            else:
                files = [e for e, _unit in claimed.values()]
            units = plan.units[kind] + ([OUTSIDE_UNITS] if outside else [])
            manifest = build_manifest(plan.step, kind, units, files, attempt=self.attempt,
                                      registered=plan.registered.get(kind), registrations=plan.registrations)
            self._publish(f"{step_path}/{MANIFESTS[kind]}", manifest.to_bytes(), None)
            manifests[kind] = plan.published[kind] = manifest
        return manifests

    # -- trackers ------------------------------------------------------------------------------

    def advance_tracker(self, kind: Kind, step: int) -> bool:
        """Point the tracker of ``kind`` at ``step`` unless storage already has a newer committed
        step there; True if it was written."""

        def still_forward() -> None:
            current = read_tracker(self.storage, kind)
            if current is not None and current >= step and is_committed(self.storage, current, kind):
                raise _NotNeeded

        path = self.storage.join(TRACKERS[kind])
        try:
            self._publish(path, f"{step}\n".encode(), partial(failpoints.hit, "before_tracker_rename"), still_forward,
                          previous=self._current(path))
        except _NotNeeded:
            return False
        return True

    def write_tracker(self, kind: Kind, step: int) -> None:
        """Point the tracker at ``step`` whatever it holds (start-up repair, retirement)."""
        path = self.storage.join(TRACKERS[kind])
        self._publish(path, f"{step}\n".encode(), None, previous=self._current(path))

    def _current(self, path: str) -> bytes | None:
        """What a tracker holds now (None: none), for a publish over it to restore if it must
        take itself back."""
        try:
            return self.storage.read_bytes(path)
        except FileNotFoundError:
            return None

    def differs(self, step: int, entries: list[FileEntry]) -> list[str]:
        """The paths (relative to the step) whose bytes on storage are not what ``entries`` say."""
        failpoints.hit("state_dict_check")
        return changed_files(self.storage, find_step_dir(self.storage, step, self.template) or "", entries)

    def registered_before(self, step: int, reg_id: str) -> bool:
        """Whether the checkpoint manifest of ``step`` counted the registration ``reg_id``."""
        name = find_step_dir(self.storage, step, self.template)
        path = None if name is None else self.storage.join(name, MANIFESTS[Kind.CHECKPOINT])
        manifest = None if path is None else read_manifest(self.storage, path)
        return manifest is not None and reg_id in (manifest.registrations or [])

    def revoke(self, step: int, kind: Kind, trusted: Trusted | None = None) -> int | None:
        """Take back a commit whose files changed: point the tracker of ``kind`` at the newest
        step that stays committed (or remove it), then remove the manifest. Returns that step.

        The tracker moves first, so that a withdrawal cut short in between (fenced, or the
        monitor gone) leaves a tracker naming a committed step, never one without a manifest;
        the manifest left behind is withdrawn again by the retry, a restart or the next job.
        ``trusted``: which manifests the tracker may fall back to (:func:`newest_committed`)."""
        check_fence(self.storage, self.attempt)  # first too: a retried withdrawal ends on it
        failpoints.hit("before_revoke")

        changed: set[int] = set()

        def staying(s: int, kinds: frozenset[Kind]) -> frozenset[Kind]:
            kinds = kinds if trusted is None else trusted(s, kinds)
            return frozenset() if s in changed else kinds - {kind} if s == step else kinds

        # Not onto a step whose files changed since it committed (outside ckptd): every loader
        # refuses it. It stays as it is; the next newest one takes its place.
        while (newest := newest_committed(self.storage, kind, staying)) is not None:
            name = find_step_dir(self.storage, newest, self.template)
            entry = None if name is None else StepEntry(newest, name, kinds_in(self.storage, name))
            paths = [] if entry is None else changed_in(self.storage, entry)
            if not paths:
                break
            log.error("step %d: %s changed since it committed; the %s tracker falls back past it", newest,
                      ", ".join(paths[:5]), kind.value)
            changed.add(newest)
        if read_tracker(self.storage, kind) != newest:
            if newest is None:
                self.remove_tracker(kind)
            else:
                self.write_tracker(kind, newest)
        failpoints.hit("before_revoke_rm")
        name = find_step_dir(self.storage, step, self.template)
        check_fence(self.storage, self.attempt)  # and last, as before a rename: the lookup lists
        if name is not None:
            self.storage.rm(self.storage.join(name, MANIFESTS[kind]))
        return newest

    def remove_tracker(self, kind: Kind) -> None:
        """Remove the tracker of ``kind`` (no step of the kind is committed)."""
        check_fence(self.storage, self.attempt)
        self.storage.rm(self.storage.join(TRACKERS[kind]))

    # -- publishing ----------------------------------------------------------------------------

    def _publish(self, path: str, data: bytes, before_publish, check=None, previous: bytes | None = None) -> None:
        """Publish ``data`` at ``path`` if this attempt is still the newest (and ``check`` passes).
        ``previous``: what the path held (a tracker), restored if the publish must be taken back.

        Both checks run at the last moment, after the content is written and just before the
        rename (or PUT) makes it visible, so a monitor that stalled in between (a slow disk, a
        paused process) cannot publish over a newer attempt.

        NOTE: between that check and the rename a window of microseconds remains: fencing on a
        filesystem without a lock service narrows the race, it cannot close it.
        """

        def last_moment() -> None:
            if before_publish is not None:
                before_publish()
            check_fence(self.storage, self.attempt)
            if check is not None:
                check()

        check_fence(self.storage, self.attempt)
        try:
            self.storage.write_atomic(path, data, before_publish=last_moment)
            failpoints.hit("after_publish")
        except (FencedError, _NotNeeded):
            raise
        except Exception as e:
            # The rename (or PUT) may have happened before the error (a failed directory fsync,
            # a lost response): settle it by reading storage, before anyone is told anything.
            if not self._settle(path, data, e, previous):
                raise

    def _settle(self, path: str, data: bytes, error: Exception, previous: bytes | None = None) -> bool:
        """After a publish of ``data`` at ``path`` raised ``error``: True once it is on storage
        and durable, False once it is not there (never published, or taken back: removed, or
        ``previous`` put back, so that a tracker taken back still names the step it named).

        Visible but not durable, it is taken back, so that what readers see is what a crash
        would leave. Until one or the other succeeds (storage refusing both the sync and the
        removal) this keeps trying, however long that takes: a failure reported with the
        manifest still visible would commit the step for every reader, and for a restarted
        monitor, after its callers heard it failed. A newer attempt on the root ends it before a
        removal: the root is that job's now, and what this one left is its to judge
        (:class:`UndecidedPublish`). A newer attempt that may still be taken back (a losing
        ``start_monitor``'s, see ``fence_is_final``) only pauses it: reporting an outcome then
        would be a guess that a restart of this monitor could contradict."""
        tries = 0
        while True:
            try:
                failpoints.hit("settle_read")
                if self.storage.read_bytes(path) != data:
                    return False
            except FileNotFoundError:
                return False
            except Exception as e:  # unknown (an object store's sync proves nothing): a removal settles it
                log.warning("could not read back %s after its publish raised (%s: %s): taking it back", path,
                            type(e).__name__, e)
            else:
                log.warning("publishing %s raised %s: %s, but it is on storage; syncing again", path,
                            type(error).__name__, error)
                try:
                    failpoints.hit("settle_sync")
                    self.storage.make_durable([path])
                    return True
                except Exception as e:
                    log.warning("could not sync %s after its publish raised (%s: %s): taking it back", path,
                                type(e).__name__, e)
            try:
                failpoints.hit("settle_remove")
                check_fence(self.storage, self.attempt)  # at the last moment, as before a rename
                if previous is None:
                    self.storage.rm(path)
                else:
                    self.storage.write_atomic(path, previous)
                return False
            except FencedError as e:
                if self.fence_is_final():
                    raise UndecidedPublish(e.mine, e.newer, e.run, path) from e
                # A newer attempt that may yet be taken back: looked at again soon.
                level, longest, why = logging.WARNING, _SETTLE_FENCED_S, f"a newer attempt on the root keeps it ({e})"
            except Exception as e:
                level, longest, why = logging.ERROR, _SETTLE_MAX_BACKOFF_S, f"{type(e).__name__}: {e}"
            tries += 1
            delay = min(_SETTLE_BACKOFF_S * 2 ** tries, longest)
            log.log(level, "%s may be visible but not durable, and could not be removed (%s): trying again in %.1f s "
                    "(try %d)", path, why, delay, tries)
            time.sleep(delay)
