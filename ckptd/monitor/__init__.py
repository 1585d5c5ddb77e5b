"""The CheckpointMonitor actor and the step ledger it runs on."""

from ckptd.monitor.actor import CheckpointMonitor
from ckptd.monitor.ledger import StepLedger, StepState
from ckptd.monitor.service import get_monitor, start_monitor
from ckptd.monitor.status import MonitorStatus, StepStatus
from ckptd.protocol import UnitFailure

__all__ = ["CheckpointMonitor", "MonitorStatus", "StepLedger", "StepState", "StepStatus",
           "UnitFailure", "get_monitor", "start_monitor"]
