"""A monitor that a newer job fenced out while it had nothing to publish: a job started on the
same root from another Ray cluster (which cannot see this monitor, so does not refuse or stop
it) opens the next attempt with ``open_attempt``, as its ``start_monitor`` does. The old monitor
must tell its callers within seconds, not leave an unbounded wait until ``step_timeout_s``, and
must not withdraw what it committed before; an attempt that a losing ``start_monitor`` takes
back at once must not fence it. Found by helpers' attacks (session 32)."""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd
from ckptd.layout import LEDGER_DIR, MANIFESTS, TRACKERS
from ckptd.monitor.attempts import open_attempt
from ckptd.monitor.fence_watch import FENCE_CHECK_S
from ckptd.storage import Storage

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    commit_one,
    held_at,
    in_thread,
    read_manifest,
    replace_same_size,
    restart_monitor,
    revoke_loops,
    tracker_of,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

DEADLINE_S = 60.0
CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def test_an_idle_monitor_fenced_out_by_a_job_on_another_cluster_fails_its_steps_within_seconds(
        make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)  # step_timeout_s: 3600
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.register(2, checkpoint_thread_count=1)
    # Begun before the fence: a wait on a step nobody registered, and one on the state dict of a
    # step registered for a full checkpoint only (whose commit would have committed it). Bounded,
    # so that where the fence does not end it, it fails the test rather than hang the session.
    early: list = []
    waiters = [threading.Thread(target=lambda w=w: early.append(in_thread(w, 2 * DEADLINE_S)), daemon=True)
               for w in (lambda: coord.wait_committed(4),
                         lambda: coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S))]
    for waiter in waiters:
        waiter.start()
    newer = open_attempt(Storage(root), "the-next-job", None)  # the new job, elsewhere
    outcome, error = in_thread(lambda: coord.wait_committed(2, timeout_s=None), 3 * FENCE_CHECK_S + 5)
    assert outcome == "raised", f"the wait was still waiting {3 * FENCE_CHECK_S + 5:g} s after the root was taken"
    assert isinstance(error, ckptd.CheckpointSaveError) and f"superseded by attempt {newer.attempt}" in str(error)
    assert ray.get(monitor.status.remote()).fenced is not None
    for waiter in waiters:
        waiter.join(2 * DEADLINE_S)
    after = [in_thread(lambda: coord.wait_committed(5), DEADLINE_S),
             in_thread(lambda: coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S), DEADLINE_S)]
    assert len(early) == 2
    for result in early + after:
        assert result[0] == "raised" and "superseded" in str(result[1]), result
    # Nothing of the old job was published over the new one's root, and a new save is refused.
    assert tracker_of(root, CKPT) == 1 and read_manifest(root, 2, CKPT) is None
    coord.register(3, checkpoint_thread_count=1)
    path = f"{coord.step_dir(3)}/model.bin"
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        coord.save_sync(lambda: write_file(path, os.urandom(64)), 3)
    assert read_manifest(root, 3, CKPT) is None and tracker_of(root, CKPT) == 1
    coord.close()


