"""Commit path under BaseException save functions, monitor restarts, new jobs and additive
registrations: real Ray, real files, no mocks.

The tests that look only at their own steps share one monitor (``env``: each its own block of
steps); those that restart the monitor, start a new job, or check which step a tracker names have
their own."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

import ckptd
from ckptd.errors import CheckpointError, CheckpointSaveError

from .helpers import actor_gone, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")

SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}  # no test's steps go while another runs

TRACKERS = {"latest_checkpointed_iteration.txt": "checkpoint", "latest_state_dict_iteration.txt": "state_dict"}


class Boom(BaseException):
    """Not an Exception, like torch.distributed.checkpoint.api.CheckpointException."""


def _write(root: str, step: int, name: str, data: bytes = b"x" * 64) -> None:
    d = ckptd.step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def _raiser(root: str, step: int, exc: BaseException):
    def fn():
        _write(root, step, f"partial-{step}.bin")
        raise exc
    return fn


def assert_trackers_verified(root: str) -> dict[str, int]:
    """Every tracker names a step that ckptd.verify accepts for its kind."""
    seen = {}
    for name, kind in TRACKERS.items():
        try:
            with open(os.path.join(root, name)) as f:
                text = f.read().strip()
        except FileNotFoundError:
            continue
        step = int(text)
        ckptd.verify(root, step, kind=kind)
        seen[kind] = step
    return seen


def assert_never_committed(root: str, step: int) -> None:
    seen = assert_trackers_verified(root)
    assert step not in seen.values(), seen
    for m in ("ckptd_manifest.json", "ckptd_state_dict_manifest.json"):
        assert not os.path.exists(os.path.join(ckptd.step_dir(root, step), m))


def register_failing(coord, step: int, **counts) -> None:
    """Register a step whose save may already have failed: register then raises, as documented."""
    try:
        coord.register(step, **counts)
    except CheckpointSaveError:
        pass


def _root(tmp_path) -> str:
    return str(tmp_path / "ckpt")


def _good_then_commit(coord, root, name, step):
    coord.save_async(name, lambda: _write(root, step, f"{name}-{step}.bin"), step)
    coord.register(step, checkpoint_thread_count=1)
    coord.wait_all()
    coord.wait_committed(step, timeout_s=60)
    assert assert_trackers_verified(root)["checkpoint"] == step


def test_base_exception_in_save_async_fails_step_thread_survives(make_monitor, tmp_path):
    root = _root(tmp_path)
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _good_then_commit(coord, root, "model", 1)
    coord.save_async("model", _raiser(root, 2, Boom("dcp failed")), 2)
    register_failing(coord, 2, checkpoint_thread_count=1)
    with pytest.raises(CheckpointSaveError) as ei:
        coord.wait_all()
    assert isinstance(ei.value.__cause__, Boom)
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(2, timeout_s=60)
    assert_never_committed(root, 2)
    # The save thread of "model" survived: later saves of the same name run and commit.
    _good_then_commit(coord, root, "model", 3)
    assert_never_committed(root, 2)
    coord.close()


def test_system_exit_in_save_async_raised_by_wait_all(env):
    root, s1 = env.root, env.s + 1
    coord = env.coord()
    coord.save_async("model", _raiser(root, s1, SystemExit(3)), s1)
    register_failing(coord, s1, checkpoint_thread_count=1)
    with pytest.raises(CheckpointSaveError) as ei:
        coord.wait_all()
    assert "SystemExit" in str(ei.value)


def test_system_exit_in_save_async_never_commits_thread_survives(make_monitor, tmp_path):
    """What does hold with SystemExit on a save thread: the step fails, the thread lives on."""
    root = _root(tmp_path)
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("model", _raiser(root, 1, SystemExit(3)), 1)
    register_failing(coord, 1, checkpoint_thread_count=1)
    with pytest.raises(CheckpointSaveError):
        coord.wait_all()
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(1, timeout_s=60)
    assert_never_committed(root, 1)
    _good_then_commit(coord, root, "model", 2)
    assert_never_committed(root, 1)
    coord.close()


def test_system_exit_in_save_sync_propagates_never_commits(env):
    root, s4, s5, s6 = env.root, env.s + 4, env.s + 5, env.s + 6
    coord = env.coord()
    coord.register(s4, checkpoint_thread_count=1)
    with pytest.raises(SystemExit):
        coord.save_sync(_raiser(root, s4, SystemExit(2)), s4)
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(s4, timeout_s=60)
    assert_never_committed(root, s4)
    # Boom (not SystemExit) in save_sync becomes a CheckpointSaveError.
    coord.register(s5, checkpoint_thread_count=1)
    with pytest.raises(CheckpointSaveError):
        coord.save_sync(_raiser(root, s5, Boom("x")), s5)
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(s5, timeout_s=60)
    assert_never_committed(root, s5)
    coord.save_sync(lambda: _write(root, s6, "ok.bin"), s6)
    coord.register(s6, checkpoint_thread_count=1)
    coord.wait_committed(s6, timeout_s=60)
    assert_trackers_verified(root)
    coord.close()


def _wait_alive(coord_factory, timeout=60):
    deadline = time.time() + timeout
    while True:
        try:
            return coord_factory()
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def test_failed_step_never_commits_after_restart_and_new_job(make_monitor, run_name, tmp_path):
    root = _root(tmp_path)
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _good_then_commit(coord, root, "model", 1)
    # Step 2: one unit fails (Boom), the other finishes; counts say 2.
    coord.save_async("a", _raiser(root, 2, Boom("a")), 2)
    coord.save_async("b", lambda: _write(root, 2, "b.bin"), 2)
    with pytest.raises(CheckpointSaveError):
        coord.wait_all()
    # Monitor restart (Ray restarts the actor) before the step is registered.
    ray.kill(monitor, no_restart=False)
    with pytest.raises(CheckpointSaveError):  # retried across the restart; the step already failed
        coord.register(2, checkpoint_thread_count=2)
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(2, timeout_s=60)
    assert_never_committed(root, 2)
    # A late save of the failed step is refused, never commits it.
    coord.save_async("b", lambda: _write(root, 2, "late.bin"), 2)
    with pytest.raises(CheckpointSaveError):
        coord.wait_all()
    assert_never_committed(root, 2)
    # SIGKILL of the monitor's process.
    pid = ray.get(monitor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, 9)
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(2, timeout_s=60)
    assert_never_committed(root, 2)
    coord.close()
    # A new job: a new monitor on the same root.
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), timeout_s=60, what="the old monitor to be gone")
    monitor2 = make_monitor(root, run=run_name + "n")
    coord2 = _wait_alive(lambda: ckptd.CheckpointCoordinator(monitor2, worker_id="w1"))
    assert_never_committed(root, 2)
    with pytest.raises((CheckpointError, TimeoutError)):
        coord2.wait_committed(2, timeout_s=3)
    assert_never_committed(root, 2)
    _good_then_commit(coord2, root, "model", 3)
    assert_never_committed(root, 2)
    coord2.close()


def test_checkpoint_waits_for_state_dict_saves_of_its_step(make_monitor, tmp_path):
    root = _root(tmp_path)
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    gate = threading.Event()

    def slow_sd():
        assert gate.wait(60)
        _write(root, 7, "sd.bin")

    coord.save_async("sd", slow_sd, 7, is_state_dict=True)
    coord.save_async("opt", lambda: _write(root, 7, "opt.bin"), 7)
    coord.register(7, state_dict_thread_count=1, checkpoint_thread_count=1)
    with pytest.raises(TimeoutError):
        coord.wait_committed(7, timeout_s=3)
    assert assert_trackers_verified(root) == {}
    gate.set()
    coord.wait_all()
    coord.wait_committed(7, timeout_s=60)
    coord.wait_committed(7, is_state_dict=True, timeout_s=60)
    assert assert_trackers_verified(root) == {"checkpoint": 7, "state_dict": 7}
    c = ckptd.verify(root, 7, kind="checkpoint")
    assert c is not None
    coord.close()


def test_checkpoint_with_failed_state_dict_never_commits(env):
    root, s8 = env.root, env.s + 8
    coord = env.coord()
    coord.save_async("sd", _raiser(root, s8, Boom("sd")), s8, is_state_dict=True)
    coord.save_async("opt", lambda: _write(root, s8, "opt.bin"), s8)
    register_failing(coord, s8, state_dict_thread_count=1, checkpoint_thread_count=1)
    with pytest.raises(CheckpointSaveError):
        coord.wait_all()
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(s8, timeout_s=60)
    assert_never_committed(root, s8)
    coord.close()


def test_registrations_add_up_when_counts_differ(make_monitor, tmp_path):
    """The monitor's contract (actor.register): registrations of a step add up."""
    root = _root(tmp_path)
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(9, checkpoint_thread_count=1)
    coord.register(9, checkpoint_thread_count=2)
    for n in ("a", "b"):
        coord.save_async(n, lambda n=n: _write(root, 9, f"{n}.bin"), 9)
    coord.wait_all()
    with pytest.raises(TimeoutError):  # expects 3 units, 2 finished
        coord.wait_committed(9, timeout_s=3)
    coord.save_async("c", lambda: _write(root, 9, "c.bin"), 9)
    coord.wait_all()
    coord.wait_committed(9, timeout_s=60)
    assert assert_trackers_verified(root)["checkpoint"] == 9
    coord.close()


