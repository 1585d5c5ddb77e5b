"""O_DIRECT writes of large files (ckptd/direct_io.py): exact bytes and CRC-32 for every length and
write pattern, the fallback when the kernel refuses, which filesystems get it, and errors."""

from __future__ import annotations

import fcntl
import logging
import os
import random
import zlib

import pytest
import torch
from safetensors.torch import load_file

from ckptd import direct_io, failpoints
from ckptd.direct_io import ALIGN, DIRECT_MIN, DirectWriter, direct_io_for, filesystem_type
from ckptd.errors import CheckpointConfigError
from ckptd.storage import Storage
from ckptd.workers.files import load_torch, write_stream, write_torch
from ckptd.workers.safetensors_io import write_safetensors

BUF = direct_io._BUFFER


@pytest.fixture
def disarm():
    yield
    failpoints.disarm()


def _open(path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def _write_pieces(tmp_path, pieces: list[bytes], name: str = "f.bin",
                  size: int | None = None) -> tuple[DirectWriter, bytes]:
    path = tmp_path / name
    fd = _open(path)
    try:
        if not direct_io.enable(fd):
            pytest.skip(f"the kernel refuses O_DIRECT on {filesystem_type(str(tmp_path))}")
        w = DirectWriter(fd, size)
        for p in pieces:
            assert w.write(p) == len(p)
        w.finish()
    finally:
        os.close(fd)
    return w, path.read_bytes()


@pytest.mark.parametrize("length", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BUF - 1, BUF, BUF + 1, 2 * BUF + 12345])
def test_every_length_is_written_exactly_with_its_crc(tmp_path, length):
    data = random.Random(length).randbytes(length)
    w, got = _write_pieces(tmp_path, [data])
    assert got == data  # the padding of the last block is cut off again
    assert w.size == length and w.crc == zlib.crc32(data)
    assert w.direct


