"""A narrow storage layer over fsspec.

Checkpoint roots are URLs (``/abs/path``, ``file://``, ``s3://``, ``gs://``, ``memory://`` ...),
never ``Path`` objects, because a root may live on an object store. All checkpoint I/O in ckptd
goes through :class:`Storage`. How a file is published atomically depends on the backend; see
:mod:`ckptd.commit`.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import IO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckptd import phases
from ckptd.commit import TMP_PREFIX, CommitStrategy, check_publish, fsync_path, strategy_for
from ckptd.direct_io import MODES, DirectIO, current_mode
from ckptd.errors import CheckpointConfigError, CheckpointError, CorruptCheckpointError
from ckptd.walk import FileStat, scan, scan_large

__all__ = ["TMP_PREFIX", "FileStat", "Storage", "explains_credentials"]

#: What storage clients raise when they find no usable credentials, by class name so that no
#: backend is imported: botocore's (s3fs) and google-auth's (gcsfs).
_CREDENTIAL_ERRORS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                                "DefaultCredentialsError"})


class Storage:
    """A checkpoint root on any fsspec filesystem.

    Args:
        root: A local path or fsspec URL. A relative local path is made absolute here, once, so
            that every process resolves it the same way.
        storage_options: Passed to the fsspec filesystem (credentials, endpoint). Never logged.
        direct_io: How large local files are written: ``auto`` with O_DIRECT on ext4 and xfs,
            ``on`` wherever the kernel accepts it, ``off`` never (see :mod:`ckptd.direct_io`).
            None: the mode of the save unit this runs in (the monitor's option), else ``auto``.

    Paths taken and returned by the methods are the filesystem's own (protocol stripped), as
    produced by :meth:`join`.
    """

    def __init__(self, root: str, storage_options: dict | None = None, direct_io: DirectIO | None = None) -> None:
        if not isinstance(root, str) or not root:
            raise CheckpointConfigError(f"root must be a non-empty path or URL string, got {root!r}")
        if direct_io is None:
            direct_io = current_mode()
        if direct_io not in MODES:
            raise CheckpointConfigError(f"direct_io must be one of {', '.join(map(repr, MODES))}, got {direct_io!r}")
        self.direct_io: DirectIO = direct_io
        self.storage_options = dict(storage_options or {})
        if "://" not in root:
            root = os.path.abspath(os.path.expanduser(root))
        try:
            self.fs, path = _open_fs(root, self.storage_options)
        except (ImportError, ValueError) as e:
            raise CheckpointConfigError(
                f"cannot open checkpoint root {root!r}: {e}. Install the fsspec backend for this "
                "protocol (for example s3fs for s3://) or pass a local path"
            ) from e
        self.root = path.rstrip("/") or "/"
        self.is_posix = isinstance(self.fs, LocalFileSystem)
        self.commit: CommitStrategy = strategy_for(self.fs)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.url = self.root if self.is_posix else f"{protocol}://{self.root.lstrip('/')}"

    IS_A_FILE = "it is a file, not a directory"  # what root_problem says of a root that is a file

    def root_problem(self) -> str | None:
        """Why the root holds no checkpoints as it is, in words (it does not exist, or is a file),
        or None: a directory (on an object store, a prefix with objects under it)."""
        if self.fs.isdir(self.root):
            return None
        return self.IS_A_FILE if self.fs.exists(self.root) else "it does not exist"

    def require_root(self) -> None:
        """Raise :class:`CheckpointConfigError` unless the root is a directory (:meth:`root_problem`)."""
        problem = self.root_problem()
        if problem is not None:
            raise CheckpointConfigError(f"checkpoint root {self.url!r} cannot be used: {problem}. Check the path")

    # -- paths ---------------------------------------------------------------------------------

    def join(self, *parts: str) -> str:
        """A path under the root."""
        return "/".join([self.root.rstrip("/"), *(p.strip("/") for p in parts if p)])

    # -- writing -------------------------------------------------------------------------------

    def write_atomic(
        self, path: str, data: bytes, *, before_publish: Callable[[], None] | None = None, durable: bool = True
    ) -> None:
        """Publish ``data`` at ``path`` so that readers never see a partial file.

        Args:
            path: Destination (from :meth:`join`). Parent directories are created.
            data: The complete content.
            before_publish: Called after the content is written (and durable) but before it
                becomes visible (the failpoint hook for "crash before rename").
            durable: False skips the fsyncs on POSIX: still all or nothing for readers, but a
                power loss may lose the file. For records whose loss only delays a commit.
        """
        self.commit.publish(path, data, durable=durable, before_publish=before_publish)

    def open_write(self, path: str) -> AbstractContextManager[IO[bytes]]:
        """A file to stream into; it appears at ``path`` when the ``with`` block ends, and not at
        all if the block raises. Not fsynced: see :meth:`make_durable`."""
        return self.commit.open_write(path)

    def make_durable(self, paths: list[str]) -> None:
        """Make files written with plain writes durable before anything points at them.

        POSIX: fsync each file, then every directory from the files up to the root, because a
        new directory entry is not durable until its directory is. Elsewhere nothing is needed:
        an object is durable once its upload completed.
        """
        if not self.is_posix:
            return
        with phases.phase(phases.FSYNC):
            self._fsync_all(paths)

    def _fsync_all(self, paths: list[str]) -> None:
        dirs: set[str] = set()
        for path in paths:
            fsync_path(path)
            d = os.path.dirname(path)
            while d.startswith(self.root) and d not in dirs:
                dirs.add(d)
                if d == self.root:
                    break
                d = os.path.dirname(d)
        for d in sorted(dirs, key=len, reverse=True):
            fsync_path(d)

    def makedirs(self, path: str) -> None:
        check_publish()  # a save unit of a job that was superseded creates nothing in the root
        self.fs.makedirs(path, exist_ok=True)

    def rm(self, path: str) -> None:
        """Remove a file or a directory tree; a missing path is not an error."""
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    # -- reading -------------------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_text_or_none(self, path: str) -> str | None:
        """The UTF-8 text of ``path``, or None if it does not exist.

        Raises:
            CorruptCheckpointError: the file is not UTF-8 (ckptd writes its files whole: damage, or
                something else wrote it).
        """
        try:
            data = self.fs.cat_file(path)
        except (FileNotFoundError, NotADirectoryError):  # a path under a file does not exist either
            return None
        try:
            return data.decode()
        except UnicodeDecodeError as e:
            raise CorruptCheckpointError(f"{path}: not UTF-8 text ({e}): damaged, or written by something else") from e

    def open(self, path: str, mode: str = "rb") -> IO[bytes]:
        return self.fs.open(path, mode)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def listdir(self, path: str) -> list[str]:
        """Base names of the entries of a directory; empty if it does not exist."""
        try:
            if self.is_posix:  # fsspec's ls costs microseconds per entry: 10,000 in a step of 10,000 ranks
                return os.listdir(path)
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def file_names(self, path: str) -> set[str]:
        """Base names of the regular files (or objects) directly in a directory: no
        subdirectory, even one named like a file; empty if it does not exist."""
        try:
            if self.is_posix:
                with os.scandir(path) as entries:
                    return {e.name for e in entries if e.is_file()}
            entries = self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return set()
        return {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file"}

    def stat(self, path: str) -> FileStat:
        if self.is_posix:
            st = os.stat(path)
            return FileStat(st.st_size, st.st_mtime_ns)
        info = self.fs.info(path)
        return FileStat(int(info.get("size") or 0), _mtime_ns(info))

    def walk_files(self, path: str, skip: Callable[[str], bool] | None = None,
                   links: list[str] | None = None, large: bool = False) -> dict[str, FileStat]:
        """Every file under ``path``, keyed by its path relative to ``path`` (with ``/``).

        Only regular files count (a symlink counts as the file it points to): a named pipe or a
        device in a step is no file of it, and opening one to checksum it would block.

        ``skip``: leaves out the files whose relative path it accepts (ckptd's own temp files, say).
        ``links``: gets the relative paths of the files listed that are symbolic links (POSIX).
        ``large``: the caller expects thousands of files; on POSIX they are then walked outside
        this process (:func:`ckptd.walk.scan_large`), so that its other threads go on meanwhile.
        """
        if self.is_posix:
            return (scan_large if large else scan)(path, skip, links)
        out: dict[str, FileStat] = {}
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return out
        prefix = path.rstrip("/") + "/"
        for full, info in found.items():
            if info.get("type") == "directory" or not full.startswith(prefix):
                continue
            rel = full[len(prefix):]
            if skip is not None and skip(rel):
                continue
            out[rel] = FileStat(int(info.get("size") or 0), _mtime_ns(info))
        return out


def _open_fs(url: str, options: dict) -> tuple[fsspec.AbstractFileSystem, str]:
    if "://" not in url or url.startswith("file://") or "use_listings_cache" in options:
        return fsspec.core.url_to_fs(url, **options)
    # Listing caches (s3fs, gcsfs ...) would hide what other processes wrote since: a monitor
    # must see a manifest or a unit's file as soon as it exists.
    try:
        return fsspec.core.url_to_fs(url, use_listings_cache=False, **options)
    except TypeError:  # a filesystem that takes no such option has no such cache
        return fsspec.core.url_to_fs(url, **options)


def _mtime_ns(info: dict) -> int | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, _dt.datetime):
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)):
            return int(value * 1e9)
    return None


def credentials_missing(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) says the storage client found no credentials."""
    seen: BaseException | None = error
    for _ in range(8):  # a cause chain is short; a cycle is not followed for ever
        if seen is None:
            return False
        if any(c.__name__ in _CREDENTIAL_ERRORS for c in type(seen).__mro__):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def no_credentials_error(root: object, error: BaseException) -> CheckpointConfigError:
    where = f"checkpoint root {root!r}" if root else "the checkpoint root"
    return CheckpointConfigError(
        f"cannot use {where}: the storage client found no credentials ({type(error).__name__}: {error}). "
        "Pass them in storage_options (for s3://: key and secret, or profile; for gs://: token), or set "
        "them in the environment of every process that uses the root (for s3://: AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")


def explains_credentials(fn):
    """Decorate a public entry point whose first argument is a root (or has a ``root``): a storage
    client's missing-credentials error becomes a :class:`CheckpointConfigError` that says what to pass."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CheckpointError:
            raise
        except Exception as e:
            if not credentials_missing(e):
                raise
            first = args[0] if args else kwargs.get("root", kwargs.get("plan"))
            raise no_credentials_error(getattr(first, "root", first), e) from e

    return call
