"""Session 15b: the commit path after 05779fc (registration gate ``_registering``, the retention
fence of failed steps) and b9f58bc/685fff0 (O_DIRECT writes), attacked with a real local Ray, real
files, real coordinators and real monitor restarts.

The monitor's eight I/O threads are held busy by failure records slowed with the
``before_failure_record`` delay failpoint (eight "failed" notifications sent concurrently), so
that a registration record write waits in the pool, as on slow storage, while a unit finishes;
storage refusing the record is a directory in the way of its name (the rename fails).

Attacked:

1. Liveness of the registration gate: a registration whose record write is slow while the
   step's last unit finishes; two registrations of one step racing each other and a unit's finish;
   the same with a SIGKILL while both writes wait (Ray retries them); a registration whose record
   write is refused while the step's last unit finishes.
2. The retention fence: it takes "the newest commit" from the monitor's in-memory tracker, while
   the pass it guards takes it from the manifests it scans.
3. O_DIRECT end to end: ``save_state_async``'s default writer (thread and ``writer="process"``)
   and ``save_hf_model`` in a save unit, with odd dtypes and non-contiguous views, under
   ``direct_io`` "on", "auto" and "off": byte-identical files that ``ckptd.verify`` accepts; a
   save unit whose large write fails part-way leaves no file and does not commit.

Held: 1 when the record write is slow (the commit waits for it and counts it, also across a
SIGKILL with both writes retried by Ray); 3 for every writer and mode (byte-identical, verified;
the failing unit fails the step and leaves nothing).

Broke, and fixed in the same session (each test failed before its fix; the causes as found):

* ``test_a_refused_registration_record_does_not_hold_a_finished_step_for_ever``: the step's
  state dict is complete but never commits (until its timeout fails it). ``register``
  (ckptd/monitor/actor.py:229-239) re-evaluates the step (``_after_change``) only when
  ``write_registration`` returned: when it raises, the ``finally`` clears ``_registering`` but the
  commit that ``_after_change_sync`` (commit_flow.py:65) skipped while the record was written is
  never started; no other event re-evaluates a step that is merely ready.
* ``test_the_retention_fence_covers_every_step_the_pass_deletes``: the state dict of a failed step
  is admitted, committed and reported committed, then deleted by the retention pass as a "failed
  leftover". ``_fence_failed_leftovers`` (commit_flow.py:236-248) fences only steps older than
  ``self._trackers[SD]``, but ``plan_retention`` (retention.py:74-91) deletes failed steps older
  than the newest *manifest* it scans. A commit whose tracker could not be advanced ("committed,
  but the tracker could not be advanced", commit_flow.py:181-190), or one between its manifest
  and its tracker, makes the scan's newest newer than the fence's (here None: no fence at all).
* ``test_save_hf_model_follows_the_monitors_direct_io_mode``: ``direct_io="off"`` does not reach
  the ``ckptd.workers`` writers: ``save_hf_model`` (workers/hf.py:142), ``save_sharded``
  (workers/sharded.py:139), ``save_training_state``, LoRA and DCP build ``Storage(out_dir,
  storage_options)`` with the default ``"auto"``, so on ext4/xfs they write with O_DIRECT whatever
  the monitor says (docs/storage.md and MonitorOptions.direct_io name the HF and sharded writers).

The fixes: ``register`` re-evaluates the step in its ``finally``; the fence takes the newest
commit from the ledger too (``StepLedger.newest_committed``: committed or being committed), and
retention deletes at once only steps whose state dict has failed, leaving any other as an idle
leftover; a save unit runs its ``save_fn`` with the monitor's mode as the default of every
``Storage`` opened in it (``ckptd.direct_io.mode``), and a writer-process job likewise.

Runtime: about 40 s on the 2-core VM (11 s of it starting Ray), the unit file about 9 s.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
import ray
import torch

import ckptd
from ckptd.workers import save_hf_model

from .helpers import (
    arm_in_monitor,
    assert_trackers_verified,
    fail_checkpoint_unit,
    read_manifest,
    restart_monitor,
    status,
    threads_held_at,
    wait_for,
    write_step_file,
)

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT
POOL = 8  # the monitor's I/O threads (actor.py: ThreadPoolExecutor(max_workers=8))
HOLD_S = 6.0  # how long each failure record holds its I/O thread (3 s ran out on a loaded machine)


def _in_monitor(monitor, fn):
    return ray.get(monitor.__ray_call__.remote(fn))


def _hold_io_pool(monitor, first_step: int) -> list:
    """Fill every I/O thread of the monitor with a failure record slowed by HOLD_S: eight
    failing units of eight steps, reported concurrently (one call each). Returns the refs."""
    arm_in_monitor(monitor, "before_failure_record", f"delay:{HOLD_S}")
    refs = []
    for i in range(POOL):
        unit = {"worker": "hold", "name": f"hold{i}", "step": first_step + i, "kind": "checkpoint", "call": f"hold-{i}"}
        failure = {"unit": f"hold/hold{i}", "error_type": "OSError", "message": "held"}
        refs.append(monitor.notify_batch.remote([("failed", unit, failure)]))
    # Every thread sleeps in the failpoint: a failure known (``_failure_writes``) may not have a
    # thread yet, and once disarmed, its record would not hold one.
    wait_for(lambda: threads_held_at(monitor, "before_failure_record") >= POOL,
             what="every I/O thread holding a failure record")
    arm_in_monitor(monitor, "before_failure_record", None)  # those in flight keep sleeping
    return refs


def _gated_unit(coord, root: str, step: int, name: str):
    """A state-dict unit that is admitted and then waits for ``go``; returns (started, go)."""
    started, go = threading.Event(), threading.Event()

    def fn():
        started.set()
        assert go.wait(60)
        return write_step_file(root, step, f"{name}.bin")

    coord.save_async(name, fn, step, is_state_dict=True)
    assert started.wait(30)
    return go


def _registering(monitor, step: int) -> int:
    return _in_monitor(monitor, lambda self: self._registering.get(step, 0))


@pytest.mark.parametrize("restart", [False, True])
def test_registrations_racing_each_other_and_a_units_finish_are_all_counted(make_monitor, tmp_path, restart):
    """Step 70's state dict is registered with one unit, which is admitted and held. Two more
    registrations of one unit each are sent while the I/O pool is busy (their records wait);
    the first unit then finishes (with ``restart``: the monitor is SIGKILLed first, and Ray retries
    both registrations on the new one). The state dict must not commit with one unit: it waits
    for all three and its manifest counts three registrations."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(70, is_state_dict=True, state_dict_thread_count=1)
    go = _gated_unit(coord, root, 70, "u1")
    _hold_io_pool(monitor, 1000)
    refs = [monitor.register.remote(70, {"state_dict": 1, "checkpoint": 0}, "state_dict", f"s15b-race-{i}")
            for i in range(2)]
    wait_for(lambda: _registering(monitor, 70) == 2, what="both registration records being written")
    if restart:
        restart_monitor(monitor, how="sigkill")
    go.set()
    coord.wait_all()
    assert [ray.get(r, timeout=60) for r in refs] == [{"error": None}] * 2
    assert _registering(monitor, 70) == 0
    assert read_manifest(root, 70, SD) is None  # one of three units: no commit
    assert status(monitor).step(70, SD).expected == 3
    for name in ("u2", "u3"):
        coord.save_sync(lambda n=name: write_step_file(root, 70, f"{n}.bin"), 70, is_state_dict=True)
    coord.wait_committed(70, is_state_dict=True, timeout_s=30)
    manifest = read_manifest(root, 70, SD)
    assert manifest.registered == 3 and sorted(f.path for f in manifest.files) == ["u1.bin", "u2.bin", "u3.bin"]
    assert assert_trackers_verified(root)[SD] == 70
    coord.close()


