"""A withdrawal of a state dict that a newer job's attempt fences out before its tracker moves
(held at ``before_revoke``): the fenced monitor may not touch the root any more, so the newer
job's start-up finishes it. Found by a helper's attack (session 36)."""

from __future__ import annotations

import os

import pytest
import ray

import ckptd
from ckptd import protocol
from ckptd.layout import step_failure_path
from ckptd.monitor.attempts import open_attempt
from ckptd.storage import Storage

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    held_at,
    read_manifest,
    revoke_loops,
    start_new_job,
    tracker_of,
    wait_for,
    write_file,
)
from .test_fenced_idle_monitor import DEADLINE_S, SD, _rewrite, _state_dict_2_with_a_checkpoint_unit_held

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_withdrawal_fenced_before_its_tracker_moved_is_finished_by_the_new_jobs_start_up(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    go = _state_dict_2_with_a_checkpoint_unit_held(coord, _rewrite)  # its file rewritten, then reported
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_revoke", f"until:{DEADLINE_S:g}:{gate}")
    go.set()
    wait_for(lambda: held_at(monitor, "before_revoke"), DEADLINE_S, "the withdrawal held before its tracker moved")
    assert tracker_of(root, SD) == 2  # names a step whose file changed: the window the withdrawal closes
    assert ckptd.latest_step(root, "state_dict") == 1  # ckptd's readers: its failure is recorded
    assert ckptd.verify(root, kind="state_dict").step == 1
    # The newer job, from another Ray cluster (which cannot see the old monitor): its attempt fences
    # the old monitor; its start_monitor (here, one that finds that attempt newest and not live here)
    # starts the monitor whose start-up cleans the root up.
    open_attempt(Storage(root), "the-next-job", None)
    # Until the new job's start-up has withdrawn it, the old attempt's failure record still counts
    # for readers (it counted only for the newest attempt: from here, the new job's).
    assert ckptd.latest_step(root, "state_dict") == 1
    make_monitor(root, run="the-next-job")
    assert read_manifest(root, 2, SD) is None
    assert tracker_of(root, SD) == 1
    assert_trackers_verified(root)
    arm_in_monitor(monitor, "before_revoke", None)
    open(gate, "w").close()  # the old monitor's withdrawal goes on, fenced
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    assert tracker_of(root, SD) == 1
    assert_trackers_verified(root)
    coord.close()


def test_readers_never_see_a_state_dict_being_withdrawn_when_no_older_one_is_committed(make_monitor, tmp_path):
    """Nothing older to point the tracker back at: the withdrawal removes the tracker, then the
    manifest. In between (held at ``before_revoke_rm``), a reader that finds no tracker falls back
    to the manifests, where the withdrawn state dict's still is; its failure, recorded first, rules
    it out (it was the newest state dict there, helper-62's break D)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    go = _state_dict_2_with_a_checkpoint_unit_held(coord, _rewrite)
    assert ckptd.latest_step(root, "state_dict") == 2
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_revoke_rm", f"until:{DEADLINE_S:g}:{gate}")
    go.set()
    wait_for(lambda: held_at(monitor, "before_revoke_rm"), DEADLINE_S, "the withdrawal held before its manifest went")
    assert tracker_of(root, SD) is None and read_manifest(root, 2, SD) is not None  # the window
    assert ckptd.latest_step(root, "state_dict") is None
    with pytest.raises(ckptd.CheckpointError, match="no committed"):
        ckptd.verify(root, kind="state_dict")
    arm_in_monitor(monitor, "before_revoke_rm", None)
    open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    assert read_manifest(root, 2, SD) is None and ckptd.latest_step(root, "state_dict") is None
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    coord.close()


def test_an_older_jobs_failure_record_does_not_hide_a_step_the_new_job_committed(make_monitor, tmp_path):
    """A fenced monitor of an older job may still record its own failure of a step (its records are
    its attempt's) after the newer job's start-up discarded them, and the newer job may commit that
    step number: readers count only the newest attempt's failure records."""
    root = str(tmp_path / "ckpt")
    old = make_monitor(root)
    old_coord = ckptd.CheckpointCoordinator(old, worker_id="w0")
    commit_one(old_coord, 1, "weights.bin", is_state_dict=True)
    old_coord.close()
    new = make_monitor(root, run="the-next-job", takeover=True)  # fences the old monitor
    coord = ckptd.CheckpointCoordinator(new, worker_id="w0")
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    # What the old job's fenced monitor records when it fails its own step 2, as it does.
    protocol.write_step_failure(Storage(root), 1, 2, SD, "superseded by attempt 2")
    assert ckptd.latest_step(root, "state_dict") == 2 and ckptd.verify(root, kind="state_dict").step == 2
    # The same record of the newest attempt's: a withdrawal of step 2 under way.
    protocol.write_step_failure(Storage(root), 2, 2, SD, "withdrawn")
    assert ckptd.latest_step(root, "state_dict") == 1
    coord.close()


@pytest.mark.parametrize("changed", [1, 2], ids=["an older step", "the newest step"])
def test_a_new_job_leaves_a_state_dict_changed_outside_ckptd_as_it_is(make_monitor, tmp_path, changed):
    """State dicts 1 and 2 are committed, every save of them done, no full checkpoint registered;
    the job ends and a file of one of them is changed outside ckptd. The new job's start-up took
    the old job's records of the step for a save still under way into it: it withdrew the state
    dict and deleted the step, files the change had not touched with it (helper-83). The step stays
    as it is: the newest one, which the trackers name, refuses the start, naming the file; an
    older one is left for its loaders to refuse."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2):
        commit_one(coord, step, "weights.bin", is_state_dict=True)
    coord.close()
    weights = f"{coord.step_dir(changed)}/weights.bin"
    write_file(weights, os.urandom(os.path.getsize(weights)))
    if changed == 2:
        with pytest.raises(ckptd.CorruptCheckpointError, match="committed step 2 .*weights.bin"):
            make_monitor(root, run="the-next-job", takeover=True)
    else:
        make_monitor(root, run="the-next-job", takeover=True)
        assert tracker_of(root, SD) == 2
        assert_trackers_verified(root)
    assert read_manifest(root, changed, SD) is not None and os.path.exists(weights)
    with pytest.raises(ckptd.CorruptCheckpointError, match="weights.bin"):
        ckptd.verify(root, step=changed, kind="state_dict")


def test_an_older_attempts_leftover_records_do_not_make_a_newer_jobs_state_dict_in_flight(make_monitor, tmp_path):
    """The first job registered step 2's state dict and started a unit of it, and died; the second
    job's start-up was cut short before it discarded those records, and the second job saved and
    committed step 2's state dict itself (then 3). A file of step 2 is then changed outside
    ckptd. The third job's start-up took the first job's records for a save still under way into
    step 2 (they name a registration and a unit its manifest does not count), and withdrew it and
    deleted the step. The step stays as it is, for its loaders to refuse (helper-84)."""
    root = str(tmp_path / "ckpt")
    first = make_monitor(root)
    first_attempt = ray.get(first.ping.remote())["attempt"]
    second = make_monitor(root, run="the-second-job", takeover=True)
    coord = ckptd.CheckpointCoordinator(second, worker_id="w0")
    for step in (2, 3):
        commit_one(coord, step, "weights.bin", is_state_dict=True)
    coord.close()
    storage = Storage(root)
    protocol.write_registration(storage, first_attempt, protocol.Registration(
        reg_id="first-job-2", step=2, counts={SD: 1}, monitored=SD, at=0.0))
    protocol.write_started(storage, first_attempt, protocol.UnitId(
        worker="w0", name="weights", step=2, kind=SD, call="first-job-w0-1"))
    weights = f"{coord.step_dir(2)}/weights.bin"
    write_file(weights, os.urandom(os.path.getsize(weights)))
    make_monitor(root, run="the-third-job", takeover=True)
    assert tracker_of(root, SD) == 3
    assert_trackers_verified(root)
    assert read_manifest(root, 2, SD) is not None and os.path.exists(weights)
    with pytest.raises(ckptd.CorruptCheckpointError, match="weights.bin"):
        ckptd.verify(root, step=2, kind="state_dict")


def test_a_new_job_keeps_a_state_dict_the_old_job_withdrew_withdrawn_though_its_bytes_are_back(
        make_monitor, tmp_path):
    """The old job withdraws state dict 1 (a unit of its full checkpoint replaced its file; the
    worker is told it is withdrawn, and readers pass over it by its failure record), but storage
    refuses the manifest's removal until the job ends. Then the file gets its old bytes back (a
    retry, a restore). The new job's start-up removed the manifest only when a listed file had
    changed: it discarded the old job's records, the failure with them, and counted state dict 1
    committed again, the tracker with it. Found by helper-88's attack."""
    root = str(tmp_path / "ckpt")
    old = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(old, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    weights = f"{coord.step_dir(1)}/weights.bin"
    before = open(weights, "rb").read()
    coord.register(1, checkpoint_thread_count=1)
    arm_in_monitor(old, "before_revoke", f"raise_until:{tmp_path / 'never'}")
    coord.save_async("optimizer-1", lambda: write_file(weights, os.urandom(len(before))), 1)
    wait_for(lambda: any(revoke_loops(old, 1)), DEADLINE_S, "state dict 1's withdrawal refused, retried")
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_all()
    assert ckptd.latest_step(root, "state_dict") is None
    coord.close()
    write_file(weights, before)
    new = start_new_job(make_monitor, root, old)
    assert read_manifest(root, 1, SD) is None and tracker_of(root, SD) is None
    assert ckptd.latest_step(root, "state_dict") is None
    answer = ray.get(new.wait_committed.remote(1, "state_dict", 1))
    assert not answer["committed"], answer


def test_a_late_failure_record_of_an_old_attempt_does_not_withdraw_a_state_dict_a_newer_job_kept(
        make_monitor, tmp_path):
    """The old job's withdrawal of state dict 1 (a unit replaced its file) is held before its
    failure record; the file gets its bytes back, and a new job starts: its start-up keeps state
    dict 1 (its files are as listed) and discards the old attempt's records. The old monitor,
    fenced, goes on and writes its record. ckptd's readers and the new job ignore it (records
    count from the newest attempt that finished its start-up), but a third job's start-up took
    it for a withdrawal cut short and removed the manifest of a state dict that verified. Found by
    helper-92's attack (session 46)."""
    root = str(tmp_path / "ckpt")
    old = make_monitor(root)
    old_attempt = ray.get(old.ping.remote())["attempt"]
    coord = ckptd.CheckpointCoordinator(old, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    weights = f"{coord.step_dir(1)}/weights.bin"
    kept = open(weights, "rb").read()
    gate = str(tmp_path / "gate")
    arm_in_monitor(old, "before_failure_record", f"until:{DEADLINE_S:g}:{gate}")
    coord.register(1, checkpoint_thread_count=1)
    coord.save_async("optimizer-1", lambda: write_file(weights, os.urandom(len(kept))), 1)
    wait_for(lambda: held_at(old, "before_failure_record"), DEADLINE_S, "the withdrawal held before its record")
    write_file(weights, kept)
    open_attempt(Storage(root), "the-next-job", None)  # fences the old monitor, which keeps running
    new = make_monitor(root, run="the-next-job")
    assert read_manifest(root, 1, SD) is not None and tracker_of(root, SD) == 1
    new_coord = ckptd.CheckpointCoordinator(new, worker_id="w1")
    new_coord.wait_committed(1, is_state_dict=True, timeout_s=DEADLINE_S)
    arm_in_monitor(old, "before_failure_record", None)
    open(gate, "w").close()
    storage = Storage(root)
    late = step_failure_path(storage, old_attempt, 1, SD)
    wait_for(lambda: storage.exists(late), DEADLINE_S, "the old attempt's late failure record")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()
    coord.close()
    assert ckptd.latest_step(root, "state_dict") == 1
    new_coord.wait_committed(1, is_state_dict=True, timeout_s=DEADLINE_S)
    new_coord.close()
    make_monitor(root, run="the-third-job", takeover=True)
    assert read_manifest(root, 1, SD) is not None, "a state dict the second job counted committed was withdrawn"
    assert ckptd.latest_step(root, "state_dict") == 1
    assert_trackers_verified(root)
