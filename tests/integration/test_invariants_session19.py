"""A helper's attack on this session's two changes (session 19, commits 7ae40d3 and c23bad8).

1. A coordinator that sends through a shared node relay stops waiting at its own notify_timeout_s
   (``_Route.send``), while the relay retries the batch upstream for the timeout of the coordinator
   that started it. The attack found that a coordinator giving up on the relay alone could leave
   a unit admitted through the relay's late "started" in limbo, and that a zone relay cut every
   coordinator short at its starter's timeout: now a coordinator sends a batch its relay did not
   answer in time straight to the monitor (``MonitorClient.send_batch``), and a node relay waits
   for its zone relay without a deadline of its own (``_Route.send_async``).
2. A released read lease schedules retention before any await (``Publication.release``); the
   attack found a refused pin did not, and now every lease that ends does (``_end_lease``).

Invariants attacked (each test names its own in its docstring):
I1. A step commits (manifest, then trackers) only when every registered unit finished; trackers
    name only steps whose manifest exists and whose files match it.
I2. Nothing committed is lost or changed; retention never deletes a pinned step, nor the newest.
I3. A save reported failed to its user may still commit through the relay only with whole,
    verified data; never partially, and its step never stays neither committed nor failed.
I4. Bounded time: a short notify_timeout_s bounds its own coordinator, dead or slow monitor; a
    long one sharing the relay is not cut short by it.
I5. Lease release against retention: after every lease is released and wait_retention() returns
    True, the policy is applied; a pinned step is never deleted while pinned.

Real local Ray, real files, real monitors and relays. Orders are forced with failpoints armed in a
relay's own process (``__ray_call__``) or in the monitor's environment, and polls of state.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time

import pytest
import ray

import ckptd
from ckptd.config import Kind

from .helpers import (
    HOLD_STEP,
    Gate,
    actor_gone,
    assert_trackers_verified,
    failpoint_env,
    hold_commit,
    in_thread,
    node_relay,
    read_manifest,
    restart_monitor,
    status,
    wait_all,
    wait_for,
    weights,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT = Kind.CHECKPOINT
SD = Kind.STATE_DICT

SHORT_S, LONG_S = 3.0, 120.0
#: How long a coordinator with notify_timeout_s=SHORT_S may take to report a save it gave up on:
#: its "finished" (or "started") and then its "failed" notification, each SHORT_S, with margin
#: for a loaded machine; far below LONG_S, the relay's own timeout.
SHORT_BOUND_S = 20.0


# -- helpers --------------------------------------------------------------------------------------


def _hold_batches(relay, seconds: float, once_dir=None) -> None:
    """The relay's batches wait ``seconds`` before they are forwarded: every one, or with
    ``once_dir`` the next one only (a marker file named after the failpoint appears there when it
    fires). The relay's event loop sleeps meanwhile, as a stalled relay process would."""
    def arm(_self, seconds=seconds, once=None if once_dir is None else str(once_dir)):
        from ckptd import failpoints

        if once is not None:
            os.environ[failpoints.ONCE_ENV_VAR] = once
        failpoints.arm("relay_before_forward", f"delay:{seconds:g}")

    ray.get(relay.__ray_call__.remote(arm), timeout=30)


def _admitted_then_held(quick, root: str, relay, seconds: float, once_dir) -> int:
    """The quick coordinator's unit "s" of step 1 is admitted (its "started" answered through
    the relay), then the relay holds the next batch, which is that unit's "finished". Returns
    the relay's forwarded count before the hold."""
    gate = Gate(root, 1, "s.bin")
    quick.save_async("s", gate, 1)
    assert gate.entered.wait(30)
    forwarded = ray.get(relay.stats.remote(), timeout=30)["forwarded"]
    _hold_batches(relay, seconds, once_dir)
    gate.open()
    return forwarded


def _receipts(root: str, attempt: int, step: int) -> dict[str, str]:
    """The unit receipts of ``step``: "worker/name" -> status (started, finished, failed)."""
    out = {}
    for path in glob.glob(os.path.join(root, ".ckptd", "pending", str(attempt), str(step), "unit-*.json")):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        out[f"{rec['unit']['worker']}/{rec['unit']['name']}"] = rec["status"]
    return out


