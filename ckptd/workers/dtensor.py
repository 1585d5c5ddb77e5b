"""This rank's pieces of a DTensor state (FSDP2, HSDP, tensor parallel), ready to stage and write.

A DTensor is a global tensor of which each rank holds a block (``Shard`` placements) or a copy
(``Replicate``). :func:`sharded_state` takes, for every tensor of the model and its optimizer,
the block this rank holds and where it sits in the global tensor. No collective runs and
nothing is gathered: the local tensors are views of the live parameters and moments, which
:meth:`ckptd.CheckpointCoordinator.save_state_async` copies into reusable host buffers before
the write runs in the background. Of a replicated block only the rank at coordinate 0 of every
replicated mesh dimension writes, so each element is written once.

Names: model tensors keep their state-dict names (the HuggingFace names for an HF model, so the
shards consolidate into a loadable HF checkpoint); optimizer state is
``optim.state.{parameter name}.{state key}`` (DCP's flattened names), and the parameter groups
(hyper-parameters, parameter names) go to ``optimizer_groups.json``, which makes the state
independent of the world size and of parameter order.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.errors import CheckpointConfigError
from ckptd.manifest import WrittenFile
from ckptd.units import check_rank
from ckptd.workers.sharded import Shard, save_sharded

OPTIM_PREFIX = "optim.state."
GROUPS_FILE = "optimizer_groups.json"


def is_dtensor(t: Any) -> bool:
    # A DTensor exists only once its module was imported: importing it here would cost the
    # first save of a job without DTensors a second or more on the training thread.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The block a DTensor holds on this rank, detached (the tensor itself if it is a plain one).
    Not ``to_local()``: that is an autograd function, ten times slower over a whole state."""
    if not is_dtensor(t):
        return t.detach()
    local = getattr(t, "_local_tensor", None)
    return (t.to_local() if local is None else local).detach()


