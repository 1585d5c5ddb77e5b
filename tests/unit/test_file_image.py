"""A staged state laid out as its safetensors file (``BufferSet`` with a plan), and files written
from that image: O_DIRECT straight from the staged bytes (``DirectWriter.write_stable``), the same
bytes as the ordinary writer, and the fallbacks where the layout does not fit."""

from __future__ import annotations

import logging
import mmap
import os
import random
import zlib

import pytest
import torch
from safetensors.torch import load_file

from ckptd import direct_io, failpoints
from ckptd.coordinator.staging import BufferSet, StagedCopy
from ckptd.direct_io import ALIGN, DirectWriter, filesystem_type
from ckptd.storage import Storage
from ckptd.workers.safetensors_io import is_image, plan_safetensors, write_safetensors
from tests.unit.helpers import write_streamed

META = {"format": "pt"}


@pytest.fixture
def disarm():
    yield
    failpoints.disarm()


def _aligned(data: bytes) -> memoryview:
    """``data`` in a page-aligned mapping (as a staged image is)."""
    m = mmap.mmap(-1, max(len(data), 1))
    m[: len(data)] = data
    return memoryview(m)[: len(data)]


def _direct_fd(tmp_path, name="f.bin") -> tuple[int, str]:
    path = str(tmp_path / name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if not direct_io.enable(fd):
        os.close(fd)
        pytest.skip(f"the kernel refuses O_DIRECT on {filesystem_type(str(tmp_path))}")
    return fd, path


def _write(tmp_path, calls) -> tuple[DirectWriter, bytes]:
    """Each call is ("write" | "stable", buffer)."""
    fd, path = _direct_fd(tmp_path)
    try:
        w = DirectWriter(fd, sum(len(b) for _, b in calls))
        for how, b in calls:
            assert (w.write_stable(b) if how == "stable" else w.write(b)) == len(b)
        w.finish()
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        return w, f.read()


@pytest.mark.parametrize("length", [1, ALIGN - 1, ALIGN, ALIGN + 1, (3 << 20) + 17, 40 << 20])
def test_aligned_stable_bytes_are_written_from_where_they_are_except_the_tail(tmp_path, length):
    data = random.Random(length).randbytes(length)
    w, got = _write(tmp_path, [("stable", _aligned(data))])
    assert got == data and w.size == length and w.crc == zlib.crc32(data)
    assert w.copied == length % ALIGN  # only the part of a block after the last whole one was copied
    assert w.direct


def test_stable_bytes_that_are_not_page_aligned_or_follow_a_partial_buffer_are_copied_and_exact(tmp_path):
    rnd = random.Random(7)
    a, b, c, d = (rnd.randbytes(n) for n in (5 << 20, 3 << 20, 100, 6 << 20))
    unaligned = _aligned(b"x" + b)[1:]  # one byte past a page boundary
    calls = [("stable", _aligned(a)), ("stable", unaligned), ("write", c), ("stable", _aligned(d))]
    w, got = _write(tmp_path, calls)
    assert got == a + b + c + d and w.crc == zlib.crc32(a + b + c + d)
    # a went from its own pages; b was not aligned; d came after c, which left a buffer partly filled
    assert w.copied == len(b) + len(c) + len(d)


def test_stable_writes_refused_o_direct_are_written_buffered_with_the_same_bytes(tmp_path, disarm):
    data = random.Random(3).randbytes((20 << 20) + 5)
    failpoints.arm("direct_io_write", "raise")
    w, got = _write(tmp_path, [("stable", _aligned(data))])
    assert got == data and w.crc == zlib.crc32(data)
    assert not w.direct


def test_a_stable_write_error_is_raised_by_finish(tmp_path):
    data = _aligned(random.Random(4).randbytes(8 << 20))
    fd, _ = _direct_fd(tmp_path)
    w = DirectWriter(fd, len(data))
    os.close(fd)  # every pwrite now fails with EBADF
    w.write_stable(data)
    with pytest.raises(OSError):
        w.finish()
    w.abort()  # idempotent: nothing left in flight


def _state(misaligned: bool = False) -> dict[str, torch.Tensor]:
    return {
        "big": torch.randn((9 << 20) // 4 + 2),
        "ids": torch.arange(7 if misaligned else 8, dtype=torch.int8),  # 7 bytes put the next one off its dtype
        "bf16": torch.randn(1000).to(torch.bfloat16),
        "t": torch.randn(300, 500).t(),  # not contiguous: the staged copy is
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0),
    }


def _stage(state: dict, plan=None, shared: bool = False) -> tuple[BufferSet, dict]:
    leaves = list(state.values())
    buf = BufferSet(leaves, shared, plan)
    copy = StagedCopy(leaves, buf)
    copy.run()
    copy.wait()
    return buf, dict(zip(state, buf.tensors, strict=True))


@pytest.mark.parametrize("shared", [False, True])
def test_a_planned_buffer_set_is_the_files_image_with_the_header_in_front(shared):
    state = _state()
    plan = plan_safetensors(state, META)
    buf, staged = _stage(state, plan, shared)
    assert buf.image is not None and buf.image.data_ptr() % ALIGN == 0 and buf.image.numel() == plan.size
    assert buf.shared_tensors[-1] is buf.image and buf.image.is_shared() == shared
    for t, (offset, n) in zip(staged.values(), plan.spans, strict=True):
        if n:
            assert t.data_ptr() == buf.image.data_ptr() + offset
    assert is_image(buf.image, plan, staged)
    # The image's bytes are the file safetensors itself reads back.
    loaded = _load_bytes(bytes(buf.image.numpy()))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def _load_bytes(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


def test_a_layout_that_does_not_fit_its_dtypes_gets_one_buffer_per_tensor():
    state = _state(misaligned=True)
    buf, staged = _stage(state, plan_safetensors(state, META))
    assert buf.image is None and buf.shared_tensors == buf.tensors
    assert all(torch.equal(staged[k], v) for k, v in state.items())


def test_a_file_written_from_its_image_is_the_file_written_from_the_tensors(tmp_path, caplog):
    state = _state()
    plan = plan_safetensors(state, META)
    buf, staged = _stage(state, plan)
    storage = Storage(str(tmp_path), direct_io="on")
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        from_image = write_safetensors(storage, str(tmp_path / "image.safetensors"), staged, META, image=buf.image)
    plain = write_safetensors(storage, str(tmp_path / "plain.safetensors"), state, META)
    assert (tmp_path / "image.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    assert (from_image.size, from_image.crc32) == (plain.size, plain.crc32)
    lines = [r.getMessage() for r in caplog.records if "image.safetensors" in r.getMessage()]
    if lines and "with O_DIRECT" in lines[0]:
        assert f", {plan.size % ALIGN} of them through bounce buffers" in lines[0]
    loaded = load_file(str(tmp_path / "image.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_an_image_that_is_not_the_tensors_file_is_ignored(tmp_path):
    state = _state()
    plan = plan_safetensors(state, META)
    buf, staged = _stage(state, plan)
    other = {k: v.clone() for k, v in staged.items()}  # the same values, elsewhere in memory
    assert not is_image(buf.image, plan, other)
    assert not is_image(buf.image, plan_safetensors(staged, {"format": "other"}), staged)  # another header
    storage = Storage(str(tmp_path))
    other["big"][0] = 42.0  # only the tensors given are written, not the image's bytes
    write_safetensors(storage, str(tmp_path / "f.safetensors"), other, META, image=buf.image)
    assert load_file(str(tmp_path / "f.safetensors"))["big"][0] == 42.0


def test_a_write_from_the_image_streams_behind_the_copy_tensor_by_tensor(tmp_path):
    state = {"a": torch.randn((20 << 20) // 4), "b": torch.randn(5, 7), "c": torch.randn((30 << 20) // 4 + 1)}
    _, path, asked, buf = write_streamed(tmp_path, state, plan_safetensors(state, META), META)
    assert buf.image is not None
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # Every tensor was waited for, in order, up to its whole size before the piece holding its end.
    last = {}
    for k, n in asked:
        assert n >= last.get(k, 0)
        last[k] = n
    assert last == {k: v.numel() * v.element_size() for k, v in state.items()}
    assert [k for k, _ in asked] == sorted((k for k, _ in asked), key="abc".index)

