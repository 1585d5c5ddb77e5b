"""Attacks on the commit protocol around the resized O_DIRECT bounce buffers
(``ckptd.direct_io.buffer_size`` and the LRU cache of free buffers) and the save-unit fence
(``ckptd.fencing.check_fence`` through ``ckptd.commit.publish_guard``), with large files written
by the default staged writer (``save_state_async(..., fenced=True)`` + ``before_update``) on ext4.

Real Ray (the ``ray_local`` / ``make_monitor`` fixtures), real files under ``tmp_path`` (ext4 here,
so ``direct_io="auto"`` takes O_DIRECT for files of 32 MiB and more), real writer processes.
What is attacked:

1. Large staged saves at and around every buffer step (32 MiB, 128 MiB, 256 MiB +/- a block,
   384 MiB, 512 MiB, odd tails), in an order that makes the free-buffer cache hand out and evict
   buffers of every size: each file is the fenced snapshot (not the tensor changed after
   ``before_update``), verifies, and no committed file changes afterwards.
2. write_torch with a size hint that is wrong both ways (views of one storage: the pickle is much
   smaller, or much larger, than the hint): the files verify and load back.
3. A unit that fails inside an O_DIRECT write (after several buffers went out): the step is
   reported failed and never commits, not after a retried registration, a monitor restart
   (SIGKILL), a new job of the same run name, nor one of another run name; the buffers it gave back
   write a correct file next; trackers name only verified steps.
4. A failure from the fence (a job-1 staged unit finishing after job 2 started): job 2 never
   counts job 1's finished unit of that step.
5. Trinity semantics with large staged units: registrations add up per kind, a full checkpoint
   waits for the state-dict unit of its step, units may finish before the registration, and a
   monitor restart in the middle does not lose or double a registration.
6. No false fencing in the current job: several coordinators, save_sync inside save_async of
   another coordinator, a monitor SIGKILL mid-save of a large staged unit, ``writer="process"``
   after its process was SIGKILLed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

import ckptd
from ckptd.coordinator.writer_process import write_flat_into
from ckptd.direct_io import DirectWriter, buffer_size
from ckptd.storage import Storage
from ckptd.workers.files import load_torch, write_stream, write_torch

from .helpers import (
    assert_not_committed,
    assert_trackers_verified,
    kill_gated_writer,
    read_manifest,
    restart_monitor,
    start_new_job,
    wait_all,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(autouse=True)
def _remove_large_files(tmp_path):
    """These tests write about 3.5 GB; pytest keeps the temporary directories of its last three
    runs, which would fill a small disk. Removed after the monitors are gone (fixtures end in
    reverse order, and this one starts first)."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)

MiB = 1 << 20


def big(nbytes: int, seed: int) -> torch.Tensor:
    """An int32 tensor of ``nbytes`` (a multiple of 4) whose every word differs from its
    neighbours, so a block written twice, skipped or shifted shows."""
    return torch.arange(nbytes // 4, dtype=torch.int32).add_(seed * 7919)


def sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * MiB):
            h.update(chunk)
    return h.hexdigest()


def files_of(root: str) -> dict[str, tuple[int, int, int]]:
    """Every file of a step (outside .ckptd and the trackers, which move): its inode, size and
    modification time (a write in place changes it; the bytes are hashed once, see the test)."""
    out = {}
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".ckptd"]
        for n in names:
            if d == root:
                continue
            p = os.path.join(d, n)
            st = os.stat(p)
            out[p] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def staged_save(coord, name: str, state: dict, step: int, **kw) -> None:
    coord.save_state_async(name, state, step, fenced=True, **kw)
    coord.before_update()


# -- 1. every buffer step -------------------------------------------------------------------------

SIZES = [512 * MiB + 12, 32 * MiB, 384 * MiB + 8, 256 * MiB - 4096, 256 * MiB + 4096, 128 * MiB + 4,
         48 * MiB + 4, 512 * MiB + 4]


