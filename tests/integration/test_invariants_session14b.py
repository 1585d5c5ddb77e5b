"""Session 14b: invariants 1-3 against writer='process' (a write_fn that fails in the writer
process fails its save, which never commits, also across a monitor restart and a new job on the
same root) and against notify_batch's yield inside a large batch."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

import ckptd
from ckptd.storage import Storage
from ckptd.workers.files import write_torch

from .helpers import assert_trackers_verified, restart_monitor, wait_all


def write_then_raise(out: str, snapshot: dict) -> list:
    """Writes a complete file into the step, then fails: the save must not count."""
    storage = Storage(out)
    storage.makedirs(storage.root)
    write_torch(storage, storage.join("optim.pt"), snapshot)
    raise RuntimeError("disk quota exceeded (injected)")


def test_a_write_fn_failing_in_the_writer_process_never_commits_across_restart_and_new_job(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", writer="process")
    model = {"w": torch.randn(64)}
    coord.register(1, checkpoint_thread_count=2)
    coord.save_state_async("model", model, 1)  # default writer: succeeds
    coord.save_state_async("optim", {"s": torch.ones(8)}, 1, partial(write_then_raise, coord.step_dir(1)))
    error = wait_all(coord)
    assert error is not None and "writer process of w0 failed" in error and "quota" in error
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    assert os.path.exists(os.path.join(root, "global_step_1", "optim.pt"))  # on storage, yet not counted
    assert_trackers_verified(root)
    assert ckptd.latest_step(root) is None

    restart_monitor(monitor)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(1, timeout_s=30)
    assert ckptd.latest_step(root) is None
    coord.close()
    assert coord._writer.pid is None

    # A new job on the same root: step 1 stays failed; its step 2 commits and moves the tracker.
    coord2 = ckptd.CheckpointCoordinator(make_monitor(root, run=f"{os.getpid()}-job2", takeover=True), worker_id="w0",
                                         writer="process")
    coord2.register(2, checkpoint_thread_count=1)
    coord2.save_state_async("model", model, 2)
    assert wait_all(coord2) is None
    coord2.wait_committed(2, timeout_s=60)
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 2
    with pytest.raises(ckptd.CheckpointError):
        ckptd.verify(root, 1)
    coord2.close()


def test_a_unit_started_later_in_a_large_batch_than_its_steps_last_unit_is_refused(make_monitor, tmp_path):
    """notify_batch yields to the event loop every 32 events: the commit that the batch's last
    registered unit starts may run between events of the same batch. A unit of that step admitted
    further on would not be in the commit, so it must be refused, and its report too."""
    import ray

    from ckptd.coordinator.files import crc32_file

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    n = 40
    coord.register(1, checkpoint_thread_count=n)
    storage = Storage(root)
    step_path = storage.join("global_step_1")
    storage.makedirs(step_path)
    files = []
    for i in range(n + 1):
        rel = f"u{i}.bin"
        with open(os.path.join(root, "global_step_1", rel), "wb") as f:
            f.write(os.urandom(64 + i))
        size, crc = crc32_file(storage, f"{step_path}/{rel}")
        files.append({"path": rel, "size": size, "crc32": crc})

    def unit(i: int) -> dict:
        return {"worker": "w9", "name": f"u{i}", "step": 1, "kind": "checkpoint", "call": f"c{i}"}

    events = [("started", unit(i), None) for i in range(n)]
    events += [("finished", unit(i), {"files": [files[i]], "found": False}) for i in range(n)]  # ends at 79
    events += [("timing", None, None)] * 20  # past the yield at 96: the commit may run
    events += [("started", unit(n), None), ("finished", unit(n), {"files": [files[n]], "found": False})]
    results = ray.get(monitor.notify_batch.remote(events))
    assert all(r == {"admitted": True} for r in results[:n])
    assert all(r is None for r in results[n:2 * n])
    assert "refused" in results[-2] and "refused" in results[-1], results[-2:]
    coord.wait_committed(1, timeout_s=60)
    ckptd.verify(root, 1)
    assert_trackers_verified(root)
    from ckptd.layout import MANIFESTS
    from ckptd.manifest import Manifest

    with open(os.path.join(root, "global_step_1", MANIFESTS[ckptd.Kind.CHECKPOINT])) as f:
        manifest = Manifest.model_validate_json(f.read())
    assert len([u for u in manifest.units if u.startswith("w9/")]) == n  # u40.bin: "written outside save units"
    # The last registered unit counted once, the late one not at all.
    assert f"w9/u{n - 1}#c{n - 1}" in manifest.units and f"w9/u{n}#c{n}" not in manifest.units
    coord.close()
