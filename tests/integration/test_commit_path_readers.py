"""Adversarial tests of the commit path against readers: trackers and woken subscribers only ever
name verifiable steps, failed steps stay failed across restarts and new jobs whatever lease
records lie under ``.ckptd/leases/``, and retention's claim/unclaim path honours read leases.
Real Ray, real monitors, real files."""

from __future__ import annotations

import contextlib
import json
import os
import threading

import pytest
import ray

import ckptd

from .helpers import restart_monitor, wait_for
from .test_rollout import publish

pytestmark = pytest.mark.usefixtures("ray_local")

LEASES = ".ckptd/leases"
READER = {"id": "sub-a", "name": "attacker", "kind": "state_dict", "where": "driver"}


def trackers_verify(root: str) -> dict:
    """Every tracker names a step that verifies; the trackers read."""
    out = {}
    for kind, name in (("checkpoint", "latest_checkpointed_iteration.txt"),
                       ("state_dict", "latest_state_dict_iteration.txt")):
        path = os.path.join(root, name)
        if os.path.exists(path):
            step = int(open(path).read().strip())
            ckptd.verify(root, step, kind=kind)
            out[kind] = step
    return out


def fail_step(coord, root: str, step: int) -> None:
    """A state-dict unit of ``step`` writes a file, then raises: the step fails."""
    def save_fn():
        d = ckptd.step_dir(root, step)
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/model.safetensors", "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    # Registered first: a registration after the failure reached the monitor would be refused.
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.save_async("model", save_fn, step, is_state_dict=True)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(step, is_state_dict=True, timeout_s=60)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_all()


def lease(lease_id: str, step, kind: str = "state_dict") -> dict:
    return {"lease": lease_id, "subscriber": "old-sub", "name": "old", "kind": kind, "step": step}


def write_records(root: str, records: dict[str, bytes | None]) -> None:
    """Lease records by file name; None makes a directory of that name."""
    base = os.path.join(root, LEASES)
    os.makedirs(base, exist_ok=True)
    for name, data in records.items():
        if data is None:
            os.makedirs(os.path.join(base, name), exist_ok=True)
        else:
            with open(os.path.join(base, name), "wb") as f:
                f.write(data)


def new_job(monitor, make_monitor, root, run, **options):
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: _dead(monitor), what="the old monitor to die")
    return make_monitor(root, run=run, **options)


def _dead(monitor) -> bool:
    try:
        ray.get(monitor.ping.remote(), timeout=5)
        return False
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return True


def _prepare(make_monitor, root, **options):
    """Steps 1 and 3 committed (state dicts), step 2 failed with a partial file on storage."""
    monitor = make_monitor(root, **options)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    publish(coord, 1)
    fail_step(coord, root, 2)
    publish(coord, 3)
    coord.close()
    assert trackers_verify(root) == {"state_dict": 3}
    return monitor


def _assert_step2_stays_failed(monitor, root, resave: bool = True):
    answer = ray.get(monitor.wait_committed.remote(2, "state_dict", 30))
    assert answer["committed"] is False
    assert not os.path.exists(os.path.join(ckptd.step_dir(root, 2), "ckptd_state_dict_manifest.json"))
    if not resave:
        # A new job discards older attempts' records by design (attempts.py): a fresh save of the
        # step there is a new save, so only "the failed save never commits" is checked.
        trackers_verify(root)
        return
    # A new save of the failed step is refused, never committed.
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer2")
    raised = []
    for call in (lambda: publish(coord, 2), coord.wait_all):
        try:
            call()
        except ckptd.CheckpointError as e:
            raised.append(e)
    assert raised  # refused or reported failed, never committed (checked below)
    coord.close()
    assert not os.path.exists(os.path.join(ckptd.step_dir(root, 2), "ckptd_state_dict_manifest.json"))
    trackers_verify(root)


