"""A helper's attack on relays that belong to one attempt (session 18, commit e4b19ba).

Node and zone relays (``start_monitor(node_relay=True, relay_zones=N)``) are named by attempt, get
the coordinator's monitor handle and bind their client to the attempt: when job 1's monitor is
gone and job 2 starts one under the same run name, job 1's relays refuse to re-attach to it and
job 1's coordinators are told (a CheckpointError naming both attempts). A Ray restart of the same
monitor keeps the attempt, and relays keep working across it.

Each test writes its invariant in its docstring. They use a real local Ray, real files, real
monitors and relays; the orders are forced with gates, failpoints armed in a relay's own process
(``__ray_call__``) or through the environment it inherits, and polls of observable state.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import threading

import pytest
import ray

import ckptd
from ckptd.config import Kind
from ckptd.coordinator.relay import zone_of
from ckptd.protocol import relay_name

from .helpers import (
    Gate,
    actor_gone,
    arm_in_monitor,
    assert_not_committed,
    assert_trackers_verified,
    in_thread,
    read_manifest,
    restart_monitor,
    start_new_job,
    status,
    wait_all,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT = Kind.CHECKPOINT

ROUTES = {
    "direct": {},
    "node": {"node_relay": True},
    "zone1": {"node_relay": True, "relay_zones": 1},
    "zone2": {"node_relay": True, "relay_zones": 2},
}

#: How long an old job's call may take before it counts as hung (its notify_timeout_s is 30 s).
BOUND_S = 90


# -- helpers --------------------------------------------------------------------------------------


def _node() -> str:
    return ray.get_runtime_context().get_node_id()


def _relay_names(run: str, attempt: str, opts: dict) -> list[str]:
    """The relays a coordinator of ``attempt`` on this node sends through (node relay first)."""
    if not opts.get("node_relay"):
        return []
    names = [relay_name(run, attempt, _node())]
    zones = int(opts.get("relay_zones") or 0)
    if zones:
        names.append(relay_name(run, attempt, f"zone{zone_of(_node(), zones)}"))
    return names


def _stats(name: str) -> dict:
    return ray.get(ray.get_actor(name).stats.remote(), timeout=30)


def _exists(name: str) -> bool:
    try:
        ray.get_actor(name)
        return True
    except ValueError:
        return False


def _names_both(text: str, old, new) -> bool:
    """The error names the old coordinator's attempt and the new job's."""
    return (re.search(rf"attempt {old._attempt}\b", text) is not None
            and re.search(rf"attempt {new._attempt}\b", text) is not None)


def _assert_clear_error(result, old, new, kind=ckptd.CheckpointError) -> None:
    """An in_thread result: it raised ``kind`` naming both attempts (not hung, not RayActorError)."""
    assert result[0] == "raised", f"expected a CheckpointError, got {result}"
    assert isinstance(result[1], kind), repr(result[1])
    assert _names_both(str(result[1]), old, new), str(result[1])


def _units(root: str, step: int) -> list[str]:
    """Who saved the committed checkpoint of ``step`` ("worker/name"), one entry per unit."""
    m = read_manifest(root, step, CKPT)
    assert m is not None, f"step {step} has no checkpoint manifest"
    return sorted(u.split("#")[0] for u in m.units if "#" in u)


def _old_job_writing(monitor, root: str, timeout_s: float) -> tuple[ckptd.CheckpointCoordinator, Gate]:
    """Job 1's coordinator w0 with a unit of step 5 admitted and held before it writes (open the gate)."""
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=timeout_s)
    old.register(5, checkpoint_thread_count=1)
    gate = Gate(root, 5, "late.bin")
    old.save_async("late", gate, 5)
    assert gate.entered.wait(30)  # admitted by job 1's monitor (through its relays, if any)
    return old, gate


