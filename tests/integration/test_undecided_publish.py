"""A manifest's publish raised, and storage refuses both the sync and the removal that would
settle it, when a newer attempt appears on the root. Invariant 2 (a step reported failed is
never committed) must hold on both sides:

* a newer job that stays owns the root, and its start-up keeps the manifest (a state dict's
  only if its files are unchanged):
  the old job is told the outcome is that job's to decide, never that the step failed;
* a losing ``start_monitor``'s attempt, taken back within seconds, only pauses the settle: the
  job is told what storage then holds, and a Ray restart of its monitor agrees.

Found by helper-68's attack (session 38): the old job was told "failed" and the next job, or the
same job's restarted monitor, committed the step.
"""

from __future__ import annotations

import pytest

import ckptd
from ckptd.monitor.attempts import open_attempt
from ckptd.monitor.fence_watch import FENCE_CHECK_S
from ckptd.storage import Storage

from .helpers import (
    arm_in_monitor,
    commit_one,
    held_at,
    read_manifest,
    restart_monitor,
    save_one,
    tracker_of,
    wait_for,
    write_file,
)
from .test_fenced_idle_monitor import _looks_held, _take_back

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
SETTLE_POINTS = ("after_publish", "settle_sync", "settle_remove")


def _unsettled_publish(monitor, tmp_path) -> tuple[str, str]:
    """Make every publish raise after it happened, and storage refuse the sync and the removal
    that would settle it until the returned files exist (sync_ok, rm_ok)."""
    sync_ok, rm_ok = str(tmp_path / "sync-ok"), str(tmp_path / "rm-ok")
    arm_in_monitor(monitor, "after_publish", "raise")
    arm_in_monitor(monitor, "settle_sync", f"raise_until:{sync_ok}")
    arm_in_monitor(monitor, "settle_remove", f"raise_until:{rm_ok}")
    return sync_ok, rm_ok


def _storage_recovers(monitor, *paths: str) -> None:
    for path in paths:
        open(path, "w").close()
    for name in SETTLE_POINTS:
        arm_in_monitor(monitor, name, None)


@pytest.mark.parametrize("kind", [CKPT, SD], ids=["checkpoint", "state_dict"])
def test_a_publish_a_newer_job_took_over_while_it_was_settled_is_left_to_that_job(make_monitor, tmp_path, kind):
    """The old job is told step 2 is undecided (a CheckpointError that is not a save failure,
    naming the newer attempt); the old monitor removes nothing from the root; the new job's
    start-up keeps the step, whose files are unchanged, and its trackers name it."""
    root, is_sd = str(tmp_path / "ckpt"), kind is SD
    monitor = make_monitor(root, commit_retries=0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=is_sd)
    sync_ok, rm_ok = _unsettled_publish(monitor, tmp_path)
    try:
        if is_sd:  # a full checkpoint of the step too, that no unit has saved yet: it cannot commit any more
            coord.register(2, checkpoint_thread_count=1)
        save_one(coord, 2, "model.bin", is_sd)
        wait_for(lambda: read_manifest(root, 2, kind) is not None, DEADLINE_S, "step 2's manifest renamed into place")
        newer = open_attempt(Storage(root), "the-next-job", None)
        open(rm_ok, "w").close()  # storage would remove it now: the fence stops the old monitor first
        with pytest.raises(ckptd.CheckpointError, match=f"undecided.*attempt {newer.attempt}") as told:
            coord.wait_committed(2, is_state_dict=is_sd, timeout_s=DEADLINE_S)
        assert not isinstance(told.value, ckptd.CheckpointSaveError), "told failed: the new job may commit it"
        assert read_manifest(root, 2, kind) is not None and tracker_of(root, kind) == 1
        if is_sd:
            with pytest.raises(ckptd.CheckpointSaveError, match="took the root over while the step's state dict"):
                coord.wait_committed(2, timeout_s=DEADLINE_S)
    finally:
        _storage_recovers(monitor, sync_ok, rm_ok)
    coord.close()
    make_monitor(root, run="the-next-job")  # its start-up decides: the step's files are unchanged
    assert ckptd.latest_step(root, kind.value) == 2 and tracker_of(root, kind) == 2
    assert ckptd.verify(root, 2, kind=kind.value).step == 2
    assert read_manifest(root, 2, CKPT if is_sd else SD) is None  # the kind the old job was told failed


