"""The benchmark's verdicts as printed: reasons for inconclusive, percent targets, smoke runs, and
when the RAM-backed P2 run is skipped."""

from __future__ import annotations

from bench.__main__ import ram_dir_problem
from bench.common import MiB, Row
from bench.report import limit_of, paired_checks, single_checks, targets_table
from bench.training import interval_condition
from bench.verdicts import Comparison, judge


def _pair(a: list[float], b: list[float]) -> tuple[Row, Row]:
    return Row("P2 durable (disk, 64 MiB)", "ckptd", "s", a), Row("P2 durable (disk, 64 MiB)", "st", "s", b)


def test_a_straddling_interval_is_inconclusive_and_says_why():
    a, b = _pair([1.0, 1.3, 0.9, 1.2, 1.05], [1.0] * 5)
    t = judge(Comparison("P2 ckptd durable / safetensors+fsync (disk, 64 MiB)", a, b, noise="disk writeback noise"),
              1.1)
    assert t["verdict"] == "inconclusive" and t["low"] < 1.1 < t["high"]
    assert t["reason"].startswith(f"interval {t['low']:.3g} to {t['high']:.3g} straddles 1.1: disk writeback noise")
    assert "only 5 pairs: use --pairs 9" in t["reason"]
    assert t["a"]["samples"] == a.samples and t["b"]["samples"] == b.samples


def test_clear_results_are_met_or_missed_and_a_smoke_run_never_is():
    a, b = _pair([0.5 + i * 0.001 for i in range(9)], [1.0] * 9)
    c = Comparison("P1 eager blocked / memcpy", a, b)
    assert judge(c, limit_of(c.target))["verdict"] == "met" and judge(c, 0.4)["verdict"] == "missed"
    # Where the difference goes is said with a verdict that is not met, and only then.
    c.detail = "of a step, 4.5 % in ckptd calls"
    assert judge(c, 0.4)["reason"] == c.detail and judge(c, limit_of(c.target))["reason"] == ""
    assert judge(c, 1.2)["reason"] == ""
    smoke = judge(c, 1.2, smoke=True)
    assert (smoke["verdict"], smoke["reason"]) == ("inconclusive", "smoke run: tiny sizes and few pairs")


def test_a_slowdown_target_is_judged_in_percent():
    base = Row("P3", "none", "s/step", [1.0] * 9)
    slow = Row("P3", "ckptd", "s/step", [1.05] * 9)
    t = paired_checks([Comparison("P3 ckptd slowdown % (python)", slow, base, percent=True)], smoke=False)
    t = t["P3 ckptd slowdown % (python)"]
    assert abs(t["value"] - 5.0) < 1e-9 and t["target"] == 3.0 and t["verdict"] == "missed"
    assert abs(t["ratio"] - 1.05) < 1e-9
    table = targets_table({"P3 ckptd slowdown % (python)": t}, [("P2 (RAM)", "/nope does not exist")])
    assert "| P3 ckptd slowdown % (python) | 5 | 5 – 5 | ≤ 3 | 9 | missed |" in table
    assert "| P2 (RAM) | – | – | – | – | skipped | /nope does not exist |" in table


def test_a_run_outside_the_targets_condition_is_inconclusive_whatever_it_measured():
    """P3's target holds "when the checkpoint interval is longer than the save time": a run whose
    saves took longer than its interval measured something else, and says so."""
    base = Row("P3", "none", "s/step", [1.0] * 9)
    slow = Row("P3", "ckptd", "s/step", [1.20] * 9)
    outside, had = interval_condition(interval=1.0, save_times=[0.9, 1.4, 1.6])
    assert "not longer than the save time" in outside and "--py-every" in outside and "1.4 s" in had
    t = judge(Comparison("P3 ckptd slowdown % (python)", slow, base, percent=True, outside=outside), 3.0)
    assert t["verdict"] == "inconclusive" and t["reason"] == f"outside the target's condition: {outside}"
    # Within the condition the same figures are judged as they are; the condition is in the reason.
    outside, had = interval_condition(interval=2.0, save_times=[0.9, 1.4, 1.6])
    assert outside == "" and had.endswith("(within the target's condition)")
    t = judge(Comparison("P3 ckptd slowdown % (python)", slow, base, percent=True, detail=had), 3.0)
    assert t["verdict"] == "missed" and t["reason"] == had
    assert interval_condition(1.0, [])[0] == ""  # no save time read back: the condition cannot be checked
    # A smoke run stays a smoke run.
    assert "smoke" in judge(Comparison("P3", slow, base, percent=True, outside="x"), 3.0, smoke=True)["reason"]