def _commits_with_its_own_second_unit_only(new, root: str, step: int) -> None:
    """Job 2's ``step``, registered with two units and one saved: not committed (no unit of job 1
    stood for the second); with its own second unit it commits, listing job 2's units only."""
    assert_not_committed(new, step)
    new.save_sync(lambda: write_step_file(root, step, "mine2.bin"), step)
    new.wait_committed(step, timeout_s=30)
    assert _units(root, step) == ["w1/sync", "w1/sync"]


def _finished_receipt(root: str, attempt: int, step: int) -> bool:
    for path in glob.glob(os.path.join(root, ".ckptd", "pending", str(attempt), str(step), "unit-*.json")):
        try:
            with open(path) as f:
                if json.load(f)["status"] == "finished":
                    return True
        except (OSError, ValueError):
            pass
    return False


def _forwarding(name: str) -> bool:
    """The relay has a batch in hand that it is forwarding upstream (its call has not returned)."""
    def busy(self):
        drainer = self._core._sender._drainer
        return drainer is not None and not drainer.done()
    return ray.get(ray.get_actor(name).__ray_call__.remote(busy), timeout=30)


class _Returning(Gate):
    """A Gate that also says when its file was written (its unit goes on to its receipt)."""

    def __init__(self, root: str, step: int, name: str) -> None:
        super().__init__(root, step, name)
        self.wrote = threading.Event()

    def __call__(self) -> list[str]:
        paths = super().__call__()
        self.wrote.set()
        return paths


# -- 1. a late unit of job 1, through every route --------------------------------------------------


@pytest.mark.parametrize("route", list(ROUTES))
def test_an_old_jobs_late_unit_and_calls_never_count_in_the_new_job(make_monitor, tmp_path, run_name, route):
    """Invariants 1, 3, 4: a unit of job 1 admitted by job 1's monitor, still writing when job 2
    starts under the same run name on the same root, reports its end through its route (direct,
    node relay, node + zone relay) after job 2's monitor exists. It must not count as job 2's
    unit of the same step: job 2's step (two units registered, one saved) stays uncommitted until
    its own second unit, and its manifest lists job 2's units only. Job 1's coordinator learns it
    promptly: wait_all, register (blocking and wait=False), register_and_monitor, wait_committed
    and a new save_async raise a CheckpointError naming both attempts, close returns; its
    wait=False registration of step 6 never counts in job 2's step 6. Job 1's relays, still alive
    (their owner, this process, lives), carry nothing of job 2: their forwarded counts do not
    move, and job 2's coordinators go through relays of their own attempt, in other processes."""
    opts = ROUTES[route]
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, **opts)
    old, gate = _old_job_writing(monitor, root, 30.0)
    old_relays = _relay_names(run_name, old._attempt_id, opts)
    before = {name: _stats(name) for name in old_relays}

    monitor2 = start_new_job(make_monitor, root, monitor, **opts)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", notify_timeout_s=30.0)
    assert new._attempt == old._attempt + 1
    new.register(5, checkpoint_thread_count=2)
    new.save_sync(lambda: write_step_file(root, 5, "mine.bin"), 5)
    gate.open()
    result = in_thread(lambda: wait_all(old), BOUND_S)
    assert result[0] == "ok", result
    assert result[1] is not None and _names_both(result[1], old, new), result
    assert_not_committed(new, 5)  # the old unit did not stand for job 2's second one

    # Every other call of job 1's coordinator fails clearly, and soon.
    _assert_clear_error(in_thread(lambda: old.register(6, checkpoint_thread_count=1), BOUND_S), old, new)
    _assert_clear_error(in_thread(lambda: old.wait_committed(5, timeout_s=5), BOUND_S), old, new)
    _assert_clear_error(in_thread(lambda: asyncio.run(old.register_and_monitor(6, checkpoint_thread_count=1)),
                                  BOUND_S), old, new)
    old.register(6, checkpoint_thread_count=1, wait=False)
    old.save_async("after", lambda: write_step_file(root, 6, "old6.bin"), 6)
    _assert_clear_error(in_thread(old.wait_all, BOUND_S), old, new)  # the registration first
    _assert_clear_error(in_thread(old.wait_all, BOUND_S), old, new, ckptd.CheckpointSaveError)  # then the save
    assert not os.path.exists(os.path.join(old.step_dir(6), "old6.bin")), "a refused unit wrote its file"
    assert in_thread(old.close, BOUND_S)[0] != "hung"

    new.save_sync(lambda: write_step_file(root, 5, "mine2.bin"), 5)
    new.wait_committed(5, timeout_s=30)
    assert _units(root, 5) == ["w1/sync", "w1/sync"]
    new.register(6, checkpoint_thread_count=1)  # job 1's registration of step 6 must not add to it
    new.save_sync(lambda: write_step_file(root, 6, "mine.bin"), 6)
    new.wait_committed(6, timeout_s=30)
    assert _units(root, 6) == ["w1/sync"]
    assert assert_trackers_verified(root)[CKPT] == 6

    new_relays = _relay_names(run_name, new._attempt_id, opts)
    for name, was in before.items():
        now = _stats(name)  # still alive: its owner is this process
        assert now["pid"] == was["pid"], (name, was, now)
        assert now["forwarded"] == was["forwarded"], f"job 1's relay {name} forwarded more: {was} -> {now}"
    old_pids = {s["pid"] for s in before.values()}
    for name in new_relays:
        stats = _stats(name)
        assert stats["pid"] not in old_pids, (name, stats, before)
        assert stats["forwarded"] >= 6, (name, stats)  # 3 units of job 2: started and finished each
    new.close()


