"""Staging: copying a state's tensors into reusable host buffers so that training can go on.

A save that reads live tensors while the optimizer changes them in place writes a checkpoint
that mixes two steps. Staging copies them first, into host buffers that belong to the save's
name and are reused by its next save, so the steady state allocates nothing. Buffers are pinned
when the source tensors live on a GPU, so the device-to-host copy runs at full speed and can be
asynchronous.

Two ways to stage:

* eager: the copy runs on the training thread, which waits for it (bounded by memcpy speed);
* fenced: the copy runs on a staging thread while forward and backward go on, since parameters
  and optimizer state only change at the optimizer step. The training loop calls
  ``coord.before_update()`` before that step, which waits for whatever part of the copy is not
  done yet, copying that part itself alongside the staging thread
  (:mod:`ckptd.coordinator.staged_copy`).
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import weakref
from typing import Any

import torch

from ckptd.coordinator.staged_copy import StagedCopy
from ckptd.direct_io import ALIGN
from ckptd.threads import lower_priority
from ckptd.workers.dtensor import is_dtensor, local_tensor
from ckptd.workers.safetensors_io import SafetensorsPlan
from ckptd.workers.state_dict import map_tensors

_log = logging.getLogger(__name__)


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple, in :func:`map_tensors` order; of a DTensor, the
    block this rank holds (staging never gathers)."""
    found: list[torch.Tensor] = []
    map_tensors(state, lambda t: found.append(local_tensor(t) if is_dtensor(t) else t))
    return found


def rebuild(state: Any, tensors: list[torch.Tensor]) -> Any:
    """``state`` with its tensors replaced, in :func:`tensors_of` order, and other leaves copied.

    A DTensor becomes a DTensor over the staged host block with the original's mesh and
    placements, left on the host (``DTensor.from_local`` would move it back to the mesh's
    device); DCP's own stager builds its host copies the same way.
    """
    it = iter(tensors)

    def replace(t: torch.Tensor) -> torch.Tensor:
        staged = next(it)
        if not is_dtensor(t):
            return staged
        from torch.distributed.tensor import DTensor

        return DTensor(staged, t._spec, requires_grad=False)

    return map_tensors(state, replace, copy.deepcopy)


def _layout(leaves: list[torch.Tensor], plan: SafetensorsPlan | None = None) -> tuple:
    return (tuple((t.shape, t.dtype, t.device.type == "cuda") for t in leaves),
            plan.header if plan is not None else None)


_uids = itertools.count(1)


class BufferSet:
    """Host tensors shaped like one state's tensors: pinned for GPU sources, or in shared memory
    (``shared``) for a writer in another process, which then reads them without a copy (page-locked
    in place for GPU sources, so their copies are as fast as into pinned memory). ``uid``
    names the set for the life of the process (a writer process holds sets by it).

    With ``plan`` (the safetensors file the default writer will make of the state), CPU tensors
    are staged straight into the file's image: one page-aligned block of bytes that holds the
    header, with the tensors as views at their offsets (:attr:`image`), so the writer sends the
    file from it with no further copy. Without a plan, or where that layout does not fit the
    tensors (one that would start at an offset its dtype cannot be viewed at, or GPU sources,
    whose pinned buffers stay one per tensor), :attr:`image` is None and each tensor gets its own buffer.
    """

    def __init__(self, leaves: list[torch.Tensor], shared: bool = False, plan: SafetensorsPlan | None = None) -> None:
        self.uid = next(_uids)
        self.layout = _layout(leaves, plan)
        self.image: torch.Tensor | None = None
        if plan is not None and _image_fits(leaves, plan):
            self.image, self.tensors = _image(leaves, plan, shared)
        elif shared:
            self.tensors = [torch.empty(t.shape, dtype=t.dtype, device="cpu").share_memory_() for t in leaves]
            gpu = [(b, t.device.index) for b, t in zip(self.tensors, leaves, strict=True) if t.device.type == "cuda"]
            _page_lock(self, [b for b, _ in gpu], gpu[0][1] if gpu else 0)
        else:
            self.tensors = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
                for t in leaves
            ]
        self.nbytes = (self.image.numel() if self.image is not None
                       else sum(b.numel() * b.element_size() for b in self.tensors))

    @property
    def shared_tensors(self) -> list[torch.Tensor]:
        """What a writer process is sent: the tensors, then the image if there is one."""
        return self.tensors if self.image is None else [*self.tensors, self.image]


