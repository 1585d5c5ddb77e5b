"""Which files a save unit wrote, with their sizes and checksums (runs in the save thread)."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable

from ckptd import phases
from ckptd.errors import CheckpointConfigError
from ckptd.manifest import FileEntry, WrittenFile, crc32_file, is_internal
from ckptd.storage import FileStat, Storage

# File timestamps come from the kernel's coarse clock, which can lag time.time_ns() by a tick
# (up to 10 ms): look this much further back so a unit's first file is never missed.
_MTIME_SLACK_NS = 20_000_000


def discover_files(
    storage: Storage, step_path: str, started_ns: int, listed_before: dict[str, FileStat] | None = None
) -> list[FileEntry]:
    """Checksum the files in ``step_path`` that appeared or changed while the unit ran.

    On POSIX that is every file modified since ``started_ns``. Object stores keep timestamps to
    the second, from the server's clock, so there it is every file that is not in
    ``listed_before`` (the step directory as listed before the unit ran) or differs from it.

    The unit's own save_fn has returned, so its files are complete. A file still changing while
    it is read belongs to another unit that is writing into the same step directory, and is
    left to that unit.
    """
    def changed(rel: str, st: FileStat) -> bool:
        if listed_before is not None:
            return listed_before.get(rel) != st
        return st.mtime_ns is None or st.mtime_ns >= started_ns - _MTIME_SLACK_NS

    before = {rel: st for rel, st in storage.walk_files(step_path).items() if not is_internal(rel) and changed(rel, st)}
    entries = []
    for rel, st in sorted(before.items()):
        path = f"{step_path}/{rel}"
        try:
            with phases.phase(phases.CHECKSUM):
                size, crc = crc32_file(storage, path)
            after = storage.stat(path)
        except FileNotFoundError:
            continue  # another unit's temp file, renamed away meanwhile
        if after != st or size != st.size:
            continue
        entries.append(FileEntry(path=rel, size=size, crc32=crc, mtime_ns=st.mtime_ns))
    storage.make_durable([f"{step_path}/{e.path}" for e in entries])
    return entries


def _absolute(storage: Storage, p: str) -> str | None:
    """The storage path of an absolute path or URL; None for a path relative to the step.

    Object stores' own paths have no leading slash (``bucket/run/...``): those under the root
    count as absolute too, which is what ckptd's writers return there. On POSIX the path is
    normalised, as the step directory's listing names it.
    """
    if "://" in p or p.startswith("/"):
        full = storage.fs._strip_protocol(p)
        return _normpath(full) if storage.is_posix else full
    if not storage.is_posix and p.startswith(storage.root.rstrip("/") + "/"):
        return p
    return None


def _normpath(p: str) -> str:
    """A POSIX path as the step directory's listing names it: "dir//a", "dir/./a" and
    "dir/../dir/a" are "dir/a". normpath keeps two leading slashes (POSIX leaves their meaning to
    the system); Linux, like every system ckptd runs on, reads "//x" as "/x"."""
    p = posixpath.normpath(p)
    return "/" + p.lstrip("/") if p.startswith("//") else p


def step_path_of(storage: Storage, returned: list) -> str | None:
    """The step directory that absolute returned paths lie in (the first component under root)."""
    prefix = storage.root.rstrip("/") + "/"
    for item in returned:
        p = item.path if isinstance(item, WrittenFile) else item
        full = _absolute(storage, os.fspath(p)) if isinstance(p, (str, os.PathLike)) else None
        if full is not None and full.startswith(prefix):
            return prefix + full[len(prefix):].split("/", 1)[0]
    return None


def describe_returned_files(storage: Storage, step_path: str, returned: Iterable) -> list[FileEntry]:
    """Describe the files a save_fn said it wrote: paths (absolute or step-relative) or
    :class:`WrittenFile` records, whose checksum is trusted and whose size is checked."""
    entries = []
    prefix = step_path.rstrip("/") + "/"
    for i, item in enumerate(returned):
        written = item if isinstance(item, WrittenFile) else None
        p = written.path if written is not None else item
        if not isinstance(p, (str, os.PathLike)):
            # Not "save_fn returned None": it returned a list, one of whose items is not a path.
            raise CheckpointConfigError(
                f"item {i} of what save_fn returned is {item!r} ({type(item).__name__}), not a file path; return "
                "None, or a list of the file paths it wrote (or ckptd.WrittenFile records)"
            )
        p = os.fspath(p)
        full = _absolute(storage, p)
        if full is not None:
            if not full.startswith(prefix):
                raise CheckpointConfigError(
                    f"save_fn returned {p!r}, which is outside the step directory {step_path!r}; "
                    "write every file of a step under ckptd.step_dir(root, step)"
                )
            rel = full[len(prefix):]
        elif storage.is_posix:
            # The commit matches reports to the step directory's listing by name ("./a" is "a");
            # on an object store "a//b" is a key of its own, so names are taken as they are.
            rel = _normpath(p)
        else:
            rel = p
        if ".." in rel.split("/"):  # what is left of ".." after normpath escapes
            raise CheckpointConfigError(f"save_fn returned {p!r}, which escapes the step directory")
        st = storage.stat(prefix + rel)
        if written is None:
            with phases.phase(phases.CHECKSUM):
                size, crc = crc32_file(storage, prefix + rel)
        elif written.size != st.size:
            raise OSError(f"{rel} is {st.size} bytes on storage but its writer wrote {written.size}")
        else:
            size, crc = written.size, written.crc32
        entries.append(FileEntry(path=rel, size=size, crc32=crc, mtime_ns=st.mtime_ns))
    storage.make_durable([prefix + e.path for e in entries])
    return entries
