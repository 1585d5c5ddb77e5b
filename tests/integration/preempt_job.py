"""A training worker process for the preemption tests: one rank of a data-parallel job.

Run as ``python -m tests.integration.preempt_job --rank R --world W ...``. It connects to the test's
Ray cluster, joins a gloo process group (W > 1), trains a small model with SGD and momentum,
saves every ``--every`` steps through its own coordinator, and calls
``PreemptionGuard.at_step_boundary`` after each step. After each step it writes the model and
optimizer state to ``--trace/rank{R}/{step}.pt``, which the test compares with what resume loads.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import ray
import torch
import torch.distributed as dist

import ckptd
from ckptd.coordinator.preemption import DEFAULT_GRACE_S
from ckptd.workers import capture_training_state, save_sharded, save_training_state, snapshot


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_step(model, optimizer, step: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(8, 6, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    optimizer.step()


def until(get, what: str, timeout_s: float = 300.0):
    """Poll ``get`` until it returns a value (the test starts this process before it is ready)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = get()
        except ckptd.CheckpointError:
            value = None
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--gcs", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    ap.add_argument("--go", required=True, help="train once this file exists (the test starts the "
                    "processes early: importing torch and Ray takes seconds)")
    ap.add_argument("--stall-final", action="store_true", help="a save started after the notice never ends")
    args = ap.parse_args()
    rank, world = args.rank, args.world

    ray.init(address=args.gcs, namespace=args.namespace, log_to_driver=False, configure_logging=False)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    coord = ckptd.CheckpointCoordinator(until(lambda: ckptd.get_monitor(args.run), "the monitor"),
                                        worker_id=f"rank{rank}")
    model, optimizer = build()
    trace = f"{args.trace}/rank{rank}"
    os.makedirs(trace, exist_ok=True)
    never = threading.Event()

    def save(step: int) -> None:
        out = coord.step_dir(step)
        weights = snapshot(model.state_dict())
        state = capture_training_state(epoch=0, step=step, step_in_epoch=step, rank=rank, world_size=world,
                                       optimizer=optimizer)
        stall = args.stall_final and guard.preempted  # the final save (not one started before the notice)

        def write() -> list:
            if stall:
                never.wait()  # a save that outlives any grace period
            return (save_sharded(f"{out}/model", weights, rank=rank, world_size=world)
                    + save_training_state(out, state))

        coord.save_async("state", write, step)
        if rank == 0:
            coord.register(step, checkpoint_thread_count=world)

    until(lambda: os.path.exists(args.go) or None, "the test's go")
    with ckptd.PreemptionGuard(coord, save, grace_s=args.grace, watch_ray_drain=False) as guard:
        for step in range(1, args.steps + 1):
            train_step(model, optimizer, step, rank, world)
            time.sleep(args.step_time)  # the rest of a real step's compute
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{trace}/{step}.pt")
            if step % args.every == 0:
                save(step)
            guard.at_step_boundary(step)
    coord.close()


if __name__ == "__main__":
    main()