# -- 2. a relay first started after job 2 started --------------------------------------------------


@pytest.mark.parametrize("route", ["node", "zone2"])
def test_an_old_coordinators_first_relay_started_after_the_new_job_refuses_it(make_monitor, tmp_path, run_name,
                                                                             route):
    """Invariants 1, 3, 5: job 1's coordinator (node_relay=True) never sent a report through a
    relay until job 2's monitor existed: its relay (and zone relay) is started for the first
    time then, lazily, with job 1's monitor handle, which is dead. Its unit must be refused (a
    CheckpointSaveError naming both attempts, save_fn never runs), the relay it starts is job 1's
    (named by attempt 1), never job 2's, and forwards nothing; job 2's step counts its own units
    only, also after a Ray restart of job 2's monitor rebuilt its ledger from storage (job 1's
    receipts written after job 2 started must not count there either)."""
    opts = ROUTES[route]
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, **opts)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=30.0)
    old.register(5, checkpoint_thread_count=1)  # direct: no relay yet
    old_relays = _relay_names(run_name, old._attempt_id, opts)
    assert not any(_exists(n) for n in old_relays), "a relay started before any unit"

    monitor2 = start_new_job(make_monitor, root, monitor, **opts)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", notify_timeout_s=30.0)
    new.register(5, checkpoint_thread_count=2)
    new.save_sync(lambda: write_step_file(root, 5, "mine.bin"), 5)
    new_relays = _relay_names(run_name, new._attempt_id, opts)
    new_pids = {_stats(n)["pid"] for n in new_relays}
    new_forwarded = {n: _stats(n)["forwarded"] for n in new_relays}

    ran = threading.Event()

    def late() -> list[str]:
        ran.set()
        return write_step_file(root, 5, "late.bin")

    old.save_async("late", late, 5)
    result = in_thread(lambda: wait_all(old), BOUND_S)
    assert result[0] == "ok" and result[1] is not None and _names_both(result[1], old, new), result
    assert not ran.is_set(), "job 1's unit was admitted by job 2's monitor"
    for name in old_relays:  # started lazily, job 1's own, and it carried nothing
        stats = _stats(name)
        assert stats["pid"] not in new_pids and stats["forwarded"] == 0, (name, stats)
    for name in new_relays:
        assert _stats(name)["forwarded"] == new_forwarded[name], f"job 1's report went through job 2's {name}"

    restart_monitor(monitor2, how="sigkill")  # rebuilt from job 2's records only
    assert ray.get(monitor2.ping.remote())["attempt"] == new._attempt
    _commits_with_its_own_second_unit_only(new, root, 5)
    assert assert_trackers_verified(root)[CKPT] == 5
    assert in_thread(old.close, BOUND_S)[0] != "hung"
    new.close()


