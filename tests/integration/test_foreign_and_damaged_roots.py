"""Roots ckptd did not write all of, or that were damaged: another tool's checkpoints beside
ckptd's (a verl run switched to ckptd half-way keeps its old ``global_step_N`` directories and
tracker), trackers and manifests edited or corrupted by hand, a tracker left behind by a crash,
and output directories that would mix files. Found by a helper's audit from a user's side
(session 37): before, retention, ``gc`` and ``retire`` deleted the other tool's checkpoints, and
damaged files gave raw tracebacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import ray

import ckptd
from ckptd.cli import main
from ckptd.gc import plan_gc
from ckptd.workers.export import export_hf_step

from .helpers import actor_gone, commit_one, in_thread, status, tracker_of, wait_for, write_file

pytestmark = pytest.mark.usefixtures("ray_local")

CKPT = ckptd.Kind.CHECKPOINT
HOUR_AGO = time.time() - 3600


def _another_tools_steps(root: str, steps=(5, 10, 15)) -> None:
    """What verl leaves: step directories of its own files, and its tracker; nothing of ckptd's."""
    for step in steps:
        d = f"{root}/global_step_{step}/actor"
        write_file(f"{d}/model.pt", b"weights %d" % step)
        for path in (f"{d}/model.pt", d, os.path.dirname(d)):
            os.utime(path, (HOUR_AGO, HOUR_AGO))
    write_file(f"{root}/latest_checkpointed_iteration.txt", f"{steps[-1]}\n".encode())


def _theirs_intact(root: str, steps=(5, 10, 15)) -> bool:
    return all(open(f"{root}/global_step_{s}/actor/model.pt", "rb").read() == b"weights %d" % s for s in steps)


def cli(*argv: str) -> subprocess.CompletedProcess:
    """The command line in a process of its own (no Ray initialised there)."""
    return subprocess.run([sys.executable, "-m", "ckptd", *argv], capture_output=True, text=True, timeout=120)


def test_another_tools_checkpoints_in_the_root_are_never_deleted(make_monitor, tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    _another_tools_steps(root)
    monitor = make_monitor(root, leftover_grace_s=1.0, max_ckpt_to_keep=2)  # theirs: an hour old
    assert tracker_of(root, CKPT) == 15  # the other tool's tracker: not removed at start-up,
    assert status(monitor).trackers.checkpoint is None  # and not taken for a step of ckptd's
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (20, 21, 22):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    # A save at a step number the other tool has: refused before it writes (its files would mix with
    # that checkpoint's, and go with the step later); the failed step's directory stays theirs.
    with pytest.raises(ckptd.CheckpointSaveError, match="global_step_15 holds another tool's checkpoint"):
        coord.save_sync(lambda: write_file(f"{root}/global_step_15/model.bin", b"ckptd's"), 15)
    commit_one(coord, 23, "model.bin", is_state_dict=False)
    assert ray.get(monitor.wait_retention.remote(60))
    assert status(monitor).retention.deleted_steps == [20, 21]  # ckptd's own steps past the policy only
    assert _theirs_intact(root) and not os.path.exists(f"{root}/global_step_15/model.bin")
    assert tracker_of(root, CKPT) == 23  # ckptd's first commit took the tracker
    coord.close()
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="the monitor to be gone")

    plan = plan_gc(root, min_idle_s=0)
    assert plan.items == [] and sorted(plan.not_ours) == ["global_step_10", "global_step_15", "global_step_5"]
    assert main(["gc", root, "--min-idle", "0"]) == 0
    said = "kept (there before ckptd first used the root: another tool's): global_step_5"
    assert said in capsys.readouterr().out
    assert ckptd.retire_steps(root, after=22) == [23]
    assert _theirs_intact(root) and tracker_of(root, CKPT) == 22
    assert ckptd.resume(root).step == 22


def test_a_new_job_keeps_another_tools_directories_the_old_job_left_records_for(make_monitor, tmp_path):
    """The old job's save at another tool's step number was refused, and it registered another of
    them: its records name those steps. The new job's clean-up of the old attempt's uncommitted
    steps deleted both directories, and its tracker repair then the other tool's tracker. Found
    by a helper's attack (session 37)."""
    root = str(tmp_path / "ckpt")
    _another_tools_steps(root)
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 20, "weights.bin", is_state_dict=True)  # a state dict only: the checkpoint tracker stays theirs
    with pytest.raises(ckptd.CheckpointSaveError, match="holds another tool's checkpoint"):
        coord.save_sync(lambda: write_file(f"{root}/global_step_15/model.bin", b"ckptd's"), 15)
    coord.register(10, checkpoint_thread_count=2)
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="the old job's monitor to be gone")
    make_monitor(root, run="the-next-job")
    assert _theirs_intact(root) and tracker_of(root, CKPT) == 15
    with pytest.raises(ckptd.CheckpointError, match="names step 15"):
        ckptd.resume(root)