def _units(root: str, step: int, kind: Kind = CKPT) -> list[str]:
    m = read_manifest(root, step, kind)
    assert m is not None, f"step {step} has no {kind.value} manifest"
    return sorted(u.split("#")[0] for u in m.units if "#" in u)


def _outcome(coord: ckptd.CheckpointCoordinator, step: int, timeout_s: float = 30) -> str:
    """'committed', 'failed' or 'neither' (wait_committed timed out)."""
    result = in_thread(lambda: coord.wait_committed(step, timeout_s=timeout_s), timeout_s + 30)
    if result[0] == "ok":
        return "committed"
    if result[0] == "raised" and isinstance(result[1], ckptd.CheckpointSaveError):
        return "failed"
    assert result[0] == "raised" and isinstance(result[1], TimeoutError), result
    return "neither"


def _assert_whole_or_absent(root: str, step: int, outcome: str) -> None:
    """I1/I3: a committed step verifies; a failed one has no manifest and no tracker names it."""
    named = assert_trackers_verified(root)
    if outcome == "committed":
        ckptd.verify(root, step)
    else:
        assert read_manifest(root, step, CKPT) is None and read_manifest(root, step, SD) is None
        assert step not in named.values(), named


def _timed(fn):
    t0 = time.monotonic()
    result = in_thread(fn, 90)
    return result, time.monotonic() - t0


def _pair(monitor, root: str, step: int, units: int = 2, quick_s: float = SHORT_S):
    """The patient coordinator (notify_timeout_s=LONG_S) starts the node relay with one finished
    unit of ``step`` (registered with ``units``); the quick one (``quick_s``) shares that relay."""
    patient = ckptd.CheckpointCoordinator(monitor, worker_id="wl", notify_timeout_s=LONG_S)
    patient.register(step, checkpoint_thread_count=units)
    patient.save_sync(lambda: write_step_file(root, step, "l.bin"), step)  # starts the node relay
    quick = ckptd.CheckpointCoordinator(monitor, worker_id="ws", notify_timeout_s=quick_s)
    return patient, quick


def _close(*coords) -> None:
    for coord in coords:
        assert in_thread(coord.close, 150)[0] != "hung"


# -- I3: a "finished" the relay delivers after its coordinator gave up -------------------------------