@pytest.mark.parametrize("storage_recovers_with", ["the removal", "the sync"])
@pytest.mark.parametrize("kind", [CKPT, SD], ids=["checkpoint", "state_dict"])
def test_a_publish_settled_under_a_losing_starts_attempt_waits_until_it_is_taken_back(
        make_monitor, tmp_path, kind, storage_recovers_with):
    """A losing ``start_monitor`` opens its attempt while step 2's publish is being settled, and
    takes it back. Meanwhile the job is told nothing; then what storage allows decides (the
    removal: failed, and gone; the sync: committed), and a Ray restart of the monitor agrees."""
    root, is_sd = str(tmp_path / "ckpt"), kind is SD
    monitor = make_monitor(root, commit_retries=0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "model.bin", is_state_dict=is_sd)
    sync_ok, rm_ok = _unsettled_publish(monitor, tmp_path)
    gate = str(tmp_path / "remove.gate")
    arm_in_monitor(monitor, "settle_remove", f"until:{DEADLINE_S:g}:{gate}")
    release_looks = _looks_held(monitor, tmp_path)  # two looks would make the loser's fence final
    try:
        save_one(coord, 2, "model.bin", is_sd)
        wait_for(lambda: held_at(monitor, "settle_remove"), DEADLINE_S, "step 2's publish about to be taken back")
        loser = open_attempt(storage, "a-losing-start", None)
        arm_in_monitor(monitor, "settle_remove", f"raise_until:{rm_ok}")
        open(gate, "w").close()
        open(rm_ok, "w").close()  # storage would remove it now, but the loser's attempt is on the root
        with pytest.raises(TimeoutError):  # neither committed nor failed while the loser is there
            coord.wait_committed(2, is_state_dict=is_sd, timeout_s=3)
        assert read_manifest(root, 2, kind) is not None
        if storage_recovers_with == "the removal":
            _take_back(storage, loser.attempt)
            with pytest.raises(ckptd.CheckpointSaveError, match="FailpointError"):
                coord.wait_committed(2, is_state_dict=is_sd, timeout_s=DEADLINE_S)
        else:
            arm_in_monitor(monitor, "after_publish", None)  # the tracker's publish goes through
            open(sync_ok, "w").close()
            coord.wait_committed(2, is_state_dict=is_sd, timeout_s=DEADLINE_S)
            _take_back(storage, loser.attempt)
    finally:
        release_looks()
        _storage_recovers(monitor, sync_ok, rm_ok, gate)
    committed = storage_recovers_with == "the sync"
    want = 2 if committed else 1
    assert (read_manifest(root, 2, kind) is not None) is committed
    # The tracker's publish met the loser's attempt: it moves forward once a look lifts the fence.
    wait_for(lambda: tracker_of(root, kind) == want, 3 * FENCE_CHECK_S + 5, f"the tracker naming step {want}")
    assert ckptd.latest_step(root, kind.value) == want
    restart_monitor(monitor, how="sigkill")
    if committed:
        coord.wait_committed(2, is_state_dict=is_sd, timeout_s=DEADLINE_S)
        assert ckptd.verify(root, 2, kind=kind.value).step == 2
    else:
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(2, is_state_dict=is_sd, timeout_s=DEADLINE_S)
    assert ckptd.latest_step(root, kind.value) == want and tracker_of(root, kind) == want
    coord.close()


def _told_undecided(call) -> None:
    """``call`` raises a CheckpointError saying the step is undecided, and not a save failure."""
    with pytest.raises(ckptd.CheckpointError, match="undecided") as told:
        call()
    assert not isinstance(told.value, ckptd.CheckpointSaveError), f"told failed: {told.value}"


