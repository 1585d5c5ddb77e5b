"""Commit-path invariants, attacked through the changes after session 14d (the failure record's
retries, retention's trash emptied by an ``rm -rf`` process, the leaner stat walk, the one-pass
report check, returned paths normalised) with a real monitor, real files and real restarts.

1. A tracker only ever names a step that ``ckptd.verify`` accepts.
2. A step reported failed never commits, also after a monitor restart or under a new job.
3. Nothing committed is lost, changed or overwritten: retention deletes no tracker target, no step
   in flight, no leased step, and odd entries in a step directory make the walk skip no file.
4. Trinity's semantics: registrations add up per kind; a full checkpoint waits for its step's
   state-dict units.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest
import ray

import ckptd
from ckptd.layout import MANIFESTS
from ckptd.manifest import Manifest

from .helpers import assert_trackers_verified, restart_monitor, status, wait_for

CKPT, SD = ckptd.Kind.CHECKPOINT, ckptd.Kind.STATE_DICT


def _manifest(root: str, step: int, kind: ckptd.Kind = CKPT) -> Manifest | None:
    path = os.path.join(ckptd.step_dir(root, step), MANIFESTS[kind])
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return Manifest.model_validate_json(f.read())


def _steps(root: str) -> set[int]:
    return {int(n.rsplit("_", 1)[1]) for n in os.listdir(root) if n.startswith("global_step_")}


def _save_weights(coord, root: str, step: int, extra=None) -> None:
    """A state-dict step of one unit writing model.bin (and whatever ``extra(step_dir)`` adds)."""
    def save() -> list[str]:
        d = ckptd.step_dir(root, step)
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/model.bin", "wb") as f:
            f.write(os.urandom(128))
        return [f"{d}/model.bin"] + (extra(d) if extra is not None else [])

    coord.register(step, is_state_dict=True, state_dict_thread_count=1)
    coord.save_async("weights", save, step, is_state_dict=True)
    coord.wait_committed(step, is_state_dict=True, timeout_s=30)


def _immutable(path: str, on: bool) -> bool:
    """chattr +i / -i: a file that even root cannot remove. False where the filesystem (or the
    user) cannot do it."""
    if shutil.which("chattr") is None:
        return False
    done = subprocess.run(["chattr", "+i" if on else "-i", path], capture_output=True)
    return done.returncode == 0


def test_a_trash_entry_rm_cannot_remove_does_not_stop_retention(make_monitor, tmp_path):
    """Retention renames an old step into .ckptd/trash, then 'rm -rf' fails on a file in it (an
    immutable file: chmod does not stop root). Every later pass began by emptying the trash and
    raised there, so retention deleted nothing more: the disk filled up. The trash entry stays
    (and is retried); the steps past the policy still go."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, max_state_dict_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    stuck = []

    def pinned(d: str) -> list[str]:
        path = f"{d}/pinned.bin"
        with open(path, "wb") as f:
            f.write(b"p" * 16)
        stuck.append(path)
        return [path]

    _save_weights(coord, root, 1, extra=pinned)
    if not _immutable(stuck[0], True):
        coord.close()
        pytest.skip("chattr +i is not possible here")
    trash = os.path.join(root, ".ckptd", "trash")
    try:
        for step in (2, 3):
            _save_weights(coord, root, step)
        assert ray.get(monitor.wait_retention.remote(60))
        assert _steps(root) == {2, 3}  # step 1 went to the trash; rm could not remove all of it
        (left,) = os.listdir(trash)
        assert status(monitor).retention.errors, "the failed removal is reported"
        for step in (4, 5):
            _save_weights(coord, root, step)
        assert ray.get(monitor.wait_retention.remote(60))
        assert _steps(root) == {4, 5}
        assert os.listdir(trash) == [left]  # retried at each pass, never lost track of
    finally:
        for dirpath, _dirs, files in os.walk(trash):
            for name in files:
                _immutable(os.path.join(dirpath, name), False)
    # Once removable, the next pass empties the trash.
    _save_weights(coord, root, 6)
    assert ray.get(monitor.wait_retention.remote(60))
    assert not os.path.exists(trash) or os.listdir(trash) == []
    assert assert_trackers_verified(root)[SD] == 6
    coord.close()


