"""A process that outlived its job cannot publish into the next job's checkpoints.

Job 1's unit of step 5 is admitted, then waits; job 1's monitor goes for good, and job 2 starts on
the same root (a new attempt) and commits its own step 5, with a file of the same name. When job
1's unit goes on, ckptd's writer checks the root's attempts before its rename (or PUT): a newer
attempt exists, so the file is not replaced, the old unit fails with an error naming both
attempts, and step 5 still verifies with job 2's content. Without the check the old unit's rename
replaced job 2's committed file. Both writers: the save thread, and a writer process (which sets
the check in its own process)."""

from __future__ import annotations

import os
import threading
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.commit import TMP_PREFIX
from ckptd.config import Kind
from ckptd.storage import Storage
from ckptd.workers.safetensors_io import write_safetensors

from .helpers import assert_trackers_verified, start_new_job, wait_all, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")

OLD, NEW = {"w": torch.zeros(64)}, {"w": torch.ones(64)}


def write_when_open(gate: str, root: str, path: str, snapshot: dict) -> list:
    """Waits for the file ``gate`` (after creating ``{gate}.waiting``), then writes ``snapshot`` to
    ``path`` with ckptd's writer. Module level: a writer process runs it."""
    open(f"{gate}.waiting", "w").close()
    wait_for(lambda: os.path.exists(gate), timeout_s=60, what="the gate")
    return [write_safetensors(Storage(root), path, snapshot)]


def _new_job_commits_step_5(make_monitor, root: str, old_monitor) -> tuple:
    monitor2 = start_new_job(make_monitor, root, old_monitor)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    new.save_state_async("model", NEW, 5)  # the default writer: {step_dir}/model.safetensors
    new.register(5, checkpoint_thread_count=1)
    new.wait_all()
    new.wait_committed(5, timeout_s=60)
    return monitor2, new


def _assert_step_5_is_job_2s(root: str, path: str) -> None:
    assert torch.equal(load_file(path)["w"], NEW["w"])
    assert assert_trackers_verified(root)[Kind.CHECKPOINT] == 5
    ckptd.verify(root, 5)
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(TMP_PREFIX)]


def test_an_old_jobs_save_thread_cannot_replace_a_file_the_new_job_committed(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=10.0)
    path = f"{old.step_dir(5)}/model.safetensors"
    entered, go = threading.Event(), threading.Event()

    def late_save() -> list:
        entered.set()
        assert go.wait(60)
        return [write_safetensors(Storage(root), path, OLD)]

    old.save_async("model", late_save, 5)
    assert entered.wait(30)  # admitted by job 1's monitor, and now outliving it
    _, new = _new_job_commits_step_5(make_monitor, root, monitor)
    go.set()
    error = wait_all(old)
    _assert_step_5_is_job_2s(root, path)
    assert error is not None and "superseded by attempt" in error and "did not publish" in error, error
    new.close()
    old.close()


def test_an_old_jobs_writer_process_cannot_replace_a_file_the_new_job_committed(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=10.0, writer="process")
    path = f"{old.step_dir(5)}/model.safetensors"
    old.save_state_async("model", OLD, 5, partial(write_when_open, gate, root, path))
    wait_for(lambda: os.path.exists(f"{gate}.waiting"), timeout_s=60, what="the writer process to start the write")
    _, new = _new_job_commits_step_5(make_monitor, root, monitor)
    open(gate, "w").close()
    error = wait_all(old)
    _assert_step_5_is_job_2s(root, path)
    assert error is not None and "superseded by attempt" in error and "did not publish" in error, error
    new.close()
    old.close()
