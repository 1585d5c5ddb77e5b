"""A monitor's start-up: its ledger rebuilt from storage alone (manifests and its attempt's
records), and trackers repaired."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ckptd import protocol
from ckptd.config import Kind
from ckptd.layout import StepEntry, Trusted, read_tracker, scan_steps
from ckptd.manifest import Manifest
from ckptd.monitor.commit import Committer
from ckptd.monitor.ledger import SD, StepLedger, StepRecord, StepState
from ckptd.monitor.start_checks import newest_steps, start_manifests, state_dicts_in_flight
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate

log = logging.getLogger("ckptd.monitor")


@dataclass
class Rebuilt:
    steps: list[StepRecord] = field(default_factory=list)  # in flight: look at them once running
    committed_at_start: dict[int, frozenset[Kind]] = field(default_factory=dict)
    failures: set[tuple[int, Kind]] = field(default_factory=set)  # recorded in storage already
    settled: list[int] = field(default_factory=list)  # committed steps whose records can go
    scanned: dict[int, StepEntry] = field(default_factory=dict)  # the step directories found
    # State dicts whose failure is recorded while their manifest is still there: a withdrawal a
    # restart cut short (its failure is recorded first), which the start-up finishes; the reasons.
    withdrawals: dict[int, str] = field(default_factory=dict)


def rebuild(storage: Storage, template: StepDirTemplate, attempt: int, ledger: StepLedger,
            committer: Committer | None, trackers: dict[Kind, int | None], foreign: set[str]) -> Rebuilt:
    """Fill ``ledger`` from storage, and (with a ``committer``) repair ``trackers`` in storage
    and in the dict.

    A committed state dict whose full checkpoint may still come is read back (its units and files
    decide what later units of the step may do); a committed checkpoint needs nothing more.
    """
    out = Rebuilt()
    now = time.time()
    scanned = out.scanned = scan_steps(storage, template)
    out.committed_at_start = {step: entry.kinds for step, entry in scanned.items() if entry.committed}
    state_dicts, damaged = _checked(storage, scanned)
    for step, entry in scanned.items():
        for kind in entry.kinds:
            manifest = state_dicts.get(step) if kind is SD else None
            ledger.mark_committed(step, kind, now, manifest and manifest.units, manifest and manifest.files)
    recorded_failed: set[tuple[int, Kind]] = set()
    for pending in protocol.load_pending(storage, attempt):
        if ledger.is_committed(pending.step, Kind.CHECKPOINT):
            out.settled.append(pending.step)
            continue
        for kind in pending.deleted_kinds:
            ledger.mark_committed(pending.step, kind, now)
        for reg in pending.registrations:
            ledger.register(reg, replay=True)
        for unit, t in pending.started.items():
            ledger.started(unit, t)
        for unit, (t, files, found) in pending.finished.items():
            ledger.finish(unit, files, t, found=found)
        for unit, (t, failure) in pending.failed.items():
            ledger.fail(unit, failure, t)
        rec = ledger.get(pending.step)
        if rec is None:
            continue
        rec.first_seen = min(rec.first_seen, pending.first_seen() or now)
        for kind, reason in pending.failure_reasons.items():
            if kind is SD and rec[SD].state is StepState.COMMITTED:
                # Not settled, either way, until the manifest is gone: no wait may answer
                # "committed" meanwhile (ckptd's readers already pass over it), and retention
                # keeps it without counting it.
                rec[SD].withdrawing = True
                out.withdrawals[pending.step] = reason
            ledger.fail_kind(rec, kind, reason)
            out.failures.add((pending.step, kind))
            recorded_failed.add((pending.step, kind))
        out.steps.append(rec)
    if committer is not None:
        # Not to a kind whose failure is recorded while its manifest is still there: a withdrawal
        # cut short (the failure is recorded first), which the start-up finishes. Nor forward onto
        # a step with a damaged manifest, or files changed since it committed, which every loader
        # of the step refuses.
        newest = newest_steps(scanned, lambda s, kinds: frozenset(
            k for k in kinds if (s, k) not in recorded_failed and s not in damaged))
        _repair_trackers(committer, ledger.is_committed, newest, trackers, _not_ours(scanned, foreign),
                         recorded_failed, damaged)
    return out


def repair_trackers(storage: Storage, template: StepDirTemplate, committer: Committer,
                    trackers: dict[Kind, int | None], trusted: Trusted, foreign: set[str]) -> None:
    """:func:`_repair_trackers` from a new read of the root (the trackers, and a scan): for a
    monitor whose start-up could not (fenced then), which counts only the manifests it
    ``trusted`` (its commits may be in flight). What the ledger its start-up built says is not
    enough: the trackers, and the steps they name, may have been edited or removed since."""
    on_storage = {kind: read_tracker(storage, kind) for kind in Kind}
    scanned = scan_steps(storage, template)
    # Checked as at start-up: files may have changed since, and the fenced start-up did not check
    # them for the trackers either (helper-79: the trackers stayed on a changed step). Only the
    # manifests it trusts: the check walks down from the newest steps the trackers may name, and
    # a newer one it does not trust (a commit in flight) would stand in for them (helper-80).
    mine = {s: replace(e, kinds=trusted(s, e.kinds)) for s, e in scanned.items()}
    _, damaged = _checked(storage, mine)
    newest = newest_steps(mine, lambda s, kinds: frozenset() if s in damaged else kinds)
    _repair_trackers(committer, lambda s, kind: s in mine and kind in mine[s].kinds, newest, trackers,
                     _not_ours(scanned, foreign), refused=damaged, on_storage=on_storage)


def _checked(storage: Storage, scanned: dict[int, StepEntry]) -> tuple[dict[int, Manifest], set[int]]:
    """The start-up's lenient check of the newest steps (:func:`start_manifests`: start_monitor
    checked them strictly): the state dicts' manifests, and the steps the trackers must not name
    (damaged, changed since they committed, or a state dict an attempt was still saving into
    that changed)."""
    in_flight = state_dicts_in_flight(storage, scanned, protocol.pending_attempts(storage))
    return start_manifests(storage, scanned, strict=False, cleaned=in_flight)


def _not_ours(scanned: dict[int, StepEntry], foreign: set[str]) -> set[int]:
    """The steps of another tool's directories (``foreign``: :func:`ckptd.layout.foreign_dirs`) still
    without a manifest."""
    return {s for s, entry in scanned.items() if not entry.kinds and entry.name in foreign}


def _repair_trackers(committer: Committer, is_committed: Callable[[int, Kind], bool], newest: dict[Kind, int],
                     trackers: dict[Kind, int | None], not_ours: set[int],
                     failed: set[tuple[int, Kind]] = frozenset(), refused: set[int] = frozenset(),
                     on_storage: dict[Kind, int | None] | None = None) -> None:
    """A monitor that died between a manifest and its tracker left the tracker behind; a tracker
    edited by hand (or left by a retirement) may name a step that is not committed, one whose
    failure is recorded (``failed``: a withdrawal cut short), or one every loader refuses
    (``refused``: a damaged manifest, or files changed since it committed). All are set to the
    newest committed step that is none of these (an older one, for the last two). A tracker that
    names a step directory of another tool's (``not_ours``) while ckptd has committed no step of
    the kind is that tool's: it stays until ckptd's first commit of the kind replaces it.

    ``trackers``: the steps the monitor holds the trackers name, set to what each names once
    repaired; ``on_storage``: what their files name, where the monitor's may be behind them."""
    for kind in Kind:  # a kind with nothing committed has no entry in ``newest``
        step, current = newest.get(kind, -1), (trackers if on_storage is None else on_storage)[kind]
        if current is not None and current in not_ours and step < 0:
            trackers[kind] = None  # left on storage, but no step of ckptd's: none to tell callers of
            continue
        # A full checkpoint holds the weights too: the state-dict tracker may name one.
        committed = current is not None and (is_committed(current, kind)
                                             or kind is SD and is_committed(current, Kind.CHECKPOINT))
        wrong = current is not None and ((current, kind) in failed or current in refused or not committed)
        if step < 0:
            if wrong:
                committer.remove_tracker(kind)  # nothing of the kind is committed: no step to name
            trackers[kind] = None if wrong else current
            continue
        if current is None or wrong or current < step:
            committer.write_tracker(kind, step)
            current = step
        trackers[kind] = current
