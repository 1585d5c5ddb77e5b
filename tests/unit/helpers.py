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


def large_step(root: str, step: int = 1, touch=None):
    """A step directory of LARGE_STEP or more reported files (4 a rank, as P9 lays them out), so
    that its commit walks it with GNU find; ``touch(path, rank, unit)`` may change a file before
    it is reported. Returns the committer and the plan of that commit."""
    import zlib

    import ckptd
    from ckptd.config import Kind
    from ckptd.monitor.commit import LARGE_STEP, CommitPlan, Committer
    from ckptd.storage import Storage
    from ckptd.template import StepDirTemplate

    step_dir = ckptd.step_dir(root, step)
    reports = {}
    for r in range(LARGE_STEP // 4 + 1):
        os.makedirs(f"{step_dir}/rank{r}")
        entries = []
        for u in range(4):
            path = f"{step_dir}/rank{r}/u{u}.bin"
            data = f"{r}-{u}".encode()
            with open(path, "wb") as f:
                f.write(data)
            if touch is not None:
                touch(path, r, u)
            entries.append(FileEntry(path=f"rank{r}/u{u}.bin", size=len(data), crc32=f"{zlib.crc32(data):08x}",
                                     mtime_ns=os.stat(path).st_mtime_ns))
        reports[f"rank{r}/save#{r}"] = entries
    committer = Committer(Storage(root), StepDirTemplate("global_step_{step}"), 0)
    plan = CommitPlan(step=step, kinds=[Kind.CHECKPOINT], reports=reports, units={Kind.CHECKPOINT: sorted(reports)},
                      sd_units=set())
    return committer, plan
