"""Invariant: nobody is told that a kind of a step failed before that failure is recorded on
storage (else a monitor restarted in between, finding every unit finished, could commit it).

A state-dict unit that fails after its state dict committed fails only the step's full
checkpoint; the monitor then checked the committed state dict's files before it recorded that
failure. During that check the full checkpoint was failed in memory with nothing on storage yet,
and a registration of it was answered "failed" at once (helper-91's finding, session 46; fixed in
session 47). The failure is now recorded before the check, so that the registration waits for the
record only, not for a read of the whole state dict (which storage may refuse for long)."""

from __future__ import annotations

import os

import pytest
import ray

import ckptd
from ckptd.layout import step_failure_path
from ckptd.storage import Storage

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    busy_coroutines,
    commit_one,
    held_at,
    replace_same_size,
    threads_held_at,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
CKPT = ckptd.Kind.CHECKPOINT


def _fails() -> None:
    raise OSError("the late state-dict unit could not write")


def _state_dict_1_then_its_full_checkpoint_registered(make_monitor, tmp_path):
    """State dict 1 committed, then step 1's full checkpoint registered (one unit): a state-dict
    unit of step 1 now counts toward the full checkpoint only. (root, monitor, coordinator)"""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    coord.register(1, checkpoint_thread_count=1)
    return root, monitor, coord


def test_a_registration_during_the_check_a_late_units_failure_sets_off_is_answered_once_the_failure_is_recorded(
        make_monitor, tmp_path):
    root, monitor, coord = _state_dict_1_then_its_full_checkpoint_registered(make_monitor, tmp_path)
    checked = str(tmp_path / "checked")
    arm_in_monitor(monitor, "state_dict_check", f"until:{2 * DEADLINE_S:g}:{checked}")
    attempt = ray.get(monitor.ping.remote())["attempt"]
    record = step_failure_path(Storage(root), attempt, 1, CKPT)
    try:
        coord.save_async("model-late", _fails, 1, is_state_dict=True)  # counts toward the full checkpoint only
        wait_for(lambda: held_at(monitor, "state_dict_check"), DEADLINE_S, "the check of state dict 1")
        assert "_changed_state_dict" in busy_coroutines(monitor)
        answer = monitor.register.remote(1, {"checkpoint": 1}, "checkpoint", "during-the-check")
        # Answered while the check is still held: the failure is recorded before the check.
        wait_for(lambda: ray.wait([answer], timeout=0)[0], DEADLINE_S, "the registration's answer")
        assert held_at(monitor, "state_dict_check")
        assert os.path.exists(record), f"told {ray.get(answer)['error']} with no failure record on storage"
    finally:
        open(checked, "w").close()
    error = ray.get(answer, timeout=DEADLINE_S)["error"]
    assert os.path.exists(record)
    assert error is not None and error["type"] == "CheckpointSaveError" and error["kind"] == "checkpoint", error
    assert "model-late" in str(error["unit"]) + str(error["cause"]), error
    with pytest.raises(ckptd.CheckpointSaveError, match="step 1"):
        coord.wait_all()
    assert ckptd.latest_step(root, "state_dict") == 1 and ckptd.latest_step(root) is None
    assert_trackers_verified(root)
    coord.close()


def test_a_file_replaced_after_the_records_check_is_withdrawn_by_the_failed_units_check(make_monitor, tmp_path):
    """Both checks of state dict 1 run at once once the full checkpoint's failure is recorded
    first: the recording's and the failed state-dict unit's. The first one to read storage is held
    here; the other finds nothing changed, the file is replaced, then the held one reads it. That
    check only decided the unit's answer, and nothing withdrew the state dict: its tracker named
    bytes that were gone (helper-95's attack on d9ae203). Whichever check finds a change now
    withdraws the state dict."""
    root, monitor, coord = _state_dict_1_then_its_full_checkpoint_registered(make_monitor, tmp_path)
    checked = str(tmp_path / "checked")

    def first_check_only(_self, once=str(tmp_path / "once")):
        os.environ["CKPTD_FAILPOINTS_ONCE"] = once
    ray.get(monitor.__ray_call__.remote(first_check_only))
    arm_in_monitor(monitor, "state_dict_check", f"until:{2 * DEADLINE_S:g}:{checked}")
    try:
        coord.save_async("model-late", _fails, 1, is_state_dict=True)
        wait_for(lambda: held_at(monitor, "state_dict_check"), DEADLINE_S, "the first check of state dict 1")
        wait_for(lambda: _reported(monitor, 1), DEADLINE_S, "the other check to pass, and the failure reported")
        assert threads_held_at(monitor, "state_dict_check") == 1
        replace_same_size(os.path.join(ckptd.step_dir(root, 1), "weights.bin"))
    finally:
        open(checked, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError, match="model-late") as raised:
        coord.wait_all()  # the unit's answer: once its check found the change, and the withdrawal began
    assert "does not fail" not in str(raised.value)
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(1, is_state_dict=True, timeout_s=DEADLINE_S)
    assert ckptd.latest_step(root, "state_dict") is None and ckptd.latest_step(root) is None
    assert_trackers_verified(root)
    coord.close()


def _reported(monitor, step: int) -> bool:
    """Whether the monitor reported the full checkpoint's failure (waits on it answer "failed")."""
    return ray.get(monitor.__ray_call__.remote(lambda self, step=step: (step, CKPT) in self._failures_durable))
