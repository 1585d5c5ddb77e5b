"""Large files written with O_DIRECT: straight from aligned buffers to the device, past the page cache.

A buffered write copies every byte into the page cache, and the fsync that makes it durable
then has the kernel write it back; both take CPU that training wants, and how long the
writeback takes depends on whatever else is dirty. Measured on the 2-core development VM (ext4
on a virtio disk), 1 GiB took 0.41 to 0.52 s with O_DIRECT, against 1.6 to 3.1 s for buffered
writes plus fsync, and a third of the machine's CPU time (docs/benchmarks.md).

:class:`DirectWriter` gathers the stream into two page-aligned bounce buffers (16 to 64 MiB, by
the file's size: :func:`buffer_size`): while one is written by a helper thread, the caller
fills the other, and each buffer's CRC-32 is taken before it leaves. Of the last buffer, the
whole 4 KiB blocks go the same way and the rest through the page cache, so nothing is written
past the file's length. A caller whose bytes stay put until the file is finished (a staged
file image: :meth:`DirectWriter.write_stable`) has its page-aligned blocks written from where
they are, with no copy into a bounce buffer.

Which files get it is decided by :func:`direct_io_for`, from the storage's mode: the monitor's
``direct_io`` option, which a coordinator also makes the default (:func:`mode`) for every
``Storage`` that the writers of ``ckptd.workers`` open inside its save units. ``auto`` picks
the local block-device filesystems whose O_DIRECT is well trodden (ext4, xfs); not tmpfs, where
it is slower, nor network or FUSE filesystems, whose O_DIRECT semantics vary. A kernel that
refuses O_DIRECT for a file (EINVAL) gets the same bytes written buffered.

NOTE: O_DIRECT does not make a file durable: the caller still fsyncs it (the metadata, and the
device's volatile cache), as for any other file.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from typing import Literal

from ckptd import failpoints
from ckptd.checksum import ChecksummedStream
from ckptd.errors import FailpointError
from ckptd.threads import lower_priority

#: The storage option values: ``auto`` (the filesystems in :data:`AUTO_FILESYSTEMS`), ``on``
#: (every local filesystem that accepts it), ``off``.
DirectIO = Literal["auto", "on", "off"]
MODES: tuple[str, ...] = ("auto", "on", "off")

#: Filesystems that ``auto`` writes with O_DIRECT.
AUTO_FILESYSTEMS = frozenset({"ext4", "xfs"})
#: Files smaller than this are written buffered: O_DIRECT pays off on large sequential writes.
DIRECT_MIN = 32 << 20
#: Offsets, lengths and buffers are multiples of this (a page; every block size divides it).
ALIGN = 4096
_BUFFER = 16 << 20  # one bounce buffer (the smallest, and the size for a file of unknown size); two per file
_BUFFER_MAX = 64 << 20
_STABLE_IN_FLIGHT = 2  # writes straight from a caller's memory (write_stable) at once, per file

_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckptd-direct", initializer=lower_priority)
_free_buffers: list[mmap.mmap] = []  # reused: a fresh mapping costs a page fault per 4 KiB
_free_lock = threading.Lock()
_MAX_FREE = 8  # buffers kept for the next file, and at most this many bytes of them
_MAX_FREE_BYTES = 256 << 20


_mode: ContextVar[DirectIO] = ContextVar("ckptd_direct_io", default="auto")


@contextmanager
def mode(value: DirectIO) -> Iterator[None]:
    """Make ``value`` the mode of every :class:`~ckptd.storage.Storage` opened without one in
    this thread (or task) meanwhile: a save unit runs its ``save_fn`` in it."""
    token = _mode.set(value)
    try:
        yield
    finally:
        _mode.reset(token)


def current_mode() -> DirectIO:
    """The mode a :class:`~ckptd.storage.Storage` opened now without one gets."""
    return _mode.get()


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (``ext4``, ``tmpfs`` ...), from
    ``/proc/self/mountinfo``; None where that cannot be read (not Linux)."""
    real = os.path.realpath(path)
    best, fstype = -1, None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields = left.split()
                if not sep or len(fields) < 5 or not right.split():
                    continue
                mount = _unescape(fields[4])
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= best:  # the last of stacked mounts wins, as in the kernel
                    best, fstype = len(mount), right.split()[0]
    except OSError:
        return None
    return fstype


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in octal (``\\040``)."""
    if "\\" not in field:
        return field
    return field.encode("latin-1", "surrogateescape").decode("unicode_escape").encode(
        "latin-1").decode("utf-8", "surrogateescape")


def direct_io_for(mode: DirectIO, path: str, size: int | None) -> bool:
    """Whether a local file of ``size`` bytes (None: unknown) at ``path`` is written with O_DIRECT."""
    if mode == "off" or size is None or size < DIRECT_MIN:
        return False
    return mode == "on" or filesystem_type(os.path.dirname(path) or ".") in AUTO_FILESYSTEMS


def enable(fd: int) -> bool:
    """Set O_DIRECT on an open file; False if the filesystem refuses it (the file is unchanged)."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    return True