def test_a_finished_report_held_by_the_relay_past_the_coordinators_timeout_goes_straight_to_the_monitor(
        make_monitor, tmp_path, run_name):
    """I3, I1, I2, I4 (no restart): the relay holds the quick coordinator's "finished" for 8 s.
    At its own 3 s the coordinator sends it straight to the monitor instead (not at the relay's
    120 s), so its save succeeds: wait_all is clean well within the bound, its receipt says
    finished, and the step commits with both units and whole data. The relay's late delivery of
    the same report changes nothing, nor does a SIGKILL restart of the monitor."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    patient, quick = _pair(monitor, root, 1)
    relay = node_relay(run_name, patient)
    forwarded = _admitted_then_held(quick, root, relay, 8, tmp_path / "once")
    result, took = _timed(lambda: wait_all(quick))
    assert result == ("ok", None) and took < SHORT_BOUND_S, (result, took)
    assert (tmp_path / "once" / "relay_before_forward").exists(), "the relay held nothing: nothing was tested"
    # Finished, never failed; or gone already: the step committed (asserted next), and its commit
    # removes the step's records (a recursive removal, which a read can meet halfway).
    assert _receipts(root, quick._attempt, 1).get("ws/s") in ("finished", None)

    assert _outcome(patient, 1) == "committed"
    assert _units(root, 1) == ["wl/sync", "ws/s"]
    _assert_whole_or_absent(root, 1, "committed")
    manifest = read_manifest(root, 1, CKPT)
    wait_for(lambda: ray.get(relay.stats.remote(), timeout=30)["forwarded"] > forwarded, timeout_s=60,
             what="the relay to deliver the held report")
    assert read_manifest(root, 1, CKPT) == manifest and status(monitor).step(1).failed == []

    restart_monitor(monitor, how="sigkill")
    assert read_manifest(root, 1, CKPT) == manifest
    assert _outcome(patient, 1, 10) == "committed"
    assert assert_trackers_verified(root)[CKPT] == 1
    _close(quick, patient)


@pytest.mark.parametrize("second_unit_running", [False, True])
def test_a_restart_while_the_relay_holds_finished_settles_the_step_once_and_whole(make_monitor, tmp_path, run_name,
                                                                                 second_unit_running):
    """I3, I1 (restart before the give-up): the monitor is SIGKILLed the moment the quick
    coordinator's "finished" receipt is on storage, while the relay holds that report; Ray
    restarts it, racing the quick coordinator's 3 s give-up (and its "failed" receipt). With
    ``second_unit_running`` another registered unit of the step is still writing through all of
    it. Whatever the race, the step must settle exactly one way (never stay neither committed nor
    failed), a commit must verify against its files and list every registered unit, a failure
    must publish nothing; and a second restart must not change the outcome."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    patient, quick = _pair(monitor, root, 1, units=3 if second_unit_running else 2)
    relay = node_relay(run_name, patient)
    gate = threading.Event()
    if second_unit_running:
        patient.save_async("late", lambda: (gate.wait(60), write_step_file(root, 1, "late.bin"))[1], 1)
        wait_for(lambda: any(u.startswith("wl/late#") for u in status(monitor).step(1).started),
                 what="the second unit to be admitted")
    pid = ray.get(monitor.ping.remote())["pid"]
    _admitted_then_held(quick, root, relay, 8, tmp_path / "once")
    wait_for(lambda: _receipts(root, quick._attempt, 1).get("ws/s") in ("finished", "failed"),
             what="the quick unit's receipt")
    before = ray.get(monitor.ping.remote())["started_at"]
    os.kill(pid, 9)
    wait_for(lambda: ray.get(monitor.ping.remote())["started_at"] != before, what="the monitor to restart")
    result, took = _timed(lambda: wait_all(quick))
    assert result[0] == "ok" and took < SHORT_BOUND_S, (result, took)
    gate.set()
    assert wait_all(patient) is None

    outcome = _outcome(patient, 1)
    assert outcome in ("committed", "failed"), f"step 1 is neither committed nor failed after {result}"
    _assert_whole_or_absent(root, 1, outcome)
    if outcome == "committed":
        expected = ["wl/late", "wl/sync", "ws/s"] if second_unit_running else ["wl/sync", "ws/s"]
        assert _units(root, 1) == expected
    restart_monitor(monitor, how="sigkill")
    assert _outcome(patient, 1, 10) == outcome
    _assert_whole_or_absent(root, 1, outcome)
    _close(quick, patient)


