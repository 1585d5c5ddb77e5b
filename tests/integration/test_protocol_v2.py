"""Protocol v2: Trinity's exact commit semantics and a "latest" that stays true across crashes,
retries, restarts and new jobs. One test per scenario of the issue, with a real monitor actor,
real coordinators and real files."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import ray
import torch

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS

from .helpers import HalfWriter, Signal, restart_monitor, status, wait_all, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")

# The tests that look only at their own steps share one monitor (``env``); those that look at the
# trackers, restart or replace the monitor, or need options of their own start one each.
SHARED_MONITOR_OPTIONS = {"max_state_dict_to_keep": None}  # no test's steps go while another runs


def write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def manifest(root: str, step: int, kind: Kind = Kind.CHECKPOINT) -> dict:
    with open(f"{ckptd.step_dir(root, step)}/{MANIFESTS[kind]}") as f:
        return json.load(f)


def tracker(root: str, kind: Kind = Kind.CHECKPOINT) -> int | None:
    name = "latest_checkpointed_iteration.txt" if kind is Kind.CHECKPOINT else "latest_state_dict_iteration.txt"
    try:
        with open(os.path.join(root, name)) as f:
            return int(f.read())
    except FileNotFoundError:
        return None


# -- Trinity's own calls ------------------------------------------------------------------------


def test_trinity_save_checkpoint_moves_both_trackers(make_monitor, tmp_path):
    """Trinity's worker wraps the engine's save in save_sync(is_state_dict=True) on rank 0; the trainer
    then registers the full checkpoint as register_and_monitor(S, state_dict_thread_count=1)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    coord.save_sync(lambda: [write(f"{coord.step_dir(4)}/actor/model.pt", b"weights4")], 4, is_state_dict=True)
    asyncio.run(coord.register_and_monitor(4, state_dict_thread_count=1))
    coord.wait_committed(4, timeout_s=30)
    assert tracker(root) == 4 and tracker(root, Kind.STATE_DICT) == 4
    assert ckptd.verify(root, 4).files.keys() == {"actor/model.pt"}


def test_a_full_checkpoint_without_state_dict_units_counts_as_the_steps_state_dict(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(3)}/m.bin", b"m")], 3)
    coord.register(3, checkpoint_thread_count=1)
    coord.wait_committed(3, is_state_dict=True, timeout_s=30)  # as latest_step(root, "state_dict") says
    assert tracker(root, Kind.STATE_DICT) == 3 and ckptd.latest_step(root, "state_dict") == 3


def test_state_dict_then_full_checkpoint_of_the_same_step(make_monitor, tmp_path):
    """save_state_dict(S), then save_checkpoint(S) of the same weights: both trackers reach S."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    out = coord.step_dir(2)
    coord.save_async("sd", lambda: [write(f"{out}/actor/model.pt", b"w2")], 2, is_state_dict=True)
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(2, is_state_dict=True, timeout_s=30)
    assert tracker(root, Kind.STATE_DICT) == 2 and tracker(root) is None
    # save_checkpoint(S): the engine rewrites the same weights (same bytes) and adds the optimizer
    coord.save_sync(lambda: [write(f"{out}/actor/model.pt", b"w2"), write(f"{out}/actor/optim.pt", b"o2")],
                    2, is_state_dict=True)
    coord.register(2, state_dict_thread_count=1)
    coord.wait_committed(2, timeout_s=30)
    assert tracker(root) == 2 and tracker(root, Kind.STATE_DICT) == 2
    assert set(ckptd.verify(root, 2).files) == {"actor/model.pt", "actor/optim.pt"}
    assert manifest(root, 2, Kind.STATE_DICT)["files"][0]["path"] == "actor/model.pt"


def test_full_checkpoint_waits_for_the_steps_state_dict_and_fails_with_it(make_monitor, tmp_path):
    """A full checkpoint of S must not move the state-dict tracker while S's weights are still
    being written, nor commit when their save failed; resume then uses the previous step."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    gate = Signal.remote()

    def slow_weights():
        ray.get(gate.wait.remote())
        return [write(f"{coord.step_dir(1)}/model.pt", b"w1")]

    coord.save_async("weights", slow_weights, 1, is_state_dict=True)
    coord.save_async("optim", lambda: [write(f"{coord.step_dir(1)}/optim.pt", b"o1")], 1)
    coord.register(1, state_dict_thread_count=1, checkpoint_thread_count=1)
    with pytest.raises(TimeoutError):
        coord.wait_committed(1, timeout_s=0.5)
    assert tracker(root) is None and tracker(root, Kind.STATE_DICT) is None
    ray.get(gate.send.remote())
    coord.wait_committed(1, timeout_s=30)
    assert tracker(root) == 1 and tracker(root, Kind.STATE_DICT) == 1

    def broken():
        raise OSError("disk full")

    coord.save_async("weights", broken, 2, is_state_dict=True)
    coord.save_async("optim", lambda: [write(f"{coord.step_dir(2)}/optim.pt", b"o2")], 2)
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_all()
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.register(2, state_dict_thread_count=1, checkpoint_thread_count=1)
    assert tracker(root) == 1 and tracker(root, Kind.STATE_DICT) == 1
    assert ckptd.latest_step(root) == 1


