"""How long calls to a monitor that is dead for good may take, found by helper-76: registrations
queued behind one that timed out share one more timeout (each retried for a whole one); a new
job's monitor under the run's name that does not answer holds no call past its deadline (it was
asked with the full timeout, twice per retry); and a coordinator created on a dead monitor's
handle is told at once (it retried for the whole timeout a monitor nothing could reach again)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

import ckptd

from .helpers import actor_gone, commit_one, in_thread, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 120.0


def _timed(call) -> tuple[tuple, float]:
    start = time.monotonic()
    told = in_thread(call, DEADLINE_S)
    return told, time.monotonic() - start


def _killed_for_good(monitor) -> None:
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), DEADLINE_S, "the monitor gone")


def test_registrations_queued_behind_one_that_timed_out_share_one_more_timeout(make_monitor, tmp_path):
    """docs/api.md: close() and wait_all are held about two timeouts however many were queued.
    Each queued registration retried the dead monitor for its own whole timeout: 10 took 10 of them."""
    timeout_s, queued = 2.0, 10
    monitor = make_monitor(str(tmp_path / "ckpt"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=timeout_s)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    _killed_for_good(monitor)
    for step in range(2, 2 + queued):
        coord.register(step, checkpoint_thread_count=1, wait=False)
    told, took = _timed(coord.wait_all)
    assert told[0] == "raised" and type(told[1]) is ckptd.CheckpointTimeoutError, told
    assert took < 5 * timeout_s, f"{queued} queued registrations held wait_all {took:.1f} s (timeout {timeout_s} s)"
    coord.close()


def test_a_stopped_monitor_under_the_run_name_holds_no_call_past_its_deadline(make_monitor, tmp_path):
    """The old monitor dead for good, a new job's monitor under the same run name, its process
    stopped: asking it which attempt it serves took the whole timeout, twice per retry, so
    wait_committed(timeout_s=1) took twice notify_timeout_s, and its error said no monitor had
    been started again."""
    timeout_s = 6.0
    monitor = make_monitor(str(tmp_path / "ckpt"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=timeout_s)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    _killed_for_good(monitor)
    pid = ray.get(make_monitor(str(tmp_path / "another-root")).ping.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        told, took = _timed(lambda: coord.wait_committed(2, timeout_s=1.0))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert told[0] == "raised" and type(told[1]) is ckptd.CheckpointTimeoutError, told
    assert "a monitor was started again under its run's name but did not say in time" in str(told[1]), told
    assert took < timeout_s + 1.0 + 3.0, f"wait_committed(timeout_s=1) took {took:.1f} s (notify_timeout_s={timeout_s})"
    coord.close()


def test_a_coordinator_created_on_a_dead_monitors_handle_is_told_at_once(make_monitor, tmp_path):
    """Nothing can reach a monitor through its handle once Ray will not restart it, and a
    coordinator still asking for its configuration does not know its run to look it up again:
    it waited out the whole notify_timeout_s, then said nothing of why (after a takeover, say)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    make_monitor(root, run="the-next-job", takeover=True)  # stops the first for good
    wait_for(lambda: actor_gone(monitor), DEADLINE_S, "the taken-over monitor gone")
    told, took = _timed(lambda: ckptd.CheckpointCoordinator(monitor, worker_id="w1", notify_timeout_s=60.0))
    assert told[0] == "raised" and type(told[1]) is ckptd.CheckpointError, told
    assert "is dead and Ray does not restart it" in str(told[1]) and "ckptd.get_monitor" in str(told[1]), told
    assert took < 20.0, f"told after {took:.1f} s (notify_timeout_s=60)"
