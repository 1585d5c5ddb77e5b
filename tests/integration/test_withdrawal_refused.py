"""A withdrawal that storage refuses for a while does not hold back the worker that set it off.

A unit of step 1's full checkpoint replaces a file of step 1's committed state dict, which
withdraws that state dict. The withdrawal is retried until storage accepts the manifest's removal;
it used to run inside the unit's report, so every later notification of that worker's process
(one coordinator sends them in turn) waited behind it, and its other saves did not commit. Found
by helper-83's attack (session 44), and by helper-86's for a unit of the failing step started
meanwhile."""

from __future__ import annotations

import os
import re
import zlib

import pytest
import ray

import ckptd
from ckptd import protocol
from ckptd.storage import Storage

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    busy_coroutines,
    commit_one,
    failpoint_env,
    held_at,
    in_thread,
    read_manifest,
    restart_monitor,
    revoke_loops,
    tracker_of,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
SD = ckptd.Kind.STATE_DICT


def _replace(weights: str) -> list[str]:
    return write_file(weights, os.urandom(4096))  # reported: the "finished" report names the file


def _replace_then_fail(weights: str) -> list[str]:
    write_file(weights, os.urandom(4096))
    raise OSError("the optimizer's file could not be written")  # reported as failed, with no files


def _replace_unreported(weights: str) -> list[str]:
    write_file(weights, os.urandom(4096))  # the full checkpoint's commit finds it
    return write_file(f"{os.path.dirname(weights)}/optim.bin", b"optimizer")


@pytest.mark.parametrize("unit", [_replace, _replace_then_fail, _replace_unreported],
                         ids=["reported-finished", "reported-failed", "found-by-the-commit"])
def test_a_withdrawal_storage_refuses_does_not_hold_back_the_workers_other_saves(make_monitor, tmp_path, unit):
    """Also a unit of the failing step that the same worker starts meanwhile: its refusal waited for
    the whole withdrawal too (an admission waited until the failure was reported, and a commit
    that found the change held its step until the withdrawal ended). Found by helper-86."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    weights = f"{coord.step_dir(1)}/weights.bin"
    coord.register(1, checkpoint_thread_count=1)
    accepted = str(tmp_path / "accepted")
    arm_in_monitor(monitor, "before_revoke", f"raise_until:{accepted}")
    try:
        coord.save_async("optimizer-1", lambda: unit(weights), 1)
        wait_for(lambda: any(revoke_loops(monitor, 1)), DEADLINE_S, "state dict 1's withdrawal refused, retried")
        ran = []
        coord.save_async("late-1", lambda: ran.append(1), 1)  # refused: step 1 failed
        # A registration of step 1 is answered once the failures are on storage (helper-86/88's
        # open item, session 46): in the background, it would hold back the units started after it
        # (the registration barrier), step 2's among them; the state dict counts as failed.
        coord.register(1, checkpoint_thread_count=1, wait=False)
        for answer in (r"^checkpoint save of step 1 failed", r"^state_dict save of step 1 failed.*withdrawn"):
            # The first raises the background one's answer; the second is its own (a state dict
            # being withdrawn counts as failed).
            outcome = in_thread(lambda: coord.register(1, is_state_dict=True), timeout_s=DEADLINE_S / 2)
            assert outcome[0] == "raised" and isinstance(outcome[1], ckptd.CheckpointSaveError), outcome
            assert re.search(answer, str(outcome[1])), outcome
        # The same worker saves step 2's state dict: it commits while storage still refuses the
        # removal of step 1's manifest.
        commit_one(coord, 2, "weights.bin", is_state_dict=True, timeout_s=DEADLINE_S / 2)
        assert tracker_of(root, SD) == 2 and ran == []
        assert read_manifest(root, 1, SD) is not None and any(revoke_loops(monitor, 1))
        # Meanwhile state dict 1 is not answered as committed, nor its full checkpoint as failed:
        # that waits until no manifest claims the replaced file.
        for is_state_dict in (True, False):
            with pytest.raises(TimeoutError, match="not committed within 1"):
                coord.wait_committed(1, is_state_dict=is_state_dict, timeout_s=1)
    finally:
        arm_in_monitor(monitor, "before_revoke", None)
        open(accepted, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(1, is_state_dict=True, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError, match="step 1"):
        coord.wait_all()
    assert read_manifest(root, 1, SD) is None
    assert tracker_of(root, SD) == 2
    assert ray.get(monitor.__ray_call__.remote(lambda self: dict(self._withdrawals))) == {}
    assert_trackers_verified(root)
    coord.close()


def test_a_retried_report_of_the_unit_that_replaced_a_file_says_the_state_dict_was_withdrawn(make_monitor, tmp_path):
    """The report of a unit that replaced a committed state dict's file withdraws that state dict;
    its worker, which lost the answer, sends it again. The answer said the report was wrong
    (storage no longer held what the withdrawn state dict listed, so the check found nothing
    changed). Found by helper-85's attack (session 44)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    coord.register(1, checkpoint_thread_count=1)
    unit = {"worker": "w1", "name": "optimizer", "step": 1, "kind": "checkpoint", "call": "w1-1"}
    assert ray.get(monitor.notify_batch.remote([("started", unit, None)])) == [{"admitted": True}]
    data = os.urandom(4096)
    (path,) = write_file(f"{coord.step_dir(1)}/weights.bin", data)
    entry = {"path": "weights.bin", "size": len(data), "crc32": f"{zlib.crc32(data):08x}",
             "mtime_ns": os.stat(path).st_mtime_ns}
    report = ("finished", unit, {"files": [entry], "found": False})
    answers = [ray.get(monitor.notify_batch.remote([report]))[0] for _ in range(2)]
    for answer in answers:
        assert "committed files must not change, so that state dict is withdrawn" in answer["refused"], answer
        assert "report is wrong" not in answer["refused"]
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(1, is_state_dict=True, timeout_s=DEADLINE_S)
    assert read_manifest(root, 1, SD) is None and tracker_of(root, SD) is None
    coord.close()


