"""Monitor restarts, timeouts, failpoints in the commit path, and tracker atomicity."""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS

from .helpers import SaveWorker, Signal, failpoint_env, ledger_records, restart_monitor, status, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")


def _write(root: str, step: int, name: str) -> None:
    d = ckptd.step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/{name}", "wb") as f:
        f.write(os.urandom(4096))


def _has_manifest(root: str, step: int) -> bool:
    return os.path.exists(f"{ckptd.step_dir(root, step)}/{MANIFESTS[Kind.CHECKPOINT]}")


def _tracker(root: str) -> str | None:
    try:
        return open(f"{root}/latest_checkpointed_iteration.txt").read()
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_monitor_killed_mid_step_recovers(make_monitor, run_name, tmp_path, how):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    trainer = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    workers = [SaveWorker.remote(run_name, r) for r in range(2)]

    ray.get([w.save.remote(1) for w in workers])
    trainer.register(1, checkpoint_thread_count=2)
    trainer.wait_committed(1, timeout_s=30)

    # Step 2: rank 0 finishes before the kill, rank 1 is held mid-save across it.
    gate = Signal.remote()
    ray.get(workers[0].save.remote(2))
    ray.get(workers[1].save.remote(2, gate=gate))
    trainer.register(2, checkpoint_thread_count=2)
    assert ray.get(workers[0].wait_all.remote()) is None
    wait_for(lambda: status(monitor).step(2).finished, what="rank 0's unit")
    restart_monitor(monitor, how)

    after = status(monitor)
    assert after.trackers.checkpoint == 1 and after.step(1).committed
    s2 = after.step(2)
    assert s2.expected == 2 and len(s2.finished) == 1 and not s2.committed  # rebuilt from storage
    ray.get(gate.send.remote())
    assert ray.get(workers[1].wait_all.remote()) is None
    trainer.wait_committed(2, timeout_s=30)
    assert ckptd.latest_step(root) == 2 and _has_manifest(root, 1)
    # Ledger records of committed steps are cleaned up.
    wait_for(lambda: ledger_records(root, 2) == [], what="clean-up")


def test_restart_repairs_a_tracker_behind_a_committed_manifest(make_monitor, tmp_path):
    """A monitor that died after the manifest and before the tracker rename."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2):
        coord.save_async("model", lambda step=step: _write(root, step, "m.bin"), step)
        coord.register(step, checkpoint_thread_count=1)
    coord.wait_committed(2, timeout_s=30)
    with open(f"{root}/latest_checkpointed_iteration.txt", "w") as f:
        f.write("1\n")  # as if the crash came just before the rename
    restart_monitor(monitor, "SIGKILL")
    assert status(monitor).trackers.checkpoint == 2
    assert _tracker(root) == "2\n"


def test_timeout_fails_the_step_with_a_reason_and_survives_restart(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    # The clock starts when the monitor first hears of the step (the unit's admission): the unit
    # and the registration must both reach it within the timeout, also on a loaded machine (CI
    # once took over 1 s).
    monitor = make_monitor(root, step_timeout_s=5.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("model", lambda: _write(root, 3, "m.bin"), 3)
    coord.wait_all()
    coord.register(3, checkpoint_thread_count=2)
    with pytest.raises(ckptd.CheckpointSaveError, match="timed out after 5 s: 1 of 2 registered units"):
        coord.wait_committed(3, timeout_s=30)
    assert not _has_manifest(root, 3) and _tracker(root) is None
    restart_monitor(monitor, "ray.kill")
    s = status(monitor).step(3)
    assert s.state.value == "failed" and "timed out" in s.reason
    # The late unit is refused (it does not resurrect the step), and the next step is unaffected.
    other = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    other.save_async("model", lambda: _write(root, 3, "late.bin"), 3)
    with pytest.raises(ckptd.CheckpointSaveError, match="step 3 has already failed"):
        other.wait_all()
    assert not os.path.exists(f"{ckptd.step_dir(root, 3)}/late.bin")
    other.save_async("model", lambda: _write(root, 4, "m.bin"), 4)
    other.register(4, checkpoint_thread_count=1)
    other.wait_all()
    other.wait_committed(4, timeout_s=30)
    assert not _has_manifest(root, 3) and ckptd.latest_step(root) == 4


def _save_step_one(monitor, root: str) -> ckptd.CheckpointCoordinator:
    """One unit of step 1, saved and registered: the step the commit-path tests commit."""
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("model", lambda: _write(root, 1, "m.bin"), 1)
    coord.register(1, checkpoint_thread_count=1)
    return coord


@pytest.mark.parametrize("point", ["before_manifest", "before_tracker_rename"])
def test_monitor_crash_in_the_commit_path_recovers(make_monitor, tmp_path, point):
    """SIGKILL-like exit at each monitor failpoint: after the restart the step still commits,
    and the tracker ends up at it."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, runtime_env=failpoint_env(f"{point}=crash", once_dir=tmp_path / "fp"))
    first = ray.get(monitor.ping.remote())
    coord = _save_step_one(monitor, root)
    coord.wait_all()
    coord.wait_committed(1, timeout_s=60)
    assert os.path.exists(tmp_path / "fp" / point)  # the crash did happen
    assert ray.get(monitor.ping.remote())["started_at"] != first["started_at"]
    assert _has_manifest(root, 1) and _tracker(root) == "1\n"


