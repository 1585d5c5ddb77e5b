"""Worker side: the CheckpointCoordinator and its named save threads, and the PreemptionGuard."""

from ckptd.coordinator.coordinator import CheckpointCoordinator
from ckptd.coordinator.preemption import PreemptionGuard

__all__ = ["CheckpointCoordinator", "PreemptionGuard"]
