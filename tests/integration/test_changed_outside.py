"""Committed files changed outside ckptd (a stray `rm`, another tool writing the same path, a copy
cut short): a new job's start_monitor refuses to start on the step its trackers would name, before
writing anything, and says what to do; a Ray restart of a running job's monitor moves the trackers
off it to the newest step that still holds its files. A file only copied back (new modification
time, same bytes) is no change, and an unchanged step is not read to find that out."""

from __future__ import annotations

import os

import fsspec
import pytest
import ray
import torch

import ckptd
import ckptd.manifest
from ckptd.fencing import list_attempts
from ckptd.monitor.attempts import open_attempt
from ckptd.monitor.fence_watch import FENCE_CHECK_S
from ckptd.storage import Storage

from .helpers import commit_one, replace_same_size, restart_monitor, tracker_of, wait_for, write_file
from .test_fenced_idle_monitor import _take_back

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def _a_job_commits(make_monitor, root: str, *saves: tuple[int, str, bool], run: str | None = None,
                   under_way: tuple[int, ...] = ()) -> None:
    """A job (its own monitor) commits each ``(step, file, is_state_dict)`` in turn, one unit
    each, registers the full checkpoints of the steps ``under_way`` (their state dicts committed:
    a unit of theirs may have been writing when it stopped), and is gone."""
    monitor = make_monitor(root, run=run)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step, rel, is_state_dict in saves:
        commit_one(coord, step, rel, is_state_dict=is_state_dict)
    for step in under_way:
        coord.register(step, checkpoint_thread_count=1)
    coord.close()
    ray.kill(monitor, no_restart=True)


CHANGES = {
    "rewritten": replace_same_size,  # same size, other bytes: only the checksum tells
    "deleted": os.remove,
    "truncated": lambda path: os.truncate(path, 10),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_new_job_refuses_to_start_on_a_newest_step_changed_outside_ckptd(make_monitor, tmp_path, change):
    root = str(tmp_path / "ckpt")
    _a_job_commits(make_monitor, root, (1, "model.bin", False), (2, "model.bin", False))
    CHANGES[change](f"{root}/global_step_2/model.bin")
    attempts = list_attempts(Storage(root))
    with pytest.raises(ckptd.CorruptCheckpointError, match=r"step 2 \(checkpoint\).*model\.bin are missing or "
                       r"changed.*ckptd retire \S+ --after 1.*ckptd verify \S+ --step 2") as refused:
        make_monitor(root, run="the-next-job")
    assert "no longer holds the files its manifest lists" in str(refused.value)
    # Nothing written: no attempt opened, the tracker as it was.
    assert list_attempts(Storage(root)) == attempts and tracker_of(root, CKPT) == 2
    # What the message says to do works: retired, the next start names step 1.
    ckptd.retire_steps(root, after=1)
    monitor = make_monitor(root, run="the-job-after")
    assert tracker_of(root, CKPT) == 1 and ckptd.latest_step(root) == 1
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 2, "model.bin", is_state_dict=False)
    assert tracker_of(root, CKPT) == 2 and ckptd.verify(root).step == 2
    coord.close()


def _checkpoint_2_and_state_dict_3(make_monitor, root: str) -> None:
    _a_job_commits(make_monitor, root, (2, "model.bin", False), (3, "weights.bin", True))


def test_the_step_the_state_dict_tracker_names_is_checked_too(make_monitor, tmp_path):
    """The state-dict tracker names the newest state dict (step 3, saved after checkpoint 2); the
    second job's start-up discarded the first's records of it, so it is a committed step like any."""
    root = str(tmp_path / "ckpt")
    _checkpoint_2_and_state_dict_3(make_monitor, root)
    ray.kill(make_monitor(root, run="the-second-job"), no_restart=True)
    os.remove(f"{root}/global_step_3/weights.bin")
    with pytest.raises(ckptd.CorruptCheckpointError, match=r"step 3 \(state_dict\).*weights\.bin.*--after 2"):
        make_monitor(root, run="the-third-job")
    assert tracker_of(root, SD) == 3


def test_a_state_dict_whose_checkpoint_was_under_way_is_withdrawn_by_the_clean_up_not_refused(make_monitor, tmp_path):
    """Step 3's full checkpoint was registered when the first job stopped (its records say so), so
    a unit may have replaced its file: the next job's clean-up withdraws that state dict, as
    before; start_monitor's check leaves it to it. (With every save of the step done and no full
    checkpoint registered, the change is one made outside ckptd: the start is refused, as in
    ``test_the_step_the_state_dict_tracker_names_is_checked_too``.)"""
    root = str(tmp_path / "ckpt")
    _a_job_commits(make_monitor, root, (2, "model.bin", False), (3, "weights.bin", True), under_way=(3,))
    os.remove(f"{root}/global_step_3/weights.bin")
    make_monitor(root, run="the-next-job")
    assert tracker_of(root, SD) == 2 and ckptd.latest_step(root, "state_dict") == 2
    assert not os.path.exists(f"{root}/global_step_3/ckptd_state_dict_manifest.json")


