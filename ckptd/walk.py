"""Every file under a local directory, with its size and modification time: what a commit checks
its step against, 40,000 files at 10,000 ranks.

Two walks with one result: os.walk's view of the regular files (symlinked directories are not
entered, a symlink to a file counts as that file, a dangling link, a fifo or a device is none):

* :func:`scan`, in Python with ``os.scandir``;
* :func:`scan_large`, with GNU ``find`` where there is one. Its walk and its stat calls run in
  another process, outside the caller's GIL: in the monitor, notifications and other steps go on
  while a large step is walked (0.3 s of the monitor's GIL at 40,000 files in Python, about 0.05 s
  to read ``find``'s answer). Anything unexpected (no GNU find, a file removed during the walk, an
  unreadable directory, an answer it cannot parse, a time before 1970 with a fraction of a second,
  a path of PATH_MAX bytes or more) falls back to :func:`scan`, which then raises or skips as it
  always does.

In both, a symlink that leads to no file (its target gone, a loop of links, a path through a
file) is no file of the step, as a dangling one always was.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import NamedTuple


class FileStat(NamedTuple):
    """A file's size and modification time (None where the backend keeps none). A tuple: a
    commit makes one per file of its step, 40,000 at 10,000 ranks."""

    size: int
    mtime_ns: int | None


# Type, path relative to the start, size, modification time (seconds, 10 decimals).
_FORMAT = r"%y\0%P\0%s\0%T@\0"
_FIELDS = 4

# What following a symlink (or stating an entry removed meanwhile) fails with where no file is
# there to list: gone, a path through a file ("file/x"), a loop of links. Such a link is dangling:
# no file of a step, in both walks.
_NO_FILE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})
# The longest path the Python walk can stat (PATH_MAX, its NUL included): find walks deeper, by
# relative names, and would list files that neither the Python walk nor a checksum can open.
_PATH_MAX = 4096


def scan(path: str, skip: Callable[[str], bool] | None = None, links: list[str] | None = None) -> dict[str, FileStat]:
    """Regular files under ``path`` (a symlink counts as the file it points to) -> FileStat,
    keyed by their path relative to ``path`` with ``/``; empty if ``path`` is no directory.

    ``skip`` leaves out the files whose relative path it accepts; ``links`` gets the relative
    paths of the files listed that are symbolic links.
    """
    out: dict[str, FileStat] = {}
    _scan(path, "", out, skip, links)
    return out


def scan_large(path: str, skip: Callable[[str], bool] | None = None,
               links: list[str] | None = None) -> dict[str, FileStat]:
    """:func:`scan` for a tree of thousands of files: walked by GNU find, off the GIL."""
    found = _find(path, skip)
    if found is None:
        return scan(path, skip, links)
    out, linked = found
    if links is not None:
        links.extend(linked)
    return out


def _find(path: str, skip: Callable[[str], bool] | None) -> tuple[dict[str, FileStat], list[str]] | None:
    """:func:`scan` by GNU find, and the links listed; None where it cannot answer (then
    :func:`scan` must)."""
    find = _gnu_find()
    if find is None or not os.path.isabs(path):
        return None
    try:
        # Into a file, not a pipe: the caller's thread then only waits, and reads the answer once.
        with tempfile.TemporaryFile() as answer:
            # "path/": a start that is a symlink to a directory is walked, as os.scandir does.
            code = subprocess.call([find, path.rstrip("/") + "/", "-mindepth", "1", "!", "-type", "d", "-printf",
                                    _FORMAT], stdin=subprocess.DEVNULL, stdout=answer, stderr=subprocess.DEVNULL,
                                   env={**os.environ, "LC_ALL": "C"})  # "1.5", never "1,5"
            answer.seek(0)
            data = answer.read()
    except OSError:
        return None
    if code != 0:
        return None
    fields = data.decode(sys.getfilesystemencoding(), "surrogateescape").split("\0")
    if len(fields) % _FIELDS != 1:  # the answer ends with a separator
        return None
    try:
        return _parse(path, fields, skip)
    except ValueError:  # not the answer expected of GNU find
        return None


def _parse(path: str, fields: list[str], skip: Callable[[str], bool] | None) -> tuple[dict[str, FileStat], list[str]]:
    out: dict[str, FileStat] = {}
    links: list[str] = []
    start = len(os.fsencode(path.rstrip("/"))) + 1
    it = iter(fields)
    for kind, rel, size, mtime in zip(it, it, it, it, strict=False):  # drops the final ""
        # Encoded only where it might be that long: 4 bytes a character at most.
        if start + len(rel) * 4 >= _PATH_MAX and start + len(os.fsencode(rel)) >= _PATH_MAX:
            raise ValueError(f"{rel!r}: a path longer than the Python walk can stat")
        if kind == "f":
            if skip is None or not skip(rel):
                out[rel] = FileStat(int(size), _ns(mtime))
        elif kind == "l" and (skip is None or not skip(rel)):  # a link counts as its target, if a file
            try:
                st = os.stat(os.path.join(path, rel))
            except OSError as e:
                if e.errno in _NO_FILE:
                    continue
                raise
            if stat.S_ISREG(st.st_mode):
                out[rel] = FileStat(st.st_size, st.st_mtime_ns)
                links.append(rel)
        # Anything else (a fifo, a socket, a device) is no file of a step.
    return out, links


@functools.cache
def _gnu_find() -> str | None:
    """The path of GNU find (the only one with -printf), or None."""
    find = shutil.which("find")
    if find is None:
        return None
    try:
        version = subprocess.run([find, "--version"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return find if version.returncode == 0 and b"GNU findutils" in version.stdout else None


def _ns(seconds: str) -> int:
    """Nanoseconds of find's ``%T@`` ("1700000000.1234567890"), exactly, without a float.

    Raises:
        ValueError: a time before 1970 with a fraction of a second. GNU find 4.9 prints the whole
            seconds rounded down and then a fraction to add (-1.5 s as "-2.5000000000"), which
            reads as -2.5; rather than rely on that, such a time is left to the Python walk.
    """
    dot = seconds.find(".")
    if dot > 0 and len(seconds) - dot == 11 and seconds[0] != "-":  # GNU find's: 10 decimals, the last always 0
        return int(seconds[:dot] + seconds[dot + 1:]) // 10
    whole, _, frac = seconds.partition(".")
    if whole.startswith("-") and frac.strip("0"):
        raise ValueError(f"{seconds!r}: a time before 1970, with a fraction of a second")
    return int(whole) * 1_000_000_000 + int((frac + "000000000")[:9])


def _scan(path: str, rel: str, out: dict[str, FileStat], skip: Callable[[str], bool] | None,
          links: list[str] | None) -> None:
    # Names built by concatenation: os.path.relpath per file would double the time.
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False):  # the common case first: one call
                regular = True
            elif entry.is_dir(follow_symlinks=False):
                _scan(entry.path, f"{rel}{entry.name}/", out, skip, links)
                continue
            elif entry.is_dir():  # a symlink to a directory: os.walk lists it, never as a file
                continue
            else:  # a symlink to a file, or no file at all (a fifo, a socket, a device)
                regular = False
            name = rel + entry.name
            if skip is not None and skip(name):
                continue
            st = entry.stat()
        except OSError as e:  # removed while we walked (a temp file, say), or a dangling link
            if e.errno in _NO_FILE:
                continue
            raise
        if regular or stat.S_ISREG(st.st_mode):
            out[name] = FileStat(st.st_size, st.st_mtime_ns)
            if not regular and links is not None:
                links.append(name)
