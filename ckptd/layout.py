"""Where things live under a checkpoint root, and the reader-side view of what is committed.

    root/
      latest_checkpointed_iteration.txt      tracker: last committed full checkpoint
      latest_state_dict_iteration.txt        tracker: last committed state dict (or checkpoint)
      global_step_{S}/                       what the save units wrote (the name is a template)
        ckptd_manifest.json                  written last: the step's checkpoint is committed
        ckptd_state_dict_manifest.json       written last: the step's state dict is committed
      .ckptd/layout.json                     the step directory template of this root
      .ckptd/attempts/{n}.json               one record per job that started a monitor here
      .ckptd/pending/{attempt}/{S}/          the monitor's ledger for steps in flight
        reg-{id}.json                        one per register call: counts to add per kind
        unit-{call}.json                     one receipt per finished or failed save call
        failed-{kind}.json                   why a kind of the step failed (timeout, commit)
      .ckptd/leases/{id}.json                a weight subscriber's read lease on a step
      .ckptd/events/{run}/*.json             timeline events (ckptd timeline; see monitor/event_store.py)

A step of a kind exists for readers only if its manifest exists, on every backend. Steps are
always ordered by the number parsed from the directory name, never by the name.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError, CheckpointError, CorruptCheckpointError
from ckptd.storage import Storage, explains_credentials
from ckptd.template import StepDirTemplate

log = logging.getLogger(__name__)

TRACKERS: dict[Kind, str] = {
    Kind.CHECKPOINT: "latest_checkpointed_iteration.txt",
    Kind.STATE_DICT: "latest_state_dict_iteration.txt",
}
MANIFESTS: dict[Kind, str] = {
    Kind.CHECKPOINT: "ckptd_manifest.json",
    Kind.STATE_DICT: "ckptd_state_dict_manifest.json",
}
DEFAULT_TEMPLATE = "global_step_{step}"
LEDGER_DIR = ".ckptd"
_LAYOUT_FILE = "layout.json"
_BEFORE = "before_ckptd"  # layout.json: the step directories without a manifest found at the first start

# Templates read from storage, per root URL. A root's template never changes once recorded.
_known_templates: dict[str, StepDirTemplate] = {}


# -- the template of a root ---------------------------------------------------------------------


def read_template(storage: Storage) -> StepDirTemplate:
    """The step directory template recorded under the root (the default if none is)."""
    known = _known_templates.get(storage.url)
    if known is not None:
        return known
    recorded = _read_layout(storage)
    if recorded is None:
        return StepDirTemplate(DEFAULT_TEMPLATE)
    template = StepDirTemplate(recorded["step_dir_template"])
    _known_templates[storage.url] = template
    return template


def check_template(storage: Storage, template: StepDirTemplate) -> bool:
    """Raise if the root names its step directories with another template; True if the root
    records one at all. Reads only."""
    recorded = _read_layout(storage)
    if recorded is None:
        return False
    existing = recorded["step_dir_template"]
    if existing != template.template:
        raise CheckpointConfigError(
            f"checkpoint root {storage.url!r} names its step directories {existing!r}; this "
            f"monitor was configured with {template.template!r}. Use the root's template or "
            "another root"
        )
    return True


def record_template(storage: Storage, template: StepDirTemplate) -> None:
    """Record the root's template, or raise if the root already uses another one. The first
    record also lists the step directories without a manifest that the root holds already:
    another tool's (:func:`foreign_dirs`)."""
    if not check_template(storage, template):
        before = sorted(n for n in storage.listdir(storage.root)
                        if template.parse(n) is not None and not kinds_in(storage, n))
        storage.write_atomic(storage.join(LEDGER_DIR, _LAYOUT_FILE),
                             json.dumps({"step_dir_template": template.template, _BEFORE: before}).encode())
    _known_templates[storage.url] = template


def foreign_dirs(storage: Storage) -> set[str] | None:
    """The step directories another tool wrote: those without a manifest that the root held before
    ckptd first used it (a run switched to ckptd keeps its old ``global_step_N`` directories), by
    name; ckptd never deletes them, nor saves into them. None if ckptd never used the root (it
    records no template): then every step directory without a manifest is another tool's."""
    recorded = _read_layout(storage)
    return None if recorded is None else set(recorded.get(_BEFORE, []))