def test_a_committed_state_dict_stays_committed_for_the_old_job_when_the_new_job_rewrites_its_files(
        make_monitor, tmp_path):
    """The old job committed step 1's state dict, and its full checkpoint is still to come; the new
    job, which owns the root now, rewrites step 1's weights. The fenced old monitor fails the full
    checkpoint, but does not turn the state dict its callers were told was committed into a
    "withdrawn" one it cannot withdraw: the root is the new job's, whose monitor checks it."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=True)
    coord.register(1, checkpoint_thread_count=1)
    open_attempt(Storage(root), "the-next-job", None)
    replace_same_size(f"{coord.step_dir(1)}/model.bin")  # the new job's save of step 1
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        coord.wait_committed(1, timeout_s=None)  # the full checkpoint's failure: recorded, so settled
    coord.wait_committed(1, is_state_dict=True, timeout_s=DEADLINE_S)
    assert read_manifest(root, 1, SD) is not None and tracker_of(root, SD) == 1
    coord.close()


def _newer_attempt_seen(monitor):
    """The newer attempt's record that the monitor's last fence check found, as a dict."""
    return ray.get(monitor.__ray_call__.remote(
        lambda self: None if self._newer_attempt is None else self._newer_attempt.model_dump()))


def test_attempts_taken_back_by_losing_start_monitors_do_not_fence_the_live_monitor(make_monitor, tmp_path):
    """Two losing ``start_monitor`` calls one after the other, each attempt seen by one fence
    check and taken back before the next: the second reuses the first one's number, and still
    does not count as the same newer attempt seen twice."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.register(2, checkpoint_thread_count=1)
    storage = Storage(root)
    for i in range(2):
        loser = open_attempt(storage, f"a-racing-job-{i}", None)
        assert loser.attempt == 2
        wait_for(lambda loser=loser: _newer_attempt_seen(monitor) == loser.model_dump(), timeout_s=DEADLINE_S,
                 what=f"a fence check to find racing attempt {i}")
        storage.rm(storage.join(LEDGER_DIR, "attempts", f"{loser.attempt}.json"))  # as start_monitor's _undo does
    wait_for(lambda: _newer_attempt_seen(monitor) is None, timeout_s=DEADLINE_S,
             what="the next fence check to find no newer attempt")
    assert ray.get(monitor.status.remote()).fenced is None
    path = f"{coord.step_dir(2)}/model.bin"  # step 2, registered before the race, still commits
    coord.save_sync(lambda: write_file(path, os.urandom(64)), 2)
    coord.wait_committed(2, timeout_s=DEADLINE_S)
    assert tracker_of(root, CKPT) == 2
    coord.close()


def test_a_monitor_fenced_by_its_own_publish_ends_the_waits_on_steps_nobody_registered(make_monitor, tmp_path):
    """The new job's attempt appears and step 2's commit runs into it at once (the manifest's
    fence check), before two fence checks could see it: the monitor is fenced by that publish,
    and a wait on a step nobody registered must still end, once two checks saw the attempt (a
    look that found it gone would lift the fence, and the step could still commit)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    unregistered: list = []
    waiter = threading.Thread(target=lambda: unregistered.append(in_thread(lambda: coord.wait_committed(9),
                                                                             DEADLINE_S)), daemon=True)
    waiter.start()
    # The periodic looks are held, so that the commit's publish is what meets the new attempt
    # first (on a loaded machine two looks could otherwise come first, and the case be missed).
    looks = str(tmp_path / "looks")
    arm_in_monitor(monitor, "before_fence_look", f"until:{DEADLINE_S:g}:{looks}")
    open_attempt(Storage(root), "the-next-job", None)
    coord.register(2, checkpoint_thread_count=1)
    path = f"{coord.step_dir(2)}/model.bin"
    coord.save_async("model", lambda: write_file(path, os.urandom(64)), 2)
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        coord.wait_committed(2, timeout_s=DEADLINE_S)
    assert ray.get(monitor.__ray_call__.remote(lambda self: (self._fence_seen, self._fence_for_good))) == (1, False)
    assert not unregistered, "the wait on step 9 ended before any look saw the new attempt"
    arm_in_monitor(monitor, "before_fence_look", None)
    open(looks, "w").close()
    waiter.join(3 * FENCE_CHECK_S + 5)
    assert unregistered, f"the wait on step 9 was still waiting {3 * FENCE_CHECK_S:g} s after the fence"
    assert unregistered[0][0] == "raised" and "superseded" in str(unregistered[0][1]), unregistered
    assert read_manifest(root, 2, CKPT) is None and tracker_of(root, CKPT) == 1
    coord.close()


def test_a_state_dict_wait_on_a_checkpoint_only_step_is_answered_only_once_the_checkpoints_failure_is_recorded(
        make_monitor, tmp_path):
    """Step 2 is registered for a full checkpoint only; the monitor is fenced while the commit is
    held, so the commit fails. Until that failure is recorded, a monitor restarted in its place (the
    newer attempt taken back by a losing ``start_monitor``) would still commit the step, its state
    dict with it: the state-dict wait is answered no sooner than the checkpoint's own wait, then
    with the same "superseded". Found by a helper's attack (session 33)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    commit_gate, record_gate = str(tmp_path / "commit"), str(tmp_path / "record")
    arm_in_monitor(monitor, "before_manifest", f"until:{DEADLINE_S:g}:{commit_gate}")
    arm_in_monitor(monitor, "before_failure_record", f"until:{DEADLINE_S:g}:{record_gate}")
    coord.register(2, checkpoint_thread_count=1)
    path = f"{coord.step_dir(2)}/model.bin"
    coord.save_sync(lambda: write_file(path, os.urandom(64)), 2)
    wait_for(lambda: held_at(monitor, "before_manifest"), DEADLINE_S, "the commit held before its manifest")
    open_attempt(Storage(root), "the-next-job", None)
    wait_for(lambda: ray.get(monitor.status.remote()).fenced, DEADLINE_S, "the monitor fenced")
    early: list = []  # begun before the checkpoint failed: ends once the failure is recorded
    waiter = threading.Thread(target=lambda: early.append(in_thread(
        lambda: coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S), 2 * DEADLINE_S)), daemon=True)
    waiter.start()
    open(commit_gate, "w").close()
    wait_for(lambda: held_at(monitor, "before_failure_record"), DEADLINE_S, "the failure's record held")
    for sd in (True, False):  # failed, not yet recorded: both kinds' waits keep waiting
        outcome, error = in_thread(lambda sd=sd: coord.wait_committed(2, is_state_dict=sd, timeout_s=3), DEADLINE_S)
        assert outcome == "raised" and isinstance(error, TimeoutError), (sd, outcome, error)
    assert not early, early
    open(record_gate, "w").close()
    waiter.join(2 * DEADLINE_S)
    later = [in_thread(lambda sd=sd: coord.wait_committed(2, is_state_dict=sd, timeout_s=DEADLINE_S), DEADLINE_S)
             for sd in (True, False)]
    for outcome, error in early + later:
        assert outcome == "raised" and "superseded" in str(error), (outcome, error)
    assert read_manifest(root, 2, CKPT) is None and tracker_of(root, SD) == 1
    coord.close()


