"""The benchmark's P4..P8 in smoke mode (P1..P3 and P9: test_bench.py): every scenario runs and
every target gets a verdict (inconclusive, in a smoke run; no timing asserted)."""

from __future__ import annotations

from .helpers import run_bench_smoke

SINGLE = {"P4 commit latency p50 (ms) (disk)", "P4 commit latency p99 (ms) (disk)",
          "P4 notifications per second (disk)",
          "P5 ckptd peak RSS / state", "P7 subscriber latency p50 (ms)",
          "P7 ckptd load_into / load_file+load_state_dict", "P8 ckptd fenced blocked / dcp.async_save",
          "P8 ckptd eager blocked / dcp.async_save", "P8 ckptd durable / dcp.save"}


def test_bench_smoke_runs_the_monitor_memory_mirror_rollout_and_fsdp_scenarios(ray_local, tmp_path):
    _proc, result = run_bench_smoke(tmp_path, "P4,P5,P6,P7,P8")
    assert {r["scenario"] for r in result["rows"]} == {
        "P4 monitor (disk)", "P5 peak RSS", "P6 mirror", "P7 version latency", "P7 verified load",
        "P8 FSDP2 blocked", "P8 FSDP2 durable"}
    targets = result["targets"]
    assert set(targets) == SINGLE
    assert result["skipped"] == {"P4 (RAM)": "smoke run: the disk run covers the same code"}
    assert all(targets[n]["verdict"] == "inconclusive" and "smoke" in targets[n]["note"] for n in SINGLE)
    rate, steps = targets["P4 notifications per second (disk)"], [
        r for r in result["rows"] if r["scenario"] == "P4 monitor (disk)" and r["method"] == "wall time, each step"]
    assert len(steps) == 1 and rate["n"] == len(steps[0]["samples"]) and rate["low"] <= rate["value"] <= rate["high"]
    assert {r["method"] for r in result["rows"] if r["scenario"] == "P8 FSDP2 durable"} == {
        "ckptd fenced", "ckptd eager", "dcp.async_save", "dcp.save"}
    assert {r["method"] for r in result["rows"] if r["scenario"] == "P7 version latency"} == {
        "ckptd subscriber p50", "ckptd subscriber p99", "tracker polling 1 s p50", "tracker polling 1 s p99"}
