"""Run the benchmark scenarios side by side and print tables with verdicts; write JSON too.

    python -m bench                      # the full run (about 20 min on 2 cores)
    python -m bench --smoke              # tiny sizes, 3 pairs: checks that it runs (verdicts inconclusive)
    python -m bench --only P2 --sizes-mib 64 --pairs 9
    python -m bench --only P3 --p3-variants python --model-mib 256 --pairs 9
    python -m bench --only P8 --reps 9      # FSDP2 on 2 Ray actors against dcp.save / async_save

P1, P2 and P3 targets come from interleaved A/B pairs (see bench/README.md): the median ratio,
its bootstrap 95 % interval, and met / missed / inconclusive with the reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import time

import torch

from . import breakdown
from .common import MiB, Row, make_state
from .report import TARGETS, paired_checks, rows_table, single_checks, targets_table
from .verdicts import MIN_PAIRS, Comparison

__all__ = ["TARGETS", "main"]


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes-mib takes comma-separated MiB, e.g. 64,256,1024; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes-mib needs sizes >= 1 MiB, got {text!r}")
    return sizes


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", default="P1,P2,P3,P4,P5,P6,P7,P8,P9", help="comma-separated scenarios")
    p.add_argument("--pairs", type=int, default=MIN_PAIRS,
                   help=f"interleaved A/B pairs per P1/P2/P3 target (verdicts need >= {MIN_PAIRS})")
    p.add_argument("--reps", type=int, default=5,
                   help="repetitions of P4-P8 methods; P1/P2/P3 context rows use at most 3")
    p.add_argument("--size-mib", type=int, default=1024, help="state size of P1, P5 and P7")
    p.add_argument("--sizes-mib", type=_sizes, default="64,256,1024", help="P2 state sizes, comma-separated")
    p.add_argument("--ram-dir", default="/dev/shm",
                   help="RAM-backed directory for the second P2 and P4 runs ('' to skip them)")
    p.add_argument("--model-mib", type=int, default=256, help="P3 model size (AdamW adds twice as much state)")
    p.add_argument("--p3-variants", default="matmul,python,python-process",
                   help="P3 training stand-ins: matmul (MLP on one torch thread), python (GIL-bound step); "
                        "-process: with CheckpointCoordinator(writer='process')")
    p.add_argument("--train-steps", type=int, default=12, help="P3 matmul: steps per block")
    p.add_argument("--ckpt-every", type=int, default=6, help="P3 matmul: checkpoint every k steps")
    p.add_argument("--py-steps", type=int, default=120, help="P3 python: steps per block")
    p.add_argument("--py-every", type=int, default=60, help="P3 python: checkpoint every k steps")
    p.add_argument("--py-ops", type=int, default=6000, help="P3 python: tiny tensor ops per step")
    p.add_argument("--workers", type=int, default=128, help="P4 simulated workers")
    p.add_argument("--units", type=int, default=4, help="P4 units per worker and step")
    p.add_argument("--scale-steps", type=int, default=50, help="P4 steps")
    p.add_argument("--hosts", type=int, default=4, help="P4 host actors the simulated workers share")
    p.add_argument("--ranks", type=int, default=10_000, help="P9 simulated ranks (8 per node)")
    p.add_argument("--zones", type=int, default=32, help="P9 zone relays")
    p.add_argument("--write-s", type=float, default=2.0,
                   help="P9 spread mode: each unit writes for 0.5x..1.5x this many seconds")
    p.add_argument("--rank-steps", type=int, default=5, help="P9 steps per mode (spread, burst)")
    p.add_argument("--mirror-mib", type=int, default=256, help="P6 step size")
    p.add_argument("--versions", type=int, default=100, help="P7 weight versions committed")
    p.add_argument("--fsdp-hidden", type=int, default=512, help="P8 model width")
    p.add_argument("--fsdp-layers", type=int, default=8, help="P8 model depth")
    p.add_argument("--fsdp-vocab", type=int, default=16384, help="P8 vocabulary")
    p.add_argument("--dir", default=None, help="scratch directory on disk; None: the system temp dir")
    p.add_argument("--json", default="bench/results.json", help="where to write the JSON results")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, 3 pairs, 1 repetition, no RAM run: checks that everything runs; "
                        "verdicts inconclusive")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    args.width = 2048
    if args.smoke:
        args.size_mib, args.sizes_mib, args.reps, args.pairs, args.model_mib = 4, [4], 1, 3, 4
        args.train_steps, args.ckpt_every, args.width = 4, 2, 256
        args.py_steps, args.py_every, args.py_ops = 6, 3, 200
        args.workers, args.units, args.scale_steps, args.hosts = 8, 2, 3, 1
        args.ranks, args.zones, args.write_s, args.rank_steps = 64, 2, 0.2, 1
        args.mirror_mib, args.versions = 4, 5
        args.fsdp_hidden, args.fsdp_layers, args.fsdp_vocab = 64, 2, 512
    args.context_reps = min(args.reps, 3)
    return args


def ram_dir_problem(path: str, need_bytes: int) -> str | None:
    """Why the RAM-backed P2 run cannot use ``path``, or None."""
    if not path:
        return "--ram-dir '' given"
    if not os.path.isdir(path):
        return f"{path} does not exist (no RAM-backed directory on this machine)"
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        return f"{path} has {free / MiB:.0f} MiB free, the run needs {need_bytes / MiB:.0f} MiB"
    return None


class Results:
    """What the scenarios measured: rows, paired comparisons, phase breakdowns, skipped parts."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.comparisons: list[Comparison] = []
        self.phases: list[breakdown.Breakdown] = []
        self.skipped: list[tuple[str, str]] = []
        self.seconds: dict[str, float] = {}
        self._t0 = time.time()

    def lap(self, name: str) -> None:
        """Time since the previous lap, as ``name``'s duration (printed on stderr)."""
        now = time.time()
        self.seconds[name] = now - self._t0
        self._t0 = now
        print(f"{name}: {self.seconds[name]:.1f} s", file=sys.stderr)


