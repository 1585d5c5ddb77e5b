"""The RL demo (``ckptd demo --rl``): a trainer publishes weights, rollout workers follow them.

A trainer of 2 ranks (a small MLP, :class:`TrainWorker`) publishes its weights every step (a
state-dict save of each rank's shard) and a full checkpoint every few steps. Two rollout actors
follow the versions through a :class:`~ckptd.WeightSubscriber`: woken by the monitor when a
version commits, they open it (a read lease keeps retention off it), load it verified into their
own model and report the version they serve. The driver prints, per version, how long after its
commit each rollout was notified and how long its load took, and the served lag that status
showed while training ran.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass

import ray
import torch

import ckptd
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


@dataclass
class Served:
    version: int
    notified_ms: float  # commit (tracker published) -> this rollout woken
    load_ms: float  # open, read, check and copy into the model


class RolloutWorker:
    """A rollout worker: follows the trainer's versions and serves the newest it has loaded."""

    def __init__(self, run: str, name: str) -> None:
        torch.set_num_threads(1)
        self.model = make_model()
        self.sub = ckptd.WeightSubscriber(run, name=name, model_dir=MODEL_DIR)
        self.served: list[Served] = []

    async def follow(self, last: int) -> list[Served]:
        """Serve each new version until ``last`` is served."""
        async for version in self.sub.versions():
            woken = time.time()
            published = self.sub.published_at(version) or woken
            t0 = time.perf_counter()
            with self.sub.open(version) as weights:
                await asyncio.to_thread(weights.load_into, self.model)
            load_ms = (time.perf_counter() - t0) * 1000
            await asyncio.to_thread(self.sub.report_serving, version)
            self.served.append(Served(version, (woken - published) * 1000, load_ms))
            if version >= last:
                return self.served
        return self.served

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
    return f"median {statistics.median(values):.1f} ms, p99 {p99:.1f} ms, max {values[-1]:.1f} ms"


def run_rl_demo(root: str, steps: int = 30, ckpt_every: int = 5, rollouts: int = 2, ranks: int = 2) -> int | None:
    """Run the RL demo; return the newest version every rollout serves at the end (None if they differ)."""
    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, ranks), include_dashboard=False, log_to_driver=False)
    run = f"rl-demo-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run, max_ckpt_to_keep=2, max_state_dict_to_keep=2)
    trainer = ckptd.CheckpointCoordinator(monitor, worker_id="trainer")
    train_actor = ray.remote(num_cpus=1)(TrainWorker)
    workers = [train_actor.remote(run, r, ranks) for r in range(ranks)]
    rollout_actor = ray.remote(num_cpus=0)(RolloutWorker)
    followers = [rollout_actor.remote(run, f"rollout-{i}") for i in range(rollouts)]
    following = [f.follow.remote(steps) for f in followers]

    lags: dict[str, list[tuple[int, float]]] = {}
    for step in range(1, steps + 1):
        full = step % ckpt_every == 0
        ray.get([w.train_step.remote(step, full) for w in workers])
        trainer.register(step, is_state_dict=not full, state_dict_thread_count=ranks,
                         checkpoint_thread_count=ranks if full else 0)
        for sub in ray.get(monitor.status.remote()).subscribers:
            if sub.lag_steps is not None:
                lags.setdefault(sub.name, []).append((sub.lag_steps, sub.lag_s or 0.0))
    ray.get([w.finish.remote() for w in workers])
    served = ray.get(following)

    names = [f"rollout-{i}" for i in range(rollouts)]
    by_version = [{s.version: s for s in rows} for rows in served]
    header = f"{'version':>7} {'saved':<18}" + "".join(f" {n + ' notified':>19} {'load':>9}" for n in names)
    print(header)
    for version in sorted({v for rows in by_version for v in rows}):
        cells = "".join(
            f" {rows[version].notified_ms:>16.1f} ms {rows[version].load_ms:>6.1f} ms" if version in rows
            else f" {'(skipped)':>19} {'':>9}" for rows in by_version)
        print(f"{version:>7} {'weights+checkpoint' if version % ckpt_every == 0 else 'weights':<18}{cells}")
    print()
    skipped = sorted(set(range(1, steps + 1)) - {v for rows in by_version for v in rows})
    if skipped:
        print(f"(not loaded by any rollout, a newer version having committed first: {skipped})")
    notified = [s.notified_ms for rows in served for s in rows]
    loads = [s.load_ms for rows in served for s in rows]
    print(f"steps trained:                {steps} on {ranks} ranks; weights published every step, a full "
          f"checkpoint every {ckpt_every}")
    print(f"commit -> rollout notified:   {_ms(notified)} ({len(notified)} wake-ups)")
    print(f"load (verified, into model):  {_ms(loads)}")
    for name in names:
        samples = lags.get(name, [])
        if samples:
            print(f"served lag of {name}:      steps median {statistics.median(s for s, _ in samples):.0f}, max "
                  f"{max(s for s, _ in samples)}; seconds median {statistics.median(t for _, t in samples):.2f}, "
                  f"max {max(t for _, t in samples):.2f} (status, sampled each step)")
    final = ray.get(monitor.status.remote())
    serving = {s.name: s.serving for s in final.subscribers}
    print(f"serving at the end:           {serving}; newest state dict {final.trackers.state_dict}")
    trained = ray.get(workers[0].weights.remote())
    same = all(all(torch.equal(v, trained[k]) for k, v in ray.get(f.weights.remote()).items()) for f in followers)
    print(f"rollout weights equal the trainer's: {'yes' if same else 'NO'}")
    print(f"wall time:                    {time.perf_counter() - started:.1f} s")
    for actor in followers + workers:
        ray.kill(actor)
    ray.kill(monitor, no_restart=True)
    versions = set(serving.values())
    return versions.pop() if len(versions) == 1 and same else None
