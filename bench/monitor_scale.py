"""P4: the monitor under many workers: commit latency (last unit reported -> tracker durable)
and notifications handled per second."""

from __future__ import annotations

import os
import shutil
import statistics
import time

import numpy as np
import ray

import ckptd

from .common import Row

#: The row of every step's commit latency, from which the P4 targets' percentiles are judged.
COMMIT_LATENCIES = "commit latency, each step"
#: The row of every step's wall time, from which the rate's interval is judged.
STEP_TIMES = "wall time, each step"


@ray.remote(num_cpus=0)
class Host:
    """Hosts several simulated training workers, each with its own coordinator."""

    def __init__(self, run: str, first: int, count: int, units: int) -> None:
        monitor = ckptd.get_monitor(run)
        self.coords = [ckptd.CheckpointCoordinator(monitor, worker_id=f"w{first + i}") for i in range(count)]
        self.units = units

    def ready(self) -> int:
        return len(self.coords)

    def step(self, step: int) -> None:
        for coord in self.coords:
            for u in range(self.units):
                coord.save_async(f"u{u}", list, step)  # a unit that writes nothing
        for coord in self.coords:
            coord.wait_all()

    def close(self) -> None:
        for coord in self.coords:
            coord.close()


@ray.remote(num_cpus=0)
class Flood:
    """Sends notifications straight to the monitor, in batches, without save threads or files:
    what the monitor alone can absorb."""

    def __init__(self, run: str) -> None:
        self.monitor = ckptd.get_monitor(run)

    def send(self, first: int, workers: int, units: int, step: int, batch: int) -> None:
        events = []
        for w in range(first, first + workers):
            for u in range(units):
                unit = {"worker": f"w{w}", "name": f"u{u}", "step": step, "kind": "checkpoint",
                        "call": f"{w}-{u}-{step}"}
                events += [("started", unit, None), ("finished", unit, [])]
        ray.get([self.monitor.notify_batch.remote(events[i:i + batch]) for i in range(0, len(events), batch)])


def p4_monitor(base_dir: str | None, workers: int, units: int, steps: int, hosts: int = 4,
               label: str = "disk") -> list[Row]:
    """P4 with its root under ``base_dir``; ``label`` names that filesystem in the rows."""
    import tempfile

    root = tempfile.mkdtemp(prefix="ckptd-bench-p4-", dir=base_dir)
    run = f"bench-p4-{os.getpid()}"
    monitor = ckptd.start_monitor(root, run=run)
    driver = ckptd.CheckpointCoordinator(monitor, worker_id="driver")
    per = -(-workers // hosts)
    actors = [Host.remote(run, i * per, min(per, workers - i * per), units) for i in range(hosts) if i * per < workers]
    assert sum(ray.get([a.ready.remote() for a in actors])) == workers  # started before the clock
    before = ray.get(monitor.status.remote()).notifications
    start = time.perf_counter()
    step_ends = []
    for step in range(1, steps + 1):
        driver.register(step, checkpoint_thread_count=workers * units)
        ray.get([a.step.remote(step) for a in actors])
        step_ends.append(time.perf_counter())
    driver.wait_committed(steps, timeout_s=600)
    step_ends[-1] = time.perf_counter()  # the last step's time includes its commit
    elapsed = step_ends[-1] - start
    st = ray.get(monitor.status.remote())
    latencies = sorted(s.committed_at - s.ready_at for s in st.steps if s.committed and s.ready_at)
    ray.get([a.close.remote() for a in actors])
    for a in actors:
        ray.kill(a)

    # The monitor alone: the same events for as many steps again, sent by two processes (one with one host).
    floods = [Flood.remote(run) for _ in range(min(2, hosts))]
    half = -(-workers // len(floods))
    before_flood = ray.get(monitor.status.remote()).notifications
    t0 = time.perf_counter()
    for step in range(steps + 1, 2 * steps + 1):
        driver.register(step, checkpoint_thread_count=workers * units)
        ray.get([f.send.remote(i * half, min(half, workers - i * half), units, step, 2 * units)
                 for i, f in enumerate(floods)])
    driver.wait_committed(2 * steps, timeout_s=600)
    flood_rate = (ray.get(monitor.status.remote()).notifications - before_flood) / (time.perf_counter() - t0)
    driver.close()
    ray.kill(monitor, no_restart=True)
    shutil.rmtree(root, ignore_errors=True)  # on /dev/shm it would hold memory until reboot
    note = f"{workers} workers x {units} units, {steps} steps, on {len(actors)} host actors"
    scenario = f"P4 monitor ({label})"
    p50 = Row(scenario, "commit latency p50", "s", [statistics.median(latencies)], note)
    p99 = Row(scenario, "commit latency p99", "s", [float(np.quantile(latencies, 0.99))], note)
    each = Row(scenario, COMMIT_LATENCIES, "s", latencies,
               "every step's (last unit finished -> trackers durable): the targets' percentiles and intervals")
    rate = Row(scenario, "notifications per second", "1/s", [(st.notifications - before) / elapsed], note)
    per_step = Row(scenario, STEP_TIMES, "s", [float(t) for t in np.diff([start, *step_ends])],
                   "each step's wall time (its notifications are the same every step): the rate's interval")
    alone = Row(scenario, "notifications per second, monitor alone", "1/s", [flood_rate],
                f"the same events sent by {len(floods)} processes in batches of {2 * units} (one worker's units), "
                "no save threads or receipt files")
    return [p50, p99, each, rate, per_step, alone]
