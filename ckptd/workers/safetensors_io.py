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
from dataclasses import dataclass
from functools import partial

import torch

from ckptd.direct_io import DirectWriter, buffer_size
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
        if key == "__metadata__":
            raise CheckpointConfigError(f"{what} has a tensor named '__metadata__', the name safetensors keeps "
                                        "for the file's metadata; rename it")
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


@dataclass(frozen=True)
class SafetensorsPlan:
    """Where everything goes in the safetensors file of a dict of tensors."""

    header: bytes  #: the file's first bytes: the 8-byte header length and the JSON header, padded
    spans: tuple[tuple[int, int], ...]  #: (file offset, bytes) of each tensor, in the dict's order

    @property
    def size(self) -> int:
        return len(self.header) + sum(n for _, n in self.spans)


def plan_safetensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
                     ) -> SafetensorsPlan:
    """The layout :func:`write_safetensors` writes ``tensors`` and ``metadata`` in: the header,
    then each tensor's bytes back to back in the dict's order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    sizes = []
    for key, t in tensors.items():
        n = tensor_nbytes(t)
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        sizes.append(n)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    spans, offset = [], len(head)
    for n in sizes:
        spans.append((offset, n))
        offset += n
    return SafetensorsPlan(head, tuple(spans))


def is_image(image: torch.Tensor, plan: SafetensorsPlan, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``image`` (bytes) holds the file of ``plan``: its header at the front and
    ``tensors``, in order, as views at their offsets. The tensors' values are not compared."""
    if image.dtype != torch.uint8 or image.dim() != 1 or not image.is_contiguous() or image.device.type != "cpu":
        return False
    if image.numel() != plan.size or len(tensors) != len(plan.spans):
        return False
    base = image.data_ptr()
    for t, (offset, n) in zip(tensors.values(), plan.spans, strict=True):
        if n and (t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() != base + offset):
            return False
    return bytes(image[: len(plan.header)].numpy()) == plan.header


def write_safetensors(
    storage: Storage, path: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None,
    ready: Callable[[torch.Tensor, int], None] | None = None, image: torch.Tensor | None = None,
) -> WrittenFile:
    """Write ``tensors`` as one safetensors file at ``path``; return its size and CRC-32.

    ``ready(t, n)``, when given, is called before the first ``n`` bytes of tensor ``t`` are
    written and returns once they hold their final values: that lets the write stream behind a
    staging copy still in progress (see ``Snapshot.wait_staged``).

    ``image``, when given, may be the whole file already laid out in memory (bytes whose
    tensors are views into it, with the header written: see :func:`is_image`, which is checked
    here); the file is then written from it, page-aligned blocks with no copy where the
    storage writes with O_DIRECT. Otherwise it is ignored.

    NOTE: the tensors must not change while this runs (snapshot them first); a tensor changed
    mid-write leaves a file whose values mix two steps.
    """
    plan = plan_safetensors(tensors, metadata)
    if image is not None and is_image(image, plan, tensors):
        return write_stream(storage, path, partial(_fill_from_image, image, plan, tensors, ready), size=plan.size)

    def fill(w: ChecksumWriter) -> None:
        w.write(plan.header)
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

    return write_stream(storage, path, fill, size=plan.size)


def _fill_from_image(image: torch.Tensor, plan: SafetensorsPlan, tensors: Mapping[str, torch.Tensor],
                     ready: Callable[[torch.Tensor, int], None] | None, w: ChecksumWriter | DirectWriter) -> None:
    """Write the file from its image in pieces as large as a bounce buffer (page-aligned in the
    image), each once the tensors it covers are staged that far."""
    data = memoryview(image.numpy())
    write = getattr(w, "write_stable", w.write)
    piece = buffer_size(plan.size)
    spans = [(t, offset, n) for t, (offset, n) in zip(tensors.values(), plan.spans, strict=True)]
    first = 0  # the first tensor not wholly before this piece
    for start in range(0, len(data), piece):
        end = min(start + piece, len(data))
        if ready is not None:
            for t, offset, n in spans[first:]:
                if offset >= end:
                    break
                ready(t, min(n, end - offset))
        while first < len(spans) and spans[first][1] + spans[first][2] <= end:
            first += 1
        write(data[start:end])
