"""What a training worker saves, and how: writers that run inside save units.

Each writer takes an output directory (a step directory from ``coord.step_dir(step)``, or a
folder in one) and returns the :class:`~ckptd.WrittenFile` records of what it wrote, so the
coordinator lists them in the step's manifest without reading them back. Snapshot tensors on the
training thread first (:func:`snapshot`); the writers run in the background.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptd._lazy import lazy_exports

# Loaded on first use (PEP 562), as in ckptd/__init__.py: the monitor reads and writes files
# through ckptd.workers.files, and needs neither torch nor transformers for that.
_SOURCES = {
    "ShardedState": "ckptd.workers.dtensor",
    "sharded_state": "ckptd.workers.dtensor",
    "export_hf_async": "ckptd.workers.export",
    "export_hf_step": "ckptd.workers.export",
    "save_hf_model": "ckptd.workers.hf",
    "save_lora_adapter": "ckptd.workers.lora",
    "Shard": "ckptd.workers.sharded",
    "export_hf": "ckptd.workers.sharded",
    "save_sharded": "ckptd.workers.sharded",
    "shard_dim0": "ckptd.workers.sharded",
    "select_prefix": "ckptd.workers.state_dict",
    "snapshot": "ckptd.workers.state_dict",
    "RunningState": "ckptd.workers.training_state",
    "TrainingState": "ckptd.workers.training_state",
    "capture_training_state": "ckptd.workers.training_state",
    "save_training_state": "ckptd.workers.training_state",
}


__getattr__, __dir__ = lazy_exports(globals(), _SOURCES)


if TYPE_CHECKING:
    from ckptd.workers.dtensor import ShardedState, sharded_state
    from ckptd.workers.export import export_hf_async, export_hf_step
    from ckptd.workers.hf import save_hf_model
    from ckptd.workers.lora import save_lora_adapter
    from ckptd.workers.sharded import Shard, export_hf, save_sharded, shard_dim0
    from ckptd.workers.state_dict import select_prefix, snapshot
    from ckptd.workers.training_state import (
        RunningState,
        TrainingState,
        capture_training_state,
        save_training_state,
    )

__all__ = [
    "RunningState",
    "ShardedState",
    "Shard",
    "TrainingState",
    "capture_training_state",
    "export_hf",
    "export_hf_async",
    "export_hf_step",
    "save_hf_model",
    "save_lora_adapter",
    "save_sharded",
    "save_training_state",
    "select_prefix",
    "shard_dim0",
    "sharded_state",
    "snapshot",
]