def test_many_small_and_large_pieces_keep_their_order(tmp_path):
    rng = random.Random(7)
    pieces = [rng.randbytes(rng.choice([1, 7, 4096, 70_000, BUF // 3, BUF + 5])) for _ in range(40)]
    w, got = _write_pieces(tmp_path, pieces)
    whole = b"".join(pieces)
    assert got == whole and w.crc == zlib.crc32(whole) and w.size == len(whole)


def test_buffers_grow_with_the_file_in_steps_of_16_mib_up_to_64():
    mib = 1 << 20
    sizes = [None, 0, 32 * mib, 255 * mib, 256 * mib, 511 * mib, 512 * mib, 768 * mib, 8 << 30]
    assert [direct_io.buffer_size(s) // mib for s in sizes] == [16, 16, 16, 16, 32, 48, 64, 64, 64]


@pytest.mark.parametrize("hint", [None, 256 << 20, 1 << 30])
def test_a_size_hint_picks_the_buffers_and_any_length_is_still_written_exactly(tmp_path, hint):
    """The hint is about the file: shorter or longer, the bytes and CRC-32 are the same."""
    size = direct_io.buffer_size(hint)
    rng = random.Random(hint or 1)
    pieces = [rng.randbytes(n) for n in (5, size - 3, size + ALIGN + 1, 12345)]
    w, got = _write_pieces(tmp_path, pieces, size=hint)
    whole = b"".join(pieces)
    assert got == whole and w.crc == zlib.crc32(whole) and w.size == len(whole)
    assert w._size == size
    held = sum(len(b) for b in direct_io._free_buffers)
    assert held <= direct_io._MAX_FREE_BYTES and len(direct_io._free_buffers) <= direct_io._MAX_FREE


def test_a_refused_o_direct_write_falls_back_to_the_same_bytes_buffered(tmp_path, disarm):
    data = random.Random(3).randbytes(BUF + 999)
    failpoints.arm("direct_io_write", "raise")  # acts as a kernel answering EINVAL
    path = tmp_path / "f.bin"
    fd = _open(path)
    try:
        assert direct_io.enable(fd)
        w = DirectWriter(fd)
        w.write(data)
        w.finish()
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # switched off for the rest
    finally:
        os.close(fd)
    assert not w.direct
    assert path.read_bytes() == data and w.crc == zlib.crc32(data)


def test_a_write_error_is_raised_and_the_buffers_go_back(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # pwrite fails with EBADF, which is no reason to fall back
    try:
        w = DirectWriter(fd)
        taken = list(w._bufs)
        with pytest.raises(OSError):
            w.write(b"x" * (BUF + 1))
            w.finish()
        w.abort()  # idempotent
    finally:
        os.close(fd)
    assert all(any(b is t for b in direct_io._free_buffers) for t in taken)  # both came back


def test_the_buffers_kept_are_the_most_recently_used_within_the_limits():
    """After two large files written at once (their 64 MiB buffers fill the byte limit), files of
    the usual size still reuse their buffers instead of mapping fresh ones each time: the least
    recently used go first."""
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        large = [DirectWriter(fd, 8 << 30), DirectWriter(fd, 8 << 30)]
        for w in large:
            w.write(b"x")  # takes its buffers (a writer takes none until something is copied)
        for w in large:
            w.abort()
        assert sum(len(b) for b in direct_io._free_buffers) == direct_io._MAX_FREE_BYTES
        first = DirectWriter(fd)
        first.write(b"x")
        small = list(first._bufs)
        first.abort()
        again = DirectWriter(fd)
        again.write(b"x")
        assert all(any(b is s for s in small) for b in again._bufs)  # reused, not mapped anew
        again.abort()
    finally:
        os.close(fd)
    assert len(direct_io._free_buffers) <= direct_io._MAX_FREE
    assert sum(len(b) for b in direct_io._free_buffers) <= direct_io._MAX_FREE_BYTES


def test_filesystem_type_reads_the_mount_table():
    assert filesystem_type("/proc/self/status") == "proc"
    assert filesystem_type("/") is not None
    assert direct_io._unescape(r"/mnt/with\040space") == "/mnt/with space"


def test_which_files_get_o_direct(tmp_path):
    big = DIRECT_MIN
    assert not direct_io_for("off", str(tmp_path / "f"), big)
    assert not direct_io_for("on", str(tmp_path / "f"), big - 1)  # small files stay buffered
    assert not direct_io_for("on", str(tmp_path / "f"), None)  # size unknown (torch.save's stream)
    assert direct_io_for("on", str(tmp_path / "f"), big)
    assert direct_io_for("auto", str(tmp_path / "f"), big) == (filesystem_type(str(tmp_path)) in {"ext4", "xfs"})
    if filesystem_type("/dev/shm") == "tmpfs":
        assert not direct_io_for("auto", "/dev/shm/f", big)  # slower there than a plain write
    with pytest.raises(CheckpointConfigError, match="direct_io must be one of"):
        Storage(str(tmp_path), direct_io="sometimes")


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_large_safetensors_file_is_exact_either_way(tmp_path, caplog, mode):
    storage = Storage(str(tmp_path), direct_io=mode)
    sd = {"a": torch.randn(3, (DIRECT_MIN // 12) + 1), "b": torch.arange(7, dtype=torch.int8),
          "c": torch.randn(100, 33).t()}  # a view that is not contiguous
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        written = write_safetensors(storage, f"{tmp_path}/m.safetensors", sd)
    data = (tmp_path / "m.safetensors").read_bytes()
    assert written.size == len(data) > DIRECT_MIN and written.crc32 == f"{zlib.crc32(data):08x}"
    back = load_file(f"{tmp_path}/m.safetensors")
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    assert ("with O_DIRECT" in caplog.text) == (mode == "on")


def test_a_failing_fill_leaves_no_file_and_no_temp(tmp_path):
    storage = Storage(str(tmp_path), direct_io="on")

    def fill(w):
        w.write(b"y" * (BUF + 10))
        raise RuntimeError("the state changed shape")

    with pytest.raises(RuntimeError, match="changed shape"):
        write_stream(storage, f"{tmp_path}/x.bin", fill, size=DIRECT_MIN)
    assert os.listdir(tmp_path) == []


def test_a_large_torch_save_stream_goes_past_the_page_cache_and_loads_back(tmp_path, caplog):
    """torch.save's many small pickle writes and large storages, through the bounce buffers."""
    storage = Storage(str(tmp_path), direct_io="on")
    optim = {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn((1 << 20) + i)} for i in range(9)},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": list(range(9))}]}
    with caplog.at_level(logging.DEBUG, logger="ckptd.files"):
        written = write_torch(storage, f"{tmp_path}/optim.pt", optim)
    data = (tmp_path / "optim.pt").read_bytes()
    assert written.size == len(data) and written.crc32 == f"{zlib.crc32(data):08x}"
    assert "with O_DIRECT" in caplog.text
    back = load_torch(data, "optim.pt")
    assert back["param_groups"] == optim["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], optim["state"][i]["exp_avg"]) for i in range(9))
