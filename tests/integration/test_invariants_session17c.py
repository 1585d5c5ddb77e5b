"""A helper's third attack on ``register(..., wait=False)`` (session 17c): failed steps and trackers
with background registrations.

Each test mixes background registrations with unit failures, monitor restarts (SIGKILL, ray.kill)
and a new job on the same root, and checks three invariants: a tracker only ever names a step that
verifies; a step reported failed never commits (not later, not after a restart, not through a new
job, also when a wait=False registration of it is queued or retried across); and Trinity's counting
(registrations add up per kind, a full checkpoint waits for its step's state-dict units, a retried
registration counts once).
"""

from __future__ import annotations

import threading

import pytest
import ray

import ckptd
from ckptd.config import Kind

from .helpers import (
    HOLD_STEP,
    Gate,
    actor_gone,
    assert_trackers_verified,
    disk_full,
    fail_checkpoint_unit,
    hold_registrar,
    in_thread,
    read_manifest,
    registrar_held,
    restart_monitor,
    status,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = Kind.CHECKPOINT, Kind.STATE_DICT


def _files(root: str, step: int, kind: Kind = CKPT) -> list[str] | None:
    m = read_manifest(root, step, kind)
    return None if m is None else sorted(f.path for f in m.files)


def _drain(coord) -> list[BaseException]:
    """wait_all until it returns: each raises one failure (a registration's, then the saves')."""
    errors = []
    for _ in range(5):
        result = in_thread(coord.wait_all, 60)
        if result[0] == "ok":
            return errors
        assert result[0] == "raised", result
        errors.append(result[1])
    raise AssertionError(f"wait_all kept raising: {errors}")


def _failed(monitor, step: int, kind: Kind = CKPT) -> bool:
    s = status(monitor).step(step, kind)
    return s is not None and s.state.value == "failed"


# -- 2. a failed step never commits: restarts ------------------------------------------------------


@pytest.mark.parametrize("how", ["sigkill", "ray.kill"])
def test_a_unit_failing_while_its_steps_registration_is_held_keeps_the_step_failed_across_a_restart(
        make_monitor, tmp_path, how):
    """The registration of step 5 is held in the registrar; unit a of step 5 has written and waits at
    its barrier, unit b fails at once (failures do not wait for the barrier). The monitor restarts
    while the registration is still queued; once retried, it must be answered with the failure, and a
    (registration count 1, finished unit a) must never commit step 5."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    hold_registrar(coord, monitor, root)
    wrote = threading.Event()
    coord.register(5, checkpoint_thread_count=1, wait=False)
    coord.save_async("a", lambda: (write_step_file(root, 5, "a.bin"), wrote.set()) and None, 5)
    coord.save_async("b", disk_full, 5)
    assert wrote.wait(20)
    wait_for(lambda: _failed(monitor, 5), what="the failure of step 5")
    assert registrar_held(monitor)
    restart_monitor(monitor, how=how)
    errors = _drain(coord)
    assert any(isinstance(e, ckptd.CheckpointSaveError) and e.step == 5 for e in errors), errors
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(5, timeout_s=10)
    # Once more after a second restart, with another background registration of the failed step.
    restart_monitor(monitor, how="sigkill" if how == "ray.kill" else "ray.kill")
    coord.register(5, checkpoint_thread_count=1, wait=False)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(lambda: write_step_file(root, 5, "late.bin"), 5)
    assert read_manifest(root, 5, CKPT) is None and read_manifest(root, 5, SD) is None
    assert ckptd.latest_step(root) != 5
    assert assert_trackers_verified(root)[CKPT] in (None, HOLD_STEP)
    coord.close()


def test_a_failed_step_registered_in_the_background_stays_failed_while_a_later_step_commits(make_monitor, tmp_path):
    """Background registrations of a failed step, a committed one and a new one, across a SIGKILL:
    the trackers move to the new step only, and each names a step that verifies."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("m", lambda: write_step_file(root, 2, "m.bin"), 2)
    coord.register(2, checkpoint_thread_count=1, wait=False)
    coord.wait_committed(2, timeout_s=30)
    coord.register(3, checkpoint_thread_count=2, wait=False)
    coord.save_async("m", lambda: write_step_file(root, 3, "m.bin"), 3)
    fail_checkpoint_unit(coord, root, 3)  # save_sync: after the registration was applied
    _drain(coord)  # unit m of step 3 finished, or was refused once the step failed
    ray.kill(monitor, no_restart=False)  # these registrations go to the restarting monitor
    coord.register(3, checkpoint_thread_count=1, wait=False)  # of the failed step: refused
    coord.register(4, checkpoint_thread_count=1, wait=False)
    coord.register(2, checkpoint_thread_count=1, wait=False)  # of the committed step: refused
    coord.save_async("m", lambda: write_step_file(root, 4, "m.bin"), 4)
    errors = _drain(coord)
    assert [type(e) for e in errors][:1] == [ckptd.CheckpointSaveError], errors
    coord.wait_committed(4, timeout_s=30)
    s3 = status(monitor).step(3)
    assert s3 is None or s3.state.value == "failed"
    assert read_manifest(root, 3, CKPT) is None and _files(root, 2) == ["m.bin"] and _files(root, 4) == ["m.bin"]
    assert assert_trackers_verified(root) == {CKPT: 4, SD: 4}
    restart_monitor(monitor, how="sigkill")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, timeout_s=10)
    assert assert_trackers_verified(root) == {CKPT: 4, SD: 4}
    coord.close()


