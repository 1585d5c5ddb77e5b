"""The mirror tier: a local root mirrored to a real S3-protocol server (moto) on 127.0.0.1.

Faults come from a real server being stopped, a real monitor process being killed, and
``faulty://``, a fault-injecting fsspec wrapper in front of the real S3 client
(``tests/faulty_fs.py``), which the monitor's process gets through Ray's
``worker_process_setup_hook``.
"""

from __future__ import annotations

import os

import pytest
import ray
import torch

import ckptd
from ckptd.config import Kind
from ckptd.layout import committed_steps, read_tracker
from ckptd.storage import Storage
from ckptd.workers import save_sharded
from tests import faulty_fs
from tests.integration.conftest import start_ray
from tests.integration.helpers import status, wait_for, weights
from tests.s3server import S3Server

faulty_fs.register()  # in this (driver) process; the setup hook does it in Ray's workers

FAST_RETRIES = {"retries": 2, "retry_backoff_s": 0.01, "retry_after_s": 600}


@pytest.fixture(scope="module")
def ray_local():
    """Ray whose workers know the faulty:// filesystem: not the instance other modules share."""
    if ray.is_initialized():
        ray.shutdown()
    start_ray({"worker_process_setup_hook": "tests.faulty_fs.register"})
    yield
    ray.shutdown()


def faulty(s3_opts: dict, *faults: dict) -> dict:
    """mirror_storage_options for faulty:// over S3, with fail-fast S3 clients."""
    target = {**s3_opts, "config_kwargs": {"retries": {"max_attempts": 1}}}
    return {"target_protocol": "s3", "target_options": target, "faults": list(faults), "skip_instance_cache": True}


def linear(step: int) -> dict[str, torch.Tensor]:
    w = weights(step)
    return {"weight": w["w"], "bias": w["b"]}


def save_step(coord, step: int, parts: int = 1, weights_as_state_dict: bool = False) -> None:
    """A committed full checkpoint of ``parts`` sharded models (two files each). With
    ``weights_as_state_dict``, part 0 is saved as the step's state dict, as pipelines do."""
    out = coord.step_dir(step)
    for p in range(parts):
        sd, dest, as_sd = linear(step + 1000 * p), f"{out}/model{p}", weights_as_state_dict and p == 0
        coord.save_async(f"model{p}", lambda sd=sd, dest=dest: save_sharded(dest, sd, rank=0, world_size=1), step,
                         is_state_dict=as_sd)
    coord.register(step, state_dict_thread_count=int(weights_as_state_dict),
                   checkpoint_thread_count=parts - int(weights_as_state_dict))
    coord.wait_committed(step, timeout_s=60)
    if weights_as_state_dict:
        coord.wait_committed(step, is_state_dict=True, timeout_s=60)


def local_steps(root: str) -> set[int]:
    return {int(n.rsplit("_", 1)[1]) for n in os.listdir(root) if n.startswith("global_step_")}


def test_bad_mirrors_are_refused_before_anything_is_written(ray_local, tmp_path, run_name, s3_server):
    root = str(tmp_path / "ckpt")
    with pytest.raises(ckptd.CheckpointConfigError, match="overlaps the checkpoint root"):
        ckptd.start_monitor(root, run=run_name, mirror=f"{root}/mirror")
    with pytest.raises(ckptd.CheckpointConfigError, match="cannot be written"):
        ckptd.start_monitor(root, run=run_name, mirror="s3://no-such-bucket-ckptd/run",
                            mirror_storage_options=s3_server.options())
    with pytest.raises(ckptd.CheckpointConfigError, match="mirror.retries"):
        ckptd.start_monitor(root, run=run_name, mirror={"url": "s3://b/r", "retries": -1})
    assert [f for _, _, files in os.walk(root) for f in files] == []  # nothing but the removed probe


