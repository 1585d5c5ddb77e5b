"""HuggingFace-format weights, written from a state dict and a config dict.

``transformers.AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``
load what :func:`save_hf_model` writes, offline. transformers itself is not needed to write it.

    dir/
      config.json
      generation_config.json                       if given
      tokenizer files                              if a tokenizer is given
      model.safetensors                            weights up to max_shard_size, or
      model-00001-of-0000N.safetensors ...         weights split into N shards, plus
      model.safetensors.index.json                 {"metadata": {"total_size": bytes}, "weight_map": ...}
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from ckptd.errors import CheckpointConfigError
from ckptd.layout import enclosing_root
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.workers.files import write_bytes, write_json
from ckptd.workers.safetensors_io import check_tensors, tensor_nbytes, write_safetensors
from ckptd.workers.state_dict import select_prefix

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# What tokenizers' save_pretrained writes, across tokenizer kinds; copied from a directory.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_ST_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the shard names save_hf_model writes


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (decimal) or ``"512MiB"`` (binary)."""
    if isinstance(size, bool):
        raise CheckpointConfigError(f"max_shard_size must be bytes or a size like '5GB', got {size!r}")
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE_RE.match(str(size))
        if not m:
            raise CheckpointConfigError(f"max_shard_size must be bytes or a size like '5GB' or '512MiB', got {size!r}")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if n < 1:
        raise CheckpointConfigError(f"max_shard_size must be >= 1 byte, got {size!r}")
    return n


def as_dict(obj: Any, what: str) -> dict:
    """A config given as a dict or as an object with ``to_dict()`` (a transformers/peft config)."""
    if isinstance(obj, Mapping):
        return dict(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise CheckpointConfigError(f"{what} must be a dict or have to_dict(), got {type(obj).__name__}")


def _plan_shards(tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        n = tensor_nbytes(t)
        if shards[-1] and size + n > limit:  # a tensor larger than the limit gets a shard alone
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def save_hf_model(
    out_dir: str,
    state_dict: Mapping[str, torch.Tensor],
    config: Any,
    *,
    generation_config: Any = None,
    tokenizer: Any = None,
    max_shard_size: int | str = "5GB",
    prefix: str | None = None,
    storage_options: dict | None = None,
) -> list[WrittenFile]:
    """Write a model in HuggingFace format into ``out_dir`` (a step directory, or a folder in one).

    Run it inside a save unit (``coord.save_async("hf", lambda: save_hf_model(...), step)``) on
    one rank; the files it returns are listed in the step manifest without being read back.

    Saving into a folder that holds an older save replaces it: once the new weights are written,
    the old save's safetensors weight files that were not overwritten (``model-0000N-of-0000M``
    shards, and ``model.safetensors`` or the index, whichever this save does not write) are
    removed, as ``save_pretrained`` does with old shards. Other files are left as they are. Not
    inside a checkpoint root: a step's directory may hold the files of its committed state dict,
    which nothing may change.

    Args:
        out_dir: Destination directory, a path or fsspec URL.
        state_dict: Tensor name -> tensor, already snapshotted (see :func:`ckptd.workers.snapshot`).
        config: The model config, as a dict or an object with ``to_dict()``; it must have
            ``model_type`` so that ``AutoConfig`` can read it.
        generation_config: Optional dict or object with ``to_dict()``; ``eos_token_id`` may be
            a list (OLMo has two).
        tokenizer: Optional tokenizer with ``save_pretrained`` (saved to a temporary local
            directory, then copied), or a local directory holding tokenizer files.
        max_shard_size: Weights above this are split into numbered shards with an index.
        prefix: Save only this attribute of a composite model (``"policy"``), with the prefix
            stripped from the keys.
        storage_options: fsspec options for ``out_dir``.

    Returns:
        The files written.

    Raises:
        CheckpointConfigError: bad input; nothing was written.
    """
    tensors = dict(state_dict) if prefix is None else select_prefix(state_dict, prefix)
    check_tensors(tensors, "state_dict")
    if not tensors:
        raise CheckpointConfigError("state_dict is empty; there are no weights to save")
    cfg = as_dict(config, "config")
    if not cfg.get("model_type"):
        raise CheckpointConfigError(
            "config has no 'model_type'; pass model.config (or its to_dict()), which AutoConfig needs"
        )
    gen = None if generation_config is None else as_dict(generation_config, "generation_config")
    limit = parse_size(max_shard_size)
    tokenizer_dir = None
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        if not isinstance(tokenizer, (str, os.PathLike)) or not os.path.isdir(tokenizer):
            raise CheckpointConfigError(
                "tokenizer must have save_pretrained() or be a local directory of tokenizer files, "
                f"got {tokenizer!r}"
            )
        tokenizer_dir = os.fspath(tokenizer)

    storage = Storage(out_dir, storage_options)
    base = storage.root
    storage.makedirs(base)
    written = [write_json(storage, f"{base}/{CONFIG}", cfg)]
    if gen is not None:
        written.append(write_json(storage, f"{base}/{GENERATION_CONFIG}", gen))
    written += _save_tokenizer(storage, base, tokenizer, tokenizer_dir)
    shards = _plan_shards(tensors, limit)
    if len(shards) == 1:
        written.append(write_safetensors(storage, f"{base}/{WEIGHTS}", tensors, _ST_METADATA))
        _remove_old_weights(storage, base, {WEIGHTS})
        return written
    weight_map = {}
    for i, keys in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        written.append(write_safetensors(storage, f"{base}/{name}", {k: tensors[k] for k in keys}, _ST_METADATA))
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(tensor_nbytes(t) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    written.append(write_json(storage, f"{base}/{INDEX}", index))
    _remove_old_weights(storage, base, {INDEX, *weight_map.values()})
    return written


def _remove_old_weights(storage: Storage, base: str, kept: set[str]) -> None:
    """Remove the safetensors weight files of an older save in ``base`` that this save did not
    overwrite, so the folder holds one save: shards named ``model-0000N-of-0000M.safetensors``
    (what transformers' ``save_pretrained`` removes too), and also ``model.safetensors`` beside new
    shards (``from_pretrained`` would load it instead of them) or an index beside a new single
    file. Nothing else is touched: other files (``pytorch_model*.bin``, the user's) stay."""
    if enclosing_root(storage) is not None:  # base is its root
        return  # committed files never change; ckptd's start-up and gc clean what never committed
    for name in sorted(storage.file_names(base)):
        if name in kept:
            continue
        if name in (WEIGHTS, INDEX) or _SHARD_RE.fullmatch(name):
            storage.rm(f"{base}/{name}")


def _save_tokenizer(storage: Storage, base: str, tokenizer: Any, tokenizer_dir: str | None) -> list[WrittenFile]:
    if tokenizer is None:
        return []
    with tempfile.TemporaryDirectory(prefix="ckptd-tokenizer-") as tmp:
        if tokenizer_dir is None:
            tokenizer.save_pretrained(tmp)
            src, names = tmp, sorted(os.listdir(tmp))
        else:
            src, names = tokenizer_dir, [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, n))]
            if not names:
                raise CheckpointConfigError(f"{tokenizer_dir} holds none of the tokenizer files {TOKENIZER_FILES}")
        written = []
        for name in names:
            with open(os.path.join(src, name), "rb") as f:
                written.append(write_bytes(storage, f"{base}/{name}", f.read()))
        return written


def is_hf_dir(names: set[str]) -> bool:
    return WEIGHTS in names or INDEX in names
