"""Loading a sharded state into a model and optimizer of any world size (DTensor or plain).

Each rank needs only the blocks that overlap its own: it reads the header of every shard file
(a few kilobytes) to find them, then reads and checks (size, CRC-32 against the manifest) only
the files that hold such blocks, and copies the overlapping parts. Nothing is gathered and no
collective runs, except one agreement in :func:`agree` so that every rank fails when one does.

Optimizer state is matched by parameter name, not position, so the optimizer may be freshly
built on another world size; its moments become DTensors placed like their parameters.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import CheckpointConfigError, CorruptCheckpointError
from ckptd.storage import Storage
from ckptd.verify import CommittedStep
from ckptd.workers import sharded
from ckptd.workers.dtensor import GROUPS_FILE, OPTIM_PREFIX, local_box, local_tensor, parameter_names
from ckptd.workers.files import load_json
from ckptd.workers.mapped import map_verified, read_safetensors
from ckptd.workers.safetensors_io import DTYPE_NAMES

_MAX_HEADER = 100 * 2**20  # as the safetensors library: a larger header is damage


@dataclass(frozen=True)
class _Block:
    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str


def _overlap(a_off, a_shape, b_off, b_shape) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where boxes a and b meet: the slices of each, or None if they do not."""
    ia, ib = [], []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape, strict=True):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        ia.append(slice(lo - ao, hi - ao))
        ib.append(slice(lo - bo, hi - bo))
    return tuple(ia), tuple(ib)


class ShardedCheckpoint:
    """The shards of one committed sharded directory, read lazily and verified per file."""

    def __init__(self, storage: Storage, committed: CommittedStep, rel_dir: str) -> None:
        self.storage, self.committed = storage, committed
        self.prefix = rel_dir.strip("/") + "/" if rel_dir.strip("/") else ""
        self.base = f"{committed.path}/{self.prefix}".rstrip("/")
        meta = self._json(sharded.METADATA)
        self.layout = sharded.Layout.of(meta, f"{self.base}/{sharded.METADATA}")
        self.blocks: dict[str, list[_Block]] = {}
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.read_files: list[str] = []
        for name in self.layout.files:
            for key, block in self._header_blocks(name):
                self.blocks.setdefault(key, []).append(block)
        self._check_tiling()

    def _check_tiling(self) -> None:
        """Every tensor's blocks agree on dtype and global shape, and tile it exactly: a forged
        header whose block overlaps another could otherwise hide a hole of the same size.

        The headers are not verified yet, but a block read later is checked against its verified
        file's header (:meth:`copies`), so a tiling that holds here holds for the data used."""
        for key, blocks in self.blocks.items():
            first = blocks[0]
            odd = [b.file for b in blocks if b.dtype != first.dtype or b.global_shape != first.global_shape]
            if odd or not sharded.tiles(first.global_shape, [(b.offsets, b.shape) for b in blocks]):
                files = sorted({b.file for b in blocks})
                for name in files:
                    self._file(name)  # a file damaged after the commit is named as such
                raise CorruptCheckpointError(
                    f"{self.base}: the blocks of {key!r} in {files[:4]} do not tile a {first.dtype} tensor of "
                    f"shape {first.global_shape} exactly (they overlap, leave a gap or disagree on dtype or shape)")

    def has(self, name: str) -> bool:
        return self.prefix + name in self.committed.files

    def _entry(self, name: str):
        entry = self.committed.files.get(self.prefix + name)
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.base}/{name} is not listed in the manifest of step {self.committed.step}")
        return entry

    def _json(self, name: str) -> Any:
        path = f"{self.base}/{name}"
        return load_json(bytes(map_verified(self.storage, path, self._entry(name))), path)

    def _header_blocks(self, name: str):
        """The blocks a shard file says it holds, from its header alone. Not verified: it only
        chooses which files to read, and those are verified before any of their bytes is used."""
        path = f"{self.base}/{name}"
        size = self._entry(name).size
        try:
            with self.storage.fs.open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(size - 8, _MAX_HEADER):
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
            file_meta = header.pop("__metadata__", None) or {}
            for key, info in header.items():
                shape = tuple(int(d) for d in info["shape"])
                offsets, whole = self.layout.piece(key, torch.empty(shape, device="meta"), file_meta, path)
                yield key, _Block(name, offsets, shape, whole, str(info["dtype"]))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: missing") from None
        except (struct.error, ValueError, TypeError, KeyError, AttributeError) as e:
            raise CorruptCheckpointError(f"{path}: not a readable shard file ({e})") from e

    def global_shape(self, key: str) -> tuple[int, ...] | None:
        if key in self.layout.shapes:
            return self.layout.shapes[key]
        blocks = self.blocks.get(key)
        return blocks[0].global_shape if blocks else None

    def dtype(self, key: str) -> torch.dtype:
        return DTYPE_NAMES[self.blocks[key][0].dtype]

    def _file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._tensors:
            self.read_files.append(self.prefix + name)
            path = f"{self.base}/{name}"
            tensors, file_meta = read_safetensors(self.storage, path, self._entry(name))
            # The plan came from the header read before the file was checked: hold the checked
            # file to it, so that no change in between can place a block elsewhere.
            for key, blocks in self.blocks.items():
                for b in blocks:
                    if b.file == name and (key not in tensors or (b.offsets, b.global_shape) != self.layout.piece(
                            key, tensors[key], file_meta, path)):
                        raise CorruptCheckpointError(f"{path}: changed while it was read (block of {key!r})")
            self._tensors[name] = tensors
        return self._tensors[name]

    def copies(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]
               ) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
        """What fills the box (``offsets``, ``shape``) of tensor ``key``: (slices of the box, source) pairs.

        Raises:
            CorruptCheckpointError: the saved blocks do not cover the box exactly.
        """
        out, covered = [], 0
        for block in self.blocks.get(key, []):
            meet = _overlap(offsets, shape, block.offsets, block.shape)
            if meet is None:
                continue
            source = self._file(block.file).get(key)
            if source is None or tuple(source.shape) != block.shape or source.dtype != DTYPE_NAMES.get(block.dtype):
                raise CorruptCheckpointError(f"{self.base}/{block.file}: tensor {key!r} differs from its header")
            into, of = meet
            out.append((into, source[of]))
            covered += math.prod(s.stop - s.start for s in into)
        if covered != math.prod(shape):
            raise CorruptCheckpointError(
                f"{self.base}: the shards hold {covered} of the {math.prod(shape)} elements of {key!r} at {offsets}")
        return out


