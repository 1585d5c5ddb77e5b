"""A monitor that a newer job fenced out while it had nothing to publish: a job started on the
same root from another Ray cluster (which cannot see this monitor, so does not refuse or stop
it) opens the next attempt with ``open_attempt``, as its ``start_monitor`` does. The old monitor
must tell its callers within seconds, not leave an unbounded wait until ``step_timeout_s``; and
an attempt that a losing ``start_monitor`` takes back at once must not fence it."""

from __future__ import annotations

import os

import pytest
import ray

import ckptd
from ckptd.layout import LEDGER_DIR
from ckptd.monitor.actor import FENCE_CHECK_S
from ckptd.monitor.attempts import open_attempt
from ckptd.storage import Storage

from .helpers import commit_one, in_thread, read_manifest, tracker_of, wait_for, write_file

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
CKPT = ckptd.Kind.CHECKPOINT


def _newer_attempt_seen(monitor) -> int | None:
    return ray.get(monitor.__ray_call__.remote(lambda self: self._newer_attempt))


def test_an_idle_monitor_fenced_out_by_a_job_on_another_cluster_fails_its_steps_within_seconds(
        make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)  # step_timeout_s: 3600
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.register(2, checkpoint_thread_count=1)
    newer = open_attempt(Storage(root), "the-next-job", None)  # the new job, elsewhere
    outcome, error = in_thread(lambda: coord.wait_committed(2, timeout_s=None), 3 * FENCE_CHECK_S + 5)
    assert outcome == "raised", f"the wait was still waiting {3 * FENCE_CHECK_S + 5:g} s after the root was taken"
    assert isinstance(error, ckptd.CheckpointSaveError) and f"superseded by attempt {newer.attempt}" in str(error)
    assert ray.get(monitor.status.remote()).fenced is not None
    # Nothing of the old job was published over the new one's root, and a new save is refused.
    assert tracker_of(root, CKPT) == 1 and read_manifest(root, 2, CKPT) is None
    coord.register(3, checkpoint_thread_count=1)
    path = f"{coord.step_dir(3)}/model.bin"
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        coord.save_sync(lambda: write_file(path, os.urandom(64)), 3)
    assert read_manifest(root, 3, CKPT) is None and tracker_of(root, CKPT) == 1
    coord.close()


def test_an_attempt_taken_back_by_a_losing_start_monitor_does_not_fence_the_live_monitor(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.register(2, checkpoint_thread_count=1)
    storage = Storage(root)
    loser = open_attempt(storage, "a-racing-job", None)
    wait_for(lambda: _newer_attempt_seen(monitor) == loser.attempt, timeout_s=DEADLINE_S,
             what="a fence check to see the racing attempt")
    storage.rm(storage.join(LEDGER_DIR, "attempts", f"{loser.attempt}.json"))  # as start_monitor's _undo does
    wait_for(lambda: _newer_attempt_seen(monitor) is None, timeout_s=DEADLINE_S,
             what="the next fence check to find it gone")
    assert ray.get(monitor.status.remote()).fenced is None
    path = f"{coord.step_dir(2)}/model.bin"  # step 2, registered before the race, still commits
    coord.save_sync(lambda: write_file(path, os.urandom(64)), 2)
    coord.wait_committed(2, timeout_s=DEADLINE_S)
    assert tracker_of(root, CKPT) == 2
    coord.close()