# -- 3. Ray restarts of the same monitor: the attempt is kept ----------------------------------------


@pytest.mark.parametrize(("how", "zones"), [("sigkill", 1), ("ray.kill", 2)])
def test_relays_carry_every_unit_once_across_a_restart_that_kills_them_too(make_monitor, tmp_path, run_name,
                                                                           how, zones):
    """Invariant 2: the monitor restarts (Ray restarts the same actor: same attempt) while its
    node relay and zone relay are killed with it and units are still writing. A coordinator
    created before and one created during the restart go on through new relays of the same
    attempt (not refused as another job's), the step commits with every unit exactly once, and
    the next step goes through the replacement relays."""
    opts = {"node_relay": True, "relay_zones": zones}
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, **opts)
    first = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=60.0)
    first.register(1, checkpoint_thread_count=4)
    gates = [Gate(root, 1, f"w0-{u}.bin") for u in range(2)]
    for u, gate in enumerate(gates):
        first.save_async(f"u{u}", gate, 1)
    for gate in gates:
        assert gate.entered.wait(30)
    names = _relay_names(run_name, first._attempt_id, opts)
    pids = {name: _stats(name)["pid"] for name in names}
    attempt = ray.get(monitor.ping.remote())["attempt"]

    before = ray.get(monitor.ping.remote())
    if how == "ray.kill":
        ray.kill(monitor, no_restart=False)
    else:
        os.kill(before["pid"], 9)
    for name in reversed(names):  # the zone relay, then the node relay
        ray.kill(ray.get_actor(name), no_restart=True)
    second = ckptd.CheckpointCoordinator(monitor, worker_id="w1", notify_timeout_s=60.0)  # during the restart
    for gate in gates:
        gate.open()
    for u in range(2):
        second.save_async(f"u{u}", lambda u=u: write_step_file(root, 1, f"w1-{u}.bin"), 1)
    for coord in (first, second):
        result = in_thread(lambda c=coord: wait_all(c), BOUND_S)
        assert result == ("ok", None), result
    first.wait_committed(1, timeout_s=60)
    after = ray.get(monitor.ping.remote())
    assert after["started_at"] != before["started_at"] and after["attempt"] == attempt == second._attempt
    assert _units(root, 1) == ["w0/u0", "w0/u1", "w1/u0", "w1/u1"]
    for name in names:
        assert _stats(name)["pid"] != pids[name], f"{name} was not replaced"

    # The next step, through the replacements.
    forwarded = {name: _stats(name)["forwarded"] for name in names}
    second.register(2, checkpoint_thread_count=2)
    for coord in (first, second):
        coord.save_sync(lambda c=coord: write_step_file(root, 2, f"{c.worker_id}.bin"), 2)
    second.wait_committed(2, timeout_s=30)
    assert _units(root, 2) == ["w0/sync", "w1/sync"]
    for name in names:
        assert _stats(name)["forwarded"] >= forwarded[name] + 4, name
    assert assert_trackers_verified(root)[CKPT] == 2
    for coord in (first, second):
        coord.close()


# -- 4. orders: the report reaches the relay before job 2's monitor exists ---------------------------