class _Fill:
    """Copies into one tensor's local block, prepared now and run later."""

    def __init__(self, target: torch.Tensor, key: str, ckpt: ShardedCheckpoint) -> None:
        offsets, shape = local_box(target)
        local = local_tensor(target)
        if tuple(local.shape) != shape:
            raise CheckpointConfigError(
                f"{key}: this rank holds a block of shape {tuple(local.shape)}, and its placements give {shape}; "
                "ckptd loads DTensors split as DTensor splits them (torch.chunk)")
        self.target = target
        self.parts = ckpt.copies(key, offsets, shape) if math.prod(shape) else []

    def __call__(self) -> None:
        local = local_tensor(self.target)  # shares the parameter's storage
        with torch.no_grad():
            for into, source in self.parts:
                local[into].copy_(source)


def _check_model(ckpt: ShardedCheckpoint, targets: Mapping[str, torch.Tensor], strict: bool) -> list[str]:
    saved = {k for k in ckpt.blocks if not k.startswith(OPTIM_PREFIX)}
    saved |= {k for k, s in ckpt.layout.shapes.items() if not k.startswith(OPTIM_PREFIX)}
    missing, unexpected = sorted(set(targets) - saved), sorted(saved - set(targets))
    if strict and (missing or unexpected):
        raise CheckpointConfigError(
            f"the sharded state in {ckpt.base} does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}")
    wrong = [f"{k}: {ckpt.global_shape(k)} vs {tuple(targets[k].shape)}" for k in saved & set(targets)
             if ckpt.global_shape(k) != tuple(targets[k].shape)]
    if wrong:
        raise CheckpointConfigError(f"the sharded state in {ckpt.base} has other shapes than the model: {wrong[:5]}")
    return sorted(saved & set(targets))


