"""The mirror's work in its own threads: reading the mirror and the local root, copying and
checking files, publishing manifests and trackers with retries, and a retention pass.

A mixin of :class:`~ckptd.monitor.mirror.Mirror`, whose event loop hands these to its thread pool
(they read its storages, options, policy and counters).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptd import failpoints
from ckptd.config import Kind
from ckptd.errors import CheckpointError
from ckptd.fencing import FencedError
from ckptd.layout import MANIFESTS, StepEntry, foreign_dirs, manifests_of, newest_committed, scan_steps
from ckptd.manifest import FileEntry, Manifest, crc32_file
from ckptd.metrics import RETRIED_REQUESTS
from ckptd.monitor.retention import plan_retention, run_plan
from ckptd.verify import open_step
from ckptd.workers.files import ChecksumWriter, mismatch, write_stream

if TYPE_CHECKING:
    from ckptd.monitor.mirror import _Upload

log = logging.getLogger("ckptd.mirror")

CHUNK = 8 << 20
MAX_BACKOFF_S = 30.0


class LocalCopyError(CheckpointError):
    """The local copy of a step cannot be uploaded: a file is gone or differs from its manifest."""


class MirrorIO:
    def _read_remote_trackers(self) -> dict[Kind, int | None]:
        return {kind: newest_committed(self.remote, kind) for kind in Kind}

    def _missing_on_mirror(self) -> tuple[list[int], set[int]]:
        """The local steps (when the monitor started) that the mirror lacks, whole or a manifest of,
        and that the mirror's retention would keep: a step an earlier monitor failed to upload
        goes up now even if newer ones made it, unless the mirror would delete it at once (the
        second value: those dropped)."""
        missing = {step: kinds for step, kinds in self._startup_local.items()
                   if not kinds <= manifests_of(self.remote, step, self._template)}
        if all(step > max(self._tracked(), default=-1) for step in missing):
            return sorted(missing), set()  # the common case, without listing the mirror
        entries = {s: e for s, e in scan_steps(self.remote, self._template).items() if e.committed}
        entries.update({step: StepEntry(step, "", kinds) for step, kinds in missing.items()})
        plan = plan_retention(entries, self._policy, protected=self._tracked(), failed=set())
        dropped = {e.step for e in plan.delete} & set(missing)
        return sorted(set(missing) - dropped), dropped

    def _read_local(self, step: int) -> tuple[str, dict[Kind, bytes], dict[str, FileEntry]]:
        try:
            committed = open_step(self._local, step, self._step_kind)
        except CheckpointError as e:
            raise LocalCopyError(f"step {step} cannot be read under {self._local.url}: {e}") from e
        # Every manifest of the step, not only the mirrored kinds': a pipeline may list a step's
        # weights under its state-dict manifest and the rest under the checkpoint one. State dict
        # first, so that a reader of the mirror never sees the checkpoint without its weights.
        manifests = {k: committed.manifests[k].to_bytes()
                     for k in (Kind.STATE_DICT, Kind.CHECKPOINT) if k in committed.manifests}
        return committed.path.rsplit("/", 1)[-1], manifests, committed.files

    def _still_local(self, step: int, name: str, manifests: dict[Kind, bytes]) -> dict[Kind, bytes]:
        """Of ``manifests``, those the root still holds as they were read: a state dict withdrawn
        while its files went up (a unit rewrote one) is not committed on the mirror either."""
        out = {}
        for kind, data in manifests.items():
            text = self._local.read_text_or_none(self._local.join(name, MANIFESTS[kind]))
            # As written (the same bytes), or as another version of ckptd wrote it (parsed).
            if text is not None and (text.encode() == data or Manifest.model_validate_json(text).to_bytes() == data):
                out[kind] = data
        if not out:
            raise LocalCopyError(f"step {step} is no longer committed under {self._local.url} (withdrawn while "
                                 "it was being uploaded)")
        return out

    def _copy_file(self, name: str, rel: str, entry: FileEntry, rec: _Upload) -> None:
        src, dst = self._local.join(name, rel), self.remote.join(name, rel)
        self._retrying(f"upload of {name}/{rel}", self._copy_once, src, dst, entry)
        failpoints.hit("after_mirror_file")
        with self._lock:
            self._uploaded_bytes += entry.size
            rec.bytes += entry.size

    def _copy_once(self, src: str, dst: str, entry: FileEntry) -> None:
        try:
            fin = self._local.open(src, "rb")
        except FileNotFoundError:
            raise LocalCopyError(f"{src} is missing") from None

        def copy(w: ChecksumWriter) -> None:
            while chunk := fin.read(CHUNK):
                w.write(chunk)
            problem = mismatch(entry, w.size, f"{w.crc:08x}")
            if problem:  # raised before the write completes: nothing is published on the mirror
                raise LocalCopyError(f"{src}: {problem}")

        with fin:
            write_stream(self.remote, dst, copy)
        # Verified on the mirror itself, not trusted from the upload.
        if self._opts.verify == "checksum":
            problem = mismatch(entry, *crc32_file(self.remote, dst))
        else:
            problem = mismatch(entry, self.remote.stat(dst).size, entry.crc32)
        if problem:
            raise OSError(f"the mirror's copy of {dst} is {problem}")

    def _publish(self, path: str, data: bytes, check: Callable[[], Any] | None = None) -> None:
        """A manifest or tracker onto the mirror, if this monitor's attempt is still the newest
        (and ``check`` passes: for a manifest, the root still holds it): checked at the last
        moment of each try, as the root's publishes are (a try retried for seconds must not
        publish over a newer job that started meanwhile, nor a state dict withdrawn meanwhile)."""

        def last_moment() -> None:
            self._check_fence()
            if check is not None:
                check()

        failpoints.hit("before_mirror_publish")
        self.remote.write_atomic(path, data, before_publish=last_moment)

    def _retrying(self, what: str, fn: Callable, *args: Any) -> Any:
        for attempt in range(self._opts.retries + 1):
            try:
                return fn(*args)
            except (LocalCopyError, FencedError):
                raise
            except Exception as e:
                if attempt == self._opts.retries:
                    raise
                delay = min(self._opts.retry_backoff_s * 2**attempt, MAX_BACKOFF_S)
                with self._lock:
                    self._retried += 1
                self._metrics.inc(RETRIED_REQUESTS, request="mirror")
                log.warning("%s failed (%s: %s); retry %d of %d in %.2f s", what, type(e).__name__, e,
                            attempt + 1, self._opts.retries, delay)
                time.sleep(delay)  # backoff between requests, in the mirror's own thread

    def _retention_pass(self, protected: set[int]):
        self._check_fence()
        entries = scan_steps(self.remote, self._template)
        # The mirror's only writer is this monitor: a step directory there without a manifest
        # that is not being uploaded is what a killed upload left, and can go at once; unless the
        # mirror held it before ckptd first used it (another tool's), which stays.
        foreign = foreign_dirs(self.remote) or set()
        leftovers = {s for s, e in entries.items() if not e.committed and e.name not in foreign} - protected
        plan = plan_retention(entries, self._policy, protected=protected, failed=leftovers, foreign=foreign)
        return run_plan(self.remote, plan, grace_s=0.0, fence=self._check_fence)
