"""Session 23d: 62da4ea (bounded calls, coordinator side) and f896c43 + 5ec9435 (the state-dict
checks, monitor side), attacked.

Targets: ``MonitorClient.call`` / ``_get_while_alive`` (an unbounded wait lasts while the monitor
answers a ping within ``notify_timeout_s``), ``call(until=)`` with ``Registrar._run`` (queued
background registrations share one more timeout), the relay's unbounded upstream;
``CommitFlow._record_failure`` (a full checkpoint's failure is durable for ``wait_committed``
only after ``withdraw_if_changed``), ``_held_failures`` / ``_resume_step``, the ``checks``
counter of ``_changed_state_dict`` (retention keeps, uncounted), its retried storage errors, and
``manifest.changed_files`` (a listed path that is no longer a regular file is changed).

Real local Ray, real monitors (the module's shared one, each test in its own block of steps, or a
test's own where retention by count or a restart is needed), real coordinators, real files;
faults through the named failpoints (``before_revoke`` in the monitor, ``after_publish`` through
the monitor's runtime environment, fired once with a marker the test removes), SIGKILL, the
monitor probed through ``__ray_call__``; nothing mocked.

What held (by reading, and by the runs of sessions 23b/23c and these cases):

* ``_record_failure`` adds to ``_failures_durable`` and then wakes: a waiter registered before
  the failure is woken after the check, one that comes during it waits (``_settled`` is False).
  A restart's held failures are released (durable, then woken) in ``_resume_step`` for every
  step ``_resume`` checked, also when a check raised (caught in ``check``).
* ``checks`` is incremented before the first await and decremented in a ``finally``: a check that
  raises or is cancelled leaves no count behind.
* ``changed_files``: a listed path that became a directory, a symlink loop or a named pipe counts
  as changed. A pipe used to block ``open()`` for ever (no writer): the check, and with it the
  failure's report and (at start-up) retention, hung; found here and fixed meanwhile by 5ec9435
  (``os.stat`` first), so no case is kept. A symlink to a device is caught the same way.
* Registrar: the shared bound covers only the registrations queued when the first one went
  unanswered (``_submitted`` read then); later ones get their own timeout. Those past the shared
  bound are still sent (and applied when the monitor resumes), and only the first error is raised.
* Relay: ``call_async(bounded=False)`` only lifts the bound on a live monitor's answer; each
  coordinator still bounds its own wait for the relay and then goes straight (session 23b).
* Cost, no case (nothing promised): while storage refuses reads, ``_changed_state_dict`` retries
  for ever, so a full checkpoint's failure is not reported (``wait_committed`` waits or times out),
  retention stays held at start-up, and a unit's "failed" whose check runs inline in
  ``notify_batch`` (``_failed``) holds that call, and the events batched behind it, until storage
  answers: coordinators with a short ``notify_timeout_s`` then report those units failed (the
  contract allows it). Acceptable: nothing can be committed or recorded meanwhile either, and
  "not yet known" is the honest answer; a bound would have to report a failure whose state dict
  may be stale.
* By reading, minor: an unbounded call (or one whose own wait outlasted the timeout) that meets a
  ``RayActorError`` after ``notify_timeout_s`` raises it at once, without ``_reattach``; a monitor
  re-created by a new job therefore surfaces as ``ActorDiedError``, not the ``CheckpointError``
  naming both attempts that the contract describes (still bounded, and still never counted).

What broke, fixed since (each case below fails without its fix):

1. I5 (``test_i5_a_registration_and_a_save_into_the_failed_step_are_told_...``):
   ``durable()`` waits only for ``_failure_writes``, which ``_record_failure`` sets and pops
   before it awaits ``withdraw_if_changed``; register's ``_failure_for`` and ``_admit`` answer
   from it. While the withdrawal of step S+2's changed state dict runs (held in
   ``before_revoke``), ``register(S+2)`` raises ``CheckpointSaveError`` and a save into S+2 is
   refused "already failed", while the state-dict tracker still names S+2, whose manifest lists
   bytes storage no longer holds. The same holds for a restart's ``_held_failures`` (never in
   ``_failure_writes``). Candidate fix: set and pop ``written`` after the check, next to
   ``_failures_durable.add`` (and have ``durable()`` also wait for a held failure). Since session
   46 the test (renamed ``..._are_told_once_its_readers_pass_it_over``) asks less: a registration,
   like a unit since session 45, is answered once the state dict's failure is recorded (ckptd's
   readers then pass S+2 over), not once the tracker file moved back (``wait_committed`` waits for
   that), so that a withdrawal storage refuses for long does not hold a worker's registrations.
2. I2 (``test_i2_a_state_dict_whose_rewritten_file_is_being_read_back_is_not_counted_by_retention``):
   ``UnitReports._finished`` reads a committed state dict's file back itself
   (``committer.differs``), outside ``_changed_state_dict``: neither ``checks`` nor
   ``withdrawing`` marks the state dict until ``_revoke_state_dict`` starts. A checkpoint unit
   rewrites step 3's weights.bin as a 1 GiB shard; while the monitor reads it back, step 4's
   state dict commits and retention (window 2) counts 4 and the stale 3, deleting the valid 2.
   Candidate fix: count ``rec[SD].checks`` around that read (or call ``_changed_state_dict``).
3. I4 (``test_i4_an_unbounded_wait_rides_out_a_monitor_restart_as_a_bounded_one_does``):
   ``_get_while_alive`` takes a ping unanswered within the timeout for a stopped monitor, but Ray
   queues the ping while it restarts the monitor: with ``notify_timeout_s=1`` and a 3 s restart,
   ``wait_committed(2, timeout_s=None)`` raises ``CheckpointTimeoutError`` after 2 s, while
   ``wait_committed(2, timeout_s=60)`` of the same coordinator waits through the restart and
   sees step 2 commit ("coordinators retry their calls across the restart"). Candidate fix: on a
   ping timeout, ask the GCS for the actor's state (``ray._private.state.actors(id)["State"]``;
   the state API needs the dashboard) and go on waiting while it is ``RESTARTING`` or
   ``PENDING_CREATION``; a SIGSTOPed monitor stays ``ALIVE`` and still fails in about two
   timeouts.

Fixes: (1) ``_record_failure`` sets its ``_failure_writes`` event (what ``durable()`` waits for)
only after the check, and a starting monitor gives its held failures such an event, set in
``_resume_step``; (2) ``_finished`` reads the reported files back through
``_changed_state_dict(rec, entries)``, which counts ``checks``; (3) ``_get_while_alive`` goes on
waiting while Ray says the monitor is being restarted (``_restarting``, the GCS's actor state),
and an unbounded wait that outlived its monitor gets the timeout for its retries from then on.

Found later (session 32, a CI run on a loaded machine): a monitor killed on this node stays ALIVE
in the GCS until the raylet reports the death, more than a second under load, so (3) still cut
the unbounded wait short. ``_restarting`` now also counts a monitor whose process on this node is
gone (or a zombie), and a stall needs the pings of two windows in a row unanswered (a death on
another node gets one more window); the raylet case holds the raylet to make that window certain.
A helper's attack then found the GCS query itself unbounded: with the GCS stopped too, a stopped
monitor held the wait for as long as the GCS (12 s at a 0.5 s timeout); it now gets the timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import ray

import ckptd
from ckptd.layout import TRACKERS

from .helpers import (
    WindowMissed,
    arm_in_monitor,
    busy_coroutines,
    commit_one,
    fail_full_checkpoint,
    failpoint_env,
    read_manifest,
    replace_same_size,
    revoke_loops,
    stale_files,
    tracker_of,
    wait_all,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0  # far beyond what any wait here needs: reaching it means a hang
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}  # no test's steps go while another runs


# -- 1. I5: a registration and a save into the failed step are told before the check --------------


def test_i5_a_registration_and_a_save_into_the_failed_step_are_told_once_its_readers_pass_it_over(env):
    """Step S+2's state dict is committed and its weights.bin replaced outside units; its full
    checkpoint fails (a checkpoint unit fails), and the withdrawal that ``_record_failure``'s check
    starts is held in ``before_revoke``. Meanwhile the trainer registers the step again (a
    retried ``save_checkpoint``) and a worker saves into it: both are told that it failed, once
    the state dict's failure is recorded, so ckptd's readers no longer name S+2 (the tracker file
    moves back once storage takes the withdrawal, which ``wait_committed`` waits for; since session
    46 a registration, like a unit since session 45, does not wait for that: storage may refuse
    the removal for long)."""
    s, root, monitor = env.s, env.root, env.monitor
    coord = env.coord()
    commit_one(coord, s + 1, "model.bin", is_state_dict=False)
    commit_one(coord, s + 2, "weights.bin", is_state_dict=True)
    replace_same_size(f"{env.step_dir(s + 2)}/weights.bin")  # another rank's plain torch.save
    heard: dict = {}
    arm_in_monitor(monitor, "before_revoke", "delay:3")
    try:
        fail_full_checkpoint(coord, s + 2)
        wait_for(lambda: revoke_loops(monitor, s + 2), timeout_s=DEADLINE_S, what="the withdrawal of S+2")
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.register(s + 2, checkpoint_thread_count=1)
        heard["register"] = ckptd.latest_step(root, "state_dict")
        with pytest.raises(ckptd.CheckpointSaveError, match="already failed"):
            coord.save_sync(lambda: write_file(f"{env.step_dir(s + 2)}/late.bin", b"x"), s + 2)
        heard["save"] = ckptd.latest_step(root, "state_dict")
        with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
            coord.wait_committed(s + 2, is_state_dict=True, timeout_s=DEADLINE_S)
        heard["wait_committed"] = tracker_of(root, SD)  # the file: S+1, a full checkpoint, nothing stale
    finally:
        arm_in_monitor(monitor, "before_revoke", None)
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the monitor to settle step S+2")
    wait_all(coord)
    coord.close()
    assert read_manifest(root, s + 2, SD) is None and tracker_of(root, SD) == s + 1  # withdrawn in the end
    assert heard == {"register": s + 1, "save": s + 1, "wait_committed": s + 1}, heard


# -- 2. I2: a unit's report of a rewritten committed file: storage is read back, uncounted ---------


def _finishing(monitor, step: int) -> bool:
    """Whether the monitor is handling a "finished" report of a unit of ``step`` (``_finished``)."""
    def probe(self, step=step):
        import gc
        import inspect as _inspect
        return any(_inspect.iscoroutine(o) and o.cr_frame is not None and o.cr_code.co_name == "_finished"
                   and getattr(o.cr_frame.f_locals.get("uid"), "step", None) == step for o in gc.get_objects())
    return ray.get(monitor.__ray_call__.remote(probe))


BIG = 1 << 30  # a shard of a real state dict; sparse, so the test writes nothing (reading it takes ~2 s)


def test_i2_a_state_dict_whose_rewritten_file_is_being_read_back_is_not_counted_by_retention(
        make_monitor, tmp_path):
    """Default window of 2 state dicts. Steps 1 and 2 are state dicts; step 3's state dict commits
    (retention deletes step 1, rightly), and then a checkpoint unit of step 3 rewrites its
    weights.bin as a 1 GiB shard (the full checkpoint's model under the state dict's name) and
    reports it: the monitor reads weights.bin back to learn whether the bytes the manifest lists
    are gone. Meanwhile another worker's state dict of step 4 commits, and retention runs."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    other = ckptd.CheckpointCoordinator(monitor, worker_id="w1", notify_timeout_s=599)  # its own notifier
    for step in (1, 2):
        commit_one(coord, step, "weights.bin", is_state_dict=True)
    coord.register(3, checkpoint_thread_count=1)
    commit_one(coord, 3, "weights.bin", is_state_dict=True)
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S)) and read_manifest(root, 1, SD) is None
    weights = f"{ckptd.step_dir(root, 3)}/weights.bin"

    def rewrite():
        with open(weights, "r+b") as f:
            f.truncate(BIG)
        return [ckptd.WrittenFile(weights, BIG, "00000000")]

    coord.save_async("model", rewrite, 3)
    wait_for(lambda: _finishing(monitor, 3), timeout_s=DEADLINE_S, what="the monitor to read weights.bin back")
    commit_one(other, 4, "weights.bin", is_state_dict=True)
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    if not _finishing(monitor, 3):
        raise WindowMissed("weights.bin was read back before retention's pass: make BIG larger")
    assert wait_all(coord) is not None  # the unit changed a committed file
    wait_for(lambda: not busy_coroutines(monitor), timeout_s=DEADLINE_S, what="the withdrawal of step 3")
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    coord.close()
    other.close()
    with contextlib.suppress(FileNotFoundError):
        os.remove(weights)  # the sparse shard: page cache
    assert read_manifest(root, 3, SD) is None and tracker_of(root, SD) == 4  # withdrawn in the end
    # I2: steps 4 and 2 are the newest 2 valid state dicts: step 2 must still be there.
    assert stale_files(root, 2, SD) == [], "retention deleted step 2, counting step 3 (being read back) in its place"