def _read_layout(storage: Storage) -> dict | None:
    """The root's ``.ckptd/layout.json``, or None if ckptd never used the root.

    Raises:
        CorruptCheckpointError: it is not what ckptd writes (damaged, or edited by hand).
    """
    path = storage.join(LEDGER_DIR, _LAYOUT_FILE)
    text = storage.read_text_or_none(path)
    if text is None:
        return None
    try:
        recorded = json.loads(text)
        if (isinstance(recorded, dict) and isinstance(recorded.get("step_dir_template"), str)
                and isinstance(recorded.get(_BEFORE, []), list)):
            return recorded
    except ValueError:
        pass
    raise CorruptCheckpointError(
        f"{path} is not the layout record ckptd writes (damaged, or edited by hand): every reader and monitor of "
        f"the root needs it to find the step directories. Restore it: it holds "
        f'{{"step_dir_template": "<the template the run used, {DEFAULT_TEMPLATE} by default>", '
        f'"{_BEFORE}": [<the step directories of another tool the root held before ckptd, or none>]}}')


def enclosing_root(storage: Storage) -> str | None:
    """The checkpoint root that holds ``storage``'s root (or is it): the nearest directory at or
    above it with ckptd's ledger directory, as a path of ``storage.fs``; None if there is none.
    One lookup per level, up to the filesystem's root or the bucket."""
    here = storage.root.rstrip("/")
    while here:
        if storage.fs.isdir(f"{here}/{LEDGER_DIR}"):
            return here
        parent = posixpath.dirname(here)
        if parent == here:
            break
        here = parent
    return None


# -- finding steps -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepEntry:
    """A step directory found under the root, and the kinds committed in it."""

    step: int
    name: str
    kinds: frozenset[Kind]

    @property
    def committed(self) -> bool:
        return bool(self.kinds)


def kinds_in(storage: Storage, name: str) -> frozenset[Kind]:
    """The kinds committed in the step directory ``name`` (those whose manifest it holds, as
    a file: a save that made a directory of that name commits nothing)."""
    names = storage.file_names(storage.join(name))
    return frozenset(k for k in Kind if MANIFESTS[k] in names)


def listed_files(storage: Storage, entry: StepEntry) -> set[str]:
    """The step-relative paths the manifests of a step directory list."""
    from ckptd.manifest import read_manifest

    listed: set[str] = set()
    for kind in entry.kinds:
        manifest = read_manifest(storage, storage.join(entry.name, MANIFESTS[kind]))
        if manifest is not None:
            listed |= {f.path for f in manifest.files}
    return listed


def scan_steps(storage: Storage, template: StepDirTemplate | None = None) -> dict[int, StepEntry]:
    """Every step directory under the root, keyed by step.

    If two directories hold the same step (an epoch template, with a crashed attempt left under
    another epoch), the committed one wins.
    """
    template = template or read_template(storage)
    found: dict[int, StepEntry] = {}
    for name in storage.listdir(storage.root):
        step = template.parse(name)
        if step is None:
            continue
        entry = StepEntry(step, name, kinds_in(storage, name))
        other = found.get(step)
        if other is not None:
            log.warning("step %d has two directories, %s and %s", step, other.name, name)
            if other.committed and not entry.committed:
                continue
        found[step] = entry
    return found


def find_step_dir(storage: Storage, step: int, template: StepDirTemplate | None = None) -> str | None:
    """The base name of the directory of ``step``, or None if an epoch template finds none.

    Raises:
        CheckpointError: two directories hold ``step`` and neither or both are committed.
    """
    template = template or read_template(storage)
    if not template.needs_epoch:
        return template.name(step)
    names = [n for n in storage.listdir(storage.root) if template.parse(n) == step]
    if len(names) > 1:
        committed = [n for n in names if kinds_in(storage, n)]
        if len(committed) != 1:
            raise CheckpointError(
                f"step {step} has several directories under {storage.url}: {sorted(names)}; "
                "remove the ones that are not this run's"
            )
        names = committed
    return names[0] if names else None