def test_steps_are_mirrored_verified_retained_per_tier_and_resumed_on_a_fresh_node(make_monitor, tmp_path, s3_root):
    mirror, opts = s3_root
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_ckpt_to_keep=2, mirror={"url": mirror, "max_ckpt_to_keep": 3},
                           mirror_storage_options=opts)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    for step in range(1, 6):
        save_step(coord, step, parts=2, weights_as_state_dict=True)
    coord.wait_mirrored(5, timeout_s=120)
    assert ray.get(monitor.wait_retention.remote(60))

    remote = Storage(mirror, opts)
    assert local_steps(root) == {4, 5}  # keep 2 locally
    assert committed_steps(remote, Kind.CHECKPOINT) == [3, 4, 5]  # and 3 on the mirror
    assert read_tracker(remote, Kind.CHECKPOINT) == 5
    mirrored = ckptd.verify(mirror, storage_options=opts)  # every file checked against the manifests
    assert mirrored.kinds == {Kind.CHECKPOINT, Kind.STATE_DICT}  # the state-dict files went up too
    assert sorted(mirrored.files) == sorted(ckptd.verify(root).files)
    shown = status(monitor).mirror
    assert [s.state for s in shown.steps] == ["mirrored"] * 5 and shown.queued == [] and shown.retried_requests == 0
    assert shown.deleted_steps == [1, 2] and shown.trackers.checkpoint == 5
    assert opts["secret"] not in shown.model_dump_json()

    # A job restarted on a fresh node: its local root does not exist; the mirror has step 5.
    fresh = torch.nn.Linear(64, 64)
    fresh_root = str(tmp_path / "fresh-node" / "ckpt")
    assert ckptd.resume(fresh_root, model=fresh, model_dir="model0") is None
    state = ckptd.resume(fresh_root, model=fresh, model_dir="model0", mirror=mirror, mirror_storage_options=opts)
    assert state.step == 5 and state.path == f"{mirror}/global_step_5"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in linear(5).items())
    # With both tiers at step 5, the local one is read.
    assert ckptd.resume(root, model=fresh, model_dir="model0", mirror=mirror,
                        mirror_storage_options=opts).path == f"{root}/global_step_5"


def test_a_transient_error_on_the_nth_request_is_retried(make_monitor, tmp_path, s3_root):
    mirror, opts = s3_root
    url = mirror.replace("s3://", "faulty://")
    # The monitor's 2nd and 3rd writes to the mirror fail (step 1 has two files, then a manifest).
    monitor = make_monitor(str(tmp_path / "ckpt"), runtime_env=faulty_fs.ARMED,
                           mirror={"url": url, **FAST_RETRIES, "retries": 3},
                           mirror_storage_options=faulty(opts, {"request": "write", "at": 2, "times": 2}))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    save_step(coord, 1)
    coord.wait_mirrored(1, timeout_s=60)
    shown = status(monitor).mirror
    assert shown.retried_requests == 2 and shown.step(1).attempts == 1 and shown.step(1).state == "mirrored"
    assert ckptd.verify(mirror, storage_options=opts).step == 1


def test_an_outage_past_the_retry_limit_fails_the_upload_keeps_the_steps_and_recovers(make_monitor, tmp_path, s3_root):
    mirror, opts = s3_root
    root, outage = str(tmp_path / "ckpt"), tmp_path / "outage"
    outage.touch()
    down = {"request": "write", "at": 1, "while_exists": str(outage)}
    url = mirror.replace("s3://", "faulty://")
    monitor = make_monitor(root, max_ckpt_to_keep=2, runtime_env=faulty_fs.ARMED, mirror={"url": url, **FAST_RETRIES},
                           mirror_storage_options=faulty(opts, down))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    save_step(coord, 1)
    failed = wait_for(lambda: (s := status(monitor).mirror.step(1)) and s.state == "failed" and s,
                      what="a failed upload")
    assert failed.attempts == 1 and "injected fault" in failed.error
    # retries=2: each of the step's two files (shard and metadata) is tried three times, then no more.
    assert status(monitor).mirror.retried_requests == 4
    with pytest.raises(TimeoutError):
        coord.wait_mirrored(1, timeout_s=0.5)
    remote = Storage(mirror, opts)
    assert committed_steps(remote, Kind.CHECKPOINT) == [] and read_tracker(remote, Kind.CHECKPOINT) is None

    for step in (2, 3):
        save_step(coord, step)
    wait_for(lambda: [s.state for s in status(monitor).mirror.steps] == ["failed"] * 3, what="three failed uploads")
    assert ray.get(monitor.wait_retention.remote(60))
    assert local_steps(root) == {1, 2, 3}  # keep 2 locally, but nothing leaves before it is mirrored

    outage.unlink()  # the mirror is back
    ray.get(monitor.retry_mirror.remote())
    coord.wait_mirrored(3, timeout_s=60)
    assert committed_steps(remote, Kind.CHECKPOINT) == [1, 2, 3] and read_tracker(remote, Kind.CHECKPOINT) == 3
    assert [s.attempts for s in status(monitor).mirror.steps] == [2, 2, 2]
    assert ray.get(monitor.wait_retention.remote(60))
    assert local_steps(root) == {2, 3}


