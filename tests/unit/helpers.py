"""What the unit tests share."""

from __future__ import annotations

import os

from ckptd.manifest import FileEntry
from ckptd.verify import CommittedStep


def committed(root: str, written, step: int = 7) -> CommittedStep:
    """A step made of what the writers returned (as the monitor's manifest would list it)."""
    files = {}
    for w in written:
        rel = os.path.relpath(w.path, root)
        files[rel] = FileEntry(path=rel, size=w.size, crc32=w.crc32)
    return CommittedStep(step, root, {}, files)
