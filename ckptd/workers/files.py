"""Writing and reading the files of a checkpoint through :class:`~ckptd.storage.Storage`.

Writers stream into the destination and checksum what they write as they write it, so the
coordinator never reads a file back, and return :class:`~ckptd.manifest.WrittenFile` records.
Readers check each file against its manifest entry before they deserialise it, and load
pickles with ``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pickle
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import IO, Any

from ckptd import phases
from ckptd.checksum import ChecksummedStream, crc32, hex_of
from ckptd.direct_io import DirectWriter, direct_io_for, enable
from ckptd.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptd.manifest import FileEntry, WrittenFile
from ckptd.storage import Storage
from ckptd.threads import lower_priority

log = logging.getLogger("ckptd.files")

_CHUNK = 64 << 20


_OVERLAP_MIN = 1 << 20
# CRC-32 and file writes both release the GIL on large buffers, so a helper thread can
# checksum a slice while the writing thread hands the same slice to the OS.
_crc_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckptd-crc", initializer=lower_priority)


class ChecksumWriter(ChecksummedStream):
    """A write-only stream that passes bytes through to ``f`` and keeps their CRC-32 and count.

    Large writes go out in slices of 64 MiB; each slice is checksummed on a helper thread while
    it is written, and both finish before :meth:`write` returns, because callers such as
    ``torch.save`` reuse their buffer afterwards.
    """

    def __init__(self, f: IO[bytes]) -> None:
        super().__init__()
        self._f = f

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        for start in range(0, len(view), _CHUNK):
            part = view[start : start + _CHUNK]
            if len(part) < _OVERLAP_MIN:
                self._checksum(part)
                self._f.write(part)
                continue
            crc = _crc_pool.submit(crc32, part, self.crc)
            self._f.write(part)
            with phases.phase(phases.CHECKSUM):  # the part of the CRC its write did not hide
                self.crc = crc.result()
        self.size += len(view)
        return len(view)


def write_stream(storage: Storage, path: str, fill: Callable[[ChecksumWriter | DirectWriter], None],
                 size: int | None = None) -> WrittenFile:
    """Open ``path`` for writing, let ``fill`` write into it, and return what was written.

    ``size``, about how many bytes ``fill`` will write when known, lets a large local file go
    past the page cache (see :mod:`ckptd.direct_io` and the storage's ``direct_io`` mode).
    """
    with phases.phase(phases.WRITE), storage.open_write(path) as f:
        if storage.is_posix and direct_io_for(storage.direct_io, path, size) and enable(f.fileno()):
            w: ChecksumWriter | DirectWriter = DirectWriter(f.fileno(), size)
            try:
                fill(w)
            except BaseException:
                with contextlib.suppress(Exception):  # the fill's error is the one to raise
                    w.abort()
                raise
            w.finish()
            log.debug("%s: %d bytes written %s, %d of them through bounce buffers", path, w.size,
                      "with O_DIRECT" if w.direct else "buffered (O_DIRECT refused)", w.copied)
        else:
            w = ChecksumWriter(f)
            fill(w)
    return WrittenFile(path=path, size=w.size, crc32=hex_of(w.crc))


def write_bytes(storage: Storage, path: str, data: bytes) -> WrittenFile:
    return write_stream(storage, path, lambda w: w.write(data))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    torch = sys.modules.get("torch")  # a torch.dtype exists only where torch was imported
    if torch is not None and isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def write_json(storage: Storage, path: str, obj: Any) -> WrittenFile:
    return write_bytes(storage, path, (json.dumps(obj, indent=2, sort_keys=True, default=_jsonable) + "\n").encode())


def write_torch(storage: Storage, path: str, obj: Any) -> WrittenFile:
    """``torch.save`` streamed into storage (no in-memory copy of the serialised bytes)."""
    import torch

    from ckptd.workers.safetensors_io import tensor_nbytes
    from ckptd.workers.state_dict import map_tensors

    # About the file's size (its tensors' bytes): what decides whether it goes past the page cache.
    sizes: list[int] = []
    map_tensors(obj, lambda t: sizes.append(tensor_nbytes(t)))
    return write_stream(storage, path, lambda w: torch.save(obj, w), size=sum(sizes))


def read_verified(storage: Storage, path: str, entry: FileEntry | None) -> bytes:
    """Read a whole file; if ``entry`` is given, check its size and CRC-32 against it.

    Raises:
        CorruptCheckpointError: the file is missing, or differs from its manifest entry.
    """
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing") from None
    if entry is not None:
        problem = mismatch(entry, len(data), hex_of(crc32(data)))
        if problem:
            raise CorruptCheckpointError(f"{path}: {problem}")
    return data


def mismatch(entry: FileEntry, size: int, crc32: str) -> str | None:
    """What is wrong with a file of ``size`` bytes and checksum ``crc32``, or None."""
    if size != entry.size:
        how = "truncated" if size < entry.size else "longer than written"
        return f"{how}: {size} bytes, the manifest says {entry.size}"
    if crc32 != entry.crc32:
        return f"checksum mismatch: CRC-32 {crc32}, the manifest says {entry.crc32}"
    return None


def load_torch(data: bytes, path: str) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, never arbitrary objects.

    Raises:
        UnsafeCheckpointError: the pickle needs more than tensors and plain containers.
    """
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path} needs arbitrary Python objects to load, and ckptd only loads tensors and plain "
            f"containers (torch.load(weights_only=True)). Save state_dict() values, not objects. "
            f"Detail: {str(e).splitlines()[0]}"
        ) from e


def load_json(data: bytes, path: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an int too long, nested too deep
        raise CorruptCheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from e