def test_a_fifo_in_a_step_directory_neither_hangs_the_commit_nor_enters_the_manifest(make_monitor, tmp_path):
    """A save leaves a named pipe in its step directory (a tool's progress pipe, say). The walk
    listed it as a file of size 0, and the commit opened it to checksum it: the monitor's I/O
    thread blocked for ever and the step never committed. Only regular files (or links to them)
    are files of a step."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")

    def fifo(d: str) -> list[str]:
        os.mkfifo(f"{d}/progress.pipe")
        os.symlink(f"{d}/progress.pipe", f"{d}/pipe.link")
        return []

    _save_weights(coord, root, 1, extra=fifo)
    assert [f.path for f in _manifest(root, 1, SD).files] == ["model.bin"]
    assert assert_trackers_verified(root)[SD] == 1
    coord.close()


def test_a_file_named_like_a_ckptd_manifest_below_the_top_of_a_step_is_a_file_of_the_step(make_monitor, tmp_path):
    """A save copies a committed step of another ckptd root into a subdirectory (a reference
    model), manifest included: ref/ckptd_manifest.json. Only the top of a step directory holds
    ckptd's manifests; the walk skipped the name anywhere, so the step failed ("missing from
    storage") when the save named the file, and the file was left out of the manifest (no CRC
    protects it) when the save's files were found by time."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")

    def reference(d: str) -> list[str]:
        os.makedirs(f"{d}/ref")
        for name in ("ckptd_manifest.json", "ckptd_state_dict_manifest.json"):
            with open(f"{d}/ref/{name}", "w") as f:
                f.write('{"copied": true}')
        return [f"{d}/ref/ckptd_manifest.json"]  # the other one is found as written outside units

    _save_weights(coord, root, 1, extra=reference)
    assert sorted(f.path for f in _manifest(root, 1, SD).files) == [
        "model.bin", "ref/ckptd_manifest.json", "ref/ckptd_state_dict_manifest.json"]
    assert assert_trackers_verified(root)[SD] == 1
    coord.close()


def test_returned_paths_that_name_a_file_of_the_step_in_other_spellings_commit(make_monitor, tmp_path):
    """A save function returns its files as '//<step dir>/model.bin' (POSIX: the same file; "/" +
    an absolute path gives it), 'sub/../sub/optim.bin' and './/extra.bin'. Each names a file of
    the step, and the step commits listing each once by its name on storage (the first was refused
    as outside the step, the second as escaping it, which the same path made absolute was not)."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(3)

    def save() -> list[str]:
        os.makedirs(f"{out}/sub")
        for rel in ("model.bin", "sub/optim.bin", "extra.bin"):
            with open(f"{out}/{rel}", "wb") as f:
                f.write(os.urandom(64))
        return ["/" + f"{out}/model.bin", "sub/../sub/optim.bin", ".//extra.bin", f"{out}/sub/./../sub/optim.bin"]

    coord.register(3, checkpoint_thread_count=1)
    coord.save_async("model", save, 3)
    coord.wait_committed(3, timeout_s=30)
    assert sorted(f.path for f in _manifest(root, 3).files) == ["extra.bin", "model.bin", "sub/optim.bin"]
    assert assert_trackers_verified(root)[CKPT] == 3
    coord.close()


def test_a_link_into_another_step_is_refused_so_retention_cannot_break_a_committed_step(make_monitor, tmp_path):
    """Steps 2 and 3 link their frozen embeddings to step 1's file instead of writing them again.
    Retention (two state dicts kept) deletes step 1, and the committed step 3, the tracker's
    step, lost a file: verify rejected it. A file of a step that is a link into another directory
    under the root now fails its step, naming the file; a link within the step, or to a file
    outside the root (a shared tokenizer), still commits."""
    root = str(tmp_path / "ckpt")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tokenizer.json").write_text("{}")
    monitor = make_monitor(root, max_state_dict_to_keep=2)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")

    def embeddings(d: str) -> list[str]:
        with open(f"{d}/embed.bin", "wb") as f:
            f.write(b"e" * 64)
        os.symlink("model.bin", f"{d}/model.link")
        os.symlink(shared / "tokenizer.json", f"{d}/tokenizer.json")
        return [f"{d}/embed.bin", f"{d}/model.link", f"{d}/tokenizer.json"]

    _save_weights(coord, root, 1, extra=embeddings)
    for step in (2, 3):
        def linked(d: str) -> list[str]:
            os.symlink("../global_step_1/embed.bin", f"{d}/embed.bin")
            return [f"{d}/embed.bin"]

        with pytest.raises(ckptd.CheckpointSaveError, match=r"embed\.bin.*link"):
            _save_weights(coord, root, step, extra=linked)
    _save_weights(coord, root, 4)
    assert ray.get(monitor.wait_retention.remote(60))
    assert assert_trackers_verified(root)[SD] == 4
    for step in _steps(root) & {1, 4}:
        ckptd.verify(root, step)
    coord.close()


def _refuse_failure_records(monitor, refuse: bool) -> None:
    """Storage refuses the monitor's failure records (the before_failure_record failpoint, armed
    in the running monitor's process only: a restarted one starts without it)."""
    def set_it(_self):
        from ckptd import failpoints
        if refuse:
            failpoints.arm("before_failure_record", "raise")
        else:
            failpoints.disarm("before_failure_record")
    ray.get(monitor.__ray_call__.remote(set_it))


