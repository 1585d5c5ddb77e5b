"""Worker side: the CheckpointCoordinator and its named save threads, and the PreemptionGuard."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562), as in ckptd/__init__.py: a notification relay runs the
# coordinator's client and notifier only, and needs none of the save path's torch.
_SOURCES = {"CheckpointCoordinator": "ckptd.coordinator.coordinator",
            "PreemptionGuard": "ckptd.coordinator.preemption"}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from ckptd.coordinator.coordinator import CheckpointCoordinator
    from ckptd.coordinator.preemption import PreemptionGuard

__all__ = ["CheckpointCoordinator", "PreemptionGuard"]