def test_a_failed_step_stays_failed_with_leases_naming_failed_missing_and_stale_steps(make_monitor, run_name,
                                                                                     tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = _prepare(make_monitor, root, read_lease_s=2.0)
    write_records(root, {
        "on-failed.json": json.dumps(lease("on-failed", 2)).encode(),
        "on-missing.json": json.dumps(lease("on-missing", 99)).encode(),
        "on-old.json": json.dumps(lease("on-old", 1, "checkpoint")).encode(),
        "null.json": b"null", "list.json": b"[1, 2]", "str.json": b'"x"', "empty.json": b"",
        "truncated.json": b'{"lease": "t", "st', "no-step.json": json.dumps({"lease": "x"}).encode(),
        "bad-kind.json": json.dumps(lease("bk", 1, "weights")).encode(),
        "bad-step.json": json.dumps(lease("bs", "one")).encode(),
        "nan-step.json": b'{"lease": "n", "subscriber": "s", "name": "n", "kind": "state_dict", "step": NaN}',
        "list-id.json": json.dumps(lease(["l"], 1)).encode(),
        "tmp.json.partial": b"{",
    })
    # Sigkill restart (same job), then a new job on the same root: step 2 stays failed each time.
    restart_monitor(monitor, how="sigkill")
    assert trackers_verify(root) == {"state_dict": 3}
    _assert_step2_stays_failed(monitor, root)
    monitor = new_job(monitor, make_monitor, root, run_name, read_lease_s=2.0)
    _assert_step2_stays_failed(monitor, root, resave=False)
    # The restored leases expire (nobody renews them), their records go, and retention then runs.
    wait_for(lambda: not any(n in os.listdir(os.path.join(root, LEASES))
                             for n in ("on-failed.json", "on-missing.json", "on-old.json")),
             what="expired lease records to be removed")
    assert trackers_verify(root) == {"state_dict": 3}


def test_malformed_lease_records_do_not_stop_the_monitor_from_starting(make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = _prepare(make_monitor, root)
    write_records(root, {
        "dir.json": None,  # a directory named like a record
        "binary.json": b"\xff\xfe\x00garbage",  # not UTF-8
        "deep.json": b"[" * 100_000,  # nested too deep for the JSON parser
        "inf.json": b'{"lease": "i", "subscriber": "s", "name": "n", "kind": "state_dict", "step": Infinity}',
    })
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: _dead(monitor), what="the old monitor to die")
    try:
        monitor = make_monitor(root, run=run_name)
        ray.get(monitor.ping.remote(), timeout=60)
    except Exception as e:  # the constructor's failure, as start_monitor or the first call raises it
        pytest.fail(f"the monitor did not start: {type(e).__name__}: {e}")
    _assert_step2_stays_failed(monitor, root, resave=False)
    assert not {"binary.json", "deep.json", "inf.json"} & set(os.listdir(os.path.join(root, LEASES)))


def test_an_expiring_lease_record_never_removes_a_file_outside_the_lease_directory(make_monitor, run_name,
                                                                                   tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = _prepare(make_monitor, root)
    evil = "../../global_step_3/ckptd_state_dict_manifest"
    write_records(root, {"evil.json": json.dumps(lease(evil, 3)).encode()})
    monitor = new_job(monitor, make_monitor, root, run_name, read_lease_s=1.0)
    wait_for(lambda: not os.path.exists(os.path.join(root, LEASES, "evil.json"))
             or not os.path.exists(os.path.join(ckptd.step_dir(root, 3), "ckptd_state_dict_manifest.json")),
             timeout_s=20, what="the restored lease to expire")
    ray.get(monitor.wait_retention.remote(30))
    assert trackers_verify(root) == {"state_dict": 3}


@contextlib.contextmanager
def renewing(monitor, leases: list, every_s: float = 0.5):
    """Heartbeats for ``leases`` every ``every_s``, as a subscriber's own thread sends them (a loaded
    machine can take longer than a short lease between two steps). A heartbeat that fails while the
    monitor restarts is sent again at the next beat; the first lease it reports lost is kept."""
    stop, lost = threading.Event(), []

    def beat():
        while not stop.wait(every_s):
            try:
                lost.extend(ray.get(monitor.reader_heartbeat.remote(READER, leases, None), timeout=30)["lost"])
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield lost
    finally:
        stop.set()
        thread.join()


def test_pins_retention_and_restarts_keep_trackers_verifiable(make_monitor, run_name, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2, read_lease_s=8.0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    publish(coord, 1)
    assert ray.get(monitor.pin.remote(READER, "L1", 1)) == {"error": None}
    with renewing(monitor, [["L1", 1]]) as lost:
        # A lease on a step that was never saved, and on a failed one, is refused.
        fail_step(coord, root, 2)
        assert ray.get(monitor.pin.remote(READER, "L2", 2))["error"]
        assert ray.get(monitor.pin.remote(READER, "L9", 9))["error"]
        for step in (3, 4, 5):
            publish(coord, step)
            ray.get(monitor.wait_retention.remote(30))
            trackers_verify(root)
            ckptd.verify(root, 1, kind="state_dict")  # pinned: kept past the policy
        assert not os.path.isdir(ckptd.step_dir(root, 3))  # not pinned: deleted
        # Renewed across a sigkill restart: the restored lease still holds step 1.
        restart_monitor(monitor, how="sigkill")
        assert ray.get(monitor.reader_heartbeat.remote(READER, [["L1", 1]], None))["lost"] == []
        publish(coord, 6)
        ray.get(monitor.wait_retention.remote(30))
        ckptd.verify(root, 1, kind="state_dict")
        assert trackers_verify(root) == {"state_dict": 6}
    assert lost == []
    # Released: the next pass deletes it (the claim was not left behind), and a new pin is refused.
    ray.get(monitor.release.remote("L1"))
    wait_for(lambda: not os.path.isdir(ckptd.step_dir(root, 1)), what="retention to delete step 1")
    assert ray.get(monitor.pin.remote(READER, "L1b", 1))["error"]
    assert ray.get(monitor.reader_heartbeat.remote(READER, [["L1", 1]], None))["lost"] == ["L1"]
    # A lease on the current tracker target that simply expires: the target stays.
    assert ray.get(monitor.pin.remote(READER, "L6", 6)) == {"error": None}
    wait_for(lambda: not os.path.exists(os.path.join(root, LEASES, "L6.json")), what="lease L6 to expire")
    for step in (7, 8):
        publish(coord, step)
    ray.get(monitor.wait_retention.remote(30))
    assert trackers_verify(root) == {"state_dict": 8}
    assert not os.path.isdir(ckptd.step_dir(root, 6))
    ray.get(monitor.wait_committed.remote(2, "state_dict", 5))
    assert not os.path.exists(os.path.join(ckptd.step_dir(root, 2), "ckptd_state_dict_manifest.json"))
    coord.close()


def test_a_woken_subscriber_is_only_told_durable_verifiable_versions(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    after = None
    for step in (1, 2, 4, 5):
        if step == 5:
            publish(coord, 3)  # out of order: wakes nobody waiting after 4
        woken = monitor.wait_version.remote("state_dict", after, 60)
        publish(coord, step, wait=False)
        answer = ray.get(woken)
        version = answer["version"]
        assert version is not None and (after is None or version > after)
        # Durable at wake-up: the tracker names it (or a newer step) and the version verifies.
        assert int(open(os.path.join(root, "latest_state_dict_iteration.txt")).read()) >= version
        ckptd.verify(root, version, kind="state_dict")
        assert answer["published_at"] is not None
        coord.wait_committed(step, is_state_dict=True, timeout_s=60)
        after = max(after or 0, version)
    # The out-of-order step 3 never woke anyone: versions never go back.
    assert ray.get(monitor.wait_version.remote("state_dict", 5, 0.5))["version"] is None
    assert trackers_verify(root) == {"state_dict": 5}
    coord.close()
