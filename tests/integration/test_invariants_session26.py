"""Session 26: attacks on retention's claim before each deletion (fe1db11, 30549c9).

Three breaks, each fixed and each test failing while its break stands: a running unit of a
committed state dict's step did not make the step in flight (``StepLedger.in_flight_steps``
now counts running units); a claim the event loop answered after the pass's thread gave up
stayed claimed forever (``DeletionClaims`` tickets); a withdrawal that began after the pass's
snapshot made it delete a state dict its policy keeps (``RetentionRunner._may_delete`` refuses
and runs another pass). The fourth test held.

Real local Ray, real monitors (failpoints armed, and probes run, in the monitor's process only
through ``__ray_call__``), real coordinators and files under ``tmp_path``; nothing mocked.
"""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    held_at,
    in_thread,
    status,
    step_dirs,
    two_state_dicts,
    wait_all,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_running_state_dict_unit_of_a_committed_state_dict_keeps_its_step(make_monitor, tmp_path):
    """State dicts 1 and 2 are committed (2 kept). A state-dict unit of step 1 then starts (the
    first unit of step 1's full checkpoint, whose registration has not arrived yet: save_async
    before register, as a trainer may do). It is admitted (it counts toward the full checkpoint
    only) and writes into step 1's directory. Committing state dict 3 runs a pass: step 1 has a
    unit admitted and not settled, so it is in flight and must be kept (invariant 1). The
    ledger's in_flight_steps does not count it (its state dict is settled, its checkpoint kind
    has no registration or unit yet), so the pass's snapshot and its claim both let it go: the
    directory the unit is writing into goes to the trash."""
    root = str(tmp_path / "ckpt")
    monitor, coord = two_state_dicts(make_monitor, root)
    d = coord.step_dir(1)
    admitted, may_finish = threading.Event(), threading.Event()

    def late_unit() -> list[str]:
        admitted.set()  # save_fn runs only once the monitor admitted the unit
        paths = write_file(f"{d}/extra_weights.bin", os.urandom(512))
        assert may_finish.wait(60)
        return paths

    coord.save_async("extra-weights", late_unit, 1, is_state_dict=True)
    try:
        assert admitted.wait(30), "the late state-dict unit of step 1 was not admitted"
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
        assert ray.get(monitor.wait_retention.remote(60))
        deleted = status(monitor).retention.deleted_steps
        kept = step_dirs(root)
    finally:
        may_finish.set()
    in_thread(lambda: wait_all(coord), timeout_s=30)
    assert 1 not in deleted and 1 in kept, (
        f"retention deleted step 1 while a unit of it, admitted and still running, wrote into it "
        f"(deleted {deleted}, on disk {sorted(kept)})")
    coord.close()



def _set_loop_call_timeout(monitor, seconds: float) -> None:
    def set_it(_self, seconds=seconds):
        from ckptd.monitor import claims
        claims.LOOP_CALL_TIMEOUT_S = seconds
    ray.get(monitor.__ray_call__.remote(set_it))


def _hold_loop_through_a_claim_timeout(gate: str):
    """Blocks the monitor's event loop (a callback put on it from a ``__ray_call__``, which runs
    in another thread): the callback lets the held pass go on (``gate``), then keeps the loop
    busy until the pass's thread has waited in ``DeletionClaims.claim`` and given up (its
    timeout ran out). Returns what it saw."""
    def hold(self, gate=gate):
        import sys
        import threading
        import time

        def in_on_loop() -> bool:
            for frame in sys._current_frames().values():
                while frame is not None:
                    if frame.f_code.co_name == "claim" and "ticket" in frame.f_locals:
                        return True
                    frame = frame.f_back
            return False

        box: dict = {}
        done = threading.Event()

        def blocker() -> None:  # on the event loop: nothing else runs there meanwhile
            try:
                open(gate, "w").close()
                deadline = time.monotonic() + 15
                entered = left = False
                while time.monotonic() < deadline:  # watching the pass's thread, loop held
                    if in_on_loop():
                        entered = True
                    elif entered:
                        left = True
                        break
                    time.sleep(0.005)
                box.update(entered=entered, left=left)
            finally:
                done.set()

        self._retention.claims._loop.call_soon_threadsafe(blocker)
        done.wait(30)
        return box
    return hold