# -- 3. I4: an unbounded wait across a monitor restart ---------------------------------------------


def _waits_in_monitor(monitor) -> int:
    """The ``wait_committed`` calls the monitor is serving."""
    def probe(self):
        import gc
        import inspect as _inspect
        return sum(1 for o in gc.get_objects() if _inspect.iscoroutine(o) and o.cr_frame is not None
                   and o.cr_code.co_name == "wait_committed")
    return ray.get(monitor.__ray_call__.remote(probe))


def test_i4_an_unbounded_wait_rides_out_a_monitor_restart_as_a_bounded_one_does(make_monitor, tmp_path):
    """A 1 s coordinator waits for step 2 twice, with timeout_s=None and with 60. The monitor is
    SIGKILLed; Ray restarts it, and its start-up takes 3 s (a tracker to repair, published in
    ``after_publish``'s delay: a large root's rebuild, or a slow node, takes that long). Step 2
    then commits."""
    root, once = str(tmp_path / "ckpt"), tmp_path / "once"
    os.makedirs(once)
    marker = once / "after_publish"
    marker.touch()  # fired already, as far as the failpoint knows: until the marker goes
    monitor = make_monitor(root, runtime_env=failpoint_env("after_publish=delay:3", once))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=1)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.register(2, checkpoint_thread_count=1)
    outcomes: dict = {}

    def wait(timeout_s):
        t0 = time.monotonic()
        try:
            coord.wait_committed(2, timeout_s=timeout_s)
            outcomes[timeout_s] = "committed"
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcomes[timeout_s] = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"

    waiters = [threading.Thread(target=wait, args=(t,), daemon=True) for t in (None, DEADLINE_S)]
    for t in waiters:
        t.start()
    wait_for(lambda: _waits_in_monitor(monitor) == 2, timeout_s=DEADLINE_S, what="both waits to reach the monitor")
    pid = ray.get(monitor.ping.remote())["pid"]
    for kind in (CKPT, SD):
        os.remove(os.path.join(root, TRACKERS[kind]))  # the restarted monitor repairs them
    marker.unlink()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: ray.get(monitor.ping.remote())["pid"] != pid, timeout_s=DEADLINE_S, what="the restart")
    later = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    later.save_sync(lambda: write_file(f"{ckptd.step_dir(root, 2)}/model.bin", os.urandom(64)), 2)
    for t in waiters:
        t.join(DEADLINE_S)
    coord.close()
    later.close()
    assert outcomes[DEADLINE_S] == "committed", outcomes
    assert outcomes[None] == "committed", (
        f"wait_committed(timeout_s=None) was cut short by the monitor's restart: {outcomes[None]}")


