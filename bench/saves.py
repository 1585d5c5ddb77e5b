"""P1 (time training is blocked by a save) and P2 (time until the save is durable), side by side.

Every method saves the same state into a new directory of the same filesystem, and keeps its last
two saves as ckptd's retention does here (see :meth:`SaveHarness.retire`). Each target pair
(ckptd against its baseline) runs as interleaved pairs, order alternated (:mod:`bench.stats`),
after one warm-up save of each that is not counted (ckptd allocates its staging buffers then);
the other methods are context rows with fewer repetitions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import ckptd
from ckptd.commit import fsync_path
from ckptd.direct_io import direct_io_for
from ckptd.phases import COMMIT, NOTIFICATION, RECEIPT, TRACKERS, WRITE

from . import breakdown
from .common import MiB, Row, busy_compute, connect_ray, fsync_tree, one_rank_group, timed
from .stats import interleave
from .verdicts import Comparison

#: Saves each method keeps: the harness's monitors keep as many checkpoints (retention).
KEEP = 2


class SaveHarness:
    """Ray, a monitor, a coordinator and a one-rank gloo group (for DCP) around a scratch root."""

    def __init__(self, base_dir: str | None, label: str = "disk", **options) -> None:
        self.label = label
        self.base_dir = base_dir
        self.dir = tempfile.mkdtemp(prefix="ckptd-bench-", dir=base_dir)
        self.root = os.path.join(self.dir, "ckptd")
        connect_ray()
        self.monitor = ckptd.start_monitor(self.root, run=f"bench-{label}-{os.getpid()}", max_ckpt_to_keep=KEEP,
                                           max_state_dict_to_keep=KEEP, **options)
        self.coord = ckptd.CheckpointCoordinator(self.monitor, worker_id="bench")
        self.step = 0
        self._saves: dict[str, int] = {}
        if not dist.is_initialized():
            one_rank_group()

    def new_dir(self, name: str) -> str:
        """The path of a new directory (not created) for the next save of method ``name``."""
        n = self._saves[name] = self._saves.get(name, 0) + 1
        return os.path.join(self.dir, f"{name}-{n}")

    def retire(self, name: str) -> None:
        """After a save of ``name``: delete that method's saves older than its last :data:`KEEP`,
        as the monitor's retention does for ckptd's steps after each commit.

        Deleting the previous save just before writing the next one, as this harness once did,
        favoured the baseline: its file reused pages freed a moment earlier, while ckptd's went
        where the allocator put them. On a VM those can be pages the hypervisor has taken back
        (free page reporting), and the first write to each faults on the host: the same 1 GiB
        safetensors file on /dev/shm took 0.36 s, or 0.85 to 2.5 s.
        """
        n = self._saves.get(name, 0)
        if n > KEEP:
            shutil.rmtree(os.path.join(self.dir, f"{name}-{n - KEEP}"), ignore_errors=True)

    def settle(self) -> None:
        """Let the clean-up of the last save end before the next one is timed: ckptd's retention
        pass, then a journal commit of the deletions (the harness directory's fsync), so no
        method's fsync pays for another's deletions, as none would with saves minutes apart."""
        if not ray.get(self.monitor.wait_retention.remote(timeout_s=600)):
            raise TimeoutError("the bench monitor's retention pass did not end within 600 s")
        fsync_path(self.dir)

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def commit(self, step: int, units: int = 1) -> None:
        self.coord.register(step, checkpoint_thread_count=units)
        self.coord.wait_all()
        self.coord.wait_committed(step, timeout_s=600)

    def ckptd_save(self, sd: dict[str, torch.Tensor], name: str, fenced: bool = False,
                   saved: list[int] | None = None) -> int:
        """One staged save of ``sd``, committed; returns its step (appended to ``saved``)."""
        step = self.next_step()
        self.coord.save_state_async(name, sd, step, fenced=fenced)
        if fenced:
            self.coord.before_update()
        self.commit(step)
        if saved is not None:
            saved.append(step)
        return step

    def close(self, *, keep_group: bool = False) -> None:
        self.coord.close()
        ray.kill(self.monitor, no_restart=True)
        if dist.is_initialized() and not keep_group:
            dist.destroy_process_group()
        shutil.rmtree(self.dir, ignore_errors=True)


def p1_blocked(h: SaveHarness, sd: dict[str, torch.Tensor], pairs: int, context_reps: int,
               ) -> tuple[list[Row], list[Comparison], list[breakdown.Breakdown]]:
    """The training thread's blocked time: ckptd eager and fenced, each paired with memcpy."""
    mib = sum(t.numel() * t.element_size() for t in sd.values()) / MiB
    bufs = {k: torch.empty_like(v) for k, v in sd.items()}

    def memcpy() -> float:
        return timed(lambda: [bufs[k].copy_(v) for k, v in sd.items()])

    memcpy()
    compute_s = 2 * sorted(memcpy() for _ in range(3))[1]
    noise = "the copy's memory bandwidth is shared with everything else on the machine"
    rows: list[Row] = []
    comparisons: list[Comparison] = []
    phases: list[breakdown.Breakdown] = []
    for fenced, method in ((False, "ckptd eager staging"), (True, "ckptd fenced staging")):
        saved: list[int] = []

        def ckptd_blocked(fenced: bool = fenced, saved: list[int] = saved) -> float:
            step = h.next_step()
            blocked = timed(lambda: h.coord.save_state_async("p1", sd, step, fenced=fenced))
            if fenced:
                busy_compute(compute_s)  # forward and backward: the copy runs meanwhile
                blocked += timed(h.coord.before_update)
            h.commit(step)
            h.settle()
            saved.append(step)
            return blocked

        ckptd_blocked()  # warm-up: allocates the staging buffers
        saved.clear()
        a, b = interleave(ckptd_blocked, memcpy, pairs)
        ck = Row("P1 blocked", method, "s", a, f"{mib:.0f} MiB")
        base = Row("P1 blocked", f"memcpy into preallocated buffers (paired with {method.split()[1]})", "s", b,
                   "the limit")
        if fenced:
            ck.note += f", forward+backward stand-in of {compute_s * 1e3:.0f} ms (2x memcpy)"
        rows += [base, ck]
        name = "P1 fenced blocked / memcpy" if fenced else "P1 eager blocked / memcpy"
        comparisons.append(Comparison(name, ck, base, noise=noise))
        b = breakdown.Breakdown(f"P1 {method.split()[1]} {mib:.0f} MiB")
        breakdown.collect(h.monitor, saved, h.coord.worker_id, b)
        phases.append(b)

    dcp_row = Row("P1 blocked", "dcp.async_save", "s", note=f"context: {context_reps} reps")
    unstaged = Row("P1 blocked", "save_async(lambda: torch.save(sd)), no staging", "s",
                   note=f"context: {context_reps} reps; reads live tensors: torn if training goes on")
    for rep in range(context_reps + 1):
        path = h.new_dir("dcp-async")
        future = None

        def start(path=path):
            nonlocal future
            future = dcp.async_save(sd, checkpoint_id=path)

        blocked = timed(start)
        future.result()
        h.retire("dcp-async")
        if rep:
            dcp_row.samples.append(blocked)
    for rep in range(context_reps + 1):
        step = h.next_step()
        out = h.coord.step_dir(step)

        def save(out=out):
            os.makedirs(out, exist_ok=True)
            torch.save(sd, f"{out}/model.pt")
            return [f"{out}/model.pt"]

        blocked = timed(lambda: h.coord.save_async("p1-unstaged", save, step))  # noqa: B023
        h.commit(step)
        if rep:
            unstaged.samples.append(blocked)
    rows += [r for r in (dcp_row, unstaged) if r.samples]
    return rows, comparisons, phases


def p2_durable(h: SaveHarness, sd: dict[str, torch.Tensor], pairs: int, context_reps: int,
               ) -> tuple[list[Row], list[Comparison], breakdown.Breakdown]:
    """Time until durable: ckptd paired with safetensors.save_file + fsync; other methods as context."""
    mib = round(sum(t.numel() * t.element_size() for t in sd.values()) / MiB)
    scenario = f"P2 durable ({h.label}, {mib} MiB)"
    saved: list[int] = []

    def ckptd_save() -> float:
        seconds = timed(lambda: h.ckptd_save(sd, "p2", fenced=True, saved=saved))
        h.settle()
        return seconds

    def ckptd_eager() -> float:
        seconds = timed(lambda: h.ckptd_save(sd, "p2-eager"))
        h.settle()
        return seconds

    def baseline(name: str, write: Callable[[str], object]) -> Callable[[], float]:
        """A method that writes into the directory it is given: timed without the deletion of
        its old saves, as ckptd's retention runs after the commit."""
        def run() -> float:
            seconds = timed(partial(write, h.new_dir(name)))
            h.retire(name)
            h.settle()
            return seconds

        return run

    def safetensors_write(path: str) -> None:
        os.makedirs(path)
        save_file(sd, f"{path}/model.safetensors")
        fsync_tree(path)

    def torch_write(path: str) -> None:
        os.makedirs(path)
        torch.save(sd, f"{path}/model.pt")
        fsync_tree(path)

    safetensors_save = baseline("st", safetensors_write)
    # ckptd's default (direct_io="auto") writes a file this large with O_DIRECT on ext4 and xfs:
    # then a context row shows the same save through the page cache, from a second monitor.
    direct = direct_io_for("auto", os.path.join(h.root, "model.safetensors"), mib * MiB)
    buffered = SaveHarness(h.base_dir, f"{h.label}-buffered", direct_io="off") if direct and context_reps else None

    def ckptd_buffered() -> float:
        seconds = timed(lambda: buffered.ckptd_save(sd, "p2-buffered", fenced=True))
        buffered.settle()
        return seconds

    ckptd_save(), safetensors_save()  # warm-up
    saved.clear()
    a, b = interleave(ckptd_save, safetensors_save, pairs)
    how = "O_DIRECT" if direct else "through the page cache"
    ck = Row(scenario, f"ckptd fenced (copy streamed into the write, {how}, fsynced, committed)", "s", a)
    st = Row(scenario, "safetensors.save_file + fsync", "s", b)
    rows = [ck, st]
    context = {"ckptd eager (the copy, then the write)": ckptd_eager,
               "torch.save + fsync": baseline("pt", torch_write),
               "dcp.save": baseline("dcp", lambda path: dcp.save(sd, checkpoint_id=path)),
               "dcp.async_save (until done)": baseline(
                   "dcp-async", lambda path: dcp.async_save(sd, checkpoint_id=path).result())}
    if buffered is not None:
        ckptd_buffered()  # warm-up: its staging buffers
        context = {"ckptd fenced, through the page cache (direct_io='off')": ckptd_buffered, **context}
    for method, fn in context.items():
        row = Row(scenario, method, "s", note=f"context: {context_reps} reps")
        row.samples = [fn() for _ in range(context_reps)]
        if row.samples:
            rows.append(row)
    if buffered is not None:
        buffered.close(keep_group=True)
    noise = ("disk writeback noise; the RAM run isolates ckptd's overhead" if h.label == "disk"
             else "CPU and memory-bandwidth noise of a shared machine, and on a VM the first writes to "
                  "memory the hypervisor took back")
    phases = breakdown.Breakdown(f"P2 {h.label} {mib} MiB")
    breakdown.collect(h.monitor, saved, h.coord.worker_id, phases)
    protocol = sum(phases.median_ms(p) for p in (breakdown.ADMISSION, RECEIPT, NOTIFICATION, COMMIT, TRACKERS))
    detail = (f"ckptd's write phase took {phases.median_ms(WRITE):.3g} ms (median) against "
              f"{st.median * 1000:.3g} ms for safetensors' whole save, and its admission, receipt, notification, "
              f"commit and trackers {protocol:.3g} ms more (admission {phases.median_ms(breakdown.ADMISSION):.3g} "
              "ms: the unit's round trip to the monitor before it writes)") if phases.steps else ""
    comparison = Comparison(f"P2 ckptd durable / safetensors+fsync ({h.label}, {mib} MiB)", ck, st, noise=noise,
                            detail=detail)
    return rows, [comparison], phases
