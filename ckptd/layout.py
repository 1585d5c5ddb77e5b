"""Where things live under a checkpoint root, and the reader-side view of what is committed.

    root/
      latest_checkpointed_iteration.txt      tracker: last committed full checkpoint
      latest_state_dict_iteration.txt        tracker: last committed state dict (or checkpoint)
      global_step_{S}/                       what the save units wrote, plus
        ckptd_manifest.json                  written last: the step's checkpoint is committed
        ckptd_state_dict_manifest.json       written last: the step's state dict is committed
      .ckptd/pending/{S}/{kind}/             the monitor's ledger for steps not yet committed
        registration.json                    expected unit count
        units/{worker}~{name}.json           one receipt per finished or failed unit
        failed.json                          why the step failed as a whole (timeout, commit)

A step of a kind exists for readers only if its manifest exists, on every backend.
"""

from __future__ import annotations

import re

from ckptd.config import Kind
from ckptd.errors import CheckpointConfigError
from ckptd.storage import Storage
from ckptd.units import check_step

TRACKERS: dict[Kind, str] = {
    Kind.CHECKPOINT: "latest_checkpointed_iteration.txt",
    Kind.STATE_DICT: "latest_state_dict_iteration.txt",
}
MANIFESTS: dict[Kind, str] = {
    Kind.CHECKPOINT: "ckptd_manifest.json",
    Kind.STATE_DICT: "ckptd_state_dict_manifest.json",
}
STEP_DIR_PREFIX = "global_step_"
_STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")
LEDGER_DIR = ".ckptd"


def step_dir_name(step: int) -> str:
    return f"{STEP_DIR_PREFIX}{check_step(step)}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory's base name, or None if it is not one."""
    m = _STEP_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def step_dir(root: str, step: int) -> str:
    """The directory that holds step ``step`` under ``root`` (a path or URL, returned as such).

    Save functions write the step's files here; the monitor writes the manifest here last.
    """
    return f"{root.rstrip('/')}/{step_dir_name(step)}"


def pending_dir(storage: Storage, step: int, kind: Kind) -> str:
    return storage.join(LEDGER_DIR, "pending", str(step), kind.value)


def parse_tracker(text: str | None) -> int | None:
    """The integer a tracker holds, or None for a missing tracker."""
    if text is None:
        return None
    return int(text.strip())


def read_tracker(storage: Storage, kind: Kind) -> int | None:
    return parse_tracker(storage.read_text_or_none(storage.join(TRACKERS[kind])))


def is_committed(storage: Storage, step: int, kind: Kind) -> bool:
    """The one predicate every reader asks: is step ``step`` committed as ``kind``?

    A full checkpoint also counts as a state dict.
    """
    base = storage.join(step_dir_name(step))
    kinds = (Kind.CHECKPOINT,) if kind is Kind.CHECKPOINT else (Kind.STATE_DICT, Kind.CHECKPOINT)
    return any(storage.exists(f"{base}/{MANIFESTS[k]}") for k in kinds)


def committed_steps(storage: Storage, kind: Kind) -> list[int]:
    """Every step committed as ``kind``, sorted numerically."""
    names = {MANIFESTS[kind]} if kind is Kind.CHECKPOINT else set(MANIFESTS.values())
    steps = []
    for entry in storage.listdir(storage.root):
        step = parse_step_dir(entry)
        if step is None:
            continue
        if names & set(storage.listdir(storage.join(entry))):
            steps.append(step)
    return sorted(steps)


def latest_step(
    root: str, kind: str = "checkpoint", storage_options: dict | None = None
) -> int | None:
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
    try:
        k = Kind(kind)
    except ValueError:
        raise CheckpointConfigError(f"kind must be 'checkpoint' or 'state_dict', got {kind!r}") from None
    storage = Storage(root, storage_options)
    tracked = read_tracker(storage, k)
    if tracked is not None and is_committed(storage, tracked, k):
        return tracked
    steps = committed_steps(storage, k)
    return steps[-1] if steps else None