def test_two_calls_with_the_same_name_and_step_are_two_units(env):
    root, monitor, step = env.root, env.monitor, env.s + 1
    coord = env.coord()
    coord.save_async("model", lambda: [write(f"{coord.step_dir(step)}/a.bin", b"a")], step)
    coord.register(step, checkpoint_thread_count=2)
    coord.wait_all()
    s = status(monitor).step(step)
    assert len(s.finished) == 1 and not s.committed  # one of two registered units
    coord.save_async("model", lambda: [write(f"{coord.step_dir(step)}/b.bin", b"b")], step)
    coord.wait_committed(step, timeout_s=30)
    assert len(manifest(root, step)["units"]) == 2


# -- files written outside units -----------------------------------------------------------------


def test_files_other_ranks_wrote_outside_units_are_in_the_manifest(env):
    """Trinity's FSDP state-dict save: only rank 0 saves through the coordinator (its save_fn
    returns None); the other ranks torch.save their shards before rank 0's save thread starts."""
    root, step = env.root, env.s + 3
    coord = ckptd.CheckpointCoordinator(env.monitor, worker_id=f"rank0-{env.s}")
    out = coord.step_dir(step)
    for rank in (1, 2, 3):
        os.makedirs(out, exist_ok=True)
        torch.save({"w": torch.full((64,), float(rank))}, f"{out}/model_rank{rank}.pt")
    coord.save_async("sd", lambda: torch.save({"w": torch.zeros(64)}, f"{out}/model_rank0.pt"), step,
                     is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(step, is_state_dict=True, timeout_s=30)
    listed = {f["path"] for f in manifest(root, step, Kind.STATE_DICT)["files"]}
    assert listed == {f"model_rank{r}.pt" for r in range(4)}
    with open(f"{out}/model_rank2.pt", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ckptd.CorruptCheckpointError, match="model_rank2.pt"):
        ckptd.verify(root, step)


def test_attribution_with_old_mtimes_and_the_other_kind_writing_beside(env, tmp_path):
    """A save_fn returning None that copies files with their old mtimes (shutil.copytree of a
    tokenizer), while a checkpoint unit of the same step is still writing its own file."""
    root, step = env.root, env.s + 1
    src = tmp_path / "tokenizer"
    src.mkdir()
    (src / "vocab.json").write_text('{"a": 1}')
    os.utime(src / "vocab.json", (1_000_000, 1_000_000))
    coord = env.coord()
    out = coord.step_dir(step)
    slow_optimizer = HalfWriter(f"{out}/optim.pt")
    coord.save_async("optim", slow_optimizer, step)
    assert slow_optimizer.half_written.wait(30)
    coord.save_async("tok", lambda: shutil.copytree(src, f"{out}/tokenizer", dirs_exist_ok=True) and None, step,
                     is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.register(step, checkpoint_thread_count=1)
    with pytest.raises(TimeoutError):
        coord.wait_committed(step, is_state_dict=True, timeout_s=1.0)  # waits: optim.pt is unattributed
    slow_optimizer.release()
    coord.wait_committed(step, timeout_s=30)
    sd = {f["path"]: f["size"] for f in manifest(root, step, Kind.STATE_DICT)["files"]}
    assert sd == {"tokenizer/vocab.json": 8}
    full = {f["path"]: f["size"] for f in manifest(root, step)["files"]}
    assert full == {"tokenizer/vocab.json": 8, "optim.pt": len(b"half-and-the-rest")}
    ckptd.verify(root, step)


def test_a_save_fn_returning_none_does_not_take_the_other_kinds_half_written_file(env):
    """The state-dict unit returns None and so finds files by time; a checkpoint unit of the same
    step writes half of its file after that unit started. The half file must not enter the state
    dict's manifest: the state dict waits until the checkpoint unit has reported it."""
    root, step = env.root, env.s + 1
    coord = env.coord()
    out = coord.step_dir(step)
    optimizer = HalfWriter(f"{out}/optim.pt")

    def weights():  # returns None
        assert optimizer.half_written.wait(30)
        write(f"{out}/model.pt", b"weights")

    coord.save_async("weights", weights, step, is_state_dict=True)
    coord.save_async("optim", optimizer, step)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.register(step, checkpoint_thread_count=1)
    with pytest.raises(TimeoutError):
        coord.wait_committed(step, is_state_dict=True, timeout_s=1.0)
    optimizer.release()
    coord.wait_committed(step, timeout_s=30)
    assert wait_all(coord) is None
    assert {f["path"] for f in manifest(root, step, Kind.STATE_DICT)["files"]} == {"model.pt"}
    full = {f["path"]: f["size"] for f in manifest(root, step)["files"]}
    assert full == {"model.pt": 7, "optim.pt": len(b"half-and-the-rest")}
    ckptd.verify(root, step)


# -- committed steps are immutable ---------------------------------------------------------------


def test_a_save_into_a_committed_step_is_refused_before_it_runs(env):
    root, step = env.root, env.s + 1
    coord = env.coord()
    coord.save_async("model", lambda: [write(f"{coord.step_dir(step)}/m.bin", b"v1")], step)
    coord.register(step, checkpoint_thread_count=1)
    coord.wait_committed(step, timeout_s=30)
    ran = []
    coord.save_async("model", lambda: ran.append(write(f"{coord.step_dir(step)}/m.bin", b"v2")), step)
    with pytest.raises(ckptd.CheckpointSaveError, match="already committed as a checkpoint"):
        coord.wait_all()
    assert ran == []
    with pytest.raises(ckptd.CheckpointSaveError, match="already committed"):
        coord.save_sync(lambda: ran.append(1), step, is_state_dict=True)
    assert ran == []
    with pytest.raises(ckptd.CheckpointConfigError, match="retire"):
        coord.register(step, checkpoint_thread_count=1)
    ckptd.verify(root, step)


def test_a_unit_that_rewrites_a_committed_state_dict_file_fails(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    out = coord.step_dir(1)
    coord.save_async("sd", lambda: [write(f"{out}/model.pt", b"weights")], 1, is_state_dict=True)
    coord.register(1, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(1, is_state_dict=True, timeout_s=30)
    with pytest.raises(ckptd.CheckpointSaveError, match="committed files must not change"):
        coord.save_sync(lambda: [write(f"{out}/model.pt", b"CHANGED")], 1, is_state_dict=True)
    with pytest.raises(ckptd.CheckpointSaveError, match="committed files must not change"):
        coord.register(1, state_dict_thread_count=1)  # answered once the failure is on storage
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(1, is_state_dict=True, timeout_s=30)  # answered once the manifest is gone
    # No manifest claims the bytes that are gone: the state dict of step 1 is withdrawn.
    assert tracker(root) is None and tracker(root, Kind.STATE_DICT) is None
    assert not os.path.exists(f"{out}/{MANIFESTS[Kind.STATE_DICT]}")
    assert ckptd.latest_step(root, "state_dict") is None
    assert status(monitor).step(1, "state_dict").state.value == "failed"


def test_retire_lets_a_job_resumed_from_an_older_step_save_the_newer_steps_again(ray_local, tmp_path, run_name,
                                                                                  capsys):
    root = str(tmp_path / "ckpt")
    monitor = ckptd.start_monitor(root, run=run_name)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    for step in (1, 2, 3):
        coord.save_async("m", lambda s=step: [write(f"{coord.step_dir(s)}/m.bin", b"old%d" % s)], step)
        coord.register(step, checkpoint_thread_count=1)
    for step in (1, 2, 3):  # each: steps commit independently, and the monitor is killed next
        coord.wait_committed(step, timeout_s=30)
    coord.close()
    with pytest.raises(ckptd.CheckpointConfigError, match="is live"):
        ckptd.retire_steps(root, after=1)
    ray.kill(monitor, no_restart=True)
    from ckptd.cli import main

    assert main(["retire", root, "--after", "1"]) == 0  # without --yes: only says what would go
    assert ckptd.latest_step(root) == 3
    assert main(["retire", root, "--after", "1", "--yes"]) == 0
    assert "retired steps [2, 3]; latest checkpoint is now 1" in capsys.readouterr().out
    assert ckptd.latest_step(root) == 1 and tracker(root) == 1
    assert sorted(n for n in os.listdir(root) if n.startswith("global_step_")) == ["global_step_1"]
    monitor = ckptd.start_monitor(root, run=run_name)
    try:
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
        coord.save_async("m", lambda: [write(f"{coord.step_dir(2)}/m.bin", b"new2")], 2)
        coord.register(2, checkpoint_thread_count=1)
        coord.wait_committed(2, timeout_s=30)
        assert ckptd.latest_step(root) == 2
        assert open(f"{ckptd.step_dir(root, 2)}/m.bin", "rb").read() == b"new2"
    finally:
        ray.kill(monitor, no_restart=True)


# -- crash, resume, save again; two monitors on one root ----------------------------------------


def test_a_new_job_never_counts_a_dead_jobs_records(ray_local, tmp_path, run_name):
    """Records and files of a crashed job do not count toward the next job's save of the same step."""
    root = str(tmp_path / "ckpt")
    monitor = ckptd.start_monitor(root, run=run_name)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"one")], 1)
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)
    # Step 2 of the crashed job: 2 of 3 units finished, a shard of another world size
    coord.save_async("a", lambda: [write(f"{coord.step_dir(2)}/a.bin", b"old-a")], 2)
    coord.save_async("b", lambda: [write(f"{coord.step_dir(2)}/rank3.bin", b"old-rank3")], 2)
    coord.register(2, checkpoint_thread_count=3)
    coord.wait_all()
    ray.kill(monitor, no_restart=True)  # the job dies
    # Another tool's checkpoint that ckptd has no trace of: never touched.
    foreign = write(f"{root}/global_step_7/trinity_model.pt", b"foreign")

    monitor = ckptd.start_monitor(root, run=run_name)
    try:
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
        assert status(monitor).attempt == 2 and status(monitor).step(2) is None
        assert not os.path.exists(f"{ckptd.step_dir(root, 2)}/rank3.bin")  # cleared: it starts clean
        coord.save_async("a", lambda: [write(f"{coord.step_dir(2)}/a.bin", b"new-a")], 2)
        coord.save_async("b", lambda: [write(f"{coord.step_dir(2)}/b.bin", b"new-b")], 2)
        coord.register(2, checkpoint_thread_count=2)
        coord.wait_committed(2, timeout_s=30)
        assert set(ckptd.verify(root, 2).files) == {"a.bin", "b.bin"}
        assert manifest(root, 2)["attempt"] == 2
        assert open(foreign, "rb").read() == b"foreign"
        ckptd.verify(root, 1)
    finally:
        ray.kill(monitor, no_restart=True)