def _disable(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}")
        done += n


def buffer_size(size: int | None) -> int:
    """The bounce buffer for a file of about ``size`` bytes (None: unknown): an eighth of it in
    multiples of 16 MiB, from 16 to 64 MiB.

    Every buffer costs the writing threads a few GIL hand-offs (the copy in, the CRC-32, the
    hand-over to the write pool), which a GIL-bound training loop pays for; but the last buffer's
    write overlaps nothing, so a buffer large against its file delays the file. Measured on the
    2-core development VM with interleaved runs (docs/benchmarks.md): a 768 MiB checkpoint (a
    256 MiB and a 512 MiB file) cost a GIL-bound loop 134 ms of training with these sizes against
    147 ms with 16 MiB buffers, and the durable time of a 256 MiB save went from 139 to 135 ms;
    64 MiB for every file saved more training (116 against 144 ms) but made that save 13 % slower.
    """
    if size is None:
        return _BUFFER
    return min(_BUFFER_MAX, max(_BUFFER, size // 8 // _BUFFER * _BUFFER))


def _take_buffer(size: int) -> mmap.mmap:
    with _free_lock:
        for i in range(len(_free_buffers) - 1, -1, -1):  # the most recently used first
            if len(_free_buffers[i]) == size:
                return _free_buffers.pop(i)
    return mmap.mmap(-1, size)  # anonymous mappings are page-aligned


def _give_buffer(buf: mmap.mmap) -> None:
    with _free_lock:
        _free_buffers.append(buf)
        # Over the limits, the least recently used go: buffers of a size no file needs any more
        # must not leave every later file mapping (and faulting in) fresh ones.
        while len(_free_buffers) > _MAX_FREE or sum(len(b) for b in _free_buffers) > _MAX_FREE_BYTES:
            _free_buffers.pop(0)  # unmapped once no view of it is left


class DirectWriter(ChecksummedStream):
    """A write-only stream into ``fd`` (a new, empty file with O_DIRECT set) that keeps the
    CRC-32 and count of what it was given, like :class:`~ckptd.workers.files.ChecksumWriter`.

    :meth:`finish` must run before the file is used: it writes the last buffer (:meth:`abort`
    instead, when the stream is abandoned). If the kernel refuses an
    O_DIRECT write (EINVAL), O_DIRECT is cleared and the same bytes are written buffered;
    :attr:`direct` then says False.
    """

    def __init__(self, fd: int, size: int | None = None) -> None:
        super().__init__()
        self._fd = fd
        self._size = buffer_size(size)  # of each buffer: ``size`` is about how large the file will be
        self._bufs: list[mmap.mmap] = []  # the two bounce buffers, taken when first needed
        self._arrays: list = []
        self._pending: list[Future | None] = [None, None]
        self._stable: deque[Future] = deque()  # writes from callers' memory in flight, oldest first
        self._cur = 0
        self._fill = 0  # bytes in the current buffer
        self._offset = 0  # file offset of the current buffer
        self._lock = threading.Lock()  # the O_DIRECT switch, shared by the writes in flight
        self.direct = True
        self.copied = 0  # bytes that went through the bounce buffers

    def write(self, b) -> int:
        import numpy as np  # here: the monitor imports this module and never writes large files

        view = memoryview(b).cast("B")
        if not len(view):
            return 0
        if not self._bufs:
            self._bufs = [_take_buffer(self._size), _take_buffer(self._size)]
            self._arrays = [np.frombuffer(buf, dtype=np.uint8) for buf in self._bufs]
        src = np.frombuffer(view, dtype=np.uint8)
        pos = 0
        while pos < len(view):
            n = min(len(view) - pos, self._size - self._fill)
            # copyto releases the GIL for the copy, as the write and the CRC-32 do
            np.copyto(self._arrays[self._cur][self._fill : self._fill + n], src[pos : pos + n])
            self._fill += n
            pos += n
            if self._fill == self._size:
                self._send(self._size)
        self.size += len(view)
        self.copied += len(view)
        return len(view)

    def write_stable(self, b) -> int:
        """:meth:`write` for bytes that stay alive and unchanged until :meth:`finish` or
        :meth:`abort` has returned: where they start on a page boundary and nothing is waiting
        in a bounce buffer, their whole blocks are written from where they are (no copy), the
        rest as :meth:`write` does. A file written in page-aligned pieces of its own image (as
        ``write_safetensors`` does from a staged image) goes out with no copy but its tail's."""
        import numpy as np

        view = memoryview(b).cast("B")
        n = len(view) // ALIGN * ALIGN
        if not (self._fill == 0 and n and np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0):
            return self.write(view)
        part = view[:n]
        self._checksum(part)
        while len(self._stable) >= _STABLE_IN_FLIGHT:
            self._stable.popleft().result()
        self._stable.append(_pool.submit(self._pwrite, part, self._offset))
        self._offset += n
        self.size += n
        return n + self.write(view[n:])

    def _send(self, length: int) -> None:
        """Checksum the current buffer's ``_fill`` bytes, write its first ``length`` bytes at
        its offset on the helper thread, and move on to the other buffer."""
        i = self._cur
        data = memoryview(self._bufs[i])
        self._checksum(data[: self._fill])
        self._pending[i] = _pool.submit(self._pwrite, data[:length], self._offset)
        self._offset += self._fill
        self._cur, self._fill = 1 - i, 0
        self._wait(self._cur)  # the other buffer's write must be done before it is refilled

    def _pwrite(self, data: memoryview, offset: int) -> None:
        """Write ``data`` at ``offset``: with O_DIRECT while the kernel takes it, the rest (all
        of it once O_DIRECT was refused) buffered."""
        done = 0
        while self.direct and done < len(data):
            try:
                failpoints.hit("direct_io_write")
                n = os.pwrite(self._fd, data[done:], offset + done)
            except (OSError, FailpointError) as e:
                if not (isinstance(e, FailpointError) or e.errno == errno.EINVAL):
                    raise
                self._fall_back()
                break
            if n == 0:
                raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}")
            done += n
            if done < len(data) and n % ALIGN:
                self._fall_back()  # a short write left the rest unaligned
        _write_all(self._fd, data[done:], offset + done)

    def _fall_back(self) -> None:
        with self._lock:
            if self.direct:
                _disable(self._fd)
                self.direct = False

    def _wait(self, i: int) -> None:
        pending, self._pending[i] = self._pending[i], None
        if pending is not None:
            pending.result()

    def finish(self) -> None:
        """Write what is left and wait for every write. Raises the first write error (the file is
        then incomplete: the caller discards it).

        The last buffer's whole blocks go with O_DIRECT; the part of a block after them goes
        through the page cache (O_DIRECT is cleared for it), so nothing past the file's length
        is ever written: a file that exactly fits a quota or RLIMIT_FSIZE fits."""
        try:
            if self._fill:
                i, n = self._cur, self._fill
                data = memoryview(self._bufs[i])
                self._checksum(data[:n])
                self._wait(1 - i)  # nothing in flight now: O_DIRECT may be cleared for the tail
                self._wait_stable()
                head = n // ALIGN * ALIGN if self.direct else n
                if head:
                    self._pwrite(data[:head], self._offset)
                if head < n:
                    with self._lock:
                        if self.direct:
                            _disable(self._fd)
                    _write_all(self._fd, data[head:n], self._offset + head)
                self._offset += n
                self._fill = 0
        finally:
            self.abort()

    def _wait_stable(self) -> None:
        """Wait for every write from a caller's memory; raise the first error (after all ended)."""
        errors = []
        while self._stable:
            try:
                self._stable.popleft().result()
            except BaseException as e:  # noqa: BLE001 - every write must end before the caller's memory is free
                errors.append(e)
        if errors:
            raise errors[0]

    def abort(self) -> None:
        """Wait for the writes in flight and hand the buffers back; raise the first write error.
        Idempotent."""
        errors = []
        for wait in (partial(self._wait, 0), partial(self._wait, 1), self._wait_stable):
            try:
                wait()
            except BaseException as e:  # noqa: BLE001 - every write must end before the buffers go back
                errors.append(e)
        bufs, self._bufs, self._arrays = self._bufs, [], []
        for buf in bufs:
            _give_buffer(buf)
        if errors:
            raise errors[0]
