"""LoRA adapters only, in PEFT's format: ``adapter_model.safetensors`` and ``adapter_config.json``.

``peft.PeftModel.from_pretrained(base_model, dir)`` loads what :func:`save_lora_adapter` writes.
peft itself is not needed to write it. The checkpoint holds the adapter weights and nothing of
the base model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptd.errors import CheckpointConfigError
from ckptd.manifest import WrittenFile
from ckptd.storage import Storage
from ckptd.workers.files import write_json
from ckptd.workers.hf import as_dict
from ckptd.workers.safetensors_io import check_tensors, write_safetensors

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def adapter_state_dict(
    state_dict: Mapping[str, torch.Tensor], adapter_name: str = "default"
) -> dict[str, torch.Tensor]:
    """The LoRA weights of one adapter, keyed as PEFT saves them (adapter name removed).

    ``...q_proj.lora_A.default.weight`` becomes ``...q_proj.lora_A.weight``; base weights and
    other adapters are left out. A state dict that already has PEFT's saved keys passes through.
    """
    out = {}
    for key, t in state_dict.items():
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if part in _LORA_PARTS:
                if parts[i + 1] == adapter_name:
                    out[".".join(parts[: i + 1] + parts[i + 2 :])] = t
                elif i + 2 == len(parts) or parts[i + 1] == "weight":
                    out[key] = t  # already saved form: no adapter name
                break
    return out


def save_lora_adapter(
    out_dir: str,
    state_dict: Mapping[str, torch.Tensor],
    adapter_config: Any,
    *,
    adapter_name: str = "default",
    storage_options: dict | None = None,
) -> list[WrittenFile]:
    """Write the LoRA adapter ``adapter_name`` of a PEFT model into ``out_dir``.

    Args:
        out_dir: Destination directory, a path or fsspec URL.
        state_dict: The PEFT model's state dict (snapshotted); only the adapter's LoRA weights
            are written.
        adapter_config: The adapter's ``LoraConfig`` or its ``to_dict()``.
        adapter_name: Which adapter to save.
        storage_options: fsspec options for ``out_dir``.

    Raises:
        CheckpointConfigError: not a LoRA config, ``modules_to_save`` set (not supported), or no
            LoRA weight of that adapter in the state dict; nothing was written.
    """
    cfg = as_dict(adapter_config, "adapter_config")
    peft_type = getattr(cfg.get("peft_type"), "value", cfg.get("peft_type"))
    if peft_type != "LORA":
        raise CheckpointConfigError(f"adapter_config must be a LoRA config (peft_type 'LORA'), got {peft_type!r}")
    for field in ("r", "lora_alpha", "target_modules"):
        if cfg.get(field) in (None, ""):
            raise CheckpointConfigError(f"adapter_config has no {field!r}; pass the adapter's LoraConfig")
    if cfg.get("modules_to_save"):
        raise CheckpointConfigError(
            "adapter_config has modules_to_save, whose full weights this writer does not save; "
            "save them with save_hf_model(prefix=...) beside the adapter, or use peft's save_pretrained"
        )
    tensors = adapter_state_dict(state_dict, adapter_name)
    if not tensors:
        raise CheckpointConfigError(
            f"the state dict has no LoRA weights of adapter {adapter_name!r} (keys like "
            f"'...lora_A.{adapter_name}.weight'); pass the PEFT model's state_dict()"
        )
    check_tensors(tensors, "adapter state dict")
    storage = Storage(out_dir, storage_options)
    storage.makedirs(storage.root)
    return [
        write_json(storage, f"{storage.root}/{ADAPTER_CONFIG}", cfg),
        write_safetensors(storage, f"{storage.root}/{ADAPTER_WEIGHTS}", tensors, {"format": "pt"}),
    ]