def test_a_second_monitor_on_a_root_is_refused_and_a_takeover_fences_the_first(ray_local, tmp_path, run_name):
    root = str(tmp_path / "ckpt")
    first = ckptd.start_monitor(root, run=run_name)
    second = None
    try:
        coord = ckptd.CheckpointCoordinator(first, worker_id="w")
        coord.save_async("m", lambda: [write(f"{coord.step_dir(20)}/m.bin", b"20")], 20)
        coord.register(20, checkpoint_thread_count=1)
        coord.wait_committed(20, timeout_s=30)
        before = sorted(os.listdir(root))
        with pytest.raises(ckptd.CheckpointConfigError, match=f"live monitor of run '{run_name}'"):
            ckptd.start_monitor(root, run=run_name + "-b")
        assert sorted(os.listdir(root)) == before
        with pytest.raises(ckptd.CheckpointConfigError, match="live monitor"):
            ckptd.start_monitor(root, run=run_name, namespace="elsewhere")
        second = ckptd.start_monitor(root, run=run_name + "-b", takeover=True)
        wait_for(lambda: _dead(first), what="the first monitor to be stopped")
        c2 = ckptd.CheckpointCoordinator(second, worker_id="w2")
        c2.save_async("m", lambda: [write(f"{c2.step_dir(15)}/m.bin", b"15")], 15)
        c2.register(15, checkpoint_thread_count=1)
        c2.wait_committed(15, timeout_s=30)
        assert tracker(root) == 20 and ckptd.latest_step(root) == 20  # never backwards
        assert status(second).attempt == 2
    finally:
        for h in (first, second):
            if h is not None:
                ray.kill(h, no_restart=True)


