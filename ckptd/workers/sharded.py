"""Sharded (FSDP-style) model state: each rank writes its own shard, rank 0 the shared metadata.

    dir/
      sharded_metadata.json          rank 0: {"format": "ckptd-sharded", "version": 1, "world_size": N}
      shard-00000.safetensors        rank 0's pieces; each tensor's offsets and global shape are
      shard-00001.safetensors        in the file's own metadata, so ...
      ...

... a reader needs nothing but the directory: it learns the world size from the metadata and
assembles every tensor from the pieces. The world size is not part of any file name, so a run
can resume on any number of ranks (:func:`ckptd.workers.weights.read_weights` then :func:`shard_dim0`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ckptd.errors import CheckpointConfigError
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.units import check_rank
from ckptd.workers.files import write_json
from ckptd.workers.hf import save_hf_model
from ckptd.workers.safetensors_io import check_tensors, write_safetensors

METADATA = "sharded_metadata.json"
FORMAT = "ckptd-sharded"
PIECES_KEY = "ckptd_pieces"


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


def save_sharded(
    out_dir: str,
    shards: Mapping[str, Shard | torch.Tensor],
    *,
    rank: int,
    world_size: int,
    storage_options: dict | None = None,
) -> list[WrittenFile]:
    """Write this rank's shard of the model state (and, on rank 0, the shared metadata).

    Args:
        out_dir: Destination directory, the same on every rank.
        shards: Name -> :class:`Shard` (this rank's piece) or plain tensor (replicated on every
            rank; written by rank 0 only). Snapshot the tensors first.
        rank, world_size: This rank, and how many ranks write.
        storage_options: fsspec options for ``out_dir``.

    Raises:
        CheckpointConfigError: bad rank, a piece that does not fit its global shape; nothing
            was written.
    """
    check_rank(rank, world_size)
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict] = {}
    for key, value in shards.items():
        if isinstance(value, torch.Tensor):
            if rank != 0:
                continue
            value = Shard(value, (0,) * value.dim(), tuple(value.shape))
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
        tensors[key] = t
        pieces[key] = {"offsets": list(value.offsets), "global_shape": list(value.global_shape)}
    check_tensors(tensors, "shards")
    storage = Storage(out_dir, storage_options)
    storage.makedirs(storage.root)
    meta = {"format": "pt", PIECES_KEY: json.dumps(pieces, separators=(",", ":"))}
    written = [write_safetensors(storage, f"{storage.root}/{shard_name(rank)}", tensors, meta)]
    if rank == 0:
        written.append(write_json(storage, f"{storage.root}/{METADATA}",
                                  {"format": FORMAT, "version": 1, "world_size": world_size}))
    return written


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
