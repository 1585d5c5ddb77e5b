"""What every scenario shares: the state to save, timing, and the result records."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ckptd.storage import Storage

MiB = 1 << 20


def connect_ray() -> bool:
    """Join the cluster ``RAY_ADDRESS`` names (the test suite passes its own: no second start-up),
    or start a local one with 2 CPUs; True if this call started or joined it."""
    import ray  # here, so the GPU scenario (bench.gpu) runs where Ray is not installed

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return True


def one_rank_group(backend: str = "gloo") -> None:
    """A process group of this process alone (DCP needs one), on an in-process store: no TCP
    port, since a free port picked, closed and bound again can be taken in between by another
    process of a busy machine (EADDRINUSE on one loaded run)."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def make_state(nbytes: int, tensors: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 tensors totalling ``nbytes``, like a model's parameters."""
    g = torch.Generator().manual_seed(seed)
    per = max(1, nbytes // 4 // tensors)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def state_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and the directories, as a durable save must."""
    storage = Storage(path)
    storage.make_durable([storage.join(rel) for rel in storage.walk_files(storage.root)])


@dataclass
class Row:
    """One measured method of one scenario: every repetition, summarised by the median."""

    scenario: str
    method: str
    unit: str
    samples: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "method": self.method, "unit": self.unit,
                "median": self.median, "min": min(self.samples), "max": max(self.samples),
                "samples": self.samples, "note": self.note}


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def busy_compute(seconds: float, size: int = 256) -> None:
    """Stand-in for forward and backward: matrix products on the training thread."""
    a = torch.randn(size, size)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)