def _optimizer_loader(ckpt: ShardedCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                      ) -> Callable[[], None]:
    if not ckpt.has(GROUPS_FILE):
        raise CheckpointConfigError(
            f"{ckpt.base} holds no optimizer state ({GROUPS_FILE} is missing); save it with "
            "sharded_state(model, optimizer), or leave optimizer=None")
    saved = ckpt._json(GROUPS_FILE)
    where = f"{ckpt.base}/{GROUPS_FILE}"
    try:
        groups, scalars = saved["param_groups"], saved.get("scalars", {})
        saved_names = [list(g["params"]) for g in groups]
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise TypeError("param_groups is not a list of objects")
        if not isinstance(scalars, dict) or not all(
                isinstance(v, dict) and all(_is_json_scalar(x) for x in v.values()) for v in scalars.values()):
            raise TypeError("scalars is not an object of objects of numbers, strings or booleans")
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: unreadable ({e})") from e
    kind = saved.get("type")
    if kind is not None and kind != type(optimizer).__name__:
        raise CheckpointConfigError(
            f"{where} holds the state of a {kind} optimizer, and this one is a {type(optimizer).__name__}; build "
            f"a {kind}, or leave optimizer=None to start it fresh")
    names = parameter_names(model)
    ours = [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]
    if ours != saved_names:
        raise CheckpointConfigError(
            f"the optimizer's parameter groups differ from the saved ones ({[len(g) for g in ours]} vs "
            f"{[len(g) for g in saved_names]} parameters per group; {_groups_difference(ours, saved_names)}); "
            "build the optimizer over the same parameters in the same groups")
    params = {name: p for g in optimizer.param_groups for p in g["params"] for name in [names[id(p)]]}
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    fills = []
    keys = set(ckpt.blocks) | set(ckpt.layout.shapes)
    for key in sorted(k for k in keys if k.startswith(OPTIM_PREFIX)):
        rest = key[len(OPTIM_PREFIX):]
        name, _, state_key = rest.rpartition(".")
        if name not in params:
            raise CheckpointConfigError(
                f"{ckpt.base}: optimizer state {key!r} belongs to no parameter of the optimizer")
        p, shape = params[name], ckpt.global_shape(key)
        dtype = ckpt.dtype(key) if key in ckpt.blocks else torch.float32
        if shape == tuple(p.shape):
            t = torch.zeros_like(p, dtype=dtype)  # a DTensor placed like its parameter
        else:
            t = torch.zeros(shape, dtype=dtype, device="cpu")
        fills.append(_Fill(t, key, ckpt))
        per_param.setdefault(name, {})[state_key] = t
    for fill in fills:  # into new tensors: nothing of the optimizer changes yet
        fill()
    for name, values in scalars.items():
        if name not in params:
            raise CorruptCheckpointError(f"{where}: state of {name!r}, which is no parameter of the optimizer")
        both = sorted(set(values) & set(per_param.get(name, {})))
        if both:
            raise CorruptCheckpointError(f"{where}: {name!r} has {both} both as tensors and as scalars")

    # Everything is decided here, so that applying it cannot fail half-way.
    states = {params[name]: {**per_param.get(name, {}), **scalars.get(name, {})}
              for name in set(per_param) | set(scalars)}
    settings = [{k: tuple(v) if isinstance(v, list) and isinstance(group.get(k), tuple) else v
                 for k, v in saved_group.items() if k != "params"}
                for group, saved_group in zip(optimizer.param_groups, groups, strict=True)]

    def apply() -> None:
        optimizer.state.clear()
        optimizer.state.update(states)
        for group, values in zip(optimizer.param_groups, settings, strict=True):
            group.update(values)

    return apply


def _is_json_scalar(x: Any) -> bool:
    return x is None or isinstance(x, (bool, int, float, str)) or (
        isinstance(x, list) and all(_is_json_scalar(v) for v in x))


def load_sharded_state(
    storage: Storage,
    committed: CommittedStep,
    rel_dir: str,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> Callable[[], None]:
    """Read and check this rank's part of a sharded state; return the function that applies it.

    The model's parameters may be DTensors of any mesh and world size, or plain tensors (then
    the whole tensor is read). Nothing is changed until the returned function runs.

    Args:
        storage, committed: The root and a committed step of it (:func:`ckptd.verify.open_step`).
        rel_dir: The sharded directory, relative to the step directory.
        model: Loads ``model.state_dict()``'s tensors.
        optimizer: Loads the optimizer state saved by :func:`ckptd.workers.sharded_state`.
        strict: Names must match exactly.

    Raises:
        CorruptCheckpointError: a file read differs from the manifest, or the blocks do not
            cover a tensor.
        CheckpointConfigError: names, shapes or parameter groups do not fit.
    """
    ckpt = ShardedCheckpoint(storage, committed, rel_dir)
    steps = []
    if model is not None:
        targets = model.state_dict()
        fills = [_Fill(targets[k], k, ckpt) for k in _check_model(ckpt, targets, strict)]
        steps.append(lambda: [f() for f in fills])
    if optimizer is not None:
        if model is None:
            raise CheckpointConfigError("the optimizer's state is loaded by parameter name: pass model= too")
        steps.append(_optimizer_loader(ckpt, model, optimizer))
    return lambda: [s() for s in steps]


def agree(ok: bool) -> None:
    """Every rank of the default process group learns whether all of them succeeded so far.

    Raises:
        CorruptCheckpointError: on the ranks that succeeded, when another rank failed (that
            rank raises its own error, which names the file).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    failed = torch.tensor([0 if ok else dist.get_rank() + 1], dtype=torch.int64, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if ok and int(failed.item()):
        raise CorruptCheckpointError(
            f"rank {int(failed.item()) - 1} could not load its part of the checkpoint (its error names the file); "
            "no rank changed anything")


def _groups_difference(ours: list[list[str]], saved: list[list[str]]) -> str:
    """The first place where the optimizer's parameter names per group differ from the saved ones,
    in words (a name in one place but not the other, or a group or parameters one side lacks)."""
    for i, (mine, theirs) in enumerate(zip(ours, saved, strict=False)):
        if mine == theirs:
            continue
        pairs = [(a, b) for a, b in zip(mine, theirs, strict=False) if a != b]
        if pairs:
            return f"in group {i}, first differences (this optimizer's, the saved): {pairs[:3]}"
        if len(mine) < len(theirs):
            return f"group {i} lacks the saved parameters {theirs[len(mine):][:3]}"
        return f"group {i} has parameters the saved one lacks: {mine[len(theirs):][:3]}"
    if len(ours) < len(saved):
        return f"the saved group {len(ours)} of parameters {saved[len(ours)][:3]} is missing"
    return f"group {len(saved)} of parameters {ours[len(saved)][:3]} was not saved"
