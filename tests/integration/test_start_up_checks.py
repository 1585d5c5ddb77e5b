"""What a monitor's start reads, and what readers see while a new job starts: found by a helper's
attack on session 38's changes (damaged manifests refused at start, readers honouring recorded
failures). A refused start changes nothing, not even the live monitor a takeover would stop; a
Ray restart of a running job's monitor does not end the run over one damaged step; and a state
dict withdrawn by an older attempt stays out of the readers' answers until the new job's
start-up has removed its manifest."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import ray

import ckptd
from ckptd.layout import TRACKERS
from ckptd.monitor.attempts import open_attempt
from ckptd.storage import Storage

from .helpers import (
    Gate,
    actor_gone,
    arm_in_monitor,
    commit_one,
    failpoint_env,
    held_at,
    in_thread,
    ledger_records,
    read_manifest,
    restart_monitor,
    save_one,
    tracker_of,
    wait_for,
    write_file,
)
from .test_fenced_idle_monitor import DEADLINE_S, _rewrite, _state_dict_2_with_a_checkpoint_unit_held

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def test_a_refused_takeover_leaves_the_live_monitor_running(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    write_file(f"{root}/global_step_2/ckptd_manifest.json", b"{damaged")
    with pytest.raises(ckptd.CorruptCheckpointError, match="global_step_2/ckptd_manifest.json"):
        make_monitor(root, run="the-next-job", takeover=True)
    # It was refused after the takeover had stopped the live monitor, and the run could not go on.
    commit_one(coord, 3, "model.bin", is_state_dict=False)
    assert tracker_of(root, CKPT) == 3
    coord.close()


def test_a_takeover_refused_by_an_unwritable_mirror_leaves_the_live_monitor_running(make_monitor, tmp_path):
    """Every check that can refuse before the new attempt opens runs before the takeover stops the
    live monitor: the mirror's write check ran after it (helper-67)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    write_file(str(tmp_path / "a-file"), b"x")
    with pytest.raises(ckptd.CheckpointConfigError, match="mirror"):
        make_monitor(root, run="the-next-job", takeover=True, mirror=str(tmp_path / "a-file" / "mirror"))
    outcome, error = in_thread(lambda: commit_one(coord, 2, "model.bin", is_state_dict=False), DEADLINE_S)
    assert outcome == "ok", error
    assert tracker_of(root, CKPT) == 2
    coord.close()


def test_a_restart_never_moves_a_tracker_onto_a_step_it_found_damaged(make_monitor, tmp_path):
    """Checkpoint 2's manifest is published, its tracker not yet (the monitor held before the
    rename); the manifest is damaged and the monitor restarted: its repair of the tracker left
    behind moved it onto step 2, which every loader refuses (helper-67)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    arm_in_monitor(monitor, "before_tracker_rename", f"until:{DEADLINE_S:g}:{tmp_path / 'gate'}")
    save_one(coord, 2, "model.bin", is_state_dict=False)
    wait_for(lambda: held_at(monitor, "before_tracker_rename"), DEADLINE_S, "the commit held before its tracker")
    assert read_manifest(root, 2, CKPT) is not None and tracker_of(root, CKPT) == 1
    write_file(f"{root}/global_step_2/ckptd_manifest.json", b"{damaged")
    restart_monitor(monitor)
    assert tracker_of(root, CKPT) == 1 and ckptd.verify(root).step == 1
    commit_one(coord, 3, "model.bin", is_state_dict=False)  # the run goes on past it
    assert tracker_of(root, CKPT) == 3
    coord.close()


def test_a_restart_leaves_a_state_dict_tracker_that_names_a_full_checkpoint_as_it_is(make_monitor, tmp_path):
    """A full checkpoint holds the weights too, so its commit moves the state-dict tracker onto it.
    A restart's repair took that tracker for one naming an uncommitted step and rewrote it on every
    start (the same step, but a write a fenced or read-only start must not need)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    assert (tracker_of(root, CKPT), tracker_of(root, SD)) == (1, 1)
    before = {kind: os.stat(os.path.join(root, TRACKERS[kind])) for kind in (CKPT, SD)}
    restart_monitor(monitor)
    for kind, st in before.items():
        now = os.stat(os.path.join(root, TRACKERS[kind]))
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), f"the {kind.value} tracker was rewritten"
    commit_one(coord, 2, "model.bin", is_state_dict=False)
    assert (tracker_of(root, CKPT), tracker_of(root, SD)) == (2, 2)
    coord.close()