def test_files_copied_back_with_new_times_start_and_unchanged_ones_are_not_read(make_monitor, tmp_path, monkeypatch):
    """A file restored from the mirror (same bytes, a new modification time) is checksummed and
    passes; the start-up reads no file whose size and time are as committed."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(2, checkpoint_thread_count=2)
    coord.save_state_async("model", {"w": torch.arange(1000.0)}, 2)
    coord.save_async("extra", lambda: write_file(f"{coord.step_dir(2)}/extra.bin", b"e" * 100), 2)
    coord.wait_committed(2, timeout_s=60)
    coord.close()
    ray.kill(monitor, no_restart=True)
    read = []
    crc32_file = ckptd.manifest.crc32_file
    monkeypatch.setattr(ckptd.manifest, "crc32_file", lambda s, path: read.append(path) or crc32_file(s, path))
    copied = f"{root}/global_step_2/extra.bin"
    os.utime(copied, ns=(os.stat(copied).st_atime_ns, os.stat(copied).st_mtime_ns + 10**9))
    make_monitor(root, run="the-next-job")  # start_monitor's check runs here, in this process
    assert read == [copied]
    assert tracker_of(root, CKPT) == 2


def test_a_restart_of_a_running_jobs_monitor_moves_the_trackers_off_a_step_changed_outside_ckptd(
        make_monitor, tmp_path):
    """The run must go on (a Ray restart does not end it over one step), and its trackers must not
    name a step every loader refuses: they go back to the newest step that holds its files."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2, 3):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    os.remove(f"{root}/global_step_3/model.bin")
    replace_same_size(f"{root}/global_step_2/model.bin")
    restart_monitor(monitor)
    assert tracker_of(root, CKPT) == 1 and tracker_of(root, SD) == 1
    assert ckptd.latest_step(root) == 1 and ckptd.verify(root).step == 1
    commit_one(coord, 4, "model.bin", is_state_dict=False)  # the run goes on past them
    assert tracker_of(root, CKPT) == 4 and ckptd.verify(root).step == 4
    coord.close()


def test_an_s3_root_is_checked_from_its_listing(make_monitor, s3_root):
    root, opts = s3_root
    monitor = make_monitor(root, opts)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2):
        coord.register(step, checkpoint_thread_count=1)
        coord.save_state_async("model", {"w": torch.full((64,), float(step))}, step)
        coord.wait_committed(step, timeout_s=60)
    coord.close()
    ray.kill(monitor, no_restart=True)
    fs, path = fsspec.core.url_to_fs(f"{root}/global_step_2/model.safetensors", **opts)
    fs.pipe_file(path, b"x" * 10)  # another object (its time may be the same second: S3's times are coarse)
    with pytest.raises(ckptd.CorruptCheckpointError, match=r"step 2 \(checkpoint\).*model\.safetensors"):
        make_monitor(root, opts, run="the-next-job")
    assert ckptd.latest_step(root, storage_options=opts) == 2  # nothing written


@pytest.mark.parametrize("change", ["rewritten", "deleted"])
def test_a_restart_moves_the_state_dict_tracker_off_a_state_dict_saved_alone_whose_file_changed(
        make_monitor, tmp_path, change):
    """State dict 3 alone, its records still there (its full checkpoint may come): start-up's
    check left it to the resume, which checks a state dict alone no more, so the tracker stayed
    on a step verify refuses (helper-77)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 2, "model.bin", is_state_dict=False)
    commit_one(coord, 3, "weights.bin", is_state_dict=True)
    CHANGES[change](f"{root}/global_step_3/weights.bin")
    restart_monitor(monitor)
    assert tracker_of(root, SD) == 2 and tracker_of(root, CKPT) == 2
    assert ckptd.verify(root, kind="state_dict").step == 2
    coord.close()


def test_a_state_dict_under_way_does_not_stand_in_for_an_older_one_that_changed(make_monitor, tmp_path):
    """The second job's state dict 3 (its records left) will be withdrawn by the next job's
    clean-up; state dict 2 (settled) is then what the tracker names, and its file is gone too: the
    next start_monitor never looked at it, and started (helper-77)."""
    root = str(tmp_path / "ckpt")
    _a_job_commits(make_monitor, root, (1, "model.bin", False), (2, "weights.bin", True))
    _a_job_commits(make_monitor, root, (3, "weights.bin", True), run="the-second-job", under_way=(3,))
    for step in (2, 3):
        os.remove(f"{root}/global_step_{step}/weights.bin")
    with pytest.raises(ckptd.CorruptCheckpointError, match=r"step 2 \(state_dict\).*weights\.bin"):
        make_monitor(root, run="the-third-job")


def test_a_restart_under_a_fence_moves_the_trackers_off_a_changed_step_once_the_fence_is_lifted(
        make_monitor, tmp_path):
    """Step 2's file is replaced, and the monitor restarts while a losing ``start_monitor``'s
    attempt is on the root: fenced, it leaves its trackers to the lift. The repair after the lift
    checks the newest steps as a start-up does: the trackers go back to step 1. It took step 2 as
    committed, and the trackers stayed on a step every loader refuses (helper-79)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    storage = Storage(root)
    loser = open_attempt(storage, "a-racing-job", None)
    replace_same_size(f"{root}/global_step_2/model.bin")
    restart_monitor(monitor)
    assert "superseded" in ray.get(monitor.status.remote()).fenced
    _take_back(storage, loser.attempt)
    wait_for(lambda: tracker_of(root, CKPT) == 1 and tracker_of(root, SD) == 1, 3 * FENCE_CHECK_S + 10,
             "the trackers moved off step 2 after the lift")
    assert ckptd.verify(root).step == 1
    coord.close()
