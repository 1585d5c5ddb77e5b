"""P9: the monitor at 10,000 ranks x 4 units per step, simulated.

Each simulated rank does what a coordinator does with ``node_relay=True, relay_zones=32``: it
asks admission for its units (one batch, as its notifier would send them), each unit "writes"
for a while and creates its file, then reports it finished with that file. Its events go through
the relay of its node (8 ranks per node: 1,250 node relays at 10,000 ranks), which sends through
one of 32 zone relays, which send to the monitor. The relays are the real
:class:`~ckptd.coordinator.relay.RelayCore`, hosted in a few simulator processes instead of one
actor per node and zone, since this machine has 2 cores, not 1,250 nodes: the rank -> node relay
-> zone relay hops (in parallel on other machines on a real cluster) are function calls here;
everything from the zone relays on (Ray calls, the real monitor, its commit with every file
checked, trackers, retention) is real. What ranks also do that is not simulated: receipts (a file
per unit, written by each rank on its own node, in parallel) and the data itself.

Per step it measures the commit latency after the last unit (the last finished event handed to
its relay -> the trackers durable, from the monitor's commit span), how much of it the commit
itself took, the monitor's CPU time (its process), and the calls the monitor received.

Write times: ``spread`` draws each unit's from 0.5x..1.5x ``write_s`` (ranks finish over a
window, as real saves of shards of different sizes on different disks do); ``burst`` has every
unit finish at once, the worst case: the monitor then has all 40,000 finished events in front of
it at the same instant.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import ray

import ckptd
from ckptd.coordinator.relay import RelayCore

from .common import Row

RANKS_PER_NODE = 8
#: The rows of every step's latency, from which the P9 target's p99 and its interval are judged.
EACH_STEP = "commit latency after the last unit, each step"


@ray.remote(num_cpus=0)
class NodeSimulator:
    """Simulates the ranks of several nodes, each node with its own relay."""

    def __init__(self, run: str, namespace: str | None, attempt: str, monitor: Any, ranks: list[int], units: int,
                 zones: list[int], seed: int) -> None:
        self.ranks, self.units = ranks, units
        self.rng = random.Random(seed)
        # Zone relays send to the monitor (real Ray calls); node relays to their zone's.
        self.zones = {z: RelayCore(run, namespace, attempt, monitor, 600.0) for z in zones}
        self.relays: dict[int, RelayCore] = {}
        for rank in ranks:
            node = rank // RANKS_PER_NODE
            if node not in self.relays:
                zone = self.zones[zones[node % len(zones)]]
                self.relays[node] = RelayCore(run, namespace, attempt, monitor, 600.0, upstream=zone.relay)

    async def prepare(self, step_dir: str) -> None:
        """Create this step's empty files (each unit's output)."""
        for rank in self.ranks:
            os.makedirs(os.path.join(step_dir, f"rank{rank}"), exist_ok=True)
            for u in range(self.units):
                open(os.path.join(step_dir, f"rank{rank}", f"u{u}.bin"), "wb").close()

    async def step(self, step: int, write_s: float) -> dict:
        """Run one step for every rank; when the last finished event was handed to a relay."""
        calls_before = sum(z.calls for z in self.zones.values())
        last = await asyncio.gather(*(self._rank(rank, step, write_s) for rank in self.ranks))
        return {"last_finished": max(last), "calls": sum(z.calls for z in self.zones.values()) - calls_before}

    async def _rank(self, rank: int, step: int, write_s: float) -> float:
        relay = self.relays[rank // RANKS_PER_NODE]
        units = [{"worker": f"rank{rank}", "name": f"u{u}", "step": step, "kind": "checkpoint",
                  "call": f"{rank}-{u}-{step}"} for u in range(self.units)]
        answers = await relay.relay([("started", unit, None) for unit in units])
        refused = [a for a in answers if not a or "refused" in a]
        if refused:
            raise RuntimeError(f"rank {rank}: {refused[0]}")
        done = await asyncio.gather(*(self._unit(relay, unit, rank, write_s) for unit in units))
        return max(done)

    async def _unit(self, relay: RelayCore, unit: dict, rank: int, write_s: float) -> float:
        if write_s > 0:
            await asyncio.sleep(write_s * self.rng.uniform(0.5, 1.5))
        files = [{"path": f"rank{rank}/{unit['name']}.bin", "size": 0, "crc32": "00000000"}]
        handed = time.time()
        (answer,) = await relay.relay([("finished", unit, {"files": files, "found": False})])
        if answer and "refused" in answer:
            raise RuntimeError(f"{unit}: {answer['refused']}")
        return handed


def _cpu(monitor) -> float:
    return ray.get(monitor.__ray_call__.remote(lambda self: time.process_time()))


def _commit_span(monitor, step: int) -> tuple[float, float]:
    """(start, end) of the step's commit, from the monitor's timeline."""
    spans = ray.get(monitor.timeline.remote())["spans"]
    (span,) = [s for s in spans if s["lane"] == "commit" and s["step"] == step and not s.get("error")]
    return span["start"], span["end"]


def p9_scale(base_dir: str | None, ranks: int, units: int, steps: int, write_s: float, zones: int = 32,
             simulators: int = 4) -> list[Row]:
    root = tempfile.mkdtemp(prefix="ckptd-bench-p9-", dir=base_dir)
    run = f"bench-p9-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run, max_ckpt_to_keep=2, status_history=4)
    driver = ckptd.CheckpointCoordinator(monitor, worker_id="driver")
    namespace = ray.get_runtime_context().namespace
    # Whole nodes and zones per simulator, so that each relay batches all of what it stands for.
    simulators = max(1, min(simulators, zones))
    nodes = -(-ranks // RANKS_PER_NODE)
    per = -(-nodes // simulators)
    sims = []
    for i in range(simulators):
        mine = list(range(i * per * RANKS_PER_NODE, min(ranks, (i + 1) * per * RANKS_PER_NODE)))
        if mine:
            sims.append(NodeSimulator.remote(run, namespace, driver._attempt_id, monitor, mine, units,
                                             list(range(i, zones, simulators)), seed=i))
    rows: list[Row] = []
    note = (f"{ranks} ranks x {units} units, {nodes} node relays -> {zones} zone relays -> monitor, "
            f"on {len(sims)} simulator processes, {steps} steps per mode")
    step = 0
    try:
        for mode, ws in (("spread", write_s), ("burst", 0.0)):
            latencies, cpus, calls, commits = [], [], [], []
            for _ in range(steps):
                step += 1
                out = driver.step_dir(step)
                ray.get([s.prepare.remote(out) for s in sims])
                driver.register(step, checkpoint_thread_count=ranks * units)
                cpu0 = _cpu(monitor)
                results = ray.get([s.step.remote(step, ws) for s in sims])
                driver.wait_committed(step, timeout_s=600)
                cpus.append(_cpu(monitor) - cpu0)
                start, end = _commit_span(monitor, step)
                last = max(r["last_finished"] for r in results)
                latencies.append(end - last)
                commits.append(end - start)
                calls.append(sum(r["calls"] for r in results))
            what = f"{mode} (writes {0.5 * ws:g}-{1.5 * ws:g} s)" if ws else "burst (every unit finishes at once)"
            latencies.sort()
            rows += [
                Row("P9 scale", f"commit latency after the last unit p50, {what}", "s",
                    [statistics.median(latencies)], note),
                Row("P9 scale", f"commit latency after the last unit p99, {what}", "s",
                    [float(np.quantile(latencies, 0.99))], note),
                Row("P9 scale", f"{EACH_STEP}, {what}", "s", latencies, note),
                Row("P9 scale", f"of which the commit (manifest, checks, trackers), {what}", "s", commits, note),
                Row("P9 scale", f"monitor CPU per step, {what}", "s", cpus, note),
                Row("P9 scale", f"monitor calls per step, {what}", "calls", calls,
                    f"{2 * ranks * units} notifications per step"),
            ]
    finally:
        for s in sims:
            ray.kill(s)
        driver.close()
        ray.kill(monitor, no_restart=True)
        shutil.rmtree(root, ignore_errors=True)
    return rows