@pytest.mark.parametrize("route", ["direct", "node", "zone1"])
def test_a_report_retried_while_no_monitor_exists_is_refused_once_the_new_job_starts(make_monitor, tmp_path,
                                                                                    run_name, route):
    """Invariants 1, 4, 5 (order: report first, new monitor after): job 1's monitor is gone and
    none exists under the run name when job 1's unit reports its end; the report is retried
    (by the coordinator, or inside its relay: the relay holds the batch). Then job 2 starts. The
    retry must meet job 2's monitor as another attempt's: the save fails with an error naming
    both attempts (not a success, not a timeout), and job 2's step counts its own units only."""
    opts = ROUTES[route]
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, **opts)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=60.0)
    old.register(5, checkpoint_thread_count=1)
    gate = _Returning(root, 5, "late.bin")
    old.save_async("late", gate, 5)
    assert gate.entered.wait(30)
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="job 1's monitor to be gone")
    gate.open()
    wait_for(lambda: _finished_receipt(root, old._attempt, 5), what="job 1's unit to reach its report")
    names = _relay_names(run_name, old._attempt_id, opts)
    if names:  # the node relay holds the batch: forwarding it, to a monitor that is gone
        wait_for(lambda: _forwarding(names[0]), what="the relay to hold job 1's report")

    monitor2 = make_monitor(root, **opts)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", notify_timeout_s=60.0)
    new.register(5, checkpoint_thread_count=2)
    new.save_sync(lambda: write_step_file(root, 5, "mine.bin"), 5)
    result = in_thread(lambda: wait_all(old), BOUND_S)
    assert result[0] == "ok" and result[1] is not None and _names_both(result[1], old, new), result
    _commits_with_its_own_second_unit_only(new, root, 5)
    assert assert_trackers_verified(root)[CKPT] == 5
    old.close()
    new.close()


# -- 5. orders: the report is in the relay when job 1's monitor goes and job 2's comes ---------------


def test_a_batch_held_by_a_relay_across_the_switch_is_refused(make_monitor, tmp_path, run_name, monkeypatch):
    """Invariants 1, 5 (order: report in the relay while job 1's monitor lives, forwarded after
    job 2's exists): the node relay holds job 1's finished report (relay_before_forward=delay,
    armed in that relay's process only) while job 1's monitor is killed and job 2's started. When
    the relay forwards it, job 1's handle is dead and the monitor under the name is job 2's: the
    report must be refused with both attempts named, and count nowhere in job 2."""
    once = tmp_path / "once"
    monkeypatch.setenv("CKPTD_FAILPOINTS_ONCE", str(once))  # reaches the relays started from now on
    opts = ROUTES["zone1"]
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, **opts)
    old, gate = _old_job_writing(monitor, root, 60.0)
    node_relay, zone_relay = _relay_names(run_name, old._attempt_id, opts)
    forwarded = _stats(zone_relay)["forwarded"]
    arm_in_monitor(ray.get_actor(zone_relay), "relay_before_forward", "delay:5")  # any actor's process
    gate.open()
    wait_for(lambda: (once / "relay_before_forward").exists(), what="the zone relay to hold job 1's report")
    monitor2 = start_new_job(make_monitor, root, monitor, **opts)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", notify_timeout_s=60.0)
    new.register(5, checkpoint_thread_count=2)
    new.save_sync(lambda: write_step_file(root, 5, "mine.bin"), 5)
    result = in_thread(lambda: wait_all(old), BOUND_S)
    assert result[0] == "ok" and result[1] is not None and _names_both(result[1], old, new), result
    assert _stats(zone_relay)["forwarded"] == forwarded, "job 1's zone relay forwarded job 1's late report"
    _commits_with_its_own_second_unit_only(new, root, 5)
    assert assert_trackers_verified(root)[CKPT] == 5
    old.close()
    new.close()


# -- 6. retries: a relay dies after its monitor applied a batch; the retry meets job 2 ---------------


