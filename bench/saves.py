"""P1 (time training is blocked by a save) and P2 (time until the save is durable), side by side.

Every method saves the same state into a fresh directory of the same disk, once per repetition,
after one warm-up save that is not counted (ckptd allocates its staging buffers then).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import ckptd

from .common import Row, busy_compute, fsync_tree, timed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SaveHarness:
    """Ray, a monitor, a coordinator and a one-rank gloo group (for DCP) around a scratch root."""

    def __init__(self, base_dir: str | None) -> None:
        self.dir = tempfile.mkdtemp(prefix="ckptd-bench-", dir=base_dir)
        self.root = os.path.join(self.dir, "ckptd")
        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.monitor = ckptd.start_monitor(self.root, run=f"bench-{os.getpid()}", max_ckpt_to_keep=2,
                                           max_state_dict_to_keep=2)
        self.coord = ckptd.CheckpointCoordinator(self.monitor, worker_id="bench")
        self.step = 0
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
            dist.init_process_group("gloo", rank=0, world_size=1)

    def fresh(self, name: str) -> str:
        path = os.path.join(self.dir, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def commit(self, step: int, units: int = 1) -> None:
        self.coord.register(step, checkpoint_thread_count=units)
        self.coord.wait_all()
        self.coord.wait_committed(step, timeout_s=600)

    def close(self) -> None:
        self.coord.close()
        ray.kill(self.monitor, no_restart=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.dir, ignore_errors=True)


def p1_blocked(h: SaveHarness, sd: dict[str, torch.Tensor], reps: int) -> list[Row]:
    rows = {m: Row("P1 blocked", m, "s") for m in (
        "memcpy into preallocated buffers (limit)", "ckptd eager staging", "ckptd fenced staging",
        "dcp.async_save", "save_async(lambda: torch.save(sd)), no staging")}
    bufs = {k: torch.empty_like(v) for k, v in sd.items()}

    def memcpy() -> None:
        for k, v in sd.items():
            bufs[k].copy_(v)

    memcpy()
    for _ in range(reps):
        rows["memcpy into preallocated buffers (limit)"].samples.append(timed(memcpy))
    compute_s = 2 * rows["memcpy into preallocated buffers (limit)"].median
    rows["ckptd fenced staging"].note = f"forward+backward stand-in of {compute_s * 1e3:.0f} ms (2x memcpy)"
    rows["save_async(lambda: torch.save(sd)), no staging"].note = "reads live tensors: torn if training goes on"

    for fenced, method in ((False, "ckptd eager staging"), (True, "ckptd fenced staging")):
        for rep in range(reps + 1):  # the first save allocates the buffers: not counted
            step = h.next_step()
            blocked = timed(lambda: h.coord.save_state_async("p1", sd, step, fenced=fenced))  # noqa: B023
            if fenced:
                busy_compute(compute_s)
                blocked += timed(h.coord.before_update)
            h.commit(step)
            if rep:
                rows[method].samples.append(blocked)

    for rep in range(reps + 1):
        path = h.fresh("dcp-async")
        future = None

        def start(path=path):
            nonlocal future
            future = dcp.async_save(sd, checkpoint_id=path)

        blocked = timed(start)
        future.result()
        if rep:
            rows["dcp.async_save"].samples.append(blocked)

    for rep in range(reps + 1):
        step = h.next_step()
        out = h.coord.step_dir(step)

        def save(out=out):
            os.makedirs(out, exist_ok=True)
            torch.save(sd, f"{out}/model.pt")
            return [f"{out}/model.pt"]

        blocked = timed(lambda: h.coord.save_async("p1-unstaged", save, step))  # noqa: B023
        h.commit(step)
        if rep:
            rows["save_async(lambda: torch.save(sd)), no staging"].samples.append(blocked)
    return list(rows.values())


def p2_durable(h: SaveHarness, sd: dict[str, torch.Tensor], reps: int) -> list[Row]:
    rows = {m: Row("P2 durable", m, "s") for m in (
        "ckptd (staged, streamed, fsynced, committed)", "safetensors.save_file + fsync", "torch.save + fsync",
        "dcp.save", "dcp.async_save (until done)")}

    def ckptd_save() -> None:
        step = h.next_step()
        h.coord.save_state_async("p2", sd, step)
        h.commit(step)

    def safetensors_save() -> None:
        path = h.fresh("st")
        os.makedirs(path)
        save_file(sd, f"{path}/model.safetensors")
        fsync_tree(path)

    def torch_save() -> None:
        path = h.fresh("pt")
        os.makedirs(path)
        torch.save(sd, f"{path}/model.pt")
        fsync_tree(path)

    def dcp_save() -> None:
        dcp.save(sd, checkpoint_id=h.fresh("dcp"))

    def dcp_async() -> None:
        dcp.async_save(sd, checkpoint_id=h.fresh("dcp-async")).result()

    methods = dict(zip(rows, (ckptd_save, safetensors_save, torch_save, dcp_save, dcp_async), strict=True))
    for rep in range(reps + 1):
        for method, fn in methods.items():  # interleaved, so drift in the machine hits all alike
            t = timed(fn)
            if rep:
                rows[method].samples.append(t)
    return list(rows.values())
