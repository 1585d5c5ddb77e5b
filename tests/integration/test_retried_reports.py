"""A worker's report that the monitor already acted on, retried after a monitor restart.

The monitor commits a step when the last unit's "finished" arrives; if it dies before its answer
reaches the worker, Ray retries the call on the restarted monitor, whose ledger (rebuilt from
storage) holds no units for a committed checkpoint. Found by the chaos test (seed 3684421656):
the retried report was refused as "finished after the step was committed", and wait_all()
raised for a unit the committed manifest lists.
"""

from __future__ import annotations

import os
import time

import ray
import torch

import ckptd
from ckptd.layout import MANIFESTS
from ckptd.manifest import Manifest


def test_a_report_retried_on_a_restarted_monitor_is_acknowledged_not_refused(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(1)
    os.makedirs(out)
    coord.register(1, checkpoint_thread_count=1)
    coord.save_async("model", lambda: torch.save({"w": torch.ones(2)}, os.path.join(out, "model.pt")), 1)
    coord.wait_committed(1, timeout_s=30)
    coord.close()
    with open(os.path.join(out, MANIFESTS[ckptd.Kind.CHECKPOINT])) as f:
        manifest = Manifest.model_validate_json(f.read())
    (key,) = manifest.units
    worker_name, call = key.split("#")
    worker, name = worker_name.split("/")
    unit = {"worker": worker, "name": name, "step": 1, "kind": "checkpoint", "call": call}
    report = {"files": [f.model_dump() for f in manifest.files], "found": False}

    before = ray.get(monitor.ping.remote())["pid"]
    ray.kill(monitor, no_restart=False)  # Ray restarts it; it rebuilds its ledger from storage
    deadline = time.monotonic() + 60
    while ray.get(monitor.ping.remote(), timeout=60)["pid"] == before:  # until the restarted one answers
        assert time.monotonic() < deadline, "the monitor did not restart"
        time.sleep(0.05)
    assert ray.get(monitor.notify_batch.remote([("finished", unit, report)]), timeout=60) == [None]

    # A unit the manifest does not list is still refused: its files are in no manifest.
    stranger = {**unit, "call": call + "0"}
    (answer,) = ray.get(monitor.notify_batch.remote([("finished", stranger, report)]), timeout=60)
    assert "finished after the step was committed" in answer["refused"]
    ckptd.verify(root, 1)
    assert ckptd.latest_step(root) == 1
