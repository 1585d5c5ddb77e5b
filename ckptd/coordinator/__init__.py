"""Worker side: the CheckpointCoordinator and its named save threads."""

from ckptd.coordinator.coordinator import CheckpointCoordinator

__all__ = ["CheckpointCoordinator"]
