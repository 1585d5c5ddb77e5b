"""Session 14c: the chunked staging copy and the write that streams behind it, without Ray.

The real staging thread, real buffers and real files; the copy is slowed through the
``staging_chunk`` failpoint so that the write catches up with it and must wait.
"""

from __future__ import annotations

import threading
import zlib

import pytest
import torch
from safetensors.torch import load_file

from ckptd import failpoints
from ckptd.coordinator.staging import StagingArea, tensors_of
from ckptd.storage import Storage
from ckptd.workers.safetensors_io import write_safetensors

CHUNK = 16 << 20


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    failpoints.disarm()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _stream(tmp_path, state: dict[str, torch.Tensor], area: StagingArea | None = None):
    """Stage ``state`` fenced and stream it into a file; return the file's path, what the
    writer returned, and every (key, bytes) it was told was staged, with whether those bytes
    really held the source's when it was told so."""
    area = area or StagingArea(1, "stage-test")
    snap = area.snapshot("model", state, tensors_of(state), fenced=True)
    keys = {id(t): k for k, t in snap.state.items()}
    sources = {k: _bits(v).clone() for k, v in state.items()}
    told: list[tuple[str, int, bool]] = []

    def ready(t: torch.Tensor, n: int) -> None:
        snap.wait_staged(t, n)
        key = keys[id(t)]
        told.append((key, n, bool(torch.equal(_bits(t)[:n], sources[key][:n]))))

    storage = Storage(str(tmp_path))
    path = storage.join("out", "model.safetensors")
    storage.makedirs(storage.join("out"))
    try:
        written = write_safetensors(storage, path, snap.state, {"format": "pt"}, ready)
        snap.wait()
    finally:
        snap.release()
    return path, written, told


def _check_file(path: str, written, state: dict[str, torch.Tensor]) -> None:
    loaded = load_file(path)
    assert list(loaded) == list(state)
    for key, want in state.items():
        assert loaded[key].dtype == want.dtype and loaded[key].shape == want.shape
        assert torch.equal(_bits(loaded[key]), _bits(want)), key
    with open(path, "rb") as f:
        data = f.read()
    assert written.size == len(data) and written.crc32 == f"{zlib.crc32(data):08x}"


def test_every_wait_staged_return_means_those_bytes_hold_the_source(tmp_path):
    g = torch.Generator().manual_seed(3)
    big = torch.randn(CHUNK // 2 + 5, generator=g)  # two chunks and 20 bytes
    state = {
        "big": big,
        "tail": big[3:],  # an offset view over two chunks
        "bf16": torch.randn(CHUNK // 2 + 1, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (CHUNK // 8 + 1,), generator=g),
        "bool": torch.randint(0, 2, (CHUNK + 1,), dtype=torch.uint8, generator=g).bool(),
        "f8": torch.randint(0, 256, (CHUNK + 9,), dtype=torch.uint8, generator=g).view(torch.float8_e5m2),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
    }
    failpoints.arm("staging_chunk", "delay:0.05")  # the write overtakes the copy, chunk by chunk
    path, written, told = _stream(tmp_path, state)
    assert [t for t in told if not t[2]] == []  # never told bytes were staged before they were
    for key in ("big", "tail", "bf16", "i64", "bool", "f8"):
        bounds = [n for k, n, _ in told if k == key]
        assert bounds[-1] == state[key].numel() * state[key].element_size() and len(bounds) >= 3
    _check_file(path, written, state)


@pytest.mark.parametrize("nbytes", [CHUNK, CHUNK + 1, 2 * CHUNK])
def test_sizes_around_the_chunk_boundary_stream_exactly(tmp_path, nbytes):
    state = {"head": torch.arange(5, dtype=torch.int32),
             "u8": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))}
    failpoints.arm("staging_chunk", "delay:0.02")
    path, written, told = _stream(tmp_path, state)
    assert all(ok for _, _, ok in told)
    assert [n for k, n, _ in told if k == "u8"][-1] == nbytes
    _check_file(path, written, state)


def test_a_wait_for_a_tensor_outside_the_buffer_set_waits_for_the_whole_copy():
    area = StagingArea(1, "stage-test")
    state = {"w": torch.randn(3 * CHUNK // 4 + 1)}
    failpoints.arm("staging_chunk", "delay:0.1")
    snap = area.snapshot("model", state, tensors_of(state), fenced=True)
    try:
        snap.wait_staged(torch.zeros(4), 4)  # not one of the buffers: the whole copy must be done
        assert torch.equal(snap.state["w"], state["w"])
    finally:
        snap.release()


def test_release_while_the_copy_runs_returns_only_once_the_copy_has_ended():
    """A streamed write that fails at once releases its snapshot while the fenced copy still
    runs: the buffers may go back only once nothing writes into them any more."""
    area = StagingArea(1, "stage-test")
    state = {"w": torch.randn(3 * CHUNK // 4 + 1)}
    failpoints.arm("staging_chunk", "delay:0.2")
    snap = area.snapshot("model", state, tensors_of(state), fenced=True)
    snap.release()
    assert torch.equal(snap.state["w"], state["w"])  # the copy is complete: it had ended
    assert area.fence() is True


def test_a_snapshot_released_twice_hands_its_buffers_back_once():
    """Releasing is idempotent: a snapshot whose buffers went back twice would give one buffer
    set to two saves at once (each a torn snapshot of the other)."""
    area = StagingArea(1, "stage-test")
    state = {"w": torch.randn(1024)}
    first = area.snapshot("model", state, tensors_of(state), fenced=False)
    first.release()
    first.release()
    second = area.snapshot("model", state, tensors_of(state), fenced=False)
    got_third = threading.Event()
    holder: dict = {}

    def third() -> None:
        holder["snap"] = area.snapshot("model", state, tensors_of(state), fenced=False)
        got_third.set()

    t = threading.Thread(target=third, daemon=True)
    t.start()
    # Bounded check that it is still blocked; releasing the second is what lets it through.
    assert not got_third.wait(0.5), "a second buffer set was handed out with max_staged=1"
    second.release()
    assert got_third.wait(30)
    t.join(30)
    assert holder["snap"].state["w"].data_ptr() == second.state["w"].data_ptr()
    holder["snap"].release()
    assert area.allocated_bytes == 1024 * 4
