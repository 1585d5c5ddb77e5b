"""Commit-path invariants, attacked through this session's changes (issue 14: scale) with real Ray,
real files and real monitor restarts.

1. A tracker only ever names a step that ``ckptd.verify`` accepts.
2. A step reported failed never commits, also after a monitor restart.
3. Trinity's semantics: registrations add up per kind; a full checkpoint waits for its step's
   state-dict units, including those that arrive after the state dict committed.
4. Every notification counts once, whatever path it takes (shared notifier, node relay).

What changed and is attacked here: the ledger's per-step tallies (rebuilt by replaying receipts
after a restart), the per-process shared notifier, and the node relay.
"""

from __future__ import annotations

import os
import threading

import pytest
import ray
import torch

import ckptd
from ckptd.protocol import relay_name

from .helpers import assert_trackers_verified, read_manifest, restart_monitor, status, wait_for

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def _writer(path: str, value: float, gate: threading.Event | None = None, fail: bool = False):
    """A save function that writes one file (after ``gate`` opens) and names it, or raises."""

    def save() -> list[str]:
        if gate is not None:
            assert gate.wait(60), "the test never opened the gate"
        if fail:
            raise OSError(f"disk full writing {os.path.basename(path)}")
        torch.save({"w": torch.full((4,), value)}, path)
        return [path]

    return save


def _state(monitor, step: int, kind: ckptd.Kind = CKPT):
    return status(monitor).step(step, kind)