def _page_lock(owner: object, buffers: list[torch.Tensor], device: int) -> None:
    """Page-lock shared-memory ``buffers`` in place (``cudaHostRegister``), so copies from a GPU
    into them run as into pinned memory: asynchronous, at full speed. They are unregistered when
    ``owner`` goes. A buffer the driver will not register stays pageable: its copies are slower
    and synchronous, with the same bytes.

    The calls run on a thread of their own: CUDA keeps a failed call's error as the calling
    thread's last error, which PyTorch would report at that thread's next kernel launch. That
    thread first makes ``device`` (a GPU the sources are on) its current one: left at GPU 0, its
    first call would open a context there, on a GPU the process may not otherwise use."""
    if not buffers:
        return
    cudart = torch.cuda.cudart()

    def register() -> None:
        torch.cuda.set_device(device)
        for b in buffers:
            nbytes = b.numel() * b.element_size()
            if nbytes == 0:
                continue
            ptr = b.data_ptr()
            err = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
            if err != 0:
                _log.warning("could not page-lock a %d-byte staging buffer (CUDA error %d); copies into it "
                             "run from pageable memory, slower", nbytes, err)
                continue
            # Not at exit: the CUDA context may be gone by then, and the process's memory with it.
            weakref.finalize(owner, cudart.cudaHostUnregister, ptr).atexit = False

    t = threading.Thread(target=register, name="ckptd-page-lock")
    t.start()
    t.join()


def _image_fits(leaves: list[torch.Tensor], plan: SafetensorsPlan) -> bool:
    return len(leaves) == len(plan.spans) and all(
        t.device.type == "cpu" and offset % t.element_size() == 0 and n == t.numel() * t.element_size()
        for t, (offset, n) in zip(leaves, plan.spans, strict=True))


def _image(leaves: list[torch.Tensor], plan: SafetensorsPlan, shared: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A page-aligned block of ``plan.size`` bytes holding the header, and views of it shaped
    like ``leaves`` at their offsets."""
    block = torch.empty(plan.size + ALIGN, dtype=torch.uint8)
    if shared:
        block.share_memory_()  # mapped anew: align only after this
    pad = -block.data_ptr() % ALIGN
    image = block[pad : pad + plan.size]
    image[: len(plan.header)].copy_(torch.frombuffer(bytearray(plan.header), dtype=torch.uint8))
    views = [image[offset : offset + n].view(t.dtype).view(t.shape)
             for t, (offset, n) in zip(leaves, plan.spans, strict=True)]
    return image, views


class Stager:
    """The buffers of one save name: at most ``max_in_flight`` sets, reused in turn.

    :meth:`acquire` blocks while every set is held by a save still being written: that is the
    back-pressure that bounds staging memory to ``max_in_flight`` copies of the state.
    """

    def __init__(self, max_in_flight: int, shared: bool = False) -> None:
        self._max = max_in_flight
        self._shared = shared
        self._free: list[BufferSet] = []
        self._count = 0
        self._cond = threading.Condition()
        self.allocated_bytes = 0

    def acquire(self, leaves: list[torch.Tensor], plan: SafetensorsPlan | None = None) -> BufferSet:
        layout = _layout(leaves, plan)
        with self._cond:
            while True:
                for i, buf in enumerate(self._free):
                    if buf.layout == layout:
                        return self._free.pop(i)
                if self._free and self._count >= self._max:
                    # The state changed shape: drop an idle set of the old shape for a new one.
                    old = self._free.pop()
                    self._count -= 1
                    self.allocated_bytes -= old.nbytes
                if self._count < self._max:
                    self._count += 1
                    break
                self._cond.wait()
        try:
            buf = BufferSet(leaves, self._shared, plan)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise
        with self._cond:
            self.allocated_bytes += buf.nbytes
        return buf

    def release(self, buf: BufferSet) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class StagingThread:
    """Runs fenced copies one after another, off the training thread."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._queue: list[StagedCopy] = []
        self._running: StagedCopy | None = None
        self._since_fence = 0  # copies submitted since the last fence
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: StagedCopy) -> None:
        with self._cond:
            self._queue.append(job)
            self._since_fence += 1
            self._cond.notify_all()

    def fence(self) -> bool:
        """Wait until every submitted copy has finished; True if any was submitted since the
        last fence (whether or not it had finished already).

        The caller does not wait idle: it copies the chunks nobody has claimed yet, from the end
        of the last copy submitted backwards, while the staging thread goes on from the front.

        Left early (Ctrl-C raises ``KeyboardInterrupt`` here), the fence fails every copy that had
        not ended, and re-raises: the caller may go on and change the sources, so those saves
        cannot vouch for what they stage."""
        with self._cond:
            jobs = ([self._running] if self._running is not None else []) + self._queue
        try:
            for job in reversed(jobs):
                job.help()
            with self._cond:
                while self._queue or self._running is not None:
                    self._cond.wait()
                fenced, self._since_fence = self._since_fence > 0, 0
        except BaseException as e:
            for job in jobs:
                job.abandon(e)
            raise
        return fenced

    def _loop(self) -> None:
        lower_priority()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                self._running = self._queue.pop(0)
            try:
                self._running.run()
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()