def test_a_claim_that_times_out_on_a_busy_loop_is_not_left_behind(make_monitor, tmp_path):
    """A pass asks the event loop to claim each step (``DeletionClaims.claim``: run_coroutine_threadsafe,
    then ``.result(LOOP_CALL_TIMEOUT_S)``). When the loop is busy past that timeout (60 s in
    production; 0.5 s here, set in the monitor's process, with the loop held by a probe until
    the pass's thread gave up), the pass fails and is retried later. But the claim coroutine is
    still queued on the loop: once the loop is free it runs, finds the step deletable and puts
    it in ``RetentionRunner.deleting``, and nothing ever releases it. Every later admission or
    registration of that step then waits in ``quiesce`` forever (invariant 4)."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor, coord = two_state_dicts(make_monitor, root)
    assert ray.get(monitor.wait_retention.remote(30))  # the held pass is step 3's, and no other pass follows it
    _set_loop_call_timeout(monitor, 0.5)
    arm_in_monitor(monitor, "before_retention_scan", f"until:60:{gate}")
    try:
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "before_retention_scan"), what="the pass to reach its scan")
        seen = ray.get(monitor.__ray_call__.remote(_hold_loop_through_a_claim_timeout(gate)))
    finally:
        open(gate, "w").close()
    assert seen == {"entered": True, "left": True}, seen
    _set_loop_call_timeout(monitor, 60.0)
    assert ray.get(monitor.wait_retention.remote(60))
    leaked = ray.get(monitor.__ray_call__.remote(lambda self: sorted(self._retention.claims.deleting)))
    d = coord.step_dir(1)
    registered = threading.Event()

    def register() -> None:
        coord.register(1, checkpoint_thread_count=1)
        registered.set()

    outcome = in_thread(register, timeout_s=10)
    if outcome[0] == "hung":  # let it go before failing, so that nothing is left waiting on a dead actor
        def let_go(self):
            for step in list(self._retention.claims.deleting):
                self._retention.claims.release(step)
        ray.get(monitor.__ray_call__.remote(let_go))
        registered.wait(30)
        in_thread(lambda: wait_all(coord), timeout_s=20)
        coord.close()
    assert outcome[0] != "hung" and not leaked, (
        f"no pass runs, yet steps {leaked} stay claimed for deletion; a registration of step 1 "
        f"then waits forever: {outcome}")
    coord.save_async("optim", lambda: write_file(f"{d}/optim.bin", os.urandom(512)), 1)
    assert in_thread(lambda: wait_all(coord), timeout_s=10)[0] == "ok"
    assert_trackers_verified(root)
    coord.close()


def test_a_withdrawal_that_begins_after_the_snapshot_does_not_cost_an_older_state_dict(make_monitor, tmp_path):
    """State dicts 1 and 2 are committed (2 kept). Step 3 saves a full checkpoint: its state dict
    commits while its checkpoint unit is held; that commit runs a pass, held before its scan (it
    read ``withdrawing_steps()`` already: empty). The checkpoint unit then replaces weights.bin
    and fails: the monitor withdraws state dict 3, held before its manifest goes. The pass scans
    (manifest 3 still there), counts 3 among the 2 newest state dicts and plans to delete 1; the
    claim re-checks step 1 alone and lets it go. State dict 3 is then withdrawn: the only
    committed state dict left is 2, though the policy keeps 2 of them and 1 was committed
    (invariant 3; plan_retention's ``withdrawing`` exists exactly to keep it)."""
    root = str(tmp_path / "ckpt")
    scan_gate, revoke_gate = str(tmp_path / "scan_gate"), str(tmp_path / "revoke_gate")
    monitor, coord = two_state_dicts(make_monitor, root)
    d = coord.step_dir(3)
    coord.register(3, is_state_dict=True, state_dict_thread_count=1)
    coord.register(3, checkpoint_thread_count=1)
    admitted, go = threading.Event(), threading.Event()

    def replace_then_fail():
        admitted.set()
        assert go.wait(60)
        path = f"{d}/weights.bin"
        write_file(path, os.urandom(os.path.getsize(path)))
        raise OSError("disk full after replacing weights.bin")

    coord.save_async("optim", replace_then_fail, 3)
    assert admitted.wait(30)
    arm_in_monitor(monitor, "before_retention_scan", f"until:60:{scan_gate}")
    arm_in_monitor(monitor, "before_revoke", f"until:60:{revoke_gate}")
    try:
        coord.save_async("weights", lambda: write_file(f"{d}/weights.bin", os.urandom(4096)), 3, is_state_dict=True)
        coord.wait_committed(3, is_state_dict=True, timeout_s=30)
        wait_for(lambda: held_at(monitor, "before_retention_scan"), what="the pass to reach its scan")
        go.set()
        wait_for(lambda: held_at(monitor, "before_revoke"), what="state dict 3's withdrawal")
        open(scan_gate, "w").close()
        assert ray.get(monitor.wait_retention.remote(30))
    finally:
        open(scan_gate, "w").close()
        open(revoke_gate, "w").close()
    # Answered once the withdrawal has ended (the tracker file moved back); ckptd's readers pass
    # over state dict 3 as soon as its failure is recorded, before that.
    answer = ray.get(monitor.wait_committed.remote(3, "state_dict", 60))
    assert not answer["committed"] and "withdrawn" in answer["cause"], answer
    assert ckptd.latest_step(root, "state_dict") == 2
    in_thread(lambda: wait_all(coord), timeout_s=30)
    assert ray.get(monitor.wait_retention.remote(30))
    committed_sd = sorted(s for s in step_dirs(root)
                          if os.path.exists(os.path.join(ckptd.step_dir(root, s), MANIFESTS[Kind.STATE_DICT])))
    deleted = status(monitor).retention.deleted_steps
    assert 1 not in deleted, (f"retention deleted state dict 1 although state dict 3 was being withdrawn: "
                              f"committed state dicts left {committed_sd}, deleted {deleted}")
    assert_trackers_verified(root)
    coord.close()


def test_held_a_registration_waiting_for_a_deletion_that_fails_goes_on(make_monitor, tmp_path):
    """(Holds.) The pass claims step 1 and is held before its rename; a full checkpoint of step 1
    registers (it waits: the step is claimed) and its unit starts (waits too). The rename then
    fails (the trash's path is taken by a file): the claim is released, the registration and the
    unit go on, and the full checkpoint commits into the directory that stayed."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor, coord = two_state_dicts(make_monitor, root)
    arm_in_monitor(monitor, "before_step_delete", f"until:60:{gate}")
    try:
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "before_step_delete"), what="the pass to reach step 1's deletion")
        open(os.path.join(root, ".ckptd", "trash"), "w").close()  # after the pass emptied it: the rename fails
        d = coord.step_dir(1)
        coord.register(1, checkpoint_thread_count=1, wait=False)
        coord.save_async("optim", lambda: write_file(f"{d}/optim.bin", os.urandom(512)), 1)
        early = in_thread(lambda: coord.wait_committed(1, is_state_dict=False, timeout_s=2), timeout_s=10)
    finally:
        arm_in_monitor(monitor, "before_step_delete", None)
        open(gate, "w").close()
    assert early[0] != "ok", early
    assert ray.get(monitor.wait_retention.remote(30))
    # The deletion failed (a later pass, after step 1's full checkpoint commits, may have run
    # since: its errors replace the held pass's, and its trash clean-up removes the file).
    assert 1 not in status(monitor).retention.deleted_steps and os.path.exists(os.path.join(d, "weights.bin"))
    trash = os.path.join(root, ".ckptd", "trash")
    if os.path.isfile(trash):
        os.remove(trash)
    assert in_thread(lambda: coord.wait_committed(1, is_state_dict=False, timeout_s=15), timeout_s=20) == ("ok", None)
    assert in_thread(lambda: coord.wait_all(), timeout_s=10)[0] == "ok"
    assert ray.get(monitor.__ray_call__.remote(lambda self: dict(self._retention.claims.deleting))) == {}
    ckptd.verify(root, 1, kind="checkpoint")
    assert_trackers_verified(root)
    coord.close()
