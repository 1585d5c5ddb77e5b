"""How a file is published atomically, per backend: the commit strategies behind :class:`Storage`.

Every strategy gives readers the same promise: a published file is seen whole or not at all,
and a write that fails leaves nothing at its final path (an older file there stays as it was).
What changes between backends is how:

* :class:`PosixRename` (local disk, NFS, Lustre): temp file in the same directory, fsync,
  rename, fsync of the directory.
* :class:`ObjectPut` (S3, GCS, Azure and other object stores): one PUT for small data, or a
  multipart upload that is completed only when the write finished (fsspec's
  ``autocommit=False``), and aborted otherwise. Object stores have no atomic rename, so there
  is none.
* :class:`MoveIntoPlace` (HDFS, and local disk behind ``dir://``: an atomic rename, and files
  visible while they are written): temp file, then a move.
* :class:`BufferedPut` (``memory://``, whose files are visible from the moment they are
  opened): the content is buffered and stored in one call.

Above these, a step is committed by writing its data, then its manifest, then the tracker; every
reader asks whether the manifest exists (:func:`ckptd.layout.is_committed`).
"""

from __future__ import annotations

import io
import itertools
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO

from fsspec import AbstractFileSystem
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

TMP_PREFIX = ".ckptd-tmp-"
Hook = Callable[[], None] | None

#: Filesystems with an atomic rename and files that are visible while they are written.
MOVE_PROTOCOLS = frozenset({"hdfs", "arrow_hdfs", "webhdfs", "viewfs"})


_temp_prefix = uuid.uuid4().hex[:8]
_temp_seq = itertools.count()


def temp_name(path: str) -> str:
    """A hidden sibling of ``path`` for a write in progress (readers and manifests skip these),
    unique across hosts (a random prefix), forked processes (the pid) and threads (a counter)."""
    head, _, base = path.rpartition("/")
    return f"{head}/{TMP_PREFIX}{base}-{_temp_prefix}{os.getpid():x}-{next(_temp_seq):x}"


