"""The commit's checks of a step directory against what its units reported: reported files
still as reported, committed files unchanged, no link out of the step, and the files written
outside save units checksummed. Runs in the monitor's I/O threads, within
:meth:`~ckptd.monitor.commit.Committer.commit`.

A mixin of :class:`~ckptd.monitor.commit.Committer` (it reads the root through its storage).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ckptd.errors import CheckpointError
from ckptd.manifest import FileEntry, crc32_file, listed_as, still_holds
from ckptd.storage import FileStat, Storage

if TYPE_CHECKING:
    from ckptd.monitor.commit import CommitPlan


class CommitCheckError(CheckpointError):
    """The step directory does not match what its units reported; the step must not commit.

    ``committed_changed``: a file an earlier manifest of the step lists has changed.
    """

    def __init__(self, message: str, committed_changed: bool = False) -> None:
        super().__init__(message)
        self.committed_changed = committed_changed

    def __reduce__(self):
        return (type(self), (str(self), self.committed_changed))


class StepChecks:
    storage: Storage

    def _check_reports(self, plan: CommitPlan, step_path: str,
                       on_storage: dict[str, FileStat]) -> dict[str, tuple[FileEntry, str]]:
        """rel -> (entry, unit key) for every reported file, checked against storage.

        Two units can report one file (a unit whose save_fn returned None finds files that changed
        while it ran, which may be another unit's): the report that matches storage wins, and of
        those a unit that named the file, a state-dict unit first.
        """
        out: dict[str, tuple[FileEntry, str]] = {}
        shared: dict[str, list[tuple[FileEntry, str]]] = {}  # files more than one unit reported
        doubtful = []
        # One pass, without building paths: 40,000 files a commit at 10,000 ranks.
        for unit, entries in plan.reports.items():
            for e in entries:
                rel = e.path
                seen = out.get(rel)
                if seen is not None:
                    shared.setdefault(rel, [seen]).append((e, unit))
                    continue
                out[rel] = (e, unit)
                st = on_storage.get(rel)
                if st is None or not listed_as(e, st):
                    doubtful.append(rel)
        # Sorted, so that the first problem reported is the same whatever order the units came in.
        for rel in sorted(shared.keys() | set(doubtful)):
            # By unit too: the unit a message names, and the report kept, must not depend on the
            # order the units' reports arrived in.
            candidates = sorted(shared.get(rel) or [out[rel]], key=lambda c: c[1])
            st = on_storage.get(rel)
            if st is None:
                units = ", ".join(sorted({u for _, u in candidates}))
                raise CommitCheckError(f"{step_path}/{rel}, reported by {units}, is missing from storage")
            match = [c for c in candidates if self._unchanged(f"{step_path}/{rel}", c[0], st)]
            if len({c[0].crc32 for c in match}) > 1:
                # Reports of the same size and time but other bytes: the file was rewritten within
                # one tick of the filesystem's clock, so only its bytes can say which is on storage.
                crc = crc32_file(self.storage, f"{step_path}/{rel}")[1]
                match = [c for c in match if c[0].crc32 == crc]
            if not match:
                e, unit = candidates[-1]
                raise CommitCheckError(
                    f"{step_path}/{rel} is {st.size} bytes on storage, but {unit} reported {e.size} bytes "
                    "(or it changed after it was reported): something rewrote it after its save finished. "
                    "Save functions that return None have their files found by time; return the paths "
                    "they wrote so each file is attributed exactly"
                )
            # The file's writer, if it reported it: a unit that found the file by time (its
            # save_fn returned None) may hold another unit's file, and a state-dict unit's file
            # must stay in the state dict's manifest.
            out[rel] = min(match, key=lambda c: (c[1] in plan.found, c[1] not in plan.sd_units, c[1]))
        return out

    def _check_links(self, step_path: str, links: list[str]) -> None:
        """Refuse a file that is a symbolic link into another directory under the root (another
        step, say): retention, gc or a retirement deleting that directory would take a file of
        this step with it once committed. Links within the step, or out of the root, are the
        job's to keep."""
        if not links:
            return
        root = os.path.realpath(self.storage.root) + "/"
        step = os.path.realpath(step_path) + "/"
        for rel in sorted(links):
            target = os.path.realpath(f"{step_path}/{rel}")
            if target.startswith(root) and not target.startswith(step):
                raise CommitCheckError(
                    f"{step_path}/{rel} is a symbolic link to {target}, outside its step directory but under "
                    "the checkpoint root: deleting that (retention, gc, a retirement) would take a committed "
                    "file of this step with it. Copy or hard-link the file into the step instead"
                )

    def _unchanged(self, path: str, entry: FileEntry, st: FileStat) -> bool:
        return still_holds(self.storage, path, entry, st)

    def _checksum_unclaimed(self, step_path: str, unclaimed: list[str],
                            on_storage: dict[str, FileStat]) -> dict[str, FileEntry]:
        out = {}
        for rel in unclaimed:
            path = f"{step_path}/{rel}"
            size, crc = crc32_file(self.storage, path)
            st = self.storage.stat(path)
            if size != st.size or not listed_as(FileEntry(path=rel, size=size, crc32=crc,
                                                      mtime_ns=on_storage[rel].mtime_ns), st):
                raise CommitCheckError(
                    f"{path} changed while it was being checksummed for the commit of its step; no "
                    "registered save unit reported it, so something outside ckptd is still writing it"
                )
            out[rel] = FileEntry(path=rel, size=size, crc32=crc, mtime_ns=st.mtime_ns)
        self.storage.make_durable([f"{step_path}/{rel}" for rel in out])
        return out
