"""Session 26d: attacks on e094ee6 (retention claims a step on the event loop; ``_admit`` waits
for a claimed step and restores a unit's "started" receipt for steps older than the tracker): a
step failed that way stays failed across a restart, and a new job may save it again, cleanly.

Real local Ray, real monitors and files under ``tmp_path``; failpoints armed in the monitor's
process only; nothing mocked.
"""

from __future__ import annotations

import os

import pytest
import ray

import ckptd
from ckptd.layout import Kind

from .helpers import (
    assert_trackers_verified,
    checkpoint_step1_while_deleted,
    in_thread,
    read_manifest,
    restart_monitor,
    two_state_dicts,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT = Kind.CHECKPOINT


def _fail_step1_ckpt_after_deletion(make_monitor, root, gate):
    """Step 1's full checkpoint is registered while retention holds step 1 claimed; after the
    deletion its unit writes into a fresh directory; the commit check fails (weights.bin gone)."""
    monitor, coord, _ = checkpoint_step1_while_deleted(make_monitor, root, gate, "after_delete_claim")
    coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, is_state_dict=False, timeout_s=60)
    assert ray.get(monitor.wait_retention.remote(60))
    return monitor, coord


def _try_step1_again(coord):
    d = coord.step_dir(1)
    out = in_thread(lambda: coord.register(1, checkpoint_thread_count=1), timeout_s=30)
    coord.save_async("optim2", lambda: write_file(f"{d}/optim2.bin", os.urandom(512)), 1)
    try:
        coord.wait_all()
    except Exception:
        pass
    return out, in_thread(lambda: coord.wait_committed(1, is_state_dict=False, timeout_s=15), timeout_s=30)


def test_failed_after_waiting_for_deletion_stays_failed_across_restart(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor, coord = _fail_step1_ckpt_after_deletion(make_monitor, root, str(tmp_path / "gate"))
    restart_monitor(monitor)
    reg, committed = _try_step1_again(coord)
    assert committed[0] != "ok", f"step 1's checkpoint was reported failed, yet committed after a restart: {committed}"
    assert read_manifest(root, 1, CKPT) is None
    assert_trackers_verified(root)
    coord.close()


def _new_job_saves_step1_again(make_monitor, monitor, coord, root, run_name):
    """A new job on the root re-saves step 1, which the old job failed. That is allowed (a job
    that crashed at step N resumes from an older step and saves N again: docs/contract.md,
    "Attempts and fencing"), and what commits is the new job's save alone: the failed attempt's
    files in the step are discarded, never listed."""
    coord.close()
    ray.kill(monitor, no_restart=True)
    job2 = make_monitor(root, run=f"{run_name}-b", takeover=True, max_state_dict_to_keep=2, max_ckpt_to_keep=None)
    coord2 = ckptd.CheckpointCoordinator(job2, worker_id="w")
    reg, committed = _try_step1_again(coord2)
    assert reg[0] == "ok" and committed[0] == "ok", (reg, committed)
    manifest = read_manifest(root, 1, CKPT)
    assert manifest is not None, "step 1 committed, yet has no manifest"
    # The new job's unit, and the step's state dict where the old job committed one that is kept.
    assert {f.path for f in manifest.files} - {"weights.bin"} == {"optim2.bin"}, manifest
    assert not os.path.exists(os.path.join(ckptd.step_dir(root, 1), "optim.bin"))
    assert_trackers_verified(root)
    coord2.close()


def test_a_new_job_may_save_again_a_step_failed_after_waiting_for_a_deletion(make_monitor, tmp_path, run_name):
    root = str(tmp_path / "ckpt")
    monitor, coord = _fail_step1_ckpt_after_deletion(make_monitor, root, str(tmp_path / "gate"))
    _new_job_saves_step1_again(make_monitor, monitor, coord, root, run_name)


def test_a_new_job_may_save_again_a_step_whose_unit_failed(make_monitor, tmp_path, run_name):
    """The same with no retention involved: step 1's checkpoint unit raised after writing."""
    root = str(tmp_path / "ckpt")
    monitor, coord = two_state_dicts(make_monitor, root)
    coord.register(1, checkpoint_thread_count=1)
    d = coord.step_dir(1)

    def boom():
        write_file(f"{d}/optim.bin", os.urandom(512))
        raise RuntimeError("boom")

    coord.save_async("optim", boom, 1)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, is_state_dict=False, timeout_s=60)
    _new_job_saves_step1_again(make_monitor, monitor, coord, root, run_name)