def test_a_refused_registration_record_does_not_hold_a_finished_step_for_ever(make_monitor, tmp_path):
    """Step 60's state dict is registered with one unit, admitted and held. A full-checkpoint
    registration of step 60 is sent while the I/O pool is busy; storage will refuse its record (a
    directory is in the way of its name). The state-dict unit finishes while that record waits:
    no commit may begin then. The registration then fails; the state dict, complete, must still
    commit (and nothing may stay in ``_registering``)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(60, is_state_dict=True, state_dict_thread_count=1)
    go = _gated_unit(coord, root, 60, "u1")
    attempt = ray.get(monitor.ping.remote())["attempt"]
    os.makedirs(f"{root}/.ckptd/pending/{attempt}/60/reg-s15b-refused.json")  # the rename will fail
    _hold_io_pool(monitor, 2000)
    ref = monitor.register.remote(60, {"state_dict": 0, "checkpoint": 1}, "checkpoint", "s15b-refused")
    wait_for(lambda: _registering(monitor, 60) == 1, what="the registration record being written")
    go.set()
    coord.wait_all()  # the unit's finish is applied while the record waits
    with pytest.raises(Exception, match="reg-s15b-refused|Is a directory"):
        ray.get(ref, timeout=60)
    try:
        assert _registering(monitor, 60) == 0
        coord.wait_committed(60, is_state_dict=True, timeout_s=8)
        assert [f.path for f in read_manifest(root, 60, SD).files] == ["u1.bin"]
    finally:
        coord.close()


def test_the_retention_fence_covers_every_step_the_pass_deletes(make_monitor, tmp_path):
    """Step 6's checkpoint unit fails (it created the step directory). Step 7's state dict
    commits, but storage refuses its tracker (``before_tracker_rename`` raises on every retry):
    committed, tracker not advanced. Its retention pass (slowed by ``before_step_delete``) then
    deletes step 6 as a failed leftover, older than step 7's manifest, although the fence saw no
    committed step. A state dict of step 6 saved meanwhile must be refused, or, if it is reported
    committed, still be there after the pass."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None, keep_every_n_steps=3)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")

    fail_checkpoint_unit(coord, root, 6)
    arm_in_monitor(monitor, "before_tracker_rename", "raise")
    arm_in_monitor(monitor, "before_step_delete", "delay:5")
    try:
        coord.save_sync(lambda: write_step_file(root, 7, "sd.bin"), 7, is_state_dict=True)
        coord.register(7, is_state_dict=True, state_dict_thread_count=1)
        coord.wait_committed(7, is_state_dict=True, timeout_s=30)  # committed; its tracker failed
        arm_in_monitor(monitor, "before_tracker_rename", None)
        assert not ray.get(monitor.wait_retention.remote(0))  # the pass that deletes step 6 runs
        committed = False
        try:
            coord.save_sync(lambda: write_step_file(root, 6, "sd.bin"), 6, is_state_dict=True)
            coord.register(6, is_state_dict=True, state_dict_thread_count=1)
            coord.wait_committed(6, is_state_dict=True, timeout_s=30)
            committed = True
        except ckptd.CheckpointSaveError as e:
            assert "retention deletes step 6" in str(e) or "disk full" in str(e)
        assert ray.get(monitor.wait_retention.remote(60))
    finally:
        arm_in_monitor(monitor, "before_tracker_rename", None)
        arm_in_monitor(monitor, "before_step_delete", None)
    try:
        if committed:  # reported committed: it must still be there
            assert read_manifest(root, 6, SD) is not None
            ckptd.verify(root, 6)
        assert_trackers_verified(root)
    finally:
        coord.close()


