"""Safetensors files written straight from tensors into storage, and read back verified.

The format is an 8-byte little-endian header length, a JSON header (dtype, shape and byte range
of every tensor, plus string metadata), then the raw bytes of the tensors back to back. Writing
it here rather than with ``safetensors.torch.save`` lets the bytes stream into any fsspec file
with the checksum computed on the way, without a second in-memory copy of the whole file.
Reading is in :mod:`ckptd.workers.mapped` (memory-mapped, verified).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping

import torch

from ckptd.errors import CheckpointConfigError
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.workers.files import ChecksumWriter, write_stream

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
#: safetensors' dtype names -> torch dtypes.
DTYPE_NAMES: dict[str, torch.dtype] = {name: dtype for dtype, name in _DTYPES.items()}


_STREAM_CHUNK = 16 << 20  # with ``ready``: the bytes written per wait


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def check_tensors(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise CheckpointConfigError unless ``tensors`` maps string keys to savable tensors."""
    if not isinstance(tensors, Mapping):
        raise CheckpointConfigError(f"{what} must be a dict of name -> tensor, got {type(tensors).__name__}")
    for key, t in tensors.items():
        if not isinstance(key, str) or not key:
            raise CheckpointConfigError(f"{what} has a key {key!r}; keys must be non-empty strings")
        if not isinstance(t, torch.Tensor):
            raise CheckpointConfigError(
                f"{what}[{key!r}] is a {type(t).__name__}, not a tensor; safetensors holds tensors only"
            )
        if t.dtype not in _DTYPES:
            raise CheckpointConfigError(f"{what}[{key!r}] has dtype {t.dtype}, which safetensors cannot hold")
        if t.is_sparse or t.layout != torch.strided:
            raise CheckpointConfigError(f"{what}[{key!r}] is not a dense tensor; call .to_dense() first")


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(
    storage: Storage, path: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None,
    ready: Callable[[torch.Tensor, int], None] | None = None,
) -> WrittenFile:
    """Write ``tensors`` as one safetensors file at ``path``; return its size and CRC-32.

    ``ready(t, n)``, when given, is called before the first ``n`` bytes of tensor ``t`` are
    written and returns once they hold their final values: that lets the write stream behind a
    staging copy still in progress (see ``Snapshot.wait_staged``).

    NOTE: the tensors must not change while this runs (snapshot them first); a tensor changed
    mid-write leaves a file whose values mix two steps.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, t in tensors.items():
        n = tensor_nbytes(t)
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned

    def fill(w: ChecksumWriter) -> None:
        w.write(struct.pack("<Q", len(raw)))
        w.write(raw)
        for t in tensors.values():
            if ready is None:
                w.write(_bytes_of(t))
                continue
            ready(t, 0)
            data = _bytes_of(t)
            for start in range(0, len(data), _STREAM_CHUNK):
                end = min(start + _STREAM_CHUNK, len(data))
                ready(t, end)
                w.write(data[start:end])

    return write_stream(storage, path, fill, size=8 + len(raw) + offset)
