"""A fenced staging copy publishes its progress chunk by chunk, and a write streams behind it."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from ckptd import failpoints
from ckptd.checksum import crc32, hex_of
from ckptd.coordinator.staging import BufferSet, StagedCopy, StagingArea
from ckptd.errors import CheckpointError
from ckptd.storage import Storage
from ckptd.workers.safetensors_io import write_safetensors
from tests.unit.helpers import write_streamed


def _state() -> dict[str, torch.Tensor]:
    return {
        "big": torch.randn((40 << 20) // 4 + 3),  # three chunks and a bit: the uneven last chunk
        "transposed": torch.randn(300, 500).t(),  # not contiguous: copied whole
        "bf16": torch.randn(1001).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64),
        "empty": torch.empty(0),
    }


def _streamed(tmp_path, state):
    return write_streamed(tmp_path, state)[:3]


def test_a_write_streamed_behind_the_copy_holds_the_state_and_its_checksum(tmp_path):
    state = _state()
    written, path, asked = _streamed(tmp_path, state)
    loaded = load_file(path)
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    with open(path, "rb") as f:
        assert written.crc32 == hex_of(crc32(f.read()))
    # The big tensor was asked for chunk by chunk, each bound growing up to its whole size.
    big = [n for k, n in asked if k == "big"]
    assert big == sorted(big) and big[-1] == state["big"].numel() * 4 and len(big) >= 4


def test_a_copy_that_fails_midway_wakes_the_streaming_write_with_its_error(tmp_path):
    failpoints.arm("staging_chunk", "raise")
    try:
        with pytest.raises(CheckpointError, match="staging the state failed: FailpointError"):
            _streamed(tmp_path, _state())
    finally:
        failpoints.disarm()
    assert not (tmp_path / "out" / "model.safetensors").exists()  # nothing half-written appeared


def _big_state() -> dict[str, torch.Tensor]:
    return {"a": torch.randn((48 << 20) // 4), "t": torch.randn(300, 500).t(), "b": torch.randn((40 << 20) // 4 + 5)}


def test_the_fence_copies_what_the_staging_thread_has_not_reached_and_the_snapshot_is_exact():
    state = _big_state()
    total = sum(t.numel() * t.element_size() for t in state.values())
    area = StagingArea(max_staged=1, thread_name="ckptd-stage-test")
    failpoints.arm("staging_chunk", "delay:0.05")  # every chunk is slow, on whichever thread copies it
    try:
        snap = area.snapshot("m", state, list(state.values()), fenced=True)
        assert area.fence() is True
    finally:
        failpoints.disarm()
    # The caller of the fence did not wait idle: it copied chunks from the end.
    assert 0 < snap.helped_bytes <= total
    snap.wait()
    assert all(torch.equal(snap.state[k], v) for k, v in state.items())
    snap.release()


def test_a_chunk_failing_on_the_fence_fails_the_save_and_not_the_fence():
    state = _big_state()
    area = StagingArea(max_staged=1, thread_name="ckptd-stage-test")
    failpoints.arm("staging_chunk", "raise")
    try:
        snap = area.snapshot("m", state, list(state.values()), fenced=True)
        assert area.fence() is True  # the training loop goes on; the save reports the failure
    finally:
        failpoints.disarm()
    with pytest.raises(CheckpointError, match="staging the state failed: FailpointError"):
        snap.wait()
    snap.release()
    # The buffers went back: the next save of the name gets them and copies the state whole.
    again = area.snapshot("m", state, list(state.values()), fenced=True)
    area.fence()
    again.wait()
    assert all(torch.equal(again.state[k], v) for k, v in state.items())
    again.release()


def test_a_write_streamed_from_the_front_while_a_fence_copies_from_the_back_holds_the_state(tmp_path):
    state = _big_state() | {"small": torch.arange(5, dtype=torch.int64)}
    leaves = list(state.values())
    buf = BufferSet(leaves)
    copy = StagedCopy(leaves, buf)
    staged = dict(zip(state, buf.tensors, strict=True))
    failpoints.arm("staging_chunk", "delay:0.02")
    copier = threading.Thread(target=copy.run)
    helper = threading.Thread(target=copy.help)
    copier.start()
    helper.start()
    try:
        path = str(tmp_path / "out" / "model.safetensors")
        storage = Storage(str(tmp_path))
        storage.makedirs(str(tmp_path / "out"))
        written = write_safetensors(storage, path, staged, ready=copy.wait_staged)
    finally:
        copier.join()
        helper.join()
        failpoints.disarm()
    assert copy.helped_bytes > 0 and copy.error is None
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    with open(path, "rb") as f:
        assert written.crc32 == hex_of(crc32(f.read()))
