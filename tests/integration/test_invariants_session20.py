"""Attacks on the save-unit fence (``ckptd.fencing.check_fence`` through
``ckptd.commit.publish_guard``): a process of job 1 that outlived its job must not publish into a
root on which job 2 (a newer attempt) has committed.

Every case runs real Ray (the ``ray_local`` / ``make_monitor`` fixtures), real files, real writer
processes and, for object stores, a real S3-protocol server (moto, in server mode on 127.0.0.1).
Job 1's unit is admitted by job 1's monitor, then held on an event (or a file, across processes)
while job 1's monitor goes for good and job 2 starts on the same root and commits a step with
files at the same paths; then job 1's unit goes on. What is attacked:

1. Nothing committed changes: every file of the root outside ``.ckptd`` keeps its bytes, inode
   and mtime (a rename over a file changes its inode), for each way job 1 saves (save thread,
   save_sync, save_state_async eager and fenced, a writer process) and each of ckptd's writers
   (write_safetensors, write_torch, save_hf_model with several shards, DCP through
   CkptdStorageWriter, a nested Storage of another URL and another commit strategy); no temp file
   is left behind.
2. The trackers name steps that verify, and job 2's steps commit, after job 1's failure too.
3. Job 1 alone is not fenced: a monitor restart (ray.kill, SIGKILL) keeps the attempt, so units
   admitted before it and saves after it publish and commit (thread and writer process).
4. The error names both attempts, says nothing was published, and survives pickling and Ray.
5. An S3 root: a multipart upload (a file past the first block) and a single PUT.

And ways around the guard: a save_fn whose writer publishes from another thread (a thread
pool; asyncio.to_thread copies the context and is fenced), a save_fn that returns a generator
(materialised after the guard has ended), a nested Storage, ``takeover=True``, two coordinators
(two jobs) in one process with nested save units, and the step directory a fenced write leaves
behind under an epoch template.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import ray
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.commit import TMP_PREFIX
from ckptd.config import Kind
from ckptd.fencing import FencedError, list_attempts
from ckptd.layout import TRACKERS
from ckptd.storage import Storage
from ckptd.workers import save_hf_model
from ckptd.workers.dcp import CkptdStorageWriter
from ckptd.workers.files import write_torch
from ckptd.workers.safetensors_io import write_safetensors

from .helpers import assert_trackers_verified, restart_monitor, start_new_job, status, wait_all, wait_for

pytestmark = pytest.mark.usefixtures("ray_local")

OLD, NEW = {"w": torch.zeros(64)}, {"w": torch.ones(64)}
STEP = 5


# -- ckptd's writers, as a save_fn of either job calls them (module level: a writer process runs them) --

def w_safetensors(d: str, sd: dict) -> list:
    s = Storage(d)  # a nested Storage: the save_fn's own
    return [write_safetensors(s, s.join("model.safetensors"), {"w": sd["w"]})]


def w_torch(d: str, sd: dict) -> list:
    s = Storage(d)
    return [write_torch(s, s.join("optim.pt"), {"state": {"m": sd["w"]}, "step": STEP})]


def w_hf(d: str, sd: dict) -> list:
    """Several files: config.json, two shards, the index (a shard is 256 bytes, the limit 300)."""
    return save_hf_model(f"{d}/hf", {"a": sd["w"], "b": sd["w"] * 2}, {"model_type": "llama"}, max_shard_size=300)


def w_dcp(d: str, sd: dict) -> list:
    return CkptdStorageWriter(f"{d}/model").save({"w": sd["w"]})


def w_file_url(d: str, sd: dict) -> list:
    """A nested Storage of another spelling of the root (file://), PosixRename."""
    s = Storage(f"file://{d}")
    s.write_atomic(s.join("blob.bin"), sd["w"].numpy().tobytes())
    return [f"{d}/blob.bin"]


def w_dirfs(d: str, sd: dict) -> list:
    """A nested Storage behind dir:// (MoveIntoPlace: temp file, then a move)."""
    s = Storage("dir::file:///")
    s.write_atomic(s.join(d.lstrip("/"), "moved.bin"), sd["w"].numpy().tobytes())
    return [f"{d}/moved.bin"]


WRITERS = {"safetensors": w_safetensors, "torch": w_torch, "hf_sharded": w_hf, "dcp": w_dcp,
           "file_url_storage": w_file_url, "dirfs_storage": w_dirfs}


def write_when_open(gate: str, writer, d: str, sd: dict) -> list:
    """Creates ``{gate}.waiting``, waits for the file ``gate``, then writes (a writer process runs it)."""
    with open(f"{gate}.waiting", "w") as f:
        f.write(str(os.getpid()))
    wait_for(lambda: os.path.exists(gate), timeout_s=60, what="the gate")
    return writer(d, sd)


class Held:
    """Holds a job-1 save between its admission and its write."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def wait(self) -> None:
        self.entered.set()
        assert self.go.wait(60), "the test never opened the gate"

    def then(self, fn, *args):
        def held(*more):
            self.wait()
            return fn(*args, *more)
        return held


# -- what the root holds ---------------------------------------------------------------------------

def files_of(root: str) -> dict[str, tuple[str, int, int]]:
    """Every file outside ``.ckptd``: its content hash, inode and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if os.path.relpath(dirpath, root) == ".":
            dirnames[:] = [d for d in dirnames if d != ".ckptd"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, root)] = (digest, st.st_ino, st.st_mtime_ns)
    return out