def test_a_relay_holding_every_batch_past_the_coordinators_timeout_leaves_no_unit_in_limbo(make_monitor, tmp_path,
                                                                                             run_name):
    """I3 (a step neither committed nor failed): every batch of the relay is held 5 s, longer
    than the quick coordinator's 3 s. Its "started" and "finished" go straight to the monitor
    once its own timeout passed, so its save runs and the step commits whole; the relay's late
    copies of both (and the relay's death while it holds one) change nothing. Before the direct
    fallback, the coordinator gave up on "started", the relay still delivered it (the unit was
    admitted), and a "failed" lost with the relay left the step neither committed nor failed
    until step_timeout_s."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    patient, quick = _pair(monitor, root, 1)
    relay = node_relay(run_name, patient)
    ran = threading.Event()
    _hold_batches(relay, 5)

    def save() -> list[str]:
        ran.set()
        return write_step_file(root, 1, "s.bin")

    quick.save_async("s", save, 1)
    result, took = _timed(lambda: wait_all(quick))
    assert result == ("ok", None) and took < SHORT_BOUND_S, (result, took)
    # Finished, or gone with the step's records once its commit (asserted next) removes them.
    assert ran.is_set() and _receipts(root, quick._attempt, 1).get("ws/s") in ("finished", None)
    try:
        assert _outcome(patient, 1, 15) == "committed"
        manifest = read_manifest(root, 1, CKPT)
        ray.kill(relay, no_restart=True)  # holding a late copy of a report, maybe
        wait_for(lambda: actor_gone(relay, "stats"), what="the relay to be gone")
        assert _outcome(quick, 1, 15) == "committed" and read_manifest(root, 1, CKPT) == manifest
        _assert_whole_or_absent(root, 1, "committed")
        assert _units(root, 1) == ["wl/sync", "ws/s"]
    finally:
        _close(quick, patient)


# -- I4: bounded time, dead and slow monitors --------------------------------------------------------


def test_a_short_timeout_bounds_wait_all_save_sync_register_and_close_when_the_monitor_is_dead(make_monitor,
                                                                                               tmp_path, run_name):
    """I4 (dead monitor): the monitor is gone for good (ray.kill, no restart) and no job has
    started another. Through a relay started by a coordinator with notify_timeout_s=120, the quick
    coordinator's wait_all (a unit that reports its end), save_sync (a unit that asks to start),
    register and close each return within a bound set by its own 1.5 s timeout (up to four of
    them each: through the relay, then straight, for the report and then for its failure); what it
    saved is reported failed, and its save_sync never ran the save function."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    patient, quick = _pair(monitor, root, 1, quick_s=SHORT_S / 2)
    entered, release = threading.Event(), threading.Event()

    def held() -> list[str]:
        entered.set()
        release.wait(60)
        return write_step_file(root, 1, "s.bin")

    quick.save_async("s", held, 1)
    try:
        assert entered.wait(30)  # admitted through the relay
        ray.kill(monitor, no_restart=True)
        wait_for(lambda: actor_gone(monitor), what="the monitor to be gone")
        release.set()
        result, took = _timed(lambda: wait_all(quick))
        assert result[0] == "ok" and result[1] is not None and took < SHORT_BOUND_S, (result, took)

        ran = threading.Event()
        result, took = _timed(lambda: quick.save_sync(lambda: (ran.set(), write_step_file(root, 2, "x.bin"))[1], 2))
        assert result[0] == "raised" and isinstance(result[1], ckptd.CheckpointSaveError), result
        assert took < SHORT_BOUND_S and not ran.is_set(), (took, ran.is_set())

        result, took = _timed(lambda: quick.register(3, checkpoint_thread_count=1))
        assert result[0] == "raised" and took < SHORT_BOUND_S, (result, took)

        quick.save_async("t", lambda: write_step_file(root, 4, "t.bin"), 4)
        result, took = _timed(quick.close)
        assert result[0] == "raised" and isinstance(result[1], ckptd.CheckpointSaveError), result
        assert took < SHORT_BOUND_S, took
    finally:
        release.set()
        # A new job: the relay learns its monitor is another attempt's, and its retries end.
        if actor_gone(monitor):
            make_monitor(root, node_relay=True)
        _close(patient)


