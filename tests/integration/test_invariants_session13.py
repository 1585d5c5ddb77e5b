"""Commit-path invariants, attacked through this session's changes (real Ray, real files).

1. A tracker only ever names a step that ``ckptd.verify`` accepts.
2. A step reported failed never commits: not after a retried report on a restarted monitor,
   not after a new job (a new attempt) on the same root.
3. Trinity's semantics: registrations add up per kind, and a full checkpoint of a step waits
   for that step's state-dict saves too.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

import ckptd
from ckptd.layout import MANIFESTS
from ckptd.manifest import Manifest

from .helpers import assert_trackers_verified


def _restart(monitor) -> None:
    before = ray.get(monitor.ping.remote(), timeout=60)["pid"]
    ray.kill(monitor, no_restart=False)  # Ray restarts it; it rebuilds its ledger from storage
    deadline = time.monotonic() + 60
    while ray.get(monitor.ping.remote(), timeout=60)["pid"] == before:  # until the restarted one answers
        assert time.monotonic() < deadline, "the monitor did not restart"


def _units_of(manifest_path: str, kind: str) -> list[tuple[dict, dict]]:
    """(unit, "finished" report) of every unit a committed manifest lists, as a worker sends them."""
    with open(manifest_path) as f:
        manifest = Manifest.model_validate_json(f.read())
    out = []
    for key in manifest.units:
        worker_name, call = key.split("#")
        worker, name = worker_name.split("/")
        unit = {"worker": worker, "name": name, "step": manifest.step, "kind": kind, "call": call}
        out.append((unit, {"files": [f.model_dump() for f in manifest.files], "found": False}))
    return out


def _save(path: str, value: float) -> None:
    torch.save({"w": torch.full((4,), value)}, path)


def test_failed_checkpoint_beside_a_committed_state_dict_stays_failed(make_monitor, tmp_path, run_name):
    """Attack on ``_counted_in_manifest`` (it reads every kind's manifest): the state dict of step 1
    commits, its full checkpoint fails; retried reports of the state-dict unit (listed in the state
    dict's manifest) after a monitor restart, and a new job on the root, must not commit it.
    Step 3 fails by timeout (one of two registered units finished): its late unit is refused
    after the restart, and the step stays failed."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, step_timeout_s=3)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    # Step 3 first, so that its timeout runs while step 1 is saved.
    out3 = coord.step_dir(3)
    os.makedirs(out3)
    coord.register(3, checkpoint_thread_count=2)
    coord.save_sync(lambda: _save(os.path.join(out3, "a.pt"), 1.0), 3)
    out = coord.step_dir(1)
    os.makedirs(out)
    coord.register(1, is_state_dict=True, state_dict_thread_count=1)
    coord.register(1, checkpoint_thread_count=1)
    coord.save_async("model", lambda: _save(os.path.join(out, "model.pt"), 1.0), 1, is_state_dict=True)
    coord.wait_committed(1, is_state_dict=True, timeout_s=30)

    def broken() -> None:
        raise OSError("disk full")

    coord.save_async("optim", broken, 1)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    coord.close()
    assert assert_trackers_verified(root) == {ckptd.Kind.STATE_DICT: 1, ckptd.Kind.CHECKPOINT: None}

    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    with pytest.raises(ckptd.CheckpointSaveError, match="timed out"):  # the step timeout failed it
        coord.wait_committed(3, timeout_s=60)
    coord.close()

    sd_units = _units_of(os.path.join(out, MANIFESTS[ckptd.Kind.STATE_DICT]), "state_dict")
    assert len(sd_units) == 1
    _restart(monitor)
    for unit, report in sd_units:
        # The retried state-dict report (and the same unit retried as a checkpoint unit) is answered,
        # but nothing it does may complete the failed full checkpoint.
        ray.get(monitor.notify_batch.remote([("finished", unit, report)]), timeout=60)
        ray.get(monitor.notify_batch.remote([("finished", {**unit, "kind": "checkpoint"}, report)]), timeout=60)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError):  # the timed-out step's missing unit, late
        coord.save_sync(lambda: _save(os.path.join(out3, "b.pt"), 2.0), 3)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, timeout_s=30)
    coord.close()
    assert not os.path.exists(os.path.join(out3, MANIFESTS[ckptd.Kind.CHECKPOINT]))
    assert not os.path.exists(os.path.join(out, MANIFESTS[ckptd.Kind.CHECKPOINT]))
    assert assert_trackers_verified(root) == {ckptd.Kind.STATE_DICT: 1, ckptd.Kind.CHECKPOINT: None}

    # A new job on the same root: its monitor knows nothing of step 1's checkpoint being pending.
    ray.kill(monitor, no_restart=True)
    monitor2 = make_monitor(root, run=run_name + "-job2")
    for unit, report in sd_units:
        ray.get(monitor2.notify_batch.remote([("finished", {**unit, "kind": "checkpoint"}, report)]), timeout=60)
    coord2 = ckptd.CheckpointCoordinator(monitor2, worker_id="w0")
    for step in (1, 3):
        with pytest.raises((ckptd.CheckpointError, TimeoutError)):
            coord2.wait_committed(step, timeout_s=0)
    coord2.close()
    assert not os.path.exists(os.path.join(out, MANIFESTS[ckptd.Kind.CHECKPOINT]))
    assert not os.path.exists(os.path.join(out3, MANIFESTS[ckptd.Kind.CHECKPOINT]))
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] is None


