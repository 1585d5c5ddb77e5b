"""A fenced staging copy publishes its progress chunk by chunk, and a write streams behind it."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from ckptd import failpoints
from ckptd.checksum import crc32, hex_of
from ckptd.coordinator.staging import BufferSet, StagedCopy
from ckptd.errors import CheckpointError
from ckptd.storage import Storage
from ckptd.workers.safetensors_io import write_safetensors


def _state() -> dict[str, torch.Tensor]:
    return {
        "big": torch.randn((40 << 20) // 4 + 3),  # three chunks and a bit: the uneven last chunk
        "transposed": torch.randn(300, 500).t(),  # not contiguous: copied whole
        "bf16": torch.randn(1001).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64),
        "empty": torch.empty(0),
    }


def _streamed(tmp_path, state):
    leaves = list(state.values())
    buf = BufferSet(leaves)
    copy = StagedCopy(leaves, buf)
    staged = dict(zip(state, buf.tensors, strict=True))
    asked: list[tuple[str, int]] = []
    names = {id(t): k for k, t in staged.items()}

    def ready(t, n):
        copy.wait_staged(t, n)
        asked.append((names[id(t)], n))

    copier = threading.Thread(target=copy.run)
    copier.start()
    try:
        path = str(tmp_path / "out" / "model.safetensors")
        storage = Storage(str(tmp_path))
        storage.makedirs(str(tmp_path / "out"))
        return write_safetensors(storage, path, staged, ready=ready), path, asked
    finally:
        copier.join()


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
