"""A whole run on an S3 root: a real S3-protocol server on 127.0.0.1 (moto), real Ray, s3fs."""

from __future__ import annotations

import glob
import os

import pytest
import ray
import s3fs
import torch
from safetensors.torch import load as load_safetensors

import ckptd
from ckptd.cli import main
from tests.integration.helpers import StateSaver, restart_monitor, status, wait_for, weights
from tests.s3server import ACCESS_KEY, SECRET_KEY


def committed(monitor, step: int) -> bool:
    result = ray.get(monitor.wait_committed.remote(step, "checkpoint", 120))
    assert result["committed"], result
    return True


def keys(s3_server, bucket: str) -> set[str]:
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def test_a_run_on_s3_commits_with_manifests_and_trackers_and_applies_retention(make_monitor, s3_root, s3_server,
                                                                               run_name, monkeypatch, capsys):
    root, opts = s3_root
    bucket = root.split("/")[2]
    monitor = make_monitor(root, opts, max_ckpt_to_keep=2)
    a, b = StateSaver.remote(run_name, "a"), StateSaver.remote(run_name, "b")
    driver = ckptd.CheckpointCoordinator(monitor, worker_id="driver")
    for step in (1, 2, 3, 4):
        driver.register(step, checkpoint_thread_count=3)
        ray.get([a.save.remote(step, "a"), b.save.remote(step, "b"), b.save_untracked.remote(step, "extra")])
        assert committed(monitor, step)
    assert ray.get([a.wait_all.remote(), b.wait_all.remote()]) == [None, None]
    assert ray.get(monitor.wait_retention.remote(60))

    objects = keys(s3_server, bucket)
    step_dirs = {k.split("/")[1] for k in objects if k.startswith("run/global_step_")}
    assert step_dirs == {"global_step_3", "global_step_4"}
    for name in ("a.safetensors", "b.safetensors", "extra.pt", "ckptd_manifest.json"):
        assert f"run/global_step_4/{name}" in objects
    assert not any(k.startswith("run/.ckptd/pending/") for k in objects)  # ledger records cleaned up
    assert not any(k.startswith("run/.ckptd/probes/") for k in objects)
    assert not any(".ckptd-tmp-" in k for k in objects)  # single PUTs: no temp objects, no renames
    tracker = s3_server.client().get_object(Bucket=bucket, Key="run/latest_checkpointed_iteration.txt")
    assert tracker["Body"].read() == b"4\n"

    assert ckptd.latest_step(root, storage_options=opts) == 4
    checked = ckptd.verify(root, storage_options=opts)
    assert sorted(checked.files) == ["a.safetensors", "b.safetensors", "extra.pt"]  # extra.pt found by listing
    body = s3_server.client().get_object(Bucket=bucket, Key="run/global_step_4/a.safetensors")["Body"].read()
    assert all(torch.equal(v, weights(4)[k]) for k, v in load_safetensors(body).items())
    assert status(monitor).storage.commit_strategy == "object-put"
    # The CLI takes credentials and the endpoint from the environment, as the AWS tools do.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert main(["verify", root]) == 0 and "step 4: 3 files match" in capsys.readouterr().out

    # A monitor restarted mid-step rebuilds the step from the ledger records on S3.
    driver.register(5, checkpoint_thread_count=2)
    ray.get(a.save.remote(5, "a"))
    assert ray.get(a.wait_all.remote()) is None
    wait_for(lambda: status(monitor).step(5) and status(monitor).step(5).finished, what="step 5's first unit")
    restart_monitor(monitor)
    ray.get(b.save.remote(5, "b"))
    assert committed(monitor, 5)
    assert ckptd.latest_step(root, storage_options=opts) == 5


def test_credentials_never_appear_in_status_errors_or_logs(make_monitor, s3_root, run_name):
    root, opts = s3_root
    monitor = make_monitor(root, opts)
    saver = StateSaver.remote(run_name, "w")
    driver = ckptd.CheckpointCoordinator(monitor, worker_id="driver")
    driver.register(1, checkpoint_thread_count=1)
    ray.get(saver.save.remote(1))
    assert committed(monitor, 1)
    shown = status(monitor).model_dump_json()
    with pytest.raises(ckptd.CheckpointConfigError) as conflict:
        ckptd.start_monitor(root, run=run_name, storage_options=opts, max_ckpt_to_keep=5)
    with pytest.raises(ckptd.CheckpointConfigError) as bad_bucket:
        ckptd.start_monitor("s3://no-such-bucket-ckptd/run", run=run_name + "x", storage_options=opts)
    logs = ""
    session = ray._private.worker._global_node.get_session_dir_path()
    for path in glob.glob(os.path.join(session, "logs", "*")):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                logs += f.read()
    for secret in (SECRET_KEY, ACCESS_KEY):
        assert secret not in shown
        assert secret not in str(conflict.value)
        assert secret not in str(bad_bucket.value)
        assert secret not in logs
    assert "no-such-bucket-ckptd" in str(bad_bucket.value)


def test_a_root_without_credentials_is_refused_saying_what_to_pass(ray_local, s3_server, run_name, monkeypatch,
                                                                   tmp_path, capsys):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()  # an earlier test's client, made with credentials, is reused otherwise
    bucket = s3_server.new_bucket()
    root = f"s3://{bucket}/run"
    options = {k: v for k, v in s3_server.options().items() if k not in ("key", "secret")}
    said = "the storage client found no credentials .*Pass them in storage_options"
    with pytest.raises(ckptd.CheckpointConfigError, match=said):
        ckptd.start_monitor(root, run=run_name, storage_options=options)
    with pytest.raises(ckptd.CheckpointConfigError, match=said):
        ckptd.verify(root, storage_options=options)
    with pytest.raises(ckptd.CheckpointConfigError, match=said):
        ckptd.latest_step(root, storage_options=options)
    assert main(["verify", root]) == 1
    assert "FAILED: cannot use checkpoint root" in capsys.readouterr().err
    assert s3_server.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0  # nothing written
