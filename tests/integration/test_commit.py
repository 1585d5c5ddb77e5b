"""The commit rule and commit action against a real monitor actor, real files, real workers."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import zlib

import pytest
import ray

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS

from .helpers import SaveWorker, Signal, commit_one, restart_monitor, status

pytestmark = pytest.mark.usefixtures("ray_local")

# The tests that look only at their own steps share one monitor (``env``); those that look at the
# trackers or the steps before theirs, or restart the monitor, start one each.
SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}  # no test's steps go while another runs


def manifest(root: str, step: int, kind: Kind = Kind.CHECKPOINT) -> dict:
    with open(f"{ckptd.step_dir(root, step)}/{MANIFESTS[kind]}") as f:
        return json.load(f)


def tracker(root: str, name: str = "latest_checkpointed_iteration.txt") -> str | None:
    try:
        with open(os.path.join(root, name)) as f:
            return f.read()
    except FileNotFoundError:
        return None


def test_pipeline_usage_two_workers(make_monitor, run_name, tmp_path):
    """save_async with a lambda on 2 worker actors, register_and_monitor, wait_all."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, storage_options={"auto_mkdir": True})
    workers = [SaveWorker.remote(run_name, r) for r in range(2)]
    trainer = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    for step in (1, 2, 3):
        is_sd = step != 3
        ray.get([w.save.remote(step, "model", is_state_dict=is_sd) for w in workers])
        counts = {"state_dict_thread_count": 2} if is_sd else {"checkpoint_thread_count": 2}
        asyncio.run(trainer.register_and_monitor(step, is_state_dict=is_sd, **counts))
    assert ray.get([w.wait_all.remote() for w in workers]) == [None, None]
    trainer.wait_committed(3, timeout_s=30)
    trainer.wait_committed(2, is_state_dict=True, timeout_s=30)

    assert tracker(root) == "3\n"
    assert tracker(root, "latest_state_dict_iteration.txt") == "3\n"  # a checkpoint advances both
    assert ckptd.latest_step(root) == 3 and ckptd.latest_step(root, "state_dict") == 3
    m = manifest(root, 3)
    assert sorted(f["path"] for f in m["files"]) == ["model_rank0.pt", "model_rank1.pt"]
    assert len(m["units"]) == 2
    for f in m["files"]:
        data = open(f"{ckptd.step_dir(root, 3)}/{f['path']}", "rb").read()
        assert f["size"] == len(data) and f["crc32"] == f"{zlib.crc32(data):08x}"
    assert manifest(root, 2, Kind.STATE_DICT)["kind"] == "state_dict"
    assert not os.path.exists(f"{ckptd.step_dir(root, 2)}/ckptd_manifest.json")
    full = status(monitor)
    s = full.step(3)
    assert s.committed and s.expected == 2 and len(s.finished) == 2 and not s.failed
    dumped = json.loads(full.model_dump_json())
    assert dumped["trackers"] == {"checkpoint": 3, "state_dict": 3}
    assert "auto_mkdir" not in full.model_dump_json()  # storage options never shown


