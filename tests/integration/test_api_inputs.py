"""Bad input to the coordinator's calls is refused with CheckpointConfigError, saying what was
wrong, before anything is registered or written (found by a user's-eyes audit, session 36)."""

from __future__ import annotations

import os

import pytest

import ckptd

from .helpers import status
from .test_protocol_v2 import write


def test_a_run_name_instead_of_the_monitor_handle_is_refused_with_the_call_to_make(ray_local):
    with pytest.raises(ckptd.CheckpointConfigError, match=r"pass ckptd.get_monitor\('my-run'\)"):
        ckptd.CheckpointCoordinator("my-run")
    with pytest.raises(ckptd.CheckpointConfigError, match="must be the monitor's actor handle.*got NoneType"):
        ckptd.CheckpointCoordinator(None)


def test_a_kind_flag_or_timeout_of_the_wrong_type_is_refused_before_anything_happens(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    ran = []
    with pytest.raises(ckptd.CheckpointConfigError, match="is_state_dict must be True"):
        coord.save_async("m", lambda: ran.append(1), 1, is_state_dict="no")
    with pytest.raises(ckptd.CheckpointConfigError, match="is_state_dict must be True"):
        coord.register(1, is_state_dict=None, state_dict_thread_count=1)
    with pytest.raises(ckptd.CheckpointConfigError, match="timeout_s must be >= 0"):
        coord.wait_committed(1, timeout_s=-1)
    with pytest.raises(ckptd.CheckpointConfigError, match="timeout_s must be a number"):
        coord.wait_mirrored(1, timeout_s="3")
    coord.wait_all()
    assert ran == [] and status(monitor).step(1) is None and not os.path.exists(coord.step_dir(1))
    coord.close()


def test_a_save_fn_that_returns_a_dict_fails_its_unit_saying_what_to_return(make_monitor, tmp_path):
    """Its keys are not file paths: before, they were read as such ("FileNotFoundError: .../ok")."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.register(2, checkpoint_thread_count=1)

    def returns_a_dict():
        write(f"{coord.step_dir(2)}/model.bin", b"m")
        return {"ok": True}

    coord.save_async("m", returns_a_dict, 2)
    with pytest.raises(ckptd.CheckpointSaveError, match="save_fn returned dict; return None or a list of the paths"):
        coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(2, timeout_s=30)
    assert ckptd.latest_step(root) is None
    coord.close()