def test_registrations_add_up_and_a_checkpoint_waits_for_its_state_dict(make_monitor, tmp_path):
    """Trinity's counters: two register calls of one unit each expect two units; the full
    checkpoint of a step is not committed before that step's state-dict unit finishes."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(2)
    os.makedirs(out)
    coord.register(2, checkpoint_thread_count=1)
    coord.register(2, checkpoint_thread_count=1)
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    coord.save_sync(lambda: _save(os.path.join(out, "a.pt"), 1.0), 2)
    coord.save_sync(lambda: _save(os.path.join(out, "b.pt"), 2.0), 2)
    # Both registered checkpoint units finished, but the state dict of the step has not.
    with pytest.raises(TimeoutError):
        coord.wait_committed(2, timeout_s=0)
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] is None
    coord.save_sync(lambda: _save(os.path.join(out, "sd.pt"), 3.0), 2, is_state_dict=True)
    coord.wait_committed(2, timeout_s=30)
    coord.close()
    with open(os.path.join(out, MANIFESTS[ckptd.Kind.CHECKPOINT])) as f:
        manifest = Manifest.model_validate_json(f.read())
    assert {os.path.basename(f.path) for f in manifest.files} == {"a.pt", "b.pt", "sd.pt"}
    assert len(manifest.units) == 3
    assert assert_trackers_verified(root) == {ckptd.Kind.STATE_DICT: 2, ckptd.Kind.CHECKPOINT: 2}


def test_a_retried_report_is_acknowledged_only_as_the_manifest_lists_it(make_monitor, tmp_path):
    """Attack on ``_counted_in_manifest`` after a restart (the ledger holds no units of the
    committed step): a report naming a listed unit but a file no manifest lists, and a report checked
    against a damaged manifest, are refused, and the rest of their batch still applies."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(1)
    os.makedirs(out)
    coord.register(1, checkpoint_thread_count=1)
    coord.save_sync(lambda: _save(os.path.join(out, "model.pt"), 1.0), 1)
    coord.wait_committed(1, timeout_s=30)
    coord.close()
    manifest_path = os.path.join(out, MANIFESTS[ckptd.Kind.CHECKPOINT])
    ((unit, report),) = _units_of(manifest_path, "checkpoint")
    _restart(monitor)

    # The same report, retried: acknowledged (test_retried_reports covers this; here it is the control).
    assert ray.get(monitor.notify_batch.remote([("finished", unit, report)]), timeout=60) == [None]
    # The same unit with a file the manifest does not list: not the report the commit counted.
    (entry,) = report["files"]
    extra = {"files": [entry, {**entry, "path": entry["path"] + ".extra"}], "found": False}
    (answer,) = ray.get(monitor.notify_batch.remote([("finished", unit, extra)]), timeout=60)
    assert "finished after the step was committed" in answer["refused"]
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 1

    # A damaged manifest cannot vouch for a report; the report is refused, not the whole batch.
    with open(manifest_path, "w") as f:
        f.write("not json")
    next_unit = {**unit, "step": 2, "call": unit["call"] + "n"}
    answers = ray.get(monitor.notify_batch.remote([("finished", unit, report), ("started", next_unit, None)]),
                      timeout=60)
    assert "finished after the step was committed" in answers[0]["refused"]
    assert answers[1] == {"admitted": True}
