"""The model weights of a committed step, in any format ckptd writes, read verified.

Where the weights are is found from the manifest: a directory (the step directory or one inside
it) that holds

    adapter_model.safetensors              a LoRA adapter (PEFT's format)
    sharded_metadata.json + shard-*        ckptd shards (:func:`ckptd.workers.save_sharded`)
    model.safetensors[.index.json]         HuggingFace safetensors, one file or sharded
    one other *.safetensors file           e.g. ``{name}.safetensors`` of ``coord.save_state_async``
    pytorch_model.bin[.index.json]         HuggingFace pickles (loaded with ``weights_only=True``)
    one other *.pt / *.bin file            a plain ``torch.save`` of a state dict

Every file is checked against the manifest before a tensor of it is used; safetensors are
memory-mapped on POSIX (:mod:`ckptd.workers.mapped`). Loading into a model checks every name and
shape first, then copies on several threads, so a refused load leaves the model as it was.
"""

from __future__ import annotations

import os
import pickle
import posixpath
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import CheckpointConfigError, CorruptCheckpointError
from ckptd.manifest import FileEntry
from ckptd.storage import Storage
from ckptd.verify import CommittedStep
from ckptd.workers import hf, lora, sharded
from ckptd.workers.dtensor import OPTIM_PREFIX
from ckptd.workers.files import load_json, load_torch
from ckptd.workers.mapped import map_verified, pool, read_safetensors
from ckptd.workers.training_state import DATA, PER_RANK

TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
_TRAINING_STATE_DIRS = PER_RANK  # optimizer/rank-00000.pt ...: not weights
_TRAINING_STATE_FILES = (DATA,)


