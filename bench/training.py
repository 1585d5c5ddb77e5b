"""P3: what checkpointing costs a training loop, as alternating blocks of steps.

One process layout, two loops: blocks of ``steps`` steps without checkpointing (A) and with a
ckptd fenced checkpoint (model and AdamW state) every ``every`` steps (B), run ABBA..., each
block one sample (seconds per step). A B block checkpoints before steps 0, k, 2k, ...: every
save overlaps the k steps after it, as it would in a long run. The slowdown is
``(median B / median A - 1) * 100`` with a bootstrap interval over the pairs of blocks. Between
blocks the last save still running is waited for (not timed), so no block pays for the
previous one's save.

Two training stand-ins, with the same checkpointed state (``model_mib`` of weights + AdamW):

* ``matmul``: forward, backward and AdamW of an MLP on one torch thread: big kernels that release
  the GIL, so the save's threads compete for cores and memory bandwidth only;
* ``python``: a GIL-bound step, like an RL trainer's per-sample bookkeeping: thousands of tiny
  tensor ops and dict updates per step, then an in-place update of the weights. The save, checksum
  and notification threads hold the GIL in between their large releases, and this shows what that
  costs such a trainer.

The training thread's time inside ckptd calls (the save calls and the fence) is also measured,
so the table shows how much of the slowdown is waiting for staging and how much is contention;
so is its CPU time, which tells contention apart: a training thread that waits for the GIL (or
for a core) loses wall time but no CPU time, one slowed by the save's memory traffic or
interrupts spends more CPU on the same work.
A synchronous ``torch.save`` + fsync of the same state is a context row (fewer blocks).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

import ckptd

from . import breakdown
from .common import MiB, Row, fsync_tree
from .saves import SaveHarness
from .stats import bootstrap_ratio, interleave_rounds
from .verdicts import Comparison

VARIANTS = ("matmul", "python")


def _model(model_mib: int, width: int) -> torch.nn.Module:
    layers = max(1, model_mib * MiB // (width * width * 4))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def python_work(ops: int) -> float:
    """A GIL-bound training step: ``ops`` tiny tensor ops, each with a little Python bookkeeping."""
    acc = torch.zeros(8)
    stats: dict[int, float] = {}
    for i in range(ops):
        acc = acc + 1.0
        stats[i & 63] = stats.get(i & 63, 0.0) + i
    return float(acc[0]) + len(stats)


class BareCheckpoint:
    """The least a background checkpoint of the same state does, for P3's floor: the training
    thread's tensors copied into buffers allocated once (the optimizer waits for the copy, as
    for ckptd's fence), then written to one file and fsynced, on one thread. No checksum, no
    receipt, no monitor, no manifest: what is left is the copy's and the write's memory traffic
    and CPU, which any library that saves while training pays.

    Args:
        out_dir: Where the file goes (one file, overwritten by each save).
    """

    def __init__(self, out_dir: str) -> None:
        self.path = os.path.join(out_dir, "bare.bin")
        self._buffers: list[torch.Tensor] = []
        self._copied = threading.Event()
        self._copied.set()
        self._thread: threading.Thread | None = None

    def save(self, tensors: list[torch.Tensor]) -> None:
        """Start one save of ``tensors`` (the previous one must be done: :meth:`wait`)."""
        if not self._buffers:
            self._buffers = [torch.empty_like(t) for t in tensors]
        self._copied.clear()
        self._thread = threading.Thread(target=self._run, args=(tensors,), name="bare-checkpoint")
        self._thread.start()

    def _run(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for buf, t in zip(self._buffers, tensors, strict=True):
                buf.copy_(t)
        self._copied.set()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for buf in self._buffers:
                view = memoryview(buf.numpy()).cast("B")
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def fence(self) -> None:
        """Before the optimizer changes the tensors: the copy must be done."""
        self._copied.wait()

    def wait(self) -> None:
        """The last save is written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class _Loop:
    """The model, its optimizer and one training step of the chosen stand-in."""

    def __init__(self, h: SaveHarness, variant: str, model_mib: int, width: int, py_ops: int,
                 coord: ckptd.CheckpointCoordinator | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown P3 variant {variant!r}; use one of {VARIANTS}")
        torch.manual_seed(0)
        self.h, self.variant, self.py_ops = h, variant, py_ops
        self.coord = coord or h.coord
        self.model = _model(model_mib, width)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(16, width)
        self.first = next(self.model.parameters())
        self._matmul_step(lambda: None)  # allocates gradients and the optimizer's state
        self.nbytes = sum(p.numel() * 4 * 3 for p in self.model.parameters())  # weights + 2 AdamW moments
        self.bare = BareCheckpoint(h.dir)
        self.blocked = 0.0  # the training thread's time inside ckptd calls, this block
        self.cpu = 0.0  # the training thread's CPU time per step, this block

    def _matmul_step(self, fence: Callable[[], None]) -> None:
        loss = self.model(self.x).square().mean()
        self.opt.zero_grad()
        loss.backward()
        fence()
        self.opt.step()

    def _python_step(self, fence: Callable[[], None]) -> None:
        python_work(self.py_ops)
        fence()
        with torch.no_grad():
            self.first.add_(1e-6)  # the update the fence protects: the weights change in place

    def step(self, fence: Callable[[], None]) -> None:
        (self._matmul_step if self.variant == "matmul" else self._python_step)(fence)

    def _fence(self) -> None:
        t0 = time.perf_counter()
        self.coord.before_update()  # fenced copies of the last checkpoint must be done
        self.blocked += time.perf_counter() - t0

    def save_ckptd(self, step: int) -> None:
        """One P3 checkpoint: the model and the optimizer, fenced, registered in the background."""
        t0 = time.perf_counter()
        # Both with the default writer: each is staged as its safetensors file's image and written
        # from it (the optimizer's structure goes to optim.state.json beside it).
        self.coord.save_state_async("model", self.model.state_dict(), step, fenced=True)
        self.coord.save_state_async("optim", self.opt.state_dict(), step, fenced=True)
        self.coord.register(step, checkpoint_thread_count=2, wait=False)
        self.blocked += time.perf_counter() - t0

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor a checkpoint holds: the weights and the optimizer's state."""
        state = [t for per in self.opt.state_dict()["state"].values() for t in per.values()
                 if isinstance(t, torch.Tensor) and t.numel() > 1]
        return [p.detach() for p in self.model.parameters()] + state

    def _save_sync(self) -> None:
        path = self.h.new_dir("p3-sync")
        os.makedirs(path)
        torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, f"{path}/ckpt.pt")
        fsync_tree(path)
        self.h.retire("p3-sync")

    def block(self, mode: str, steps: int, every: int, saved: list[int] | None = None) -> float:
        """Run ``steps`` steps; return seconds per step. ``mode``: "none", "ckptd", "bare"
        (:class:`BareCheckpoint`) or "sync".

        Checkpoints are taken before steps 0, k, 2k, ... < ``steps``: each save overlaps the k
        steps after it inside the block, as in a loop that checkpoints every k steps for good,
        and no save is left for after the block.
        """
        self.blocked = 0.0
        fence = {"ckptd": self._fence, "bare": self.bare.fence}.get(mode, lambda: None)
        last = None
        t0, cpu0 = time.perf_counter(), time.thread_time()
        for i in range(steps):
            if mode != "none" and i % every == 0:
                if mode == "ckptd":
                    last = self.h.next_step()
                    self.save_ckptd(last)
                    if saved is not None:
                        saved.append(last)
                elif mode == "bare":
                    self.bare.wait()  # the save before, if the interval is shorter than a save
                    self.bare.save(self._tensors())
                else:
                    self._save_sync()
            self.step(fence)
        per_step = (time.perf_counter() - t0) / steps
        self.cpu = (time.thread_time() - cpu0) / steps
        if last is not None:  # not timed: the next block starts with no save in flight
            self.coord.wait_all()
            self.coord.wait_committed(last, timeout_s=600)
        self.bare.wait()
        return per_step