def test_a_slow_monitor_fails_the_quick_coordinator_in_its_bound_and_the_patient_one_still_commits(
        make_monitor, tmp_path, run_name):
    """I4 (alive but slow), I1: the commit of step 1 is held in before_manifest for 10 s; the
    quick coordinator's save into step 1 asks to start and the monitor holds that answer until the
    commit ends, and with it the relay's one call in flight. The quick coordinator gives up
    within its bound (its save is reported failed, its save function never ran). The patient
    coordinator's save of step 3, queued behind in the same relay, is not cut short by the quick
    one's timeout: it is admitted once the monitor answers, and step 3 commits with it. Step 1
    commits with its one registered unit; every tracker verifies."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True)
    patient = ckptd.CheckpointCoordinator(monitor, worker_id="wl", notify_timeout_s=LONG_S)
    quick = ckptd.CheckpointCoordinator(monitor, worker_id="ws", notify_timeout_s=SHORT_S)
    hold_commit(patient, monitor, root, 10)
    ran = threading.Event()
    quick.save_async("late", lambda: (ran.set(), write_step_file(root, HOLD_STEP, "late.bin"))[1], HOLD_STEP)
    wait_for(lambda: "ws/late" in _receipts(root, quick._attempt, HOLD_STEP), what="the quick unit to ask")
    patient.register(3, checkpoint_thread_count=1)
    patient.save_async("p", lambda: write_step_file(root, 3, "p.bin"), 3)

    result, took = _timed(lambda: wait_all(quick))
    assert result[0] == "ok" and result[1] is not None and took < SHORT_BOUND_S, (result, took)
    assert not ran.is_set()
    assert wait_all(patient) is None  # waited for the monitor, within its own 120 s
    assert _outcome(patient, 3) == "committed" and _units(root, 3) == ["wl/p"]
    assert _outcome(patient, HOLD_STEP) == "committed" and _units(root, HOLD_STEP) == ["wl/hold"]
    assert not os.path.exists(os.path.join(ckptd.step_dir(root, HOLD_STEP), "late.bin"))
    assert assert_trackers_verified(root)[CKPT] == 3
    # A restart reads the quick unit's "failed" receipt of the committed step 1: nothing changes.
    restart_monitor(monitor, how="sigkill")
    assert _outcome(patient, HOLD_STEP, 10) == "committed"
    ckptd.verify(root, HOLD_STEP)
    _close(quick, patient)


@pytest.mark.parametrize("zones", [0, 1])
def test_a_patient_coordinator_is_not_cut_short_by_relays_a_quick_one_started(make_monitor, tmp_path, run_name, zones):
    """I4 (the other order: the quick coordinator, notify_timeout_s=3, starts the relays, so they
    retry upstream for 3 s), I1: the monitor is alive but slow: the commit of step 1 is held 10 s
    in before_manifest, and the quick coordinator's save into step 1 asks to start, which the
    monitor answers only once the commit ends, holding the relays' call in flight. The patient
    coordinator (notify_timeout_s=120) saves step 3 through the same relays: it must be admitted
    once the monitor answers and step 3 must commit; only the quick coordinator's save fails."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, node_relay=True, relay_zones=zones)
    quick = ckptd.CheckpointCoordinator(monitor, worker_id="ws", notify_timeout_s=SHORT_S)
    quick.register(5, checkpoint_thread_count=1)
    quick.save_sync(lambda: write_step_file(root, 5, "q.bin"), 5)  # the quick one starts the relays
    patient = ckptd.CheckpointCoordinator(monitor, worker_id="wl", notify_timeout_s=LONG_S)
    try:
        hold_commit(patient, monitor, root, 10)
        quick.save_async("late", lambda: write_step_file(root, HOLD_STEP, "late.bin"), HOLD_STEP)
        wait_for(lambda: "ws/late" in _receipts(root, quick._attempt, HOLD_STEP), what="the quick unit to ask")
        patient.register(3, checkpoint_thread_count=1)
        patient.save_async("p", lambda: write_step_file(root, 3, "p.bin"), 3)
        result = in_thread(lambda: wait_all(patient), 90)
        assert result == ("ok", None), f"the patient coordinator's save failed: {result}"
        assert _outcome(patient, 3) == "committed" and _units(root, 3) == ["wl/p"]
        assert wait_all(quick) is not None
        assert assert_trackers_verified(root)[CKPT] == 5
    finally:
        _close(quick, patient)


# -- I5: lease release against retention ------------------------------------------------------------