def _dead(handle) -> bool:
    try:
        ray.get(handle.ping.remote(), timeout=5)
        return False
    except Exception:
        return True


def test_a_fenced_monitor_publishes_nothing(ray_local, tmp_path, run_name):
    """A stale monitor (its root taken over by a newer attempt it does not know of) can never move
    a tracker or write a manifest."""
    from ckptd.monitor.attempts import open_attempt
    from ckptd.storage import Storage

    root = str(tmp_path / "ckpt")
    monitor = ckptd.start_monitor(root, run=run_name)
    try:
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
        open_attempt(Storage(root), "intruder", None)  # a newer job, e.g. on another Ray cluster
        coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"1")], 1)
        coord.register(1, checkpoint_thread_count=1)
        with pytest.raises(ckptd.CheckpointSaveError, match="superseded by attempt 2"):
            coord.wait_committed(1, timeout_s=30)
        assert tracker(root) is None and not os.path.exists(f"{ckptd.step_dir(root, 1)}/{MANIFESTS[Kind.CHECKPOINT]}")
        assert "superseded" in status(monitor).fenced
    finally:
        ray.kill(monitor, no_restart=True)


# -- failures are durable ------------------------------------------------------------------------


def test_a_failure_survives_a_monitor_restart_and_a_retry_under_the_same_name(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")

    def broken():
        raise OSError("bad sector")

    coord.save_async("model", broken, 1)
    assert "bad sector" in wait_all(coord)
    coord.save_async("model", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"retry")], 1)  # refused: failed
    assert "has already failed" in wait_all(coord)
    restart_monitor(monitor)
    with pytest.raises(ckptd.CheckpointSaveError, match="bad sector"):
        coord.register(1, checkpoint_thread_count=1)
    assert tracker(root) is None


