"""Retention in the monitor: exactly the configured set survives, whatever the commit order,
restarts and failed deletions; leftovers of failed or crashed saves are collected."""

from __future__ import annotations

import os
import random
import time

import pytest
import ray

import ckptd

from .helpers import failpoint_env, ledger_records, restart_monitor, status, step_dirs

pytestmark = pytest.mark.usefixtures("ray_local")


def _saver(root: str, step: int, name: str, fail: bool = False):
    def save():
        d = ckptd.step_dir(root, step)
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/{name}", "wb") as f:
            f.write(os.urandom(256))
        if fail:
            raise OSError("disk full")
        return [f"{d}/{name}"]
    return save


def _save(coord, root: str, step: int, full: bool) -> None:
    """A pipeline step: weights as a state-dict unit, plus the optimizer as a checkpoint unit."""
    coord.save_async("weights", _saver(root, step, "model.bin"), step, is_state_dict=True)
    if full:
        coord.save_async("optim", _saver(root, step, "optim.bin"), step)
    coord.register(step, is_state_dict=not full, state_dict_thread_count=1,
                   checkpoint_thread_count=1 if full else 0)




def test_fifty_steps_in_random_order_with_a_restart_keep_exactly_the_configured_set(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_ckpt_to_keep=3, max_state_dict_to_keep=2, keep_every_n_steps=16)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    order = list(range(1, 51))
    random.Random(7).shuffle(order)
    for i, step in enumerate(order):
        if i == 25:
            coord.wait_all()
            restart_monitor(monitor)  # retention must carry on from storage alone
        _save(coord, root, step, full=step % 4 == 0)
    coord.wait_all()
    for step in order:
        try:
            coord.wait_committed(step, is_state_dict=step % 4 != 0, timeout_s=60)
        except ckptd.CheckpointError as e:  # committed and deleted before the restart
            assert "unknown to the monitor" in str(e) and step in order[:25]
    assert ray.get(monitor.wait_retention.remote(60))
    # Newest 3 full checkpoints, newest 2 state dicts, every 16th step; nothing else.
    assert step_dirs(root) == {40, 44, 48} | {49, 50} | {16, 32}
    assert ckptd.latest_step(root) == 48 and ckptd.latest_step(root, "state_dict") == 50
    for step in step_dirs(root):
        ckptd.verify(root, step, kind="state_dict")  # what is left is whole
    coord.close()


def test_a_failed_deletion_is_retried_and_does_not_stop_the_others(make_monitor, tmp_path, run_name):
    root = str(tmp_path / "ckpt")
    first = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(first, worker_id="w0")
    for step in range(1, 5):
        _save(coord, root, step, full=False)
    coord.wait_all()
    for step in range(1, 5):  # each: steps commit independently, and the monitor is killed next
        coord.wait_committed(step, is_state_dict=True, timeout_s=60)
    coord.close()
    ray.kill(first, no_restart=True)
    assert step_dirs(root) == {1, 2, 3, 4}

    # A new monitor on the same root keeps only 2 state dicts; its first deletion fails once.
    monitor = make_monitor(root, run=f"{run_name}-b", max_state_dict_to_keep=2,
                           runtime_env=failpoint_env("before_step_delete=raise", once_dir=tmp_path / "fp"))
    assert ray.get(monitor.wait_retention.remote(60))
    st = status(monitor).retention
    assert st.deleted_steps == [2] and "global_step_1" in st.errors[0] and "FailpointError" in st.errors[0]
    assert step_dirs(root) == {1, 3, 4} and ckptd.verify(root, 1, kind="state_dict")  # untouched, still whole

    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    _save(coord, root, 5, full=False)
    coord.wait_committed(5, is_state_dict=True, timeout_s=60)
    assert ray.get(monitor.wait_retention.remote(60))
    assert step_dirs(root) == {4, 5} and status(monitor).retention.errors == []
    coord.close()


def _old_dir(root: str, step: int, age_s: float) -> None:
    d = f"{root}/global_step_{step}"
    os.makedirs(d)
    open(f"{d}/partial.bin", "wb").write(b"x" * 10)
    t = time.time() - age_s
    os.utime(f"{d}/partial.bin", (t, t))
    os.utime(d, (t, t))


def test_leftovers_of_failed_and_crashed_saves_are_collected(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    _old_dir(root, 5, 3600)  # another tool's, there before ckptd: never deleted, however old
    monitor = make_monitor(root, max_state_dict_to_keep=2, leftover_grace_s=600)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    # Wrote a file, then failed: never commits. (Not registered: a registration racing the
    # failure would raise it there instead of in wait_all.)
    coord.save_async("weights", _saver(root, 1, "model.bin", fail=True), 1, is_state_dict=True)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    for crashed, age_s in ((2, 3600), (3, 0)):  # from a job that crashed: no ledger record
        _old_dir(root, crashed, age_s)
    _save(coord, root, 6, full=False)
    coord.wait_committed(6, is_state_dict=True, timeout_s=60)
    assert ray.get(monitor.wait_retention.remote(60))
    # Failed step 1 at once, crashed step 2 (untouched for an hour) too; step 3 was written
    # moments ago, perhaps by a save this monitor has not heard of yet: it stays for now; so
    # does step 5, another tool's.
    assert step_dirs(root) == {3, 5, 6}
    # The failed step's records stay: they are what tells a restarted monitor that it failed.
    assert ledger_records(root, 1) != []
    restart_monitor(monitor)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.register(1, is_state_dict=True, state_dict_thread_count=1)
    coord.close()