def parse_tracker(text: str | None) -> int | None:
    """The integer a tracker holds, or None for a missing or unreadable tracker.

    A tracker is only a pointer: readers confirm its step by the manifest, and fall back to the
    manifests when it is missing or damaged (edited by hand, or caught mid-replace on HDFS).
    """
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        log.warning("ignoring a tracker that holds %r instead of a step number", text[:40])
        return None


def read_tracker(storage: Storage, kind: Kind) -> int | None:
    try:
        text = storage.read_text_or_none(storage.join(TRACKERS[kind]))
    except CorruptCheckpointError as e:  # not text at all: as damaged as one that holds no number
        log.warning("ignoring a tracker that is not text: %s", e)
        return None
    return parse_tracker(text)


#: ``(step, kinds of the manifests storage shows) -> the kinds to count``.
Trusted = Callable[[int, frozenset[Kind]], frozenset[Kind]]


# -- the ledger: attempts (ckptd.fencing) and records of steps in flight (ckptd.protocol) -------


def attempts_dir(storage: Storage) -> str:
    return storage.join(LEDGER_DIR, "attempts")


def list_attempts(storage: Storage, ext: str = "json") -> list[int]:
    """The attempts opened on the root (one per job that started a monitor), oldest first; with
    ``ext="started"``, those whose monitor finished its start-up (its clean-up of older ones)."""
    out = []
    for name in storage.listdir(attempts_dir(storage)):
        stem, _, found = name.partition(".")
        if found == ext and stem.isdigit():
            out.append(int(stem))
    return sorted(out)


def pending_root(storage: Storage) -> str:
    return storage.join(LEDGER_DIR, "pending")


def attempt_pending_dir(storage: Storage, attempt: int) -> str:
    return f"{pending_root(storage)}/{attempt}"


def step_pending_dir(storage: Storage, attempt: int, step: int) -> str:
    return f"{attempt_pending_dir(storage, attempt)}/{step}"


def step_failure_path(storage: Storage, attempt: int, step: int, kind: Kind) -> str:
    """Where a monitor records that ``kind`` of ``step`` failed."""
    return f"{step_pending_dir(storage, attempt, step)}/failed-{kind.value}.json"


def newest_started_attempt(storage: Storage) -> int | None:
    """The newest attempt whose monitor finished its start-up (not one taken back). Ledger records
    count from it on: that start-up decided about the older attempts' steps (it finished their
    withdrawals, withdrew what they may have changed) and then discarded their records, so an
    older attempt's record found now was written after it, by a fenced monitor of an older job
    that went on."""
    opened = set(list_attempts(storage))
    return max((a for a in list_attempts(storage, "started") if a in opened), default=None)


def counted_attempts(storage: Storage) -> list[int]:
    """The attempts whose ledger records count, oldest first (:func:`newest_started_attempt`)."""
    newest = newest_started_attempt(storage)
    return [a for a in list_attempts(storage) if newest is None or a >= newest]


def _not_failed(storage: Storage) -> Trusted:
    """What a reader without a monitor counts: a manifest whose kind a monitor recorded as failed
    is a withdrawal under way, or cut short (the failure is recorded before the tracker moves and
    the manifest goes; that monitor, or the next job's start-up, finishes it).

    The records that count are those of the newest attempt whose monitor finished its start-up,
    and of any newer one: a newer job's start-up finishes an older attempt's withdrawals before it
    discards that attempt's records (and before it marks itself started), but a fenced monitor of
    an older job may record a failure afterwards, of a step number the newer job then commits.
    Costs one listing of the attempts, the first time a step has a manifest to look at, and a
    lookup per such step, kind and counted attempt (one, unless a job is starting)."""
    counted: list[int] | None = None

    def trusted(step: int, kinds: frozenset[Kind]) -> frozenset[Kind]:
        nonlocal counted
        if not kinds:
            return kinds
        if counted is None:
            counted = counted_attempts(storage)
        return frozenset(k for k in kinds if not any(
            storage.exists(step_failure_path(storage, a, step, k)) for a in counted))

    return trusted


