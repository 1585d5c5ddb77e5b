"""Session 14c: invariants of the streamed fenced save (66c6030, c97b87d) under attack.

A fenced ``save_state_async`` with the default thread writer streams each 16 MiB chunk into
the file as soon as the staging thread has copied it. Attacked here, with a real local Ray, a
real monitor, real files and the real staging thread (faults through the ``staging_chunk``
failpoint, a step directory blocked by a file, and a real file-size limit for a write that fails
part-way):

1. the committed file holds the state bit for bit as it was at the call or at the fence, every
   dtype and shape, and the manifest's CRC-32 is the file's;
2. a copy or a write that fails part-way never commits, never leaves a partial file, and the
   next save of the name is correct;
3. buffers are never shared by two saves: interleaved fenced, eager and failing saves of one
   name never write a torn snapshot, and a save whose unit never runs hands its buffers back
   (it did not: a staged save refused because its step had already failed kept them, and the
   name's next save waited for ever; fixed in the coordinator, Job.finish);
4. before_update() returns once the copies end, while the streaming writer waits for a slot
   or the training thread for back-pressure;
5. close() and wait_all() with a streamed save in flight: no hang, the error surfaces;
6. a streamed save's ``staging`` phase is only the write's wait for the copy.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import threading
import time
import zlib

import pytest
import ray
import torch
from safetensors.torch import load_file

import ckptd
from ckptd import failpoints

from .helpers import wait_for

pytestmark = pytest.mark.usefixtures("ray_local")

CHUNK = 16 << 20  # the staging copy's and the streaming write's chunk
DEADLINE_S = 60.0  # far beyond what any of these waits needs; reaching it means a hang


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    failpoints.disarm()


SHARED_MONITOR_OPTIONS = {"max_ckpt_to_keep": None}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_file_holds(root: str, step: int, name: str, expected: dict[str, torch.Tensor]) -> None:
    """The committed file holds ``expected`` bit for bit, and its manifest entry is its bytes."""
    path = f"{root}/global_step_{step}/{name}.safetensors"
    loaded = load_file(path)
    assert list(loaded) == list(expected)
    for key, want in expected.items():
        got = loaded[key]
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), key
        assert torch.equal(_bits(got), _bits(want)), f"{key} differs from the state at the call"
    with open(f"{root}/global_step_{step}/ckptd_manifest.json") as f:
        entries = {e["path"]: e for e in json.load(f)["files"]}
    with open(path, "rb") as f:
        data = f.read()
    entry = entries[f"{name}.safetensors"]
    assert entry["size"] == len(data)
    assert entry["crc32"] == f"{zlib.crc32(data):08x}"
    ckptd.verify(root, step)


def _visible(step_dir: str) -> list[str]:
    return sorted(os.listdir(step_dir)) if os.path.isdir(step_dir) else []


def _largest(directory: str) -> int:
    """The size of the largest file in ``directory`` (0 if none), as a writer streams into it."""
    sizes = [0]
    for name in _visible(directory):
        try:
            sizes.append(os.path.getsize(f"{directory}/{name}"))
        except FileNotFoundError:  # a temporary file renamed meanwhile
            pass
    return max(sizes)


def _in_thread(fn, *args) -> tuple[threading.Thread, threading.Event, dict]:
    """Run ``fn`` on a thread; the event is set when it returns or raises."""
    done, out = threading.Event(), {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the test, which asserts on it
            out["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done, out


def _zoo() -> dict[str, torch.Tensor]:
    """Every dtype and shape the streamed path must keep bit for bit."""
    g = torch.Generator().manual_seed(14)
    big = torch.randn(2 * CHUNK // 4 + 3, generator=g)  # two chunks and an uneven tail
    exact = torch.randn(CHUNK // 4, generator=g)  # exactly one chunk
    grid = torch.randn(1100, 4000, generator=g)  # 17.6 MB
    return {
        "big": big,
        "exact_chunk": exact,
        "alias": exact,  # the same tensor object under a second key
        "tail_view": big[1:],  # a contiguous view at an offset of its storage, over two chunks
        "head_view": big[:1000],  # shares the storage of big
        "bf16": torch.randn(CHUNK // 2 + 1, generator=g).to(torch.bfloat16),  # one chunk and one element
        "i64": torch.randint(-(2**62), 2**62, (CHUNK // 8 + 5,), generator=g),
        "bool": torch.randint(0, 2, (CHUNK + 7,), dtype=torch.uint8, generator=g).bool(),
        "f8": torch.randint(0, 256, (CHUNK + 3,), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 3),
        "odd": torch.randn(3, 5, 7, generator=g),
        "transposed": grid.t(),  # not contiguous and over a chunk: copied whole
        "columns": grid[:, 1:3001],  # not contiguous
    }


def _train_step(state: dict[str, torch.Tensor]) -> None:
    """The optimizer step: every storage of the zoo changes in place."""
    with torch.no_grad():
        for key in ("big", "exact_chunk", "bf16", "odd", "scalar"):
            state[key].add_(1)
        state["i64"].add_(1)
        state["bool"].logical_not_()
        state["f8"].view(torch.uint8).add_(1)
        state["transposed"].mul_(-1)  # grid, through the view


# -- 1: bit for bit --------------------------------------------------------------------------


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced-streamed", "eager"])
def test_every_dtype_and_shape_is_saved_bit_for_bit_with_the_manifest_crc(env, fenced):
    root, s, coord = env.root, env.s, env.coord()
    state = _zoo()
    expected = {k: v.clone() for k, v in state.items()}
    # Slow chunks: the streamed write catches up with the copy and waits inside each large leaf.
    failpoints.arm("staging_chunk", "delay:0.02")
    coord.save_state_async("model", state, s + 1, fenced=fenced)
    if fenced:
        coord.before_update()
    _train_step(state)
    assert not torch.equal(_bits(state["f8"]), _bits(expected["f8"]))  # the step did change it
    coord.register(s + 1, checkpoint_thread_count=1)
    coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    _assert_file_holds(root, s + 1, "model", expected)
    coord.close()


# -- 2: failures part-way ----------------------------------------------------------------------


def test_a_copy_failing_at_its_third_chunk_never_commits_and_the_next_save_is_exact(env):
    root, s, coord = env.root, env.s, env.coord()
    state = {"w": torch.randn(3 * CHUNK // 4 + 1), "b": torch.arange(10)}  # three chunk boundaries
    step_dir = coord.step_dir(s + 1)
    failpoints.arm("staging_chunk", "delay:0.5")
    coord.register(s + 1, checkpoint_thread_count=1)
    coord.save_state_async("model", state, s + 1, fenced=True)
    # The first chunk has reached the (temporary) file: the copy sleeps after its second chunk.
    wait_for(lambda: _largest(step_dir) >= CHUNK, DEADLINE_S, "the first chunk to be streamed")
    assert "model.safetensors" not in _visible(step_dir)  # streamed into a temporary name only
    failpoints.arm("staging_chunk", "raise")  # the third chunk boundary fails the copy
    with pytest.raises(ckptd.CheckpointSaveError, match="staging the state failed: FailpointError"):
        coord.wait_all()
    coord.before_update()  # the failed copy has ended: nothing more to wait for
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    assert _visible(step_dir) == []  # neither the file nor its temporary stayed behind

    failpoints.disarm()
    _next_fenced_save_is_exact(coord, root, state, s + 2)


def test_an_eager_copy_failing_part_way_raises_at_the_call_and_a_retry_is_exact(env):
    root, s, coord = env.root, env.s, env.coord(max_staged=1)
    state = {"w": torch.randn(2 * CHUNK // 4 + 1), "b": torch.arange(10)}
    coord.register(s + 1, checkpoint_thread_count=1)
    failpoints.arm("staging_chunk", "raise")  # the copy on the training thread fails after chunk 1
    with pytest.raises(ckptd.CheckpointError, match="staging the state failed: FailpointError"):
        coord.save_state_async("model", state, s + 1)
    failpoints.disarm()
    assert _visible(coord.step_dir(s + 1)) == []  # nothing was queued, nothing written
    expected = {k: v.clone() for k, v in state.items()}
    # The same step again: its buffers (max_staged=1) came back when the copy failed.
    _, saved, out = _in_thread(coord.save_state_async, "model", state, s + 1)
    assert saved.wait(DEADLINE_S) and "error" not in out
    _train_step_plain(state)
    coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    _assert_file_holds(root, s + 1, "model", expected)
    coord.close()


def _train_step_plain(state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in state.values():
            t.add_(1)


def _next_fenced_save_is_exact(coord, root, state, step):
    """A fenced save of ``state`` at ``step`` after a failed one: it commits the state as it was
    at before_update(), whatever training does next; then the coordinator is closed."""
    expected = {k: v.clone() for k, v in state.items()}
    coord.save_state_async("model", state, step, fenced=True)
    coord.before_update()
    _train_step_plain(state)
    coord.register(step, checkpoint_thread_count=1)
    coord.wait_committed(step, timeout_s=DEADLINE_S)
    _assert_file_holds(root, step, "model", expected)
    coord.close()


@pytest.fixture
def file_size_limit():
    """Set RLIMIT_FSIZE for this process (a write past it fails with EFBIG, as on a full disk),
    with SIGXFSZ ignored so the write raises instead of the process dying; restored after."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(nbytes: int | None) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit if nbytes is None else (nbytes, old_limit[1]))

    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_write_failing_part_way_never_commits_and_the_next_save_is_exact(env, file_size_limit):
    root, s, coord = env.root, env.s, env.coord()
    state = {"w": torch.randn(2 * CHUNK // 4 + 1), "b": torch.arange(10)}
    step_dir = coord.step_dir(s + 1)
    coord.register(s + 1, checkpoint_thread_count=1)
    failpoints.arm("staging_chunk", "delay:0.05")  # the write streams behind the copy
    file_size_limit(CHUNK + CHUNK // 2)  # the file system is full in the middle of chunk 2
    try:
        coord.save_state_async("model", state, s + 1, fenced=True)
        with pytest.raises(ckptd.CheckpointSaveError, match="File too large"):
            coord.wait_all()
    finally:
        file_size_limit(None)
    coord.before_update()
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    assert _visible(step_dir) == []

    _next_fenced_save_is_exact(coord, root, state, s + 2)


# -- 3: buffers never shared -------------------------------------------------------------------


def _filled(step: int, strided: bool = False) -> dict[str, torch.Tensor]:
    """A fresh state whose every element is ``step``: a torn snapshot shows two values.
    ``strided``: ``w`` is a view with a stride of 2, which a copy takes whole (no chunks)."""
    n = 2 * CHUNK // 4 - 1
    w = torch.full((2 * n,), float(step))[::2] if strided else torch.full((n,), float(step))
    return {"w": w, "n": torch.full((1000,), step, dtype=torch.int64)}


@pytest.mark.parametrize("max_staged", [1, 2])
def test_interleaved_fenced_eager_and_failing_saves_of_one_name_never_tear(env, max_staged):
    root, s, coord = env.root, env.s, env.coord(max_staged=max_staged)
    # step: (fenced, its step directory is blocked by a file, before_update after it)
    plan = {1: (True, False, False), 2: (False, False, False), 3: (True, True, False), 4: (False, False, False),
            5: (True, False, False), 6: (True, True, True), 7: (False, True, False), 8: (True, False, True)}
    plan = {s + k: how for k, how in plan.items()}
    os.makedirs(root, exist_ok=True)
    for step, (_, blocked, _) in plan.items():
        if blocked:
            with open(coord.step_dir(step), "w") as f:
                f.write("in the way")  # the write fails at once while a fenced copy still runs
    for step, (fenced, blocked, fence) in plan.items():
        # A fenced copy sleeps after its first chunk, then copies most of a second one; the copy
        # of a save whose write fails at once sleeps long: a failing write that handed the
        # buffers back early would let the next save's copy in before that second chunk.
        failpoints.arm("staging_chunk", "delay:1.0" if blocked and fenced else "delay:0.05")
        coord.register(step, checkpoint_thread_count=1)
        # An eager save copies a strided state in one go, no chunk sleeps: were the buffers
        # handed back while a failed save's fenced copy still ran, that copy's rest would land
        # on top of this snapshot.
        coord.save_state_async("model", _filled(step, strided=not fenced), step, fenced=fenced)
        if fence:
            coord.before_update()
    with pytest.raises(ckptd.CheckpointSaveError, match=r"and 2 more failed saves|and 1 more failed save"):
        coord.wait_all()
    coord.before_update()
    for step, (_, blocked, _) in plan.items():
        if blocked:
            with pytest.raises(ckptd.CheckpointSaveError):
                coord.wait_committed(step, timeout_s=DEADLINE_S)
        else:
            coord.wait_committed(step, timeout_s=DEADLINE_S)
            _assert_file_holds(root, step, "model", _filled(step))
    coord.close()


def test_a_staged_save_whose_unit_is_refused_hands_its_buffers_back(env):
    """A unit of a step that already failed is refused before its save_fn runs. The snapshot's
    buffers must still go back to the name, or its next save waits for them forever."""
    root, s, coord = env.root, env.s, env.coord(max_staged=1)
    coord.register(s + 1, checkpoint_thread_count=2)

    def fail() -> None:
        raise RuntimeError("optimizer shard lost (injected)")

    coord.save_async("optim", fail, s + 1)
    with pytest.raises(ckptd.CheckpointSaveError, match="injected"):
        coord.wait_all()
    coord.save_state_async("model", _filled(1), s + 1, fenced=True)  # step 1 failed: refused
    with pytest.raises(ckptd.CheckpointSaveError, match="not saved"):
        coord.wait_all()
    coord.before_update()
    _, done, out = _in_thread(coord.save_state_async, "model", _filled(2), s + 2)
    assert done.wait(DEADLINE_S), "the next save of the name waits for buffers nobody will hand back"
    assert "error" not in out
    coord.register(s + 2, checkpoint_thread_count=1)
    coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
    _assert_file_holds(root, s + 2, "model", _filled(2))
    assert coord.staged_bytes() == sum(t.numel() * t.element_size() for t in _filled(0).values())
    coord.close()


# -- 4: before_update never deadlocks with the streaming writer -------------------------------


def test_before_update_returns_while_the_streaming_writer_waits_for_the_only_slot(make_monitor, tmp_path):
    root, s = str(tmp_path / "ckpt"), 0  # a monitor of its own: the run's only writer slot is held
    coord = ckptd.CheckpointCoordinator(make_monitor(root, save_strategy="single_thread"), worker_id="w0")
    holding, gate = threading.Event(), threading.Event()

    def hold_the_slot() -> list:
        holding.set()
        gate.wait(DEADLINE_S)
        return []

    coord.register(s + 1, checkpoint_thread_count=2)
    coord.save_async("train_state", hold_the_slot, s + 1)
    assert holding.wait(DEADLINE_S)  # it runs: it holds the run's only writer slot
    state = {"w": torch.randn(2 * CHUNK // 4 + 1)}
    expected = {k: v.clone() for k, v in state.items()}
    failpoints.arm("staging_chunk", "delay:0.1")
    coord.save_state_async("model", state, s + 1, fenced=True)
    _, fenced, out = _in_thread(coord.before_update)
    assert fenced.wait(DEADLINE_S), "before_update waits for a writer that waits for a slot"
    assert "error" not in out
    assert not os.path.exists(f"{coord.step_dir(s + 1)}/model.safetensors")  # the writer is still held
    _train_step_plain(state)
    gate.set()
    coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    _assert_file_holds(root, s + 1, "model", expected)
    coord.close()


def test_before_update_returns_while_the_next_save_waits_on_back_pressure(env):
    root, s, coord = env.root, env.s, env.coord(max_staged=1)
    first, second = {"w": torch.randn(2 * CHUNK // 4 + 1)}, {"w": torch.randn(2 * CHUNK // 4 + 1)}
    want1, want2 = first["w"].clone(), second["w"].clone()
    failpoints.arm("staging_chunk", "delay:0.2")
    coord.save_state_async("model", first, s + 1, fenced=True)
    # Another thread saves the next step: it waits until step 1's buffers come back.
    _, saved2, out = _in_thread(coord.save_state_async, "model", second, s + 2, None)
    _, fenced, fence_out = _in_thread(coord.before_update)
    assert fenced.wait(DEADLINE_S) and "error" not in fence_out
    _train_step_plain(first)  # the fence returned: step 1's copy is over
    assert saved2.wait(DEADLINE_S) and "error" not in out
    coord.before_update()
    _train_step_plain(second)
    for step in (s + 1, s + 2):
        coord.register(step, checkpoint_thread_count=1)
        coord.wait_committed(step, timeout_s=DEADLINE_S)
    _assert_file_holds(root, s + 1, "model", {"w": want1})
    _assert_file_holds(root, s + 2, "model", {"w": want2})
    coord.close()


# -- 5: close() and wait_all() with a streamed save in flight ---------------------------------


def test_close_with_a_streamed_save_in_flight_finishes_it_and_returns(env):
    root, s, coord = env.root, env.s, env.coord()
    state = {"w": torch.randn(2 * CHUNK // 4 + 1)}
    expected = {k: v.clone() for k, v in state.items()}
    coord.register(s + 1, checkpoint_thread_count=1)
    failpoints.arm("staging_chunk", "delay:0.2")
    coord.save_state_async("model", state, s + 1, fenced=True)
    _, closed, out = _in_thread(coord.close)  # no before_update: close waits for the write
    assert closed.wait(DEADLINE_S), "close() hangs with a streamed save in flight"
    assert "error" not in out
    _train_step_plain(state)  # the write, and so the copy behind it, are over
    assert ray.get(env.monitor.wait_committed.remote(s + 1, "checkpoint", DEADLINE_S))["committed"]
    _assert_file_holds(root, s + 1, "model", expected)
    with pytest.raises(ckptd.CheckpointError, match="closed"):
        coord.save_state_async("model", state, s + 2, fenced=True)


def test_close_raises_the_failure_of_a_streamed_save_in_flight(env):
    s, coord = env.s, env.coord(max_staged=1)
    coord.register(s + 1, checkpoint_thread_count=1)
    failpoints.arm("staging_chunk", "raise")
    coord.save_state_async("model", {"w": torch.randn(2 * CHUNK // 4 + 1)}, s + 1, fenced=True)
    _, closed, out = _in_thread(coord.close)
    assert closed.wait(DEADLINE_S), "close() hangs on a failed streamed save"
    assert isinstance(out.get("error"), ckptd.CheckpointSaveError)
    assert "staging the state failed: FailpointError" in str(out["error"])
    assert _visible(coord.step_dir(s + 1)) == []
    with pytest.raises(ckptd.CheckpointSaveError):
        coord.wait_committed(s + 1, timeout_s=DEADLINE_S)


def test_wait_all_after_a_failed_streamed_write_leaves_the_buffers_free(env):
    root, s, coord = env.root, env.s, env.coord(max_staged=1)
    os.makedirs(root, exist_ok=True)
    with open(coord.step_dir(s + 1), "w") as f:
        f.write("in the way")
    failpoints.arm("staging_chunk", "delay:1.0")  # the copy sleeps well past the write's failure
    coord.save_state_async("model", _filled(1), s + 1, fenced=True)
    _, waited, out = _in_thread(coord.wait_all)
    assert waited.wait(DEADLINE_S), "wait_all() hangs on a failed streamed write"
    assert isinstance(out.get("error"), ckptd.CheckpointSaveError)
    assert f"step {s + 1} failed" in str(out["error"])
    failpoints.disarm()
    # The failed save's copy may still run. The next save of the name gets the buffers once it
    # has ended, never before, and never waits for ever. Its write is held (its lane is busy)
    # until that copy is over, so a snapshot shared with the copy would be written torn.
    gate = threading.Event()
    coord.register(s + 2, checkpoint_thread_count=2)
    coord.save_async("model", lambda: gate.wait(DEADLINE_S) and [], s + 2)
    _, saved, out2 = _in_thread(coord.save_state_async, "model", _filled(2, strided=True), s + 2)
    assert saved.wait(DEADLINE_S) and "error" not in out2
    coord.before_update()  # the failed save's copy has ended
    gate.set()
    coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
    _assert_file_holds(root, s + 2, "model", _filled(2))
    coord.close()


# -- 6: phase timings ------------------------------------------------------------------------


def _staged_span(monitor, step: int) -> dict:
    """The span of the step's staged unit (the only one with a staging phase)."""
    def span():
        spans = ray.get(monitor.timeline.remote())["spans"]
        found = [s for s in spans if s["lane"] == "unit" and s["step"] == step and "staging" in s.get("phases", {})]
        return found[0] if found else None

    return wait_for(span, DEADLINE_S, f"the staged unit's span of step {step}")


def test_a_streamed_saves_staging_phase_is_only_its_wait_for_the_copy(env):
    s, coord = env.s, env.coord()
    delay = 0.3
    # Eight chunks, each followed by a sleep on whichever thread copied it: the staging thread
    # copies from the front and the fence from the back, four each, so a copy of >= 1.2 s.
    failpoints.arm("staging_chunk", f"delay:{delay}")
    state = {"w": torch.randn(8 * CHUNK // 4)}

    # Step 1: the write starts only after the copy has ended (its lane is busy until then).
    gate = threading.Event()
    coord.register(s + 1, checkpoint_thread_count=2)
    coord.save_async("model", lambda: gate.wait(DEADLINE_S) and [], s + 1)
    t0 = time.perf_counter()
    coord.save_state_async("model", state, s + 1, fenced=True)
    coord.before_update()
    copy_s = time.perf_counter() - t0
    assert copy_s >= 3 * delay
    gate.set()
    coord.wait_committed(s + 1, timeout_s=DEADLINE_S)
    late = _staged_span(env.monitor, s + 1)

    # Step 2: the write streams behind the copy and waits for each chunk.
    coord.register(s + 2, checkpoint_thread_count=1)
    coord.save_state_async("model", state, s + 2, fenced=True)
    coord.before_update()
    coord.wait_committed(s + 2, timeout_s=DEADLINE_S)
    behind = _staged_span(env.monitor, s + 2)

    for span in (late, behind):
        assert {"staging", "write", "fsync", "receipt"} <= set(span["phases"]), span["phases"]
        assert sum(span["phases"].values()) <= span["end"] - span["start"] + 0.05  # exclusive phases
    # Nothing left to wait for: the copy's own second(s) are not counted as staging.
    assert late["phases"]["staging"] < copy_s / 3, late["phases"]
    # It waited behind at least two of the three sleeps, and that wait is not also write time.
    assert behind["phases"]["staging"] >= 2 * delay, behind["phases"]
    assert behind["phases"]["write"] < behind["end"] - behind["start"] - 2 * delay
    coord.close()
