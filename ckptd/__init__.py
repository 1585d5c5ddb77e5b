"""ckptd: asynchronous checkpoint coordination for training jobs on Ray.

Saves run in background threads so training continues; a step is committed (manifest, then the
``latest_*_iteration.txt`` trackers) only when every registered save of it has finished.
"""

from ckptd.config import Kind, MonitorOptions, SaveStrategy
from ckptd.coordinator import CheckpointCoordinator
from ckptd.coordinator.notice import PREEMPTED_EXIT_CODE, PREEMPTION_INCOMPLETE_EXIT_CODE, PreemptionOutcome
from ckptd.coordinator.preemption import PreemptionGuard
from ckptd.errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    RegistrationConflictError,
    UnsafeCheckpointError,
)
from ckptd.layout import latest_step, step_dir
from ckptd.manifest import WrittenFile
from ckptd.monitor import MonitorStatus, StepStatus, get_monitor, start_monitor
from ckptd.resume import ResumeState, resume
from ckptd.retire import retire_steps
from ckptd.rollout import Weights, WeightSubscriber
from ckptd.verify import verify

__version__ = "0.1.0"

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PREEMPTION_INCOMPLETE_EXIT_CODE",
    "CheckpointConfigError",
    "CheckpointCoordinator",
    "CheckpointError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "CorruptCheckpointError",
    "Kind",
    "MonitorOptions",
    "MonitorStatus",
    "PreemptionGuard",
    "PreemptionOutcome",
    "RegistrationConflictError",
    "ResumeState",
    "SaveStrategy",
    "StepStatus",
    "UnsafeCheckpointError",
    "WeightSubscriber",
    "Weights",
    "WrittenFile",
    "get_monitor",
    "latest_step",
    "resume",
    "retire_steps",
    "start_monitor",
    "step_dir",
    "verify",
]