def _counts_as(kinds: frozenset[Kind], kind: Kind) -> bool:
    # A full checkpoint holds the weights too, so it also counts as a state dict.
    return Kind.CHECKPOINT in kinds or (kind is Kind.STATE_DICT and Kind.STATE_DICT in kinds)


def is_committed(storage: Storage, step: int, kind: Kind) -> bool:
    """The one predicate every reader asks: is step ``step`` committed as ``kind``?"""
    return _counts_as(manifests_of(storage, step), kind)


def manifests_of(storage: Storage, step: int, template: StepDirTemplate | None = None) -> frozenset[Kind]:
    """The kinds whose manifest step ``step`` has (empty if it has no directory)."""
    name = find_step_dir(storage, step, template)
    return frozenset() if name is None else kinds_in(storage, name)


def committed_steps(storage: Storage, kind: Kind) -> list[int]:
    """Every step committed as ``kind``, sorted numerically."""
    return sorted(s for s, e in scan_steps(storage).items() if _counts_as(e.kinds, kind))


def parse_kind(kind: str) -> Kind:
    try:
        return Kind(kind)
    except ValueError:
        raise CheckpointConfigError(f"kind must be 'checkpoint' or 'state_dict', got {kind!r}") from None


@explains_credentials
def latest_step(root: str, kind: str = "checkpoint", storage_options: dict | None = None) -> int | None:
    """The newest committed step of ``kind`` under ``root``, or None if there is none.

    Reads the tracker, then confirms the step's manifest exists. A tracker that points at a step
    without a manifest (edited or restored by hand) is not trusted: the newest step with a
    manifest is returned instead.

    Args:
        root: The checkpoint root, a local path or fsspec URL.
        kind: ``"checkpoint"`` (full checkpoints) or ``"state_dict"`` (weights; full
            checkpoints count too).
        storage_options: fsspec options for ``root``.
    """
    return newest_committed(Storage(root, storage_options), parse_kind(kind))


def newest_committed(storage: Storage, kind: Kind, trusted: Trusted | None = None) -> int | None:
    """:func:`latest_step` on an open :class:`Storage`: the tracker, if its step is committed,
    else the newest step with a manifest.

    ``trusted(step, kinds)``: of the manifests storage shows for ``step``, the kinds to count (a
    monitor leaves out a commit still in flight, a step being deleted, a manifest it is about to
    withdraw). Without it, a kind whose failure a monitor recorded is left out: a withdrawal under
    way, or cut short."""

    trusted = trusted or _not_failed(storage)

    def counts(step: int, kinds: frozenset[Kind]) -> bool:
        return _counts_as(trusted(step, kinds), kind)

    tracked = read_tracker(storage, kind)
    if tracked is not None and counts(tracked, manifests_of(storage, tracked)):
        return tracked
    scanned = scan_steps(storage)
    return next((s for s in sorted(scanned, reverse=True) if counts(s, scanned[s].kinds)), None)


def step_dir(root: str, step: int, *, epoch: int | None = None, storage_options: dict | None = None) -> str:
    """The directory that holds step ``step`` under ``root`` (a path or URL, returned as such).

    Save functions write the step's files here; the monitor writes the manifest here last. The
    name follows the root's step directory template (``global_step_{step}`` unless the monitor
    was started with another ``step_dir_template``).

    Args:
        root: The checkpoint root.
        step: The training step.
        epoch: Required when the template has ``{epoch}`` (e.g. ``epoch-{epoch}_step-{step}``);
            for reading an existing step it may be left out, and the directory is looked up.
        storage_options: fsspec options for ``root``.

    Raises:
        CheckpointConfigError: a bad step, or an epoch template without ``epoch`` for a step
            that does not exist yet.
    """
    storage = Storage(root, storage_options)
    template = read_template(storage)
    if template.needs_epoch and epoch is None:
        name = find_step_dir(storage, step, template)
        if name is None:
            template.name(step)  # raises: says to pass the epoch
    else:
        name = template.name(step, epoch)
    return f"{root.rstrip('/')}/{name}"
