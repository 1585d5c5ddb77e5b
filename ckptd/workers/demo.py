"""The demo job: two training-worker actors saving through ckptd while they train.

Every step each rank publishes its shard of the weights (a state-dict save, as an RL trainer
does for its rollout workers); every few steps it also saves a full checkpoint (its optimizer
and RNG state, plus where training stands). The driver registers each step's units; the monitor
commits a step when all of them have finished and applies retention. At the end the driver
resumes a fresh model from the newest checkpoint and checks it against the trained one.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import ray
import torch

import ckptd
from ckptd.config import Kind
from ckptd.layout import scan_steps
from ckptd.storage import Storage
from ckptd.workers import capture_training_state, save_sharded, save_training_state, shard_dim0, snapshot

STEPS_PER_EPOCH = 10
MODEL_DIR = "model"


@dataclass
class StepReport:
    step: int
    loss: float
    blocked_ms: float  # how long training waited for save_async (snapshot included)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))


class TrainWorker:
    """One rank of a small MLP regression job (pure torch, CPU).

    Every rank trains the same replica on the same data, which is what data parallelism with
    all-reduced gradients amounts to, without the process group; each rank saves its own
    FSDP-style shard of it.
    """

    def __init__(self, run: str, rank: int, world_size: int, seed: int = 0) -> None:
        torch.manual_seed(seed)  # same init on every rank, as data parallelism requires
        torch.set_num_threads(1)
        self.rank, self.world_size = rank, world_size
        self.model = make_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1000)
        self.x = torch.randn(512, 256, generator=gen)
        self.y = torch.sin(self.x)
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id=f"rank{rank}")
        self.save_seconds: list[float] = []

    def _timed(self, fn):
        """The save function runs in the save thread; time it there."""
        def run():
            t0 = time.perf_counter()
            written = fn()
            self.save_seconds.append(time.perf_counter() - t0)
            return written
        return run

    def train_step(self, step: int, full_checkpoint: bool) -> StepReport:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

        t0 = time.perf_counter()
        # Snapshot before training goes on: the optimizer changes these tensors in place.
        shards = shard_dim0(snapshot(self.model.state_dict()), self.rank, self.world_size)
        out = self.coord.step_dir(step)
        self.coord.save_async(
            "weights",
            self._timed(lambda: save_sharded(f"{out}/{MODEL_DIR}", shards, rank=self.rank,
                                             world_size=self.world_size)),
            step, is_state_dict=True,
        )
        if full_checkpoint:
            state = capture_training_state(
                epoch=(step - 1) // STEPS_PER_EPOCH, step=step, step_in_epoch=(step - 1) % STEPS_PER_EPOCH + 1,
                steps_per_epoch=STEPS_PER_EPOCH, batch_size=len(self.x), rank=self.rank,
                world_size=self.world_size, optimizer=self.optimizer,
            )
            self.coord.save_async("train_state", self._timed(lambda: save_training_state(out, state)), step)
        return StepReport(step, float(loss), (time.perf_counter() - t0) * 1000)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def finish(self) -> list[float]:
        self.coord.wait_all()
        return self.save_seconds


def run_demo(root: str, steps: int = 30, ckpt_every: int = 5, workers: int = 2, keep: int = 2) -> int | None:
    """Run the demo job; return the latest committed full checkpoint step."""
    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, workers), include_dashboard=False, log_to_driver=False)
    run = f"demo-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run, max_ckpt_to_keep=keep, max_state_dict_to_keep=keep)
    root = ray.get(monitor.worker_config.remote())["root"]
    actor = ray.remote(num_cpus=1)(TrainWorker)
    ranks = [actor.remote(run, r, workers) for r in range(workers)]
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
    ray.get(monitor.wait_retention.remote(60))
    status = ray.get(monitor.status.remote())

    print(f"{'step':>5} {'saved':<18} {'loss':>9} {'blocked ms (max of ranks)':>26} {'committed':>10}")
    for step, full, reports in rows:
        st = status.step(step, Kind.CHECKPOINT if full else Kind.STATE_DICT)
        done = "-" if st is None else ("yes" if st.committed else st.state.value)
        print(f"{step:>5} {'weights+checkpoint' if full else 'weights':<18} {reports[0].loss:>9.5f} "
              f"{max(r.blocked_ms for r in reports):>26.2f} {done:>10}")
    blocked = [r.blocked_ms for _, _, reports in rows for r in reports]
    kept = sorted(scan_steps(Storage(root)))
    print()
    print(f"steps trained:              {steps} on {workers} workers, full checkpoint every {ckpt_every}")
    print(f"training blocked per save:  median {statistics.median(blocked):.2f} ms, max {max(blocked):.2f} ms")
    print(f"background save duration:   median {statistics.median(save_seconds) * 1000:.1f} ms, "
          f"max {max(save_seconds) * 1000:.1f} ms ({len(save_seconds)} saves)")
    print(f"kept after retention:       steps {kept} (max {keep} checkpoints, {keep} state dicts)")
    latest = ckptd.latest_step(root)
    print(f"latest checkpoint:          {latest} -> {ckptd.step_dir(root, latest) if latest is not None else '-'}")
    print(f"latest state dict:          {ckptd.latest_step(root, 'state_dict')}")
    if latest is not None:
        ckptd.verify(root, latest)
        fresh, optimizer = make_model(), None
        optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        state = ckptd.resume(root, model=fresh, optimizer=optimizer, model_dir=MODEL_DIR, world_size=workers)
        same = "n/a (trained past it)"
        if latest == steps:
            trained = ray.get(ranks[0].weights.remote())
            same = "yes" if all(torch.equal(v, trained[k]) for k, v in fresh.state_dict().items()) else "NO"
        print(f"resume:                     step {state.step}, epoch {state.epoch}, step in epoch "
              f"{state.step_in_epoch}; verified; weights equal rank 0's: {same}")
    print(f"wall time:                  {time.perf_counter() - started:.1f} s")
    ray.kill(monitor, no_restart=True)
    return latest
