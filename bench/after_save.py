"""Where a checkpoint's cost lands in a GIL-bound training loop, step by step after the save call.

    python -m bench.after_save                            # both writers, 10 checkpoints each
    python -m bench.after_save --writers process --dir /dev/shm --checkpoints 20

P3 reports a slowdown per block; this splits it by the step it lands in. It runs P3's GIL-bound
stand-in (:func:`bench.training.python_work`, the same 768 MiB of model and AdamW state) and,
for each writer, ``--checkpoints`` rounds of ``--every`` steps without a checkpoint (the
baseline), then a checkpoint and ``--every`` steps with the fence. It prints the median extra
time of each step after the save call over the baseline's median step: step 0 carries the save
calls and the fence (the part of the staging copy not done when the step ends), the steps after
it what the write costs the training thread while it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import ckptd

from .saves import SaveHarness
from .training import _Loop


def measure(h: SaveHarness, writer: str, checkpoints: int, every: int, py_ops: int, model_mib: int) -> dict:
    """Median baseline step (s) and the median extra time (s) of each step after a save call."""
    coord = (ckptd.CheckpointCoordinator(h.monitor, worker_id=f"after-save-{writer}", writer=writer)
             if writer == "process" else h.coord)
    loop = _Loop(h, "python", model_mib, 2048, py_ops, coord)
    base: list[float] = []
    after: list[list[float]] = [[] for _ in range(every)]
    try:
        for rnd in range(checkpoints + 1):  # round 0 warms up (staging buffers, the writer process)
            round_base, round_after = [], []
            for _ in range(every):
                t0 = time.perf_counter()
                loop.step(lambda: None)
                round_base.append(time.perf_counter() - t0)
            step = h.next_step()
            t0 = time.perf_counter()
            loop.save_ckptd(step)  # P3's checkpoint: the model and the optimizer, fenced
            for _ in range(every):
                loop.step(coord.before_update)
                round_after.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
            coord.wait_all()
            coord.wait_committed(step, timeout_s=600)
            if rnd:
                base += round_base
                for i, t in enumerate(round_after):
                    after[i].append(t)
    finally:
        if coord is not h.coord:
            coord.close()
    b = statistics.median(base)
    return {"writer": writer, "base_s": b, "extra_s": [statistics.median(a) - b for a in after],
            "checkpoints": checkpoints, "every": every, "state_mib": loop.nbytes / (1 << 20)}


def table(results: list[dict]) -> str:
    """Markdown: step 0, then the extra time summed over groups of ten steps, then the total."""
    every = results[0]["every"]
    groups = [(1, min(10, every))] + [(a, min(a + 10, every)) for a in range(10, every, 10)]
    head = ["writer", "baseline step", "step 0"] + [f"steps {a}-{b - 1}" for a, b in groups] + ["all steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        x = [e * 1000 for e in r["extra_s"]]
        cells = [r["writer"], f"{r['base_s'] * 1000:.2f} ms", f"+{x[0]:.1f} ms"]
        cells += [f"{sum(x[a:b]):+.1f} ms" for a, b in groups] + [f"{sum(x):+.1f} ms"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.after_save", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--writers", default="thread,process", help="comma-separated: thread, process")
    p.add_argument("--checkpoints", type=int, default=10, help="checkpoints measured per writer")
    p.add_argument("--every", type=int, default=60, help="steps between checkpoints (P3's --py-every)")
    p.add_argument("--py-ops", type=int, default=6000, help="tiny tensor ops per step (P3's --py-ops)")
    p.add_argument("--model-mib", type=int, default=256, help="model size; AdamW adds twice as much")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    writers = [w for w in args.writers.split(",") if w]
    if not writers or any(w not in ("thread", "process") for w in writers) or min(args.checkpoints, args.every) < 1:
        p.error("--writers takes thread and/or process; --checkpoints and --every must be >= 1")
    torch.set_num_threads(1)
    h = SaveHarness(args.dir, "after-save")
    try:
        results = [measure(h, w, args.checkpoints, args.every, args.py_ops, args.model_mib) for w in writers]
    finally:
        h.close()
    print(f"GIL-bound step ({args.py_ops} ops), {results[0]['state_mib']:.0f} MiB of state, a checkpoint every "
          f"{args.every} steps; median extra time per step after the save call, {args.checkpoints} checkpoints:")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
