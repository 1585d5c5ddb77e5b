"""Regression tests for the violations an adversarial review of the commit path found: each one
failed on the code before its fix."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import zlib

import pytest
import ray

import ckptd
from ckptd.config import Kind
from ckptd.layout import MANIFESTS

from .helpers import HalfWriter, failpoint_env, restart_monitor, status, wait_all, wait_for
from .test_protocol_v2 import manifest, tracker, write

pytestmark = pytest.mark.usefixtures("ray_local")


def _committing(monitor, step: int, kind: str = "checkpoint") -> bool:
    s = status(monitor).step(step, kind)
    return s is not None and s.state.value == "committing"


def test_a_monitor_of_another_driver_finds_the_live_one(ray_local, tmp_path, run_name):
    """Two drivers on one cluster, both with the default namespace (each its own anonymous one):
    the second start_monitor on the root must find the first monitor and refuse."""
    root = str(tmp_path / "ckpt")
    first = ckptd.start_monitor(root, run=run_name)
    try:
        address = ray.get_runtime_context().gcs_address
        code = (f"import ray, ckptd; ray.init(address={address!r}, log_to_driver=False)\n"
                f"try:\n    ckptd.start_monitor({root!r}, run='other-{run_name}')\n    print('STARTED')\n"
                "except ckptd.CheckpointConfigError as e:\n    print('REFUSED', e)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ}).stdout
        assert "REFUSED" in out and f"live monitor of run '{run_name}'" in out, out[-2000:]
    finally:
        ray.kill(first, no_restart=True)


def test_another_driver_attaches_to_the_monitor_and_subscribes_without_naming_a_namespace(
        ray_local, tmp_path, run_name):
    """A rollout driver (its own anonymous namespace) finds the trainer's monitor by run name, as
    ``ckptd status`` does: get_monitor and a WeightSubscriber in monitor mode. Before, both looked
    in their own namespace only, and get_monitor said to start a monitor that was running."""
    from .test_rollout import publish

    root = str(tmp_path / "ckpt")
    monitor = ckptd.start_monitor(root, run=run_name)
    try:
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
        publish(coord, 2)
        coord.close()
        address = ray.get_runtime_context().gcs_address
        code = (f"import ray, ckptd; ray.init(address={address!r}, log_to_driver=False)\n"
                f"m = ckptd.get_monitor({run_name!r})\n"
                "print('RUN', ray.get(m.worker_config.remote())['run'])\n"
                f"sub = ckptd.WeightSubscriber({run_name!r}, name='explorer')\n"
                "print('MODE', sub.mode, 'VERSION', sub.wait_for_version(timeout_s=60))\n"
                "sub.close()\n"
                "try:\n    ckptd.get_monitor('no-such-run')\n"
                "except ckptd.CheckpointError as e:\n    print('NONE', e)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ})
        out = proc.stdout
        assert f"RUN {run_name}" in out and "MODE monitor VERSION 2" in out, (out + proc.stderr)[-3000:]
        assert "NONE no CheckpointMonitor for run 'no-such-run' in any Ray namespace" in out, out[-2000:]
    finally:
        ray.kill(monitor, no_restart=True)


def test_a_monitor_stalled_before_its_tracker_rename_is_fenced_at_the_last_moment(ray_local, tmp_path, run_name):
    from ckptd.monitor.attempts import open_attempt
    from ckptd.storage import Storage

    root = str(tmp_path / "ckpt")
    monitor = ckptd.start_monitor(root, run=run_name, runtime_env=failpoint_env("before_tracker_rename=delay:3"))
    try:
        coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
        coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"1")], 1)
        coord.register(1, checkpoint_thread_count=1)
        wait_for(lambda: os.path.exists(f"{ckptd.step_dir(root, 1)}/{MANIFESTS[Kind.CHECKPOINT]}"),
                 what="the manifest (the tracker rename is stalled now)")
        open_attempt(Storage(root), "newer-job", None)  # a newer job takes the root meanwhile
        assert ray.get(monitor.wait_committed.remote(1, "checkpoint", 30))["committed"]
        assert tracker(root) is None and "superseded" in status(monitor).fenced
    finally:
        ray.kill(monitor, no_restart=True)


def test_a_checkpoint_unit_cannot_start_while_the_state_dict_of_its_step_commits(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, runtime_env=failpoint_env("before_manifest=delay:2"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    out = coord.step_dir(1)
    coord.save_async("w", lambda: [write(f"{out}/model.bin", b"weights")], 1, is_state_dict=True)
    coord.register(1, is_state_dict=True, state_dict_thread_count=1)
    wait_for(lambda: _committing(monitor, 1, "state_dict"), what="the state dict to be committing")
    optimizer = HalfWriter(f"{out}/optim.bin")
    coord.save_async("o", optimizer, 1)
    coord.wait_committed(1, is_state_dict=True, timeout_s=30)
    assert {f["path"] for f in manifest(root, 1, Kind.STATE_DICT)["files"]} == {"model.bin"}
    assert optimizer.half_written.wait(30)
    optimizer.release()
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)
    assert wait_all(coord) is None
    ckptd.verify(root, 1)


def test_a_restarted_monitor_still_knows_the_units_that_are_writing(make_monitor, tmp_path):
    """One unit registered, two saved (the step is held); one of them is still writing when the
    monitor restarts. The restarted monitor must not commit the step with its half file."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    out = coord.step_dir(1)
    slow = HalfWriter(f"{out}/optim.bin")
    coord.save_async("slow", slow, 1)
    assert slow.half_written.wait(30)
    coord.save_sync(lambda: [write(f"{out}/model.bin", b"m")], 1)
    coord.register(1, checkpoint_thread_count=1)
    restart_monitor(monitor)
    with pytest.raises(TimeoutError):
        coord.wait_committed(1, timeout_s=2)
    assert tracker(root) is None
    slow.release()
    coord.register(1, checkpoint_thread_count=1)
    coord.wait_committed(1, timeout_s=30)
    assert wait_all(coord) is None
    assert {f["path"]: f["size"] for f in manifest(root, 1)["files"]} == {"model.bin": 1, "optim.bin": 17}