def test_a_report_retried_after_a_relay_crash_never_counts_in_the_new_job(make_monitor, tmp_path, run_name,
                                                                         monkeypatch):
    """Invariants 1, 5 (duplicates): job 1's node relay forwards a unit's finished report, job 1's
    monitor applies it, and the relay dies before the answer goes back (relay_after_forward=crash,
    armed in that relay only). The coordinator sends it again through a new relay of attempt 1,
    which holds it (relay_before_forward=delay, armed through the environment the replacement
    inherits) while job 1's monitor is killed and job 2's started under the same run name. The
    retry must be refused (both attempts named), and job 2's step, registered with two units,
    must not count it as one of them; job 1's committed step keeps its manifest."""
    once = tmp_path / "once"
    monkeypatch.setenv("CKPTD_FAILPOINTS_ONCE", str(once))
    opts = ROUTES["node"]
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, **opts)
    old, gate = _old_job_writing(monitor, root, 60.0)
    (name,) = _relay_names(run_name, old._attempt_id, opts)
    arm_in_monitor(ray.get_actor(name), "relay_after_forward", "crash")
    # Only relays started from now on (the replacement) hold a batch before forwarding it.
    monkeypatch.setenv("CKPTD_FAILPOINTS", "relay_before_forward=delay:6")
    gate.open()
    wait_for(lambda: (once / "relay_after_forward").exists(), what="job 1's relay to crash after forwarding")
    wait_for(lambda: (once / "relay_before_forward").exists(), what="the replacement relay to hold the retry")
    # Job 1's monitor applied the report: its step 5 committed with the unit.
    wait_for(lambda: read_manifest(root, 5, CKPT) is not None, what="job 1's step 5 to commit")
    job1_units = read_manifest(root, 5, CKPT).units

    monitor2 = start_new_job(make_monitor, root, monitor, **opts)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", notify_timeout_s=60.0)
    new.register(7, checkpoint_thread_count=2)
    result = in_thread(lambda: wait_all(old), BOUND_S)
    assert result[0] == "ok" and result[1] is not None and _names_both(result[1], old, new), result
    new.save_sync(lambda: write_step_file(root, 7, "mine.bin"), 7)
    _commits_with_its_own_second_unit_only(new, root, 7)
    assert read_manifest(root, 5, CKPT).units == job1_units
    assert status(monitor2).step(5) is None or status(monitor2).step(5).state.value == "committed"
    assert assert_trackers_verified(root)[CKPT] == 7
    old.close()
    new.close()


# -- 7. background registrations queued across the switch ------------------------------------------


@pytest.mark.parametrize("route", ["direct", "zone1"])
def test_a_background_registration_queued_across_the_switch_never_counts(make_monitor, tmp_path, run_name, route):
    """Invariants 1, 4: job 1's coordinator queues ``register(7, 1, wait=False)`` and a unit of
    step 7 while job 1's monitor is gone and none exists; the registrar retries. Job 2 starts.
    The registration must fail (wait_all raises a CheckpointError naming both attempts) rather
    than add a unit to job 2's step 7, which commits with its one registered unit, and job 1's
    unit (held behind the registration) must never be admitted."""
    opts = ROUTES[route]
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, **opts)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=60.0)
    old.register(1, checkpoint_thread_count=1)
    old.save_sync(lambda: write_step_file(root, 1, "old.bin"), 1)  # its relays exist
    old.wait_committed(1, timeout_s=30)
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="job 1's monitor to be gone")
    old.register(7, checkpoint_thread_count=1, wait=False)
    ran = threading.Event()

    def late() -> list[str]:
        ran.set()
        return write_step_file(root, 7, "late.bin")

    old.save_async("late", late, 7)
    monitor2 = make_monitor(root, **opts)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", notify_timeout_s=60.0)
    _assert_clear_error(in_thread(old.wait_all, BOUND_S), old, new)
    result = in_thread(lambda: wait_all(old), BOUND_S)
    assert result[0] == "ok" and result[1] is not None and _names_both(result[1], old, new), result
    assert not ran.is_set()
    new.register(7, checkpoint_thread_count=1)
    new.save_sync(lambda: write_step_file(root, 7, "mine.bin"), 7)
    new.wait_committed(7, timeout_s=30)
    assert _units(root, 7) == ["w1/sync"]
    assert assert_trackers_verified(root)[CKPT] == 7
    assert in_thread(old.close, BOUND_S)[0] != "hung"
    new.close()