def _left_behind(monitor) -> tuple[dict, dict]:
    return ray.get(monitor.__ray_call__.remote(lambda self: (dict(self._withdrawals), dict(self._failures_on_storage))))


def test_a_monitor_restarted_during_a_refused_withdrawal_never_answers_that_state_dict_committed(
        make_monitor, tmp_path):
    """The monitor dies while storage refuses the removal of state dict 1's manifest (its failure
    is recorded). The restarted monitor found the manifest, counted the state dict committed, and
    answered waits so until its check of the files (here slowed) found them changed; and once the
    withdrawal ended, a wait begun meanwhile was not woken (the failure was recorded before the
    restart, so nothing reported it again). Found by helper-87's attack.

    Also a registration of state dict 1 while the restarted monitor's start-up checks another
    step's state dict (held here) before it resumes step 1's withdrawal: it was answered as if
    the state dict stood, though its failure was on storage (helper-90, session 46)."""
    root = str(tmp_path / "ckpt")
    accepted, checked = str(tmp_path / "accepted"), str(tmp_path / "checked")
    monitor = make_monitor(root, runtime_env=failpoint_env(f"before_revoke=raise_until:{accepted},"
                                                           f"state_dict_check=until:{2 * DEADLINE_S}:{checked}"))
    arm_in_monitor(monitor, "state_dict_check", "delay:0")  # held only in the restarted monitor
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 3):  # step 3's state dict is checked again at start-up: its full checkpoint is under way
        commit_one(coord, step, "weights.bin", is_state_dict=True)
        coord.register(step, checkpoint_thread_count=1)
    try:
        coord.save_async("optimizer-1", lambda: _replace(f"{coord.step_dir(1)}/weights.bin"), 1)
        wait_for(lambda: any(revoke_loops(monitor, 1)), DEADLINE_S, "state dict 1's withdrawal refused, retried")
        restart_monitor(monitor, how="sigkill")
        answer = ray.get(monitor.wait_committed.remote(1, "state_dict", 0.5))
        assert not answer["committed"] and answer["cause"] is None, answer
        wait_for(lambda: "_changed_state_dict" in busy_coroutines(monitor), DEADLINE_S, "the check of step 3")
        answer = ray.get(monitor.register.remote(1, {}, "state_dict", "after-the-restart"))["error"]
        assert answer is not None and "so that state dict is withdrawn" in answer["cause"], answer
        open(checked, "w").close()
        waiting = monitor.wait_committed.remote(1, "state_dict", 2 * DEADLINE_S)
        wait_for(lambda: any(revoke_loops(monitor, 1)), DEADLINE_S, "the restarted monitor's withdrawal retried")
        assert ckptd.latest_step(root, "state_dict") == 3
    finally:
        open(checked, "w").close()
        open(accepted, "w").close()
    answer = ray.get(waiting, timeout=DEADLINE_S)
    assert not answer["committed"] and "withdrawn" in answer["cause"], answer
    assert read_manifest(root, 1, SD) is None and tracker_of(root, SD) == 3
    assert _left_behind(monitor) == ({}, {})
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    coord.close()


