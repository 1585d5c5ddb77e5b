"""The step manifest: every file a step's units wrote, with its size and a fast checksum.

The manifest is written last inside the step directory; its presence is what makes the step
committed. Checksums are CRC-32 (zlib), computed by the worker that wrote the file, in its save
thread, so the monitor never reads checkpoint bytes.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from ckptd.checksum import crc32, hex_of
from ckptd.config import Kind
from ckptd.errors import CorruptCheckpointError
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
    units: list[str]  # the units it counts, as ``worker/name#call``
    files: list[FileEntry]
    committed_at: float
    attempt: int | None = None  # the attempt (job) that committed it
    registered: int | None = None  # the units registered for this kind when it committed
    registrations: list[str] | None = None  # ids of the register calls it counted

    def to_bytes(self) -> bytes:
        """What is written to storage (the root's manifest, and the mirror's copy of it)."""
        return self.model_dump_json(indent=1).encode()


def parse_manifest(text: str, path: str, *, advice: bool = True) -> Manifest:
    """The manifest ``text`` read from ``path``.

    Raises:
        CorruptCheckpointError: not JSON, or not a manifest (ckptd writes manifests whole: it was
            damaged, or edited by hand). Its message says what to do unless ``advice`` is False
            (a caller that names several damaged manifests says it once).
    """
    try:
        return Manifest.model_validate_json(text)
    except ValueError as e:  # pydantic's ValidationError is one; so is bad JSON
        first = str(e).splitlines()
        problem = f"{path}: not a valid ckptd manifest ({' '.join(first[:3])[:300]})"
        raise CorruptCheckpointError(
            problem if not advice else f"{problem}. ckptd writes manifests whole, so it was damaged or edited: "
            "restore it (the mirror holds a copy, if the run has one), or retire the step (ckptd retire ROOT "
            "--after an older step) to resume from an older one") from e


def read_manifest(storage: Storage, path: str, *, advice: bool = True) -> Manifest | None:
    """The manifest at ``path``, or None if there is none.

    Raises:
        CorruptCheckpointError: it is there but not a manifest (see :func:`parse_manifest`).
    """
    text = storage.read_text_or_none(path)
    return None if text is None else parse_manifest(text, path, advice=advice)


def crc32_file(storage: Storage, path: str) -> tuple[int, str]:
    """Size and CRC-32 (8 hex digits) of a file, read in large chunks."""
    crc = 0
    size = 0
    with storage.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = crc32(chunk, crc)
            size += len(chunk)
    return size, hex_of(crc)


_NOT_A_FILE = (errno.ELOOP, errno.ESPIPE, errno.ENXIO)  # a symlink loop, a pipe, a socket


def changed_files(storage: Storage, step_name: str, entries: list[FileEntry]) -> list[str]:
    """The paths (relative to the step directory ``step_name``, itself relative to the root) whose
    bytes on storage are not what ``entries`` say (missing ones included), each read whole and
    checksummed."""
    out = []
    for e in entries:
        path = storage.join(step_name, e.path)
        try:
            if storage.is_posix and not stat.S_ISREG(os.stat(path).st_mode):
                size, crc = -1, ""  # a directory or a pipe now (open() would wait on a pipe for ever)
            else:
                size, crc = crc32_file(storage, path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, io.UnsupportedOperation):
            size, crc = -1, ""  # gone, or no longer a regular file (a directory, a pipe)
        except OSError as err:
            if err.errno not in _NOT_A_FILE:
                raise  # storage could not be read: nothing is known about the file
            size, crc = -1, ""
        if (size, crc) != (e.size, e.crc32):
            out.append(e.path)
    return out


def listed_as(entry: FileEntry, st: FileStat) -> bool:
    """Whether a file's size and modification time (``st``) are those ``entry`` lists; a time that
    either side does not know counts as the same."""
    return entry.size == st.size and (entry.mtime_ns is None or st.mtime_ns is None or entry.mtime_ns == st.mtime_ns)


def still_holds(storage: Storage, path: str, entry: FileEntry, st: FileStat | None) -> bool:
    """Whether the file at ``path`` (``st``: its listing, None if it is missing) still holds what
    ``entry`` describes: the same size and modification time, or, if it was rewritten since (a
    copy back from a mirror, say), the same bytes (CRC-32). Only such a file is read."""
    if st is None or entry.size != st.size:
        return False
    return listed_as(entry, st) or crc32_file(storage, path)[1] == entry.crc32


def changed_since_listing(storage: Storage, step_name: str, entries: list[FileEntry]) -> list[str]:
    """The paths of ``entries`` (relative to the step directory ``step_name``) that storage no
    longer holds as listed, from one listing of the step: unlike :func:`changed_files`, a file
    whose size and modification time are unchanged is not read, so that a start-up can afford it
    for a step of any size."""
    on_storage = storage.walk_files(storage.join(step_name), skip=is_internal)

    def holds(e: FileEntry) -> bool:
        try:
            return still_holds(storage, storage.join(step_name, e.path), e, on_storage.get(e.path))
        except FileNotFoundError:  # gone since the listing
            return False

    return [e.path for e in entries if not holds(e)]


def is_internal(rel_path: str) -> bool:
    """ckptd's own files in a step directory (``rel_path`` relative to it): the manifests, at its
    top only, and temp files of atomic writes, anywhere. A file of that name in a subdirectory is
    the job's (a copied step of another root, say), and is checked and listed like any other."""
    if "/" in rel_path:
        return rel_path.rsplit("/", 1)[-1].startswith(TMP_PREFIX)
    return rel_path.startswith(TMP_PREFIX) or rel_path.startswith("ckptd_") and rel_path.endswith("manifest.json")


def build_manifest(step: int, kind: Kind, units: list[str], files: list[FileEntry], *,
                   attempt: int | None = None, registered: int | None = None,
                   registrations: list[str] | None = None) -> Manifest:
    return Manifest(step=step, kind=kind, units=sorted(units), files=sorted(files, key=lambda f: f.path),
                    committed_at=time.time(), attempt=attempt, registered=registered,
                    registrations=registrations)