def local_box(t: torch.Tensor, coordinates: dict | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The block of the global tensor this rank holds: its offsets and shape (whole for a plain tensor).

    ``coordinates`` (id(mesh) -> this rank's coordinate) saves looking it up for every tensor of
    one state.

    Raises:
        CheckpointConfigError: a placement other than Shard(dim) or Replicate, or a local tensor
            whose shape is not the block's (the layout cannot be told).
    """
    if not is_dtensor(t):
        return (0,) * t.dim(), tuple(t.shape)
    mesh = t.device_mesh
    return _box(tuple(t.shape), tuple(mesh.shape), tuple(t.placements), _coordinate(mesh, coordinates))


def _coordinate(mesh: Any, coordinates: dict | None) -> tuple[int, ...] | None:
    """This rank's place in ``mesh``, from the mesh's process groups.

    Not ``mesh.get_coordinate()``: torch keeps that from the first process group a process
    joined, so a process that joins a new group as another rank (an elastic restart, a reused
    Ray actor) gets its old coordinate, and DCP's offsets with it (measured with torch 2.13)."""
    if coordinates is None:
        coordinates = {}
    key = id(mesh)
    if key not in coordinates:
        import torch.distributed as dist

        inside = dist.get_rank() in mesh.mesh.flatten().tolist()
        coordinates[key] = tuple(mesh.get_local_rank(i) for i in range(mesh.ndim)) if inside else None
    return coordinates[key]


@functools.lru_cache(maxsize=4096)
def _box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
         coordinate: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Cached: a state has the same few layouts at every save, and the hundreds of tensors of a
    # model and its optimizer share them.
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement

    local, offsets = list(shape), [0] * len(shape)
    for dim, p in enumerate(placements):
        # _StridedShard (FSDP2 over tensor parallelism) is a Shard subclass whose local block is
        # not one contiguous box of the global tensor; Partial holds unreduced values.
        if type(p) is Replicate:
            continue
        if type(p) is not ShardPlacement:
            raise CheckpointConfigError(
                f"a DTensor with placement {p} cannot be saved as blocks; ckptd takes Shard(dim) and "
                "Replicate placements (FSDP2 or tensor parallel alone). Redistribute it first"
            )
        if coordinate is None:
            return tuple(offsets), tuple(0 for _ in shape)
        # DTensor's split: chunks of ceil(size / n), the last ranks' short or empty (torch.chunk).
        d, n, c = p.dim % len(shape), mesh_shape[dim], coordinate[dim]
        chunk = -(-local[d] // n)
        start = min(c * chunk, local[d])
        local[d], offsets[d] = min(local[d], start + chunk) - start, offsets[d] + start
    return tuple(offsets), tuple(local)


def _writes_block(coordinate: tuple[int, ...] | None, placements: tuple) -> bool:
    """This rank writes its blocks of this layout: first replica along every replicated mesh dimension."""
    from torch.distributed.tensor import Replicate

    if coordinate is None:  # not part of the mesh
        return False
    return all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate))


def piece_of(t: torch.Tensor, key: str, coordinates: dict | None = None) -> Shard | torch.Tensor | None:
    """This rank's piece of ``t``: a :class:`Shard` of a DTensor (None when another replica
    writes it), or the tensor itself when it is a plain tensor (replicated: rank 0 writes it)."""
    if not isinstance(t, torch.Tensor):
        raise CheckpointConfigError(f"{key} is a {type(t).__name__}, not a tensor")
    if not is_dtensor(t):
        return t.detach()
    coordinates = {} if coordinates is None else coordinates
    offsets, shape = local_box(t, coordinates)
    if not _writes_block(_coordinate(t.device_mesh, coordinates), tuple(t.placements)):
        return None
    local = local_tensor(t)
    if tuple(local.shape) != shape:
        raise CheckpointConfigError(
            f"{key}: this rank holds a block of shape {tuple(local.shape)}, and its placements {t.placements} "
            f"give {shape}; ckptd takes DTensors split as DTensor splits them (torch.chunk)")
    return Shard(local, offsets, tuple(t.shape))


def _jsonable(value: Any, what: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_jsonable(v, what) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointConfigError(f"{what} is {value}; it cannot be saved as JSON")
        return value
    raise CheckpointConfigError(f"{what} is a {type(value).__name__}; optimizer groups and non-tensor "
                                "state must be numbers, strings, booleans or lists of them")


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name (the first name of a tied parameter)."""
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[dict[str, torch.Tensor], dict]:
    """The optimizer's tensors under ``optim.state.{name}.{key}``, and its groups as JSON."""
    names = parameter_names(model)
    tensors: dict[str, torch.Tensor] = {}
    groups, scalars = [], {}
    for i, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointConfigError(
                    f"optimizer group {i} holds a parameter that is not one of the model's; pass the model "
                    "whose parameters the optimizer updates")
            name = names[id(p)]
            params.append(name)
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{OPTIM_PREFIX}{name}.{k}"] = v
                else:
                    scalars.setdefault(name, {})[k] = _jsonable(v, f"optimizer state {k!r} of {name}")
        hyper = {k: _jsonable(v, f"optimizer group {i}: {k}") for k, v in group.items() if k != "params"}
        groups.append({"params": params, **hyper})
    return tensors, {"format": "ckptd-optimizer-groups", "version": 1, "type": type(optimizer).__name__,
                     "param_groups": groups, "scalars": scalars}


@dataclass
class ShardedState:
    """One rank's part of a sharded state: what to stage, and how to write the staged copy.

    Attributes:
        tensors: Name -> this rank's local block (a view of the live tensor): pass it to
            ``coord.save_state_async(name, state.tensors, step, write_fn)``.
        placements: Name -> (offsets, global shape) of each block in ``tensors``.
        replicated: Names in ``tensors`` that are plain tensors (rank 0 writes them).
        global_shapes: Global shape of every tensor, including those other ranks write.
        groups: The optimizer's groups (JSON), or None.
    """

    rank: int
    world_size: int
    tensors: dict[str, torch.Tensor]
    placements: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    replicated: set[str] = field(default_factory=set)
    global_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    groups: dict | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def save(self, coord: Any, name: str, step: int, out_dir: str, *, fenced: bool = False,
             is_state_dict: bool = False, storage_options: dict | None = None) -> None:
        """Stage :attr:`tensors` and write them in the background as one save unit of ``coord``.

        A rank with nothing to write (a replica whose blocks another rank writes) still runs its
        unit, writing an empty shard file, so every rank's unit counts toward the step.
        """
        def write(staged: Mapping[str, torch.Tensor] | None) -> list[WrittenFile]:
            return self.write(out_dir, staged, storage_options=storage_options)

        if self.tensors:
            coord.save_state_async(name, self.tensors, step, write, is_state_dict=is_state_dict, fenced=fenced)
        else:
            coord.save_async(name, lambda: write({}), step, is_state_dict=is_state_dict)

    def write(self, out_dir: str, snapshot: Mapping[str, torch.Tensor] | None = None, *,
              storage_options: dict | None = None) -> list[WrittenFile]:
        """Write this rank's shard file (and on rank 0 the metadata and optimizer groups).

        Args:
            out_dir: The sharded directory of the step, the same on every rank.
            snapshot: The staged copy of :attr:`tensors` (what ``save_state_async`` passes to
                its ``write_fn``); None writes the live tensors (they must not change meanwhile).
        """
        source = self.tensors if snapshot is None else snapshot
        shards: dict[str, Shard | torch.Tensor] = {}
        for key, t in source.items():
            if key in self.replicated:
                shards[key] = t
            else:
                offsets, shape = self.placements[key]
                shards[key] = Shard(t, offsets, shape)
        extra = {GROUPS_FILE: self.groups} if self.groups is not None else None
        return save_sharded(out_dir, shards, rank=self.rank, world_size=self.world_size,
                            storage_options=storage_options, global_shapes=self.global_shapes,
                            extra_files=extra)


def sharded_state(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> ShardedState:
    """This rank's blocks of the model's state dict and of the optimizer's state.

    Call it on the training thread after the optimizer step (it is cheap: no copy, no
    collective), then stage and write it in the background::

        sharded_state(model, optimizer).save(coord, "shards", step, f"{coord.step_dir(step)}/model",
                                             fenced=True)

    Args:
        model: An ``nn.Module`` whose parameters may be DTensors (``fully_shard``).
        optimizer: Its optimizer; its state is saved per parameter name, so it can be loaded on
            another world size (:func:`ckptd.workers.reshard.load_sharded_state`, ``resume``).
        state_dict: Save this instead of ``model.state_dict()`` (names -> tensors or DTensors).
        rank, world_size: Default to ``torch.distributed``'s, or 0 and 1 without a process group.

    Raises:
        CheckpointConfigError: a non-tensor in the state dict, an unsupported placement, an
            optimizer over parameters not in ``model``, or non-JSON hyper-parameters.
    """
    if rank is None or world_size is None:
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized()
        rank = (dist.get_rank() if ready else 0) if rank is None else rank
        world_size = (dist.get_world_size() if ready else 1) if world_size is None else world_size
    check_rank(rank, world_size)
    if state_dict is None:
        if model is None:
            raise CheckpointConfigError("pass model= or state_dict=")
        state_dict = model.state_dict()
    state = ShardedState(rank, world_size, {}, {})
    everything = dict(state_dict)
    if optimizer is not None:
        if model is None:
            raise CheckpointConfigError("the optimizer's state is saved by parameter name: pass model= too")
        optim_tensors, state.groups = optimizer_state(model, optimizer)
        everything.update(optim_tensors)
    coordinates: dict = {}
    for key, t in everything.items():
        piece = piece_of(t, key, coordinates)
        state.global_shapes[key] = tuple(t.shape)
        if piece is None:
            continue
        if isinstance(piece, Shard):
            state.tensors[key] = piece.tensor
            state.placements[key] = (piece.offsets, piece.global_shape)
        elif rank == 0:
            state.tensors[key] = piece
            state.replicated.add(key)
    return state
