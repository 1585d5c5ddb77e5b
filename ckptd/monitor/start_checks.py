"""What a starting monitor checks before it trusts the root: the manifests it reads, and the files
of the steps its trackers will name.

``start_monitor`` runs these checks strictly, before it writes anything: a problem refuses the
start with a :class:`~ckptd.errors.CorruptCheckpointError` saying what to do. The actor's own
start-up (:func:`ckptd.monitor.rebuild.rebuild`, also after Ray restarts it) runs them leniently:
a problem is logged, and the trackers keep away from the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptd import protocol
from ckptd.config import Kind
from ckptd.errors import CorruptCheckpointError
from ckptd.layout import MANIFESTS, StepEntry, Trusted, kinds_in, newest_started_attempt
from ckptd.manifest import FileEntry, Manifest, changed_since_listing, read_manifest
from ckptd.storage import Storage

log = logging.getLogger("ckptd.monitor")
SD = Kind.STATE_DICT
_NAMED = 5  # files a message names; the rest are counted


def start_manifests(storage: Storage, scanned: dict[int, StepEntry], *, strict: bool = True,
                    cleaned: frozenset[int] = frozenset()) -> tuple[dict[int, Manifest], set[int]]:
    """Read the manifests a starting monitor relies on: the state dict's of each step without a
    full checkpoint (a later unit of the step is checked against its units and files), returned
    by step, and those of the newest step of each kind, which the trackers will name. The files of
    those newest steps are checked against their manifests too (:func:`changed_newest`). Returns
    those state dicts, and the steps the trackers must not name: their manifests are damaged, or
    their files changed since they committed (with ``strict=False``).

    ``cleaned``: steps with a state dict alone that a save was under way into (the start-up's
    clean-up of older attempts, :func:`~ckptd.monitor.attempts.clean_up_older_attempts`,
    withdraws one whose files changed): such a change is not a refusal, but the trackers do not
    name the step, and the next newest is checked in its place.

    Raises:
        CorruptCheckpointError: one of those manifests is damaged (each is named), or a step the
            trackers would name no longer holds the files it committed: the trackers would name a
            step no loader reads. Raised before the monitor writes anything (``start_monitor``
            calls it first). With ``strict=False`` (a Ray restart of a running job's monitor,
            which must not end the run over one step), each is logged instead, and a damaged
            state dict's units and files are not known.
    """
    wanted = {(s, SD) for s, entry in scanned.items() if entry.kinds == {SD}}
    for kind in Kind:
        steps = [s for s, entry in scanned.items() if kind in entry.kinds]
        if steps:  # every manifest of that step: a loader of it reads them all
            wanted |= {(max(steps), k) for k in scanned[max(steps)].kinds}
    read: dict[int, Manifest] = {}
    damaged: list[str] = []
    damaged_steps: set[int] = set()
    for step, kind in sorted(wanted):
        try:
            # None: gone since the listing (retired, say); nothing to rely on.
            manifest = read_manifest(storage, storage.join(scanned[step].name, MANIFESTS[kind]), advice=False)
            if manifest is not None and kind is SD:
                read[step] = manifest
        except CorruptCheckpointError as e:
            damaged.append(str(e))
            damaged_steps.add(step)
    if damaged and not strict:
        log.error("damaged manifests: %s. Their steps stay as they are, and their loaders refuse them; restore "
                  "them (the mirror holds a copy, if the run has one) or retire those steps", "; ".join(damaged))
    elif damaged:
        raise CorruptCheckpointError(
            f"the checkpoint root {storage.url} holds damaged manifests, which the monitor must read to start: "
            f"{'; '.join(damaged)}. ckptd writes a manifest whole, once, when its step commits, so something else "
            "changed it: restore it (the mirror holds a copy, if the run has one), or move the step's directory out "
            "of the root (or retire it: ckptd retire ROOT --after an older step), then start the monitor again")
    changed, withdrawn = changed_newest(storage, scanned, damaged_steps, cleaned, first_only=strict)
    for step, paths in sorted(withdrawn.items()):
        log.warning("%s, and a save into the step was under way: the trackers do not name it (it is withdrawn, or "
                    "its full checkpoint's commit refuses it)", _changed_text(storage, scanned, step, paths))
    if changed:
        what = "; ".join(_changed_text(storage, scanned, step, paths) for step, paths in sorted(changed.items()))
        if strict:
            step = max(changed)
            older = [s for s in scanned if s < step and scanned[s].committed]
            retire = f"ckptd retire {storage.url} --after {max(older)}" if older else "move its directory away"
            raise CorruptCheckpointError(
                f"{what}. The trackers would name that step, and every loader refuses it. ckptd never changes a "
                "committed file, so something else did: restore the files (the mirror holds a copy, if the run has "
                f"one), or take the step out of the root ({retire}, which takes every later step too), then start "
                f"the monitor again. ckptd verify {storage.url} --step {step} checks it whole")
        log.error("%s. The trackers name an older step; restore the files (the mirror holds a copy, if the run has "
                  "one), or retire the step", what)
    return read, damaged_steps | set(changed) | set(withdrawn)


def changed_newest(storage: Storage, scanned: dict[int, StepEntry], excluded: set[int],
                   cleaned: frozenset[int] = frozenset(), *,
                   first_only: bool = False) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """The committed steps the trackers would name (the newest of each kind, leaving out the
    ``excluded`` ones and each step found here) whose listed files storage no longer holds as
    their manifests list them: step -> those files, for the steps changed outside ckptd, and
    apart, for the ``cleaned`` ones (a save into them was under way, and a unit may have replaced
    a file: they are withdrawn, not reported). The next newest step then stands in for either.
    One listing per step; a file is read only if it was rewritten since
    (:func:`~ckptd.manifest.changed_since_listing`). A step whose manifests are gone by the end
    of its check was retired or withdrawn meanwhile, not changed. ``first_only``: stop at the
    first step changed outside ckptd."""
    changed: dict[int, list[str]] = {}
    withdrawn: dict[int, list[str]] = {}
    checked: set[int] = set()
    while True:
        left_out = excluded | changed.keys() | withdrawn.keys()
        newest = newest_steps(scanned, lambda s, kinds, out=left_out: frozenset() if s in out else kinds)
        todo = sorted({s for s in newest.values() if s >= 0} - checked, reverse=True)
        if not todo:
            return changed, withdrawn
        for step in todo:
            checked.add(step)
            entry = scanned[step]
            paths = changed_in(storage, entry)
            if paths and kinds_in(storage, entry.name):
                (withdrawn if step in cleaned else changed)[step] = paths
                if first_only and step not in cleaned:
                    return changed, withdrawn


def newest_steps(scanned: dict[int, StepEntry], trusted: Trusted) -> dict[Kind, int]:
    """The newest committed step of each kind (a full checkpoint counts as a state dict too),
    counting of each step's manifests those ``trusted`` keeps."""
    newest: dict[Kind, int] = {}
    for step, entry in scanned.items():
        for kind in trusted(step, entry.kinds):
            newest[kind] = max(newest.get(kind, -1), step)
    newest[SD] = max(newest.get(SD, -1), newest.get(Kind.CHECKPOINT, -1))
    return newest


