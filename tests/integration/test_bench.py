"""The benchmark runs end to end in smoke mode: every scenario, a verdict for every target (paired
ones with their pairs and interval), and ckptd's per-phase breakdown (no timing asserted)."""

from __future__ import annotations

from bench.breakdown import COLUMNS

from .helpers import run_bench_smoke

PAIRED = {"P1 eager blocked / memcpy", "P1 fenced blocked / memcpy",
          "P2 ckptd durable / safetensors+fsync (disk, 4 MiB)", "P3 ckptd slowdown % (matmul)",
          "P3 ckptd slowdown % (python)", "P3 ckptd slowdown % (python-process)"}
SINGLE = {"P9 commit latency after the last unit p99 (ms)"}  # P4..P8: test_bench_services.py


def test_bench_smoke_reports_every_scenario_with_verdicts_and_phases(ray_local, tmp_path):
    """P1, P2, P3 and P9 (the bench's other scenarios: test_bench_services.py, so that the two
    halves run on two pytest workers)."""
    proc, result = run_bench_smoke(tmp_path, "P1,P2,P3,P9")
    scenarios = {r["scenario"] for r in result["rows"]}
    assert scenarios == {"P1 blocked", "P2 durable (disk, 4 MiB)", "P3 training (matmul)", "P3 training (python)",
                         "P3 training (python-process)", "P9 scale"}

    targets = result["targets"]
    assert set(targets) == PAIRED | SINGLE
    for name in PAIRED:
        t = targets[name]
        # A smoke run never claims a result, whatever its numbers.
        assert (t["verdict"], t["pairs"]) == ("inconclusive", 3), (name, t)
        assert t["reason"].startswith("smoke run"), t
        assert t["low"] <= t["value"] <= t["high"] and t["ratio_low"] <= t["ratio"] <= t["ratio_high"]
        assert len(t["a"]["samples"]) == len(t["b"]["samples"]) == 3
    assert all(targets[n]["verdict"] == "inconclusive" and "smoke" in targets[n]["note"] for n in SINGLE)
    assert "| P3 ckptd slowdown % (python) |" in proc.stdout
    assert "| inconclusive | smoke run: tiny sizes and few pairs |" in proc.stdout
    # The RAM-backed P2 run is skipped in smoke runs, and says so.
    assert "| P2 (RAM) | – | – | – | – | skipped | smoke run" in proc.stdout
    assert result["skipped"] == {"P2 (RAM)": "smoke run: the disk run covers the same code"}

    # ckptd's own phase timings, read back from the monitor's timeline after the measured saves.
    assert "| " + " | ".join(COLUMNS) + " |" in proc.stdout
    labels = {b["label"]: b for b in result["phases"]}
    assert {"P1 eager 4 MiB", "P1 fenced 4 MiB", "P2 disk 4 MiB", "P3 matmul", "P3 python",
            "P3 python-process"} <= set(labels)
    for label, b in labels.items():
        # 3 pairs: one save per P1/P2 pair, two per P3 block (every 2 or 3 steps of 4 or 6).
        assert b["steps"] == (6 if label.startswith("P3") else 3) and b["durable_ms"] > 0, b
        assert all(b["median_ms"][phase] > 0 for phase in COLUMNS), (label, b)
    # P3: the training thread's CPU time beside its wall time, block by block: what tells waiting
    # (for the GIL or a core) from the same work made slower.
    for variant in ("matmul", "python", "python-process"):
        p3 = {r["method"]: r for r in result["rows"] if r["scenario"] == f"P3 training ({variant})"}
        for cpu, wall in (("no checkpointing: training thread CPU time", "no checkpointing"),
                          ("ckptd: training thread CPU time", "ckptd (fenced staging)")):
            assert len(p3[cpu]["samples"]) == len(p3[wall]["samples"]) == 3, (variant, cpu)
            assert all(0 < c <= w * 1.01 for c, w in zip(p3[cpu]["samples"], p3[wall]["samples"], strict=True))
        # The cost of one checkpoint in training time, pair by pair: what the slowdown becomes at
        # another interval. Smoke blocks: 4 or 6 steps, a checkpoint every 2 or 3, so 2 per block.
        lost = p3["training time lost per checkpoint"]
        ck, base = p3["ckptd (fenced staging)"]["samples"], p3["no checkpointing"]["samples"]
        steps = 4 if variant == "matmul" else 6
        assert lost["samples"] == [(a - b) * steps / 2 for a, b in zip(ck, base, strict=True)], (variant, lost)
        assert "at one a minute" in lost["note"], lost
        # The floor: a bare background copy + write of the same state, in the same rounds.
        bare = p3["bare background checkpoint (no ckptd)"]
        bare_lost = p3["bare checkpoint: training time lost per checkpoint"]
        assert len(bare["samples"]) == 3 and all(s > 0 for s in bare["samples"]), bare
        assert bare_lost["samples"] == [(c - b) * steps / 2 for c, b in zip(bare["samples"], base, strict=True)]
        # Each checkpoint's save time, against which the target's condition (an interval longer
        # than the save time) is checked: one per committed save, as the phases have them.
        save_time = p3["ckptd: save time of a checkpoint"]
        assert len(save_time["samples"]) == 6 and all(s > 0 for s in save_time["samples"]), save_time
    # P9: both modes measured on the real monitor through node and zone relays.
    p9 = {r["method"]: r for r in result["rows"] if r["scenario"] == "P9 scale"}
    for mode in ("spread", "burst"):
        latency = next(r for m, r in p9.items() if m.startswith(f"commit latency after the last unit p99, {mode}"))
        assert 0 < latency["median"] < 60
        calls = next(r for m, r in p9.items() if m.startswith(f"monitor calls per step, {mode}"))
        assert calls["median"] >= 1