@dataclass(frozen=True)
class Piece:
    """A block of a tensor of ``global_shape``, starting at ``offsets`` (whole: all zeros)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    @property
    def whole(self) -> bool:
        return tuple(self.tensor.shape) == self.global_shape

    def index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.tensor.shape, strict=True))


def _format_of(names: set[str]) -> str | None:
    if lora.ADAPTER_WEIGHTS in names:
        return "lora"
    if sharded.is_sharded_dir(names):
        return "sharded"
    if hf.is_hf_dir(names) or len(_single(names, ".safetensors")) == 1:
        return "safetensors"
    if TORCH_INDEX in names or TORCH_WEIGHTS in names:
        return "torch"
    return "torch" if len(_single(names, ".pt", ".bin")) == 1 else None


def _single(names: Iterable[str], *suffixes: str) -> list[str]:
    """The files with these suffixes that could be weights (not training state)."""
    return sorted(n for n in names if n.endswith(suffixes) and n not in _TRAINING_STATE_FILES)


def weight_dirs(files: Iterable[str]) -> dict[str, str]:
    """Directories (relative to the step, '' for the step itself) that hold weights, and their format."""
    by_dir: dict[str, set[str]] = {}
    for rel in files:
        d, name = posixpath.split(rel)
        if d.split("/", 1)[0] in _TRAINING_STATE_DIRS:
            continue
        by_dir.setdefault(d, set()).add(name)
    found = {d: _format_of(names) for d, names in by_dir.items()}
    return {d: f for d, f in sorted(found.items()) if f is not None}


def _summary(committed: CommittedStep) -> str:
    names = sorted(committed.files)
    if not names:  # its save functions wrote nowhere under the step's directory
        return ("no files at all: its manifest lists none (did its save functions write under "
                "ckptd.step_dir(root, step)?)")
    return ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")


class WeightSet:
    """Verified weights of one committed step: each tensor, or the pieces it was saved in.

    Attributes:
        step: The step.
        format: ``"safetensors"``, ``"sharded"``, ``"lora"`` or ``"torch"``.
        path: The directory the weights were read from.
        files: The files read, relative to the step directory (each checked against the manifest).
    """

    def __init__(self, step: int, format: str, path: str, files: list[str], pieces: dict[str, list[Piece]]):
        self.step = step
        self.format = format
        self.path = path
        self.files = files
        self._pieces = pieces

    def keys(self) -> list[str]:
        return list(self._pieces)

    def state_dict(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Name -> tensor. On CPU, tensors of mapped safetensors files are views of the mapping
        (no copy); tensors saved in pieces (ckptd shards) are assembled."""
        out = {}
        for key, pieces in self._pieces.items():
            if len(pieces) == 1 and pieces[0].whole:
                t = pieces[0].tensor
            else:
                t = torch.empty(pieces[0].global_shape, dtype=pieces[0].tensor.dtype)
                for p in pieces:
                    t[p.index()] = p.tensor
            out[key] = t if torch.device(device).type == "cpu" else t.to(device)
        return out

    def load_into(self, model: Any, strict: bool = True, adapter_name: str = "default") -> None:
        """Copy the weights into ``model`` (an ``nn.Module``; for a LoRA adapter, the ``PeftModel``).

        Every name and shape is checked before anything is copied, so a refused load changes
        nothing. Copies run on several threads; parameters may be on any device.

        Args:
            model: The module to load into.
            strict: Names must match exactly (weights tied to a loaded one, such as an LM head
                tied to the embeddings, count as loaded). Otherwise only the names both have
                are loaded.
            adapter_name: The adapter a LoRA checkpoint is loaded into.

        Raises:
            CheckpointConfigError: names or shapes do not fit the model.
        """
        self.prepare_load(model, strict, adapter_name)()

    def prepare_load(self, model: Any, strict: bool = True, adapter_name: str = "default") -> Callable[[], None]:
        """:meth:`load_into` in two halves: check now, and return the function that copies."""
        if self.format == "lora":
            return self._adapter_loader(model, adapter_name)
        targets: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
        loaded = [k for k in self._pieces if k in targets]
        # Tied weights are the same tensor under two names (not merely views of one flat buffer).
        tied = {_identity(targets[k]) for k in loaded}
        missing = sorted(k for k in targets if k not in self._pieces and _identity(targets[k]) not in tied)
        unexpected = sorted(set(self._pieces) - set(targets))
        if strict and (missing or unexpected):
            raise CheckpointConfigError(
                f"the weights of step {self.step} ({self.path}) do not fit the model: missing {_few(missing)}, "
                f"unexpected {_few(unexpected)}"
            )
        wrong = [f"{k}: {self._pieces[k][0].global_shape} vs {tuple(targets[k].shape)}" for k in loaded
                 if self._pieces[k][0].global_shape != tuple(targets[k].shape)]
        if wrong:
            raise CheckpointConfigError(
                f"the weights of step {self.step} have other shapes than the model: {_few(wrong)}")

        def copy(target: torch.Tensor, piece: Piece) -> None:
            with torch.no_grad():
                dest = target.data if piece.whole else target.data[piece.index()]
                dest.copy_(piece.tensor)

        def apply() -> None:
            jobs = [pool().submit(copy, targets[k], p) for k in loaded for p in self._pieces[k]]
            for job in jobs:
                job.result()

        return apply

    def _adapter_loader(self, model: Any, adapter_name: str) -> Callable[[], None]:
        if not hasattr(model, "peft_config"):
            raise CheckpointConfigError(
                f"step {self.step} holds a LoRA adapter ({self.path}); pass the PeftModel (the base model "
                "with the adapter) as model"
            )
        if adapter_name not in model.peft_config:
            raise CheckpointConfigError(
                f"the model has no adapter named {adapter_name!r} to load step {self.step}'s adapter into: it has "
                f"{sorted(model.peft_config)}; pass adapter_name= one of them")
        from peft import get_peft_model_state_dict, set_peft_model_state_dict  # optional, only for adapters

        # Checked before anything is copied: peft copies what fits, then reports the rest.
        expected = get_peft_model_state_dict(model, adapter_name=adapter_name)
        unexpected = sorted(set(self._pieces) - set(expected))
        if unexpected:
            raise CheckpointConfigError(
                f"the adapter of step {self.step} has weights the model has no place for: {_few(unexpected)}; "
                "load it into a PeftModel with the same target_modules")
        wrong = [f"{k}: {p[0].global_shape} vs {tuple(expected[k].shape)}" for k, p in self._pieces.items()
                 if p[0].global_shape != tuple(expected[k].shape)]
        if wrong:
            raise CheckpointConfigError(
                f"the adapter of step {self.step} has other shapes than the model: {_few(wrong)}")

        def apply() -> None:
            set_peft_model_state_dict(model, self.state_dict(), adapter_name=adapter_name)

        return apply


