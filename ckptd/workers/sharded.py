"""Sharded model state: each rank writes its own pieces, rank 0 the shared metadata.

    dir/
      sharded_metadata.json          rank 0: format, version, world size, global shapes
      shard-00000.safetensors        rank 0's pieces; each tensor's offsets are in the file's
      shard-00001.safetensors        own metadata, so a reader needs nothing but the directory
      ...

Version 2 (this one) is also a PyTorch DCP checkpoint: every file's ``__metadata__`` holds
``DCP_SHARDING_INFO`` (each piece's ``saved_offsets``) as ``torch.distributed.checkpoint``'s
``HuggingFaceStorageWriter`` writes it, so ``dcp.load(state, storage_reader=
HuggingFaceStorageReader(dir))`` reads it into DTensors of any world size, without any pickle.
Version 1 files (``ckptd_pieces`` with offsets and global shape) are still read.

The world size is not part of any file name, so a run can resume on any number of ranks
(:func:`ckptd.workers.weights.read_weights`, or :mod:`ckptd.workers.reshard` for DTensors).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import CheckpointConfigError, CorruptCheckpointError
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.units import check_rank
from ckptd.workers.files import write_json
from ckptd.workers.hf import save_hf_model
from ckptd.workers.safetensors_io import check_tensors, write_safetensors

METADATA = "sharded_metadata.json"
FORMAT = "ckptd-sharded"
VERSION = 2
PIECES_KEY = "ckptd_pieces"  # version 1: {"offsets", "global_shape"} per tensor
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"  # version 2, as DCP's HuggingFaceStorageWriter: {"saved_offsets"}
DCP_VERSION_KEY = "DCP_VERSION"


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


@dataclass(frozen=True)
class Shard:
    """One rank's piece of a tensor: a block starting at ``offsets`` of a ``global_shape`` tensor."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def shard_dim0(state_dict: Mapping[str, torch.Tensor], rank: int, world_size: int) -> dict[str, Shard]:
    """Rank ``rank``'s FSDP-style piece of every tensor: a slice along dim 0, as ``torch.chunk``
    would cut it (the last ranks may get smaller or empty pieces). 0-d tensors go to rank 0."""
    check_rank(rank, world_size)
    out = {}
    for key, t in state_dict.items():
        if t.dim() == 0:
            if rank == 0:
                out[key] = Shard(t, (), ())
            continue
        per = -(-t.shape[0] // world_size)
        start = min(rank * per, t.shape[0])
        stop = min(start + per, t.shape[0])
        out[key] = Shard(t[start:stop], (start,) + (0,) * (t.dim() - 1), tuple(t.shape))
    return out


def dcp_header(offsets: Mapping[str, dict]) -> dict[str, str]:
    """A shard file's ``__metadata__``: each tensor's ``saved_offsets``, as DCP's HF writer puts them."""
    return {"format": "pt", DCP_SHARDING_KEY: json.dumps(offsets, separators=(",", ":")), DCP_VERSION_KEY: "1.0"}


def metadata_of(world_size: int, files: list[str], shapes: Mapping[str, Any]) -> dict:
    """``sharded_metadata.json``: the shard files and every tensor's global shape."""
    return {"format": FORMAT, "version": VERSION, "world_size": world_size, "files": files,
            "shapes": {k: [int(d) for d in v] for k, v in sorted(shapes.items())}}


def save_sharded(
    out_dir: str,
    shards: Mapping[str, Shard | torch.Tensor],
    *,
    rank: int,
    world_size: int,
    storage_options: dict | None = None,
    global_shapes: Mapping[str, tuple[int, ...]] | None = None,
    extra_files: Mapping[str, Any] | None = None,
) -> list[WrittenFile]:
    """Write this rank's shard of the state (and, on rank 0, the shared metadata).

    Args:
        out_dir: Destination directory, the same on every rank. It should hold nothing but
            the shards: a DCP reader reads every ``.safetensors`` file in it.
        shards: Name -> :class:`Shard` (this rank's piece) or plain tensor (replicated on every
            rank; written by rank 0 only). Snapshot the tensors first. Empty pieces are skipped.
        rank, world_size: This rank, and how many ranks write.
        storage_options: fsspec options for ``out_dir``.
        global_shapes: Rank 0: the global shape of every tensor any rank writes, when rank 0
            does not hold a piece of each (by default, those of ``shards``).
        extra_files: Rank 0: name -> JSON value, written next to the metadata (the optimizer's
            parameter groups, for instance).

    Raises:
        CheckpointConfigError: bad rank, a piece that does not fit its global shape; nothing
            was written.
    """
    check_rank(rank, world_size)
    tensors: dict[str, torch.Tensor] = {}
    offsets: dict[str, dict] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for key, value in shards.items():
        if isinstance(value, torch.Tensor):
            value = Shard(value, (0,) * value.dim(), tuple(value.shape))
            if rank != 0:
                shapes[key] = value.global_shape
                continue
        if not isinstance(value, Shard):
            raise CheckpointConfigError(f"shards[{key!r}] must be a Shard or a tensor, got {type(value).__name__}")
        t = value.tensor
        if len(value.offsets) != t.dim() or len(value.global_shape) != t.dim() or any(
            o < 0 or o + n > g for o, n, g in zip(value.offsets, t.shape, value.global_shape, strict=True)
        ):
            raise CheckpointConfigError(
                f"shards[{key!r}]: a piece of shape {tuple(t.shape)} at offsets {value.offsets} does not fit "
                f"a tensor of shape {value.global_shape}"
            )
        shapes[key] = tuple(value.global_shape)
        if t.numel() == 0 and t.dim() > 0:
            continue  # a rank past the end of a short dimension (FSDP over more ranks than rows)
        tensors[key] = t
        offsets[key] = {"saved_offsets": list(value.offsets)}
    check_tensors(tensors, "shards")
    storage = Storage(out_dir, storage_options)
    storage.makedirs(storage.root)
    written = [write_safetensors(storage, f"{storage.root}/{shard_name(rank)}", tensors, dcp_header(offsets))]
    if rank == 0:
        shapes.update(global_shapes or {})
        written.append(write_json(storage, f"{storage.root}/{METADATA}", metadata_of(
            world_size, [shard_name(r) for r in range(world_size)], shapes)))
        for name, value in (extra_files or {}).items():
            written.append(write_json(storage, f"{storage.root}/{name}", value))
    return written


@dataclass(frozen=True)
class Layout:
    """What ``sharded_metadata.json`` says: the shard files, and the global shape of every tensor
    (version 2; version 1 records shapes in each file instead)."""

    version: int
    files: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, meta: Any, path: str) -> Layout:
        try:
            if meta.get("format") != FORMAT:
                raise ValueError("not a ckptd sharded directory")
            version = int(meta.get("version", 1))
            if version not in (1, 2):
                raise ValueError(f"version {version}; this ckptd reads versions 1 and 2, upgrade it")
            world = int(meta["world_size"])
            files = tuple(meta.get("files") or (shard_name(r) for r in range(world)))
            shapes = {str(k): tuple(int(d) for d in v) for k, v in meta.get("shapes", {}).items()}
            if any(not isinstance(f, str) or "/" in f or not f.endswith(".safetensors") for f in files):
                raise ValueError(f"bad shard file names {list(files)[:4]}")
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{path}: {e}") from e
        return cls(version, files, shapes)

    def piece(self, key: str, t: torch.Tensor, file_meta: Mapping[str, str], path: str
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where tensor ``key`` of the shard file at ``path`` sits: its offsets and global shape.

        Raises:
            CorruptCheckpointError: the file has no placement for it, or the piece does not fit.
        """
        try:
            if self.version == 1:
                info = json.loads(file_meta.get(PIECES_KEY, "{}"))[key]
                offsets, shape = tuple(info["offsets"]), tuple(info["global_shape"])
            else:
                info = json.loads(file_meta.get(DCP_SHARDING_KEY, "{}"))[key]
                offsets, shape = tuple(info["saved_offsets"]), self.shapes[key]
            offsets = tuple(int(o) for o in offsets)
        except KeyError:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} has no placement in the shard metadata") from None
        except (TypeError, ValueError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{path}: unreadable placement of {key!r} ({e})") from e
        if len(offsets) != t.dim() or len(shape) != t.dim() or any(
                o < 0 or o + n > g for o, n, g in zip(offsets, t.shape, shape, strict=True)):
            raise CorruptCheckpointError(f"{path}: piece of {key!r} does not fit its tensor {shape}")
        return offsets, shape


def tiles(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether blocks (offsets, shape) tile a tensor of ``shape``: as many elements as it has,
    each inside it, and no two overlapping (so none is missing either)."""
    numel = 1
    for d in shape:
        numel *= d
    total = 0
    for o, n in boxes:
        size = 1
        for d in n:
            size *= d
        total += size
        if len(o) != len(shape) or len(n) != len(shape) or any(
                a < 0 or a + b > g for a, b, g in zip(o, n, shape, strict=True)):
            return False
    if total != numel:
        return False
    boxes = [(o, n) for o, n in boxes if all(n)]
    split = {d for o, n in boxes for d in range(len(shape)) if o[d] != 0 or n[d] != shape[d]}
    if len(split) <= 1:  # cut along one dimension (FSDP's dim 0): consecutive intervals must not overlap
        d = split.pop() if split else 0
        spans = sorted((o[d], o[d] + n[d]) for o, n in boxes) if shape else []
        return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    return not any(all(oa[d] < ob[d] + nb[d] and ob[d] < oa[d] + na[d] for d in range(len(shape)))
                   for i, (oa, na) in enumerate(boxes) for ob, nb in boxes[i + 1:])


def is_sharded_dir(names: set[str]) -> bool:
    return METADATA in names


def export_hf(
    sharded_dir: str, out_dir: str, config, *, storage_options: dict | None = None, **hf_options
) -> list[WrittenFile]:
    """Write a consolidated HuggingFace copy of a sharded directory (one process does it).

    ``hf_options`` go to :func:`ckptd.workers.save_hf_model` (generation_config, tokenizer,
    max_shard_size, prefix).
    """
    from ckptd.workers.weights import read_sharded_dir  # it reads this module's format

    storage = Storage(sharded_dir, storage_options)
    state = read_sharded_dir(storage, storage.root).state_dict()
    return save_hf_model(out_dir, state, config, storage_options=storage_options, **hf_options)