def _ray_pid(kind: str) -> int:
    """This node's raylet (which tells the GCS that a worker process died) or GCS server."""
    from ray._private import ray_constants, worker

    return worker._global_node.all_processes[getattr(ray_constants, f"PROCESS_TYPE_{kind}")][0].process.pid


def _waiting_for_step_2(monitor, timeout_s: float) -> tuple[ckptd.CheckpointCoordinator, threading.Thread, list]:
    """A coordinator with ``notify_timeout_s=timeout_s`` that committed step 1, registered step 2
    and waits for it with ``timeout_s=None`` in a thread, that wait already in the monitor; and
    the outcome, filled in when the wait ends ("committed", or what it raised)."""
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=timeout_s)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.register(2, checkpoint_thread_count=1)
    outcome: list = []

    def wait():
        try:
            coord.wait_committed(2, timeout_s=None)
            outcome.append("committed")
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    wait_for(lambda: _waits_in_monitor(monitor) == 1, timeout_s=DEADLINE_S, what="the wait to reach the monitor")
    return coord, waiter, outcome


def test_i4_an_unbounded_wait_rides_out_a_monitor_death_that_the_gcs_has_not_heard_of(make_monitor, tmp_path):
    """The monitor is SIGKILLed while the raylet that would report its death is held (SIGSTOP,
    as a loaded node delays it): for 3 timeouts the GCS still says the dead monitor is ALIVE and
    pings go unanswered, which also describes a stopped monitor. The dead process settles it:
    the unbounded wait goes on, Ray restarts the monitor once the raylet resumes, step 2 commits."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    timeout_s = 1.0
    coord, waiter, outcome = _waiting_for_step_2(monitor, timeout_s)
    pid, raylet = ray.get(monitor.ping.remote())["pid"], _ray_pid("RAYLET")
    os.kill(raylet, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        waiter.join(3 * timeout_s)  # time must pass: three windows of unanswered pings
        assert not outcome, f"the wait ended while the monitor's death was not yet known: {outcome}"
    finally:
        os.kill(raylet, signal.SIGCONT)
    wait_for(lambda: ray.get(monitor.ping.remote())["pid"] != pid, timeout_s=DEADLINE_S, what="the restart")
    later = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    later.save_sync(lambda: write_file(f"{ckptd.step_dir(root, 2)}/model.bin", os.urandom(64)), 2)
    waiter.join(DEADLINE_S)
    coord.close()
    later.close()
    assert outcome == ["committed"], f"wait_committed(timeout_s=None) was cut short by the monitor's death: {outcome}"


def test_i4_a_stopped_monitor_ends_an_unbounded_wait_in_time_while_the_gcs_does_not_answer(make_monitor, tmp_path):
    """The monitor is stopped (SIGSTOP) and the GCS held with it: the question whether Ray is
    restarting the monitor goes unanswered, and must not hold the wait past its bound."""
    monitor = make_monitor(str(tmp_path / "ckpt"))
    timeout_s, held_s = 0.5, 10.0
    coord, waiter, outcome = _waiting_for_step_2(monitor, timeout_s)
    pid, gcs = ray.get(monitor.ping.remote())["pid"], _ray_pid("GCS_SERVER")
    os.kill(gcs, signal.SIGSTOP)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        waiter.join(held_s)
        took = time.monotonic() - t0
    finally:
        os.kill(gcs, signal.SIGCONT)
        os.kill(pid, signal.SIGCONT)
    coord.close()
    assert outcome, f"the wait was still waiting {took:.1f} s into the stop ({timeout_s:g} s timeout)"
    assert isinstance(outcome[0], ckptd.CheckpointTimeoutError), outcome
    assert took < 4 * timeout_s + 2, f"the wait took {took:.1f} s to give up on a stopped monitor"
