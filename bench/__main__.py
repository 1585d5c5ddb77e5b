"""Run the benchmark scenarios side by side and print a table; write JSON too.

    python -m bench                      # the full run: 1 GiB saves, 5 repetitions
    python -m bench --smoke              # tiny sizes, 1 repetition: checks that it runs
    python -m bench --only P1,P2 --size-mib 256
    python -m bench --only P8 --reps 9      # FSDP2 on 2 Ray actors against dcp.save / async_save
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from .common import MiB, Row, make_state

TARGETS = {
    "P1 eager blocked / memcpy": 1.2,
    "P1 fenced blocked / memcpy": 0.1,
    "P2 ckptd durable / safetensors+fsync": 1.1,
    "P3 ckptd slowdown %": 3.0,
    "P4 commit latency p50 (ms)": 20.0,
    "P4 commit latency p99 (ms)": 100.0,
    "P4 notifications per second": 2000.0,  # a minimum
    "P5 ckptd peak RSS / state": 2.2,
    "P7 subscriber latency p50 (ms)": 20.0,
    "P7 ckptd load_into / load_file+load_state_dict": 1.2,
    "P8 ckptd fenced blocked / dcp.async_save": 0.5,
    "P8 ckptd eager blocked / dcp.async_save": 0.5,
    "P8 ckptd durable / dcp.save": 1.1,
}


def _find(rows: list[Row], scenario: str, method: str) -> Row | None:
    return next((r for r in rows if r.scenario == scenario and r.method.startswith(method)), None)


def checks(rows: list[Row]) -> dict[str, dict]:
    """Each target: the measured value and whether it is met (ratios of medians, one run)."""
    out: dict[str, dict] = {}

    def add(name: str, value: float | None, minimum: bool = False) -> None:
        if value is None:
            return
        target = TARGETS[name]
        out[name] = {"value": value, "target": target, "met": value >= target if minimum else value <= target}

    memcpy = _find(rows, "P1 blocked", "memcpy")
    for method, name in (("ckptd eager", "P1 eager blocked / memcpy"), ("ckptd fenced", "P1 fenced blocked / memcpy")):
        r = _find(rows, "P1 blocked", method)
        if r and memcpy:
            add(name, r.median / memcpy.median)
    ck, st = _find(rows, "P2 durable", "ckptd"), _find(rows, "P2 durable", "safetensors")
    if ck and st:
        add("P2 ckptd durable / safetensors+fsync", ck.median / st.median)
    base, ck = _find(rows, "P3 training", "no checkpointing"), _find(rows, "P3 training", "ckptd")
    if base and ck:
        add("P3 ckptd slowdown %", (ck.median / base.median - 1) * 100)
    for method, name in (("commit latency p50", "P4 commit latency p50 (ms)"),
                         ("commit latency p99", "P4 commit latency p99 (ms)")):
        r = _find(rows, "P4 monitor", method)
        if r:
            add(name, r.median * 1000)
    r = _find(rows, "P4 monitor", "notifications")
    if r:
        add("P4 notifications per second", r.median, minimum=True)
    r = _find(rows, "P5 peak RSS", "ckptd")
    if r:
        add("P5 ckptd peak RSS / state", r.median)
    r = _find(rows, "P7 version latency", "ckptd subscriber p50")
    if r:
        add("P7 subscriber latency p50 (ms)", r.median * 1000)
    ck = _find(rows, "P7 verified load", "ckptd load_into")
    st = _find(rows, "P7 verified load", "safetensors load_file + load_state_dict")
    if ck and st:
        add("P7 ckptd load_into / load_file+load_state_dict", ck.median / st.median)
    dcp_async = _find(rows, "P8 FSDP2 blocked", "dcp.async_save")
    for method, name in (("ckptd fenced", "P8 ckptd fenced blocked / dcp.async_save"),
                         ("ckptd eager", "P8 ckptd eager blocked / dcp.async_save")):
        r = _find(rows, "P8 FSDP2 blocked", method)
        if r and dcp_async:
            add(name, r.median / dcp_async.median)
    # ckptd's durable time is the slower of its two modes: both must meet the target.
    ck = [r for m in ("ckptd fenced", "ckptd eager") if (r := _find(rows, "P8 FSDP2 durable", m))]
    st = _find(rows, "P8 FSDP2 durable", "dcp.save")
    if ck and st:
        add("P8 ckptd durable / dcp.save", max(r.median for r in ck) / st.median)
    return out


def table(rows: list[Row], targets: dict[str, dict]) -> str:
    lines = ["| scenario | method | median | min–max | note |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        scale, unit = (1000, "ms") if r.unit in ("s", "s/step") else (1, r.unit)
        unit = f"{unit}/step" if r.unit == "s/step" else unit
        lines.append(f"| {r.scenario} | {r.method} | {r.median * scale:.4g} {unit} | "
                     f"{min(r.samples) * scale:.4g}–{max(r.samples) * scale:.4g} | {r.note} |")
    lines += ["", "| target | measured | limit | met |", "| --- | --- | --- | --- |"]
    for name, t in targets.items():
        lines.append(f"| {name} | {t['value']:.3g} | {'≥' if name.endswith('second') else '≤'} {t['target']:g} | "
                     f"{'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--only", default="P1,P2,P3,P4,P5,P6,P7,P8", help="comma-separated scenarios")
    p.add_argument("--size-mib", type=int, default=1024, help="state size of P1, P2, P5 and P7")
    p.add_argument("--reps", type=int, default=5, help="repetitions per method (medians reported)")
    p.add_argument("--model-mib", type=int, default=256, help="P3 model size")
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=128, help="P4 simulated workers")
    p.add_argument("--units", type=int, default=4, help="P4 units per worker and step")
    p.add_argument("--scale-steps", type=int, default=50, help="P4 steps")
    p.add_argument("--mirror-mib", type=int, default=256, help="P6 step size")
    p.add_argument("--versions", type=int, default=100, help="P7 weight versions committed")
    p.add_argument("--fsdp-hidden", type=int, default=512, help="P8 model width")
    p.add_argument("--fsdp-layers", type=int, default=8, help="P8 model depth")
    p.add_argument("--fsdp-vocab", type=int, default=16384, help="P8 vocabulary")
    p.add_argument("--dir", default=None, help="scratch directory (default: the system temp dir)")
    p.add_argument("--json", default="bench/results.json", help="where to write the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and 1 repetition")
    args = p.parse_args(argv)
    if args.smoke:
        args.size_mib, args.reps, args.model_mib = 4, 1, 4
        args.train_steps, args.ckpt_every, args.width = 4, 2, 256
        args.workers, args.units, args.scale_steps = 8, 2, 3
        args.mirror_mib, args.versions = 4, 5
        args.fsdp_hidden, args.fsdp_layers, args.fsdp_vocab = 64, 2, 512
    else:
        args.width = 2048
    only = {s.strip().upper() for s in args.only.split(",")}
    torch.set_num_threads(1)  # the training thread's share of this machine; the rest is the save's
    rows: list[Row] = []
    started = time.time()
    if only & {"P1", "P2", "P3"}:
        from .saves import SaveHarness, p1_blocked, p2_durable

        h = SaveHarness(args.dir)
        try:
            sd = make_state(args.size_mib * MiB)
            if "P1" in only:
                rows += p1_blocked(h, sd, args.reps)
            if "P2" in only:
                rows += p2_durable(h, sd, args.reps)
            del sd
            if "P3" in only:
                from .training import p3_training

                rows += p3_training(h, args.model_mib, args.train_steps, args.ckpt_every, args.reps, args.width)
        finally:
            h.close()
    def p4():
        from .monitor_scale import p4_monitor

        return p4_monitor(args.dir, args.workers, args.units, args.scale_steps)

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

    seconds = {"P1-P3": time.time() - started}
    for name, fn in (("P4", p4), ("P5", p5), ("P6", p6), ("P7", p7), ("P8", p8)):
        if name in only:
            t0 = time.time()
            rows += fn()
            seconds[name] = time.time() - t0
            print(f"{name}: {seconds[name]:.1f} s", file=sys.stderr)
    targets = checks(rows)
    print(table(rows, targets))
    result = {
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "started_at": started, "seconds": time.time() - started, "scenario_seconds": seconds,
        "rows": [r.to_json() for r in rows], "targets": targets,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