def locate(committed: CommittedStep, model_dir: str | None) -> tuple[str, str]:
    """The directory of the weights (relative to the step, '' for the step itself) and its format.

    Raises:
        CheckpointConfigError: ``model_dir`` holds no weights, or it is None and several
            directories do (the message lists them).
    """
    dirs = weight_dirs(committed.files)
    if model_dir is not None:
        rel = model_dir.strip("/")
        if rel not in dirs:
            where = f"in {rel!r}" if rel else "in the step directory"
            found = ", ".join(repr(d) if d else "'' (the step directory itself)" for d in sorted(dirs))
            have = f"; weights are in {found}" if dirs else f"; it has {_summary(committed)}"
            raise CheckpointConfigError(
                f"step {committed.step} has no model weights {where} (no model.safetensors, index, sharded, "
                f"adapter or single .pt file){have}. Pass model_dir= (--model-dir on the command line) where "
                "they were written"
            )
        return rel, dirs[rel]
    if len(dirs) == 1:
        return next(iter(dirs.items()))
    if not dirs:
        raise CheckpointConfigError(
            f"step {committed.step} has no model weights (no model.safetensors, index, sharded, adapter or "
            f"single .pt file); it has {_summary(committed)}. A state saved with save_state_async is the "
            "model's weights when its name is 'model' (model.safetensors)"
        )
    raise CheckpointConfigError(
        f"step {committed.step} has weights in several directories {sorted(dirs)}; pass model_dir= to pick one"
    )


def read_weights(storage: Storage, committed: CommittedStep, model_dir: str | None = None) -> WeightSet:
    """Read (and check against the manifest) the weights of a committed step.

    Args:
        storage: Storage of the root the step is under.
        committed: The step (:func:`ckptd.verify.open_step`).
        model_dir: Where the weights are, relative to the step directory; None finds them.

    Raises:
        CorruptCheckpointError: a file differs from the manifest, is missing, or is not listed.
        UnsafeCheckpointError: a pickle needs arbitrary objects.
        CheckpointConfigError: no weights, or several candidate directories.
    """
    rel, fmt = locate(committed, model_dir)
    prefix = f"{rel}/" if rel else ""
    base = f"{committed.path}/{rel}".rstrip("/")
    names = {p[len(prefix):] for p in committed.files if p.startswith(prefix) and "/" not in p[len(prefix):]}
    reader = _Reader(storage, base, committed.files, prefix, committed.step)
    if fmt == "lora":
        pieces = reader.safetensors([lora.ADAPTER_WEIGHTS])
    elif fmt == "sharded":
        pieces = reader.sharded()
    elif fmt == "safetensors":
        single = [hf.WEIGHTS] if hf.WEIGHTS in names else _single(names, ".safetensors")
        pieces = reader.indexed(hf.INDEX, single, names, reader.safetensors)
    else:
        single = [TORCH_WEIGHTS] if TORCH_WEIGHTS in names else _single(names, ".pt", ".bin")
        pieces = reader.indexed(TORCH_INDEX, single, names, reader.pickles)
    return WeightSet(committed.step, fmt, base, sorted(reader.read), pieces)


def read_sharded_dir(storage: Storage, base: str) -> WeightSet:
    """The weights of a ckptd sharded directory that is not (or not yet) part of a committed step:
    nothing to check the files against."""
    return WeightSet(-1, "sharded", base, [], _Reader(storage, base, None, "", None).sharded())