# -- 2. a failed step never commits: a new job -------------------------------------------------------


def test_a_new_job_under_another_run_never_commits_a_step_the_old_job_failed(make_monitor, tmp_path):
    """Job 1 fails step 5; its coordinator queues a registration of step 5 after its monitor died for
    good and a unit admitted before the failure finishes late. A new job (run "other") on the root
    must hear of neither: the queued registration is not applied to it and step 5 does not commit."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=1.0)
    old.register(5, checkpoint_thread_count=2)
    gate = Gate(root, 5, "late.bin")
    old.save_async("late", gate, 5)
    assert gate.entered.wait(20)  # admitted by job 1 before the step failed
    fail_checkpoint_unit(old, root, 5)
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="the first monitor to be gone")
    old.register(5, checkpoint_thread_count=1, wait=False)  # retried until notify_timeout_s
    monitor2 = make_monitor(root, run="other")
    gate.open()
    errors = _drain(old)
    assert errors  # the registration could not be delivered, and the late unit could not report
    assert status(monitor2).step(5) is None
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    with pytest.raises(TimeoutError):  # not committed, and job 2 knows nothing of the step
        new.wait_committed(5, timeout_s=1)
    assert read_manifest(root, 5, CKPT) is None and ckptd.latest_step(root) is None
    assert assert_trackers_verified(root) == {CKPT: None, SD: None}
    new.close()
    in_thread(old.close)


def test_a_new_job_under_the_same_run_never_commits_a_step_the_old_job_failed(make_monitor, tmp_path):
    """As above, but the new job reuses the run name: the old coordinator re-attaches to the new
    monitor by name. Its queued registration of the failed step and its late unit (admitted by job 1
    before the failure) must not commit step 5 in job 2."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=60.0)
    old.register(5, checkpoint_thread_count=2)
    gate = Gate(root, 5, "late.bin")
    old.save_async("late", gate, 5)
    assert gate.entered.wait(20)
    fail_checkpoint_unit(old, root, 5)
    with pytest.raises(ckptd.CheckpointSaveError):
        old.register(5, checkpoint_thread_count=1)  # job 1 was told: step 5 failed
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="the first monitor to be gone")
    old.register(5, checkpoint_thread_count=1, wait=False)  # queued, retried while no monitor exists
    monitor2 = make_monitor(root)  # a new job, same run name: a new attempt
    assert ray.get(monitor2.ping.remote())["attempt"] != old._attempt
    gate.open()
    errors = _drain(old)
    # The old coordinator refuses to re-attach to the new attempt, and says so (found by this attack:
    # it used to re-attach by name, and its registration and late unit committed step 5 in job 2).
    assert any(isinstance(e, ckptd.CheckpointError) and "attempt" in str(e) for e in errors), errors
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    result = in_thread(lambda: new.wait_committed(5, timeout_s=5), 30)
    committed = result[0] == "ok"
    assert_trackers_verified(root)
    assert not committed and read_manifest(root, 5, CKPT) is None, (result, _files(root, 5))
    assert ckptd.latest_step(root) is None
    new.close()
    old.close()


# -- 3. Trinity's counting, with failures -------------------------------------------------------------