def test_large_staged_saves_at_every_buffer_step_are_the_snapshot_and_never_change(make_monitor, tmp_path):
    assert sorted({buffer_size(s) for s in SIZES}) == [16 * MiB, 32 * MiB, 48 * MiB, 64 * MiB]
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0")
    committed: dict[str, tuple[int, int, int]] = {}
    hashes: dict[str, str] = {}  # each file's bytes when it was committed
    for step, size in enumerate(SIZES, start=1):
        t = big(size, step)
        want = t.clone()
        staged_save(coord, "w", {"w": t}, step)
        t.add_(1)  # the optimizer step: the checkpoint must hold the snapshot
        coord.register(step, checkpoint_thread_count=1)
        coord.wait_committed(step, timeout_s=120)
        path = os.path.join(coord.step_dir(step), "w.safetensors")
        ckptd.verify(root, step)
        assert torch.equal(load_file(path)["w"], want), f"step {step} ({size} bytes) is not the snapshot"
        del t, want
        # Nothing committed earlier changed (inode, size, time; the bytes at the end).
        now = files_of(root)
        for p, v in committed.items():
            assert now[p] == v, f"{p} changed after it was committed"
        hashes.update({p: sha(p) for p in now if p not in hashes})
        committed = now
    for p, h in hashes.items():
        assert sha(p) == h, f"{p} changed after it was committed"
    assert wait_all(coord) is None
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == len(SIZES)
    coord.close()


# -- 2. a wrong size hint -------------------------------------------------------------------------

def torch_hint_too_large(d: str) -> list:
    """8 views of one 40 MiB storage: the hint is 8 x 40 MiB (a 48 MiB buffer), the pickle 40 MiB."""
    base = big(40 * MiB, 3)
    s = Storage(d)
    s.makedirs(s.root)
    return [write_torch(s, s.join("views.pt"), {f"v{i}": base for i in range(8)})]


def torch_hint_too_small(d: str) -> list:
    """A 36 MiB hint (O_DIRECT, 16 MiB buffers) for a 300 MiB pickle (a slice of a big storage
    saves the whole storage), and a 1-element view of a 200 MiB storage: a 4 byte hint (buffered)
    for a 200 MiB file."""
    s = Storage(d)
    s.makedirs(s.root)
    whole = big(300 * MiB, 4)
    a = write_torch(s, s.join("slice.pt"), {"w": whole[: 9 * MiB]})
    other = big(200 * MiB, 5)
    b = write_torch(s, s.join("tiny.pt"), {"w": other[:1]})
    return [a, b]