def test_every_manifest_of_the_step_a_tracker_will_name_is_read_at_start(make_monitor, tmp_path):
    """A step saved as a state dict, then as a full checkpoint (Trinity's save_state_dict, then
    save_checkpoint) has both manifests, and its loaders read both: a damaged state-dict manifest
    there was not looked at, and the checkpoint tracker named a step that resume refuses."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 2, "weights.bin", is_state_dict=True)
    commit_one(coord, 2, "optim.bin", is_state_dict=False)
    commit_one(coord, 3, "weights.bin", is_state_dict=True)
    coord.close()
    ray.kill(monitor, no_restart=True)
    write_file(f"{root}/global_step_2/ckptd_state_dict_manifest.json", b"{damaged")
    with pytest.raises(ckptd.CorruptCheckpointError, match="global_step_2/ckptd_state_dict_manifest.json"):
        make_monitor(root, run="the-next-job")


def test_a_restart_of_a_running_jobs_monitor_goes_on_past_a_damaged_manifest(make_monitor, tmp_path, caplog):
    """start_monitor refuses a damaged manifest, with the job's owner there to act; a Ray restart of
    the monitor mid-run instead logs it and goes on (it died in its start-up, for good, and every
    later save of the run failed)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)  # a state dict only: read at start-up
    commit_one(coord, 2, "model.bin", is_state_dict=False)
    write_file(f"{root}/global_step_1/ckptd_state_dict_manifest.json", b"{damaged")
    restart_monitor(monitor)
    with pytest.raises(ckptd.CorruptCheckpointError, match="global_step_1"):
        ckptd.verify(root, 1)
    # A full checkpoint of that step fails, naming the manifest (was a bare pydantic error).
    coord.register(1, checkpoint_thread_count=1)
    coord.save_async("optim", lambda: write_file(f"{coord.step_dir(1)}/optim.bin", b"o"), 1)
    with pytest.raises(ckptd.CheckpointSaveError, match="global_step_1/ckptd_state_dict_manifest.json: not a valid"):
        coord.wait_committed(1, timeout_s=DEADLINE_S)  # reported here: wait_all and close do not again
    outcome, error = in_thread(lambda: commit_one(coord, 3, "model.bin", is_state_dict=False), DEADLINE_S)
    assert outcome == "ok", error
    assert tracker_of(root, CKPT) == 3 and ckptd.verify(root).step == 3
    coord.close()


