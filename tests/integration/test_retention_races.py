"""Retention racing saves that start after its pass read what is in flight.

A pass reads the steps in flight on the monitor's event loop, then scans the root and deletes in
a thread. A save of an older step (steps saved out of order, a full checkpoint added to a state
dict already committed) can start, and commit its state dict, in between. CI caught it once
(session 26): ``test_fifty_steps_in_random_order_with_a_restart_keep_exactly_the_configured_set``
lost full checkpoint 40, whose state dict committed between a pass's snapshot and its scan: the
pass deleted it as an old state dict while its checkpoint unit still ran.

Real local Ray, real monitors (failpoints armed in the monitor's process only), real
coordinators and files under ``tmp_path``; nothing mocked.
"""

from __future__ import annotations

import contextlib
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
    checkpoint_step1_while_deleted,
    commit_one,
    held_at,
    in_thread,
    ledger_states,
    save_one,
    status,
    step_dirs,
    two_state_dicts,
    unit_receipt,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_full_checkpoint_whose_state_dict_commits_after_the_snapshot_is_not_deleted(make_monitor, tmp_path):
    """State dicts 10 and 20 are committed (2 kept). Committing 30 starts a pass that reads what
    is in flight (nothing of step 5 yet) and is held before its scan. Step 5 then saves a full
    checkpoint: its state dict commits, its checkpoint unit still runs. The pass scans, finds
    step 5 committed as a state dict older than the 2 newest, and must keep it all the same:
    step 5 is in flight. Its full checkpoint then commits and stays (the only one)."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root, max_state_dict_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    commit_one(coord, 10, "weights.bin", is_state_dict=True)
    commit_one(coord, 20, "weights.bin", is_state_dict=True)
    arm_in_monitor(monitor, "before_retention_scan", f"until:60:{gate}")
    try:
        commit_one(coord, 30, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "before_retention_scan"), what="the pass to reach its scan")
        optim_may_write = threading.Event()
        d = coord.step_dir(5)

        def optim() -> list[str]:
            assert optim_may_write.wait(60)
            return write_file(f"{d}/optim.bin", os.urandom(512))

        coord.save_async("weights", lambda: write_file(f"{d}/weights.bin", os.urandom(512)), 5, is_state_dict=True)
        coord.save_async("optim", optim, 5)
        coord.register(5, state_dict_thread_count=1, checkpoint_thread_count=1)
        coord.wait_committed(5, is_state_dict=True, timeout_s=60)
    finally:
        open(gate, "w").close()
    assert ray.get(monitor.wait_retention.remote(60))
    kept = step_dirs(root)
    optim_may_write.set()
    coord.wait_all()
    outcome = in_thread(lambda: coord.wait_committed(5, is_state_dict=False, timeout_s=60), timeout_s=70)
    assert 5 in kept, (f"the pass deleted step 5 while its full checkpoint was being saved (kept {sorted(kept)}); "
                       f"its wait_committed then gave {outcome}")
    assert outcome == ("ok", None), outcome
    assert ray.get(monitor.wait_retention.remote(60))
    assert step_dirs(root) == {5, 20, 30}  # 10 goes: not among the 2 newest; 5 is the only full checkpoint
    ckptd.verify(root, 5, kind="checkpoint")
    assert ckptd.latest_step(root) == 5
    assert_trackers_verified(root)
    coord.close()


def test_a_unit_of_a_step_being_deleted_waits_for_the_deletion(make_monitor, tmp_path):
    """State dicts 1, 2 and 3 are committed (2 kept); the pass that deletes step 1 is held right
    before the rename. A full checkpoint of step 1 is then saved (a late save into an old step).
    Its unit must not be admitted while the directory it writes into is being deleted: it waits
    for the deletion; then its full checkpoint fails (the state dict it counts is gone). Before
    the fix it was admitted at once, wrote optim.bin and committed the checkpoint into the
    directory the pass then moved into the trash: the checkpoint tracker named a step that was
    gone."""
    root = str(tmp_path / "ckpt")
    monitor, coord, early = checkpoint_step1_while_deleted(
        make_monitor, root, str(tmp_path / "gate"), "before_step_delete",
        lambda coord: in_thread(lambda: coord.wait_committed(1, is_state_dict=False, timeout_s=3), timeout_s=10))
    assert early[0] != "ok", f"step 1's full checkpoint committed while its directory was being deleted: {early}"
    assert ray.get(monitor.wait_retention.remote(60))
    assert 1 in status(monitor).retention.deleted_steps
    # After the deletion the unit writes into a fresh directory; the full checkpoint counts the
    # state dict committed at step 1, whose weights.bin is gone: its commit check says so.
    coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError, match=r"weights\.bin, reported by .* is missing from storage"):
        coord.wait_committed(1, is_state_dict=False, timeout_s=60)
    assert ray.get(monitor.wait_retention.remote(60))
    assert not os.path.exists(os.path.join(ckptd.step_dir(root, 1), MANIFESTS[Kind.CHECKPOINT]))
    assert_trackers_verified(root)
    assert ckptd.latest_step(root, "state_dict") == 3 and ckptd.latest_step(root) is None
    coord.close()


def test_a_unit_that_waited_for_a_deletion_still_has_its_receipt(make_monitor, tmp_path):
    """The pass claims step 1 and is held before the step's ledger records go. A unit of step 1
    writes its "started" receipt and asks to be admitted: it waits for the deletion, which
    removes every record of the step, its receipt too. Once admitted it must have a receipt
    again (the monitor writes it): a monitor restarted while the unit runs knows it only from
    that receipt."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor, coord = two_state_dicts(make_monitor, root)
    attempt = ray.get(monitor.ping.remote())["attempt"]
    arm_in_monitor(monitor, "after_delete_claim", f"until:60:{gate}")
    writing, may_finish = threading.Event(), threading.Event()
    d = coord.step_dir(1)

    def optim() -> list[str]:
        writing.set()
        assert may_finish.wait(60)
        return write_file(f"{d}/optim.bin", os.urandom(512))

    try:
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "after_delete_claim"), what="the pass to claim step 1")
        coord.save_async("optim", optim, 1)
        wait_for(lambda: unit_receipt(root, attempt, 1, "w") is not None, what="the unit's receipt")
        assert not writing.wait(1), "the unit was admitted into step 1 while it was claimed for deletion"
    finally:
        open(gate, "w").close()
    try:
        assert writing.wait(30), "the unit was never admitted after the deletion"
        assert 1 in status(monitor).retention.deleted_steps
        receipt = unit_receipt(root, attempt, 1, "w")
        assert receipt is not None and receipt["status"] == "started", (
            f"the unit runs, admitted after step 1's deletion removed its records, with no receipt: {receipt}")
    finally:
        may_finish.set()
    coord.wait_all()
    coord.close()