def _take_back(storage: Storage, attempt: int) -> None:
    """What a losing ``start_monitor`` does with the attempt it opened."""
    for suffix in ("json", "started"):
        path = storage.join(LEDGER_DIR, "attempts", f"{attempt}.{suffix}")
        if storage.exists(path):
            storage.rm(path)


def _looks_held(monitor, tmp_path):
    """Hold the monitor's periodic fence looks until the returned release is called: two looks
    that see a losing attempt make its fence final, and on a loaded machine they can come before
    a test takes the attempt back (seen in CI). What a test sets up then meets a fence that a
    look may still lift, whatever the machine's speed."""
    gate = str(tmp_path / "looks.gate")
    arm_in_monitor(monitor, "before_fence_look", f"until:{DEADLINE_S:g}:{gate}")

    def release() -> None:
        arm_in_monitor(monitor, "before_fence_look", None)
        open(gate, "w").close()

    return release


def _losing_attempt_at(monitor, failpoint: str, storage: Storage, tmp_path, reach) -> object:
    """Call ``reach``, which takes the monitor to ``failpoint``; hold it there while a losing
    ``start_monitor`` opens its attempt, then let it go on. The attempt."""
    gate = str(tmp_path / f"{failpoint}.gate")
    arm_in_monitor(monitor, failpoint, f"until:{DEADLINE_S:g}:{gate}")
    reach()
    wait_for(lambda: held_at(monitor, failpoint), DEADLINE_S, f"the monitor held at {failpoint}")
    loser = open_attempt(storage, "a-racing-job", None)
    arm_in_monitor(monitor, failpoint, None)
    open(gate, "w").close()
    return loser


