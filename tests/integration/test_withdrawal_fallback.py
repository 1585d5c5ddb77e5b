"""Where a withdrawn state dict's tracker falls back to. A withdrawal points the state-dict tracker
at the newest step that stays committed; it used to take any manifest storage showed: one whose
commit was still settling an uncertain publish (which may be taken back), and one of a step
retention had claimed and was about to delete. Retention, for its part, decided at its claim
whether a withdrawal left it too few state dicts, and not again before the deletion. Found by
helper-50's attack (session 34)."""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    fail_full_checkpoint,
    failpoint_env,
    held_at,
    in_thread,
    read_manifest,
    restart_monitor,
    save_one,
    tracker_of,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
SD = ckptd.Kind.STATE_DICT


def _state_dict_with_a_checkpoint_unit_held(coord, step: int) -> threading.Event:
    """State dict ``step`` committed while a unit of its full checkpoint is held; setting the
    event returned lets the unit rewrite the state dict's file, which withdraws it."""
    weights = f"{coord.step_dir(step)}/weights.bin"
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.register(step, checkpoint_thread_count=1)
    admitted, go = threading.Event(), threading.Event()

    def unit():
        admitted.set()
        go.wait(DEADLINE_S)
        return write_file(weights, os.urandom(4096))

    coord.save_async(f"optimizer-{step}", unit, step)
    assert admitted.wait(DEADLINE_S)
    coord.save_sync(lambda: write_file(weights, os.urandom(4096)), step, is_state_dict=True)
    coord.wait_committed(step, is_state_dict=True, timeout_s=DEADLINE_S)
    return go


