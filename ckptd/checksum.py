"""CRC-32 (zlib's polynomial, the checksum in every manifest) as fast as the machine allows.

ISA-L (the ``isal`` package) computes it with carry-less multiplication, several times faster
than zlib; both release the GIL, so large buffers are split across threads and the parts
combined. Without ``isal`` (a platform with no wheel) zlib is used, with the same results.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from concurrent.futures import Executor

from ckptd import phases

try:
    from isal.isal_zlib import crc32 as _crc32
    from isal.isal_zlib import crc32_combine as _combine

    BACKEND = "isal"
except ImportError:  # pragma: no cover - exercised only where isal has no wheel
    from zlib import crc32 as _crc32

    _combine = None
    BACKEND = "zlib"

crc32: Callable[..., int] = _crc32
"""``crc32(data, value=0)``: the CRC-32 of ``data``, continuing from ``value``."""

_PART = 32 << 20  # below this, one thread is as fast as several


def hex_of(crc: int) -> str:
    """The form manifests hold: 8 lowercase hex digits."""
    return f"{crc:08x}"


def crc32_parallel(data, pool: Executor, parts: int) -> int:
    """The CRC-32 of ``data`` (a buffer), computed on up to ``parts`` threads of ``pool``."""
    view = memoryview(data).cast("B")
    n = len(view)
    parts = min(parts, n // _PART) if _combine is not None else 1
    if parts <= 1:
        return crc32(view)
    size = -(-n // parts)
    bounds = [(i, min(i + size, n)) for i in range(0, n, size)]
    futures = [pool.submit(crc32, view[a:b]) for a, b in bounds]
    crc = futures[0].result()
    for (a, b), f in zip(bounds[1:], futures[1:], strict=True):
        crc = _combine(crc, f.result(), b - a)
    return crc


TIMED_MIN = 64 << 10  # the CRC-32 of smaller pieces counts as part of the write phase


class ChecksummedStream(io.RawIOBase):
    """The base of ckptd's write-only streams: the CRC-32 and the count of the bytes given."""

    def __init__(self) -> None:
        super().__init__()
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def _checksum(self, part) -> None:
        """Add ``part`` to the CRC-32, timed as the ``checksum`` phase unless it is small (pickle's
        many small pieces are not worth a clock read)."""
        if len(part) < TIMED_MIN:
            self.crc = crc32(part, self.crc)
        else:
            with phases.phase(phases.CHECKSUM):
                self.crc = crc32(part, self.crc)