def temp_files(root: str) -> list[str]:
    return [p for p in files_of(root) if os.path.basename(p).startswith(TMP_PREFIX)]


def assert_untouched(root: str, before: dict, step: int = STEP) -> None:
    after = files_of(root)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"job 1 changed or added {changed} after job 2 committed"
    assert not temp_files(root)
    assert assert_trackers_verified(root)[Kind.CHECKPOINT] == step
    ckptd.verify(root, step)


def assert_fenced(err: BaseException | None, in_process: bool = True) -> None:
    """Invariant 4: the error names both attempts, says nothing was published, and pickles."""
    assert isinstance(err, ckptd.CheckpointSaveError), repr(err)
    text = str(err)
    assert "attempt 1 of this root was superseded by attempt 2" in text and "did not publish" in text, text
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), str(again), again.step, again.cause) == (type(err), text, err.step, err.cause)
    if in_process:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, FencedError):  # DCP wraps it in its own error
            cause = cause.__cause__
        assert isinstance(cause, FencedError), repr(err.__cause__)
        assert (cause.mine, cause.newer, cause.who) == (1, 2, "save")
        back = pickle.loads(pickle.dumps(cause))
        assert (back.mine, back.newer, back.run, back.who, str(back)) == (1, 2, cause.run, "save", str(cause))


def wait_all_error(coord) -> ckptd.CheckpointSaveError | None:
    """What ``coord.wait_all()`` raises (the exception itself, unlike helpers.wait_all's text)."""
    try:
        coord.wait_all()
    except ckptd.CheckpointSaveError as e:
        return e
    return None


def job_1(make_monitor, root: str, **opts):
    """Job 1: its monitor, a coordinator, and a gate that holds one of its saves after admission."""
    monitor = make_monitor(root, **opts)
    return monitor, ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=10.0), Held()


def job_2_commits(make_monitor, root: str, old_monitor, writers, step: int = STEP, **opts):
    """Job 1's monitor goes; job 2 starts on the root and commits ``step`` with ``writers``' files."""
    monitor2 = start_new_job(make_monitor, root, old_monitor, **opts)
    assert list_attempts(Storage(root))[-1] == 2
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    d = new.step_dir(step)
    new.save_async("job2", lambda: [f for w in writers for f in w(d, NEW)], step)
    new.register(step, checkpoint_thread_count=1)
    new.wait_all()
    new.wait_committed(step, timeout_s=60)
    return monitor2, new


def job_2_goes_on(new, step: int = STEP + 1) -> None:
    """Invariant 2: job 1's failure did not touch job 2's state; its next step commits too."""
    new.wait_committed(STEP, timeout_s=10)
    new.save_async("next", lambda: w_safetensors(new.step_dir(step), NEW), step)
    new.register(step, checkpoint_thread_count=1)
    new.wait_all()
    new.wait_committed(step, timeout_s=60)