def _publish(coord: ckptd.CheckpointCoordinator, step: int) -> None:
    coord.save_state_async("model", weights(step), step, is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(step, is_state_dict=True, timeout_s=60)


def _steps_on_root(root: str) -> list[int]:
    return sorted(int(p.rsplit("_", 1)[1]) for p in glob.glob(os.path.join(root, "global_step_*")))


def test_many_readers_pinning_and_releasing_while_commits_land_never_lose_a_pinned_step(make_monitor, tmp_path,
                                                                                        run_name):
    """I5, I2: four subscribers (two of them pinning the newest version, two the one before it)
    pin each new version as it commits, hold it across the next commit, then read it verified and
    release it, while the trainer commits ten more versions, with
    every lease record's removal held 2 s (before_lease_record_removed), so releases and
    retention passes overlap. While a handle is pinned its step must exist and read verified;
    once every lease is released and wait_retention() returns True, exactly the newest two steps
    (max_state_dict_to_keep=2) are left, and the trackers verify."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2,
                           runtime_env=failpoint_env("before_lease_record_removed=delay:2"))
    trainer = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    _publish(trainer, 1)
    subs = [ckptd.WeightSubscriber(run_name, name=f"r{i}") for i in range(4)]
    stop = threading.Event()
    problems: list[str] = []
    counts = [0] * len(subs)

    def check(i: int, handle) -> None:
        """A handle pinned since before the last commit: its step is there and reads verified."""
        version = handle.version
        if not handle.pinned:
            problems.append(f"r{i}: version {version} not pinned")
        elif not os.path.isdir(ckptd.step_dir(root, version)):
            problems.append(f"r{i}: pinned version {version} deleted while pinned")
        else:
            try:
                state = handle.state_dict()
                if not all(state[k].equal(v) for k, v in weights(version).items()):
                    problems.append(f"r{i}: version {version} read other weights")
            except ckptd.CheckpointError as e:
                problems.append(f"r{i}: pinned version {version} unreadable: {e}")
        counts[i] += 1
        handle.release()

    def follow(i: int) -> None:
        """Each new version: pin the newest (even readers) or the one before (odd readers: the
        next commit pushes it past the policy), hold it across that commit, then check it."""
        sub, held, last = subs[i], None, None
        while not stop.is_set():
            try:
                last = sub.wait_for_version(last, timeout_s=1.0)
            except ckptd.CheckpointError:
                continue
            version = last if i % 2 == 0 else max(1, last - 1)
            try:
                new = sub.open(version)
            except ckptd.CheckpointError:
                new = None  # refused: retention took it first (allowed: it was never pinned)
            if held is not None:
                check(i, held)
            held = new
        if held is not None:
            check(i, held)

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(len(subs))]
    for t in threads:
        t.start()
    try:
        for step in range(2, 12):
            _publish(trainer, step)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not problems, problems
    assert all(counts), f"a reader never pinned anything: {counts}"
    for sub in subs:
        sub.close()
    wait_for(lambda: not status(monitor).pins, what="every lease to be released")
    assert ray.get(monitor.wait_retention.remote(30))
    assert _steps_on_root(root) == [10, 11]
    assert assert_trackers_verified(root)[SD] == 11
    trainer.close()


def test_a_release_whose_record_outlives_a_monitor_kill_is_restored_then_expires_and_retention_applies(
        make_monitor, tmp_path, run_name):
    """I5, I2 (the change of c23bad8, then a kill in its window): a pinned step 1 survives the
    commits of 2-4; its lease is released while every lease record's removal is held 4 s. Once
    status() shows no lease, wait_retention() must find the pass the release made due and step 1
    gone. The monitor is SIGKILLed while the record's removal is still held, so the record
    survives: the restarted monitor restores that lease (on a step already deleted) and drops it
    again (Ray retries the killed release call; else it expires, as nobody renews it), its record
    goes, and nothing committed is touched: the newest two steps stay and verify, and a new pin
    of step 3 is granted and reads."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=2.0,
                           runtime_env=failpoint_env("before_lease_record_removed=delay:4"))
    trainer = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    _publish(trainer, 1)
    sub = ckptd.WeightSubscriber(run_name, name="r0")
    handle = sub.open(1)
    for step in (2, 3, 4):
        _publish(trainer, step)
    assert ray.get(monitor.wait_retention.remote(30))
    assert _steps_on_root(root) == [1, 3, 4]
    handle.release()
    wait_for(lambda: not status(monitor).pins, what="the release to reach the monitor")
    assert ray.get(monitor.wait_retention.remote(30))
    assert _steps_on_root(root) == [3, 4]
    assert os.listdir(os.path.join(root, ".ckptd", "leases")), "the record was removed before the kill"
    restart_monitor(monitor, how="sigkill")
    # Restored from its record; Ray retries the killed release() call on the restarted monitor
    # (max_task_retries=-1), which releases it again, else it expires.
    wait_for(lambda: not status(monitor).pins, timeout_s=20, what="the restored lease to go")
    assert ray.get(monitor.wait_retention.remote(30))
    wait_for(lambda: not os.listdir(os.path.join(root, ".ckptd", "leases")), timeout_s=20,
             what="the lease record to go")
    assert _steps_on_root(root) == [3, 4]
    for step in (3, 4):
        ckptd.verify(root, step)
    with sub.open(3) as w:
        assert w.pinned and all(w.state_dict()[k].equal(v) for k, v in weights(3).items())
    assert assert_trackers_verified(root)[SD] == 4
    sub.close()
    trainer.close()