def test_an_uncertain_publish_is_settled_by_reading_storage(make_monitor, tmp_path):
    """The manifest's publish raised after the rename: storage decides, and the step is committed."""
    from .helpers import failpoint_env

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, runtime_env=failpoint_env("after_publish=raise", tmp_path / "once"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"1")], 1)
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)
    assert tracker(root) == 1
    ckptd.verify(root, 1)


@pytest.mark.parametrize("fault", ["settle_sync=raise", "settle_read=raise"], ids=["sync-fails", "read-back-fails"])
def test_an_uncertain_publish_that_cannot_be_made_durable_is_taken_back_and_fails(make_monitor, tmp_path, fault):
    """The manifest is visible but syncing it fails again, or reading it back fails (whether it is
    there is unknown, and on an object store a sync proves nothing: it was counted as published
    once the sync passed): it is removed before anyone is told, and the step fails; readers never
    saw a step reported failed as committed."""
    from .helpers import failpoint_env

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=0, runtime_env=failpoint_env(f"after_publish=raise,{fault}"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"1")], 1)
    coord.register(1, checkpoint_thread_count=1)
    with pytest.raises(ckptd.CheckpointSaveError, match="FailpointError"):
        coord.wait_committed(1, timeout_s=30)
    assert not os.path.exists(f"{ckptd.step_dir(root, 1)}/{MANIFESTS[Kind.CHECKPOINT]}")
    assert tracker(root) is None and ckptd.latest_step(root) is None


def test_a_tracker_publish_taken_back_leaves_the_tracker_it_replaced(make_monitor, tmp_path):
    """Step 2's tracker publish raised after its rename and cannot be read back: taking it back
    removed the tracker, though it had named step 1, committed; a trainer resuming then found no
    checkpoint. The tracker that was there is put back. Found by helper-52's attack (session 34)."""
    from .helpers import arm_in_monitor, held_at

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"1")], 1)
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)
    gate = tmp_path / "gate"
    arm_in_monitor(monitor, "before_tracker_rename", f"until:30:{gate}")
    try:
        coord.save_async("m", lambda: [write(f"{coord.step_dir(2)}/m.bin", b"2")], 2)
        coord.register(2, checkpoint_thread_count=1)
        wait_for(lambda: held_at(monitor, "before_tracker_rename"), 30, "tracker 2 about to be renamed")
        arm_in_monitor(monitor, "after_publish", "raise")
        arm_in_monitor(monitor, "settle_read", "raise")
    finally:
        gate.touch()
    coord.wait_committed(2, timeout_s=30)  # committed: only its tracker could not be advanced
    for name in ("after_publish", "settle_read", "before_tracker_rename"):
        arm_in_monitor(monitor, name, None)
    assert tracker(root) == 1 and ckptd.latest_step(root) == 1
    wait_all(coord)