class Snapshot:
    """A state being copied into a buffer set: ``state`` has the original's structure, with the
    buffers in place of its tensors. Its save calls :meth:`wait` before reading it and
    :meth:`release` when done; a save that never runs calls :meth:`abort` instead."""

    def __init__(self, state: Any, copy_job: StagedCopy, stager: Stager, buf: BufferSet) -> None:
        self.state = state
        self._copy, self._stager, self._buf = copy_job, stager, buf
        self._released = False
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Wait for the copy; raise CheckpointError if it failed."""
        self._copy.wait()

    def wait_staged(self, buffer: torch.Tensor, nbytes: int) -> None:
        """Wait until the first ``nbytes`` of ``buffer`` (a tensor of :attr:`state`) are staged,
        so a writer can stream the part copied so far; raise CheckpointError if the copy failed."""
        self._copy.wait_staged(buffer, nbytes)

    @property
    def buffers(self) -> BufferSet:
        """The buffer set the state is copied into."""
        return self._buf

    @property
    def helped_bytes(self) -> int:
        """Bytes of the copy made by a thread waiting at the fence rather than the staging thread."""
        return self._copy.helped_bytes

    @property
    def copy_seconds(self) -> float:
        """How long the copy took, wherever it ran (0 until it has ended)."""
        return self._copy.seconds

    def release(self) -> None:
        """Hand the buffers back for the next save of the name, once nothing copies into them
        (a streamed write that failed part-way leaves its copy running on the staging thread).
        Only the first call hands them back: twice would give one buffer set to two saves."""
        self._copy.join()
        with self._lock:
            if self._released:
                return
            self._released = True
        self._stager.release(self._buf)

    abort = release  # a save that never runs: the same, since the copy may still run


class StagingArea:
    """A coordinator's staging: the buffers of each save name, and one thread for fenced copies
    (started on the first one)."""

    def __init__(self, max_staged: int, thread_name: str, shared: bool = False) -> None:
        self._max_staged = max_staged
        self._shared = shared
        self._thread_name = thread_name
        self._stagers: dict[str, Stager] = {}
        self._thread: StagingThread | None = None
        self._lock = threading.Lock()

    def snapshot(self, name: str, state: Any, leaves: list[torch.Tensor], fenced: bool,
                 plan: SafetensorsPlan | None = None) -> Snapshot:
        """Copy ``leaves`` (the tensors of ``state``) into the buffers of ``name``: here, or on
        the staging thread when ``fenced`` (then :meth:`fence` waits for it). Blocks while
        ``max_staged`` snapshots of ``name`` are held. ``plan``: the safetensors file the state
        will be written as, to stage into its image (see :class:`BufferSet`).

        Raises:
            CheckpointError: an eager copy failed (the buffers are handed back).
        """
        with self._lock:
            stager = self._stagers.get(name)
            if stager is None:
                stager = self._stagers[name] = Stager(self._max_staged, self._shared)
        buf = stager.acquire(leaves, plan)
        started = False
        try:
            copy_job = StagedCopy(leaves, buf)  # inside: it records CUDA events, which can fail
            if fenced:
                self._staging_thread().submit(copy_job)
                started = True
            else:
                started = True
                copy_job.run()
                copy_job.wait()
            return Snapshot(rebuild(state, buf.tensors), copy_job, stager, buf)
        except BaseException:
            if started:
                copy_job.join()  # never hand back buffers the staging thread may still be filling
            stager.release(buf)
            raise

    def fence(self) -> bool:
        """Wait for every fenced copy; True if any was submitted since the last fence."""
        thread = self._thread
        return thread.fence() if thread is not None else False

    @property
    def allocated_bytes(self) -> int:
        with self._lock:
            return sum(s.allocated_bytes for s in self._stagers.values())

    def _staging_thread(self) -> StagingThread:
        with self._lock:
            if self._thread is None:
                self._thread = StagingThread(self._thread_name)
            return self._thread