def _saturate_and_pin(make_monitor, tmp_path, run_name, pin_kind: str):
    """Steps 1-4 committed as state dicts (keep 2); steps 1 and 2 held by leases, step 4 by six
    more. Lease-record removals are held 8 s (4 s was not always longer than the pinner's start
    on a loaded machine: the pin was refused before any look saw it granted), step deletions 2 s.
    Release the leases on 1 and 2 (a retention pass starts and holds its thread in the deletion
    of step 1), then the six (their record removals fill the monitor's other I/O threads), then
    pin step 2 as ``pin_kind``: the pin is granted in memory at once, but its record and its
    storage check wait for a thread, so the retention pass meets the lease on step 2. Returns
    (root, monitor, the pin's result, subscribers to close, trainer)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, runtime_env=failpoint_env(
        "before_lease_record_removed=delay:8,before_step_delete=delay:2"))
    trainer = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    holder = ckptd.WeightSubscriber(run_name, name="holder")
    filler = ckptd.WeightSubscriber(run_name, name="filler")
    _publish(trainer, 1)
    _publish(trainer, 2)
    held = [holder.open(1), holder.open(2)]
    _publish(trainer, 3)
    _publish(trainer, 4)
    fillers = [filler.open(4) for _ in range(6)]
    assert ray.get(monitor.wait_retention.remote(30)) and _steps_on_root(root) == [1, 2, 3, 4]

    for h in held:
        h.release()
    wait_for(lambda: not ray.get(monitor.wait_retention.remote(0.05)), what="a retention pass to start")
    for h in fillers:
        h.release()
    wait_for(lambda: [p.step for p in status(monitor).pins] == [], what="every release to reach the monitor")
    pinner = ckptd.WeightSubscriber(run_name, name="pinner", kind=pin_kind)
    box: list = []
    t = threading.Thread(target=lambda: box.append(in_thread(lambda: pinner.open(2), 60)), daemon=True)
    t.start()
    wait_for(lambda: [p.step for p in status(monitor).pins] == [2], what="the pin of step 2 to be granted")
    t.join(60)
    return root, monitor, box[0], [holder, filler, pinner], trainer


def test_a_granted_pin_released_during_a_retention_pass_leaves_the_policy_applied(make_monitor, tmp_path,
                                                                                   run_name):
    """I5 (the change of c23bad8, control for the next test): a state-dict pin on step 2 is
    granted while a retention pass runs and the monitor's I/O threads are all busy; the pass
    keeps step 2 for it. Its release makes retention due again, so once the lease is gone from
    status() and wait_retention() returns True, step 2 (past the policy) is deleted."""
    root, monitor, result, subs, trainer = _saturate_and_pin(make_monitor, tmp_path, run_name, "state_dict")
    assert result[0] == "ok" and result[1].pinned, result
    assert os.path.isdir(ckptd.step_dir(root, 2))
    result[1].release()
    wait_for(lambda: not status(monitor).pins, what="the release to reach the monitor")
    assert ray.get(monitor.wait_retention.remote(30))
    assert _steps_on_root(root) == [3, 4]
    for sub in subs:
        sub.close()
    trainer.close()


def test_a_refused_pin_that_a_retention_pass_honoured_leaves_the_policy_applied(make_monitor, tmp_path, run_name):
    """I5: as the test above, but the pin of step 2 comes from a checkpoint subscriber and step 2
    is a state dict only: granted in memory, then refused once storage is asked. The retention
    pass running meanwhile kept step 2 for that lease. Once the refusal is answered, no lease is
    left and wait_retention() returns True: the policy must be applied (step 2 deleted)."""
    root, monitor, result, subs, trainer = _saturate_and_pin(make_monitor, tmp_path, run_name, "checkpoint")
    try:
        assert result[0] == "raised" and "not committed as a checkpoint" in str(result[1]), result
        assert not status(monitor).pins
        assert ray.get(monitor.wait_retention.remote(30))
        assert _steps_on_root(root) == [3, 4], "step 2 is past the policy, unpinned, and retention is idle"
    finally:
        for sub in subs:
            sub.close()
        trainer.close()
