"""Reading a committed step back: its manifests, and a full check of every file against them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckptd.config import Kind
from ckptd.errors import CheckpointError, CorruptCheckpointError
from ckptd.layout import MANIFESTS, find_step_dir, newest_committed, parse_kind
from ckptd.manifest import FileEntry, Manifest, crc32_file, read_manifest
from ckptd.storage import Storage, explains_credentials
from ckptd.workers.files import mismatch, read_verified


@dataclass(frozen=True)
class CommittedStep:
    """A committed step: where it is, and every file its manifests list (step-relative paths).

    A step saved by a pipeline can have both manifests, the weights under the state-dict one
    and the rest under the checkpoint one; readers see the union.
    """

    step: int
    path: str
    manifests: dict[Kind, Manifest]
    files: dict[str, FileEntry]

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset(self.manifests)


def open_step(storage: Storage, step: int | None, kind: Kind | None) -> CommittedStep | None:
    """The committed step ``step`` (newest of ``kind`` if None), or None if nothing is committed.

    ``kind=None`` opens a given step with whatever manifests it has.

    Raises:
        CheckpointError: ``step`` was given and is not committed as ``kind`` (or at all).
    """
    if step is None:
        step = newest_committed(storage, kind or Kind.CHECKPOINT)
        if step is None:
            return None
    name = find_step_dir(storage, step)
    path = storage.join(name) if name else None
    manifests: dict[Kind, Manifest] = {}
    for k in Kind:
        if path is None:
            break
        manifest = read_manifest(storage, f"{path}/{MANIFESTS[k]}")
        if manifest is not None:
            manifests[k] = manifest
    if path is None or not manifests or kind is Kind.CHECKPOINT and Kind.CHECKPOINT not in manifests:
        what = f"as a {kind.value}" if kind is not None else "(it has no manifest)"
        raise CheckpointError(f"step {step} is not committed {what} under {storage.url}: "
                              f"{_why_not(storage, step, path, manifests)}")
    files: dict[str, FileEntry] = {}
    for m in manifests.values():
        files.update({f.path: f for f in m.files})
    return CommittedStep(step, path, manifests, files)


def _why_not(storage: Storage, step: int, path: str | None, manifests: dict[Kind, Manifest]) -> str:
    """Why a step asked for is not there, in words: what storage shows of it and of the root."""
    if manifests:
        return f"it is committed as a {' and a '.join(k.value for k in manifests)} only"
    problem = storage.root_problem()
    if problem is not None:
        return f"the root {problem.removeprefix('it ')}"  # does not exist, or is a file
    if path is not None and storage.exists(path):
        return "its directory has no manifest: its saves did not all finish, or it is still being committed"
    newest = [f"{k.value} {s}" for k in Kind if (s := newest_committed(storage, k)) is not None]
    return ("no directory of it exists: it was never saved, or retention, gc or a retirement deleted it "
            f"(the newest committed: {', '.join(newest) or 'none'})")


@explains_credentials
def verify(root: str, step: int | None = None, *, kind: str = "checkpoint",
           storage_options: dict | None = None, progress: Callable[[int], None] | None = None) -> CommittedStep:
    """Check every file of a committed step against its manifest: present, same size, same CRC-32.

    Args:
        root: The checkpoint root.
        step: The step to check, against whatever manifests it has (a state dict, a full
            checkpoint or both); None for the newest committed step of ``kind``.
        kind: ``"checkpoint"`` or ``"state_dict"``: which newest step to check when ``step`` is
            None.
        storage_options: fsspec options for ``root``.
        progress: Called with the size of each file once it is checked (for a progress bar).

    Returns:
        The step that was checked.

    Raises:
        CorruptCheckpointError: some file is missing, truncated or changed; the message names
            each such file.
        CheckpointError: nothing is committed, or ``step`` is not committed.
    """
    storage = Storage(root, storage_options)
    committed = open_step(storage, step, parse_kind(kind) if step is None else None)
    if committed is None:
        problem = storage.root_problem()
        raise CheckpointError(f"no committed {kind} under {storage.url}"
                              + (f": the root {problem.removeprefix('it ')}" if problem else ""))
    problems = []
    for rel, entry in sorted(committed.files.items()):
        path = f"{committed.path}/{rel}"
        try:
            size, crc = crc32_file(storage, path)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        problem = mismatch(entry, size, crc)
        if problem:
            problems.append(f"{path}: {problem}")
        if progress is not None:
            progress(entry.size)
    if problems:
        raise CorruptCheckpointError(
            f"step {committed.step} under {storage.url} does not match its manifest: " + "; ".join(problems)
        )
    return committed


def read_file(storage: Storage, committed: CommittedStep, rel: str) -> bytes:
    """A file of a committed step, checked against its manifest entry.

    Raises:
        CorruptCheckpointError: the manifest does not list the file, or it does not match.
    """
    entry = committed.files.get(rel)
    path = f"{committed.path}/{rel}"
    if entry is None:
        raise CorruptCheckpointError(f"{path} is not listed in the manifest of step {committed.step}")
    return read_verified(storage, path, entry)
