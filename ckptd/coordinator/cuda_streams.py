"""The CUDA streams staging copies run on: private to ckptd, one per GPU and per thread that
issues copies, and never synchronized with the default stream.

PyTorch's ``torch.cuda.Stream()`` hands out one of a small pool of streams in rotation, so in a
job with many streams (NCCL groups, FSDP) it can be the very stream the training loop or a
collective runs on, and the copies would queue behind work queued after the save. A stream
made here with ``cudaStreamCreateWithFlags(cudaStreamNonBlocking)``, through the CUDA runtime
PyTorch has loaded, is ckptd's alone. Where that runtime cannot be reached, a pool stream is used
(correct, but it may be shared) and a warning says so once.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import torch

_log = logging.getLogger(__name__)
_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit ordering with the legacy default stream
_local = threading.local()
_runtime_lock = threading.Lock()
_runtime: list[Any] = []  # [the ctypes handle of PyTorch's CUDA runtime, or None], once looked up


def record_current(devices: set[int]) -> dict[int, torch.cuda.Event]:
    """An event on the calling thread's current stream of each GPU in ``devices``: the copies of a
    save wait for it, so they see what that stream had queued when the save was called, and wait
    for nothing queued later."""
    return {d: torch.cuda.current_stream(d).record_event() for d in devices}


def copy_stream(index: int, called: dict[int, torch.cuda.Event]) -> torch.cuda.Stream:
    """The calling thread's staging stream on GPU ``index``, made to wait for ``called[index]``
    (popped: the stream is ordered after it from then on)."""
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = _private_stream(index)
    event = called.pop(index, None)
    if event is not None:
        stream.wait_event(event)
    return stream


def landed_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event after the work queued on ``stream`` so far; waiting for it sleeps rather than
    spins a core (``blocking``)."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


def _private_stream(index: int) -> torch.cuda.Stream:
    cudart = _cuda_runtime()
    if cudart is not None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(index):
            err = cudart.cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(_NON_BLOCKING))
        if err == 0:
            # Never destroyed: one per thread that stages from this GPU, for the process's life.
            return torch.cuda.ExternalStream(handle.value, device=index)
        _log.warning("cudaStreamCreateWithFlags failed (CUDA error %d): staging copies use a stream of "
                     "PyTorch's pool, which other work may share", err)
    return torch.cuda.Stream(device=index)


def _cuda_runtime() -> Any:
    """PyTorch's own CUDA runtime library (found among the process's mapped files), or None."""
    with _runtime_lock:
        if not _runtime:
            _runtime.append(_find_runtime())
        return _runtime[0]


def _find_runtime() -> Any:
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line and "/" in line})
    except OSError:
        pass
    for name in [*paths, None]:  # None: the symbols the process has loaded globally
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaStreamCreateWithFlags
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        return lib
    _log.warning("PyTorch's CUDA runtime was not found: staging copies use a stream of PyTorch's pool, "
                 "which other work may share")
    return None
