"""Session 15b: O_DIRECT writes (ckptd/direct_io.py, ckptd/workers/files.py ``write_stream``) attacked
without Ray: real files on the test machine's filesystem (ext4 here, so ``auto`` is O_DIRECT), a
real RLIMIT_FSIZE in a child process, the ``direct_io_write`` failpoint.

Attacked:

* every file is byte-exact and has the right CRC-32 in ``on``, ``auto`` and ``off``, and with the
  kernel refusing O_DIRECT (the failpoint), for safetensors files of odd dtypes (bfloat16, float16,
  int8, bool, float64), odd lengths and non-contiguous views (transposed, strided, a slice of a
  larger storage), and for a ``torch.save`` stream (``write_torch``) of such tensors;
* a write that fails part-way (RLIMIT_FSIZE below the file's size, a fill that raises after
  filling both bounce buffers) leaves neither the file nor a temp file, in every mode;
* a file whose size is exactly the RLIMIT_FSIZE limit.

Held: byte-exactness in every mode and under the failpoint; no partial or temp file after a
failure part-way.

Broke, and fixed in the same session (the test failed before the fix):

* ``test_a_file_exactly_at_the_file_size_limit_is_written_in_every_mode``: ``off`` writes it,
  ``on``/``auto`` fail with EFBIG. ``DirectWriter.finish`` (ckptd/direct_io.py:208-214) pads the
  last buffer to 4 KiB and writes the padding before ``ftruncate`` cuts it off, so the file
  briefly needs up to 4 KiB more than its length; the limit refuses the O_DIRECT write (EINVAL
  for the short unaligned remainder, so ``_pwrite`` falls back), and the fallback (direct_io.py:
  173-185) still writes the *padded* view buffered, which the limit refuses with EFBIG. The same
  applies to a disk or quota with less than 4 KiB to spare. The mode changes whether a save
  succeeds, although docs/storage.md says the modes differ only in speed. Fixed: of the last
  buffer only the whole blocks go with O_DIRECT, the rest through the page cache, and nothing is
  written past the file's end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from safetensors.torch import load_file

from ckptd import direct_io, failpoints
from ckptd.direct_io import DIRECT_MIN
from ckptd.storage import Storage
from ckptd.workers.files import load_torch, write_stream, write_torch
from ckptd.workers.safetensors_io import write_safetensors

BUF = direct_io._BUFFER
MODES = ("on", "auto", "off")


@pytest.fixture
def disarm():
    yield
    failpoints.disarm()


def _odd_tensors() -> dict[str, torch.Tensor]:
    """Odd dtypes and lengths and non-contiguous views, adding up to more than DIRECT_MIN."""
    g = torch.Generator().manual_seed(15)
    base = torch.randn(1031, 4099, generator=g)  # ~16.9 MB of float32
    return {
        "bf16": torch.randn(3_500_001, generator=g).to(torch.bfloat16),
        "f16_t": torch.randn(1023, 2049, generator=g).to(torch.float16).t(),  # transposed
        "i8": torch.randint(-128, 127, (4_194_307,), dtype=torch.int8, generator=g),
        "bool": torch.rand(777_777, generator=g) > 0.5,
        "f64_strided": torch.randn(3 * 500_009, dtype=torch.float64, generator=g)[::3],
        "f32_slice": base[5:900, 7:4001],  # a slice of a larger storage
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(2.5),
    }


def _write_all(tmp_path, mode: str) -> dict[str, bytes]:
    out = tmp_path / mode
    out.mkdir()
    storage = Storage(str(out), direct_io=mode)
    tensors = _odd_tensors()
    files = {}
    for name, fn in (("m.safetensors", lambda p: write_safetensors(storage, p, tensors)),
                     ("o.pt", lambda p: write_torch(storage, p, {"state": tensors, "step": 3}))):
        written = fn(f"{out}/{name}")
        data = (out / name).read_bytes()
        assert written.size == len(data) > DIRECT_MIN, (mode, name)
        assert written.crc32 == f"{zlib.crc32(data):08x}", (mode, name)
        files[name] = data
    back = load_file(f"{out}/m.safetensors")
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), (mode, k)
    loaded = load_torch(files["o.pt"], "o.pt")
    assert all(torch.equal(loaded["state"][k], t) for k, t in tensors.items()) and loaded["step"] == 3
    assert sorted(os.listdir(out)) == ["m.safetensors", "o.pt"]  # no temp file left
    return files


def test_odd_dtypes_and_views_are_byte_identical_in_every_mode_and_when_o_direct_is_refused(tmp_path, disarm):
    """The same tensors give the same bytes in every mode, and with every O_DIRECT write refused
    (the failpoint acts as EINVAL: the writer falls back to buffered writes mid-file)."""
    results = {mode: _write_all(tmp_path, mode) for mode in MODES}
    failpoints.arm("direct_io_write", "raise")
    refused = tmp_path / "refused"
    refused.mkdir()
    results["refused"] = _write_all(refused, "on")
    for mode, files in results.items():
        assert files == results["off"], mode


_CHILD = textwrap.dedent("""
    import os, random, resource, sys
    from ckptd.storage import Storage
    from ckptd.workers.files import write_stream
    mode, d, size, limit, fill_chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    data = random.Random(size).randbytes(size)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    def fill(w):
        for i in range(0, size, fill_chunk):
            w.write(data[i:i + fill_chunk])

    try:
        written = write_stream(Storage(d, direct_io=mode), d + "/x.bin", fill, size=size)
    except OSError as e:
        print("ERR", e.errno)
    else:
        with open(d + "/x.bin", "rb") as f:
            print("OK", written.size, f.read() == data)
