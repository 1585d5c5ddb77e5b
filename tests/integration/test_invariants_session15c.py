"""Session 15c: the retention fence of failed leftovers (``_fence_failed_leftovers``,
commit_flow.py; ``RetentionRunner._loop``, retention.py) and the registration gate
(``_registering``, actor.py ``register``), attacked with a real local Ray, real files, real
coordinators and real monitor restarts (ray.kill and SIGKILL).

Attacked:

1. A fence whose failure record storage refuses (``before_failure_record`` raises, so the
   record retries for ever): the pass deletes the step at once, then the monitor is killed
   before the fenced failure is durable. Nobody may be told of the fenced failure before it is
   durable, and a restarted monitor must never commit a state dict of the deleted step (or, if it
   reports one committed, its manifest must be there).
2. A step whose full checkpoint failed without ever creating its directory, older than the newest
   commit; two retention passes back to back (two commits in a row): its state dict is fenced
   (reported failed, promptly, not stuck pending) and a later save of it is refused, also after a
   restart.
3. A registration of the fenced step's state dict racing the pass (sent right after the commit
   that schedules it): it is either refused, or the step is kept and commits; a step reported
   failed never commits; nothing stays in ``_registering``; the trackers verify.

Held: all three. 1: while the fenced record is refused, wait_committed(state_dict) of the step
answers nothing (not settled: the failure is not durable), although the pass already deleted the
directory; after ray.kill or SIGKILL the restarted monitor fences the step again (its checkpoint
failure is durable) and never commits or reports committed a state dict of it. 2: a failed
checkpoint with no directory is fenced across two back-to-back passes, answers "failed" at once,
and stays failed after a SIGKILL. 3: a registration racing the pass either keeps the step (it then
commits, survives the pass, verifies, and a restarted monitor agrees) or is refused; nothing is
left in ``_registering``.

Broke: nothing. Observed (not an invariant here): in 3 the committed state dict of step 4 lists
``optim.partial``, the half-written file of the failed checkpoint unit, as "(written outside save
units)"; verify accepts it.

Runtime: about 16 s on the 2-core VM (4 s of it starting Ray).
"""

from __future__ import annotations

import os

import pytest
import ray

import ckptd

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    fail_checkpoint_unit,
    read_manifest,
    restart_monitor,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def _in_monitor(monitor, fn):
    return ray.get(monitor.__ray_call__.remote(fn))


def _sd_state(monitor, step):
    def get(self):
        st = self._ledger.state_of(step, SD)
        return None if st is None else st.value
    return _in_monitor(monitor, get)


def _try_sd(coord, root, step, name="sd.bin"):
    """Save and register a one-unit state dict of ``step``; True if reported committed, else the error."""
    try:
        coord.save_sync(lambda: write_step_file(root, step, name), step, is_state_dict=True)
        coord.register(step, is_state_dict=True, state_dict_thread_count=1)
        coord.wait_committed(step, is_state_dict=True, timeout_s=30)
        return True
    except ckptd.CheckpointSaveError as e:
        return str(e)


@pytest.mark.parametrize("how", ["ray.kill", "sigkill"])
def test_a_fenced_failure_not_yet_durable_is_not_reported_and_survives_a_restart(make_monitor, tmp_path, how):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None, keep_every_n_steps=3)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    fail_checkpoint_unit(coord, root, 4)  # its failure record is durable
    assert os.path.isdir(ckptd.step_dir(root, 4))
    arm_in_monitor(monitor, "before_failure_record", "raise")  # the fence's record retries for ever
    try:
        coord.save_sync(lambda: write_step_file(root, 5, "sd.bin"), 5, is_state_dict=True)
        coord.register(5, is_state_dict=True, state_dict_thread_count=1)
        coord.wait_committed(5, is_state_dict=True, timeout_s=30)
        wait_for(lambda: _sd_state(monitor, 4) == "failed", what="the fence of step 4")
        assert ray.get(monitor.wait_retention.remote(30))
        assert not os.path.isdir(ckptd.step_dir(root, 4))  # deleted as a failed leftover
        # The fenced failure is not durable: nobody may be told yet.
        r = ray.get(monitor.wait_committed.remote(4, "state_dict", 1.0))
        assert r["cause"] is None and not r["committed"], r
        restart_monitor(monitor, how=how)
    finally:
        try:
            arm_in_monitor(monitor, "before_failure_record", None)
        except Exception:
            pass
    coord2 = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    out = _try_sd(coord2, root, 4)
    if out is True:
        assert read_manifest(root, 4, SD) is not None
        ckptd.verify(root, 4)
    assert ray.get(monitor.wait_retention.remote(30))
    if out is True:
        assert read_manifest(root, 4, SD) is not None, "reported committed, then deleted"
    assert assert_trackers_verified(root)[SD] == 5
    coord.close()
    coord2.close()