def _fail_commit_check(coord, monitor, step: int) -> str:
    """Step ``step`` of two units whose commit check fails (a reported file grew after its unit
    reported it); returns that file."""
    out = coord.step_dir(step)
    os.makedirs(out)
    coord.register(step, checkpoint_thread_count=2)
    path = os.path.join(out, "a.bin")
    with open(path, "wb") as f:
        f.write(b"a" * 100)
    coord.save_sync(lambda: [path], step)
    with open(path, "ab") as f:
        f.write(b"more")
    coord.save_sync(lambda: [], step)
    wait_for(lambda: status(monitor).step(step).state.value == "failed", what=f"step {step} failed in memory")
    return path


def test_a_monitor_killed_while_its_failure_record_is_refused_never_commits_a_reported_failure(
        make_monitor, tmp_path):
    """The failure record of step 7 is refused, and the monitor is SIGKILLed inside its retry
    loop: nobody had been told. The restarted monitor fails the step again from storage (the file
    is still changed) and reports it once recorded; then a further restart and a new job on the
    same root never commit it, and the new job's steps commit."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    _refuse_failure_records(monitor, True)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    _fail_commit_check(coord, monitor, 7)
    wait_for(lambda: ray.get(monitor.__ray_call__.remote(
        lambda self: (7, CKPT) in self._failures_recorded and (7, CKPT) not in self._failures_durable)),
        what="the retry loop")
    with pytest.raises(TimeoutError):  # not recorded: not reported
        coord.wait_committed(7, timeout_s=0.5)
    coord.wait_all()  # both units succeeded: wait_all does not report the step's failure
    restart_monitor(monitor, how="sigkill")
    with pytest.raises(ckptd.CheckpointSaveError, match="commit failed"):
        coord.wait_committed(7, timeout_s=30)
    restart_monitor(monitor)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(7, timeout_s=30)
    coord.close()
    assert _manifest(root, 7) is None and ckptd.latest_step(root) is None

    run = ray.get(monitor.ping.remote())["run"]
    ray.kill(monitor, no_restart=True)  # the job ends
    job = make_monitor(root, run=f"{run}-b")
    coord = ckptd.CheckpointCoordinator(job, worker_id="w1")
    _save_weights(coord, root, 8)
    coord.close()
    assert 7 not in _steps(root) and _manifest(root, 7) is None
    assert assert_trackers_verified(root) == {SD: 8, CKPT: None}


def test_a_new_job_taking_over_while_the_old_monitor_retries_a_failure_record(make_monitor, tmp_path, run_name):
    """The old job's monitor is retrying step 7's failure record (nobody was told) when a new
    job takes the root over: the old monitor is stopped mid-retry, and the failure never reached
    storage. The new job never commits step 7 (the old attempt's uncommitted step is cleaned up),
    not after its own restart either, and its own steps commit."""
    root = str(tmp_path / "ckpt")
    old = make_monitor(root)
    _refuse_failure_records(old, True)
    coord = ckptd.CheckpointCoordinator(old, worker_id="w0")
    _fail_commit_check(coord, old, 7)
    with pytest.raises(TimeoutError):
        coord.wait_committed(7, timeout_s=0.5)
    job = make_monitor(root, run=f"{run_name}-b", takeover=True)
    assert not os.path.exists(ckptd.step_dir(root, 7))  # the old attempt's uncommitted step: gone
    new = ckptd.CheckpointCoordinator(job, worker_id="w1")
    _save_weights(new, root, 8)
    restart_monitor(job)
    _save_weights(new, root, 9)
    new.close()
    coord.close()
    assert 7 not in _steps(root) and _manifest(root, 7) is None
    assert assert_trackers_verified(root) == {SD: 9, CKPT: None}


def test_registrations_add_up_and_a_full_checkpoint_waits_for_its_state_dict_unit(make_monitor, tmp_path):
    """Trinity: a state dict of one unit and two checkpoint registrations of one unit each. Both
    checkpoint units finish first: the full checkpoint waits for the state-dict unit (and for the
    second registration's unit); then one commit lists all three files and moves both trackers."""
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    out = coord.step_dir(5)
    os.makedirs(out)
    release = threading.Event()

    def writer(name: str, gate: threading.Event | None = None):
        def save() -> list[str]:
            if gate is not None:
                assert gate.wait(60), "never released"
            with open(f"{out}/{name}", "wb") as f:
                f.write(os.urandom(32))
            return [f"{out}/{name}"]
        return save

    coord.register(5, is_state_dict=True, state_dict_thread_count=1)
    coord.register(5, checkpoint_thread_count=1)
    coord.save_async("weights", writer("model.bin", release), 5, is_state_dict=True)
    coord.save_async("optim", writer("optim.bin"), 5)
    wait_for(lambda: len(status(monitor).step(5).finished) == 1, what="the first checkpoint unit")
    coord.register(5, checkpoint_thread_count=1)  # adds to the first: two checkpoint units now
    coord.save_sync(writer("rng.bin"), 5)
    with pytest.raises(TimeoutError):
        coord.wait_committed(5, timeout_s=0.5)
    assert _manifest(root, 5) is None
    release.set()
    coord.wait_committed(5, timeout_s=30)
    assert sorted(f.path for f in _manifest(root, 5).files) == ["model.bin", "optim.bin", "rng.bin"]
    assert _manifest(root, 5).registered == 2
    assert assert_trackers_verified(root) == {SD: 5, CKPT: 5}
    coord.close()


def test_writer_slots_expire_while_a_timed_out_steps_failure_record_is_refused(make_monitor, tmp_path, run_name):
    """Step 5 times out while storage refuses failure records: the monitor retries the record
    (nobody is told before it is written). Housekeeping awaited that retry loop, so a dead
    writer's slot was never taken back and every other save waited for it. The slot lease must
    still expire; once storage takes the record, the timeout is reported."""
    from .helpers import SaveWorker, Signal

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root, save_strategy="single_thread", slot_lease_s=1.0, step_timeout_s=1.0)
    _refuse_failure_records(monitor, True)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    coord.register(5, checkpoint_thread_count=1)  # never saved: times out
    wait_for(lambda: ray.get(monitor.__ray_call__.remote(
        lambda self: (5, CKPT) in self._failures_recorded and (5, CKPT) not in self._failures_durable)),
        what="the failure record's retry loop")
    worker = SaveWorker.remote(run_name, 0)
    ray.get(worker.save.remote(1, gate=Signal.remote()))  # holds the slot, never finishes
    wait_for(lambda: status(monitor).writers.holders, what="the worker to hold the slot")
    ray.kill(worker)
    wait_for(lambda: not status(monitor).writers.holders, timeout_s=20, what="the dead writer's slot to expire")
    with pytest.raises(TimeoutError):  # not recorded yet: not reported
        coord.wait_committed(5, timeout_s=0.5)
    _refuse_failure_records(monitor, False)
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(5, timeout_s=30)
    coord.close()