def _two_kept_and_step_1_committed(make_monitor, root: str, is_sd: bool):
    """A monitor that keeps two of the kind (no commit retries) and a coordinator; step 1 of the
    kind committed and its retention pass over."""
    monitor = make_monitor(root, commit_retries=0, max_state_dict_to_keep=2, max_ckpt_to_keep=None if is_sd else 2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=is_sd)
    assert ray.get(monitor.wait_retention.remote(60))
    return monitor, coord


@pytest.mark.parametrize("kind", [Kind.STATE_DICT, Kind.CHECKPOINT])
def test_a_step_whose_publish_is_being_settled_does_not_count_toward_retention(make_monitor, tmp_path, kind):
    """Two of ``kind`` are kept; 1 and 2 are committed. Step 3's manifest is visible, but its
    publish raised and is being settled (held) when step 4 commits: that pass counted 3 among
    the newest two and deleted 2. Then 3 is taken back (its sync fails): one was left. Found by
    helper-52's attack (session 34)."""
    is_sd = kind is Kind.STATE_DICT
    root = str(tmp_path / "ckpt")
    monitor, coord = _two_kept_and_step_1_committed(make_monitor, root, is_sd)
    commit_one(coord, 2, "weights.bin", is_state_dict=is_sd)
    assert ray.get(monitor.wait_retention.remote(60))
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "after_publish", "raise")
    arm_in_monitor(monitor, "settle_read", f"until:60:{gate}")
    try:
        save_one(coord, 3, "weights.bin", is_sd)
        wait_for(lambda: held_at(monitor, "settle_read"), what="step 3's uncertain publish being settled")
        arm_in_monitor(monitor, "after_publish", None)
        arm_in_monitor(monitor, "settle_read", None)
        commit_one(coord, 4, "weights.bin", is_state_dict=is_sd)
        assert ray.get(monitor.wait_retention.remote(60))
        arm_in_monitor(monitor, "settle_sync", "raise")  # step 3 is taken back
    finally:
        open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, is_state_dict=is_sd, timeout_s=60)
    arm_in_monitor(monitor, "settle_sync", None)
    assert ray.get(monitor.wait_retention.remote(60))
    manifest = MANIFESTS[kind]
    left = [s for s in (1, 2, 3, 4) if os.path.exists(f"{ckptd.step_dir(root, s)}/{manifest}")]
    assert left == [2, 4], f"retention kept {left} of the two newest committed"
    assert_trackers_verified(root)
    coord.close()