def test_the_same_counts_registered_twice_add_up_as_documented(env):
    """register's contract (Trinity's): two calls with 1 expect two units."""
    from ckptd.config import Kind

    root, monitor, s10 = env.root, env.monitor, env.s + 10
    coord = env.coord()
    coord.register(s10, checkpoint_thread_count=1)
    coord.register(s10, checkpoint_thread_count=1)
    coord.save_async("a", lambda: _write(root, s10, "a.bin"), s10)
    coord.wait_all()
    st = ray.get(monitor.status.remote()).step(s10, Kind.CHECKPOINT)
    assert st.expected == 2 and not st.committed
    coord.save_async("b", lambda: _write(root, s10, "b.bin"), s10)
    coord.wait_committed(s10, timeout_s=30)


def test_state_dict_committed_then_checkpoint_unit_fails(make_monitor, tmp_path):
    """Step 11's state dict commits; a checkpoint unit of the same step then fails (Boom): the
    checkpoint never commits, also across a SIGKILL of the monitor, and the trackers stay valid."""
    root = _root(tmp_path)
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("sd", lambda: _write(root, 11, "sd.bin"), 11, is_state_dict=True)
    coord.register(11, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_all()
    coord.wait_committed(11, is_state_dict=True, timeout_s=60)
    assert assert_trackers_verified(root) == {"state_dict": 11}
    coord.save_async("opt", _raiser(root, 11, Boom("opt")), 11)
    with pytest.raises(CheckpointSaveError):
        coord.wait_all()
    register_failing(coord, 11, checkpoint_thread_count=1)
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(11, timeout_s=60)
    pid = ray.get(monitor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, 9)
    with pytest.raises(CheckpointSaveError):
        coord.wait_committed(11, timeout_s=60)
    seen = assert_trackers_verified(root)
    assert "checkpoint" not in seen
    assert not os.path.exists(os.path.join(ckptd.step_dir(root, 11), "ckptd_manifest.json"))
    coord.close()
