"""Write throttling through the real monitor: limits, first come first served, slot release."""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd

from .helpers import SaveWorker, Signal, status, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")


def _slot(step: int, worker: str, name: str) -> str:
    return f"{step}/checkpoint/{worker}/{name}"


def _units(keys: list[str]) -> list[str]:
    """Slot keys without the call id (``step/kind/worker/name#call``)."""
    return [k.split("#")[0] for k in keys]


def test_single_thread_one_writer_at_a_time_first_come_first_served(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy="single_thread")
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    gates = {n: Signal.remote() for n in "abc"}
    order: list[str] = []
    lock = threading.Lock()
    active = []

    def unit(name):
        def fn():
            with lock:
                active.append(name)
                order.append(name)
                assert len(active) == 1, active
            ray.get(gates[name].wait.remote())
            with lock:
                active.remove(name)
        return fn

    for name in "abc":
        coord.save_async(name, unit(name), 1)
        # Each request is queued before the next one is made, so arrival order is a, b, c.
        wait_for(lambda name=name: _slot(1, "w0", name) in _units(status(monitor).writers.holders
                 + status(monitor).writers.waiting), what=f"{name}'s slot request")
    w = status(monitor).writers
    assert _units(w.holders) == [_slot(1, "w0", "a")]
    assert _units(w.waiting) == [_slot(1, "w0", "b"), _slot(1, "w0", "c")]
    for name in "abc":
        ray.get(gates[name].send.remote())
    coord.register(1, checkpoint_thread_count=3)
    coord.wait_all()
    coord.wait_committed(1, timeout_s=30)
    assert order == ["a", "b", "c"]


def test_failed_writer_releases_its_slot(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy="single_thread")
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("bad", lambda: 1 / 0, 1)
    coord.save_async("good", lambda: _write(root, 2), 2)
    coord.register(2, checkpoint_thread_count=1)
    with pytest.raises(ckptd.CheckpointSaveError, match="ZeroDivisionError"):
        coord.wait_all()
    coord.wait_committed(2, timeout_s=30)
    assert status(monitor).writers.holders == []


def test_killed_writer_releases_its_slot_after_its_lease(make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy="single_thread", slot_lease_s=1.0)
    worker = SaveWorker.remote(run_name, 0)
    never = Signal.remote()
    ray.get(worker.save.remote(1, gate=never))
    wait_for(lambda: status(monitor).writers.holders, what="the worker to hold the slot")
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    coord.save_async("model", lambda: _write(root, 2), 2)
    wait_for(lambda: status(monitor).writers.waiting, what="the second writer to queue")
    ray.kill(worker)
    coord.register(2, checkpoint_thread_count=1)
    coord.wait_all()
    coord.wait_committed(2, timeout_s=30)


def test_single_process_runs_one_process_at_a_time(make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy="single_process")
    w0, w1 = SaveWorker.remote(run_name, 0), SaveWorker.remote(run_name, 1)
    g0, g1 = Signal.remote(), Signal.remote()
    ray.get(w0.save.remote(1, name="model", gate=g0))
    wait_for(lambda: len(status(monitor).writers.holders) == 1, what="w0 to write")
    ray.get(w1.save.remote(1, name="model", gate=g1))
    wait_for(lambda: len(status(monitor).writers.waiting) == 1, what="w1 to queue")
    # A second writer of w0's process could run beside w0, but w1 asked first: it waits.
    ray.get(w0.save.remote(1, name="optimizer"))
    wait_for(lambda: len(status(monitor).writers.waiting) == 2, what="w0's second writer to queue")
    assert len(status(monitor).writers.holders) == 1
    ray.get(g0.send.remote())
    wait_for(lambda: status(monitor).writers.holders and all(
        "/model" in h for h in status(monitor).writers.holders) and len(status(monitor).writers.waiting) == 1,
        what="w1 to be granted")
    ray.get(g1.send.remote())
    assert ray.get([w0.wait_all.remote(), w1.wait_all.remote()]) == [None, None]
    trainer = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    trainer.register(1, checkpoint_thread_count=3)
    trainer.wait_committed(1, timeout_s=30)


def _write(root: str, step: int) -> None:
    d = ckptd.step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/m.bin", "wb") as f:
        f.write(b"x" * 100)


def test_single_thread_holds_across_a_monitor_restart(make_monitor, tmp_path):
    """A holds the slot and B waits; the monitor is killed, and Ray retries B's request on the new
    monitor. B must not be granted before A, which re-announces its slot, has finished."""
    from .helpers import restart_monitor

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy="single_thread", slot_lease_s=3.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    gate = Signal.remote()
    lock, active, overlaps = threading.Lock(), [], []

    def unit(name, wait):
        def fn():
            with lock:
                if active:
                    overlaps.append((name, list(active)))
                active.append(name)
            if wait:
                ray.get(gate.wait.remote())
            with lock:
                active.remove(name)
            path = f"{ckptd.step_dir(root, 1)}/{name}.bin"
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(name.encode())
            return [path]
        return fn

    coord.save_async("a", unit("a", True), 1)
    wait_for(lambda: _units(status(monitor).writers.holders) == [_slot(1, "w0", "a")], what="a to hold")
    coord.save_async("b", unit("b", False), 1)
    wait_for(lambda: _units(status(monitor).writers.waiting) == [_slot(1, "w0", "b")], what="b to queue")
    restart_monitor(monitor)
    # a re-announces within a third of a lease; b's retried request waits for it
    wait_for(lambda: _units(status(monitor).writers.holders) == [_slot(1, "w0", "a")], what="a to re-announce")
    assert _slot(1, "w0", "b") not in _units(status(monitor).writers.holders)
    ray.get(gate.send.remote())
    coord.register(1, checkpoint_thread_count=2)
    coord.wait_all()
    coord.wait_committed(1, timeout_s=30)
    assert overlaps == []