def test_failpoint_before_manifest(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=1, runtime_env=failpoint_env("before_manifest=raise"))
    coord = _save_step_one(monitor, root)
    with pytest.raises(ckptd.CheckpointSaveError, match="commit failed after 2 attempts: FailpointError"):
        coord.wait_committed(1, timeout_s=30)
    assert not _has_manifest(root, 1) and _tracker(root) is None and ckptd.latest_step(root) is None


def test_failpoint_before_tracker_rename(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=0, runtime_env=failpoint_env("before_tracker_rename=raise"))
    coord = _save_step_one(monitor, root)
    coord.wait_committed(1, timeout_s=30)  # the manifest is what commits
    assert _has_manifest(root, 1) and _tracker(root) is None
    assert "tracker could not be advanced" in status(monitor).step(1).reason
    assert not [n for n in os.listdir(root) if n.startswith(".ckptd-tmp")]


def test_failpoint_after_unit_write_fails_the_unit(make_monitor, tmp_path):
    from ckptd import failpoints

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(1, checkpoint_thread_count=1)
    failpoints.arm("after_unit_write")
    try:
        coord.save_async("model", lambda: _write(root, 1, "m.bin"), 1)
        with pytest.raises(ckptd.CheckpointSaveError, match="FailpointError"):
            coord.wait_all()
    finally:
        failpoints.disarm()
    assert status(monitor).step(1).state.value == "failed" and not _has_manifest(root, 1)


def test_slow_commit_io_does_not_block_the_monitor(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, runtime_env=failpoint_env("before_manifest=delay:3"))
    coord = _save_step_one(monitor, root)
    # Status is served, and other steps are registered, while the manifest write is stalled.
    wait_for(lambda: status(monitor).step(1).state.value == "committing", what="a commit in progress")
    coord.register(2, checkpoint_thread_count=1)
    s = status(monitor)
    assert s.step(1).state.value == "committing" and s.step(2).expected == 1
    coord.wait_committed(1, timeout_s=30)


def test_tracker_reads_are_never_partial_through_200_commits(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", max_pending=8)
    path = f"{root}/latest_checkpointed_iteration.txt"
    reads: list[str] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                with open(path) as f:
                    reads.append(f.read())
            except FileNotFoundError:
                pass

    t = threading.Thread(target=reader)
    t.start()
    try:
        for step in range(200):
            coord.save_async("model", lambda step=step: _write(root, step, "m.bin"), step)
            coord.register(step, checkpoint_thread_count=1)
        coord.wait_all()
        coord.wait_committed(199, timeout_s=60)
    finally:
        stop.set()
        t.join()
    reads.append(open(path).read())
    assert len(reads) > 200
    values = []
    for r in reads:
        assert r.endswith("\n") and r.strip().isdigit(), repr(r)
        values.append(int(r))
    assert values == sorted(values) and values[-1] == 199