def test_tallies_rebuilt_mid_step_count_finished_running_and_failed_units(make_monitor, tmp_path):
    """A restart while a step has a finished unit, a running one and (step 2) a failed one: the
    rebuilt ledger must count exactly the units the receipts name. Step 1 then commits only once
    its third registered unit finishes (a rebuilt tally that lost or double-counted a unit would
    commit early or never); step 2 stays failed though its running unit finishes after the
    restart. Step 3 has two finished units where one was registered: held, not committed with
    either (Trinity's counters allow a later registration to add the count); after the restart
    one more registration commits it with both."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    gate = threading.Event()
    for step in (1, 2):
        os.makedirs(coord.step_dir(step))
        coord.register(step, checkpoint_thread_count=3)
        out = coord.step_dir(step)
        coord.save_sync(_writer(os.path.join(out, "a.pt"), 1.0), step)
        coord.save_async(f"b{step}", _writer(os.path.join(out, "b.pt"), 2.0, gate), step)
        wait_for(lambda s=step: len(_state(monitor, s).started) == 2, what=f"unit b of step {step} to be admitted")
    os.makedirs(coord.step_dir(3))
    coord.register(3, checkpoint_thread_count=1)
    both_started = threading.Event()  # else a3 may finish before b3 starts: 1 of 1 commits step 3
    for name in ("a", "b"):
        coord.save_async(f"{name}3", _writer(os.path.join(coord.step_dir(3), f"{name}.pt"), 4.0, both_started), 3)
    wait_for(lambda: len(_state(monitor, 3).started) == 2, what="both units of step 3 to be admitted")
    both_started.set()
    coord.save_async("c", _writer(os.path.join(coord.step_dir(2), "c.pt"), 3.0, fail=True), 2)
    wait_for(lambda: _state(monitor, 2).state == "failed", what="step 2 to fail")
    wait_for(lambda: len(_state(monitor, 3).finished) == 2, what="both units of step 3 to finish")

    restart_monitor(monitor)
    s1, s2 = _state(monitor, 1), _state(monitor, 2)
    assert (len(s1.started), len(s1.finished), s1.state) == (2, 1, "pending")
    assert (len(s2.started), len(s2.finished), len(s2.failed), s2.state) == (3, 1, 1, "failed")
    s3 = _state(monitor, 3)
    assert (len(s3.finished), s3.expected, s3.state) == (2, 1, "pending")
    coord.register(3, checkpoint_thread_count=1)
    coord.wait_committed(3, timeout_s=30)
    manifest = read_manifest(root, 3, CKPT)
    assert sorted(u.split("#")[0] for u in manifest.units) == ["w0/a3", "w0/b3"]
    assert sorted(os.path.basename(f.path) for f in manifest.files) == ["a.pt", "b.pt"]

    gate.set()
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_all()  # c of step 2 failed; b of both steps finished on the restarted monitor
    # Step 1: two of three registered units finished. Not committed.
    assert len(_state(monitor, 1).finished) == 2
    with pytest.raises(TimeoutError):
        coord.wait_committed(1, timeout_s=0)
    assert read_manifest(root, 1, CKPT) is None
    coord.save_sync(_writer(os.path.join(coord.step_dir(1), "c.pt"), 3.0), 1)
    coord.wait_committed(1, timeout_s=30)
    manifest = read_manifest(root, 1, CKPT)
    assert len(set(manifest.units)) == len(manifest.units) == 3
    assert sorted(os.path.basename(f.path) for f in manifest.files) == ["a.pt", "b.pt", "c.pt"]

    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_committed(2, timeout_s=30)
    coord.close()
    assert read_manifest(root, 2, CKPT) is None
    assert assert_trackers_verified(root) == {SD: 3, CKPT: 3}


def test_a_state_dict_unit_after_the_state_dict_commit_survives_a_restart(make_monitor, tmp_path):
    """Trinity's full checkpoint wraps the engine's state-dict save: the state dict of the step
    commits first, then the full checkpoint registers one more state-dict unit and one checkpoint
    unit. A restart while that late state-dict unit runs: the rebuilt ledger must tell the unit the
    state dict's manifest lists from the late one, so that the checkpoint commits once both
    finish, with every unit once (step 1), and fails if the late one fails (step 2), leaving
    the committed state dict of that step alone."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    gate = threading.Event()
    for step in (1, 2):
        out = coord.step_dir(step)
        os.makedirs(out)
        coord.register(step, is_state_dict=True, state_dict_thread_count=1)
        coord.save_sync(_writer(os.path.join(out, "model.pt"), 1.0), step, is_state_dict=True)
        coord.wait_committed(step, is_state_dict=True, timeout_s=30)
        coord.register(step, state_dict_thread_count=1, checkpoint_thread_count=1)
        coord.save_async(f"engine{step}", _writer(os.path.join(out, "engine.pt"), 2.0, gate, fail=step == 2), step,
                         is_state_dict=True)
        coord.save_sync(_writer(os.path.join(out, "optim.pt"), 3.0), step)
    wait_for(lambda: all(len(_state(monitor, s, SD).started) == 2 for s in (1, 2)),
             what="the late state-dict units to be admitted")

    restart_monitor(monitor)
    with pytest.raises(TimeoutError):  # the late state-dict unit is still running
        coord.wait_committed(1, timeout_s=0)
    gate.set()
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_all()
    coord.wait_committed(1, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_committed(2, timeout_s=30)
    coord.close()

    ckpt = read_manifest(root, 1, CKPT)
    assert len(set(ckpt.units)) == len(ckpt.units) == 3 and "w0/engine1" in {u.split("#")[0] for u in ckpt.units}
    assert sorted(os.path.basename(f.path) for f in ckpt.files) == ["engine.pt", "model.pt", "optim.pt"]
    for step in (1, 2):
        sd = read_manifest(root, step, SD)
        assert len(sd.units) == 1 and [os.path.basename(f.path) for f in sd.files] == ["model.pt"]
    assert read_manifest(root, 2, CKPT) is None
    # Step 2's state dict committed after step 1's checkpoint: the state-dict tracker names it.
    assert assert_trackers_verified(root) == {SD: 2, CKPT: 1}


def test_coordinators_sharing_a_notifier_through_a_relay_survive_a_close_and_a_restart(make_monitor, tmp_path,
                                                                                      run_name):
    """Coordinators of one process share one notifier per monitor, whose sends go through the
    first coordinator's client. That coordinator closes; the monitor is killed (Ray restarts it)
    and the node relay is killed with it while a unit is still writing; a coordinator created
    before and one created during the restart save one step together through a new relay: it
    commits with each unit once. A report retried through the relay after the commit is
    acknowledged (the manifest lists it), and a unit that starts then is refused."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    first = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    os.makedirs(first.step_dir(1))
    first.register(1, checkpoint_thread_count=1)
    first.save_sync(_writer(os.path.join(first.step_dir(1), "w0.pt"), 1.0), 1)
    first.wait_committed(1, timeout_s=30)
    before = ckptd.CheckpointCoordinator(monitor, worker_id="w1")
    out = first.step_dir(2)
    os.makedirs(out)
    first.register(2, checkpoint_thread_count=4)
    first.close()
    gate = threading.Event()
    before.save_async("u0", _writer(os.path.join(out, "w1-0.pt"), 0.0, gate), 2)
    wait_for(lambda: len(_state(monitor, 2).started) == 1, what="w1/u0 to be admitted")
    name = relay_name(run_name, first._attempt_id, ray.get_runtime_context().get_node_id())
    relay_pid = ray.get(ray.get_actor(name).stats.remote())["pid"]
    monitor_pid = ray.get(monitor.ping.remote())["pid"]

    ray.kill(monitor, no_restart=False)
    ray.kill(ray.get_actor(name), no_restart=True)
    after = ckptd.CheckpointCoordinator(monitor, worker_id="w2")
    gate.set()
    before.save_async("u1", _writer(os.path.join(out, "w1-1.pt"), 1.0), 2)
    for u in range(2):
        after.save_async(f"u{u}", _writer(os.path.join(out, f"w2-{u}.pt"), float(u)), 2)
    for coord in (before, after):
        coord.wait_all()
    # One notifier in this process carried both coordinators' notifications.
    assert before._client._notifier is after._client._notifier
    after.wait_committed(2, timeout_s=30)
    assert ray.get(monitor.ping.remote())["pid"] != monitor_pid
    assert ray.get(ray.get_actor(name).stats.remote())["pid"] != relay_pid  # a new relay carried them
    units = read_manifest(root, 2, CKPT).units
    assert sorted(u.split("#")[0] for u in units) == ["w1/u0", "w1/u1", "w2/u0", "w2/u1"]

    relay = ray.get_actor(name)
    key = sorted(units)[0]
    worker_name, call = key.split("#")
    worker, name = worker_name.split("/")
    unit = {"worker": worker, "name": name, "step": 2, "kind": "checkpoint", "call": call}
    files = [f.model_dump() for f in read_manifest(root, 2, CKPT).files if f.path == f"{worker}-{name}.pt"]
    late = {**unit, "name": "late", "call": call + "x"}
    answers = ray.get(relay.relay.remote([("finished", unit, {"files": files, "found": False}),
                                          ("started", late, None)]), timeout=60)
    assert answers[0] is None
    assert "already committed" in answers[1]["refused"]
    for coord in (before, after):
        coord.close()
    assert read_manifest(root, 2, CKPT).units == units
    assert assert_trackers_verified(root) == {SD: 2, CKPT: 2}


def test_an_unreadable_notification_fails_only_itself_in_a_relayed_batch(make_monitor, tmp_path, run_name):
    """A relay merges the notifications of every coordinator of its node into one monitor call.
    One the monitor cannot read (a newer coordinator's unit kind, a file entry with a field it
    does not know) used to raise out of the whole call after the events before it were applied:
    every coordinator in the batch was told its notification failed, some of which had counted
    (a save reported failed to its caller, and committed), and the events after it were lost.
    Now it is refused alone, and the rest of its batch applies; an unreadable report of a unit's
    end fails that unit's step at once."""
    from ckptd.coordinator.relay import start_relay
    from ckptd.manifest import crc32_file
    from ckptd.storage import Storage

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2, 3):
        coord.register(step, checkpoint_thread_count=1)
    node = ray.get_runtime_context().get_node_id()
    relay = start_relay(run_name, None, coord._attempt_id, monitor, node, 30.0, None, node)

    good = {"worker": "w9", "name": "u", "step": 1, "kind": "checkpoint", "call": "c1"}
    newer = {**good, "call": "c2", "kind": "optimizer_state"}
    second, third = {**good, "step": 2, "call": "c3"}, {**good, "step": 3, "call": "c4"}
    answers = ray.get(relay.relay.remote([("started", good, None), ("started", newer, None),
                                          ("started", second, None), ("started", third, None)]), timeout=60)
    assert answers[0] == answers[2] == answers[3] == {"admitted": True}
    assert "cannot read" in answers[1]["refused"]

    os.makedirs(coord.step_dir(1))
    path = os.path.join(coord.step_dir(1), "u.pt")
    _writer(path, 1.0)()
    size, crc = crc32_file(Storage(root), path)
    entry = {"path": "u.pt", "size": size, "crc32": crc, "mtime_ns": os.stat(path).st_mtime_ns}
    answers = ray.get(relay.relay.remote([("finished", second, {"files": [{**entry, "digest": "x"}]}),
                                          ("finished", good, {"files": [entry], "found": False}),
                                          ("failed", third, {"unit": "w9/u", "bogus": 1})]), timeout=60)
    assert "cannot read" in answers[0]["refused"] and answers[1:] == [None, None]
    coord.wait_committed(1, timeout_s=30)  # the report after the unreadable one counted
    for step in (2, 3):
        with pytest.raises(ckptd.CheckpointSaveError, match="UnreadableReport"):
            coord.wait_committed(step, timeout_s=30)
    coord.close()
    assert [u.split("#")[0] for u in read_manifest(root, 1, CKPT).units] == ["w9/u"]
    assert read_manifest(root, 2, CKPT) is None and read_manifest(root, 3, CKPT) is None
    assert assert_trackers_verified(root) == {SD: 1, CKPT: 1}