# -- 8. the same run name on another root ------------------------------------------------------------


@pytest.mark.parametrize("route", ["direct", "node"])
def test_a_new_job_on_another_root_under_the_same_run_name_never_counts_an_old_unit(make_monitor, tmp_path,
                                                                                    run_name, route):
    """Invariants 1, 3: job 2 starts under the same run name (the default one, say) on another
    root, while a unit of job 1 is still writing. It is another job, so job 1's late report must
    not count in job 2's step (registered with two units, one saved: it must stay uncommitted,
    not fail because of job 1's files) and job 1's coordinator must be told its save did not
    count; job 2's coordinators must not go through job 1's relay, which is still alive."""
    opts = ROUTES[route]
    root_a, root_b = str(tmp_path / "a"), str(tmp_path / "b")
    monitor = make_monitor(root_a, **opts)
    old, gate = _old_job_writing(monitor, root_a, 30.0)
    old_pids = {_stats(n)["pid"] for n in _relay_names(run_name, old._attempt_id, opts)}

    try:
        monitor2 = start_new_job(make_monitor, root_b, monitor, **opts)
        new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1", notify_timeout_s=30.0)
        new.register(5, checkpoint_thread_count=2)
        new.save_sync(lambda: write_step_file(root_b, 5, "mine.bin"), 5)
        gate.open()
        result = in_thread(lambda: wait_all(old), BOUND_S)
        assert_not_committed(new, 5)  # job 1's unit did not stand for job 2's second one (nor fail its step)
        assert result[0] == "ok" and result[1] is not None, f"job 1's save counted in job 2: {result}"
        for name in _relay_names(run_name, new._attempt_id, opts):
            assert _stats(name)["pid"] not in old_pids, f"job 2 goes through job 1's relay {name}"
        new.save_sync(lambda: write_step_file(root_b, 5, "mine2.bin"), 5)
        new.wait_committed(5, timeout_s=30)
        assert _units(root_b, 5) == ["w1/sync", "w1/sync"]
        new.close()
    finally:
        gate.open()  # never leave the old unit waiting (it would hold up the interpreter's exit)
        in_thread(old.close, BOUND_S)


# -- 9. a coordinator's own notify_timeout_s through a relay another coordinator started ------------


def test_an_old_coordinator_gives_up_within_its_own_timeout_through_a_shared_relay(make_monitor, tmp_path, run_name):
    """Invariant 4 (bounded time, no new job yet): job 1's monitor is gone and no job has started
    another. A coordinator with notify_timeout_s=3 whose unit reports its end through the node
    relay (started by another coordinator of its process, with notify_timeout_s=120) must give
    up within a bound set by its own timeout (wait_all returns its failed save well within 25 s),
    not wait for the relay's two minutes (600 s with the default timeout)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    patient = ckptd.CheckpointCoordinator(monitor, worker_id="wl", notify_timeout_s=120.0)
    patient.register(1, checkpoint_thread_count=2)
    patient.save_sync(lambda: write_step_file(root, 1, "l.bin"), 1)  # starts the node relay
    quick = ckptd.CheckpointCoordinator(monitor, worker_id="ws", notify_timeout_s=3.0)
    gate = Gate(root, 1, "s.bin")
    quick.save_async("s", gate, 1)
    try:
        assert gate.entered.wait(30)
        ray.kill(monitor, no_restart=True)
        wait_for(lambda: actor_gone(monitor), what="job 1's monitor to be gone")
        gate.open()
        result = in_thread(lambda: wait_all(quick), 25)
        assert result[0] == "ok" and result[1] is not None, f"notify_timeout_s=3 and still waiting: {result}"
    finally:
        gate.open()
        # Job 2 starts: the relay learns its monitor is another attempt's, and every call ends.
        if actor_gone(monitor):
            make_monitor(root, node_relay=True)
        for coord in (quick, patient):
            assert in_thread(coord.close, BOUND_S)[0] != "hung"