def run_saves(args: argparse.Namespace, only: set[str], out: Results) -> None:
    """P1, P2 (disk, then RAM) and P3, on a harness per filesystem."""
    from .saves import SaveHarness, p1_blocked, p2_durable
    from .training import p3_training

    h = SaveHarness(args.dir, "disk")
    out.lap("start (Ray, a monitor)")
    try:
        if "P1" in only:
            sd = make_state(args.size_mib * MiB)
            rows, comps, phases = p1_blocked(h, sd, args.pairs, args.context_reps)
            out.rows += rows
            out.comparisons += comps
            out.phases += phases
            del sd
            out.lap("P1")
        if "P2" in only:
            for mib in args.sizes_mib:
                _p2(h, mib, args, out, p2_durable)
            out.lap("P2 disk")
        if "P3" in only:
            for variant in (v.strip() for v in args.p3_variants.split(",") if v.strip()):
                steps, every = ((args.train_steps, args.ckpt_every) if variant.startswith("matmul")
                                else (args.py_steps, args.py_every))
                rows, comps, phases = p3_training(h, variant, args.model_mib, steps, every, args.pairs,
                                                  args.context_reps if variant == "matmul" else 0,
                                                  args.width, args.py_ops)
                out.rows += rows
                out.comparisons += comps
                out.phases.append(phases)
                gc.collect()
                out.lap(f"P3 {variant}")
    finally:
        h.close()
    if "P2" not in only:
        return
    # Each method's files, ckptd's two kept steps and its staging copy; the state itself is in RAM anyway.
    problem = ("smoke run: the disk run covers the same code" if args.smoke
               else ram_dir_problem(args.ram_dir, 6 * max(args.sizes_mib) * MiB))
    if problem is not None:
        out.skipped.append(("P2 (RAM)", problem))
        print(f"P2 on a RAM-backed directory skipped: {problem}", file=sys.stderr)
        return
    h = SaveHarness(args.ram_dir, "RAM")
    try:
        for mib in args.sizes_mib:
            _p2(h, mib, args, out, p2_durable)
    finally:
        h.close()
    out.lap("P2 RAM")


def _p2(h, mib: int, args: argparse.Namespace, out: Results, p2_durable) -> None:
    sd = make_state(mib * MiB)
    rows, comps, phases = p2_durable(h, sd, args.pairs, args.context_reps)
    out.rows += rows
    out.comparisons += comps
    out.phases.append(phases)
    del sd
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    only = {s.strip().upper() for s in args.only.split(",")}
    torch.set_num_threads(1)  # the training thread's share of this machine; the rest is the save's
    out = Results()
    started = time.time()
    if only & {"P1", "P2", "P3"}:
        run_saves(args, only, out)

    def p4():
        from .monitor_scale import p4_monitor

        rows = p4_monitor(args.dir, args.workers, args.units, args.scale_steps, hosts=args.hosts)
        # Again on a RAM-backed root: what is left when the filesystem's journal is out of the way.
        problem = ("smoke run: the disk run covers the same code" if args.smoke
                   else ram_dir_problem(args.ram_dir, 64 * MiB))
        if problem is not None:
            out.skipped.append(("P4 (RAM)", problem))
            print(f"P4 on a RAM-backed directory skipped: {problem}", file=sys.stderr)
            return rows
        return rows + p4_monitor(args.ram_dir, args.workers, args.units, args.scale_steps, hosts=args.hosts,
                                 label="RAM")

    def p5():
        from .rss import p5_rss

        return p5_rss(args.size_mib, args.dir, max(1, min(args.reps, 3)))

    def p6():
        from .mirror import p6_mirror

        return p6_mirror(args.mirror_mib, max(1, min(args.reps, 3)), args.dir, warm_up=not args.smoke)

    def p7():
        from .rollout import p7_rollout

        return p7_rollout(args.dir, args.versions, args.size_mib, args.reps)

    def p8():
        from .fsdp import p8_fsdp

        return p8_fsdp(args.dir, args.reps, args.fsdp_hidden, args.fsdp_layers, args.fsdp_vocab,
                       warm_up=not args.smoke)

    def p9():
        from .scale import p9_scale

        return p9_scale(args.dir, args.ranks, args.units, args.rank_steps, args.write_s, args.zones)

    for name, fn in (("P4", p4), ("P5", p5), ("P6", p6), ("P7", p7), ("P8", p8), ("P9", p9)):
        if name in only:
            out.rows += fn()
            out.lap(name)
    # In scenario order (P2's RAM run comes after P3 in time).
    out.rows.sort(key=lambda r: r.scenario[:2])
    out.comparisons.sort(key=lambda c: c.target[:2])
    out.phases.sort(key=lambda b: b.label[:2])
    targets = {**paired_checks(out.comparisons, args.smoke), **single_checks(out.rows, args.smoke)}
    print(rows_table(out.rows))
    if out.phases:
        print()
        print(breakdown.table(out.phases))
    print()
    print(targets_table(targets, out.skipped))
    result = {
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "started_at": started, "seconds": time.time() - started, "scenario_seconds": out.seconds,
        "smoke": args.smoke, "pairs": args.pairs,
        "rows": [r.to_json() for r in out.rows], "targets": targets,
        "phases": [b.to_json() for b in out.phases if b.steps], "skipped": dict(out.skipped),
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