@pytest.mark.parametrize("storage_recovers_with", ["the sync", "the removal"])
def test_an_uncertain_publish_is_not_reported_while_storage_refuses_both_sync_and_removal(
        make_monitor, tmp_path, storage_recovers_with):
    """The manifest is visible, and storage refuses both syncing it and removing it for a while.
    The commit failed with the manifest still there: readers, and a restarted monitor, saw the
    step committed after its callers heard it failed. It now keeps trying until one of the two
    succeeds, and reports what storage then holds. Found by helper-50's attack (session 34)."""
    from .helpers import arm_in_monitor

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=0)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    sync_ok, rm_ok = tmp_path / "sync-ok", tmp_path / "rm-ok"
    arm_in_monitor(monitor, "after_publish", "raise")
    arm_in_monitor(monitor, "settle_sync", f"raise_until:{sync_ok}")
    arm_in_monitor(monitor, "settle_remove", f"raise_until:{rm_ok}")
    manifest = f"{ckptd.step_dir(root, 1)}/{MANIFESTS[Kind.CHECKPOINT]}"
    try:
        coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"1")], 1)
        coord.register(1, checkpoint_thread_count=1)
        wait_for(lambda: os.path.exists(manifest), 30, "the manifest renamed into place")
        with pytest.raises(TimeoutError):  # neither committed nor failed yet
            coord.wait_committed(1, timeout_s=2)
        assert os.path.exists(manifest)
        arm_in_monitor(monitor, "after_publish", None)  # the tracker's publish goes through
        (sync_ok if storage_recovers_with == "the sync" else rm_ok).touch()
        if storage_recovers_with == "the sync":
            coord.wait_committed(1, timeout_s=30)
            assert tracker(root) == 1
            ckptd.verify(root, 1)
        else:
            with pytest.raises(ckptd.CheckpointSaveError, match="FailpointError"):
                coord.wait_committed(1, timeout_s=30)
            assert not os.path.exists(manifest) and tracker(root) is None
    finally:
        sync_ok.touch()
        rm_ok.touch()
        for name in ("after_publish", "settle_sync", "settle_remove"):
            arm_in_monitor(monitor, name, None)
    wait_all(coord)


# -- early signals -------------------------------------------------------------------------------


def test_an_unregistered_step_is_flagged_early(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, unregistered_warning_s=0.2)
    coord = ckptd.CheckpointCoordinator(monitor)
    other = ckptd.CheckpointCoordinator(monitor)
    assert coord.worker_id != other.worker_id  # default ids are unique per coordinator
    coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"1")], 1)
    coord.wait_all()
    warnings = wait_for(lambda: status(monitor).warnings, what="a warning")
    assert "not registered" in warnings[0] and "register_and_monitor(global_step=1" in warnings[0]


def test_a_refused_start_monitor_writes_nothing(ray_local, tmp_path, run_name):
    root = tmp_path / "ckpt"
    root.mkdir()
    mirror = tmp_path / "mirror"
    (mirror / ".ckptd").mkdir(parents=True)
    (mirror / ".ckptd" / "layout.json").write_text(json.dumps({"step_dir_template": "step_{step}"}))
    with pytest.raises(ckptd.CheckpointConfigError, match="names its step directories"):
        ckptd.start_monitor(str(root), run=run_name, mirror=str(mirror))
    assert os.listdir(root) == []


def test_verify_checks_a_state_dict_only_step(env):
    root, step = env.root, env.s + 1
    coord = env.coord()
    coord.save_async("m", lambda: [write(f"{coord.step_dir(step)}/m.bin", b"1")], step, is_state_dict=True)
    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(step, is_state_dict=True, timeout_s=30)
    assert set(ckptd.verify(root, step).files) == {"m.bin"}