def test_a_failure_of_a_new_unit_during_a_commit_does_not_fail_the_step(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, runtime_env=failpoint_env("before_manifest=delay:2"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(3)}/m.bin", b"m")], 3)
    coord.register(3, checkpoint_thread_count=1)
    wait_for(lambda: _committing(monitor, 3), what="the commit")
    unit = {"worker": "late", "name": "x", "step": 3, "kind": "checkpoint", "call": "late-1"}
    failure = {"unit": "late/x", "error_type": "OSError", "message": "boom", "traceback": ""}
    (answer,) = ray.get(monitor.notify_batch.remote([("failed", unit, failure)]))
    # The unit's worker is told that its failure leaves the step as it is (the commit may have
    # ended by the time the notification is applied, on a loaded machine).
    assert "does not fail step 3's checkpoint, which was" in answer["kept"], answer
    assert "without this unit" in answer["kept"], answer
    coord.wait_committed(3, timeout_s=30)  # it is committed, and says so
    assert tracker(root) == 3 and status(monitor).step(3).state.value == "committed"


def test_a_save_error_says_when_its_failure_leaves_the_step_committed(make_monitor, tmp_path):
    """A state-dict unit saved after its step's state dict committed (Trinity's full checkpoint
    of a step, which holds its weights too) fails: the state dict stays committed and the full
    checkpoint fails. The error ``wait_all`` raises, of kind state_dict, says both, so it is not
    read as the state dict having failed; an ordinary failure says nothing of the kind."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")

    def boom():
        raise OSError("disk full")

    coord.register(1, is_state_dict=True, state_dict_thread_count=1)
    coord.save_async("m", boom, 1, is_state_dict=True)
    with pytest.raises(ckptd.CheckpointSaveError) as ordinary:
        coord.wait_all()
    assert "disk full" in str(ordinary.value) and "does not fail" not in str(ordinary.value)
    coord.save_async("m", lambda: [write(f"{coord.step_dir(2)}/model.bin", b"m")], 2, is_state_dict=True)
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(2, is_state_dict=True, timeout_s=30)
    registered = threading.Event()

    def boom_once_registered():  # so that the registration does not meet a step already failed
        registered.wait(30)
        boom()

    coord.save_async("optim", boom_once_registered, 2, is_state_dict=True)
    coord.register(2, state_dict_thread_count=1)
    registered.set()
    with pytest.raises(ckptd.CheckpointSaveError) as kept:
        coord.wait_all()
    message = str(kept.value)
    assert kept.value.kind == "state_dict" and "disk full" in message, message
    assert "does not fail step 2's state dict, which was committed without this unit" in message, message
    assert "step 2's full checkpoint, which needed this unit, fails" in message, message
    with pytest.raises(ckptd.CheckpointSaveError, match="disk full"):
        coord.wait_committed(2, timeout_s=30)
    coord.wait_committed(2, is_state_dict=True, timeout_s=30)
    assert tracker(root, Kind.STATE_DICT) == 2 and tracker(root) is None
    coord.close()


def test_a_failed_unit_that_replaced_a_committed_state_dict_file_is_not_told_the_state_dict_stays(
        make_monitor, tmp_path):
    """As above, but the late state-dict unit replaced the committed weights file before it failed:
    the state dict is withdrawn, so its error must not say that its failure leaves the state dict
    committed (it did, read before the files were checked). Found by a helper's attack (session 37)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    for step in (1, 2):
        coord.save_async("m", lambda s=step: [write(f"{coord.step_dir(s)}/model.bin", b"m%d" % s)], step,
                         is_state_dict=True)
        coord.register(step, is_state_dict=True, state_dict_thread_count=1)
        coord.wait_committed(step, is_state_dict=True, timeout_s=30)
    registered = threading.Event()

    def replace_then_boom():
        registered.wait(30)
        write(f"{coord.step_dir(2)}/model.bin", b"other")
        raise OSError("disk full")

    coord.save_async("optim", replace_then_boom, 2, is_state_dict=True)
    coord.register(2, state_dict_thread_count=1)
    registered.set()
    with pytest.raises(ckptd.CheckpointSaveError) as failed:
        coord.wait_all()
    assert "disk full" in str(failed.value) and "does not fail" not in str(failed.value), str(failed.value)
    with pytest.raises(ckptd.CheckpointSaveError, match="withdrawn"):
        coord.wait_committed(2, is_state_dict=True, timeout_s=30)
    assert not os.path.exists(f"{coord.step_dir(2)}/{MANIFESTS[Kind.STATE_DICT]}")
    assert tracker(root, Kind.STATE_DICT) == 1
    coord.close()


def test_a_wait_all_after_several_failures_gives_each_ones_cause(make_monitor, tmp_path):
    """Two saves failed before one wait_all: the error is the first's, its message names the
    second, and its notes give the second's own cause, which the message leaves out."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    for step, why in ((1, "disk full"), (2, "quota exceeded")):
        coord.register(step, checkpoint_thread_count=1)

        def boom(why=why):
            raise OSError(why)

        coord.save_async(f"m{step}", boom, step)
        with pytest.raises(ckptd.CheckpointSaveError):
            coord.wait_committed(step, timeout_s=30)  # both have failed before the wait_all
    with pytest.raises(ckptd.CheckpointSaveError) as raised:
        coord.wait_all()
    assert "disk full" in str(raised.value) and "1 more failed saves: step 2 w/m2" in str(raised.value)
    assert "quota exceeded" not in str(raised.value)
    (note,) = raised.value.__notes__
    assert note.startswith("also failed: checkpoint save of step 2 failed in unit 'w/m2'") and "quota exceeded" in note
    assert wait_all(coord) is None  # reported once
    coord.close()


def test_a_failure_reported_after_its_units_files_is_ignored_and_says_so(make_monitor, tmp_path):
    """A unit's "finished" reached the monitor, and its worker, not knowing (the call's answer was
    lost), reports the unit failed: the monitor keeps the files, which count, and says so."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.register(4, checkpoint_thread_count=2)
    unit = {"worker": "other", "name": "a", "step": 4, "kind": "checkpoint", "call": "other-1"}
    (admitted,) = ray.get(monitor.notify_batch.remote([("started", unit, None)]))
    assert admitted == {"admitted": True}
    path = f"{coord.step_dir(4)}/a.bin"
    write(path, b"the files of unit a")
    st = os.stat(path)
    entry = {"path": "a.bin", "size": st.st_size, "crc32": f"{zlib.crc32(b'the files of unit a'):08x}",
             "mtime_ns": st.st_mtime_ns}
    failure = {"unit": "other/a", "error_type": "RayError", "message": "the answer was lost", "traceback": ""}
    answers = ray.get(monitor.notify_batch.remote([("finished", unit, {"files": [entry], "found": False}),
                                                  ("failed", unit, failure)]))
    assert answers[0] is None, answers
    assert "does not fail step 4's checkpoint: the monitor already had this unit's report" in answers[1]["kept"]
    coord.save_sync(lambda: [write(f"{coord.step_dir(4)}/b.bin", b"b")], 4)
    coord.wait_committed(4, timeout_s=30)
    assert sorted(f["path"] for f in manifest(root, 4)["files"]) == ["a.bin", "b.bin"]
    # Once another unit failed the step, such a report says nothing more: the step fails.
    coord.register(5, checkpoint_thread_count=2)
    a5, b5 = ({**unit, "step": 5, "name": n, "call": f"other-5{n}"} for n in "ab")
    write(f"{coord.step_dir(5)}/a.bin", b"the files of unit a")
    st = os.stat(f"{coord.step_dir(5)}/a.bin")
    answers = ray.get(monitor.notify_batch.remote([
        ("started", a5, None), ("started", b5, None),
        ("finished", a5, {"files": [{**entry, "mtime_ns": st.st_mtime_ns}], "found": False}),
        ("failed", b5, {**failure, "unit": "other/b"}), ("failed", a5, failure)]))
    assert answers[2:] == [None, None, None], answers
    with pytest.raises(ckptd.CheckpointSaveError, match="the answer was lost"):
        coord.wait_committed(5, timeout_s=30)
    coord.close()