def state_dicts_in_flight(storage: Storage, scanned: dict[int, StepEntry], attempts: list[int]) -> frozenset[int]:
    """The steps with a committed state dict alone that a save of ``attempts`` may still have been
    writing into: a unit may have replaced a file of the state dict, which is then withdrawn (by
    the clean-up of an older attempt, or by a restarted monitor's resume), not reported as a
    change made outside ckptd. A step whose records show only what its state dict counted (every
    save of it done, no full checkpoint registered) is not one: its files change only outside
    ckptd, and it stays as it is (helper-83: a new job's start-up deleted such a step)."""
    return _recorded_state_dicts(storage, scanned, attempts, _saving_into)


def withdrawals_cut_short(storage: Storage, scanned: dict[int, StepEntry], attempts: list[int]) -> frozenset[int]:
    """The steps with a committed state dict alone whose failure one of ``attempts`` recorded
    while the manifest stayed: a withdrawal a crash (or a refusal by storage until the job ended)
    cut short. Its job said the state dict was withdrawn, and readers passed over it by that
    record; it stays withdrawn, whatever its files hold now (helper-88: the bytes put back, a
    new job's start-up discarded the record and counted the state dict again)."""
    return _recorded_state_dicts(storage, scanned, attempts, _withdrawing)


def _recorded_state_dicts(storage: Storage, scanned: dict[int, StepEntry], attempts: list[int],
                          which: Callable[[Storage, StepEntry, int, protocol.PendingStep], bool]) -> frozenset[int]:
    """The steps with a committed state dict alone for which the records of one of ``attempts``
    show ``which``. Only the records that count (:func:`~ckptd.layout.newest_started_attempt`,
    as for the readers): an older attempt's, written by its fenced monitor after a newer job's
    start-up kept the state dict, must not make the next start-up withdraw it (helper-92)."""
    out: set[int] = set()
    newest = newest_started_attempt(storage)
    for attempt in attempts:
        if newest is not None and attempt < newest:
            continue
        for step in protocol.recorded_steps(storage, attempt):
            entry = scanned.get(step)
            if entry is not None and entry.kinds == {SD} and step not in out and \
                    which(storage, entry, attempt, protocol.load_step(storage, attempt, step)):
                out.add(step)
    return frozenset(out)