def test_a_fence_that_a_commit_ran_into_is_lifted_once_the_losing_attempt_is_taken_back(make_monitor, tmp_path):
    """A losing ``start_monitor``'s attempt is on the root while step 2 commits: the commit is
    refused and the step fails (the contract's limit of that race). The attempt is taken back
    before two fence checks could see it, so the next check lifts the fence: step 3 commits, and a
    wait on it begun under the fence says so. It stayed fenced for good before, and that wait was
    told "superseded" (found by helpers' attacks, session 33)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    coord.register(2, checkpoint_thread_count=1)
    go = threading.Event()
    path = f"{coord.step_dir(2)}/model.bin"
    def save() -> None:
        go.wait(DEADLINE_S)
        write_file(path, os.urandom(64))

    coord.save_async("model", save, 2)
    release_looks = _looks_held(monitor, tmp_path)
    loser = open_attempt(storage, "a-racing-job", None)
    go.set()  # the step's last unit finishes: its commit runs into the racing attempt
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        coord.wait_committed(2, timeout_s=DEADLINE_S)
    # Not answered "superseded" under a fence that a look may lift: step 3 commits after all.
    waits: list = []
    waiter = threading.Thread(target=lambda: waits.append(in_thread(
        lambda: coord.wait_committed(3, timeout_s=DEADLINE_S), 2 * DEADLINE_S)), daemon=True)
    waiter.start()
    _take_back(storage, loser.attempt)
    assert "superseded" in ray.get(monitor.status.remote()).fenced
    release_looks()
    wait_for(lambda: ray.get(monitor.status.remote()).fenced is None, 3 * FENCE_CHECK_S + 5, "the fence lifted")
    commit_one(coord, 3, "model.bin", is_state_dict=False)
    waiter.join(2 * DEADLINE_S)
    assert waits == [("ok", None)], waits
    assert tracker_of(root, CKPT) == 3 and read_manifest(root, 2, CKPT) is None
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        coord.wait_committed(2, timeout_s=DEADLINE_S)  # what failed meanwhile stays failed
    coord.close()


@pytest.mark.parametrize("strategy", ["unrestricted", "single_thread"])
def test_a_unit_refused_under_a_fence_that_a_look_may_lift_fails_its_step(make_monitor, tmp_path, strategy):
    """Step 2's commit ran into a losing ``start_monitor``'s attempt: the monitor is fenced until a
    look lifts it. Step 3's unit is refused its start meanwhile (its writer slot too), so step 3 can
    never be complete: it fails at once, naming the fence, and stays failed after the lift. It
    was left pending until ``step_timeout_s`` (seen in CI, where retention ran into the attempt
    before a step's unit started)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy=strategy)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    release_looks = _looks_held(monitor, tmp_path)
    loser = open_attempt(storage, "a-racing-job", None)
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        commit_one(coord, 2, "model.bin", is_state_dict=False)
    assert "superseded" in ray.get(monitor.status.remote()).fenced
    written = threading.Event()
    coord.register(3, checkpoint_thread_count=1)
    coord.save_async("model", lambda: written.set(), 3)
    with pytest.raises(ckptd.CheckpointSaveError, match="not admitted: attempt 1 of this root was superseded"):
        coord.wait_committed(3, timeout_s=DEADLINE_S / 2)
    with pytest.raises(ckptd.CheckpointSaveError, match="not saved"):
        coord.wait_all()
    assert not written.is_set()
    _take_back(storage, loser.attempt)
    release_looks()
    wait_for(lambda: ray.get(monitor.status.remote()).fenced is None, 3 * FENCE_CHECK_S + 5, "the fence lifted")
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        coord.wait_committed(3, timeout_s=DEADLINE_S)  # what failed meanwhile stays failed
    commit_one(coord, 4, "model.bin", is_state_dict=False)
    assert tracker_of(root, CKPT) == 4
    coord.close()


@pytest.mark.parametrize("strategy", ["unrestricted", "single_process"])
def test_a_repeated_start_of_a_unit_admitted_before_the_fence_is_answered_as_before(make_monitor, tmp_path, strategy):
    """Step 3's unit was admitted and writes; then step 2's commit runs into a losing attempt, and a
    second copy of the unit's "started" (or, with a save strategy, its ``acquire_slot``) arrives
    under that fence (a relay delivering late after the coordinator went to the monitor directly;
    a retried call). It is answered as it was ("admitted", its slot "granted") and fails nothing:
    once the fence is lifted the unit's step commits. The first version of the
    refusal-fails-its-step change failed it, though its unit wrote (helper-78)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy=strategy)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    admitted, go = threading.Event(), threading.Event()
    coord.register(3, checkpoint_thread_count=1)
    path = f"{coord.step_dir(3)}/model.bin"

    def save() -> None:
        admitted.set()
        go.wait(DEADLINE_S)
        write_file(path, os.urandom(64))

    coord.save_async("model", save, 3)
    assert admitted.wait(DEADLINE_S)
    release_looks = _looks_held(monitor, tmp_path)
    loser = open_attempt(storage, "a-racing-job", None)
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        commit_one(coord, 2, "model.bin", is_state_dict=False)
    [unit] = ray.get(monitor.__ray_call__.remote(
        lambda self: [u.unit.to_dict() for u in self._ledger.get(3).units.values()]))
    if strategy == "unrestricted":
        assert ray.get(monitor.notify_batch.remote([("started", unit, None)])) == [{"admitted": True}]
    else:
        assert ray.get(monitor.acquire_slot.remote(unit, "node", "process")) == {"granted": True}
    assert ray.get(monitor.status.remote()).step(3).state.value == "pending"
    _take_back(storage, loser.attempt)
    release_looks()
    wait_for(lambda: ray.get(monitor.status.remote()).fenced is None, 3 * FENCE_CHECK_S + 5, "the fence lifted")
    go.set()
    coord.wait_committed(3, timeout_s=DEADLINE_S)
    coord.wait_all()
    assert tracker_of(root, CKPT) == 3
    coord.close()


def test_a_fence_that_retention_ran_into_is_lifted_once_the_losing_attempt_is_taken_back(make_monitor, tmp_path):
    """Retention (two checkpoints kept) is about to delete step 1 when a losing ``start_monitor``'s
    attempt appears: the deletion is refused, and retention stops. Once the attempt is taken back,
    the next fence check lifts that fence and retention runs again."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_ckpt_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    for step in (1, 2):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    release_looks = _looks_held(monitor, tmp_path)
    loser = _losing_attempt_at(monitor, "before_step_delete", storage, tmp_path,  # retention deletes step 1
                               lambda: commit_one(coord, 3, "model.bin", is_state_dict=False))
    wait_for(lambda: ray.get(monitor.status.remote()).fenced, DEADLINE_S, "retention fenced")
    _take_back(storage, loser.attempt)
    release_looks()
    assert os.path.isdir(coord.step_dir(1))
    wait_for(lambda: ray.get(monitor.status.remote()).fenced is None, 3 * FENCE_CHECK_S + 5, "the fence lifted")
    commit_one(coord, 4, "model.bin", is_state_dict=False)
    assert ray.get(monitor.wait_retention.remote(DEADLINE_S))
    assert [os.path.isdir(coord.step_dir(s)) for s in (1, 2, 3, 4)] == [False, False, True, True]
    assert tracker_of(root, CKPT) == 4
    coord.close()


def test_a_fence_that_the_mirrors_upload_ran_into_is_lifted_once_the_losing_attempt_is_taken_back(
        make_monitor, tmp_path):
    """Step 2's upload to the mirror checks the fence while a losing ``start_monitor``'s attempt
    is on the root: refused, and a wait says why. Once the attempt is taken back, the monitor's
    next look lifts the mirror's fence and step 2 goes up. The upload loop used to end for good."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror=mirror)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    release_looks = _looks_held(monitor, tmp_path)
    loser = _losing_attempt_at(monitor, "before_mirror_manifest", storage, tmp_path,
                               lambda: commit_one(coord, 2, "model.bin", is_state_dict=False))
    with pytest.raises(ckptd.CheckpointError, match=f"superseded by attempt {loser.attempt}"):
        coord.wait_mirrored(2, timeout_s=DEADLINE_S)
    assert "superseded" in ray.get(monitor.status.remote()).mirror.fenced
    _take_back(storage, loser.attempt)
    release_looks()
    wait_for(lambda: ray.get(monitor.status.remote()).mirror.fenced is None, 3 * FENCE_CHECK_S + 5,
             "the mirror's fence lifted")
    coord.wait_mirrored(2, timeout_s=DEADLINE_S)
    assert tracker_of(mirror, CKPT) == 2 and ray.get(monitor.status.remote()).fenced is None
    coord.close()


def test_a_mirror_write_retried_past_a_newer_jobs_start_does_not_publish(make_monitor, tmp_path):
    """Step 5's upload passes its fence check before its manifest, whose write the mirror then
    refuses for a while (retried). Meanwhile a newer job starts on the root and mirrors its own
    step 5 and 6. The retried manifest write, and the tracker write after it, checked the fence
    only once, before the first try: the old monitor replaced the newer job's manifest and moved
    the mirror's tracker back to 5. Each try checks it now. Found by a helper's attack (session 34)."""
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    monitor = make_monitor(root, mirror={"url": mirror, "retries": 200, "retry_backoff_s": 0.05})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 4, "model.bin", is_state_dict=False)
    coord.wait_mirrored(4, timeout_s=DEADLINE_S)
    held, refused = str(tmp_path / "held"), str(tmp_path / "refused")
    arm_in_monitor(monitor, "before_mirror_manifest", f"until:{DEADLINE_S:g}:{held}")
    commit_one(coord, 5, "model.bin", is_state_dict=False)
    wait_for(lambda: held_at(monitor, "before_mirror_manifest"), DEADLINE_S, "step 5's upload before its manifest")
    arm_in_monitor(monitor, "before_mirror_publish", f"raise_until:{refused}")
    arm_in_monitor(monitor, "before_mirror_manifest", None)
    tries = ray.get(monitor.__ray_call__.remote(lambda self: self._mirror._retried))
    open(held, "w").close()  # the fence check passes: no newer attempt yet
    wait_for(lambda: ray.get(monitor.__ray_call__.remote(lambda self: self._mirror._retried)) > tries, DEADLINE_S,
             "the manifest's write refused and retried")
    open_attempt(Storage(root), "the-next-job", None)
    newer = b"the newer job's manifest of its step 5"
    manifest = os.path.join(mirror, "global_step_5", MANIFESTS[CKPT])
    Storage(mirror).write_atomic(manifest, newer)
    Storage(mirror).write_atomic(os.path.join(mirror, TRACKERS[CKPT]), b"6\n")
    open(refused, "w").close()
    with pytest.raises(ckptd.CheckpointError, match="superseded"):
        coord.wait_mirrored(5, timeout_s=DEADLINE_S)
    assert "superseded" in ray.get(monitor.status.remote()).mirror.fenced
    with open(manifest, "rb") as f:
        assert f.read() == newer
    assert tracker_of(mirror, CKPT) == 6
    arm_in_monitor(monitor, "before_mirror_publish", None)
    coord.close()


def test_a_monitor_restarted_while_a_losing_attempt_is_on_the_root_is_not_fenced_for_good(make_monitor, tmp_path):
    """The monitor's process dies and Ray restarts it while a losing ``start_monitor``'s attempt
    is on the root: the restarted monitor finds itself fenced. Its first start did the start-up's
    work, so a look that finds the attempt gone lifts that fence, and step 2 commits. Found by a
    helper's attack (session 33)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    loser = open_attempt(storage, "a-racing-job", None)
    restart_monitor(monitor, how="sigkill")
    assert "superseded" in ray.get(monitor.status.remote()).fenced
    _take_back(storage, loser.attempt)
    wait_for(lambda: ray.get(monitor.status.remote()).fenced is None, 3 * FENCE_CHECK_S + 5, "the fence lifted")
    commit_one(coord, 2, "model.bin", is_state_dict=False)
    assert tracker_of(root, CKPT) == 2
    coord.close()


def _rewrite(weights: str):
    return write_file(weights, os.urandom(4096))  # what the unit wrote, for its report


def _state_dict_2_with_a_checkpoint_unit_held(coord, then) -> threading.Event:
    """Step 2 registered for both kinds; a unit of its full checkpoint admitted and held; its state
    dict (``weights.bin``) committed. Setting the event returned lets the unit go on with
    ``then(path of weights.bin)``."""
    weights = f"{coord.step_dir(2)}/weights.bin"
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    coord.register(2, checkpoint_thread_count=1)
    admitted, go = threading.Event(), threading.Event()

    def unit():
        admitted.set()
        go.wait(DEADLINE_S)
        return then(weights)

    coord.save_async("optimizer", unit, 2)
    assert admitted.wait(DEADLINE_S)
    coord.save_sync(lambda: _rewrite(weights), 2, is_state_dict=True)
    coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    return go


def test_a_state_dict_being_withdrawn_is_not_answered_committed(make_monitor, tmp_path):
    """The withdrawal of state dict 2 is held after its tracker went back to step 1, before its
    manifest goes: a wait on it does not answer "committed" meanwhile (it did, until the kind was
    failed after the manifest), and once the withdrawal ends it answers "withdrawn"."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    go = _state_dict_2_with_a_checkpoint_unit_held(coord, _rewrite)  # reported as a finished unit's file
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_revoke_rm", f"until:{DEADLINE_S:g}:{gate}")
    go.set()
    wait_for(lambda: held_at(monitor, "before_revoke_rm"), DEADLINE_S, "the withdrawal held")
    assert tracker_of(root, SD) == 1 and read_manifest(root, 2, SD) is not None
    with pytest.raises(TimeoutError, match="not committed within 1"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=1)
    arm_in_monitor(monitor, "before_revoke_rm", None)
    open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()  # the unit's report, refused
    assert read_manifest(root, 2, SD) is None
    assert_trackers_verified(root)
    coord.close()


def test_a_state_dict_whose_file_a_failing_checkpoint_replaced_under_a_lifted_fence_is_withdrawn(
        make_monitor, tmp_path):
    """Step 2's state dict is committed; its full checkpoint's unit still runs when a losing
    ``start_monitor``'s attempt fences the monitor (step 3's commit ran into it). The unit then
    replaces the state dict's file and fails. A fenced monitor leaves that check to the newer
    job; once the fence is lifted there is none, so it checks then, and withdraws state dict 2:
    the tracker goes back to step 1. Found by a helper's attack (session 33)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "weights.bin", is_state_dict=True)

    def replace_then_fail(weights: str) -> None:
        replace_same_size(weights)
        raise OSError("disk full after replacing weights.bin")

    go = _state_dict_2_with_a_checkpoint_unit_held(coord, replace_then_fail)
    release_looks = _looks_held(monitor, tmp_path)
    loser = open_attempt(storage, "a-racing-job", None)
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
    go.set()
    with pytest.raises(ckptd.CheckpointSaveError):  # step 3's, or the unit's (first)
        coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_committed(2, timeout_s=DEADLINE_S)
    _take_back(storage, loser.attempt)
    assert tracker_of(root, SD) == 2  # not checked while fenced
    release_looks()
    wait_for(lambda: tracker_of(root, SD) == 1, 3 * FENCE_CHECK_S + 5, "state dict 2 withdrawn after the lift")
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    assert_trackers_verified(root)
    coord.close()