def test_a_monitor_killed_while_a_relay_holds_a_batch_counts_it_once(make_monitor, tmp_path, run_name, monkeypatch):
    """The relay holds a batch (failpoint relay_before_forward=delay) while the monitor is killed
    and restarted: the relay forwards it to the restarted monitor, which rebuilt its ledger
    from storage, and the step commits with each unit once."""
    once = tmp_path / "once"
    monkeypatch.setenv("CKPTD_FAILPOINTS", "relay_before_forward=delay:1.5")  # reaches the relays it starts
    monkeypatch.setenv("CKPTD_FAILPOINTS_ONCE", str(once))
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    monitor_pid = ray.get(monitor.ping.remote())["pid"]
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(1)
    os.makedirs(out)
    coord.register(1, checkpoint_thread_count=2)
    for u in range(2):
        coord.save_async(f"u{u}", _writer(os.path.join(out, f"u{u}.pt"), float(u)), 1)
    wait_for(lambda: (once / "relay_before_forward").exists(), what="the relay to hold a batch")
    ray.kill(monitor, no_restart=False)
    coord.wait_all()
    coord.wait_committed(1, timeout_s=60)
    coord.close()
    assert ray.get(monitor.ping.remote())["pid"] != monitor_pid
    assert sorted(u.split("#")[0] for u in read_manifest(root, 1, CKPT).units) == ["w0/u0", "w0/u1"]
    assert assert_trackers_verified(root) == {SD: 1, CKPT: 1}
