"""Session 26c: attacks on 71b5522 (``UnitReports._admit`` writes the "started" receipt again
for every unit of a step older than the state-dict tracker; retention's ``counted_newest``;
a fenced retention refuses admissions).

One break (the test fails while it stands): a stale "started" report delivered after its unit
finished (a relay that answered too late, whose batch the coordinator also sent straight to the
monitor) makes ``_admit`` write the unit's "started" receipt over its "finished" one, for any
step older than the state-dict tracker; a restarted monitor then waits for a unit that ended.
Fixed: the receipt is written again only for a unit the ledger does not know, and never over
one that is there (``protocol.restore_started``); a refused unit's restored receipt is removed.

Real local Ray, real monitors, relays and coordinators, files under ``tmp_path``; failpoints are
armed in one actor's process only (``__ray_call__``); nothing mocked.
"""

from __future__ import annotations

import os
import threading

import pytest
import ray

import ckptd

from .helpers import (
    arm_in_monitor,
    commit_one,
    in_thread,
    ledger_states,
    node_relay,
    restart_monitor,
    unit_receipt,
    wait_all,
    wait_for,
    write_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")



def _unit_state(monitor, step: int, worker: str) -> str | None:
    """'running', 'finished' or 'failed': what the monitor's ledger holds of ``worker``'s unit."""
    def probe(self, step=step, worker=worker):
        rec = self._ledger.get(step)
        if rec is None:
            return None
        for u in rec.units.values():
            if u.unit.worker == worker:
                return "running" if u.running else ("failed" if u.failure is not None else "finished")
        return None
    return ray.get(monitor.__ray_call__.remote(probe))


def test_a_late_relayed_started_report_does_not_overwrite_the_finished_receipt(make_monitor, tmp_path, run_name):
    """State dicts 1 and 2 are committed (the tracker names 2). Step 1's full checkpoint is
    registered with 2 checkpoint units: B (worker "wb") is admitted and held; A (worker "w",
    notify_timeout_s=2) starts while the node relay is held before forwarding (its batch: A's
    "started"). A's coordinator gives up on the relay after 2 s and sends the report straight
    to the monitor (``MonitorClient.send_batch``: "the relay may still deliver them, and the
    monitor answers a repeated event as it answered the first"): A is admitted, writes, writes
    its "finished" receipt and reports it. The relay is then let go and delivers A's stale
    "started". Step 1 is older than the tracker, so ``_admit`` writes A's "started" receipt
    again, over its "finished" receipt (the ledger admits it again: a retry). A monitor that
    restarts now believes A is still writing: when B finishes, step 1 never commits (it waits
    for A until step_timeout_s, then fails)."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "relay_gate")
    monitor = make_monitor(root, node_relay=True, max_state_dict_to_keep=2, max_ckpt_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w", notify_timeout_s=2.0)
    other = ckptd.CheckpointCoordinator(monitor, worker_id="wb", notify_timeout_s=60.0)
    commit_one(other, 1, "weights.bin", is_state_dict=True)
    commit_one(other, 2, "weights.bin", is_state_dict=True)
    attempt = ray.get(monitor.ping.remote())["attempt"]
    d = coord.step_dir(1)
    other.register(1, checkpoint_thread_count=2)
    b_admitted, b_go = threading.Event(), threading.Event()

    def unit_b() -> list[str]:
        b_admitted.set()
        assert b_go.wait(60)
        return write_file(f"{d}/optim-b.bin", os.urandom(512))

    other.save_async("optim-b", unit_b, 1)
    try:
        assert b_admitted.wait(30)
        relay = node_relay(run_name, coord)
        forwarded = ray.get(relay.stats.remote())["forwarded"]
        arm_in_monitor(relay, "relay_before_forward", f"until:60:{gate}")  # the relay's process only
        try:
            coord.save_async("optim-a", lambda: write_file(f"{d}/optim-a.bin", os.urandom(512)), 1)
            # A goes around the held relay twice (started, finished): about 4 s.
            wait_for(lambda: _unit_state(monitor, 1, "w") == "finished", timeout_s=30,
                     what="unit A to be admitted and finished around the held relay")
            assert (unit_receipt(root, attempt, 1, "w") or {}).get("status") == "finished"
        finally:
            open(gate, "w").close()
        # The relay delivers what it held: A's "started" (then A's "finished", a retry).
        wait_for(lambda: ray.get(relay.stats.remote())["forwarded"] >= forwarded + 2, timeout_s=30,
                 what="the relay to deliver A's stale reports")
        assert in_thread(lambda: wait_all(coord), timeout_s=20)[0] == "ok"
        receipt = unit_receipt(root, attempt, 1, "w")
        known = _unit_state(monitor, 1, "w")
        restart_monitor(monitor)
        after_restart = _unit_state(monitor, 1, "w")
    finally:
        b_go.set()
    committed = in_thread(lambda: other.wait_committed(1, is_state_dict=False, timeout_s=10), timeout_s=25)
    states = ledger_states(monitor, 1)
    in_thread(lambda: wait_all(other), timeout_s=20)
    coord.close()
    other.close()
    assert receipt is not None and receipt["status"] == "finished" and committed == ("ok", None), (
        f"unit A of step 1 finished (the monitor knew: {known}), but a stale 'started' report the relay "
        f"delivered later made the monitor write its 'started' receipt over the 'finished' one: "
        f"{None if receipt is None else receipt['status']}; the restarted monitor thinks A is {after_restart}, "
        f"and step 1's full checkpoint did not commit once B finished: {committed}, ledger {states}")