def _checkpoint_2_left_undecided(coord, monitor, root: str, tmp_path, newer_run: str):
    """Step 2's checkpoint manifest is visible, its publish unsettled, when an attempt of
    ``newer_run`` opens on the root; returns once the old job was told it is undecided (the
    attempt's fence is final), with storage working again. The attempt."""
    sync_ok, rm_ok = _unsettled_publish(monitor, tmp_path)
    try:
        save_one(coord, 2, "model.bin", False)
        wait_for(lambda: read_manifest(root, 2, CKPT) is not None, DEADLINE_S, "step 2's manifest renamed into place")
        newer = open_attempt(Storage(root), newer_run, None)
        open(rm_ok, "w").close()
        _told_undecided(lambda: coord.wait_committed(2, timeout_s=DEADLINE_S))
    finally:
        _storage_recovers(monitor, sync_ok, rm_ok)
    return newer


def test_every_answer_about_an_undecided_step_says_undecided(make_monitor, tmp_path):
    """A wait on the state dict of the step (which its full checkpoint commits for readers), a
    registration into it, blocking or queued: each is answered "undecided", never "failed"; the
    new job then commits the step, both kinds for readers. Found by helper-69's attack: these
    still said CheckpointSaveError."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    _checkpoint_2_left_undecided(coord, monitor, root, tmp_path, "the-next-job")
    _told_undecided(lambda: coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S))
    _told_undecided(lambda: coord.register(2, checkpoint_thread_count=1))
    coord.register(2, checkpoint_thread_count=1, wait=False)
    _told_undecided(coord.wait_all)
    # A save into it is refused (its unit fails alone), saying why: not "superseded", as if it had failed.
    with pytest.raises(ckptd.CheckpointSaveError, match="not saved: step 2's checkpoint commit is undecided"):
        coord.save_sync(lambda: write_file(f"{coord.step_dir(2)}/late.bin", b"late"), 2)
    coord.close()
    make_monitor(root, run="the-next-job")
    assert ckptd.latest_step(root) == 2 and ckptd.latest_step(root, "state_dict") == 2
    assert ckptd.verify(root, 2).step == 2


def test_wait_mirrored_on_an_undecided_step_says_undecided(make_monitor, tmp_path):
    """It said "not mirrored: step 2 failed", and the new job then committed step 2 (helper-70)."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, commit_retries=0, mirror=mirror)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    _checkpoint_2_left_undecided(coord, monitor, root, tmp_path, "the-next-job")
    with pytest.raises(ckptd.CheckpointError, match="not mirrored by this monitor: step 2's checkpoint commit is "
                                                    "undecided") as told:
        coord.wait_mirrored(2, timeout_s=DEADLINE_S)
    assert "failed" not in str(told.value), told.value
    coord.close()
    make_monitor(root, run="the-next-job", mirror=mirror)
    assert ckptd.latest_step(root) == 2


def test_a_step_left_undecided_under_a_losers_final_fence_commits_after_a_restart_and_was_never_told_failed(
        make_monitor, tmp_path):
    """A losing start's attempt stays until the fence is final (the old job is told step 2 is
    undecided), then is taken back; the job's monitor restarts, is the newest attempt again, and
    commits the visible step 2. Nothing before that told the job step 2 failed (helper-69)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    loser = _checkpoint_2_left_undecided(coord, monitor, root, tmp_path, "a-losing-start")
    _take_back(Storage(root), loser.attempt)
    _told_undecided(lambda: coord.register(2, checkpoint_thread_count=1))
    _told_undecided(lambda: coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S))
    restart_monitor(monitor, how="sigkill")
    coord.wait_committed(2, timeout_s=DEADLINE_S)
    coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    assert tracker_of(root, CKPT) == 2 and ckptd.verify(root, 2).step == 2
    coord.close()