def test_a_state_dict_an_older_attempt_withdraws_stays_out_of_reach_while_the_new_job_starts(
        make_monitor, tmp_path):
    """The old monitor's withdrawal of state dict 2 is held before its tracker moves; the new job's
    start-up is held after it removed that manifest, before it discards the old attempt's records.
    At each point, the readers answer step 1: the old attempt's failure record counts until the new
    job's monitor has finished its start-up (it counted only for the newest attempt, which is the
    new job's from the moment it is opened), and the start-up removes the manifest before the
    record (it removed the records first)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    go = _state_dict_2_with_a_checkpoint_unit_held(coord, _rewrite)
    gate, start_gate = str(tmp_path / "gate"), str(tmp_path / "start-gate")
    arm_in_monitor(monitor, "before_revoke", f"until:{DEADLINE_S:g}:{gate}")
    go.set()
    wait_for(lambda: held_at(monitor, "before_revoke"), DEADLINE_S, "the withdrawal held before its tracker moved")
    assert tracker_of(root, SD) == 2 and ckptd.latest_step(root, "state_dict") == 1
    # The new job, from another Ray cluster (which cannot see the old monitor): its attempt fences the
    # old monitor; then the monitor of the next start_monitor (which finds that attempt newest and
    # not live here) does the start-up.
    open_attempt(Storage(root), "the-next-job", None)
    assert ckptd.latest_step(root, "state_dict") == 1
    env = failpoint_env(f"before_discarding_older_records=until:{DEADLINE_S:g}:{start_gate}")
    started: list = []
    starting = threading.Thread(target=lambda: started.append(
        make_monitor(root, run="the-next-job", runtime_env=env)), daemon=True)
    starting.start()
    try:
        wait_for(lambda: read_manifest(root, 2, SD) is None, DEADLINE_S, "the new job's start-up to withdraw it")
        assert ledger_records(root, 2)  # the old attempt's, still there: the hold
        assert tracker_of(root, SD) == 2  # repaired only later in the start-up
        assert ckptd.latest_step(root, "state_dict") == 1 and ckptd.verify(root, kind="state_dict").step == 1
    finally:
        open(start_gate, "w").close()
        starting.join(DEADLINE_S)
    assert started, "the new job's monitor did not start"
    assert tracker_of(root, SD) == 1 and ckptd.latest_step(root, "state_dict") == 1
    arm_in_monitor(monitor, "before_revoke", None)
    open(gate, "w").close()
    with pytest.raises(ckptd.CheckpointError):
        coord.wait_all()
    assert tracker_of(root, SD) == 1 and os.path.exists(f"{root}/global_step_1/weights.bin")


@pytest.mark.parametrize("in_flight", ["a registration", "a held commit"])
def test_the_old_jobs_wait_ends_with_a_checkpoint_error_once_a_takeover_killed_its_monitor(
        make_monitor, tmp_path, in_flight):
    """A newer job's ``start_monitor(takeover=True)`` kills the old job's monitor for good. The
    old job's ``wait_committed`` used to retry a dead actor until notify_timeout_s plus its own
    timeout, then raise Ray's bare ActorDiedError (helper-68's B3): it is now told at once, by
    a CheckpointError that says the monitor is gone and what to do."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=20.0)
    commit_one(coord, 1, "model.bin", is_state_dict=False)
    gate = str(tmp_path / "gate")
    if in_flight == "a held commit":
        arm_in_monitor(monitor, "before_manifest", f"until:{DEADLINE_S:g}:{gate}")
        save_one(coord, 2, "model.bin", False)
        wait_for(lambda: held_at(monitor, "before_manifest"), DEADLINE_S, "step 2's commit held")
    else:
        coord.register(2, checkpoint_thread_count=1)
    try:
        make_monitor(root, run="the-next-job", takeover=True)
        told = in_thread(lambda: coord.wait_committed(2, timeout_s=10), DEADLINE_S)
    finally:
        open(gate, "w").close()
    assert told[0] == "raised" and type(told[1]) is ckptd.CheckpointError, told
    said = str(told[1])
    assert "is dead and Ray does not restart it" in said and "attempt 2 of the root (run 'the-next-job')" in said, said
    assert ckptd.latest_step(root) == 1
    coord.close()


@pytest.mark.parametrize("zones", [None, 0, 1], ids=["direct", "node relay", "zone relay"])
def test_a_save_through_a_relay_fails_at_once_once_a_takeover_killed_the_monitor(make_monitor, tmp_path, zones):
    """Through a node relay (and a zone relay behind it), a save that finished after a newer
    job's takeover killed the monitor used to wait out the relay's retries, then the
    coordinator's own (about twice notify_timeout_s, helper-69's I4): the relay did not know the
    root, so it could not see the newer attempt there. It now fails as fast as a direct save
    does, with the CheckpointError that names the newer attempt."""
    root = str(tmp_path / "ckpt")
    relays = {} if zones is None else {"node_relay": True, "relay_zones": zones}
    monitor = make_monitor(root, **relays)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=30.0)
    commit_one(coord, 1, "model.bin", is_state_dict=False)  # the relays are up
    gate = Gate(root, 2, "model.bin")
    coord.register(2, checkpoint_thread_count=1)
    coord.save_async("model", gate, 2)
    assert gate.entered.wait(DEADLINE_S)  # admitted: only its "finished" is left to send
    make_monitor(root, run="the-next-job", takeover=True)
    gate.open()
    told = in_thread(coord.wait_all, 20.0)
    assert told[0] == "raised", told  # 'hung': still retrying the dead monitor through the relay
    assert type(told[1]) is ckptd.CheckpointSaveError, told
    said = str(told[1])
    assert f"(attempt 1 of root {root!r}) is dead" in said, said
    assert "attempt 2 of the root (run 'the-next-job')" in said, said
    assert ckptd.latest_step(root) == 1
    coord.close()