def _step_3_about_to_be_taken_back_while_a_pass_waits_to_scan(monitor, coord, is_sd: bool, settle: str) -> None:
    """Step 2 commits; the retention pass that follows is held before its scan (armed by the
    caller), after it read what was in flight. Step 3 is then saved, its publish raises and
    cannot be read back, and its settling is held (until ``settle`` exists) right before it
    takes the manifest back: visible, its commit in flight."""
    commit_one(coord, 2, "weights.bin", is_state_dict=is_sd)
    wait_for(lambda: held_at(monitor, "before_retention_scan"), what="the pass held before its scan")
    arm_in_monitor(monitor, "before_retention_scan", None)
    arm_in_monitor(monitor, "after_publish", "raise")
    arm_in_monitor(monitor, "settle_read", "raise")
    arm_in_monitor(monitor, "settle_remove", f"until:60:{settle}")
    save_one(coord, 3, "weights.bin", is_sd)
    wait_for(lambda: held_at(monitor, "settle_remove"), what="step 3's publish about to be taken back")
    arm_in_monitor(monitor, "after_publish", None)
    arm_in_monitor(monitor, "settle_read", None)


@pytest.mark.parametrize("kind", [Kind.STATE_DICT, Kind.CHECKPOINT])
def test_a_pass_does_not_count_a_manifest_whose_commit_began_after_it_read_what_was_in_flight(
        make_monitor, tmp_path, kind):
    """As above, but step 3's commit begins after the pass (scheduled by step 2's commit) read
    what was in flight and before it scanned: the scan counted 3's manifest, still being
    settled, and 1 was deleted before 3 was taken back. The last look before each deletion now
    refuses while a manifest the plan counted belongs to a commit in flight. Found by helper-53's
    attack (session 34)."""
    is_sd = kind is Kind.STATE_DICT
    root = str(tmp_path / "ckpt")
    monitor, coord = _two_kept_and_step_1_committed(make_monitor, root, is_sd)
    scan, settle = str(tmp_path / "scan"), str(tmp_path / "settle")
    arm_in_monitor(monitor, "before_retention_scan", f"until:60:{scan}")
    try:
        _step_3_about_to_be_taken_back_while_a_pass_waits_to_scan(monitor, coord, is_sd, settle)
        open(scan, "w").close()  # the pass scans 1, 2 and 3
        assert ray.get(monitor.wait_retention.remote(60))
        assert os.path.exists(f"{ckptd.step_dir(root, 1)}/{MANIFESTS[kind]}")
    finally:
        open(scan, "w").close()
        open(settle, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, is_state_dict=is_sd, timeout_s=60)
    arm_in_monitor(monitor, "settle_remove", None)
    assert ray.get(monitor.wait_retention.remote(60))
    left = [s for s in (1, 2, 3) if os.path.exists(f"{ckptd.step_dir(root, s)}/{MANIFESTS[kind]}")]
    assert left == [1, 2], f"retention kept {left} of the two newest committed"
    assert_trackers_verified(root)
    coord.close()


@pytest.mark.parametrize("kind", [Kind.STATE_DICT, Kind.CHECKPOINT])
def test_a_counted_manifest_taken_back_between_the_scan_and_a_deletion_keeps_the_older_step(
        make_monitor, tmp_path, kind):
    """As above, but step 3's publish is taken back after the scan counted it and before step 1's
    deletion is claimed: at the last look 3's commit is no longer in flight, it failed. The last
    look refused for a state dict withdrawn since the pass began, not for a full checkpoint
    taken back, and deleted 1."""
    is_sd = kind is Kind.STATE_DICT
    root = str(tmp_path / "ckpt")
    monitor, coord = _two_kept_and_step_1_committed(make_monitor, root, is_sd)
    scan, settle, planned = (str(tmp_path / name) for name in ("scan", "settle", "planned"))
    arm_in_monitor(monitor, "before_retention_scan", f"until:60:{scan}")
    try:
        _step_3_about_to_be_taken_back_while_a_pass_waits_to_scan(monitor, coord, is_sd, settle)
        arm_in_monitor(monitor, "after_retention_plan", f"until:60:{planned}")
        open(scan, "w").close()  # the pass scans 1, 2 and 3, counts 2 and 3, and plans to delete 1
        wait_for(lambda: held_at(monitor, "after_retention_plan"), what="the pass's plan")
        arm_in_monitor(monitor, "after_retention_plan", None)
        arm_in_monitor(monitor, "settle_remove", None)
        open(settle, "w").close()
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(3, is_state_dict=is_sd, timeout_s=60)
        assert not os.path.exists(f"{ckptd.step_dir(root, 3)}/{MANIFESTS[kind]}")
    finally:
        for gate in (scan, settle, planned):
            open(gate, "w").close()
    assert ray.get(monitor.wait_retention.remote(60))
    left = [s for s in (1, 2, 3) if os.path.exists(f"{ckptd.step_dir(root, s)}/{MANIFESTS[kind]}")]
    assert left == [1, 2], f"retention kept {left} of the two newest committed"
    assert_trackers_verified(root)
    coord.close()