def p3_training(h: SaveHarness, variant: str, model_mib: int, steps: int, every: int, pairs: int,
                sync_blocks: int, width: int = 2048, py_ops: int = 6000,
                ) -> tuple[list[Row], list[Comparison], breakdown.Breakdown]:
    """Rows (seconds per step of each block), the slowdown comparison and ckptd's phases."""
    stand_in, _, writer = variant.partition("-")
    coord = (ckptd.CheckpointCoordinator(h.monitor, worker_id=f"bench-{variant}", writer=writer)
             if writer else None)
    try:
        return _p3(h, variant, _Loop(h, stand_in, model_mib, width, py_ops, coord), steps, every, pairs,
                   sync_blocks, py_ops)
    finally:
        if coord is not None:
            coord.close()


def _p3(h: SaveHarness, variant: str, loop: _Loop, steps: int, every: int, pairs: int, sync_blocks: int,
        py_ops: int) -> tuple[list[Row], list[Comparison], breakdown.Breakdown]:
    scenario = f"P3 training ({variant})"
    what = ("MLP forward+backward+AdamW, 1 torch thread" if loop.variant == "matmul"
            else f"GIL-bound step: {py_ops} tiny tensor ops + dict updates, in-place weight update")
    if loop.coord is not h.coord:
        what += "; writer='process' (the write, CRC-32 and fsync in a writer process)"
    note = (f"{loop.nbytes / MiB:.0f} MiB model + AdamW state, {what}; blocks of {steps} steps, "
            f"a full checkpoint every {every} steps ({-(-steps // every)} per block)")
    base, ck = Row(scenario, "no checkpointing", "s/step", note=note), Row(scenario, "ckptd (fenced staging)",
                                                                           "s/step", note=note)
    blocked = Row(scenario, "ckptd: training thread in ckptd calls", "s/step",
                  note="save calls and the fence, per step of the ckptd blocks")
    net = Row(scenario, "ckptd minus time in ckptd calls", "s/step",
              note="what is left of the slowdown is contention: CPU, memory bandwidth, the GIL")
    cpu_base = Row(scenario, "no checkpointing: training thread CPU time", "s/step",
                   note="time.thread_time() per step")
    cpu_ck = Row(scenario, "ckptd: training thread CPU time", "s/step",
                 note="above the baseline's: the same work made slower (memory traffic, interrupts); "
                      "wall time above CPU time and ckptd calls: waiting for the GIL or a core")
    phases = breakdown.Breakdown(f"P3 {variant}")
    saved: list[int] = []

    def run_ckptd() -> float:
        t = loop.block("ckptd", steps, every, saved)
        blocked.samples.append(loop.blocked / steps)
        net.samples.append(t - loop.blocked / steps)
        cpu_ck.samples.append(loop.cpu)
        return t

    def run_none() -> float:
        t = loop.block("none", steps, every)
        cpu_base.samples.append(loop.cpu)
        return t

    bare = Row(scenario, "bare background checkpoint (no ckptd)", "s/step",
               note="the floor: the same state copied into buffers (the update waits for the copy) and "
                    "written + fsynced to one file on a thread; no checksum, no protocol")
    loop.block("none", steps, every)  # warm-up of the loops (staging buffers are allocated here)
    loop.block("ckptd", steps, every)
    loop.block("bare", steps, every)
    a, b, c = interleave_rounds([run_ckptd, run_none, partial(loop.block, "bare", steps, every)], pairs)
    ck.samples, base.samples, bare.samples = a, b, c
    breakdown.collect(h.monitor, saved, loop.coord.worker_id, phases)
    lost = _lost_per_checkpoint(scenario, "training time lost per checkpoint", a, b, steps, every)
    bare_lost = _lost_per_checkpoint(scenario, "bare checkpoint: training time lost per checkpoint", c, b, steps,
                                     every)
    save_time = Row(scenario, "ckptd: save time of a checkpoint", "s", list(phases.durable),
                    note="from its first save call to its commit, as the monitor's timeline has them")
    rows = [base, ck, blocked, net, cpu_base, cpu_ck, lost, bare, bare_lost, save_time]
    if sync_blocks:
        sync = Row(scenario, "torch.save + fsync, synchronous", "s/step", note=f"context: {sync_blocks} blocks")
        sync.samples = [loop.block("sync", steps, every) for _ in range(sync_blocks)]
        rows.append(sync)
    noise = ("the save's threads and the training loop share 2 cores; more pairs or longer blocks "
             "narrow the interval")
    in_calls = blocked.median / base.median * 100
    cpu = (cpu_ck.median / cpu_base.median - 1) * 100
    floor = bootstrap_ratio(bare.samples, base.samples)
    over_floor = bootstrap_ratio(a, c)
    outside, condition = interval_condition(every * ck.median, save_time.samples)
    lead = "" if outside else f"{condition}; "  # an outside verdict's reason says it already
    detail = (f"{lead}of a step, the training thread spends {in_calls:.1f} % in ckptd calls (the save calls and "
              f"the fence, which waits for the part of the staging copy not done when the optimizer step comes) and "
              f"{cpu:+.1f} % in CPU time; the rest is waiting for the GIL or a core. The floor, a bare background "
              f"copy and write of the same state with nothing else, slows this loop {(floor.ratio - 1) * 100:+.1f} % "
              f"(interval {(floor.low - 1) * 100:+.1f} to {(floor.high - 1) * 100:+.1f} %), "
              f"{bare_lost.median * 1000:.0f} ms per checkpoint against ckptd's {lost.median * 1000:.0f} ms; "
              f"ckptd's blocks against the floor's: {(over_floor.ratio - 1) * 100:+.1f} % "
              f"(interval {(over_floor.low - 1) * 100:+.1f} to {(over_floor.high - 1) * 100:+.1f} %)")
    comparisons = [Comparison(f"P3 ckptd slowdown % ({variant})", ck, base, percent=True, noise=noise,
                              detail=detail, outside=outside)]
    return rows, comparisons, phases