def _finish_a_save_after_the_monitor_died_for_good(monitor, coord, root: str) -> None:
    """A save of step 2 admitted, then its monitor killed for good (gone for callers), then the
    save's file written: only its "finished" report is left to send, to a monitor that is gone."""
    coord.register(2, checkpoint_thread_count=1)
    gate = Gate(root, 2, "model.bin")
    coord.save_async("model", gate, 2)
    assert gate.entered.wait(DEADLINE_S)
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), DEADLINE_S, "the monitor gone")
    gate.open()


@pytest.mark.parametrize("zones", [0, 1], ids=["node relay", "zone relay"])
def test_a_relay_started_with_a_shorter_timeout_does_not_cut_a_coordinators_wait_short(make_monitor, tmp_path,
                                                                                       zones):
    """A relay retries a dead monitor for the notify_timeout_s of the coordinator that started
    it; another coordinator of the node, with a longer one, sends its batch again until its own
    runs out. With no newer attempt on the root, a monitor killed for good may yet be replaced by
    a new job under the run's name, and that coordinator is then told it belongs to another job
    (by its monitor, or by its attempt on the root, whichever it sees first).
    The first version of the relay's root watch raised the relay's give-up (Ray's wrapped
    ActorDiedError) at once instead (helper-72)."""
    root = str(tmp_path / "ckpt")
    relays = {"node_relay": True, "relay_zones": zones}
    monitor = make_monitor(root, **relays)
    short = ckptd.CheckpointCoordinator(monitor, worker_id="short", notify_timeout_s=0.3)
    short._client._relay.handle()  # it starts the node's relay: its timeout is the relay's
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=60.0)
    _finish_a_save_after_the_monitor_died_for_good(monitor, coord, root)
    told: list = []
    waiting = threading.Thread(target=lambda: told.append(in_thread(coord.wait_all, DEADLINE_S)), daemon=True)
    waiting.start()
    waiting.join(3.0)  # ten times the relay's own timeout
    assert not told, told  # the wait goes on: a new job may start under the run's name
    make_monitor(root, **relays)  # it does
    waiting.join(DEADLINE_S)
    assert told and told[0][0] == "raised" and type(told[0][1]) is ckptd.CheckpointSaveError, told
    said = "\n".join([str(told[0][1]), *getattr(told[0][1], "__notes__", [])])
    # Either check may see the new job first: its monitor under the run's name, or its attempt on the root.
    assert ("was started again" in said or "has opened since" in said) and "ray::" not in said, said
    short.close()
    coord.close()


@pytest.mark.parametrize("relays", [{}, {"node_relay": True}], ids=["direct", "node relay"])
def test_calls_to_a_monitor_dead_for_good_and_never_replaced_end_with_a_timeout_that_says_so(make_monitor, tmp_path,
                                                                                             relays):
    """With no newer attempt and no new job under the run's name, a monitor killed for good is
    retried for notify_timeout_s (a new job may yet start). Then every call used to end in Ray's
    raw ActorDiedError, or, for ``register_and_monitor``, whose last retry had no time left, a
    CheckpointTimeoutError saying the monitor was "alive but not answering" (helper-73). Each now
    ends with the CheckpointTimeoutError the API documents, saying the monitor is dead and was
    not started again."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, **relays)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=1.0)
    _finish_a_save_after_the_monitor_died_for_good(monitor, coord, root)
    calls = {"register": lambda: coord.register(3, checkpoint_thread_count=1),
             "register_and_monitor": lambda: asyncio.run(coord.register_and_monitor(3, checkpoint_thread_count=1)),
             "wait_committed": lambda: coord.wait_committed(2, timeout_s=1.0),
             "the save": coord.wait_all}
    for what, call in calls.items():
        told = in_thread(call, DEADLINE_S)
        assert told[0] == "raised", (what, told)
        error = told[1].__cause__ if what == "the save" else told[1]
        assert type(error) is ckptd.CheckpointTimeoutError, (what, told)
        assert "is dead and Ray does not restart it" in str(error), (what, str(error))
        assert "no monitor was started again under its run's name" in str(error), (what, str(error))
    coord.close()
