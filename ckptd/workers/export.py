"""HuggingFace export of a committed step's weights, in a Ray task: never on the training thread.

Training saves its shards (each rank its own block, nothing gathered); when an HF copy is
wanted, for evaluation or serving, a task on any node of the cluster reads the committed shards
(each file checked against the manifest), assembles the full tensors in its own memory and writes
``model.safetensors`` (split with an index above ``max_shard_size``) and ``config.json``, so
``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it. Optimizer state saved with the
weights is left out.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from ckptd.errors import CheckpointError
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.units import check_step
from ckptd.verify import open_step
from ckptd.workers.hf import save_hf_model
from ckptd.workers.weights import read_weights


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
        CheckpointError: ``step`` did not commit within ``wait_s``.
        CorruptCheckpointError: a shard differs from the manifest.
    """
    check_step(step)
    storage = Storage(root, storage_options)
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
    return save_hf_model(out_dir, weights.state_dict(), config, storage_options=out_storage_options, **hf_options)


def export_hf_async(root: str, step: int, out_dir: str, config: Any, **kwargs: Any) -> ray.ObjectRef:
    """:func:`export_hf_step` in a Ray task (0 CPUs reserved); ``ray.get`` the result for its files."""
    return _export_task.remote(root, step, out_dir, config, **kwargs)


@ray.remote(num_cpus=0, max_retries=0)
def _export_task(root: str, step: int, out_dir: str, config: Any, **kwargs: Any) -> list[WrittenFile]:
    return export_hf_step(root, step, out_dir, config, **kwargs)