def test_a_withdrawal_that_a_lifted_fence_refused_is_done_after_the_lift(make_monitor, tmp_path):
    """State dict 2 is committed; a unit of its full checkpoint finishes under a fence (step 3's
    commit ran into a losing ``start_monitor``'s attempt), reporting that it rewrote the state
    dict's file. The withdrawal is refused by the fence. Once the fence is lifted it is done: the
    manifest goes and the tracker goes back to step 1. Found by a helper's attack (session 33)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    go = _state_dict_2_with_a_checkpoint_unit_held(coord, _rewrite)  # reported as a finished unit's file
    release_looks = _looks_held(monitor, tmp_path)
    loser = open_attempt(storage, "a-racing-job", None)
    with pytest.raises(ckptd.CheckpointSaveError, match="superseded"):
        commit_one(coord, 3, "weights.bin", is_state_dict=True)
    go.set()
    with pytest.raises(ckptd.CheckpointSaveError):  # step 3's, or the unit's refused report (first)
        coord.wait_all()  # until the unit's report is answered
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=DEADLINE_S)
    assert read_manifest(root, 2, SD) is not None  # the withdrawal, refused by the fence
    _take_back(storage, loser.attempt)
    release_looks()
    # The manifest goes first, then the tracker: both, once the withdrawal is done.
    wait_for(lambda: read_manifest(root, 2, SD) is None and tracker_of(root, SD) == 1, 3 * FENCE_CHECK_S + 5,
             "the withdrawal done after the lift")
    assert_trackers_verified(root)
    coord.close()


def test_a_tracker_left_behind_is_repaired_once_a_restarted_monitors_fence_is_lifted(make_monitor, tmp_path):
    """The monitor dies between step 2's manifest and its tracker while a losing
    ``start_monitor``'s attempt is on the root: restarted, it is fenced, so it does not repair
    the tracker at start-up. Once the fence is lifted it does, before any other commit. Found by
    a helper's attack (session 33)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "after_publish", f"until:{DEADLINE_S:g}:{gate}")
    coord.register(2, checkpoint_thread_count=1)
    path = f"{coord.step_dir(2)}/model.bin"
    coord.save_async("model", lambda: write_file(path, os.urandom(64)), 2)
    wait_for(lambda: held_at(monitor, "after_publish"), DEADLINE_S, "the commit held after its manifest")
    assert read_manifest(root, 2, CKPT) is not None and tracker_of(root, CKPT) == 1
    loser = open_attempt(storage, "a-racing-job", None)
    restart_monitor(monitor, how="sigkill")
    _take_back(storage, loser.attempt)
    # The repair writes the checkpoint's tracker, then the state dict's (as a commit does), and
    # wait_committed does not wait for it (step 2 was committed all along): wait for both.
    wait_for(lambda: tracker_of(root, CKPT) == 2 and tracker_of(root, SD) == 2, 3 * FENCE_CHECK_S + 5,
             "the trackers repaired after the lift")
    coord.wait_committed(2, timeout_s=DEADLINE_S)
    assert ckptd.latest_step(root) == 2
    assert_trackers_verified(root)
    coord.close()


