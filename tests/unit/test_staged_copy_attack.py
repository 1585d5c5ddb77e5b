"""An attack on the chunked staging copy shared between the staging thread and the fence.

The invariant under attack: once ``fence()`` returns, every staged buffer holds the sources as
they were (or the copy failed and ``Snapshot.wait()`` raises); a streamed write never reads a
chunk before it is copied; ``release()``/``join()`` never return while a thread still copies.

Real threads, real buffers, real files, no Ray. Most tests shrink the copy's chunk
(``staged_copy._CHUNK``) and the writer's window (``safetensors_io._STREAM_CHUNK``) to odd,
mismatched sizes, so that small states give hundreds of chunks and many interleavings.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from ckptd import failpoints
from ckptd.coordinator import staged_copy
from ckptd.coordinator.staged_copy import StagedCopy
from ckptd.coordinator.staging import BufferSet, StagingArea, tensors_of
from ckptd.errors import CheckpointError, FailpointError
from ckptd.storage import Storage
from ckptd.workers import safetensors_io
from ckptd.workers.safetensors_io import write_safetensors

REAL_CHUNK = 16 << 20


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    failpoints.disarm()


@pytest.fixture
def small_chunks(monkeypatch):
    """A 12 KiB copy chunk and a 20 KiB write window: neither divides the other."""
    monkeypatch.setattr(staged_copy, "_CHUNK", 12 << 10)
    monkeypatch.setattr(safetensors_io, "_STREAM_CHUNK", 20 << 10)
    return 12 << 10


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _odd_state(chunk: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Leaves just below, at and above multiples of ``chunk`` bytes, in several dtypes, plus
    empty, scalar, non-contiguous and offset leaves."""
    g = torch.Generator().manual_seed(seed)
    f32 = chunk // 4
    base = torch.randn(3 * f32 + 11, generator=g)
    return {
        "below": torch.randn(f32 - 1, generator=g),
        "one_chunk": torch.randn(f32, generator=g),  # exactly one chunk: copied whole
        "above": torch.randn(f32 + 1, generator=g),  # a 4-byte last chunk
        "three_and_a_bit": torch.randn(3 * f32 + 3, generator=g),
        "exact_multiple": torch.randn(2 * f32, generator=g),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 7, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "bf16": torch.randn(chunk // 2 + 1, generator=g).to(torch.bfloat16),
        "int8_one_chunk": torch.randint(-128, 127, (chunk,), dtype=torch.int8, generator=g),
        "int8_two_chunks": torch.randint(-128, 127, (2 * chunk,), dtype=torch.int8, generator=g),
        "bool": torch.rand(chunk + 7, generator=g) > 0.5,
        "transposed": torch.randn(37, (3 * f32) // 37, generator=g).t(),  # not contiguous: whole
        "strided": base[::2],  # not contiguous
        "offset_view": base[5:],  # contiguous with a storage offset: chunked
        "int64": torch.arange(chunk // 8 * 2 + 1, dtype=torch.int64),
        "f64": torch.randn(chunk // 8 + 1, generator=g, dtype=torch.float64),
    }


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def _clone_bits(state) -> dict[str, torch.Tensor]:
    return {k: _bits(v).clone() for k, v in state.items()}


def _mutate(state) -> None:
    """What an optimizer step does: change every source in place."""
    with torch.no_grad():
        for t in state.values():
            if t.numel() == 0:
                continue
            if t.dtype == torch.bool:
                t.logical_not_()
            elif t.dtype in (torch.int8, torch.int64):
                t.add_(1)
            else:
                t.mul_(-2).add_(1)


def _assert_staged(snap_state, expected_bits) -> None:
    for k, want in expected_bits.items():
        got = _bits(snap_state[k])
        assert torch.equal(got, want), f"{k}: the staged buffer differs from the source at the save"


def _stream(tmp_path, name, snap, expected_bits, told):
    """Write ``snap`` streamed behind its copy; every wait_staged return is checked against the
    source bytes as they were at the save."""
    keys = {id(t): k for k, t in snap.state.items()}

    def ready(t, n):
        snap.wait_staged(t, n)
        key = keys[id(t)]
        told.append((key, n, bool(torch.equal(_bits(t)[:n], expected_bits[key][:n]))))

    storage = Storage(str(tmp_path))
    storage.makedirs(storage.join("out"))
    path = storage.join("out", f"{name}.safetensors")
    try:
        write_safetensors(storage, path, snap.state, {"format": "pt"}, ready)
        snap.wait()
    finally:
        snap.release()
    return path


# --- many leaves, several names, one fence, sources changed right after ---------------------


def test_several_names_queued_then_one_fence_stage_every_odd_leaf_exactly_before_the_step(small_chunks):
    area = StagingArea(1, "attack-stage")
    states = {f"n{i}": _odd_state(small_chunks, seed=i) for i in range(4)}
    failpoints.arm("staging_chunk", "delay:0.0005")  # every chunk yields: the two sides interleave
    snaps, expected = {}, {}
    for name, state in states.items():
        expected[name] = _clone_bits(state)
        snaps[name] = area.snapshot(name, state, tensors_of(state), fenced=True)
    assert area.fence() is True
    # The fence returned: nothing copies any more, and the step may change the sources at once.
    assert all(s._copy._ended and s._copy._busy == 0 for s in snaps.values())
    for state in states.values():
        _mutate(state)
    failpoints.disarm()
    helped = 0
    for name, snap in snaps.items():
        snap.wait()
        _assert_staged(snap.state, expected[name])
        helped += snap.helped_bytes
        snap.release()
    assert helped > 0  # the fence did copy, not only wait
    assert area.fence() is False  # nothing since the last fence


def test_real_chunk_boundaries_in_small_dtypes_are_exact_with_the_fence_copying(tmp_path):
    """The real 16 MiB chunk, with int8/bool/bf16 leaves at, just below and just above it."""
    state = {
        "int8_at": torch.randint(-128, 127, (REAL_CHUNK,), dtype=torch.int8),  # one chunk, whole
        "bool_above": torch.rand(REAL_CHUNK + 1) > 0.5,  # one chunk and one byte
        "bf16_below": torch.randn(REAL_CHUNK // 2 - 1).to(torch.bfloat16),
        "int8_twice": torch.randint(-128, 127, (2 * REAL_CHUNK,), dtype=torch.int8),
        "empty": torch.empty(0, dtype=torch.int8),
    }
    expected = _clone_bits(state)
    area = StagingArea(1, "attack-stage")
    failpoints.arm("staging_chunk", "delay:0.01")
    snap = area.snapshot("m", state, tensors_of(state), fenced=True)
    told: list = []
    writer = threading.Thread(target=lambda: told.append(_stream(tmp_path, "m", snap, expected, told)))
    writer.start()
    area.fence()
    _mutate(state)
    writer.join(30)
    assert not writer.is_alive()
    path = told.pop()
    assert told and all(ok for _, _, ok in told), [t for t in told if not t[2]]
    loaded = load_file(path)
    for k, want in expected.items():
        assert torch.equal(_bits(loaded[k]), want), k


# --- fences racing each other and the staging thread ------------------------------------------


def test_fences_from_two_threads_at_once_both_return_after_every_copy(small_chunks):
    area = StagingArea(1, "attack-stage")
    for rnd in range(5):
        states = {f"n{i}": _odd_state(small_chunks, seed=10 * rnd + i) for i in range(3)}
        expected = {k: _clone_bits(s) for k, s in states.items()}
        failpoints.arm("staging_chunk", "delay:0.0003")
        snaps = {k: area.snapshot(k, s, tensors_of(s), fenced=True) for k, s in states.items()}
        ended_at_return: list[bool] = []
        start = threading.Barrier(2)

        def fence(start=start, snaps=snaps, ended_at_return=ended_at_return):
            start.wait()
            area.fence()
            # Returned: every copy ended, and no thread (the other fence included) copies a chunk.
            ended_at_return.append(all(s._copy._ended and s._copy._busy == 0 for s in snaps.values()))

        fencers = [threading.Thread(target=fence) for _ in range(2)]
        for t in fencers:
            t.start()
        for t in fencers:
            t.join(30)
        assert ended_at_return == [True, True]
        for s in states.values():
            _mutate(s)
        failpoints.disarm()
        for k, snap in snaps.items():
            snap.wait()
            _assert_staged(snap.state, expected[k])
            snap.release()


def test_a_fence_before_the_staging_thread_reaches_a_job_copies_all_of_it_on_the_caller(small_chunks):
    area = StagingArea(1, "attack-stage")
    slow = {"big": torch.randn(40 * (small_chunks // 4))}  # 40 chunks at 20 ms: the thread is busy
    fast = _odd_state(small_chunks, seed=3)
    expected = _clone_bits(fast)
    failpoints.arm("staging_chunk", "delay:0.02")
    first = area.snapshot("slow", slow, tensors_of(slow), fenced=True)
    second = area.snapshot("fast", fast, tensors_of(fast), fenced=True)
    area.fence()  # helps "fast" first (the last submitted), which the thread has not reached
    _mutate(fast)
    assert second.helped_bytes == _nbytes(fast)
    second.wait()
    _assert_staged(second.state, expected)
    first.wait()
    second.release()
    first.release()


def test_help_before_run_ever_starts_copies_everything_and_run_then_ends_at_once(small_chunks):
    state = _odd_state(small_chunks, seed=4)
    expected = _clone_bits(state)
    leaves = tensors_of(state)
    buf = BufferSet(leaves)
    copy = StagedCopy(leaves, buf)
    assert copy.help() == _nbytes(state)
    _mutate(state)  # run() must not copy anything any more
    copy.run()
    copy.wait()
    _assert_staged(dict(zip(state, buf.tensors, strict=True)), expected)
    assert copy.helped_bytes == _nbytes(state)


# --- streamed writes racing the fence, buffers reused while the trainer changes the sources ---


def test_streamed_writes_racing_the_fence_never_read_an_unstaged_chunk_over_reused_buffers(tmp_path, small_chunks):
    area = StagingArea(1, "attack-stage")
    states = {f"n{i}": _odd_state(small_chunks, seed=20 + i) for i in range(2)}
    uids: dict[str, set[int]] = {k: set() for k in states}
    for step in range(4):
        failpoints.arm("staging_chunk", "delay:0.0005")
        told: list = []
        writers, paths, expected = [], {}, {}
        for name, state in states.items():
            expected[name] = _clone_bits(state)
            snap = area.snapshot(name, state, tensors_of(state), fenced=True)  # waits for the last write
            uids[name].add(snap.buffers.uid)

            def write(name=name, snap=snap, step=step, paths=paths, expected=expected, told=told):
                paths[name] = _stream(tmp_path / f"s{step}", name, snap, expected[name], told)

            writers.append(threading.Thread(target=write))
            writers[-1].start()
        area.fence()
        for state in states.values():
            _mutate(state)  # the optimizer step, right after the fence, while the writes go on
        failpoints.disarm()
        for w in writers:
            w.join(30)
            assert not w.is_alive()
        assert told and all(ok for _, _, ok in told), [t for t in told if not t[2]]
        for name, path in paths.items():
            loaded = load_file(path)
            for k, want in expected[name].items():
                assert torch.equal(_bits(loaded[k]), want), (step, name, k)
    assert all(len(u) == 1 for u in uids.values())  # max_staged=1: the same buffers every step


def test_release_while_both_sides_copy_returns_only_once_nobody_writes_the_buffers(small_chunks):
    for rnd in range(3):
        state = _odd_state(small_chunks, seed=30 + rnd)
        expected = _clone_bits(state)
        area = StagingArea(1, "attack-stage")
        failpoints.arm("staging_chunk", "delay:0.002")
        snap = area.snapshot("m", state, tensors_of(state), fenced=True)
        fencer = threading.Thread(target=area.fence)
        fencer.start()
        while snap.helped_bytes == 0 and snap._copy._back == len(snap._copy._done):
            time.sleep(0.001)  # the fence has claimed a chunk
        snap.release()  # a streamed write that failed early: its buffers go back now
        # release() returned: no thread may write into these buffers any more.
        assert snap._copy._busy == 0
        _mutate(state)
        after_release = _clone_bits(snap.state)
        _assert_staged(snap.state, expected)  # (the copy itself did not fail)
        time.sleep(0.05)
        _assert_staged(snap.state, after_release)
        fencer.join(30)
        assert not fencer.is_alive()
        failpoints.disarm()


# --- errors on either side ---------------------------------------------------------------


def test_a_failing_chunk_fails_only_chunked_saves_and_the_next_saves_reuse_the_buffers_exactly(small_chunks):
    area = StagingArea(1, "attack-stage")
    chunked = {f"n{i}": _odd_state(small_chunks, seed=40 + i) for i in range(3)}
    whole = {"w": torch.randn(100), "t": torch.randn(30, 40).t(), "e": torch.empty(0)}  # never chunked
    all_states = chunked | {"whole": whole}
    failpoints.arm("staging_chunk", "raise")  # on whichever thread copies a chunk
    snaps = {k: area.snapshot(k, s, tensors_of(s), fenced=True) for k, s in all_states.items()}
    expected_whole = _clone_bits(whole)
    assert area.fence() is True  # the fence itself does not fail
    failpoints.disarm()
    for k in chunked:
        with pytest.raises(CheckpointError, match="FailpointError"):
            snaps[k].wait()
        with pytest.raises(CheckpointError):
            snaps[k].wait_staged(snaps[k].state["empty"], 0)
    snaps["whole"].wait()
    _assert_staged(snaps["whole"].state, expected_whole)
    bufs = {k: s.buffers.uid for k, s in snaps.items()}
    for s in snaps.values():
        s.release()
    # The next saves get the same buffers and, once fenced, hold exactly the new sources.
    expected = {k: _clone_bits(s) for k, s in all_states.items()}
    again = {k: area.snapshot(k, s, tensors_of(s), fenced=True) for k, s in all_states.items()}
    assert {k: s.buffers.uid for k, s in again.items()} == bufs
    area.fence()
    for s in all_states.values():
        _mutate(s)
    for k, s in again.items():
        s.wait()
        _assert_staged(s.state, expected[k])
        s.release()


def _assert_the_next_save_stages_exactly(area: StagingArea, state: dict) -> None:
    """After an interrupted save: the next fenced save of the name stages the sources exactly."""
    expected = _clone_bits(state)
    again = area.snapshot("m", state, tensors_of(state), fenced=True)
    area.fence()
    _mutate(state)
    again.wait()
    _assert_staged(again.state, expected)
    again.release()


def test_a_keyboard_interrupt_while_the_fence_copies_is_raised_and_fails_only_that_save(small_chunks, monkeypatch):
    """Ctrl-C while the training thread copies a chunk at the fence: raised there, and only that
    save fails. The interrupt is raised from the chunk's hook on the fence's thread (not by a
    signal: pytest-xdist's workers ignore SIGINT, and a timer would race the copy)."""
    area = StagingArea(1, "attack-stage")
    state = {"big": torch.randn(30 * (small_chunks // 4))}
    fence_thread = threading.current_thread()
    interrupt = [True]

    def hit(name):
        if threading.current_thread() is fence_thread and interrupt[0]:
            interrupt[0] = False
            raise KeyboardInterrupt
        time.sleep(0.05)  # the staging thread is slow: the fence claims chunks from the back

    monkeypatch.setattr(staged_copy.failpoints, "hit", hit)
    snap = area.snapshot("m", state, tensors_of(state), fenced=True)
    with pytest.raises(KeyboardInterrupt):
        area.fence()
    assert isinstance(snap._copy.error, KeyboardInterrupt)
    with pytest.raises(CheckpointError, match="KeyboardInterrupt"):
        snap.wait()
    monkeypatch.setattr(staged_copy.failpoints, "hit", lambda name: None)
    done = threading.Event()
    threading.Thread(target=lambda: (area.fence(), snap.release(), done.set()), daemon=True).start()
    assert done.wait(10), "the staging thread or the buffers stayed held after the interrupt"
    _assert_the_next_save_stages_exactly(area, state)


class _PreemptedHelper(StagedCopy):
    """The helper thread loses the CPU right after its chunk failed (the sleep stands for the
    scheduler). Before the fix, the chunk was given back (busy -= 1) before its error was
    recorded, and run() could end the copy as a success in between."""

    helper: threading.Thread | None = None

    def _fail(self, e):
        if threading.current_thread() is self.helper:
            time.sleep(0.3)
        super()._fail(e)


def _start_a_helper_whose_chunk_fails(monkeypatch, copy: StagedCopy, helper: threading.Thread,
                                      settle_s: float) -> None:
    """Start ``helper`` (running ``copy.help``) and return once it holds a chunk; that chunk fails
    ``settle_s`` after every chunk has been claimed (by run(), which then waits for it)."""

    def hit(name):
        if threading.current_thread() is helper:
            while copy._front < copy._back:
                time.sleep(0.0005)
            time.sleep(settle_s)
            raise FailpointError("the helper's chunk failed")

    monkeypatch.setattr(staged_copy.failpoints, "hit", hit)
    helper.start()
    while copy._busy == 0:
        time.sleep(0.0002)


def test_a_chunk_failing_on_the_helper_while_run_waits_for_it_never_reads_as_success(monkeypatch):
    """The staging thread has claimed every chunk and waits for the helper's; the helper's chunk
    fails. The save must see the failure, whenever the helper gets the CPU back."""
    leaves = [torch.randn((2 * REAL_CHUNK) // 4)]  # two chunks: run() takes the first, help() the second
    buf = BufferSet(leaves)
    copy = _PreemptedHelper(leaves, buf)
    helper = threading.Thread(target=copy.help)
    copy.helper = helper

    _start_a_helper_whose_chunk_fails(monkeypatch, copy, helper, settle_s=0.1)
    runner = threading.Thread(target=copy.run)
    runner.start()
    outcome: dict[str, object] = {}

    def save():  # what the save unit does: wait for the copy, then commit
        try:
            copy.wait()
            outcome["committed"] = (copy._prefix, len(copy._done))
        except CheckpointError as e:
            outcome["failed"] = e

    saver = threading.Thread(target=save)
    saver.start()
    for t in (saver, helper, runner):
        t.join(10)
    assert copy.error is not None  # the copy did fail...
    assert "failed" in outcome, f"...but the save read it as a success: chunks done/total {outcome}"


def test_the_helper_failure_race_also_happens_without_instrumenting_the_copy(monkeypatch):
    """The same race as above, only through the scheduler (a tiny switch interval; before the
    fix, about 1 run in 300 read as a success on the 2-core VM). Asserts what must hold every
    time: a failed helper chunk fails the copy."""
    monkeypatch.setattr(staged_copy, "_CHUNK", 32 << 10)
    leaves = [torch.randn((64 << 10) // 4)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(30):
            copy = StagedCopy(leaves, BufferSet(leaves))
            helper = threading.Thread(target=copy.help)

            _start_a_helper_whose_chunk_fails(monkeypatch, copy, helper, settle_s=0.002)
            copy.run()
            helper.join(10)
            with pytest.raises(CheckpointError):
                copy.wait()
    finally:
        sys.setswitchinterval(old)


def test_a_keyboard_interrupt_while_the_fence_waits_fails_the_copies_it_did_not_wait_for(small_chunks, monkeypatch):
    """Ctrl-C after the fence has claimed every chunk it can, while it waits for the staging
    thread's chunk in progress: the fence is left before the copy ended, so a loop that catches
    the interrupt and steps the optimizer could change a chunk as it is copied. The save must
    fail rather than commit what it cannot vouch for. The interrupt is a real SIGINT to this
    thread, sent by the staging thread from inside its chunk (handled while it lasts: xdist's
    workers ignore SIGINT)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    area = StagingArea(1, "attack-stage-sigint")
    state = {"big": torch.randn(30 * (small_chunks // 4))}
    main = threading.main_thread().ident
    inside, sent = threading.Event(), threading.Event()

    def hit(name):
        if threading.current_thread().name != "attack-stage-sigint" or sent.is_set():
            return  # the fence's thread, or another test's staging thread still running
        inside.set()
        job = snap._copy
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the fence has claimed the rest: it can only wait now
            with job._cond:
                if job._front >= job._back and job._busy == 1:
                    break
            time.sleep(0.001)
        sent.set()
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.2)  # the chunk is still being copied while the fence is left

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(staged_copy.failpoints, "hit", hit)
        snap = area.snapshot("m", state, tensors_of(state), fenced=True)
        assert inside.wait(10), "the staging thread never copied a chunk"
        with pytest.raises(KeyboardInterrupt):
            area.fence()
            time.sleep(5)  # a signal that arrived just after the fence returned lands here
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sent.is_set()
    with pytest.raises(CheckpointError, match="KeyboardInterrupt"):
        snap.wait()
    monkeypatch.setattr(staged_copy.failpoints, "hit", lambda name: None)
    area.fence()
    snap.release()
    _assert_the_next_save_stages_exactly(area, state)
