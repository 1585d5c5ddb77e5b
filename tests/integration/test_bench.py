"""The benchmark runs end to end in smoke mode and reports every scenario (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_smoke_reports_every_scenario(tmp_path):
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--json", str(out), "--dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    scenarios = {r["scenario"] for r in result["rows"]}
    assert scenarios == {"P1 blocked", "P2 durable", "P3 training", "P4 monitor", "P5 peak RSS", "P6 mirror",
                         "P7 version latency", "P7 verified load", "P8 FSDP2 blocked", "P8 FSDP2 durable"}
    assert all(r["samples"] and r["min"] <= r["median"] <= r["max"] for r in result["rows"])
    assert set(result["targets"]) == {
        "P1 eager blocked / memcpy", "P1 fenced blocked / memcpy", "P2 ckptd durable / safetensors+fsync",
        "P3 ckptd slowdown %", "P4 commit latency p50 (ms)", "P4 commit latency p99 (ms)",
        "P4 notifications per second", "P5 ckptd peak RSS / state", "P7 subscriber latency p50 (ms)",
        "P7 ckptd load_into / load_file+load_state_dict", "P8 ckptd fenced blocked / dcp.async_save",
        "P8 ckptd eager blocked / dcp.async_save", "P8 ckptd durable / dcp.save"}
    assert {r["method"] for r in result["rows"] if r["scenario"] == "P8 FSDP2 durable"} == {
        "ckptd fenced", "ckptd eager", "dcp.async_save", "dcp.save"}
    assert "| P1 blocked | ckptd fenced staging |" in proc.stdout
    assert {r["method"] for r in result["rows"] if r["scenario"] == "P7 version latency"} == {
        "ckptd subscriber p50", "ckptd subscriber p99", "tracker polling 1 s p50", "tracker polling 1 s p99"}