def _odd_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(151)
    base = torch.randn(1031, 4099, generator=g)
    return {
        "bf16": torch.randn(3_500_001, generator=g).to(torch.bfloat16),
        "f16_t": torch.randn(1023, 2049, generator=g).to(torch.float16).t(),
        "i8": torch.randint(-128, 127, (4_194_307,), dtype=torch.int8, generator=g),
        "bool": torch.rand(777_777, generator=g) > 0.5,
        "f64_strided": torch.randn(3 * 500_009, dtype=torch.float64, generator=g)[::3],
        "f32_slice": base[5:900, 7:4001],
    }


def _step_bytes(root: str, step: int) -> dict[str, bytes]:
    d = ckptd.step_dir(root, step)
    out = {}
    for dirpath, _, names in os.walk(d):
        for n in names:
            if not n.startswith("ckptd_"):
                p = os.path.join(dirpath, n)
                with open(p, "rb") as f:
                    out[os.path.relpath(p, d)] = f.read()
    return out


def test_large_files_are_byte_identical_and_verify_in_every_direct_io_mode(make_monitor, tmp_path, run_name):
    """One monitor per mode: ``save_state_async`` (default writer; also ``writer="process"`` in
    "on") and ``save_hf_model`` in a unit, of the same odd tensors (>32 MiB). Every step commits,
    verifies, and holds the same bytes in every mode. Then a unit whose large write fails
    part-way fails its step and leaves no file."""
    state = _odd_state()
    seen: dict[str, dict[str, bytes]] = {}
    for mode in ("on", "auto", "off"):
        root = str(tmp_path / mode)
        monitor = make_monitor(root, run=f"{run_name}-{mode}", max_state_dict_to_keep=None, direct_io=mode)
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
        coord.save_state_async("model", state, 1, is_state_dict=True)
        coord.save_async("hf", lambda c=coord: save_hf_model(f"{c.step_dir(1)}/hf", state, {"model_type": "llama"}), 1,
                         is_state_dict=True)
        coord.register(1, is_state_dict=True, state_dict_thread_count=2)
        coord.wait_all()
        coord.wait_committed(1, is_state_dict=True, timeout_s=60)
        ckptd.verify(root, 1)
        seen[mode] = _step_bytes(root, 1)
        assert len(seen[mode]["model.safetensors"]) > 32 << 20
        if mode == "on":
            proc = ckptd.CheckpointCoordinator(monitor, worker_id="w1", writer="process")
            proc.save_state_async("model", state, 2, is_state_dict=True)
            proc.register(2, is_state_dict=True, state_dict_thread_count=1)
            proc.wait_all()
            proc.wait_committed(2, is_state_dict=True, timeout_s=60)
            ckptd.verify(root, 2)
            assert _step_bytes(root, 2) == {"model.safetensors": seen[mode]["model.safetensors"]}
            proc.close()

            # A large write failing part-way: the step fails, no file of it is left.
            from ckptd.storage import Storage
            from ckptd.workers.files import write_stream

            def failing(c=coord):
                def fill(w):
                    w.write(b"x" * (40 << 20))
                    raise OSError("device went away")
                return [write_stream(Storage(c.step_dir(3), direct_io="on"), f"{c.step_dir(3)}/big.bin", fill,
                                     size=64 << 20)]

            coord.register(3, is_state_dict=True, state_dict_thread_count=1)
            with pytest.raises(ckptd.CheckpointSaveError, match="device went away"):
                coord.save_sync(failing, 3, is_state_dict=True)
            with pytest.raises(ckptd.CheckpointSaveError):
                coord.wait_committed(3, is_state_dict=True, timeout_s=30)
            assert read_manifest(root, 3, SD) is None
            assert not os.path.exists(ckptd.step_dir(root, 3)) or _step_bytes(root, 3) == {}
        assert assert_trackers_verified(root)[SD] == (2 if mode == "on" else 1)
        coord.close()
    assert seen["on"] == seen["auto"] == seen["off"]


@pytest.mark.parametrize("mode", ["off", "on"])
def test_save_hf_model_follows_the_monitors_direct_io_mode(make_monitor, tmp_path, caplog, mode):
    """``direct_io="off"``: "always through the page cache". A large HF shard written by
    ``save_hf_model`` in a save unit of that run must not be written with O_DIRECT; with "on" it
    is (the writers open their own Storage, which takes the unit's mode)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=None, direct_io=mode)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    state = {"w": torch.randn(9_000_000)}
    try:
        with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
            coord.save_sync(lambda: save_hf_model(f"{coord.step_dir(1)}/hf", state, {"model_type": "llama"}), 1,
                            is_state_dict=True)
        coord.register(1, is_state_dict=True, state_dict_thread_count=1)
        coord.wait_committed(1, is_state_dict=True, timeout_s=30)
        ckptd.verify(root, 1)
        written = [r.getMessage() for r in caplog.records if r.name == "ckptd.files"]
        assert any("with O_DIRECT" in m for m in written) == (mode == "on"), written
    finally:
        coord.close()