class _Reader:
    """Reads the files of one weights directory, each checked against its manifest entry
    (``manifest`` maps step-relative paths to entries; None reads unchecked)."""

    def __init__(self, storage: Storage, base: str, manifest: Mapping[str, FileEntry] | None, prefix: str,
                 step: int | None) -> None:
        self.storage, self.base, self.manifest, self.prefix, self.step = storage, base, manifest, prefix, step
        self.read: list[str] = []

    def entry(self, name: str) -> FileEntry | None:
        rel = self.prefix + name
        self.read.append(rel)
        if self.manifest is None:
            return None
        entry = self.manifest.get(rel)
        if entry is None:
            raise CorruptCheckpointError(f"{self.base}/{name} is not listed in the manifest of step {self.step}")
        return entry

    def json(self, name: str) -> Any:
        path = f"{self.base}/{name}"
        data = map_verified(self.storage, path, self.entry(name))
        return load_json(bytes(data), path)

    def indexed(self, index: str, single: list[str], names: set[str], read) -> dict[str, list[Piece]]:
        """The files an index names (checking that they hold every tensor it lists), or ``single``."""
        if index not in names:
            return read(single)
        weight_map = self.json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CorruptCheckpointError(f"{self.base}/{index} has no weight_map")
        pieces = read(sorted(set(weight_map.values())))
        missing = set(weight_map) - set(pieces)
        if missing:
            raise CorruptCheckpointError(f"{self.base}/{index} lists tensors no file holds: {sorted(missing)[:5]}")
        return pieces

    def safetensors(self, files: list[str]) -> dict[str, list[Piece]]:
        out: dict[str, list[Piece]] = {}
        for name in files:
            tensors, _ = read_safetensors(self.storage, f"{self.base}/{name}", self.entry(name))
            out.update({k: [_whole(t)] for k, t in tensors.items()})
        return out

    def pickles(self, files: list[str]) -> dict[str, list[Piece]]:
        out: dict[str, list[Piece]] = {}
        for name in files:
            path = f"{self.base}/{name}"
            obj = _load_pickle(self.storage, path, self.entry(name))
            if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                    for k, v in obj.items()):
                raise CheckpointConfigError(
                    f"{path} is not a flat state dict (name -> tensor); save model.state_dict() there, or pass "
                    "model_dir= where the weights are"
                )
            out.update({k: [_whole(t)] for k, t in obj.items()})
        return out

    def sharded(self) -> dict[str, list[Piece]]:
        meta = self.json(sharded.METADATA)
        layout = sharded.Layout.of(meta, f"{self.base}/{sharded.METADATA}")
        out: dict[str, list[Piece]] = {}
        for name in layout.files:
            path = f"{self.base}/{name}"
            tensors, st_meta = read_safetensors(self.storage, path, self.entry(name))
            for key, t in tensors.items():
                if key.startswith(OPTIM_PREFIX):
                    continue  # optimizer moments saved with the weights (sharded_state): not weights
                offsets, shape = layout.piece(key, t, st_meta, path)
                out.setdefault(key, []).append(Piece(t, offsets, shape))
        shapes = {k: v for k, v in layout.shapes.items() if not k.startswith(OPTIM_PREFIX)}
        for key, shape in shapes.items():
            if key not in out and 0 in shape:  # an empty tensor has no piece anywhere
                out[key] = [Piece(torch.empty(shape), (0,) * len(shape), shape)]
        short = [k for k, ps in out.items() if not _covers(ps)] + sorted(set(shapes) - set(out))
        if short:
            raise CorruptCheckpointError(f"{self.base}: the shards do not cover tensors {short[:5]} exactly")
        return out


def _covers(pieces: list[Piece]) -> bool:
    """The pieces tile their tensor, with one dtype and one global shape."""
    shape = pieces[0].global_shape
    if any(p.global_shape != shape or p.tensor.dtype != pieces[0].tensor.dtype for p in pieces):
        return False
    return sharded.tiles(shape, [(p.offsets, tuple(p.tensor.shape)) for p in pieces])


def _identity(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _few(names: list[str]) -> str:
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _whole(t: torch.Tensor) -> Piece:
    return Piece(t, (0,) * t.dim(), tuple(t.shape))


def _load_pickle(storage: Storage, path: str, entry) -> Any:
    """A verified ``torch.save`` file, loaded with ``weights_only=True`` (memory-mapped on POSIX)."""
    if not storage.is_posix:
        return load_torch(map_verified(storage, path, entry), path)
    try:
        before = os.stat(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing") from None
    data = map_verified(storage, path, entry)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        return load_torch(bytes(data), path)  # raises UnsafeCheckpointError, with the reason
    except RuntimeError:  # the legacy (non-zip) format cannot be mapped: load the checked bytes
        return load_torch(bytes(data), path)
    after = os.stat(path)
    if (after.st_ino, after.st_size, after.st_mtime_ns) != (before.st_ino, before.st_size, before.st_mtime_ns):
        raise CorruptCheckpointError(f"{path} changed while it was read")
    return obj