def test_the_ram_run_is_skipped_with_a_reason(tmp_path):
    assert ram_dir_problem(str(tmp_path), 1) is None
    assert "does not exist" in ram_dir_problem(str(tmp_path / "missing"), 1)
    assert "MiB free, the run needs" in ram_dir_problem(str(tmp_path), 1 << 62)
    assert ram_dir_problem("", MiB) == "--ram-dir '' given"


def test_qualified_target_names_find_their_limit_and_direction():
    assert limit_of("P2 ckptd durable / safetensors+fsync (RAM, 64 MiB)") == 1.1
    assert limit_of("P4 commit latency p50 (ms)") == limit_of("P4 commit latency p50 (ms) (disk)") == 20.0
    rows = [Row("P4 monitor (disk)", "notifications per second", "1/s", [1500.0]),
            Row("P4 monitor (RAM)", "notifications per second", "1/s", [2500.0])]
    checks = single_checks(rows)
    # A rate is a minimum on every filesystem: below it is missed, above it met.
    assert checks["P4 notifications per second (disk)"]["verdict"] == "missed"
    assert checks["P4 notifications per second (RAM)"]["verdict"] == "met"
    assert "| P4 notifications per second (disk) | 1.5e+03 | – | ≥ 2000 |" in targets_table(checks, [])


def test_p4s_rate_is_judged_by_its_interval_over_the_steps_wall_times():
    """With each step's wall time, the rate gets a bootstrap interval: a run whose steps spread
    across the limit is inconclusive, with the reason, not met or missed on one number."""
    def rows(step_s: list[float]) -> list[Row]:
        rate = 1000 * len(step_s) / sum(step_s)  # 1,000 notifications a step
        return [Row("P4 monitor (disk)", "notifications per second", "1/s", [rate]),
                Row("P4 monitor (disk)", "wall time, each step", "s", step_s),
                Row("P4 monitor (disk)", "notifications per second, monitor alone", "1/s", [9e9])]
    steady = single_checks(rows([0.4, 0.41, 0.39, 0.4] * 10))["P4 notifications per second (disk)"]
    assert steady["verdict"] == "met" and steady["value"] == 2500 and steady["n"] == 40
    assert 2000 < steady["low"] <= 2500 <= steady["high"] and steady["note"].startswith("the rate over 40 steps")
    spread = single_checks(rows([0.3, 0.7] * 20))["P4 notifications per second (disk)"]
    assert spread["verdict"] == "inconclusive" and spread["low"] < 2000 < spread["high"]
    assert "straddles 2000" in spread["note"] and "more steps narrow it" in spread["note"]
    slow = single_checks(rows([0.7, 0.72, 0.69] * 10))["P4 notifications per second (disk)"]
    assert slow["verdict"] == "missed" and slow["high"] < 2000
    table = targets_table({"P4 notifications per second (disk)": steady}, [])
    assert "| P4 notifications per second (disk) | 2.5e+03 | " in table and "| ≥ 2000 | 40 samples | met |" in table


def test_commit_latency_percentiles_are_judged_by_their_interval_over_the_steps():
    """P4's p50 and p99 come from every step's latency with a bootstrap interval, like the paired
    targets: a p99 that one slow commit decides is inconclusive, with the reason, not missed."""
    fast = [0.010 + 0.0002 * i for i in range(49)]
    rows = [Row("P4 monitor (disk)", "commit latency, each step", "s", fast + [0.145]),
            Row("P4 monitor (RAM)", "commit latency, each step", "s", fast + [0.030])]
    checks = single_checks(rows)
    p99 = checks["P4 commit latency p99 (ms) (disk)"]
    assert p99["verdict"] == "inconclusive" and p99["low"] < 100 < p99["high"] and p99["n"] == 50
    assert "straddles 100" in p99["note"] and "more steps" in p99["note"]
    assert checks["P4 commit latency p99 (ms) (RAM)"]["verdict"] == "met"
    assert checks["P4 commit latency p50 (ms) (disk)"]["verdict"] == "met"
    assert checks["P4 commit latency p50 (ms) (disk)"]["high"] <= 20
    table = targets_table(checks, [])
    assert "| P4 commit latency p99 (ms) (disk) |" in table and "| ≤ 100 | 50 samples | inconclusive |" in table
    steps = single_checks([Row("P9 scale", "commit latency after the last unit, each step, spread", "s",
                               [0.44, 0.45, 0.46, 0.47, 1.2])])["P9 commit latency after the last unit p99 (ms)"]
    assert steps["verdict"] == "inconclusive" and steps["n"] == 5
    assert steps["note"].startswith("the p99 of 5 steps (the burst mode's") and "one slow step on" in steps["note"]
    smoke = single_checks(rows, smoke=True)["P4 commit latency p99 (ms) (RAM)"]
    assert (smoke["verdict"], smoke["note"]) == ("inconclusive", "smoke run: tiny sizes")