def test_write_torch_with_a_wrong_size_hint_commits_files_that_verify(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    coord = ckptd.CheckpointCoordinator(make_monitor(root), worker_id="w0")
    coord.save_async("hint_large", partial(torch_hint_too_large, coord.step_dir(1)), 1)
    coord.save_async("hint_small", partial(torch_hint_too_small, coord.step_dir(1)), 1)
    coord.register(1, checkpoint_thread_count=2)
    coord.wait_committed(1, timeout_s=120)
    assert wait_all(coord) is None
    ckptd.verify(root, 1)
    d = coord.step_dir(1)
    views = load_torch(open(os.path.join(d, "views.pt"), "rb").read(), "views.pt")
    assert torch.equal(views["v7"], big(40 * MiB, 3))
    sl = load_torch(open(os.path.join(d, "slice.pt"), "rb").read(), "slice.pt")
    assert torch.equal(sl["w"], big(300 * MiB, 4)[: 9 * MiB])
    assert os.path.getsize(os.path.join(d, "tiny.pt")) > 200 * MiB
    assert_trackers_verified(root)
    coord.close()


# -- 3. a failure inside an O_DIRECT write ------------------------------------------------------------

class Broken(Exception):
    pass


def fails_mid_direct_write(d: str, sent: threading.Event) -> list:
    """Streams 200 MiB with a 256 MiB hint (32 MiB buffers) through O_DIRECT, then raises: several
    buffers have been written (and given back by the abort)."""
    s = Storage(d)
    s.makedirs(s.root)
    chunk = big(40 * MiB, 9).numpy()

    def fill(w):
        assert isinstance(w, DirectWriter), "the large file did not take the O_DIRECT path"
        for _ in range(5):
            w.write(chunk)
        sent.set()
        raise Broken("the disk went away mid-file")

    return [write_stream(s, s.join("broken.bin"), fill, size=256 * MiB)]


def test_a_step_that_failed_in_an_o_direct_write_never_commits(make_monitor, tmp_path, run_name):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=30.0)
    # Step 3: a large staged unit that succeeds and a unit that fails inside its O_DIRECT write.
    t = big(256 * MiB + 4096, 1)
    staged_save(coord, "w", {"w": t}, 3)
    sent = threading.Event()
    coord.save_async("broken", partial(fails_mid_direct_write, coord.step_dir(3), sent), 3)
    coord.register(3, checkpoint_thread_count=2)
    err = wait_all(coord)
    assert sent.is_set() and err is not None and "mid-file" in err
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, timeout_s=60)
    assert not os.path.exists(os.path.join(coord.step_dir(3), "broken.bin"))
    # A retried registration, then a monitor SIGKILL: still failed, never committed.
    coord.register(3, checkpoint_thread_count=2, wait=False)
    restart_monitor(monitor, "SIGKILL")
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(3, timeout_s=60)
    assert read_manifest(root, 3, ckptd.Kind.CHECKPOINT) is None
    # The buffers the abort gave back (32 MiB ones) write the next step correctly.
    t2 = big(256 * MiB + 8192, 2)
    want = t2.clone()
    staged_save(coord, "w", {"w": t2}, 4)
    t2.zero_()
    coord.register(4, checkpoint_thread_count=1)
    coord.wait_committed(4, timeout_s=120)
    assert torch.equal(load_file(os.path.join(coord.step_dir(4), "w.safetensors"))["w"], want)
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 4
    coord.close()
    del t, t2, want

    # A new job, same run name: step 3 stays uncommitted (even if its unit is saved once more).
    new = start_new_job(make_monitor, root, monitor)
    c2 = ckptd.CheckpointCoordinator(new, worker_id="w0")
    c2.register(3, checkpoint_thread_count=2)
    staged_save(c2, "w", {"w": big(64 * MiB, 3)}, 3)
    assert wait_all(c2) is None
    assert_not_committed(c2, 3)
    assert read_manifest(root, 3, ckptd.Kind.CHECKPOINT) is None
    assert_trackers_verified(root)
    c2.close()
    # And a job of another run name.
    other = start_new_job(make_monitor, root, new, run=run_name + "x")
    c3 = ckptd.CheckpointCoordinator(other, worker_id="w0")
    c3.register(3, checkpoint_thread_count=2)
    c3.save_async("one", lambda: None, 3)
    assert wait_all(c3) is None
    assert_not_committed(c3, 3)
    assert read_manifest(root, 3, ckptd.Kind.CHECKPOINT) is None
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 4
    c3.close()


# -- 4. a failure from the fence ------------------------------------------------------------------

def gated_flat(gate: threading.Event, entered: threading.Event, storage, path: str, snapshot: dict) -> list:
    entered.set()
    assert gate.wait(60)
    return write_flat_into(storage, path, snapshot, {"format": "pt"})


