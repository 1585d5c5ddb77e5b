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
from ckptd.fencing import FencedError
from ckptd.layout import MANIFESTS, TRACKERS, is_committed
from ckptd.metrics import RETENTION_DELETIONS, RETRIED_REQUESTS, RunMetrics
from ckptd.monitor.mirror_io import MAX_BACKOFF_S, LocalCopyError, MirrorIO
from ckptd.monitor.retention import RetentionPolicy
from ckptd.monitor.status import MirrorState, MirrorStatus, MirrorStepStatus, Trackers
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate
from ckptd.threads import lower_priority

log = logging.getLogger("ckptd.mirror")

_HISTORY = 100


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


class Mirror(MirrorIO):
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
                await asyncio.sleep(min(delay, MAX_BACKOFF_S))
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
