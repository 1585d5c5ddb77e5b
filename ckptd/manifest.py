"""The step manifest: every file a step's units wrote, with its size and a fast checksum.

The manifest is written last inside the step directory; its presence is what makes the step
committed. Checksums are CRC-32 (zlib), computed by the worker that wrote the file, in its save
thread, so the monitor never reads checkpoint bytes.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from ckptd.config import Kind
from ckptd.storage import TMP_PREFIX, FileStat, Storage

_CHUNK = 8 << 20
MANIFEST_VERSION = 1


class FileEntry(BaseModel):
    """One file of a step, relative to the step directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    size: int
    crc32: str
    mtime_ns: int | None = None


@dataclass(frozen=True)
class WrittenFile:
    """A file a writer produced, with the checksum it computed while writing.

    Save functions may return these instead of paths, so the coordinator does not read the file
    back to checksum it.

    Attributes:
        path: Absolute path or URL of the file, or a path relative to the step directory.
        size: Bytes written.
        crc32: CRC-32 of the content, 8 lowercase hex digits.
    """

    path: str
    size: int
    crc32: str


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = MANIFEST_VERSION
    step: int
    kind: Kind
    units: list[str]
    files: list[FileEntry]
    committed_at: float

    def to_bytes(self) -> bytes:
        """What is written to storage (the root's manifest, and the mirror's copy of it)."""
        return self.model_dump_json(indent=1).encode()


def crc32_file(storage: Storage, path: str) -> tuple[int, str]:
    """Size and CRC-32 (8 hex digits) of a file, read in large chunks."""
    crc = 0
    size = 0
    with storage.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def is_internal(rel_path: str) -> bool:
    """ckptd's own files in a step directory: manifests and temp files of atomic writes."""
    base = rel_path.rsplit("/", 1)[-1]
    return base.startswith(TMP_PREFIX) or base.startswith("ckptd_") and base.endswith("manifest.json")


def describe_files(storage: Storage, step_path: str, stats: dict[str, FileStat]) -> list[FileEntry]:
    """Checksum the given files (paths relative to ``step_path``)."""
    entries = []
    for rel, st in sorted(stats.items()):
        size, crc = crc32_file(storage, f"{step_path}/{rel}")
        entries.append(FileEntry(path=rel, size=size, crc32=crc, mtime_ns=st.mtime_ns))
    return entries


def merge_unit_files(
    storage: Storage, step_path: str, reports: dict[str, list[FileEntry]]
) -> list[FileEntry]:
    """One entry per file from the units' reports.

    Two units of a step can both report a file when one of them discovered the other's file by
    scanning the step directory while it was being written. All units have finished by now, so
    the report whose size and mtime match the file as it is now is the complete one.

    Raises:
        OSError: a reported file is gone, or changed after every report of it.
    """
    by_path: dict[str, list[FileEntry]] = {}
    for entries in reports.values():
        for e in entries:
            by_path.setdefault(e.path, []).append(e)
    merged = []
    for rel, candidates in sorted(by_path.items()):
        distinct = {(c.size, c.crc32, c.mtime_ns) for c in candidates}
        if len(distinct) == 1:
            merged.append(candidates[0])
            continue
        now = storage.stat(f"{step_path}/{rel}")
        match = [c for c in candidates if c.size == now.size and c.mtime_ns == now.mtime_ns]
        if not match:
            raise OSError(f"{rel} changed after every unit that wrote it had reported it")
        merged.append(match[-1])
    return merged


def build_manifest(step: int, kind: Kind, units: list[str], files: list[FileEntry]) -> Manifest:
    return Manifest(step=step, kind=kind, units=sorted(units), files=files, committed_at=time.time())