def fsync_path(path: str) -> None:
    """fsync a file, or a directory: a rename is not durable until the directory entry is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CommitStrategy:
    """Publishes files on one filesystem. Subclasses implement :meth:`open_write`."""

    name = "abstract"

    def __init__(self, fs: AbstractFileSystem) -> None:
        self.fs = fs

    def open_write(self, path: str, *, durable: bool = False, before_publish: Hook = None) -> Iterator[IO[bytes]]:
        """A context manager yielding a writable file.

        ``path`` appears when the block ends without an exception, and not at all otherwise.
        ``durable`` fsyncs where that means anything (POSIX); ``before_publish`` runs once the
        content is written (and durable) but before it becomes visible: a crash there must
        leave the old file in place.
        """
        raise NotImplementedError

    def publish(self, path: str, data: bytes, *, durable: bool = True, before_publish: Hook = None) -> None:
        with self.open_write(path, durable=durable, before_publish=before_publish) as f:
            f.write(data)


_guard: ContextVar[Hook] = ContextVar("ckptd_publish_guard", default=None)


@contextmanager
def publish_guard(check: Hook) -> Iterator[None]:
    """Run ``check`` just before every publish (rename, PUT, completion of an upload) that the
    commit strategies make in this thread (or task) meanwhile, and before :class:`Storage` or a
    strategy creates a directory: a save unit runs its ``save_fn`` in one that raises once a newer
    job has started on the root. A check that raises fails that write, and nothing appears at its
    path (an older file there stays as it was). None: no check in the block (a unit's own records).

    NOTE: like any context variable it does not follow work handed to a thread that does not copy
    the context (``asyncio.to_thread`` does, a ``ThreadPoolExecutor`` does not); a writer process
    sets its own (see :func:`ckptd.coordinator.writer_process.in_mode`).
    """
    token = _guard.set(check)
    try:
        yield
    finally:
        _guard.reset(token)


def check_publish() -> None:
    """Run this context's publish guard, if there is one (see :func:`publish_guard`)."""
    guard = _guard.get()
    if guard is not None:
        guard()


def _run(hook: Hook) -> None:
    check_publish()
    if hook is not None:
        hook()


class PosixRename(CommitStrategy):
    name = "posix-rename"

    @contextmanager
    def open_write(self, path: str, *, durable: bool = False, before_publish: Hook = None) -> Iterator[IO[bytes]]:
        directory = os.path.dirname(path)
        tmp = temp_name(path)
        try:
            f = open(tmp, "wb")  # noqa: SIM115 (closed by the with below)
        except FileNotFoundError:
            # Only now: a receipt or record is written twice per save unit, into a directory that
            # almost always exists, and makedirs costs three system calls when it does.
            check_publish()  # a fenced unit creates no directory either (a step's, say)
            os.makedirs(directory, exist_ok=True)
            f = open(tmp, "wb")  # noqa: SIM115
        try:
            with f:
                yield f
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            _run(before_publish)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        if durable:
            fsync_path(directory)


class _ObjectWriter(io.RawIOBase):
    """Buffers an object's first block in memory: an object that ends within it is stored with
    one PUT; a larger one becomes a multipart upload that is completed only by :meth:`finish`."""

    def __init__(self, fs: AbstractFileSystem, path: str, block: int) -> None:
        self._fs, self._path, self._block = fs, path, block
        self._buf: io.BytesIO | None = io.BytesIO()
        self._file = None

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self._buf is not None:
            n = self._buf.write(b)
            if self._buf.tell() > self._block:
                self._file = self._fs.open(self._path, "wb", autocommit=False, block_size=self._block)
                self._file.write(self._buf.getbuffer())
                self._buf = None
            return n
        return self._file.write(b)

    def finish(self, before_publish: Hook) -> None:
        if self._file is None:
            _run(before_publish)
            self._fs.pipe_file(self._path, self._buf.getvalue())  # one PUT
            return
        self._file.close()  # uploads the last part
        _run(before_publish)
        self._file.commit()  # completes the multipart upload: the object appears whole

    def abort(self) -> None:
        if self._file is not None:
            self._file.discard()  # aborts the multipart upload: no object, no parts left behind
            self._file.closed = True  # nothing left to flush when the file object is collected
        self._buf = None


class ObjectPut(CommitStrategy):
    name = "object-put"

    def _block(self) -> int:
        """Objects that end within this many bytes are stored with one PUT (s3fs: 50 MiB)."""
        return int(getattr(self.fs, "default_block_size", None) or 5 << 20)

    @contextmanager
    def open_write(self, path: str, *, durable: bool = False, before_publish: Hook = None) -> Iterator[IO[bytes]]:
        # An object is durable once its upload completed; there is nothing to fsync.
        w = _ObjectWriter(self.fs, path, self._block())
        try:
            yield w
            w.finish(before_publish)
        except BaseException:
            w.abort()
            raise


class MoveIntoPlace(CommitStrategy):
    name = "move-into-place"

    @contextmanager
    def open_write(self, path: str, *, durable: bool = False, before_publish: Hook = None) -> Iterator[IO[bytes]]:
        tmp = temp_name(path)
        check_publish()
        self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            _run(before_publish)
            if self.fs.exists(path):
                # HDFS refuses to rename over a file. Readers never depend on a tracker being
                # present (they fall back to the manifests), and a step's data files are only
                # rewritten while the step is uncommitted.
                self.fs.rm(path)
            self.fs.mv(tmp, path)
        except BaseException:
            try:
                self.fs.rm(tmp)
            except (FileNotFoundError, OSError):
                pass
            raise


class BufferedPut(ObjectPut):
    """Every file buffered whole and stored in one call: for ``memory://``, where a file opened
    for writing is visible at once."""

    name = "buffered-put"

    def _block(self) -> int:
        return sys.maxsize


def strategy_for(fs: AbstractFileSystem) -> CommitStrategy:
    """The commit strategy for a filesystem."""
    if isinstance(fs, LocalFileSystem):
        return PosixRename(fs)
    target = fs.fs if isinstance(fs, DirFileSystem) else fs  # dir:// is a prefix over another fs
    protocols = {target.protocol} if isinstance(target.protocol, str) else set(target.protocol)
    if isinstance(target, MemoryFileSystem):
        return BufferedPut(fs)
    if isinstance(target, LocalFileSystem) or protocols & MOVE_PROTOCOLS:
        return MoveIntoPlace(fs)
    return ObjectPut(fs)