def test_a_late_report_never_withdraws_a_committed_checkpoints_state_dict(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(2)}/model.bin", b"m")], 2, is_state_dict=True)
    coord.register(2, is_state_dict=True, state_dict_thread_count=1)
    coord.wait_committed(2, is_state_dict=True, timeout_s=30)
    coord.save_sync(lambda: [write(f"{coord.step_dir(2)}/optim.bin", b"o")], 2, is_state_dict=True)
    coord.register(2, state_dict_thread_count=1)
    coord.wait_committed(2, timeout_s=30)
    unit = {"worker": "ghost", "name": "x", "step": 2, "kind": "state_dict", "call": "ghost-1"}
    files = {"files": [{"path": "model.bin", "size": 5, "crc32": "deadbeef", "mtime_ns": None}], "found": False}
    (answer,) = ray.get(monitor.notify_batch.remote([("finished", unit, files)]))
    assert "after the step was committed" in answer["refused"]
    assert manifest(root, 2, Kind.STATE_DICT) is not None and tracker(root, Kind.STATE_DICT) == 2
    coord.wait_committed(2, is_state_dict=True, timeout_s=5)
    ckptd.verify(root, 2)


def test_a_registration_during_a_commit_is_not_silently_dropped(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, runtime_env=failpoint_env("before_manifest=delay:2"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(4)}/m.bin", b"m")], 4)
    coord.register(4, checkpoint_thread_count=1)
    wait_for(lambda: _committing(monitor, 4), what="the commit")
    with pytest.raises(ckptd.RegistrationConflictError, match="already committed"):
        coord.register(4, checkpoint_thread_count=1)
    assert manifest(root, 4)["registered"] == 1


def test_a_registration_retried_after_its_step_committed_and_the_monitor_restarted_counts_once(
        make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(5)}/m.bin", b"m")], 5)
    call = (5, {"state_dict": 0, "checkpoint": 1}, "checkpoint", "reg-retried-1")
    assert ray.get(monitor.register.remote(*call)) == {"error": None}
    coord.wait_committed(5, timeout_s=30)
    restart_monitor(monitor)
    assert ray.get(monitor.register.remote(*call)) == {"error": None}  # what Ray's retry would send
    other = (5, {"state_dict": 0, "checkpoint": 1}, "checkpoint", "reg-new-2")
    assert ray.get(monitor.register.remote(*other))["error"]["type"] == "RegistrationConflictError"


def test_a_changed_file_outside_units_withdraws_the_state_dict_that_listed_it(make_monitor, tmp_path):
    """Another rank's shard, saved outside any unit, is listed by the committed state dict; it is
    then rewritten with other bytes. The full checkpoint fails, and the state dict is withdrawn so
    that no tracker names bytes that are gone."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="rank0")
    out = coord.step_dir(6)
    write(f"{out}/shard1.bin", b"rank1-v1")
    coord.save_async("sd", lambda: [write(f"{out}/shard0.bin", b"rank0")], 6, is_state_dict=True)
    asyncio.run(coord.register_and_monitor(6, is_state_dict=True, state_dict_thread_count=1))
    coord.wait_committed(6, is_state_dict=True, timeout_s=30)
    assert {f["path"] for f in manifest(root, 6, Kind.STATE_DICT)["files"]} == {"shard0.bin", "shard1.bin"}
    write(f"{out}/shard1.bin", b"rank1-v2")
    coord.save_sync(lambda: [write(f"{out}/optim.bin", b"o")], 6, is_state_dict=True)
    with pytest.raises(ckptd.CheckpointSaveError, match="shard1.bin"):
        coord.register(6, state_dict_thread_count=1)
        coord.wait_committed(6, timeout_s=30)
    wait_for(lambda: not os.path.exists(f"{out}/{MANIFESTS[Kind.STATE_DICT]}"), what="the state dict to be withdrawn")
    assert tracker(root, Kind.STATE_DICT) is None and ckptd.latest_step(root, "state_dict") is None


def test_a_failure_is_recorded_before_anyone_is_told(make_monitor, tmp_path):
    """A commit fails; its failure record is slow to write. A unit refused with "already failed"
    meanwhile must not hear it before the record is durable: a monitor killed right after would
    otherwise commit the step it reported failed."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, commit_retries=0, runtime_env=failpoint_env(
        "before_manifest=raise,before_failure_record=delay:2", once_dir=tmp_path / "once"))
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    coord.save_async("m", lambda: [write(f"{coord.step_dir(1)}/m.bin", b"m")], 1)
    coord.register(1, checkpoint_thread_count=1)
    wait_for(lambda: status(monitor).step(1).state.value == "failed", what="the commit to fail")
    ran = []
    coord.save_async("late", lambda: ran.append(1), 1)
    assert "has already failed" in wait_all(coord) and ran == []
    restart_monitor(monitor, "SIGKILL")  # at once, as a crash right after the answer would
    assert status(monitor).step(1).state.value == "failed"
    assert not os.path.exists(f"{ckptd.step_dir(root, 1)}/{MANIFESTS[Kind.CHECKPOINT]}")
    with pytest.raises(ckptd.CheckpointSaveError, match="FailpointError"):
        coord.wait_committed(1, timeout_s=10)
