"""Files of a committed step, checked against their manifest entry and memory-mapped.

On POSIX storage a file is mapped once (private, copy-on-write), its CRC-32 is computed over the
mapping on several threads, and the tensors of a safetensors file are views of that same
mapping: the bytes live in the page cache once, with no second copy in the process. Elsewhere
(object stores) the file is read into memory and checked there.

NOTE: a mapped tensor reads the file through the page cache. Committed files never change, but a
process that rewrote one in place would change such tensors under their reader; a tensor written
to gets a private copy of its pages and never changes the file.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import load as st_load

from ckptd.checksum import crc32, crc32_parallel, hex_of
from ckptd.errors import CorruptCheckpointError
from ckptd.manifest import FileEntry
from ckptd.storage import Storage
from ckptd.workers.files import mismatch, read_verified
from ckptd.workers.safetensors_io import DTYPE_NAMES

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads() -> int:
    """Threads used to check and copy weights: the machine's cores, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def pool() -> ThreadPoolExecutor:
    """The shared pool that checksums and copies weights (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="ckptd-load")
        return _pool


def map_verified(storage: Storage, path: str, entry: FileEntry | None):
    """The content of ``path`` as a buffer (a private mapping on POSIX, bytes elsewhere), checked
    against ``entry`` (size first, then CRC-32) unless ``entry`` is None.

    Raises:
        CorruptCheckpointError: the file is missing, or differs from ``entry``.
    """
    if not storage.is_posix:
        return read_verified(storage, path, entry)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if entry is not None and size != entry.size:
            raise CorruptCheckpointError(f"{path}: {mismatch(entry, size, '')}")
        if size == 0:
            data = bytearray()
        else:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if entry is not None:
        crc = crc32_parallel(data, pool(), threads()) if size else crc32(b"")
        problem = mismatch(entry, size, hex_of(crc))
        if problem:
            raise CorruptCheckpointError(f"{path}: {problem}")
    return data


def safetensors_header(data, path: str) -> tuple[dict, int]:
    """The JSON header of a safetensors buffer, and where its data section starts."""
    try:
        (n,) = struct.unpack("<Q", bytes(data[:8]))
        if n > len(data) - 8:
            raise ValueError(f"a header of {n} bytes in a file of {len(data)}")
        return json.loads(bytes(data[8 : 8 + n])), 8 + n
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not a safetensors file ({e})") from e


def tensors_of(data, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file held in ``data``.

    A writable buffer (a mapping) gives tensors that are views of it; bytes (read from an object
    store) are parsed by the safetensors library, which copies them. Either way the header must
    describe the data exactly, as the safetensors format requires: known dtypes, non-negative
    shapes, byte ranges of the right length that tile the data section with no gap or overlap.

    Raises:
        CorruptCheckpointError: the header lies about the data.
    """
    header, base = safetensors_header(data, path)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    layout = []
    for key, info in header.items():
        try:
            dtype = DTYPE_NAMES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            start, stop = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} has a bad header entry ({e!r})") from e
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if any(d < 0 for d in shape) or stop - start != nbytes:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} of shape {shape} does not fit bytes {start}..{stop}")
        layout.append((start, stop, key, dtype, shape))
    end = 0
    for start, stop, key, _, _ in sorted(layout):
        if start != end:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} starts at byte {start} of the data, not {end} "
                                         "(its ranges overlap or leave a gap)")
        end = stop
    if base + end != len(data):
        raise CorruptCheckpointError(
            f"{path}: the tensors cover {end} bytes of data, the file holds {len(data) - base}")
    if isinstance(data, bytes):
        try:
            return st_load(data), metadata
        except Exception as e:  # safetensors raises its own SafetensorError on malformed files
            raise CorruptCheckpointError(f"{path}: unreadable safetensors file ({e})") from e
    out: dict[str, torch.Tensor] = {}
    for start, stop, key, dtype, shape in layout:
        if stop == start:
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=stop - start, offset=base + start)
        if (base + start) % raw.new_empty((), dtype=dtype).element_size():
            raw = raw.clone()  # not aligned for its dtype (another writer's file): an aligned copy
        out[key] = raw.view(dtype).reshape(shape)
    return out, metadata


def read_safetensors(storage: Storage, path: str, entry: FileEntry | None):
    """Tensors and metadata of a safetensors file, checked against ``entry``, mapped on POSIX."""
    return tensors_of(map_verified(storage, path, entry), path)
