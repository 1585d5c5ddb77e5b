"""A monitor that is alive but does not answer (SIGSTOP: a stopped process, a stuck event loop)
bounds a coordinator's calls as a dead one does: by its ``notify_timeout_s``.

Before, a call to a live monitor waited for its answer without bound (the timeout bounded only
the retries while the monitor was unreachable), so ``wait_all()`` hung with the monitor. Now the
answer must come within the timeout, retries included; the save is reported failed, and when the
monitor resumes, it hears the unit's late notifications in order and settles the step once.

Real local Ray, a real monitor process (stopped and resumed with signals), real files.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

import ckptd

from .helpers import assert_trackers_verified, write_step_file

pytestmark = pytest.mark.usefixtures("ray_local")

TIMEOUT_S = 1.5
#: A unit's "started" and then its "failed" notification, each TIMEOUT_S, with a margin for a
#: loaded machine; far below what an unbounded wait would show.
BOUND_S = 4 * TIMEOUT_S + 5


@pytest.mark.timeout(90)  # without the bound, the save waits for ever
def test_a_stopped_monitor_bounds_the_save_and_the_waits(make_monitor, tmp_path):
    root = str(tmp_path / "ck")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=TIMEOUT_S)
    coord.save_sync(lambda: write_step_file(root, 1, "model.bin"), 1)
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)

    pid = ray.get(monitor.ping.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        coord.save_async("model", lambda: write_step_file(root, 2, "model.bin"), 2)
        with pytest.raises(ckptd.CheckpointSaveError, match="did not answer") as info:
            coord.wait_all()
        assert time.monotonic() - started < BOUND_S
        assert isinstance(info.value.__cause__, ckptd.CheckpointTimeoutError)
        assert info.value.step == 2

        # A wait with its own timeout is bounded by it plus the client's.
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer wait_committed"):
            coord.wait_committed(2, timeout_s=0.5)
        assert time.monotonic() - started < 0.5 + TIMEOUT_S + 5
    finally:
        os.kill(pid, signal.SIGCONT)

    # Resumed, the monitor hears the unit's "started", then its "failed": the step fails once,
    # and the committed step 1 stays the latest.
    with pytest.raises(ckptd.CheckpointSaveError, match="did not answer"):
        coord.wait_committed(2, timeout_s=30)
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 1
    coord.save_sync(lambda: write_step_file(root, 3, "model.bin"), 3)
    coord.register(3, checkpoint_thread_count=1)
    coord.wait_committed(3, timeout_s=30)
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 3
    coord.close()