""")


def _write_under_limit(tmp_path, mode: str, size: int, limit: int, fill_chunk: int = 1 << 20) -> tuple[str, list[str]]:
    d = tmp_path / f"{mode}-{size}-{limit}"
    d.mkdir()
    done = subprocess.run([sys.executable, "-c", _CHILD, mode, str(d), str(size), str(limit), str(fill_chunk)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip(), sorted(os.listdir(d))


@pytest.mark.parametrize("mode", MODES)
def test_a_write_past_the_file_size_limit_fails_and_leaves_nothing(tmp_path, mode):
    """RLIMIT_FSIZE stops the write part-way (within the second bounce buffer, at an unaligned
    offset): the write raises EFBIG and neither the file nor its temp file is left."""
    size = DIRECT_MIN + BUF + 12345
    out, left = _write_under_limit(tmp_path, mode, size, limit=BUF + 5000)
    assert out == "ERR 27", out  # EFBIG
    assert left == []


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_a_file_exactly_at_the_file_size_limit_is_written_in_every_mode(tmp_path, mode):
    size = DIRECT_MIN + 1000  # not a multiple of 4 KiB
    assert _write_under_limit(tmp_path, "off", size, limit=size) == (f"OK {size} True", ["x.bin"])
    assert _write_under_limit(tmp_path, mode, size, limit=size) == (f"OK {size} True", ["x.bin"])


@pytest.mark.parametrize("mode", MODES)
def test_a_fill_failing_after_both_buffers_were_sent_leaves_nothing(tmp_path, mode):
    """The fill raises after more than two bounce buffers went to the helper thread (writes in
    flight): the error is the fill's, and no file or temp file is left."""
    storage = Storage(str(tmp_path), direct_io=mode)

    def fill(w):
        for _ in range(5):
            w.write(b"z" * (BUF // 2 + 4097))
        raise RuntimeError("tensor changed shape")

    free_before = len(direct_io._free_buffers)
    with pytest.raises(RuntimeError, match="changed shape"):
        write_stream(storage, f"{tmp_path}/x.bin", fill, size=DIRECT_MIN * 2)
    assert os.listdir(tmp_path) == []
    assert len(direct_io._free_buffers) >= min(free_before, direct_io._MAX_FREE)  # buffers came back