def run_in_thread(fn) -> tuple[threading.Thread, list]:
    box: list = []

    def run():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def start_job_1_save(old, mode: str, writer, held: Held):
    """Queue job 1's save of STEP in ``mode``; return a function giving its error once it ended."""
    d = old.step_dir(STEP)
    if mode == "save_async":
        old.save_async("model", held.then(writer, d, OLD), STEP)
    elif mode == "save_sync":
        t, box = run_in_thread(lambda: old.save_sync(held.then(writer, d, OLD), STEP))

        def result():
            t.join(60)
            return box[0]
        return result
    elif mode in ("state_eager", "state_fenced"):
        old.save_state_async("model", OLD, STEP, held.then(writer, d), fenced=mode == "state_fenced")
        if mode == "state_fenced":
            old.before_update()
    else:
        raise AssertionError(mode)

    def error():
        try:
            old.wait_all()
        except ckptd.CheckpointSaveError as e:
            return e
        return None
    return error


CASES = [("save_async", w) for w in WRITERS] + [
    (mode, w) for mode in ("save_sync", "state_eager", "state_fenced") for w in ("safetensors", "hf_sharded", "dcp")]


@pytest.mark.parametrize(("mode", "writer"), CASES, ids=[f"{m}-{w}" for m, w in CASES])
def test_a_job_1_unit_publishes_nothing_over_job_2s_committed_step(make_monitor, tmp_path, mode, writer):
    root = str(tmp_path / "ckpt")
    monitor, old, held = job_1(make_monitor, root)
    error = start_job_1_save(old, mode, WRITERS[writer], held)
    assert held.entered.wait(30)  # admitted by job 1's monitor
    _, new = job_2_commits(make_monitor, root, monitor, [WRITERS[writer]])
    before = files_of(root)
    held.go.set()
    err = error()
    assert_untouched(root, before)
    assert_fenced(err)
    job_2_goes_on(new)
    old.close()
    new.close()


@pytest.mark.parametrize("writer", ["safetensors", "hf_sharded", "dcp"])
def test_a_job_1_writer_process_publishes_nothing_over_job_2s_committed_step(make_monitor, tmp_path, writer):
    """writer="process": a custom write_fn in the writer process, then the default writer
    (write_flat) queued behind it in the same process, admitted before job 2 and writing after."""
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=10.0, writer="process")
    old.save_state_async("custom", OLD, STEP, partial(write_when_open, gate, WRITERS[writer], old.step_dir(STEP)))
    wait_for(lambda: os.path.exists(f"{gate}.waiting"), timeout_s=60, what="the writer process to start")
    old.save_state_async("model", OLD, STEP)  # {step}/model.safetensors, queued behind the held job
    wait_for(lambda: any(u.startswith("w0/model") for u in status(monitor).step(STEP).started),
             what="job 1's monitor to admit the default writer's unit")
    _, new = job_2_commits(make_monitor, root, monitor, [WRITERS[writer], w_safetensors])
    before = files_of(root)
    open(gate, "w").close()
    err = wait_all_error(old)
    assert_untouched(root, before)
    assert_fenced(err, in_process=False)
    assert "more failed saves" in str(err)  # the default writer's unit failed too
    assert torch.equal(load_file(f"{new.step_dir(STEP)}/model.safetensors")["w"], NEW["w"])
    job_2_goes_on(new)
    old.close()
    new.close()


def test_a_takeover_fences_the_old_jobs_units(make_monitor, tmp_path, run_name):
    """Job 2 is another run that takes the root over (takeover=True) while job 1's monitor lives."""
    root = str(tmp_path / "ckpt")
    monitor, old, held = job_1(make_monitor, root)
    old.save_async("model", held.then(w_safetensors, old.step_dir(STEP), OLD), STEP)
    assert held.entered.wait(30)
    monitor2 = make_monitor(root, run=run_name + "-b", takeover=True)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    new.save_async("job2", lambda: w_safetensors(new.step_dir(STEP), NEW), STEP)
    new.register(STEP, checkpoint_thread_count=1)
    new.wait_all()
    new.wait_committed(STEP, timeout_s=60)
    before = files_of(root)
    held.go.set()
    err = wait_all_error(old)
    assert_untouched(root, before)
    assert_fenced(err)
    job_2_goes_on(new)
    old.close()
    new.close()