def test_a_monitor_restarted_before_it_heard_of_a_failure_refuses_the_steps_units_while_storage_refuses(
        make_monitor, tmp_path):
    """A unit of step 1's full checkpoint replaces a file of state dict 1, fails, and writes its
    failure receipt; the monitor dies before the unit's report reaches it (nor is it sent again:
    its worker is gone). The restarted monitor finds the file changed and withdraws the state dict,
    which storage refuses; it recorded the checkpoint's failure only once the withdrawal had ended,
    so a unit of step 1 another worker started meanwhile waited for it, and with it that worker's
    save of step 2. Found by helper-87's attack."""
    root = str(tmp_path / "ckpt")
    accepted = str(tmp_path / "accepted")
    monitor = make_monitor(root, runtime_env=failpoint_env(f"before_revoke=raise_until:{accepted}"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    coord.register(1, checkpoint_thread_count=1)
    gone = {"worker": "w1", "name": "optimizer", "step": 1, "kind": "checkpoint", "call": "w1-1"}
    assert ray.get(monitor.notify_batch.remote([("started", gone, None)])) == [{"admitted": True}]
    write_file(f"{coord.step_dir(1)}/weights.bin", os.urandom(4096))
    protocol.write_failed(Storage(root), ray.get(monitor.ping.remote())["attempt"], protocol.UnitId.from_dict(gone),
                          protocol.UnitFailure(unit="w1/optimizer", error_type="OSError", message="disk full"))
    restart_monitor(monitor, how="sigkill")
    try:
        wait_for(lambda: any(revoke_loops(monitor, 1)), DEADLINE_S, "the restarted monitor's withdrawal retried")
        ran = []
        coord.save_async("late-1", lambda: ran.append(1), 1)
        commit_one(coord, 2, "weights.bin", is_state_dict=True, timeout_s=DEADLINE_S / 2)
        assert tracker_of(root, SD) == 2 and ran == []
        assert read_manifest(root, 1, SD) is not None and any(revoke_loops(monitor, 1))
        for is_state_dict in (True, False):  # reported once the withdrawal has ended
            with pytest.raises(TimeoutError, match="not committed within 1"):
                coord.wait_committed(1, is_state_dict=is_state_dict, timeout_s=1)
    finally:
        open(accepted, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(1, is_state_dict=True, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_committed(1, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError, match="step 1"):
        coord.wait_all()
    assert read_manifest(root, 1, SD) is None and tracker_of(root, SD) == 2
    assert _left_behind(monitor) == ({}, {})
    assert_trackers_verified(root)
    coord.close()


def _found_changed(monitor, step: int) -> bool:
    """Whether the monitor knows the state dict of ``step`` must go (being withdrawn, or failed)."""
    def probe(self, step=step):
        rec = self._ledger.get(step)
        return rec is not None and (rec[SD].withdrawing or rec[SD].state.value == "failed")
    return ray.get(monitor.__ray_call__.remote(probe))


def test_a_registration_after_a_restarts_check_found_the_change_is_answered_withdrawn(make_monitor, tmp_path):
    """A unit of step 1's full checkpoint replaces a file of state dict 1 and fails; the monitor
    dies during the check that failure set off. The restarted monitor's start-up finds state dict
    1 changed, but began withdrawing it only once every step was checked, and storage refuses to
    read step 2's file (its check retries): meanwhile a registration of state dict 1 was accepted
    as if it stood, while waits on it were not answered "committed". Found by helper-91's attack
    (session 46). The withdrawal now begins once the change is found."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2, 3):
        commit_one(coord, step, "weights.bin", is_state_dict=True)
    for step in (1, 2):  # both state dicts are checked again at start-up: their full checkpoints are under way
        coord.register(step, checkpoint_thread_count=1)
    step2 = f"{coord.step_dir(2)}/weights.bin"
    kept = open(step2, "rb").read()
    checked = str(tmp_path / "checked")
    arm_in_monitor(monitor, "state_dict_check", f"until:{DEADLINE_S:g}:{checked}")
    coord.save_async("optimizer-1", lambda: _replace_then_fail(f"{coord.step_dir(1)}/weights.bin"), 1)
    try:
        wait_for(lambda: held_at(monitor, "state_dict_check"), DEADLINE_S, "the check of state dict 1")
        os.remove(step2)
        os.symlink("/proc/self/mem", step2)  # every read of it fails (EIO): step 2's check retries
        restart_monitor(monitor, how="sigkill")
        wait_for(lambda: _found_changed(monitor, 1), DEADLINE_S, "the start-up to find state dict 1 changed")
        assert "_changed_state_dict" in busy_coroutines(monitor)  # step 2's check still retries
        answer = ray.get(monitor.register.remote(1, {}, "state_dict", "after-the-check"))["error"]
        assert answer is not None and "so that state dict is withdrawn" in answer["cause"], answer
    finally:
        open(checked, "w").close()
        if os.path.islink(step2):
            os.remove(step2)
            write_file(step2, kept)
    answer = ray.get(monitor.wait_committed.remote(1, "state_dict", DEADLINE_S))
    assert not answer["committed"] and "withdrawn" in answer["cause"], answer
    assert read_manifest(root, 1, SD) is None and read_manifest(root, 2, SD) is not None
    assert_trackers_verified(root)
    with pytest.raises(ckptd.CheckpointSaveError, match="step 1"):
        coord.wait_all()
    coord.close()
