"""The mirror tier: committed steps copied in the background to durable remote storage.

Training writes to a fast local root; once a step is committed there, the monitor uploads it to
the mirror (any fsspec URL), one step at a time and oldest first, a bounded number of files at
once. Each file is streamed from the local copy, checked against the local manifest on the way,
and verified on the mirror (size, and by default a CRC-32 read back). Only when every file is
verified does the mirror get the step's manifest and then its own tracker, so the mirror is a
checkpoint root like any other: ``ckptd.latest_step``, ``verify`` and ``resume`` read it as is,
and a step there is committed exactly when its manifest exists.

Failures: each request is retried with exponential backoff up to ``retries`` times; an upload
that still fails is shown in status, never gets a manifest, and is tried again after
``retry_after_s`` (or at once with ``monitor.retry_mirror``). A step stays protected from local
retention until it is mirrored, so nothing is lost while the mirror is unreachable. A local copy
that does not match its manifest is never uploaded.

Upload runs in the monitor's process, in its own threads at low priority: notifications and
commits never wait for it, and training never does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ckptd import failpoints
from ckptd.config import Kind, MirrorOptions
from ckptd.errors import CheckpointError
from ckptd.fencing import FencedError
from ckptd.layout import MANIFESTS, TRACKERS, StepEntry, is_committed, manifests_of, newest_committed, scan_steps
from ckptd.manifest import FileEntry, Manifest, crc32_file
from ckptd.metrics import RETENTION_DELETIONS, RETRIED_REQUESTS, RunMetrics
from ckptd.monitor.retention import RetentionPolicy, plan_retention, run_plan
from ckptd.monitor.status import MirrorState, MirrorStatus, MirrorStepStatus, Trackers
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate
from ckptd.threads import lower_priority
from ckptd.verify import open_step
from ckptd.workers.files import ChecksumWriter, mismatch, write_stream

log = logging.getLogger("ckptd.mirror")

_CHUNK = 8 << 20
_MAX_BACKOFF_S = 30.0
_HISTORY = 100


class LocalCopyError(CheckpointError):
    """The local copy of a step cannot be uploaded: a file is gone or differs from its manifest."""


@dataclass
class _Upload:
    step: int
    state: MirrorState = MirrorState.QUEUED
    attempts: int = 0
    error: str | None = None
    bytes: int = 0
    queued_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    def to_status(self) -> MirrorStepStatus:
        return MirrorStepStatus(step=self.step, state=self.state, attempts=self.attempts, error=self.error,
                                bytes=self.bytes, queued_at=self.queued_at, finished_at=self.finished_at)


class Mirror:
    """Uploads a monitor's committed steps to its mirror. Lives on the monitor's event loop.

    Args:
        local: The monitor's root.
        remote: The mirror.
        opts: The mirror's options.
        template: The run's step directory template (the mirror uses the same names).
        local_committed: The local root's committed steps when the monitor started: protected
            from local retention until the mirror's state is known.
        on_change: Called on the event loop when a step was mirrored (local retention may now
            delete it) or the start-up scan finished.
        on_upload: Called on the event loop after each upload attempt with ``(step, start, end,
            error, detail)`` (for the timeline); it must not raise.
        metrics: Where retried requests and retention deletions are counted.
        check_fence: Raises FencedError once a newer attempt owns the root: called before a
            step's manifests go up and before retention on the mirror. A fenced mirror uploads
            and deletes nothing more (the newer job's monitor mirrors the root now).
    """

    def __init__(self, local: Storage, remote: Storage, opts: MirrorOptions, template: StepDirTemplate,
                 local_committed: dict[int, frozenset[Kind]], on_change: Callable[[], None],
                 on_upload: Callable[[int, float, float, str | None, str], None] | None = None,
                 metrics: RunMetrics | None = None, check_fence: Callable[[], None] | None = None) -> None:
        self._check_fence = check_fence or (lambda: None)
        self._fenced: str | None = None
        self._metrics = metrics or RunMetrics(None)
        self._local = local
        self.remote = remote
        self._opts = opts
        self._template = template
        self._on_change = on_change
        self._on_upload = on_upload
        self._kinds = frozenset({Kind.CHECKPOINT, Kind.STATE_DICT} if opts.state_dicts else {Kind.CHECKPOINT})
        # The manifest that makes a step one the mirror holds: with state dicts mirrored a step may
        # have no other (and a full checkpoint counts as a state dict too).
        self._step_kind = Kind.STATE_DICT if opts.state_dicts else Kind.CHECKPOINT
        # Without state dicts on the mirror, every step there is a full checkpoint.
        keep_sd = opts.max_state_dict_to_keep if opts.state_dicts else opts.max_ckpt_to_keep
        self._policy = RetentionPolicy(opts.max_ckpt_to_keep, keep_sd, opts.keep_every_n_steps)
        self._pool = ThreadPoolExecutor(opts.concurrency, thread_name_prefix="ckptd-mirror", initializer=lower_priority)
        self._uploads: dict[int, _Upload] = {}
        self._queue: set[int] = set()
        self._again: set[int] = set()  # enqueued again while uploading (another kind committed)
        self._current: int | None = None
        self._retry_at: dict[int, float] = {}
        self._events: dict[int, asyncio.Event] = {}
        self._wake = asyncio.Event()
        self._ready = False
        self._startup_local = {s: kinds for s, kinds in local_committed.items() if kinds & self._kinds}
        self._dropped: set[int] = set()  # of those, the ones the mirror's retention would delete at once
        self._trackers: dict[Kind, int | None] = dict.fromkeys(Kind)
        self._lock = threading.Lock()
        self._retried = 0
        self._uploaded_bytes = 0
        self._start_error: str | None = None
        self.retention_idle = asyncio.Event()  # no retention pass on the mirror running or due
        self.retention_idle.set()
        self._deleted: list[int] = []
        self._retention_errors: list[str] = []

    # -- what the monitor asks -----------------------------------------------------------------

    def mirrors(self, kind: Kind) -> bool:
        return kind in self._kinds

    def enqueue(self, step: int) -> None:
        """Upload ``step`` (just committed locally) when its turn comes."""
        self._dropped.discard(step)
        if step == self._current:
            self._again.add(step)
            return
        rec = self._uploads.get(step)
        if rec is None or rec.state != MirrorState.UPLOADING:
            self._uploads[step] = _Upload(step, attempts=rec.attempts if rec else 0)
        self._queue.add(step)
        self._retry_at.pop(step, None)
        self._wake.set()

    @property
    def fenced(self) -> str | None:
        """Why the mirror uploads nothing: a newer attempt on the root, found by an upload."""
        return self._fenced

    def lift_fence(self) -> None:
        """The newer attempt is gone (a ``start_monitor`` that lost a race took it back): upload
        what waits, the step that ran into the fence too."""
        self._fenced = None
        self._wake.set()

    def retry_now(self) -> None:
        """Try failed uploads again now instead of after ``retry_after_s``."""
        self._retry_at.clear()
        self._wake.set()

    def protected(self) -> set[int]:
        """Steps local retention must keep: not yet mirrored."""
        out = self._queue | set(self._startup_local)
        if self._current is not None:
            out.add(self._current)
        return out

    async def wait(self, step: int, timeout_s: float | None) -> dict:
        """Wait until ``step`` is on the mirror. ``{"mirrored": bool, "error": str | None}``;
        ``error`` is None on a timeout, and says why when the step will never be mirrored."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            rec = self._uploads.get(step)
            if rec is not None and rec.state == MirrorState.MIRRORED and step not in self._queue:
                return {"mirrored": True, "error": None}
            if rec is not None and rec.state == MirrorState.ABANDONED:
                return {"mirrored": False, "error": rec.error}
            if self._fenced is not None:
                return {"mirrored": False, "error": f"not mirrored: {self._fenced}"}
            if rec is None and step in self._dropped:
                return {"mirrored": False, "error": (
                    f"not mirrored: step {step} was committed while no monitor uploaded it, and the mirror holds "
                    f"newer steps that its retention (max_ckpt_to_keep, max_state_dict_to_keep, keep_every_n_steps) "
                    f"keeps instead: it stays on the local root only")}
            if rec is None and self._ready and step not in self._queue:
                if await self._io(is_committed, self.remote, step, self._step_kind):  # by an earlier monitor
                    return {"mirrored": True, "error": None}
            event = self._events.setdefault(step, asyncio.Event())
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return {"mirrored": False, "error": None}
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                return {"mirrored": False, "error": None}

    def status(self) -> MirrorStatus:
        with self._lock:
            retried, uploaded = self._retried, self._uploaded_bytes
        recent = sorted(self._uploads.values(), key=lambda r: r.step)[-_HISTORY:]
        return MirrorStatus(
            url=self.remote.url,
            trackers=Trackers(checkpoint=self._trackers[Kind.CHECKPOINT], state_dict=self._trackers[Kind.STATE_DICT]),
            queued=sorted(self._queue), uploading=self._current, steps=[r.to_status() for r in recent],
            retried_requests=retried, uploaded_bytes=uploaded, start_error=self._start_error,
            deleted_steps=list(self._deleted), retention_errors=list(self._retention_errors), fenced=self._fenced,
        )

    # -- the upload loop -----------------------------------------------------------------------

    async def run(self) -> None:
        """Read the mirror's state, queue what it lacks, then upload steps as they come."""
        delay = self._opts.retry_backoff_s
        while True:
            try:
                self._trackers = await self._io(self._read_remote_trackers)
                missing, self._dropped = await self._io(self._missing_on_mirror)
                break
            except Exception as e:  # the mirror is unreachable: keep the local steps, try again
                self._start_error = f"{type(e).__name__}: {e}"
                log.warning("cannot read the mirror %s (%s); retrying", self.remote.url, self._start_error)
                self._metrics.inc(RETRIED_REQUESTS, request="mirror")
                await asyncio.sleep(min(delay, _MAX_BACKOFF_S))
                delay *= 2
        self._start_error = None
        for step in missing:
            self.enqueue(step)
        self._startup_local = {}
        self._ready = True
        self._release_all_waiters()  # a wait begun before may be on a step the mirror holds already
        self._on_change()
        while True:
            step = self._next_due() if self._fenced is None else None  # fenced: until lifted
            if step is None:
                self._wake.clear()
                due = None if self._fenced is not None else min(self._retry_at.values(), default=None)
                try:
                    await asyncio.wait_for(self._wake.wait(), None if due is None else max(0.0, due - time.monotonic()))
                except asyncio.TimeoutError:
                    pass
                continue
            await self._upload(step)

    def _next_due(self) -> int | None:
        now = time.monotonic()
        due = [s for s in self._queue if self._retry_at.get(s, 0.0) <= now]
        return min(due, default=None)

    async def _upload(self, step: int) -> None:
        rec = self._uploads.setdefault(step, _Upload(step))
        rec.state, rec.error, rec.bytes = MirrorState.UPLOADING, None, 0
        rec.attempts += 1
        self._current = step
        self._queue.discard(step)
        started = time.time()
        try:
            await self._io(self._check_fence)  # and again before the manifests
            name, manifests, files = await self._io(self._read_local, step)
            results = await asyncio.gather(
                *(self._io(self._copy_file, name, rel, entry, rec) for rel, entry in sorted(files.items())),
                return_exceptions=True,
            )  # every copy has ended before the next attempt could start on the same objects
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise next((e for e in errors if isinstance(e, LocalCopyError)), errors[0])
            await self._io(failpoints.hit, "before_mirror_manifest")
            await self._io(self._check_fence)
            manifests = await self._io(self._still_local, step, name, manifests)
            for kind, data in manifests.items():  # the manifest makes the step committed on the mirror
                await self._io(self._retrying, f"manifest of step {step}", self._publish,
                               self.remote.join(name, MANIFESTS[kind]), data,
                               partial(self._still_local, step, name, {kind: data}))
            await self._advance_trackers(step, set(manifests))
        except FencedError as e:
            # Uploaded again if the fence is lifted (lift_fence); meanwhile waits say why not.
            rec.state, rec.error = MirrorState.FAILED, f"not mirrored: {e}"
            log.error("step %d: %s", step, rec.error)
            self._fenced = str(e)
            self._queue.add(step)
            self._release_all_waiters()
        except LocalCopyError as e:
            rec.state, rec.error = MirrorState.ABANDONED, f"not mirrored: {e}"
            log.error("step %d: %s", step, rec.error)
            self._release_waiters(step)
        except Exception as e:
            rec.state, rec.error = MirrorState.FAILED, f"{type(e).__name__}: {e}"
            self._queue.add(step)
            self._retry_at[step] = time.monotonic() + self._opts.retry_after_s
            log.warning("upload of step %d to %s failed (attempt %d): %s; trying again in %.0f s", step,
                        self.remote.url, rec.attempts, rec.error, self._opts.retry_after_s)
        else:
            rec.state, rec.finished_at = MirrorState.MIRRORED, time.time()
            log.info("step %d mirrored to %s (%d bytes)", step, self.remote.url, rec.bytes)
            self._current = None
            if step in self._again:  # another manifest of the step committed meanwhile: go again
                self._again.discard(step)
                self.enqueue(step)
            self._on_change()  # local retention may delete it now; scheduled before waiters wake
            self.retention_idle.clear()
            if step not in self._queue:
                self._release_waiters(step)
            try:
                await self._remote_retention()
            finally:
                self.retention_idle.set()
        finally:
            self._current = None
            if step in self._again:
                self._again.discard(step)
                self.enqueue(step)
            if self._on_upload is not None:
                self._on_upload(step, started, rec.finished_at or time.time(),
                                None if rec.state == MirrorState.MIRRORED else rec.error or rec.state.value,
                                f"{rec.bytes} bytes, attempt {rec.attempts}")

    def _release_all_waiters(self) -> None:
        for step in list(self._events):
            self._release_waiters(step)

    def _release_waiters(self, step: int) -> None:
        event = self._events.pop(step, None)
        if event is not None:
            event.set()

    async def _advance_trackers(self, step: int, kinds: set[Kind]) -> None:
        # As on the local root: a full checkpoint holds the weights, so it advances both.
        advance = {Kind.CHECKPOINT, Kind.STATE_DICT} if Kind.CHECKPOINT in kinds else {Kind.STATE_DICT}
        for kind in sorted(advance, key=lambda k: k.value):
            current = self._trackers[kind]
            if current is not None and step <= current:
                continue
            await self._io(self._retrying, f"{kind.value} tracker", self._publish,
                           self.remote.join(TRACKERS[kind]), f"{step}\n".encode())
            self._trackers[kind] = step

    def _tracked(self) -> set[int]:
        """The steps the mirror's trackers point at."""
        return {s for s in self._trackers.values() if s is not None}

    async def _io(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    # -- in the mirror's threads ---------------------------------------------------------------

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
            while chunk := fin.read(_CHUNK):
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
                delay = min(self._opts.retry_backoff_s * 2**attempt, _MAX_BACKOFF_S)
                with self._lock:
                    self._retried += 1
                self._metrics.inc(RETRIED_REQUESTS, request="mirror")
                log.warning("%s failed (%s: %s); retry %d of %d in %.2f s", what, type(e).__name__, e,
                            attempt + 1, self._opts.retries, delay)
                time.sleep(delay)  # backoff between requests, in the mirror's own thread

    # -- retention on the mirror ---------------------------------------------------------------

    async def _remote_retention(self) -> None:
        protected = self.protected() | self._tracked()
        try:
            result = await self._io(self._retention_pass, protected)
            self._deleted = (self._deleted + result.deleted)[-1000:]
            self._metrics.inc(RETENTION_DELETIONS, len(result.deleted), tier="mirror")
            self._retention_errors = result.errors
        except Exception as e:  # best-effort: the next mirrored step runs another pass
            log.warning("retention on the mirror failed: %s: %s", type(e).__name__, e)
            self._retention_errors = [f"{type(e).__name__}: {e}"]

    def _retention_pass(self, protected: set[int]):
        self._check_fence()
        entries = scan_steps(self.remote, self._template)
        # The mirror's only writer is this monitor: a step directory there without a manifest
        # that is not being uploaded is what a killed upload left, and can go at once.
        leftovers = {s for s, e in entries.items() if not e.committed} - protected
        plan = plan_retention(entries, self._policy, protected=protected, failed=leftovers)
        return run_plan(self.remote, plan, grace_s=0.0, fence=self._check_fence)