def test_two_jobs_coordinators_in_one_process_nested_units_fence_only_job_1(make_monitor, tmp_path):
    """Job 1's save_fn runs job 2's save_sync (two coordinators in one thread): job 2's nested
    unit publishes (it belongs to the newest attempt), and job 1's write after it is fenced again
    (the inner guard was undone, not left in place)."""
    root = str(tmp_path / "ckpt")
    monitor, old, held = job_1(make_monitor, root)
    box: dict = {}

    def job_1_save():
        held.wait()
        new = box["new"]
        try:  # job 2's unit, run here
            new.save_sync(lambda: w_torch(new.step_dir(STEP + 1), NEW), STEP + 1)
            box["nested"] = None
        except ckptd.CheckpointSaveError as e:
            box["nested"] = str(e)
        return w_safetensors(old.step_dir(STEP), OLD)

    old.save_async("model", job_1_save, STEP)
    assert held.entered.wait(30)
    _, new = job_2_commits(make_monitor, root, monitor, [w_safetensors])
    box["new"] = new
    new.register(STEP + 1, checkpoint_thread_count=1)
    before = files_of(root)
    held.go.set()
    err = wait_all_error(old)
    assert_fenced(err)  # job 1's own write, after the nested unit
    assert box["nested"] is None, box["nested"]
    new.wait_committed(STEP + 1, timeout_s=60)
    ckptd.verify(root, STEP + 1)
    after = files_of(root)
    assert {p for p in after if p not in before} == {"global_step_6/optim.pt", "global_step_6/ckptd_manifest.json"}
    trackers = set(TRACKERS.values())  # moved to step 6 by job 2
    assert {p: after.get(p) for p in before if p not in trackers} == \
        {p: v for p, v in before.items() if p not in trackers}
    assert not temp_files(root)
    ckptd.verify(root, STEP)
    old.close()
    new.close()


# -- around the guard: other threads, generators, directories ---------------------------------------

def in_thread_pool(d: str, sd: dict) -> list:
    with ThreadPoolExecutor(1) as pool:  # the usual way to write several shards at once
        return pool.submit(w_safetensors, d, sd).result()


def in_asyncio_to_thread(d: str, sd: dict) -> list:
    return asyncio.run(asyncio.to_thread(w_safetensors, d, sd))  # copies the context: fenced


@pytest.mark.parametrize("how", [
    pytest.param(in_asyncio_to_thread, id="asyncio_to_thread"),
    pytest.param(in_thread_pool, id="thread_pool", marks=pytest.mark.xfail(strict=True, reason=(
        "documented limit (docs/contract.md, Limits of the guarantees): publish_guard is a context "
        "variable, and a thread the save_fn starts without copying its context (ThreadPoolExecutor, "
        "threading.Thread) publishes with no fence check, so job 1's write replaces job 2's committed "
        "file."))),
])
def test_a_save_fn_that_writes_from_another_thread_is_fenced(make_monitor, tmp_path, how):
    root = str(tmp_path / "ckpt")
    monitor, old, held = job_1(make_monitor, root)
    old.save_async("model", held.then(how, old.step_dir(STEP), OLD), STEP)
    assert held.entered.wait(30)
    _, new = job_2_commits(make_monitor, root, monitor, [w_safetensors])
    before = files_of(root)
    held.go.set()
    wait_all(old)
    assert_untouched(root, before)
    old.close()
    new.close()