@pytest.mark.parametrize("unit_then", ["ends", "rewrites the state dict's file"])
def test_a_counted_manifest_taken_back_and_deferred_keeps_the_older_step(make_monitor, tmp_path, unit_then):
    """Step 3's state dict publish is taken back after the scan counted it, and its retry is put
    back to pending: a checkpoint unit of step 3 running beside it wrote a file meanwhile. The
    last look took pending for settled and deleted state dict 1: one of two kept until 3 commits,
    and for good when the unit then rewrites 3's file (3 fails). Found by helper-55's attack."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=1, max_state_dict_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    assert ray.get(monitor.wait_retention.remote(60))
    scan, settle, planned = (str(tmp_path / name) for name in ("scan", "settle", "planned"))
    began, write, finish = threading.Event(), threading.Event(), threading.Event()
    step_dir = coord.step_dir(3)

    def checkpoint_unit() -> list[str]:
        began.set()
        assert write.wait(60), "the test never let the unit write"
        write_file(f"{step_dir}/optim.bin", os.urandom(256))
        assert finish.wait(60), "the test never let the unit end"
        if unit_then != "ends":
            write_file(f"{step_dir}/weights.bin", os.urandom(64))
        return [f"{step_dir}/optim.bin"]

    arm_in_monitor(monitor, "before_retention_scan", f"until:60:{scan}")
    try:
        commit_one(coord, 2, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "before_retention_scan"), what="the pass held before its scan")
        arm_in_monitor(monitor, "before_retention_scan", None)
        coord.register(3, checkpoint_thread_count=1)
        coord.register(3, is_state_dict=True, state_dict_thread_count=1)
        coord.save_async("optim", checkpoint_unit, 3)
        assert began.wait(60)
        arm_in_monitor(monitor, "after_publish", "raise")
        arm_in_monitor(monitor, "settle_read", "raise")
        arm_in_monitor(monitor, "settle_remove", f"until:60:{settle}")
        coord.save_async("w3", lambda: write_file(f"{step_dir}/weights.bin", os.urandom(64)), 3, is_state_dict=True)
        wait_for(lambda: held_at(monitor, "settle_remove"), what="step 3's publish about to be taken back")
        arm_in_monitor(monitor, "after_publish", None)
        arm_in_monitor(monitor, "settle_read", None)
        arm_in_monitor(monitor, "after_retention_plan", f"until:60:{planned}")
        open(scan, "w").close()  # the pass counts state dicts 2 and 3, and plans to delete 1
        wait_for(lambda: held_at(monitor, "after_retention_plan"), what="the pass's plan")
        arm_in_monitor(monitor, "after_retention_plan", None)
        write.set()
        wait_for(lambda: os.path.exists(f"{step_dir}/optim.bin"), what="the checkpoint unit's file")
        arm_in_monitor(monitor, "settle_remove", None)
        open(settle, "w").close()
        wait_for(lambda: ledger_states(monitor, 3)["state_dict"] == "pending", what="step 3 taken back and deferred")
        assert not os.path.exists(f"{step_dir}/{MANIFESTS[Kind.STATE_DICT]}")
        open(planned, "w").close()
        assert ray.get(monitor.wait_retention.remote(60))
        left = [s for s in (1, 2, 3) if os.path.exists(f"{ckptd.step_dir(root, s)}/{MANIFESTS[Kind.STATE_DICT]}")]
        assert left == [1, 2], f"retention kept {left} of the two newest committed state dicts"
    finally:
        for gate in (scan, settle, planned):
            open(gate, "w").close()
        write.set()
        finish.set()
    outcome, _ = in_thread(lambda: coord.wait_committed(3, is_state_dict=True, timeout_s=60), 90)
    assert outcome == ("ok" if unit_then == "ends" else "raised")
    assert ray.get(monitor.wait_retention.remote(60))
    left = [s for s in (1, 2, 3) if os.path.exists(f"{ckptd.step_dir(root, s)}/{MANIFESTS[Kind.STATE_DICT]}")]
    assert left == ([2, 3] if unit_then == "ends" else [1, 2]), left
    assert_trackers_verified(root)
    with contextlib.suppress(ckptd.CheckpointSaveError):
        coord.wait_all()  # the checkpoint of step 3 fails where its unit rewrote the state dict
    coord.close()
