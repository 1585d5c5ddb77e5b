"""The node relay (``start_monitor(node_relay=True)``): coordinators' notifications go through one
actor per node, in batches, and a relay that dies mid-batch loses nothing and counts nothing twice."""

from __future__ import annotations

import os

import pytest
import ray
import torch

import ckptd
from ckptd.layout import MANIFESTS
from ckptd.manifest import Manifest

from .helpers import (
    Gate,
    actor_gone,
    assert_trackers_verified,
    in_thread,
    node_relay,
    status,
    wait_all,
    wait_for,
    write_step_file,
)

WORKERS, UNITS = 3, 2


def _writer(path: str):
    def save() -> list[str]:
        torch.save({"w": torch.ones(2)}, path)
        return [path]

    return save


def _save_step(coords: list[ckptd.CheckpointCoordinator], step: int) -> None:
    """Every coordinator saves UNITS files of ``step``; the step is registered first."""
    coords[0].register(step, checkpoint_thread_count=len(coords) * UNITS)
    out = coords[0].step_dir(step)
    os.makedirs(out, exist_ok=True)
    for coord in coords:
        for u in range(UNITS):
            coord.save_async(f"u{u}", _writer(os.path.join(out, f"{coord.worker_id}-{u}.pt")), step)


def _manifest_units(root: str, step: int) -> list[str]:
    with open(os.path.join(root, f"global_step_{step}", MANIFESTS[ckptd.Kind.CHECKPOINT])) as f:
        return sorted(Manifest.model_validate_json(f.read()).units)


def test_notifications_go_through_the_node_relay_and_its_answers_come_back(make_monitor, tmp_path, run_name):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    coords = [ckptd.CheckpointCoordinator(monitor, worker_id=f"w{i}") for i in range(WORKERS)]
    _save_step(coords, 1)
    for coord in coords:
        assert wait_all(coord) is None
    coords[0].wait_committed(1, timeout_s=60)
    assert len(_manifest_units(root, 1)) == WORKERS * UNITS
    # Every started and finished notification reached the monitor through the relay.
    assert ray.get(node_relay(run_name, coords[0]).stats.remote())["forwarded"] >= 2 * WORKERS * UNITS
    with pytest.raises(ValueError):  # no zone relays unless asked for
        node_relay(run_name, coords[0], "zone0")

    # The monitor's refusal comes back through the relay: step 1 is committed.
    coords[1].save_async("late", lambda: None, 1)
    error = wait_all(coords[1])
    assert error is not None and "already committed" in error
    for coord in coords:
        coord.close()


@pytest.mark.parametrize(("failpoint", "zones"), [("relay_before_forward", 0), ("relay_after_forward", 0),
                                                   ("relay_after_forward", 1)])
def test_a_relay_killed_mid_batch_loses_nothing_and_counts_nothing_twice(make_monitor, tmp_path, run_name,
                                                                         monkeypatch, failpoint, zones):
    """A relay process ends (os._exit, as a SIGKILL would) with a batch of notifications in hand:
    before forwarding it, or after the monitor applied it but before the answers went back. With
    a zone relay, the first relay to forward a batch's answers is the zone's: it is the one that
    dies. The coordinators send again through new relays; the step commits with every unit
    exactly once."""
    once = tmp_path / "once"
    monkeypatch.setenv("CKPTD_FAILPOINTS", f"{failpoint}=crash")  # reaches the relays it starts
    monkeypatch.setenv("CKPTD_FAILPOINTS_ONCE", str(once))
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True, relay_zones=zones)
    coords = [ckptd.CheckpointCoordinator(monitor, worker_id=f"w{i}") for i in range(WORKERS)]
    _save_step(coords, 1)
    for coord in coords:
        assert wait_all(coord) is None
    coords[0].wait_committed(1, timeout_s=60)
    assert (once / failpoint).exists(), "the relay never crashed: the test injected nothing"
    units = _manifest_units(root, 1)
    assert len(units) == len(set(units)) == WORKERS * UNITS
    assert {u.split("#")[0] for u in units} == {f"w{i}/u{u}" for i in range(WORKERS) for u in range(UNITS)}
    if failpoint == "relay_after_forward":
        # The monitor had applied the lost batch: what it received again was a retry, counted once.
        assert status(monitor).notifications > 2 * WORKERS * UNITS

    # The next step goes through the relay that replaced it.
    _save_step(coords, 2)
    for coord in coords:
        assert wait_all(coord) is None
    coords[0].wait_committed(2, timeout_s=60)
    assert len(_manifest_units(root, 2)) == WORKERS * UNITS
    if zones:  # step 2 went through the zone relay that replaced the dead one, not around it
        zone = ray.get(node_relay(run_name, coords[0], "zone0").stats.remote())
        assert zone["forwarded"] >= 2 * WORKERS * UNITS
        assert zone["pid"] != ray.get(node_relay(run_name, coords[0]).stats.remote())["pid"]
    for coord in coords:
        coord.close()


def test_zone_relays_need_node_relays(make_monitor):
    with pytest.raises(ckptd.CheckpointConfigError, match="relay_zones needs node_relay=True"):
        make_monitor(relay_zones=4)


def test_a_relay_never_carries_an_old_jobs_report_to_a_new_jobs_monitor(make_monitor, tmp_path, run_name):
    """Job 1's monitor is gone and job 2 starts one under the same run name, on the same root,
    while a coordinator of job 1 is still writing a unit of step 5 (its process outlived the job).
    Job 2 registers step 5 with two units and saves one. The old unit's report, sent through a
    node relay, must not count as job 2's second unit: the direct path refuses to re-attach to a
    monitor of another attempt, and a relay must not forward to one either."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=60.0)
    old.register(5, checkpoint_thread_count=1)
    gate = Gate(root, 5, "late.bin")
    old.save_async("late", gate, 5)
    assert gate.entered.wait(20)  # admitted by job 1's monitor, through the relay
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="job 1's monitor to be gone")
    monitor2 = make_monitor(root, node_relay=True)  # job 2: the same run name, a new attempt
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    assert new._attempt != old._attempt
    new.register(5, checkpoint_thread_count=2)
    new.save_sync(lambda: write_step_file(root, 5, "mine.bin"), 5)
    gate.open()
    error = wait_all(old)
    assert error is not None and f"attempt {old._attempt}" in error, error
    result = in_thread(lambda: new.wait_committed(5, timeout_s=3), 30)
    assert result[0] == "raised", result  # one of its two units: step 5 of job 2 must not commit
    new.save_sync(lambda: write_step_file(root, 5, "mine2.bin"), 5)
    new.wait_committed(5, timeout_s=30)
    saved_by = [u.split("#")[0] for u in _manifest_units(root, 5) if "#" in u]  # not the files outside units
    assert saved_by == ["w1/sync", "w1/sync"], saved_by
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 5
    new.close()
    old.close()