def test_a_withdrawal_does_not_fall_back_to_a_manifest_whose_publish_is_being_settled(make_monitor, tmp_path):
    """State dict 2's manifest is renamed into place but its publish raised: the commit is settling
    it (held), and may yet take it back. State dict 1 is withdrawn meanwhile: its tracker must not
    name step 2 (nor announce it) until that commit is settled."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    go = _state_dict_with_a_checkpoint_unit_held(coord, 1)
    gate = str(tmp_path / "settle")
    arm_in_monitor(monitor, "after_publish", "raise")
    arm_in_monitor(monitor, "settle_sync", f"until:{DEADLINE_S:g}:{gate}")
    try:
        save_one(coord, 2, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "settle_sync"), DEADLINE_S, "step 2's uncertain publish being settled")
        arm_in_monitor(monitor, "after_publish", None)
        assert read_manifest(root, 2, SD) is not None
        go.set()
        wait_for(lambda: read_manifest(root, 1, SD) is None, DEADLINE_S, "state dict 1 withdrawn")
        assert tracker_of(root, SD) is None  # no state dict is settled as committed
        assert ray.get(monitor.wait_version.remote("state_dict", 1, 0.5))["version"] != 2
    finally:
        arm_in_monitor(monitor, "settle_sync", None)
        open(gate, "w").close()
    coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)  # settled: durable after all
    assert tracker_of(root, SD) == 2
    assert_trackers_verified(root)
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_all()
    coord.close()


@pytest.mark.parametrize("withdrawn", [[3], [2, 3]], ids=["the-newest", "both-kept-ones"])
def test_a_withdrawal_while_retention_deletes_an_older_state_dict_keeps_it(make_monitor, tmp_path, withdrawn):
    """Two state dicts are kept. 1, 2 and 3 are committed; the pass after 3 claims step 1 and is
    held right before deleting it. Then the state dicts ``withdrawn`` are withdrawn (their full
    checkpoints' units rewrite them). Step 1 must stay, one of the two newest state dicts left,
    and the tracker must name a step that is still there (it named step 1, deleted after)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, max_ckpt_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    held: dict[int, threading.Event] = {}
    if 2 in withdrawn:
        held[2] = _state_dict_with_a_checkpoint_unit_held(coord, 2)
    else:
        commit_one(coord, 2, "weights.bin", is_state_dict=True)
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_step_delete", f"until:{DEADLINE_S:g}:{gate}")
    try:
        held[3] = _state_dict_with_a_checkpoint_unit_held(coord, 3)
        wait_for(lambda: held_at(monitor, "before_step_delete"), DEADLINE_S, "retention about to delete step 1")
        arm_in_monitor(monitor, "before_step_delete", None)
        for step in withdrawn:
            held[step].set()
        # One worker's reports are answered in turn: the first withdrawal holds the second's back.
        wait_for(lambda: any(read_manifest(root, s, SD) is None for s in withdrawn) or ray.get(
            monitor.__ray_call__.remote(lambda self: bool(set(withdrawn) & self._ledger.withdrawing_steps()))),
            DEADLINE_S, "a withdrawal begun")
    finally:
        open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    wait_for(lambda: all(read_manifest(root, s, SD) is None for s in withdrawn), DEADLINE_S, "the withdrawals done")
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    assert read_manifest(root, 1, SD) is not None, "retention deleted a state dict it had to keep"
    assert tracker_of(root, SD) == (1 if 2 in withdrawn else 2)
    assert_trackers_verified(root)
    coord.close()


def test_a_withdrawal_while_retention_deletes_a_state_dict_whose_checkpoint_failed_keeps_it(make_monitor, tmp_path):
    """As above, with step 1's full checkpoint failed (its state dict stays committed): its
    deletion is marked in its records before the last look, which skipped such steps. The look
    now keeps it too, and the mark then lists no kind, so a restarted monitor goes by the
    manifests. Found by helper-51's attack (session 34)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, max_ckpt_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    fail_full_checkpoint(coord, 1)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    assert read_manifest(root, 1, SD) is not None
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_step_delete", f"until:{DEADLINE_S:g}:{gate}")
    try:
        go = _state_dict_with_a_checkpoint_unit_held(coord, 3)
        wait_for(lambda: held_at(monitor, "before_step_delete"), DEADLINE_S, "retention about to delete step 1")
        arm_in_monitor(monitor, "before_step_delete", None)
        go.set()
        wait_for(lambda: read_manifest(root, 3, SD) is None or ray.get(
            monitor.__ray_call__.remote(lambda self: 3 in self._ledger.withdrawing_steps())),
            DEADLINE_S, "the withdrawal of state dict 3 begun")
    finally:
        open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    wait_for(lambda: read_manifest(root, 3, SD) is None, DEADLINE_S, "state dict 3 withdrawn")
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    assert read_manifest(root, 1, SD) is not None, "retention deleted one of the 2 newest committed state dicts"
    assert tracker_of(root, SD) == 2
    restart_monitor(monitor)
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    assert read_manifest(root, 1, SD) is not None and read_manifest(root, 2, SD) is not None
    assert_trackers_verified(root)
    coord.close()


def test_a_state_dict_withdrawn_while_it_goes_up_to_the_mirror_is_not_committed_there(make_monitor, tmp_path):
    """State dict 2's files are on the mirror, its manifest not yet, when it is withdrawn on the
    root. The upload went on and committed it on the mirror (manifest and tracker) after the job
    heard it was withdrawn; it now reads the root's manifests again before its own. Found by
    helper-51's attack (session 34)."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror, "state_dicts": True})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    coord.wait_mirrored(1, timeout_s=DEADLINE_S)
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_mirror_manifest", f"until:{DEADLINE_S:g}:{gate}")
    try:
        go = _state_dict_with_a_checkpoint_unit_held(coord, 2)
        wait_for(lambda: held_at(monitor, "before_mirror_manifest"), DEADLINE_S, "step 2's upload before its manifest")
        arm_in_monitor(monitor, "before_mirror_manifest", None)
        go.set()
        with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
            coord.wait_all()
        with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):  # answered once it has ended
            coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
        assert read_manifest(root, 2, SD) is None and tracker_of(root, SD) == 1
    finally:
        open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointError, match="withdrawn|no longer committed"):
        coord.wait_mirrored(2, timeout_s=DEADLINE_S)
    assert read_manifest(mirror, 2, SD) is None and tracker_of(mirror, SD) == 1
    assert_trackers_verified(mirror)
    coord.close()


def test_a_state_dict_withdrawn_while_its_mirror_manifest_write_is_retried_is_not_committed_there(
        make_monitor, tmp_path):
    """As above, with the mirror refusing the manifest's write for a while: the root was read
    once, before the first try, and the retried write went up after the withdrawal. Each try
    reads it again now. Found by helper-52's attack (session 34)."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror, "state_dicts": True, "retries": 200, "retry_backoff_s": 0.05})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    coord.wait_mirrored(1, timeout_s=DEADLINE_S)
    held, refused = str(tmp_path / "held"), str(tmp_path / "refused")
    arm_in_monitor(monitor, "before_mirror_manifest", f"until:{DEADLINE_S:g}:{held}")
    try:
        go = _state_dict_with_a_checkpoint_unit_held(coord, 2)
        wait_for(lambda: held_at(monitor, "before_mirror_manifest"), DEADLINE_S, "step 2's upload before its manifest")
        arm_in_monitor(monitor, "before_mirror_publish", f"raise_until:{refused}")
        arm_in_monitor(monitor, "before_mirror_manifest", None)
        tries = ray.get(monitor.__ray_call__.remote(lambda self: self._mirror._retried))
        open(held, "w").close()
        wait_for(lambda: ray.get(monitor.__ray_call__.remote(lambda self: self._mirror._retried)) > tries, DEADLINE_S,
                 "the manifest's write refused and retried")
        go.set()
        with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
            coord.wait_all()
        with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):  # answered once it has ended
            coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
        assert read_manifest(root, 2, SD) is None
    finally:
        open(held, "w").close()
        open(refused, "w").close()
    with pytest.raises(ckptd.CheckpointError, match="withdrawn|no longer committed"):
        coord.wait_mirrored(2, timeout_s=DEADLINE_S)
    assert read_manifest(mirror, 2, SD) is None and tracker_of(mirror, SD) == 1
    arm_in_monitor(monitor, "before_mirror_publish", None)
    coord.close()


def test_a_wait_for_a_state_dict_mirrored_before_a_restart_ends(make_monitor, tmp_path):
    """With state dicts mirrored, a restarted monitor asked about a step already on the mirror
    looked for its full checkpoint's manifest, which a state dict alone does not have: the wait
    ran to its timeout. Found by helper-52's attack (session 34)."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror, "state_dicts": True})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    coord.wait_mirrored(1, timeout_s=DEADLINE_S)
    restart_monitor(monitor, how="sigkill")
    coord.wait_mirrored(1, timeout_s=DEADLINE_S)
    coord.close()


