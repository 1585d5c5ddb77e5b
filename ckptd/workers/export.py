"""HuggingFace export of a committed step's weights, in a Ray task: never on the training thread.

Training saves its shards (each rank its own block, nothing gathered); when an HF copy is
wanted, for evaluation or serving, a task on any node of the cluster reads the committed shards
(each file checked against the manifest), assembles the full tensors in its own memory and writes
``model.safetensors`` (split with an index above ``max_shard_size``) and ``config.json``, so
``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it. Optimizer state saved with the
weights is left out.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from typing import Any

import ray

from ckptd.errors import CheckpointConfigError, CheckpointError
from ckptd.layout import enclosing_root
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.units import check_step
from ckptd.verify import open_step
from ckptd.workers.hf import save_hf_model
from ckptd.workers.weights import read_weights

log = logging.getLogger("ckptd.export")


def export_hf_step(
    root: str,
    step: int,
    out_dir: str,
    config: Any,
    *,
    model_dir: str | None = None,
    wait_s: float = 0.0,
    storage_options: dict | None = None,
    out_storage_options: dict | None = None,
    **hf_options: Any,
) -> list[WrittenFile]:
    """Write an HF copy of the weights of committed ``step`` under ``root`` into ``out_dir``.

    Args:
        root: The checkpoint root.
        step: A committed step (a full checkpoint or a state dict).
        out_dir: Where the HF files go (outside the root's step directories, whose committed
            files never change).
        config: The model config (``PretrainedConfig`` or dict with ``model_type``).
        model_dir: The weights' directory in the step; None finds it.
        wait_s: Wait up to this long for ``step`` to commit (the export may be started right
            after the save was queued).
        storage_options, out_storage_options: fsspec options for ``root`` and ``out_dir``.
        hf_options: :func:`ckptd.workers.save_hf_model`'s (max_shard_size, generation_config,
            tokenizer).

    Raises:
        CheckpointConfigError: ``out_dir`` is inside a checkpoint root, is a file, or is not empty
            (nothing is read or written then); or ``config`` does not fit the weights: a model
            built from it (on the meta device, when transformers can build it) has another shape
            for a tensor, or other layers (nothing is written then).
        CheckpointError: ``step`` did not commit within ``wait_s``.
        CorruptCheckpointError: a shard differs from the manifest.
    """
    check_step(step)
    storage = Storage(root, storage_options)
    _check_out_dir(storage, Storage(out_dir, out_storage_options))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            committed = open_step(storage, step, None)
            break
        except CheckpointError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
    weights = read_weights(storage, committed, model_dir)
    if weights.format == "lora":
        raise CheckpointConfigError(
            f"step {step} holds a LoRA adapter ({weights.path}), not a whole model: an HF folder of it would load "
            "as a model with random base weights. Load the base model with the adapter (peft), merge it "
            "(merge_and_unload) and save_pretrained that, or serve the adapter as it is")
    state = weights.state_dict()
    _check_config_fits(state, config, step)
    return save_hf_model(out_dir, state, config, storage_options=out_storage_options, **hf_options)


def _config_model_shapes(config: Any) -> tuple[str, dict[str, tuple[int, ...]]] | None:
    """The class name and the tensor shapes of the model ``config`` describes, built on the meta
    device (no memory, no weights initialised: a second or two for a 7B config), or None when
    transformers cannot build it here (not installed, an unknown or remote-code ``model_type``, a
    dict without ``model_type``): then nothing is compared."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    try:
        if isinstance(config, transformers.PretrainedConfig):
            cfg = copy.deepcopy(config)
        else:
            values = dict(config.items()) if hasattr(config, "items") else dict(config.to_dict())
            cfg = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        named = next((getattr(transformers, a, None) for a in (cfg.architectures or [])), None)
        with torch.device("meta"):
            model = named(cfg) if isinstance(named, type) else transformers.AutoModelForCausalLM.from_config(cfg)
        return type(model).__name__, {k: tuple(v.shape) for k, v in model.state_dict().items()}
    except Exception as e:  # whatever stops transformers building it: the check cannot be made
        log.info("export: the config's model could not be built to compare shapes (%s: %s); not compared",
                 type(e).__name__, e)
        return None