def _newer_seen_for_good(monitor):
    return ray.get(monitor.__ray_call__.remote(lambda self: self._fence_for_good))


def test_a_newer_job_that_stays_fences_for_good_though_losers_come_and_go_above_it(make_monitor, tmp_path):
    """A newer job's attempt stays on the root; a losing ``start_monitor``'s attempt above it is
    seen by one look and gone by the next. The two looks both saw the newer job's attempt: the
    fence is final, and a wait on a step nobody registered ends. Comparing only the newest record,
    a loser above it at every other look kept the fence provisional, and such waits waiting, for
    as long as losers came. Found by a helper's attack (session 33)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    newer = open_attempt(storage, "the-next-job", None)
    loser = open_attempt(storage, "a-racing-job", None)
    wait_for(lambda: _newer_attempt_seen(monitor) == loser.model_dump(), DEADLINE_S, "a look to find the loser")
    _take_back(storage, loser.attempt)
    wait_for(lambda: _newer_attempt_seen(monitor) == newer.model_dump(), DEADLINE_S, "the next look")
    assert _newer_seen_for_good(monitor)
    with pytest.raises(ckptd.CheckpointSaveError, match=f"superseded by attempt {newer.attempt}"):
        coord.wait_committed(9, timeout_s=DEADLINE_S)
    coord.close()


def test_a_withdrawal_checks_the_fence_after_finding_the_step_not_before(make_monitor, tmp_path):
    """A withdrawal of state dict 2 is under way (a unit reported rewriting its file) when a newer
    job opens its attempt and publishes its own step 2. The withdrawal looked for the step's
    directory after its fence check, so it removed the newer job's manifest; the check now comes
    after that lookup, just before the removal. Found by a helper's attack (session 33)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    go = _state_dict_2_with_a_checkpoint_unit_held(coord, _rewrite)
    manifest = os.path.join(coord.step_dir(2), MANIFESTS[SD])
    gate = str(tmp_path / "gate")
    arm_in_monitor(monitor, "before_revoke", f"until:{DEADLINE_S:g}:{gate}")
    go.set()
    wait_for(lambda: held_at(monitor, "before_revoke"), DEADLINE_S, "the withdrawal under way")
    open_attempt(Storage(root), "the-next-job", None)
    published = b"the newer job's manifest of its step 2"
    Storage(root).write_atomic(manifest, published)
    arm_in_monitor(monitor, "before_revoke", None)
    open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_all()
    wait_for(lambda: not revoke_loops(monitor, 2), DEADLINE_S, "the withdrawal to end")
    with open(manifest, "rb") as f:
        assert f.read() == published
    coord.close()


def test_a_withdrawal_fenced_halfway_leaves_the_tracker_on_a_committed_step(make_monitor, tmp_path):
    """State dict 2 is withdrawn (a unit reported rewriting its file) and a losing
    ``start_monitor``'s attempt appears halfway through. The withdrawal removed the manifest
    first, so the tracker was left naming step 2, without a manifest and with the replaced file,
    until the fence was lifted; it now points the tracker back first: cut short there, the tracker
    names step 1, which verifies, and step 2's manifest goes once the fence is lifted."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    storage = Storage(root)
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    go = _state_dict_2_with_a_checkpoint_unit_held(coord, _rewrite)
    assert tracker_of(root, SD) == 2
    loser = _losing_attempt_at(monitor, "before_revoke_rm", storage, tmp_path, go.set)
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_all()
    assert tracker_of(root, SD) == 1 and read_manifest(root, 2, SD) is not None
    assert_trackers_verified(root)
    _take_back(storage, loser.attempt)
    wait_for(lambda: read_manifest(root, 2, SD) is None, 3 * FENCE_CHECK_S + 5, "the withdrawal done after the lift")
    assert tracker_of(root, SD) == 1
    assert_trackers_verified(root)
    coord.close()