def test_another_tools_checkpoints_in_the_mirror_are_never_deleted(make_monitor, tmp_path):
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    _another_tools_steps(mirror)
    monitor = make_monitor(root, mirror={"url": mirror, "max_ckpt_to_keep": 2})
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (20, 21, 22):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    coord.wait_mirrored(22, timeout_s=60)
    wait_for(lambda: status(monitor).mirror.deleted_steps == [20], what="the mirror's retention of step 20")
    assert ray.get(monitor.wait_retention.remote(60))
    assert _theirs_intact(mirror)  # before, the mirror deleted them at once, as killed uploads
    coord.close()


def test_a_root_of_another_tool_only_is_refused_where_ckptd_would_lose_its_training(ray_local, tmp_path):
    root = str(tmp_path / "verl")
    _another_tools_steps(root)
    with pytest.raises(ckptd.CheckpointError, match="names step 15, which ckptd did not commit"):
        ckptd.resume(root)  # a silent fresh start would drop the other tool's 15 steps
    with pytest.raises(ckptd.CheckpointConfigError, match="was saved by ckptd"):
        ckptd.retire_steps(root, after=5)
    assert plan_gc(root, min_idle_s=0).items == []
    assert _theirs_intact(root) and tracker_of(root, CKPT) == 15
    with pytest.raises(ckptd.CheckpointConfigError, match="does not exist"):
        plan_gc(str(tmp_path / "typo"))
    write_file(str(tmp_path / "afile"), b"x")
    with pytest.raises(ckptd.CheckpointConfigError, match="is a file"):
        ckptd.retire_steps(str(tmp_path / "afile"), after=1)
    with pytest.raises(ckptd.CheckpointConfigError, match="is a file"):
        ckptd.resume(str(tmp_path / "afile"))
    assert ckptd.resume(str(tmp_path / "new")) is None  # a root not created yet: a fresh start


def test_damaged_trackers_and_manifests_are_said_not_raised_raw(make_monitor, tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2, 3):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    coord.close()
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="the monitor to be gone")

    write_file(f"{root}/latest_checkpointed_iteration.txt", b"garbage\x00\xff")  # not even text
    assert ckptd.latest_step(root) == 3 and ckptd.verify(root).step == 3
    capsys.readouterr()
    assert main(["latest", root]) == 0 and "checkpoint: 3" in capsys.readouterr().out

    for step, text in ((2, b"{}"), (3, b'{"not json')):
        write_file(f"{root}/global_step_{step}/ckptd_manifest.json", text)
    with pytest.raises(ckptd.CorruptCheckpointError, match="global_step_3/ckptd_manifest.json: not a valid ckptd"):
        ckptd.verify(root, 3)
    with pytest.raises(ckptd.CorruptCheckpointError, match="global_step_2/ckptd_manifest.json: not a valid ckptd"):
        ckptd.resume(root, step=2)
    assert main(["ls", root]) == 1  # every step listed, the damaged ones said so
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "global_step_2/ckptd_manifest.json" in out and " 1  checkpoint " in out
    assert main(["show", root, "2"]) == 1
    assert "FAILED: " in capsys.readouterr().err
    # A new job on the root: refused before it writes anything, naming the damaged manifest its
    # trackers would name (the newest step's); before, its monitor started and pointed them there.
    before = sorted(os.listdir(f"{root}/.ckptd/attempts"))
    with pytest.raises(ckptd.CorruptCheckpointError, match="global_step_3/ckptd_manifest.json: not a valid") as e:
        make_monitor(root, run="the-next-job")
    assert "global_step_2" not in str(e.value) and "move the step's directory out" in str(e.value)
    assert sorted(os.listdir(f"{root}/.ckptd/attempts")) == before
    assert open(f"{root}/latest_checkpointed_iteration.txt", "rb").read() == b"garbage\x00\xff"
    os.rename(f"{root}/global_step_3", str(tmp_path / "step_3_set_aside"))
    with pytest.raises(ckptd.CorruptCheckpointError, match="global_step_2/ckptd_manifest.json"):
        make_monitor(root, run="the-next-job")  # the newest now
    os.rename(f"{root}/global_step_2", str(tmp_path / "step_2_set_aside"))
    monitor = make_monitor(root, run="the-next-job")  # it read the tracker that is not text as none
    assert status(monitor).attempt == 2 and tracker_of(root, CKPT) == 1


