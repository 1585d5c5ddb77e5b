"""Two ``start_monitor`` calls on one root at the same time, from two drivers' threads (two run
names, or one), interleaved with the driver-side failpoints ``before_open_attempt`` and
``before_monitor_actor``. The loser must neither fence the winner for good nor take away what the
winner wrote. Found while reviewing the contract's limits (session 34)."""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd
from ckptd import failpoints
from ckptd.fencing import list_attempts, read_attempt
from ckptd.layout import DEFAULT_TEMPLATE, LEDGER_DIR, check_template
from ckptd.monitor.fence_watch import FENCE_CHECK_S
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate

from .helpers import commit_one, held_here, tracker_of, wait_for, write_file

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0


def _start_in_thread(root: str, run: str, out: list) -> threading.Thread:
    def start() -> None:
        try:
            out.append(ckptd.start_monitor(root, run=run))
        except BaseException as e:  # noqa: BLE001 - the outcome is what the test looks at
            out.append(e)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def driver_failpoints():
    yield
    failpoints.disarm()


def test_a_start_that_loses_to_a_monitor_that_came_alive_is_refused_before_its_actor_starts(
        tmp_path, run_name, driver_failpoints):
    """B passes the live-monitor check on an empty root and stops there; A starts and comes
    alive; B opens the next attempt. B was refused only after creating its actor and probing the
    root, seconds in which its attempt fenced A (for good after two fence checks, held here for
    longer than that). It is now refused right after opening its attempt."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    failpoints.arm("before_open_attempt", f"until:{DEADLINE_S:g}:{gate}")
    b_out: list = []
    b = _start_in_thread(root, f"{run_name}-b", b_out)
    wait_for(lambda: held_here("before_open_attempt"), DEADLINE_S, "B held before opening its attempt")
    failpoints.disarm("before_open_attempt")
    monitor = ckptd.start_monitor(root, run=f"{run_name}-a")
    try:
        # Where B is not refused at once, it stays here past two fence checks of A's monitor.
        failpoints.arm("before_monitor_actor", f"delay:{3 * FENCE_CHECK_S:g}")
        open(gate, "w").close()
        b.join(DEADLINE_S)
        assert len(b_out) == 1 and isinstance(b_out[0], ckptd.CheckpointConfigError), b_out
        assert "while this one was starting" in str(b_out[0])
        assert list_attempts(Storage(root)) == [1]
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
        commit_one(coord, 1, "model.bin", is_state_dict=False)
        assert ray.get(monitor.status.remote()).fenced is None
        assert tracker_of(root, ckptd.Kind.CHECKPOINT) == 1
        coord.close()
    finally:
        ray.kill(monitor, no_restart=True)
        for out in b_out:
            if not isinstance(out, BaseException):
                ray.kill(out, no_restart=True)


def test_a_start_that_fails_on_a_fresh_root_keeps_the_ledger_of_the_one_that_won(
        tmp_path, run_name, driver_failpoints):
    """A and B start one run on a fresh root. A opened attempt 1 and stops before creating its
    actor; B opens attempt 2, creates the run's actor and wins. A then fails (the actor's name is
    taken) and takes back what it wrote: it removed the root's whole ``.ckptd`` directory, which
    it had found missing, and with it B's attempt record, its start mark and the root's template.
    Now that directory stays, with B's records in it, and B's monitor still commits."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    failpoints.arm("before_monitor_actor", f"until:{DEADLINE_S:g}:{gate}")
    a_out: list = []
    a = _start_in_thread(root, run_name, a_out)
    wait_for(lambda: held_here("before_monitor_actor"), DEADLINE_S, "A held before creating its actor")
    failpoints.disarm("before_monitor_actor")
    monitor = ckptd.start_monitor(root, run=run_name)
    try:
        storage = Storage(root)
        assert list_attempts(storage) == [1, 2]
        open(gate, "w").close()
        a.join(DEADLINE_S)
        assert len(a_out) == 1 and isinstance(a_out[0], BaseException), a_out
        assert list_attempts(storage) == [2] and read_attempt(storage, 2).run == run_name
        assert storage.exists(storage.join(LEDGER_DIR, "attempts", "2.started"))
        assert check_template(storage, StepDirTemplate(DEFAULT_TEMPLATE))  # the root's template, recorded
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
        path = f"{coord.step_dir(1)}/model.bin"
        coord.register(1, checkpoint_thread_count=1)
        coord.save_sync(lambda: write_file(path, os.urandom(64)), 1)
        coord.wait_committed(1, timeout_s=DEADLINE_S)
        assert ray.get(monitor.status.remote()).fenced is None
        coord.close()
    finally:
        ray.kill(monitor, no_restart=True)