def test_the_server_stopped_mid_upload_and_back_empty(make_monitor, tmp_path):
    server = S3Server().start()
    try:
        bucket = server.new_bucket()
        marker, go = tmp_path / "paused", tmp_path / "go"
        monitor = make_monitor(str(tmp_path / "ckpt"), runtime_env=faulty_fs.ARMED,
                               mirror={"url": f"faulty://{bucket}/run", **FAST_RETRIES},
                               mirror_storage_options=faulty(server.options(), {
                                   "request": "write", "at": 2, "action": "pause", "marker": str(marker),
                                   "resume": str(go)}))
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
        save_step(coord, 1, parts=3)
        wait_for(marker.exists, what="the upload to reach its second file")
        server.stop()  # mid-upload: one file may be up, the others are not
        go.touch()
        failed = wait_for(lambda: (s := status(monitor).mirror.step(1)) and s.state == "failed" and s,
                          what="the upload to fail")
        assert "Error" in failed.error

        server.start()  # back, but empty (moto keeps nothing): the whole step must go up again
        server.client().create_bucket(Bucket=bucket)
        ray.get(monitor.retry_mirror.remote())
        coord.wait_mirrored(1, timeout_s=60)
        checked = ckptd.verify(f"s3://{bucket}/run", storage_options=server.options())
        assert checked.step == 1 and len(checked.files) == 6  # 3 parts: shard + metadata each
    finally:
        server.stop()


def test_an_upload_killed_part_way_leaves_no_manifest_and_a_new_monitor_finishes_it(
        make_monitor, tmp_path, s3_root, run_name):
    mirror, opts = s3_root
    root, marker = str(tmp_path / "ckpt"), tmp_path / "paused"
    # Step 1 takes writes 1-7 on the mirror (4 files, the manifest, 2 trackers); files go up one at a
    # time; pause at step 2's second file, and kill the monitor's process there.
    monitor = make_monitor(root, runtime_env=faulty_fs.ARMED,
                           mirror={"url": mirror.replace("s3://", "faulty://"), **FAST_RETRIES, "concurrency": 1},
                           mirror_storage_options=faulty(opts, {
                               "request": "write", "at": 9, "action": "pause", "marker": str(marker),
                               "resume": str(tmp_path / "never")}))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    save_step(coord, 1, parts=2)
    coord.wait_mirrored(1, timeout_s=60)
    save_step(coord, 2, parts=2)
    wait_for(marker.exists, what="the upload of step 2 to reach its second file")
    ray.kill(monitor, no_restart=True)

    remote = Storage(mirror, opts)
    assert remote.walk_files(remote.join("global_step_2"))  # part of step 2 is up...
    assert committed_steps(remote, Kind.CHECKPOINT) == [1]  # ...but it has no manifest
    assert read_tracker(remote, Kind.CHECKPOINT) == 1 and ckptd.latest_step(mirror, storage_options=opts) == 1

    again = make_monitor(root, run=run_name + "-again", mirror={"url": mirror, **FAST_RETRIES},
                         mirror_storage_options=opts)
    ckptd.CheckpointCoordinator(again, worker_id="rank0").wait_mirrored(2, timeout_s=60)
    assert committed_steps(remote, Kind.CHECKPOINT) == [1, 2] and read_tracker(remote, Kind.CHECKPOINT) == 2
    assert ckptd.verify(mirror, storage_options=opts).step == 2
