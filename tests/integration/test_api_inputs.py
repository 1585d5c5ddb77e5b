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


def test_a_wait_that_times_out_says_where_the_step_stands(make_monitor, tmp_path):
    """The monitor knows why a step has not committed; the TimeoutError says it, instead of only
    "not committed within N s"."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w")
    with pytest.raises(TimeoutError, match=r"step 6 \(checkpoint\) not committed within 0.5 s: nothing of its "
                                           r"checkpoint has reached the monitor.*is_state_dict"):
        coord.wait_committed(6, timeout_s=0.5)
    coord.save_async("m", lambda: [write(f"{coord.step_dir(5)}/m.bin", b"m")], 5)  # saved, never registered
    coord.wait_all()
    with pytest.raises(TimeoutError, match=r"1 units saved but only 0 were registered: register the total"):
        coord.wait_committed(5, timeout_s=0.5)
    coord.register(7, checkpoint_thread_count=2)
    coord.save_async("a", lambda: [write(f"{coord.step_dir(7)}/a.bin", b"a")], 7)
    coord.wait_all()
    with pytest.raises(TimeoutError, match=r"1 of 2 registered units finished \(finished: w/a\)"):
        coord.wait_committed(7, timeout_s=0.5)
    coord.close()


def test_a_save_fn_that_returns_none_and_writes_nothing_in_its_step_is_warned_about(make_monitor, tmp_path, caplog):
    """Its files were most likely written elsewhere, and the step commits without them: the worker
    logs a warning saying where to write, or to return [] when nothing is written on purpose."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w")
    os.makedirs(tmp_path / "elsewhere")
    coord.register(3, checkpoint_thread_count=2)

    def writes_elsewhere() -> None:
        write(str(tmp_path / "elsewhere" / "model.bin"), b"m")

    coord.save_async("lost", writes_elsewhere, 3)
    coord.save_async("nothing", list, 3)  # says it writes nothing
    coord.wait_all()
    coord.wait_committed(3, timeout_s=30)
    warned = [r.getMessage() for r in caplog.records if "returned None and no file" in r.getMessage()]
    assert len(warned) == 1 and "save w/lost of step 3" in warned[0], warned
    assert "coord.step_dir(step)" in warned[0] and "return [] to say so" in warned[0]
    coord.close()
