"""How a coordinator tells a monitor that died (Ray not told yet) from one that is stuck: whether
the monitor's process still runs on this node."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptd.coordinator.monitor_diagnosis import _process_exists


def test_a_running_process_exists():
    assert _process_exists(os.getpid())


@pytest.mark.skipif(not hasattr(os, "waitid"), reason="os.waitid(WNOWAIT) holds the zombie")
def test_a_killed_process_its_parent_has_not_reaped_does_not_exist():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, and left unreaped: a zombie
    try:
        os.kill(child.pid, 0)  # the kernel still knows the pid: a plain signal check says it exists
        assert not _process_exists(child.pid)
    finally:
        child.wait()
    assert not _process_exists(child.pid)