def test_a_state_dict_unit_failing_fails_a_full_checkpoint_registered_in_the_background(make_monitor, tmp_path):
    """register(S, state_dict_thread_count=1, checkpoint_thread_count=1, wait=False), as a full
    checkpoint: the checkpoint unit finishes, the state-dict unit fails. Neither kind commits, not
    after a restart, and a background re-registration is answered with the failure."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(6, state_dict_thread_count=1, checkpoint_thread_count=1, wait=False)
    coord.save_async("optim", lambda: write_step_file(root, 6, "optim.bin"), 6)
    coord.save_async("model", disk_full, 6, is_state_dict=True)
    errors = _drain(coord)
    assert errors and all(isinstance(e, ckptd.CheckpointSaveError) for e in errors), errors
    restart_monitor(monitor, how="sigkill")
    coord.register(6, is_state_dict=True, state_dict_thread_count=1, wait=False)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    for kind in (CKPT, SD):
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(6, is_state_dict=kind is SD, timeout_s=10)
    assert read_manifest(root, 6, CKPT) is None and read_manifest(root, 6, SD) is None
    assert assert_trackers_verified(root) == {CKPT: None, SD: None}
    coord.close()


def test_a_failed_checkpoint_unit_leaves_the_background_registered_state_dict_to_commit(make_monitor, tmp_path):
    """Background registrations of both kinds of step 7; its checkpoint unit fails before they are
    applied (failures skip the barrier), its two state-dict units finish. The state dict commits
    (both units), the full checkpoint never does, and a restart and a retried registration change
    neither."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    release = hold_registrar(coord, monitor, root)
    coord.register(7, is_state_dict=True, state_dict_thread_count=1, wait=False)
    coord.register(7, is_state_dict=True, state_dict_thread_count=1, wait=False)  # adds up: two
    coord.register(7, checkpoint_thread_count=1, wait=False)
    coord.save_async("optim", disk_full, 7)
    coord.save_async("m0", lambda: write_step_file(root, 7, "m0.bin"), 7, is_state_dict=True)
    wait_for(lambda: _failed(monitor, 7), what="the checkpoint of step 7 to fail")
    assert registrar_held(monitor)
    release()
    errors = _drain(coord)
    assert any(isinstance(e, ckptd.CheckpointSaveError) and e.unit.endswith("optim") for e in errors), errors
    s = status(monitor).step(7, SD)
    assert (s.expected, len(s.finished), s.committed) == (2, 1, False)  # not committed short
    assert read_manifest(root, 7, SD) is None
    restart_monitor(monitor, how="sigkill")
    coord.save_async("m1", lambda: write_step_file(root, 7, "m1.bin"), 7, is_state_dict=True)
    coord.wait_all()
    coord.wait_committed(7, is_state_dict=True, timeout_s=30)
    assert _files(root, 7, SD) == ["m0.bin", "m1.bin"]
    assert len(read_manifest(root, 7, SD).registrations) == 2
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(7, timeout_s=10)
    restart_monitor(monitor, how="ray.kill")
    coord.register(7, checkpoint_thread_count=1, wait=False)
    _drain(coord)
    assert read_manifest(root, 7, CKPT) is None
    assert assert_trackers_verified(root) == {CKPT: HOLD_STEP, SD: 7}
    coord.close()


def test_a_full_checkpoint_registered_in_the_background_waits_for_its_state_dict_units_across_a_restart(
        make_monitor, tmp_path):
    """Step 8: three background registrations (state dict 1+1, full checkpoint with 1 checkpoint
    unit). The checkpoint unit and one state-dict unit finish: nothing commits. After a SIGKILL, a
    duplicate-free replay still expects two state-dict units; the second one commits both kinds, and
    the full manifest lists every file."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(8, is_state_dict=True, state_dict_thread_count=1, wait=False)
    coord.register(8, state_dict_thread_count=1, checkpoint_thread_count=1, wait=False)
    coord.save_async("optim", lambda: write_step_file(root, 8, "optim.bin"), 8)
    coord.save_async("m0", lambda: write_step_file(root, 8, "m0.bin"), 8, is_state_dict=True)
    coord.wait_all()
    sd, ck = status(monitor).step(8, SD), status(monitor).step(8, CKPT)
    assert (sd.expected, len(sd.finished), sd.committed, ck.committed) == (2, 1, False, False)
    ray.kill(monitor, no_restart=False)
    coord.register(8, is_state_dict=True, wait=False)  # adds nothing; retried across the restart
    coord.wait_all()
    wait_for(lambda: not actor_gone(monitor), what="the monitor to answer again")
    sd = status(monitor).step(8, SD)
    assert (sd.expected, len(sd.finished), sd.committed) == (2, 1, False)
    assert assert_trackers_verified(root) == {CKPT: None, SD: None}
    coord.save_async("m1", lambda: write_step_file(root, 8, "m1.bin"), 8, is_state_dict=True)
    coord.wait_committed(8, timeout_s=30)
    coord.wait_committed(8, is_state_dict=True, timeout_s=30)
    assert _files(root, 8) == ["m0.bin", "m1.bin", "optim.bin"]
    assert assert_trackers_verified(root) == {CKPT: 8, SD: 8}
    coord.close()