def test_finish_before_registration(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("model", lambda: _write(root, 5, "a.bin"), 5)
    coord.wait_all()
    s = status(monitor).step(5)
    assert len(s.finished) == 1 and s.finished[0].startswith("w0/model#") and not s.committed and s.expected == 0
    assert ckptd.latest_step(root) is None
    coord.register(5, checkpoint_thread_count=1)
    coord.wait_committed(5, timeout_s=30)
    assert ckptd.latest_step(root) == 5


def test_steps_completing_out_of_order(make_monitor, tmp_path):
    """A later step finishing first: no assertion, the late older step gets its manifest, the
    tracker never moves back."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    gate = Signal.remote()

    def slow():
        ray.get(gate.wait.remote())
        _write(root, 1, "slow.bin")

    coord.save_async("slow", slow, 1)
    coord.save_async("fast", lambda: _write(root, 2, "fast.bin"), 2)
    coord.register(1, checkpoint_thread_count=1)
    coord.register(2, checkpoint_thread_count=1)
    coord.wait_committed(2, timeout_s=30)
    assert tracker(root) == "2\n" and not status(monitor).step(1).committed
    ray.get(gate.send.remote())
    coord.wait_all()
    coord.wait_committed(1, timeout_s=30)
    assert manifest(root, 1)["files"][0]["path"] == "slow.bin"
    assert tracker(root) == "2\n"


def test_duplicate_notifications_count_once(env):
    root, monitor, step = env.root, env.monitor, env.s + 7
    coord = env.coord()
    coord.register(step, checkpoint_thread_count=2)
    coord.save_async("model", lambda: _write(root, step, "a.bin"), step)
    coord.wait_all()
    # A retried notification of the same call, straight to the actor: it counts once.
    (key,) = status(monitor).step(step).finished
    unit = {"worker": coord.worker_id, "name": "model", "step": step, "kind": "checkpoint",
            "call": key.split("#")[1]}
    assert ray.get(monitor.notify_batch.remote([("started", unit, None), ("finished", unit, [])])) == [
        {"admitted": True}, None]
    s = status(monitor).step(step)
    assert s.finished == [key] and not s.committed
    other = ckptd.CheckpointCoordinator(monitor, worker_id=f"{coord.worker_id}-other")
    other.save_async("model", lambda: _write(root, step, "b.bin"), step)
    other.wait_all()
    coord.wait_committed(step, timeout_s=30)
    assert sorted(f["path"] for f in manifest(root, step)["files"]) == ["a.bin", "b.bin"]


def test_failing_save_surfaces_and_never_commits(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_async("model", lambda: _write(root, 1, "a.bin"), 1)
    coord.register(1, checkpoint_thread_count=2)

    def broken():
        _write(root, 1, "partial.bin")
        raise OSError("disk full")

    coord.save_async("optimizer", broken, 1)
    with pytest.raises(ckptd.CheckpointSaveError) as info:
        coord.wait_all()
    err = info.value
    assert err.step == 1 and err.unit == "w0/optimizer" and "OSError: disk full" in str(err)
    assert isinstance(err.__cause__, OSError)
    coord.wait_all()  # reported once

    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_committed(1, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError, match="w0/optimizer"):
        coord.register(1, checkpoint_thread_count=2)
    s = status(monitor).step(1)
    assert s.state.value == "failed" and not s.committed
    assert s.failed[0].error_type == "OSError" and "broken" in s.failed[0].traceback
    assert not os.path.exists(f"{ckptd.step_dir(root, 1)}/ckptd_manifest.json")
    assert tracker(root) is None

    # Later steps and later saves of the same name are unaffected.
    coord.save_async("optimizer", lambda: _write(root, 2, "opt.bin"), 2)
    coord.register(2, checkpoint_thread_count=1)
    coord.wait_all()
    coord.wait_committed(2, timeout_s=30)
    assert ckptd.latest_step(root) == 2


@pytest.mark.parametrize("restart", [False, True])
def test_a_checkpoint_unit_failing_before_the_registration_leaves_the_state_dict_to_commit(
        make_monitor, tmp_path, restart):
    """Found by the chaos test (seed 2510326555): the checkpoint unit of step 1 fails before the
    trainer registers the step's full checkpoint with one state-dict unit. The registration
    reports the failure, and still counts: the state dict of step 1 commits, as it does when the
    failure comes after the registration (also across a monitor restart in between)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.save_sync(lambda: _write(root, 0, "sd.bin"), 0, is_state_dict=True)
    coord.register(0, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(0, is_state_dict=True, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.save_sync(lambda: 1 / 0, 1)  # the checkpoint unit: failed and reported
    with pytest.raises(ckptd.CheckpointSaveError, match="ZeroDivisionError") as info:
        coord.register(1, state_dict_thread_count=1, checkpoint_thread_count=1)
    assert info.value.kind == "checkpoint"
    if restart:
        restart_monitor(monitor)
    coord.save_async("model", lambda: _write(root, 1, "sd.bin"), 1, is_state_dict=True)
    coord.wait_all()
    coord.wait_committed(1, is_state_dict=True, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError, match="ZeroDivisionError"):
        coord.wait_committed(1, timeout_s=30)
    assert tracker(root, "latest_state_dict_iteration.txt") == "1\n"
    assert ckptd.latest_step(root, "state_dict") == 1 and ckptd.latest_step(root) is None
    assert [f["path"] for f in manifest(root, 1, Kind.STATE_DICT)["files"]] == ["sd.bin"]
    assert not os.path.exists(f"{ckptd.step_dir(root, 1)}/{MANIFESTS[Kind.CHECKPOINT]}")


def test_save_sync_failure_raises_at_once(env):
    root, s = env.root, env.s
    coord = env.coord()
    coord.save_sync(lambda: _write(root, s + 1, "a.bin"), s + 1)
    coord.save_sync(lambda: _write(root, s + 1, "b.bin"), s + 1)  # a second unit, not a duplicate
    coord.register(s + 1, checkpoint_thread_count=2)
    coord.wait_committed(s + 1, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError) as info:
        coord.save_sync(lambda: 1 / 0, s + 2)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_same_name_serialised_different_names_concurrent(env):
    s = env.s
    coord = env.coord(max_pending=4)
    running: list[str] = []
    overlaps: list[tuple[str, ...]] = []
    lock = threading.Lock()
    both_in = threading.Barrier(2, timeout=30)

    def unit(label: str, meet: bool):
        def fn():
            with lock:
                running.append(label)
                overlaps.append(tuple(sorted(running)))
            if meet:
                both_in.wait()  # only returns if the other name runs at the same time
            with lock:
                running.remove(label)
        return fn

    coord.save_async("a", unit("a1", True), s + 1)
    coord.save_async("b", unit("b1", True), s + 1)
    for i in range(2, 5):
        coord.save_async("a", unit(f"a{i}", False), s + i)
    coord.wait_all()
    a_runs = [o for o in overlaps if sum(x.startswith("a") for x in o) > 1]
    assert a_runs == []  # never two units of name "a" at once
    assert ("a1", "b1") in overlaps


def test_bad_input_is_refused_before_anything_is_written(env, tmp_path):
    root, monitor, s = env.root, env.monitor, env.s
    coord = env.coord()
    before = sorted(os.listdir(root))
    cases = [
        lambda: coord.save_async("model", lambda: None, -1),
        lambda: coord.save_async("model", lambda: None, 1.5),
        lambda: coord.save_async("../etc", lambda: None, s + 1),
        lambda: coord.save_async("a/b", lambda: None, s + 1),
        lambda: coord.save_async("", lambda: None, s + 1),
        lambda: coord.save_async("model", "not callable", s + 1),
        lambda: coord.register(s + 1, checkpoint_thread_count=-2),
        lambda: coord.register(-3, checkpoint_thread_count=1),
        lambda: coord.register(s + 1),  # nothing to register
    ]
    for case in cases:
        with pytest.raises(ckptd.CheckpointConfigError):
            case()
    assert sorted(os.listdir(root)) == before
    coord.register(s + 4, checkpoint_thread_count=2)
    coord.register(s + 4, checkpoint_thread_count=1)  # registrations add up, as Trinity's counters do
    assert status(monitor).step(s + 4).expected == 3
    with pytest.raises(ckptd.CheckpointConfigError, match="unknown option 'save_stratgy'"):
        ckptd.start_monitor(root, run="other", save_stratgy="single_thread")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ckptd.CheckpointConfigError, match="cannot be written"):
        ckptd.start_monitor(str(not_a_dir), run="other2")
    with pytest.raises(ckptd.CheckpointConfigError, match="already exists, and this call asks for something else: "
                                                          "root: .* there, .*elsewhere.* asked. Use ckptd.get_monitor"):
        ckptd.start_monitor(str(tmp_path / "elsewhere"), run=status(monitor).run)
    # Only what differs is named, not every option.
    differs = r"something else: max_ckpt_to_keep: \w+ there, 97 asked"
    with pytest.raises(ckptd.CheckpointConfigError, match=differs) as e:
        ckptd.start_monitor(root, run=status(monitor).run, max_ckpt_to_keep=97)
    assert "save_strategy" not in str(e.value) and "step_timeout_s" not in str(e.value)


def test_save_fn_may_return_its_paths(env, tmp_path):
    root, s = env.root, env.s
    coord = env.coord()

    def fn():
        _write(root, s + 1, "x.bin")
        return [f"{ckptd.step_dir(root, s + 1)}/x.bin"]

    coord.save_async("model", fn, s + 1)
    coord.register(s + 1, checkpoint_thread_count=1)
    coord.wait_committed(s + 1, timeout_s=30)
    assert [f["path"] for f in manifest(root, s + 1)["files"]] == ["x.bin"]
    coord.save_async("outside", lambda: [str(tmp_path / "elsewhere.bin")], s + 2)
    with pytest.raises(ckptd.CheckpointSaveError, match="outside the step directory"):
        coord.wait_all()


def _write(root: str, step: int, name: str, data: bytes = b"x" * 1000) -> None:
    d = ckptd.step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/{name}", "wb") as f:
        f.write(data)


def test_a_state_dict_wait_on_a_forgotten_checkpoint_only_step_answers_committed(make_monitor, tmp_path):
    """Steps 1 to 3 commit full checkpoints only, and the monitor keeps one step's record
    (``status_history=1``). A state-dict wait on step 1 (older than the newest commit, its record
    pruned) is answered from the checkpoint that committed it, not "unknown to the monitor".
    Found by a helper's attack (session 33)."""
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root, status_history=1, max_ckpt_to_keep=None), worker_id="w0")
    for step in (1, 2, 3):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    assert tracker(root, "latest_state_dict_iteration.txt") == "3\n"
    for step in (1, 3):
        coord.wait_committed(step, is_state_dict=True, timeout_s=30)
    with pytest.raises(ckptd.CheckpointError, match="unknown to the monitor"):
        coord.wait_committed(0, is_state_dict=True, timeout_s=30)  # never saved
    coord.close()
