"""The demo job: two training-worker actors saving through ckptd while they train.

Every step each worker publishes its weights (a state-dict save, as an RL trainer does for its
rollout workers); every few steps it also saves a full checkpoint (weights and optimizer). The
driver registers each step's units; the monitor commits a step when all of them have finished.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import ray
import torch
from safetensors.torch import save_file

import ckptd
from ckptd.config import Kind
from ckptd.layout import is_committed
from ckptd.storage import Storage


@dataclass
class StepReport:
    step: int
    loss: float
    blocked_ms: float  # how long training waited for save_async (snapshot included)


class TrainWorker:
    """One data-parallel rank of a small MLP regression job (pure torch, CPU)."""

    def __init__(self, run: str, rank: int, root: str, seed: int = 0) -> None:
        torch.manual_seed(seed)  # same init on every rank, as data parallelism requires
        torch.set_num_threads(1)
        self.rank = rank
        self.root = root
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1000 + rank)
        self.x = torch.randn(512, 256, generator=gen)
        self.y = torch.sin(self.x)
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id=f"rank{rank}")
        self.save_seconds: list[float] = []

    def _background(self, out: str, fn):
        """The save function: everything but the snapshot runs in the save thread, timed."""
        def run():
            t0 = time.perf_counter()
            os.makedirs(out, exist_ok=True)
            fn()
            self.save_seconds.append(time.perf_counter() - t0)
        return run

    def train_step(self, step: int, full_checkpoint: bool) -> StepReport:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

        t0 = time.perf_counter()
        # Snapshot before training goes on: the optimizer changes these tensors in place.
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        out = ckptd.step_dir(self.root, step)
        self.coord.save_async(
            "weights",
            self._background(out, lambda: save_file(weights, f"{out}/model_rank{self.rank}.safetensors")),
            step, is_state_dict=True,
        )
        if full_checkpoint:
            state = {"optimizer": _clone(self.optimizer.state_dict()), "step": step}
            self.coord.save_async(
                "checkpoint",
                self._background(out, lambda: torch.save(state, f"{out}/optim_rank{self.rank}.pt")),
                step,
            )
        return StepReport(step, float(loss), (time.perf_counter() - t0) * 1000)

    def finish(self) -> list[float]:
        self.coord.wait_all()
        return self.save_seconds


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def run_demo(root: str, steps: int = 30, ckpt_every: int = 5, workers: int = 2) -> int:
    """Run the demo job; return the latest committed full checkpoint step."""
    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, workers), include_dashboard=False, log_to_driver=False)
    run = f"demo-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run)
    root = ray.get(monitor.worker_config.remote())["root"]
    actor = ray.remote(num_cpus=1)(TrainWorker)
    ranks = [actor.remote(run, r, root) for r in range(workers)]
    trainer = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")

    rows = []
    for step in range(1, steps + 1):
        full = step % ckpt_every == 0
        reports = ray.get([w.train_step.remote(step, full) for w in ranks])
        trainer.register(step, is_state_dict=not full, state_dict_thread_count=workers,
                         checkpoint_thread_count=workers if full else 0)
        rows.append((step, full, reports))
    save_seconds = [s for r in ray.get([w.finish.remote() for w in ranks]) for s in r]
    trainer.wait_committed(steps, is_state_dict=True, timeout_s=60)
    last_full = steps - steps % ckpt_every
    if last_full:
        trainer.wait_committed(last_full, timeout_s=60)
    storage = Storage(root)
    committed = {(step, k.value) for step, _, _ in rows for k in Kind if is_committed(storage, step, k)}

    print(f"{'step':>5} {'saved':<18} {'loss':>9} {'blocked ms (max of ranks)':>26} {'committed':>10}")
    for step, full, reports in rows:
        saved = "weights+checkpoint" if full else "weights"
        kinds = [k for k in ("state_dict", "checkpoint") if (step, k) in committed]
        done = "yes" if kinds and (not full or "checkpoint" in kinds) else "no"
        print(f"{step:>5} {saved:<18} {reports[0].loss:>9.5f} "
              f"{max(r.blocked_ms for r in reports):>26.2f} {done:>10}")
    blocked = [r.blocked_ms for _, _, reports in rows for r in reports]
    print()
    print(f"steps trained:              {steps} on {workers} workers")
    print(f"committed full checkpoints: {sum(1 for _, k in committed if k == 'checkpoint')} "
          f"(every {ckpt_every} steps); committed state dicts: "
          f"{sum(1 for _, k in committed if k == 'state_dict')}")
    print(f"training blocked per save:  median {statistics.median(blocked):.2f} ms, "
          f"max {max(blocked):.2f} ms")
    print(f"background save duration:   median {statistics.median(save_seconds) * 1000:.1f} ms, "
          f"max {max(save_seconds) * 1000:.1f} ms ({len(save_seconds)} saves)")
    latest = ckptd.latest_step(root)
    print(f"latest checkpoint:          {latest} -> {ckptd.step_dir(root, latest) if latest is not None else '-'}")
    print(f"latest state dict:          {ckptd.latest_step(root, 'state_dict')}")
    print(f"wall time:                  {time.perf_counter() - started:.1f} s")
    ray.kill(monitor, no_restart=True)
    return latest
