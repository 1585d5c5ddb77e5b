"""register(..., wait=False): the registration goes to the monitor from a background thread, the
step commits exactly as with a blocking register, and what the monitor answers is raised by the
next blocking call."""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import RayActorError

import ckptd
from ckptd.config import Kind

from .helpers import read_manifest, status, wait_for, write_step_file

pytestmark = pytest.mark.usefixtures("ray_local")


def _manifest_files(root: str, step: int) -> set[str]:
    return {f.path for f in read_manifest(root, step, Kind.CHECKPOINT).files}


def test_background_registrations_add_up_and_the_step_commits_whole(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    with pytest.raises(ckptd.CheckpointConfigError):  # checked at once, before anything is sent
        coord.register(3, checkpoint_thread_count=-1, wait=False)
    # Trinity's additive registrations, both in the background: the step expects two units.
    coord.register(3, checkpoint_thread_count=1, wait=False)
    coord.register(3, checkpoint_thread_count=1, wait=False)
    coord.save_async("model", lambda: write_step_file(root, 3, "model.bin"), 3)
    coord.wait_all()
    # Both registrations were applied before wait_all returned; one unit of two has finished.
    s = status(monitor).step(3)
    assert (s.expected, len(s.finished), s.committed) == (2, 1, False)
    assert ckptd.latest_step(root) is None
    coord.save_async("optim", lambda: write_step_file(root, 3, "optim.bin"), 3)
    coord.wait_committed(3, timeout_s=60)
    assert ckptd.latest_step(root) == 3
    assert _manifest_files(root, 3) == {"model.bin", "optim.bin"}
    coord.close()
    with pytest.raises(ckptd.CheckpointError, match="closed"):  # not queued to a stopped thread
        coord.register(5, checkpoint_thread_count=1, wait=False)


def _step_1_committed(make_monitor, tmp_path):
    """A monitor, and a coordinator whose step 1 is committed (so that adding to it is refused)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("model", lambda: write_step_file(root, 1, "model.bin"), 1)
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=60)
    return root, monitor, coord


def test_a_refused_background_registration_is_raised_once_by_wait_all(make_monitor, tmp_path):
    root, monitor, coord = _step_1_committed(make_monitor, tmp_path)
    before = _manifest_files(root, 1)
    # Adding a unit to a committed checkpoint is refused; with wait=False the call returns and the
    # refusal comes with the next wait_all, once.
    coord.register(1, checkpoint_thread_count=1, wait=False)
    with pytest.raises(ckptd.RegistrationConflictError):
        coord.wait_all()
    coord.wait_all()
    assert _manifest_files(root, 1) == before and ckptd.latest_step(root) == 1
    # The same refusal reaches a blocking register made after it, before its own registration.
    coord.register(1, checkpoint_thread_count=1, wait=False)
    with pytest.raises(ckptd.RegistrationConflictError):
        coord.register(2, checkpoint_thread_count=1)
    coord.save_async("model", lambda: write_step_file(root, 2, "model.bin"), 2)
    coord.register(2, checkpoint_thread_count=1)  # not sent above: the refusal came first
    coord.wait_committed(2, timeout_s=60)
    assert status(monitor).step(2).expected == 1
    coord.close()


def _fails() -> None:
    raise OSError("disk full")


def test_failures_beside_a_refused_background_registration_are_named_on_it(make_monitor, tmp_path):
    """Only one exception can be raised: the others that failed meanwhile (a later background
    registration, saves) are notes on it, so none is reported nowhere, close() included."""
    root, monitor, coord = _step_1_committed(make_monitor, tmp_path)
    for closing in (False, True):
        coord.register(1, checkpoint_thread_count=1, wait=False)  # both refused: 1 is committed
        coord.register(1, checkpoint_thread_count=2, wait=False)
        coord.save_async("optim", _fails, 2)
        with pytest.raises(ckptd.RegistrationConflictError) as raised:
            coord.close() if closing else coord.wait_all()
        notes = raised.value.__notes__
        assert len(notes) == 2, notes
        assert "later registration" in notes[0] and "RegistrationConflictError" in notes[0]
        assert "a save failed too" in notes[1] and "step 2" in notes[1] and "disk full" in notes[1]
        # kept for the next wait_all, which raises it, once (after close() too)
        with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
            coord.wait_all()
        coord.wait_all()


def test_wait_false_returns_while_the_monitor_is_unreachable(make_monitor, tmp_path):
    """A blocking register would raise here once its retries ran out; wait=False returns, and
    wait_all raises what the background thread got."""
    monitor = make_monitor(str(tmp_path / "ckpt"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=1.0)
    ray.kill(monitor, no_restart=True)  # asynchronous: a call right after it may still be answered

    def dead() -> bool:
        try:
            ray.get(monitor.ping.remote(), timeout=30)
        except RayActorError:
            return True
        return False

    wait_for(dead, what="the killed monitor to be gone")
    coord.register(1, checkpoint_thread_count=1, wait=False)
    with pytest.raises(ckptd.CheckpointTimeoutError, match="is dead and Ray does not restart it"):
        coord.wait_all()
    coord.close()


def test_a_background_registration_racing_a_monitor_restart_counts_once(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("model", lambda: write_step_file(root, 4, "model.bin"), 4)
    coord.wait_all()
    ray.kill(monitor, no_restart=False)  # Ray restarts it; the call is retried until it answers
    coord.register(4, checkpoint_thread_count=1, wait=False)
    # Committed with its one unit: the registration arrived, and a retry of it did not count twice
    # (two expected units would hold the step back forever).
    coord.wait_committed(4, timeout_s=60)
    assert status(monitor).step(4).committed and ckptd.latest_step(root) == 4
    assert _manifest_files(root, 4) == {"model.bin"}
    coord.close()