def test_a_failed_checkpoint_without_a_directory_is_fenced_across_two_passes(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None, keep_every_n_steps=3)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")

    def no_dir():
        raise OSError("disk full before anything was written")

    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(no_dir, 4)
    assert not os.path.exists(ckptd.step_dir(root, 4))
    for step in (5, 7):  # two commits, two passes back to back
        coord.save_sync(lambda s=step: write_step_file(root, s, "sd.bin"), step, is_state_dict=True)
        coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(5, is_state_dict=True, timeout_s=30)
    coord.wait_committed(7, is_state_dict=True, timeout_s=30)
    assert ray.get(monitor.wait_retention.remote(30))
    # Not stuck pending: the fenced state dict answers at once, failed.
    r = ray.get(monitor.wait_committed.remote(4, "state_dict", 10))
    assert not r["committed"] and r["cause"] is not None, r
    out = _try_sd(coord, root, 4)
    assert out is not True and read_manifest(root, 4, SD) is None, out
    restart_monitor(monitor, how="sigkill")
    coord2 = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    out = _try_sd(coord2, root, 4, "sd2.bin")
    assert out is not True and read_manifest(root, 4, SD) is None, out
    r = ray.get(monitor.wait_committed.remote(4, "state_dict", 10))
    assert not r["committed"] and (r["cause"] is not None), r
    assert assert_trackers_verified(root)[SD] == 7
    coord.close()
    coord2.close()


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_a_registration_racing_the_fence(make_monitor, tmp_path, delay):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None, keep_every_n_steps=3)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    fail_checkpoint_unit(coord, root, 4)
    arm_in_monitor(monitor, "before_step_delete", "delay:1")
    try:
        coord.save_sync(lambda: write_step_file(root, 5, "sd.bin"), 5, is_state_dict=True)
        coord.register(5, is_state_dict=True, state_dict_thread_count=1)  # its commit schedules the pass
        if delay:
            import time
            time.sleep(delay)
        ref = monitor.register.remote(4, {"state_dict": 1, "checkpoint": 0}, "state_dict", "s15c-race")
        answer = ray.get(ref, timeout=60)
        coord.wait_committed(5, is_state_dict=True, timeout_s=30)
        out = _try_sd(coord, root, 4)
        assert ray.get(monitor.wait_retention.remote(60))
    finally:
        arm_in_monitor(monitor, "before_step_delete", None)
    assert _in_monitor(monitor, lambda self: dict(self._registering)) == {}
    # The answer to a registration may be the checkpoint's failure (a kind it concerns) while the
    # state dict commits: judge the state dict by its own outcome.
    r = ray.get(monitor.wait_committed.remote(4, "state_dict", 10))
    assert r["cause"] is not None or r["committed"], r  # not stuck pending
    if r["committed"]:
        assert read_manifest(root, 4, SD) is not None, "reported committed, then deleted"
        ckptd.verify(root, 4)
    else:
        assert read_manifest(root, 4, SD) is None, (answer, out, r)
    restart_monitor(monitor, how="ray.kill")
    r2 = ray.get(monitor.wait_committed.remote(4, "state_dict", 10))
    assert r2["committed"] == r["committed"], (r, r2)
    assert_trackers_verified(root)
    coord.close()