def interval_condition(interval: float, save_times: list[float]) -> tuple[str, str]:
    """The P3 target holds "when the checkpoint interval is longer than the save time": (why this
    run is outside that condition, or ""; what the run had, for the verdict's reason)."""
    if not save_times:
        return "", f"a checkpoint every {interval:.2g} s of training (no save time was read back)"
    save = statistics.median(save_times)
    had = f"a checkpoint every {interval:.2g} s of training, each durable {save:.2g} s after its save call"
    if save >= interval:
        return (f"{had}: the interval is not longer than the save time (checkpoint less often: --py-every, "
                f"--ckpt-every)", had)
    return "", f"{had} (within the target's condition)"


def _lost_per_checkpoint(scenario: str, method: str, ckptd: list[float], base: list[float], steps: int,
                         every: int) -> Row:
    """Training time one checkpoint costs, pair by pair: what the slowdown becomes at another
    checkpoint interval (the bench checkpoints every few seconds of training, real runs every few
    minutes, and the cost of a save does not depend on the interval once saves do not overlap)."""
    saves = -(-steps // every)
    row = Row(scenario, method, "s", [
        (a - b) * steps / saves for a, b in zip(ckptd, base, strict=True)])
    interval = every * statistics.median(base)
    row.note = (f"(block with checkpoints - its paired baseline block) x {steps} steps / {saves} checkpoints; here a "
                f"checkpoint every {interval:.2g} s of training: at one a minute, {row.median / 60 * 100:.2g} % "
                f"of training time")
    return row