def test_a_save_fn_that_returns_a_generator_of_writes_is_fenced(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor, old, held = job_1(make_monitor, root)
    d = old.step_dir(STEP)

    def lazily():
        yield from w_safetensors(d, OLD)  # runs when the coordinator iterates what save_fn returned

    old.save_async("model", held.then(lazily), STEP)
    assert held.entered.wait(30)
    _, new = job_2_commits(make_monitor, root, monitor, [w_safetensors])
    before = files_of(root)
    held.go.set()
    error = wait_all(old)
    assert_untouched(root, before)
    assert error is not None and "did not publish" in error, error
    old.close()
    new.close()


EPOCH_TEMPLATE = "epoch-{epoch}_step-{step}"


def test_a_fenced_job_1_write_leaves_no_step_directory_that_stops_job_2s_commit(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor, old, held = job_1(make_monitor, root, step_dir_template=EPOCH_TEMPLATE)
    old.save_async("model", held.then(w_safetensors, old.step_dir(7, epoch=1), OLD), 7)
    assert held.entered.wait(30)
    monitor2 = start_new_job(make_monitor, root, monitor, step_dir_template=EPOCH_TEMPLATE)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    held.go.set()
    error = wait_all(old)
    assert error is not None and "did not publish" in error, error
    assert not temp_files(root)
    new.save_async("job2", lambda: w_safetensors(new.step_dir(7, epoch=2), NEW), 7)
    new.register(7, checkpoint_thread_count=1)
    new.wait_all()
    new.wait_committed(7, timeout_s=30)
    ckptd.verify(root, 7)
    old.close()
    new.close()


# -- invariant 3: job 1 alone is not fenced ---------------------------------------------------------

@pytest.mark.parametrize("how", ["ray.kill", "sigkill"])
def test_monitor_restarts_keep_the_attempt_and_job_1s_saves_publish(make_monitor, tmp_path, how):
    root = str(tmp_path / "ckpt")
    gate = str(tmp_path / "gate")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    proc = ckptd.CheckpointCoordinator(monitor, worker_id="wp", writer="process")
    held = Held()
    coord.save_async("model", held.then(w_hf, coord.step_dir(1), OLD), 1)
    proc.save_state_async("state", OLD, 1, partial(write_when_open, gate, w_torch, proc.step_dir(1)))
    assert held.entered.wait(30)
    wait_for(lambda: os.path.exists(f"{gate}.waiting"), timeout_s=60, what="the writer process to start")
    coord.register(1, checkpoint_thread_count=2)
    restart_monitor(monitor, how)  # both units were admitted before, and write after
    held.go.set()
    open(gate, "w").close()
    assert wait_all(coord) is None and wait_all(proc) is None
    coord.wait_committed(1, timeout_s=60)
    restart_monitor(monitor, how)
    coord.save_async("model", lambda: w_dcp(coord.step_dir(2), NEW), 2)
    proc.save_state_async("state", NEW, 2)  # the default writer, in the writer process
    coord.register(2, checkpoint_thread_count=2)
    assert wait_all(coord) is None and wait_all(proc) is None
    coord.wait_committed(2, timeout_s=60)
    assert list_attempts(Storage(root)) == [1]
    assert assert_trackers_verified(root)[Kind.CHECKPOINT] == 2
    assert sorted(ckptd.verify(root, 1).files) == ["hf/config.json", "hf/model-00001-of-00002.safetensors",
                                                    "hf/model-00002-of-00002.safetensors",
                                                    "hf/model.safetensors.index.json", "optim.pt"]
    assert not temp_files(root)
    coord.close()
    proc.close()


# -- invariant 4: across Ray ------------------------------------------------------------------------

@ray.remote(num_cpus=0)
class OldJobWorker:
    """A job-1 training worker in its own process."""

    def __init__(self, run: str) -> None:
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id="actor", notify_timeout_s=10.0)

    def save_async(self, step: int, gate: str) -> None:
        self.coord.save_async("model", partial(write_when_open, gate, w_safetensors, self.coord.step_dir(step), OLD),
                              step)

    def save_sync(self, step: int, gate: str) -> None:
        self.coord.save_sync(partial(write_when_open, gate, w_torch, self.coord.step_dir(step), OLD), step)

    def wait_all(self) -> None:
        self.coord.wait_all()  # raises across Ray


def test_the_fenced_error_crosses_ray_intact(make_monitor, tmp_path, run_name):
    root = str(tmp_path / "ckpt")
    gate_a, gate_s = str(tmp_path / "gate-a"), str(tmp_path / "gate-s")
    monitor = make_monitor(root)
    worker = OldJobWorker.options(max_concurrency=4).remote(run_name)
    ray.get(worker.save_async.remote(STEP, gate_a))
    synced = worker.save_sync.remote(STEP, gate_s)
    for gate in (gate_a, gate_s):
        wait_for(lambda g=gate: os.path.exists(f"{g}.waiting"), timeout_s=60, what="job 1's actor to start")
    _, new = job_2_commits(make_monitor, root, monitor, [w_safetensors, w_torch])
    before = files_of(root)
    open(gate_a, "w").close()
    open(gate_s, "w").close()
    try:
        errors = []
        for ref in (synced, worker.wait_all.remote()):
            with pytest.raises(ckptd.CheckpointSaveError) as e:
                ray.get(ref, timeout=120)
            errors.append((ref, e))
        assert_untouched(root, before)
        for ref, e in errors:
            assert e.value.step == STEP and e.value.kind == "checkpoint", e.value
            assert "superseded by attempt 2" in e.value.reason  # a string through Ray's wrapper too
            # Ray's wrapper (RayTaskError(CheckpointSaveError)) has its own ``cause``: the error raised.
            inner = e.value.cause if isinstance(e.value, ray.exceptions.RayTaskError) else e.value
            assert isinstance(inner, ckptd.CheckpointSaveError)
            assert (inner.step, inner.unit) == (STEP, "actor/sync" if ref is synced else "actor/model")
            for text in (inner.cause, str(inner), str(e.value)):
                assert "attempt 1 of this root was superseded by attempt 2" in text, text
                assert "did not publish" in text and "FencedError" in text, text
        job_2_goes_on(new)
    finally:
        ray.kill(worker)
        new.close()


# -- invariant 5: an S3 root ------------------------------------------------------------------------

def test_an_s3_root_multipart_and_single_put_are_fenced(make_monitor, s3_root, s3_server):
    root, opts = s3_root
    opts = {**opts, "default_block_size": 5 << 20}  # a file past 5 MiB is a multipart upload
    bucket = root.split("/")[2]
    big = {"w": torch.arange(6 << 18, dtype=torch.float32)}  # 6 MiB
    monitor = make_monitor(root, opts)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=10.0)

    def write_both(d: str, scale: float) -> list:
        s = Storage(d, opts)
        return [write_safetensors(s, s.join("big.safetensors"), {"w": big["w"] * scale}),
                write_safetensors(s, s.join("small.safetensors"), {"w": torch.full((16,), scale)})]

    held = Held()
    old.save_async("model", held.then(write_both, old.step_dir(STEP), 0.0), STEP)
    assert held.entered.wait(30)
    monitor2 = start_new_job(make_monitor, root, monitor, storage_options=opts)
    new = ckptd.CheckpointCoordinator(monitor2, worker_id="w1")
    new.save_async("job2", lambda: write_both(new.step_dir(STEP), 1.0), STEP)
    new.register(STEP, checkpoint_thread_count=1)
    new.wait_all()
    new.wait_committed(STEP, timeout_s=60)
    client = s3_server.client()

    def objects() -> dict:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return {o["Key"]: (o["ETag"], o["LastModified"], o["Size"]) for p in pages for o in p.get("Contents", [])
                if not o["Key"].startswith("run/.ckptd/")}

    before = objects()
    assert "-" in before["run/global_step_5/big.safetensors"][0]  # job 2's big file: a multipart upload
    assert "-" not in before["run/global_step_5/small.safetensors"][0]  # and the small one a single PUT
    held.go.set()
    err = wait_all_error(old)
    assert objects() == before
    assert_fenced(err)
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")  # the aborted upload left no parts
    assert not [k for k in before if TMP_PREFIX in k]
    checked = ckptd.verify(root, STEP, storage_options=opts)
    assert sorted(checked.files) == ["big.safetensors", "small.safetensors"]
    assert ckptd.latest_step(root, storage_options=opts) == STEP
    old.close()
    new.close()