def test_a_restart_between_a_withdrawals_tracker_and_manifest_keeps_the_tracker_back(make_monitor, tmp_path):
    """State dict 3's withdrawal recorded its failure and pointed the tracker back at 2; the
    monitor is killed before the manifest goes. The restarted monitor's tracker repair went by
    the manifests alone and pointed the tracker at 3 again (its file replaced) until the start-up
    withdrew it; the recorded failure now rules that step out. Found by helper-52's attack
    (session 34)."""
    root = str(tmp_path / "ckpt")
    restarted = str(tmp_path / "restarted")  # holds the restarted monitor's own withdrawal of 3
    monitor = make_monitor(root, max_state_dict_to_keep=3, max_ckpt_to_keep=None,
                           runtime_env=failpoint_env(f"before_revoke=until:{DEADLINE_S:g}:{restarted}"))
    arm_in_monitor(monitor, "before_revoke", "delay:0")  # not in this first process
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    go = _state_dict_with_a_checkpoint_unit_held(coord, 3)
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_revoke_rm", f"until:{DEADLINE_S:g}:{gate}")
    go.set()
    wait_for(lambda: held_at(monitor, "before_revoke_rm"), DEADLINE_S, "the withdrawal between tracker and manifest")
    assert tracker_of(root, SD) == 2 and read_manifest(root, 3, SD) is not None
    restart_monitor(monitor, how="sigkill")
    open(gate, "w").close()
    try:
        wait_for(lambda: held_at(monitor, "before_revoke"), DEADLINE_S, "the restarted monitor's withdrawal of 3")
        assert tracker_of(root, SD) == 2  # as the start-up's tracker repair left it
    finally:
        open(restarted, "w").close()
    wait_for(lambda: read_manifest(root, 3, SD) is None, DEADLINE_S, "state dict 3 withdrawn after the restart")
    assert tracker_of(root, SD) == 2
    assert_trackers_verified(root)
    with pytest.raises(ckptd.CheckpointSaveError, match="weights.bin of step 3"):  # the unit, retried to the restart
        coord.wait_all()
    coord.close()


@pytest.mark.parametrize("restarted", [False, True], ids=["live", "after-a-restart"])
def test_a_wait_for_the_mirror_of_a_failed_step_ends(make_monitor, tmp_path, restarted):
    """State dict 2 failed (its unit raised): it is never uploaded, and no upload's outcome woke
    a wait for it on the mirror, which ran to its timeout (forever, without one). Found by
    helper-53's attack (session 34)."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror, "state_dicts": True})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    waiting = threading.Thread(target=lambda: outcome.append(in_thread(
        lambda: coord.wait_mirrored(2, timeout_s=None), DEADLINE_S)), daemon=True)
    outcome: list = []
    if not restarted:
        waiting.start()  # begun before the failure

    def disk_full():
        raise OSError("disk full")

    coord.save_async("weights", disk_full, 2, is_state_dict=True)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    if restarted:
        restart_monitor(monitor, how="sigkill")
        waiting.start()
    waiting.join(DEADLINE_S)
    assert outcome and outcome[0][0] == "raised", f"the wait for step 2 on the mirror did not end: {outcome}"
    assert isinstance(outcome[0][1], ckptd.CheckpointError) and "disk full" in str(outcome[0][1])
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_all()
    coord.close()


def test_a_wait_for_the_mirror_is_told_of_a_failure_only_once_it_is_recorded(make_monitor, tmp_path):
    """State dict 2's commit failed and its failure record is being written (held): a wait on
    the mirror was told "failed" at once, while wait_committed waits for the record, and a
    monitor killed before the record then committed and mirrored the step. It now waits for
    the record too. Found by helper-54's attack (session 34)."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, commit_retries=0, mirror={"url": mirror, "state_dicts": True})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_manifest", "raise")
    arm_in_monitor(monitor, "before_failure_record", f"until:{DEADLINE_S:g}:{gate}")
    try:
        save_one(coord, 2, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "before_failure_record"), DEADLINE_S, "the failure record held")
        arm_in_monitor(monitor, "before_manifest", None)
        with pytest.raises(TimeoutError):  # not failed yet: the record is not written
            coord.wait_mirrored(2, timeout_s=2)
    finally:
        open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointError, match="FailpointError"):  # recorded now
        coord.wait_mirrored(2, timeout_s=DEADLINE_S)
    coord.close()