def test_a_damaged_state_dict_manifest_refuses_the_start_before_anything_is_written(make_monitor, tmp_path):
    """A state dict's manifest without its full checkpoint is read at start-up (a later unit of the
    step is checked against it): damaged, it failed the monitor actor's start with a bare
    ActorDiedError, and the coordinators then waited until their timeout (helper-64)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "weights.bin", is_state_dict=True)
    commit_one(coord, 2, "model.bin", is_state_dict=False)
    coord.close()
    ray.kill(monitor, no_restart=True)
    wait_for(lambda: actor_gone(monitor), what="the monitor to be gone")
    write_file(f"{root}/global_step_1/ckptd_state_dict_manifest.json", b"")
    before = sorted(os.listdir(f"{root}/.ckptd/attempts"))
    with pytest.raises(ckptd.CorruptCheckpointError, match="global_step_1/ckptd_state_dict_manifest.json: not a"):
        make_monitor(root, run="the-next-job")
    assert sorted(os.listdir(f"{root}/.ckptd/attempts")) == before
    assert main(["retire", root, "--after", "0", "--yes"]) == 0  # what the message offers
    assert status(make_monitor(root, run="the-next-job")).trackers.checkpoint is None


def test_a_monitor_that_cannot_rebuild_after_a_crash_fails_its_coordinators_calls_at_once(make_monitor, tmp_path):
    """The root's layout record, damaged while the monitor was down, kills the restarted actor for
    good (it cannot find the step directories without it): a coordinator's call said so only at its
    notify_timeout_s (600 s by default), and the readers raised a bare JSONDecodeError."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    for step in (1, 2):
        commit_one(coord, step, "model.bin", is_state_dict=False)
    write_file(f"{root}/.ckptd/layout.json", b'{"step_dir_template": ')
    os.kill(ray.get(monitor.ping.remote())["pid"], signal.SIGKILL)
    outcome, error = in_thread(lambda: coord.register(3, checkpoint_thread_count=1), 120)
    assert outcome == "raised" and isinstance(error, ckptd.CheckpointError), (outcome, error)
    assert "died in its start-up" in str(error) and ".ckptd/layout.json is not the layout" in str(error), error
    coord.close()
    read = cli("latest", root)  # a process that has not read it before (what it read is kept per process)
    assert read.returncode == 1 and "layout.json is not the layout record ckptd writes" in read.stderr, read.stderr
    with pytest.raises(ckptd.CorruptCheckpointError, match="Restore it"):
        make_monitor(root, run="the-next-job")


def test_an_export_that_would_mix_files_is_refused_before_anything_is_written(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    commit_one(coord, 1, "model.safetensors", is_state_dict=True)
    before = open(f"{coord.step_dir(1)}/model.safetensors", "rb").read()
    for out, said in ((coord.step_dir(1), "inside the checkpoint root"), (root, "inside the checkpoint root"),
                      (str(tmp_path / "ckpt" / "exports" / "hf"), "inside the checkpoint root")):
        with pytest.raises(ckptd.CheckpointConfigError, match=said):
            export_hf_step(root, 1, out, {"model_type": "llama"})
    old = tmp_path / "old-export"
    write_file(str(old / "model.safetensors"), b"another step's weights")
    with pytest.raises(ckptd.CheckpointConfigError, match="is not empty"):
        export_hf_step(root, 1, str(old), {"model_type": "llama"})
    write_file(str(tmp_path / "afile"), b"x")
    with pytest.raises(ckptd.CheckpointConfigError, match="is a file"):
        export_hf_step(root, 1, str(tmp_path / "afile"), {"model_type": "llama"})
    assert open(f"{coord.step_dir(1)}/model.safetensors", "rb").read() == before
    assert not os.path.exists(f"{root}/exports") and os.listdir(old) == ["model.safetensors"]
    ckptd.verify(root, 1)
    coord.close()


def test_the_command_line_says_what_is_wrong_at_once(tmp_path):
    root = str(tmp_path / "ckpt")
    os.makedirs(f"{root}/.ckptd")
    start = time.monotonic()
    proc = cli("gc", root, "--dry-run", "--address", "127.0.0.1:1")
    assert proc.returncode == 1 and "no Ray cluster at '127.0.0.1:1'" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 60  # Ray alone would keep trying for over a minute
    proc = cli("retire", root, "--after", "-1")  # the dry run checks what --yes checks
    assert proc.returncode == 1 and "after must be >= 0" in proc.stderr, proc.stderr
    proc = cli("gc", root, "--keep-checkpoints", "3")
    assert proc.returncode == 2 and "removes nothing" in proc.stderr, proc.stderr
    proc = cli("latest", str(tmp_path / "typo"))
    assert proc.returncode == 1 and "it does not exist" in proc.stderr, proc.stderr
    proc = cli("timeline", str(tmp_path / "typo"), "--out", str(tmp_path / "t.png"))
    assert proc.returncode == 1 and "no such checkpoint root" in proc.stderr, proc.stderr
