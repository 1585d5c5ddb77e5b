"""The shared-root check: a worker that does not see the monitor's storage is refused, by name.

Node-local disks are simulated with fsspec's ``dir://`` filesystem, whose base directory each
process takes from its environment (``FSSPEC_DIR``): the same root URL then means a different
directory in each process, exactly as a local path does on different nodes.
"""

from __future__ import annotations

import json

import fsspec.config
import pytest
import ray

import ckptd
from tests.integration.helpers import StateSaver, status


def node_disk(path) -> dict:
    return {"path": str(path), "target_protocol": "file"}


def test_memory_root_is_refused_by_start_monitor(ray_local, run_name):
    with pytest.raises(ckptd.CheckpointConfigError, match="not shared storage.*memory:// is private to each process"):
        ckptd.start_monitor("memory://ckpt/run", run=run_name)
    with pytest.raises(ckptd.CheckpointError, match="no CheckpointMonitor"):
        ckptd.get_monitor(run_name)  # the monitor it created is gone again


def test_a_worker_on_another_disk_is_refused_and_named(ray_local, run_name, tmp_path, monkeypatch):
    disk_a, disk_b = tmp_path / "node-a", tmp_path / "node-b"
    monkeypatch.setitem(fsspec.config.conf, "dir", node_disk(disk_a))  # the driver is on "node a"
    on_a = {"env_vars": {"FSSPEC_DIR": json.dumps(node_disk(disk_a))}}
    on_b = {"env_vars": {"FSSPEC_DIR": json.dumps(node_disk(disk_b))}}
    monitor = ckptd.start_monitor("dir://ckpt", run=run_name, runtime_env=on_a)
    try:
        good = StateSaver.options(runtime_env=on_a).remote(run_name, "good")
        bad = StateSaver.options(runtime_env=on_b).remote(run_name, "bad")
        assert ray.get(good.init_error.remote()) is None
        error = ray.get(bad.init_error.remote())
        node = ray.get(bad.node_id.remote())[:12]
        assert "is not shared storage" in error and "worker 'bad'" in error and f"node {node}" in error
        assert list((disk_b / "ckpt" / ".ckptd" / "probes").iterdir()) == []  # its probe was removed

        shown = status(monitor).storage
        assert shown.probes_checked == 3  # the driver, then each worker
        assert len(shown.unshared) == 1 and "worker 'bad'" in shown.unshared[0]

        driver = ckptd.CheckpointCoordinator(monitor, worker_id="driver")
        driver.register(1, checkpoint_thread_count=1)
        ray.get(good.save.remote(1))
        assert ray.get(monitor.wait_committed.remote(1, "checkpoint", 60))["committed"]
        assert (disk_a / "ckpt" / "global_step_1" / "ckptd_manifest.json").exists()
    finally:
        ray.kill(monitor, no_restart=True)
