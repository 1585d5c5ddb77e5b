"""ckptd: asynchronous checkpoint coordination for training jobs on Ray.

Saves run in background threads so training continues; a step is committed (manifest, then the
``latest_*_iteration.txt`` trackers) only when every registered save of it has finished.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from ckptd._lazy import lazy_exports

# The public names load on first use (PEP 562): a process that needs only part of ckptd pays
# only for that part. The monitor actor's process imports this package to unpickle its class,
# and the save path's torch import (seconds of CPU on a small machine) has no use there.
_SOURCES = {
    "Kind": "ckptd.config", "MonitorOptions": "ckptd.config", "SaveStrategy": "ckptd.config",
    "CheckpointCoordinator": "ckptd.coordinator",
    "PREEMPTED_EXIT_CODE": "ckptd.coordinator.notice",
    "PREEMPTION_INCOMPLETE_EXIT_CODE": "ckptd.coordinator.notice",
    "PreemptionOutcome": "ckptd.coordinator.notice",
    "PreemptionGuard": "ckptd.coordinator.preemption",
    "CheckpointConfigError": "ckptd.errors", "CheckpointError": "ckptd.errors",
    "CheckpointSaveError": "ckptd.errors", "CheckpointTimeoutError": "ckptd.errors",
    "CorruptCheckpointError": "ckptd.errors", "RegistrationConflictError": "ckptd.errors",
    "UnsafeCheckpointError": "ckptd.errors",
    "latest_step": "ckptd.layout", "step_dir": "ckptd.layout",
    "WrittenFile": "ckptd.manifest",
    "MonitorStatus": "ckptd.monitor", "StepStatus": "ckptd.monitor", "get_monitor": "ckptd.monitor",
    "start_monitor": "ckptd.monitor",
    "ResumeState": "ckptd.resume", "resume": "ckptd.resume",
    "retire_steps": "ckptd.retire",
    "Weights": "ckptd.rollout", "WeightSubscriber": "ckptd.rollout",
    "verify": "ckptd.verify",
    "load_state": "ckptd.workers.state_file",
}


__getattr__, __dir__ = lazy_exports(globals(), _SOURCES)


_SHADOWED = frozenset({"verify", "resume"})  # public functions that share a submodule's name


class _Package(types.ModuleType):
    """This package's module type: ``ckptd.verify`` and ``ckptd.resume`` stay the functions.

    Importing a submodule binds it to its package's attribute of the same name once it has
    loaded; ckptd.verify and ckptd.resume are also public functions, which an eager import here
    used to rebind afterwards. Those two bindings are refused, so the names resolve lazily to
    the functions, whichever submodule was imported first.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __reduce__(self) -> tuple:
        # By reference, as pickle and cloudpickle treat a plain module (a function pickled by
        # value for a Ray actor may refer to ckptd).
        return importlib.import_module, (self.__name__,)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
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
    from ckptd.workers.state_file import load_state

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
    "load_state",
    "resume",
    "retire_steps",
    "start_monitor",
    "step_dir",
    "verify",
]
