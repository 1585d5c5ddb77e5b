"""What a training worker saves, and how: writers that run inside save units.

Each writer takes an output directory (a step directory from ``coord.step_dir(step)``, or a
folder in one) and returns the :class:`~ckptd.WrittenFile` records of what it wrote, so the
coordinator lists them in the step's manifest without reading them back. Snapshot tensors on the
training thread first (:func:`snapshot`); the writers run in the background.
"""

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