def _check_config_fits(state: dict, config: Any, step: int) -> None:
    """Refuse, before anything is written, a config that does not describe these weights: a
    tensor whose shape differs from the one the config's model has (another hidden_size,
    vocab_size, number of heads...), or layers only one of them has (another num_hidden_layers).
    from_pretrained would refuse that folder, or load it with weights left random. Only names
    both have are compared for shapes, and only numbered blocks for presence, so weights named
    for another class (a prefix more or less), a tied head left out, or an old buffer are no
    mismatch."""
    built = _config_model_shapes(config)
    if built is None:
        return
    cls, expected = built
    fix = ("Pass the config the weights were trained with (the step's own config.json, or model.config); "
           "nothing was written")
    for name, t in state.items():
        want = expected.get(name)
        if want is not None and tuple(t.shape) != want:
            raise CheckpointConfigError(
                f"the config does not fit step {step}'s weights: {name!r} has shape {tuple(t.shape)} in the step, "
                f"and {want} in the {cls} the config describes{_sizes(config)}. {fix}")
    if not any(name in expected for name in state):
        return  # named for another class: nothing to compare by name
    have = {_numbered(n) for n in state}
    extra = next((n for n in state if n not in expected and _numbered(n) in {_numbered(k) for k in expected}), None)
    missing = next((n for n in expected if n not in state and _numbered(n) in have), None)
    if extra is not None or missing is not None:
        which = (f"the step has {extra!r}, which the {cls} the config describes lacks" if extra is not None
                 else f"the {cls} the config describes has {missing!r}, which the step lacks")
        raise CheckpointConfigError(
            f"the config does not fit step {step}'s weights: {which} (another number of layers?"
            f"{_sizes(config)}). {fix}")


def _numbered(name: str) -> str:
    """A tensor name with its block numbers replaced: ``model.layers.3.mlp.weight`` ->
    ``model.layers.#.mlp.weight``, to tell a layer one side lacks from a tensor of another kind."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def _sizes(config: Any) -> str:
    values = config if isinstance(config, dict) else getattr(config, "to_dict", dict)()
    shown = {k: values[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads") if k in values}
    return f"; the config has {', '.join(f'{k}={v}' for k, v in shown.items())}" if shown else ""


def _check_out_dir(root: Storage, out: Storage) -> None:
    """Refuse an ``out_dir`` whose files the export would mix with others, before anything is read:
    one inside a checkpoint root (whose committed files never change), or one that is not empty
    (``from_pretrained`` would load another export's ``model.safetensors`` or index beside it)."""
    if type(out.fs) is type(root.fs) and (out.root == root.root or out.root.startswith(root.root.rstrip("/") + "/")):
        raise CheckpointConfigError(
            f"out_dir {out.url!r} is inside the checkpoint root {root.url!r}, whose committed files must never "
            "change: export to a directory outside it")
    other = enclosing_root(out)  # inside another root: a directory above holds ckptd's ledger
    if other is not None:
        raise CheckpointConfigError(
            f"out_dir {out.url!r} is inside the checkpoint root {other!r}, whose committed files must never "
            "change: export to a directory outside it")
    problem = out.root_problem()
    if problem == Storage.IS_A_FILE:
        raise CheckpointConfigError(f"out_dir {out.url!r} is a file: give a new or empty directory")
    if problem is None and out.listdir(out.root):
        raise CheckpointConfigError(
            f"out_dir {out.url!r} is not empty: weights left there from another export would load instead of, or "
            "beside, these (from_pretrained reads model.safetensors or its index). Give a new or empty directory")


def export_hf_async(root: str, step: int, out_dir: str, config: Any, **kwargs: Any) -> ray.ObjectRef:
    """:func:`export_hf_step` in a Ray task (0 CPUs reserved); ``ray.get`` the result for its files."""
    return _export_task.remote(root, step, out_dir, config, **kwargs)


@ray.remote(num_cpus=0, max_retries=0)
def _export_task(root: str, step: int, out_dir: str, config: Any, **kwargs: Any) -> list[WrittenFile]:
    return export_hf_step(root, step, out_dir, config, **kwargs)
