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


def write_streamed(tmp_path, state: dict, plan=None, metadata=None):
    """``state`` staged into a buffer set (the file's image with ``plan``) by a copy on another
    thread, and written with ``write_safetensors`` behind that copy into ``tmp_path/out``.
    Returns the WrittenFile, the file's path, what the write waited for, as (key, bytes), and
    the buffer set."""
    import threading

    from ckptd.coordinator.staging import BufferSet, StagedCopy
    from ckptd.storage import Storage
    from ckptd.workers.safetensors_io import write_safetensors

    leaves = list(state.values())
    buf = BufferSet(leaves, plan=plan)
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
        return write_safetensors(storage, path, staged, metadata, ready, buf.image), path, asked, buf
    finally:
        copier.join()