def test_a_withdrawal_does_not_fall_back_to_a_step_whose_files_changed_outside_ckptd(make_monitor, tmp_path):
    """State dicts 1 to 3 are committed (3 while a unit of its full checkpoint is held); step 2's
    file is then changed outside ckptd, and the unit rewrites step 3's, which withdraws it. The
    tracker fell back to step 2, which every loader refuses (helper-81): it goes to step 1, and
    step 2 stays as it is."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None, max_ckpt_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2):
        commit_one(coord, step, "weights.bin", is_state_dict=True)
    go = _state_dict_with_a_checkpoint_unit_held(coord, 3)
    assert tracker_of(root, SD) == 3
    weights2 = f"{coord.step_dir(2)}/weights.bin"
    write_file(weights2, os.urandom(os.path.getsize(weights2)))
    go.set()
    with pytest.raises(ckptd.CheckpointError):
        coord.wait_all()
    wait_for(lambda: read_manifest(root, 3, SD) is None, DEADLINE_S, "state dict 3 withdrawn")
    assert tracker_of(root, SD) == 1
    assert_trackers_verified(root)
    assert read_manifest(root, 2, SD) is not None  # not ckptd's to take back: a loader names what changed
    coord.close()


def _retention_idle(monitor) -> bool:
    return ray.get(monitor.__ray_call__.remote(lambda self: self._retention.idle.is_set()))


def test_no_retention_pass_deletes_the_older_step_a_withdrawal_falls_back_to(make_monitor, tmp_path):
    """Two state dicts are kept. State dicts 1 to 4 are committed (4 while a unit of its full
    checkpoint is held, and the pass that would delete step 1 held before its scan); 2 and 3 are
    changed outside ckptd, and the unit rewrites 4's file. The withdrawal passes over 2 and 3 and
    points the tracker at step 1, which the pass, let go meanwhile, deleted: it counted 2 and 3
    among the two it keeps (helper-82)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, max_ckpt_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    wait_for(lambda: _retention_idle(monitor), DEADLINE_S, "the pass after step 1")
    scan_gate, rm_gate = tmp_path / "scan.gate", tmp_path / "rm.gate"
    arm_in_monitor(monitor, "before_retention_scan", f"until:{DEADLINE_S:g}:{scan_gate}")
    try:
        commit_one(coord, 2, "weights.bin", is_state_dict=True)
        wait_for(lambda: held_at(monitor, "before_retention_scan"), DEADLINE_S, "the pass held")
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
        go = _state_dict_with_a_checkpoint_unit_held(coord, 4)
        for step in (2, 3):
            weights = f"{coord.step_dir(step)}/weights.bin"
            write_file(weights, os.urandom(os.path.getsize(weights)))
        arm_in_monitor(monitor, "before_revoke_rm", f"until:{DEADLINE_S:g}:{rm_gate}")
        go.set()
        wait_for(lambda: held_at(monitor, "before_revoke_rm"), DEADLINE_S, "the withdrawal held after its tracker")
        assert tracker_of(root, SD) == 1
        arm_in_monitor(monitor, "before_retention_scan", None)
        scan_gate.touch()
        wait_for(lambda: _retention_idle(monitor), DEADLINE_S, "the passes over")
        assert held_at(monitor, "before_revoke_rm"), "the withdrawal is still under way"
        assert os.path.isdir(coord.step_dir(1))
    finally:
        scan_gate.touch()
        rm_gate.touch()
    with pytest.raises(ckptd.CheckpointError):
        coord.wait_all()
    wait_for(lambda: read_manifest(root, 4, SD) is None, DEADLINE_S, "state dict 4 withdrawn")
    wait_for(lambda: _retention_idle(monitor), DEADLINE_S, "the pass after the withdrawal")
    assert tracker_of(root, SD) == 1
    assert_trackers_verified(root)
    coord.close()