def test_job_2_never_counts_a_unit_job_1_finished_for_a_step_whose_other_unit_was_fenced(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    old = ckptd.CheckpointCoordinator(monitor, worker_id="w0", notify_timeout_s=5.0)
    old.register(7, checkpoint_thread_count=2)
    staged_save(old, "a", {"w": big(40 * MiB, 1)}, 7)  # finishes: a receipt of attempt 1
    assert wait_all(old) is None
    gate, entered = threading.Event(), threading.Event()
    path = old._storage.join(old._template.name(7), "b.safetensors")
    old.save_state_async("b", {"w": big(40 * MiB, 2)}, 7, partial(gated_flat, gate, entered, old._storage, path),
                         fenced=True)
    old.before_update()
    assert entered.wait(60)
    new = start_new_job(make_monitor, root, monitor)
    gate.set()
    err = wait_all(old)
    assert err is not None and "superseded" in err, err
    assert not os.path.exists(path)
    c2 = ckptd.CheckpointCoordinator(new, worker_id="w0")
    # Job 2 asks for the same two units and saves only "b": job 1's "a" must not count.
    c2.register(7, checkpoint_thread_count=2)
    staged_save(c2, "b", {"w": big(40 * MiB, 3)}, 7)
    assert wait_all(c2) is None
    assert_not_committed(c2, 7)
    staged_save(c2, "a", {"w": big(40 * MiB, 4)}, 7)
    c2.wait_committed(7, timeout_s=60)
    d = c2.step_dir(7)
    assert torch.equal(load_file(f"{d}/a.safetensors")["w"], big(40 * MiB, 4))
    assert torch.equal(load_file(f"{d}/b.safetensors")["w"], big(40 * MiB, 3))
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 7
    c2.close()


# -- 5. Trinity's semantics -----------------------------------------------------------------------

def test_registrations_add_up_and_a_full_checkpoint_waits_for_the_state_dict_unit(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w0")
    # A checkpoint unit finishes before any registration.
    staged_save(coord, "opt", {"w": big(48 * MiB, 1)}, 2)
    assert wait_all(coord) is None
    # Two registrations of the checkpoint kind add up (2 units), plus one state-dict unit.
    coord.register(2, checkpoint_thread_count=1, state_dict_thread_count=1)
    coord.register(2, checkpoint_thread_count=1)
    staged_save(coord, "opt2", {"w": big(36 * MiB, 2)}, 2)
    assert wait_all(coord) is None
    assert_not_committed(coord, 2)  # still waits for the state-dict unit
    restart_monitor(monitor, "SIGKILL")  # the registrations survive, once each
    assert_not_committed(coord, 2)
    staged_save(coord, "model", {"w": big(130 * MiB, 3)}, 2, is_state_dict=True)
    coord.wait_committed(2, timeout_s=120)
    m = read_manifest(root, 2, ckptd.Kind.CHECKPOINT)
    names = {e.path for e in m.files}
    assert {"opt.safetensors", "opt2.safetensors", "model.safetensors"} <= names, names
    ckptd.verify(root, 2)
    # A third checkpoint unit of step 2 was never registered: the count was 2, not 3.
    trackers = assert_trackers_verified(root)
    assert trackers[ckptd.Kind.CHECKPOINT] == 2 and trackers[ckptd.Kind.STATE_DICT] == 2
    coord.close()


# -- 6. no false fencing --------------------------------------------------------------------------

def gated_process_write(gate: str, d: str, snapshot: dict) -> list:
    with open(f"{gate}.waiting", "w") as f:
        f.write(str(os.getpid()))
    wait_for(lambda: os.path.exists(gate), timeout_s=60, what="the gate")
    s = Storage(d)
    s.makedirs(s.root)
    return [write_torch(s, s.join("proc.pt"), snapshot)]


def test_the_current_job_is_never_fenced(make_monitor, tmp_path):
    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    a = ckptd.CheckpointCoordinator(monitor, worker_id="a")
    b = ckptd.CheckpointCoordinator(monitor, worker_id="b")
    p = ckptd.CheckpointCoordinator(monitor, worker_id="p", writer="process")
    # The writer process dies mid-save: that step fails; the restarted process is not fenced.
    gate = str(tmp_path / "gate")
    p.save_state_async("proc", {"t": torch.ones(4)}, 1, partial(gated_process_write, gate, p.step_dir(1)))
    kill_gated_writer(gate)
    assert "died" in (wait_all(p) or "")
    open(gate, "w").close()
    # Step 2: a large staged unit of a, save_sync of b inside a save_async of a, the writer
    # process writing a large staged state, and a monitor SIGKILL while a's unit is held.
    held, go = threading.Event(), threading.Event()

    def a_save():
        b.save_sync(lambda: [*write_flat_into(b._storage, b._storage.join(b._template.name(2), "b.safetensors"),
                                              {"w": big(40 * MiB, 2)}, {"format": "pt"})], 2)
        held.set()
        assert go.wait(60)
        return write_flat_into(a._storage, a._storage.join(a._template.name(2), "a.safetensors"),
                               {"w": big(64 * MiB, 1)}, {"format": "pt"})

    a.register(2, checkpoint_thread_count=4)
    a.save_async("a", a_save, 2)
    staged_save(a, "big", {"w": big(256 * MiB + 4096, 5)}, 2)
    staged_save(p, "pbig", {"w": big(40 * MiB, 6)}, 2)
    assert held.wait(60)
    restart_monitor(monitor, "SIGKILL")
    go.set()
    for c in (a, b, p):
        assert wait_all(c) is None
    a.wait_committed(2, timeout_s=120)
    names = {e.path for e in read_manifest(root, 2, ckptd.Kind.CHECKPOINT).files}
    assert {"a.safetensors", "b.safetensors", "big.safetensors", "pbig.safetensors"} <= names, names
    ckptd.verify(root, 2)
    assert torch.equal(load_file(os.path.join(a.step_dir(2), "big.safetensors"))["w"], big(256 * MiB + 4096, 5))
    assert assert_trackers_verified(root)[ckptd.Kind.CHECKPOINT] == 2
    for c in (a, b, p):
        c.close()