def _withdrawing(storage: Storage, entry: StepEntry, attempt: int, records: protocol.PendingStep) -> bool:
    """Whether ``records`` (of ``attempt``) hold a failure of the step's committed state dict: not
    one an attempt older than the one that committed the manifest recorded (about another try)."""
    if SD not in records.failure_reasons:
        return False
    try:
        manifest = read_manifest(storage, storage.join(entry.name, MANIFESTS[SD]), advice=False)
    except CorruptCheckpointError:
        return True  # the clean-up withdraws it as it does a changed one
    return manifest is None or manifest.attempt is None or attempt >= manifest.attempt


def _saving_into(storage: Storage, entry: StepEntry, attempt: int, records: protocol.PendingStep) -> bool:
    """Whether ``records`` (of ``attempt``) show a save into the step beyond its committed state
    dict: a full checkpoint registered, or a registration or an admitted unit its manifest did not
    count (or a manifest that does not say, or cannot be read: as if so). Not the records of an
    attempt older than the one that committed it: their saves ended before that commit, which
    checksummed what they left, and a job's saves publish nothing once a newer one has started
    (records a clean-up cut short left behind, helper-84)."""
    try:
        manifest = read_manifest(storage, storage.join(entry.name, MANIFESTS[SD]), advice=False)
    except CorruptCheckpointError:
        return True
    if manifest is not None and manifest.attempt is not None and attempt < manifest.attempt:
        return False
    if manifest is None or manifest.registrations is None:
        return True
    counted = set(manifest.registrations)
    if any(reg.counts.get(Kind.CHECKPOINT) or reg.reg_id not in counted for reg in records.registrations):
        return True
    units = set(manifest.units)
    return any(unit.kind is not SD or unit.key not in units
               for unit in [*records.started, *records.finished, *records.failed])


def changed_in(storage: Storage, entry: StepEntry) -> list[str]:
    """The files of a committed step that storage no longer holds as its manifests list them
    (:func:`~ckptd.manifest.changed_since_listing`: one listing), or its manifests, damaged."""
    try:
        return changed_since_listing(storage, entry.name, _listed(storage, entry))
    except CorruptCheckpointError:
        return [MANIFESTS[k] for k in sorted(entry.kinds)]  # a loader refuses it just the same


def _listed(storage: Storage, entry: StepEntry) -> list[FileEntry]:
    """Every file the manifests of ``entry`` list. Raises CorruptCheckpointError for a damaged one."""
    files: dict[str, FileEntry] = {}
    for kind in entry.kinds:
        manifest = read_manifest(storage, storage.join(entry.name, MANIFESTS[kind]), advice=False)
        if manifest is not None:
            files.update((f.path, f) for f in manifest.files)
    return list(files.values())


def _changed_text(storage: Storage, scanned: dict[int, StepEntry], step: int, paths: list[str]) -> str:
    kinds = " and ".join(sorted(k.value for k in scanned[step].kinds))
    more = f" and {len(paths) - _NAMED} more" if len(paths) > _NAMED else ""
    return (f"committed step {step} ({kinds}) under {storage.url} no longer holds the files its manifest lists: "
            f"{', '.join(paths[:_NAMED])}{more} are missing or changed since it committed")
