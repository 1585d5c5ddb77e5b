"""A staging copy: one state's tensors copied into one buffer set, chunk by chunk, with its
progress published so a write can stream behind it, and shared between the staging thread
(from the front) and a thread waiting at the fence (from the back).

GPU sources are copied on a stream private to ckptd (:mod:`ckptd.coordinator.cuda_streams`),
with asynchronous device-to-host copies into pinned buffers: the copy is ordered after the work
the caller's stream had queued when the save was called (an event), overlaps whatever the
training loop queues next, and each tensor is published as staged when its own copy has landed
(an event per tensor), never by synchronizing the device.

Measured on the 2-core development VM (768 MiB in 16 MiB tensors, fenced, the fence called right
after the save call or after a 14 ms GIL-bound step): the fence waited 29 and 18 ms with the
waiting thread copying, against 59 and 36 ms without (docs/benchmarks.md).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ckptd import failpoints
from ckptd.coordinator import cuda_streams
from ckptd.errors import CheckpointError

if TYPE_CHECKING:
    from ckptd.coordinator.staging import BufferSet

_CHUNK = 16 << 20  # fenced copies publish their progress every this many bytes


class StagedCopy:
    """One state copied into one buffer set, leaf by leaf and in chunks of large leaves.

    Progress is published as the copy goes, so a writer can stream each chunk out as soon as it
    is staged (:meth:`wait_staged`) instead of waiting for the whole copy (:meth:`wait`). The
    chunks are claimed from the front by :meth:`run` (the staging thread) and from the back by
    :meth:`help` (a thread that would otherwise wait for the copy: the training thread at the
    fence), so the streamed front is never held back by the helper.
    """

    def __init__(self, leaves: list[torch.Tensor], buf: BufferSet) -> None:
        self._pairs = list(zip(leaves, buf.tensors, strict=True))
        self._index = {id(t): i for i, t in enumerate(buf.tensors)}
        self._cuda = any(src.device.type == "cuda" for src, _ in self._pairs)
        # (leaf, start, stop) in elements of the flattened leaf; stop < 0: the whole leaf at once.
        self._chunks: list[tuple[int, int, int]] = []
        self._first: list[int] = []  # each leaf's first chunk, and one past the last leaf's
        self._chunk_bytes: list[int] = []  # bytes per chunk of each leaf
        for i, (src, dst) in enumerate(self._pairs):
            self._first.append(len(self._chunks))
            step = max(1, _CHUNK // max(1, dst.element_size()))
            n = dst.numel()
            if self._cuda or not src.is_contiguous() or n <= step:
                self._chunks.append((i, 0, -1))
                self._chunk_bytes.append(max(1, n * dst.element_size()))
            else:
                self._chunks += [(i, a, min(a + step, n)) for a in range(0, n, step)]
                self._chunk_bytes.append(step * dst.element_size())
        self._first.append(len(self._chunks))
        # The work each GPU's stream had queued when the save was called: the copies wait for it
        # (the tensors are as that work leaves them), and for nothing queued later.
        self._called = (cuda_streams.record_current({src.device.index for src, _ in self._pairs
                                                     if src.device.type == "cuda"}) if self._cuda else {})
        self._front, self._back = 0, len(self._chunks)  # the chunks not claimed yet: [front, back)
        if self._cuda:
            self._back = 0  # a GPU copy is issued by run() alone; help() has nothing to claim
        self._done = [False] * len(self._chunks)
        self._prefix = 0  # chunks copied from the start, with none missing
        self._busy = 0  # chunks being copied now
        self._cond = threading.Condition()
        self._ended = False
        self.error: BaseException | None = None
        self.seconds = 0.0  # how long the copy took (for the save's phase timings)
        self.helped_bytes = 0  # bytes copied by :meth:`help`

    def run(self) -> None:
        """Copy the state (on the staging thread, or on the caller's for an eager copy)."""
        t0 = time.perf_counter()
        try:
            if self._cuda:
                self._copy_from_gpu()
            else:
                self._work(front=True)
        except BaseException as e:  # surfaced by the save unit, which fails the step
            self._fail(e)
        finally:
            with self._cond:
                while self._busy:  # chunks a helper still copies
                    self._cond.wait()
                self.seconds = time.perf_counter() - t0
                self._pairs = []  # nothing can be claimed any more: every chunk was, or the copy failed
                self._ended = True
                self._cond.notify_all()

    def _copy_from_gpu(self) -> None:
        """Issue every copy on this thread's staging stream of its GPU, then publish each tensor in
        order as its copy lands. The sources stay referenced (``_pairs``) until then, so the
        caching allocator cannot hand their memory to other work while a copy still reads it;
        however this ends (an error, an interrupt), it ends only once no copy writes into the
        buffers any more, since they are handed back after it."""
        landed: list[tuple[int, Any]] = []  # (leaf, event or None for a host source copied at once)
        try:
            with torch.no_grad():
                for i, (src, dst) in enumerate(self._pairs):
                    if src.device.type != "cuda":
                        dst.copy_(src.detach())
                        landed.append((i, None))
                        continue
                    stream = cuda_streams.copy_stream(src.device.index, self._called)
                    with torch.cuda.stream(stream):
                        dst.copy_(src.detach(), non_blocking=True)
                    landed.append((i, cuda_streams.landed_event(stream)))
            for i, event in landed:
                if event is not None:
                    event.synchronize()  # sleeps, without the GIL, while the copy engine works
                with self._cond:
                    self._done[self._first[i]] = True
                    while self._prefix < len(self._done) and self._done[self._prefix]:
                        self._prefix += 1
                    self._cond.notify_all()
        except BaseException:
            for _, event in landed:
                if event is not None:
                    event.synchronize()
            raise

    def help(self) -> int:
        """Copy chunks from the end until none is left to claim; the bytes copied here. A copy
        error is kept for the save (which then fails), as on the staging thread; an interrupt
        (KeyboardInterrupt) is kept and raised."""
        if self._cuda:
            return 0
        try:
            copied = self._work(front=False)
        except Exception as e:  # noqa: BLE001 - the save unit surfaces it and fails the step
            self._fail(e)
            return 0
        except BaseException as e:
            self._fail(e)
            raise
        with self._cond:
            self.helped_bytes += copied
        return copied

    def _work(self, front: bool) -> int:
        copied = 0
        with torch.no_grad():
            while True:
                with self._cond:
                    if self.error is not None or self._front >= self._back:
                        return copied
                    if front:
                        idx, self._front = self._front, self._front + 1
                    else:
                        self._back -= 1
                        idx = self._back
                    self._busy += 1
                try:
                    copied += self._copy_chunk(idx)
                except BaseException as e:
                    # The error first, in the same hold of the lock: run() may be waiting for this
                    # chunk, and must not see it handed back without the error (a failed copy
                    # would read as a finished one).
                    with self._cond:
                        if self.error is None:
                            self.error = e
                        self._busy -= 1
                        self._cond.notify_all()
                    raise
                with self._cond:
                    self._busy -= 1
                    self._done[idx] = True
                    while self._prefix < len(self._done) and self._done[self._prefix]:
                        self._prefix += 1
                    self._cond.notify_all()

    def _copy_chunk(self, idx: int) -> int:
        i, start, stop = self._chunks[idx]
        src, dst = self._pairs[i]
        if stop < 0:
            dst.copy_(src.detach())
            return dst.numel() * dst.element_size()
        dst.view(-1)[start:stop].copy_(src.detach().view(-1)[start:stop])
        failpoints.hit("staging_chunk")
        return (stop - start) * dst.element_size()

    def abandon(self, e: BaseException) -> None:
        """Fail the copy with ``e`` unless it has ended: its fence was left early (``e``, an
        interrupt), so the sources may change under the chunks still being copied."""
        with self._cond:
            if not self._ended and self.error is None:
                self.error = e
            self._cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = e
            self._cond.notify_all()

    def join(self) -> None:
        """Wait for the copy to end, however it ended."""
        with self._cond:
            while not self._ended:
                self._cond.wait()

    def wait(self) -> None:
        """Wait for the copy to end; raise if it failed."""
        self.join()
        self._raise_error()

    def wait_staged(self, buffer: torch.Tensor, nbytes: int) -> None:
        """Wait until the first ``nbytes`` of ``buffer`` (one of the buffer set's tensors) are
        staged; a tensor that is not one of them waits for the whole copy. Raise if the copy
        failed."""
        i = self._index.get(id(buffer))
        if i is None:
            self.wait()
            return
        chunks = self._first[i + 1] - self._first[i]
        need = self._first[i] + min(chunks, -(-nbytes // self._chunk_bytes[i]))
        with self._cond:
            while not self._ended and self.error is None and self._prefix < need:
                self._cond.wait()
        self._raise_error()

    def _raise_error(self) -> None:
        if self.error is not None:
            err = self.error
            raise CheckpointError(f"staging the state failed: {type(err).__name__}: {err}") from err
