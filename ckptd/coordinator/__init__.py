"""Worker side: the CheckpointCoordinator and its named save threads, and the PreemptionGuard."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptd._lazy import lazy_exports

# Loaded on first use (PEP 562), as in ckptd/__init__.py: a notification relay runs the
# coordinator's client and notifier only, and needs none of the save path's torch.
_SOURCES = {"CheckpointCoordinator": "ckptd.coordinator.coordinator",
            "PreemptionGuard": "ckptd.coordinator.preemption"}


__getattr__, __dir__ = lazy_exports(globals(), _SOURCES)


if TYPE_CHECKING:
    from ckptd.coordinator.coordinator import CheckpointCoordinator
    from ckptd.coordinator.preemption import PreemptionGuard

__all__ = ["CheckpointCoordinator", "PreemptionGuard"]
