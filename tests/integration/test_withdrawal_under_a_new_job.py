"""A withdrawal of a state dict that a newer job's attempt fences out before its tracker moves
(held at ``before_revoke``): the fenced monitor may not touch the root any more, so the newer
job's start-up finishes it. Found by a helper's attack (session 36)."""

from __future__ import annotations

import pytest

import ckptd
from ckptd.monitor.attempts import open_attempt
from ckptd.storage import Storage

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    held_at,
    read_manifest,
    tracker_of,
    wait_for,
)
from .test_fenced_idle_monitor import DEADLINE_S, SD, _rewrite, _state_dict_2_with_a_checkpoint_unit_held

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_withdrawal_fenced_before_its_tracker_moved_is_finished_by_the_new_jobs_start_up(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    go = _state_dict_2_with_a_checkpoint_unit_held(coord, _rewrite)  # its file rewritten, then reported
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_revoke", f"until:{DEADLINE_S:g}:{gate}")
    go.set()
    wait_for(lambda: held_at(monitor, "before_revoke"), DEADLINE_S, "the withdrawal held before its tracker moved")
    assert tracker_of(root, SD) == 2  # names a step whose file changed: the window the withdrawal closes
    # The newer job, from another Ray cluster (which cannot see the old monitor): its attempt fences
    # the old monitor; its start_monitor (here, one that finds that attempt newest and not live here)
    # starts the monitor whose start-up cleans the root up.
    open_attempt(Storage(root), "the-next-job", None)
    make_monitor(root, run="the-next-job")
    assert read_manifest(root, 2, SD) is None
    assert tracker_of(root, SD) == 1
    assert_trackers_verified(root)
    arm_in_monitor(monitor, "before_revoke", None)
    open(gate, "w").close()  # the old monitor's withdrawal goes on, fenced
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    assert tracker_of(root, SD) == 1
    assert_trackers_verified(root)
    coord.close()
