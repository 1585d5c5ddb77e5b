"""The targets and how the bench judges them; the Markdown tables it prints.

P1, P2 and P3 targets are ratios measured as interleaved pairs: each gets an interval and a
verdict from :func:`bench.verdicts.judge` (met / missed / inconclusive, with the reason).
Percentiles of commit latencies (P4, P9) are judged the same way, by a bootstrap interval over
their steps, and so is P4's rate (by its steps' wall times). The other targets are single values:
a latency median of one run and a memory ratio get met / missed; ratios of two medians that were
not paired get no verdict ("indicative").
"""

from __future__ import annotations

from .common import Row
from .monitor_scale import COMMIT_LATENCIES, STEP_TIMES
from .scale import EACH_STEP
from .stats import Estimate, Verdict, bootstrap_quantile, bootstrap_rate, verdict
from .verdicts import Comparison, judge

P2_TARGET = "P2 ckptd durable / safetensors+fsync"
P3_TARGET = "P3 ckptd slowdown %"

#: Every target and its limit (an upper bound, except the rate marked as a minimum).
TARGETS = {
    "P1 eager blocked / memcpy": 1.2,
    "P1 fenced blocked / memcpy": 0.1,
    P2_TARGET: 1.1,  # at every size, on the disk and on a RAM-backed directory
    P3_TARGET: 3.0,  # each training stand-in
    "P4 commit latency p50 (ms)": 20.0,
    "P4 commit latency p99 (ms)": 100.0,
    "P4 notifications per second": 2000.0,  # a minimum
    "P5 ckptd peak RSS / state": 2.2,
    "P7 subscriber latency p50 (ms)": 20.0,
    "P7 ckptd load_into / load_file+load_state_dict": 1.2,
    "P8 ckptd fenced blocked / dcp.async_save": 0.5,
    "P8 ckptd eager blocked / dcp.async_save": 0.5,
    "P8 ckptd durable / dcp.save": 1.1,
    "P9 commit latency after the last unit p99 (ms)": 1000.0,  # 10,000 ranks x 4 units, spread writes
}
MINIMUMS = {"P4 notifications per second"}


def base_of(name: str) -> str:
    """The target a name measures, without its qualifier: ``P2 ... (disk, 64 MiB)`` -> ``P2 ...``."""
    return name if name in TARGETS else name.rsplit(" (", 1)[0]


def limit_of(name: str) -> float:
    """The limit of a target name, which may carry a qualifier: ``P2 ... (disk, 64 MiB)``."""
    return TARGETS[base_of(name)]


def _find(rows: list[Row], scenario: str, method: str) -> Row | None:
    return next((r for r in rows if r.scenario == scenario and r.method.startswith(method)), None)


def paired_checks(comparisons: list[Comparison], smoke: bool) -> dict[str, dict]:
    """Each paired target's ratio, interval and verdict."""
    return {c.target: judge(c, limit_of(c.target), smoke=smoke) for c in comparisons}


def single_checks(rows: list[Row], smoke: bool = False) -> dict[str, dict]:
    """The targets measured as single values (P4..P8)."""
    out: dict[str, dict] = {}

    def add(name: str, value: float | None, note: str, judged: bool = True) -> None:
        if value is None:
            return
        target = limit_of(name)
        met = value >= target if base_of(name) in MINIMUMS else value <= target
        verdict = ("met" if met else "missed") if judged else "indicative"
        if smoke:
            verdict, judged, note = "inconclusive", False, "smoke run: tiny sizes"
        out[name] = {"value": value, "target": target, "verdict": verdict, "met": met if judged else None,
                     "note": note}

    def add_estimate(name: str, est: Estimate, note: str, straddles: str) -> None:
        """A target judged like a ratio, by its bootstrap interval; ``straddles`` says why an
        interval across the limit cannot decide."""
        target = limit_of(name)
        v = verdict(est, **{"at_least" if base_of(name) in MINIMUMS else "at_most": target})
        if smoke:
            v, note = Verdict.INCONCLUSIVE, "smoke run: tiny sizes"
        elif v is Verdict.INCONCLUSIVE:
            note += f"; interval {est.low:.3g} to {est.high:.3g} straddles {target:g}: {straddles}"
        out[name] = {"value": est.value, "low": est.low, "high": est.high, "n": est.n, "target": target,
                     "verdict": v.value, "met": {Verdict.MET: True, Verdict.MISSED: False}.get(v), "note": note}

    def add_quantile(name: str, samples: list[float], q: float, what: str, extra: str = "") -> None:
        """A percentile (in ms) by its interval over ``samples``; ``what``: a plural noun ("commits")."""
        est = bootstrap_quantile([x * 1000 for x in samples], q)
        add_estimate(name, est, f"the p{q * 100:g} of {est.n} {what}{extra}",
                     f"decided by the slowest {max(1, round(est.n * (1 - q)))} or so, and one slow {what[:-1]} "
                     "on this VM moves it; more steps narrow it")

    for label in ("disk", "RAM"):  # the root on the disk, then on a RAM-backed directory
        scenario = f"P4 monitor ({label})"
        r = _find(rows, scenario, COMMIT_LATENCIES)
        if r:
            add_quantile(f"P4 commit latency p50 (ms) ({label})", r.samples, 0.5, "commits")
            add_quantile(f"P4 commit latency p99 (ms) ({label})", r.samples, 0.99, "commits")
        r, times = _find(rows, scenario, "notifications"), _find(rows, scenario, STEP_TIMES)
        if r and times:  # as many notifications each step: the run's total, shared out
            total = r.median * sum(times.samples)
            est = bootstrap_rate([total / len(times.samples)] * len(times.samples), times.samples)
            add_estimate(f"P4 notifications per second ({label})", est,
                         f"the rate over {est.n} steps, interval from their wall times (a slower day moves all)",
                         "the steps vary that much; more steps narrow it")
        elif r:
            add(f"P4 notifications per second ({label})", r.median, "one long run: a rate over all its notifications")
    r = _find(rows, "P5 peak RSS", "ckptd")
    if r:
        add("P5 ckptd peak RSS / state", r.median, "memory, not time: little noise")
    r = _find(rows, "P7 version latency", "ckptd subscriber p50")
    if r:
        add("P7 subscriber latency p50 (ms)", r.median * 1000, "one run: the median over its versions")
    unpaired = "ratio of two medians, not paired: no verdict"
    ck = _find(rows, "P7 verified load", "ckptd load_into")
    st = _find(rows, "P7 verified load", "safetensors load_file + load_state_dict")
    if ck and st:
        add("P7 ckptd load_into / load_file+load_state_dict", ck.median / st.median, unpaired, judged=False)
    dcp_async = _find(rows, "P8 FSDP2 blocked", "dcp.async_save")
    for method, name in (("ckptd fenced", "P8 ckptd fenced blocked / dcp.async_save"),
                         ("ckptd eager", "P8 ckptd eager blocked / dcp.async_save")):
        r = _find(rows, "P8 FSDP2 blocked", method)
        if r and dcp_async:
            add(name, r.median / dcp_async.median, unpaired, judged=False)
    r = _find(rows, "P9 scale", f"{EACH_STEP}, spread")
    if r:
        add_quantile("P9 commit latency after the last unit p99 (ms)", r.samples, 0.99, "steps",
                     " (the burst mode's p99 is a row above, not a target)")
    # ckptd's durable time is the slower of its two modes: both must meet the target.
    ck_rows = [r for m in ("ckptd fenced", "ckptd eager") if (r := _find(rows, "P8 FSDP2 durable", m))]
    st = _find(rows, "P8 FSDP2 durable", "dcp.save")
    if ck_rows and st:
        add("P8 ckptd durable / dcp.save", max(r.median for r in ck_rows) / st.median, unpaired, judged=False)
    return out


def rows_table(rows: list[Row]) -> str:
    lines = ["| scenario | method | median | min–max | n | note |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        scale, unit = (1000, "ms") if r.unit in ("s", "s/step") else (1, r.unit)
        unit = f"{unit}/step" if r.unit == "s/step" else unit
        lines.append(f"| {r.scenario} | {r.method} | {r.median * scale:.4g} {unit} | "
                     f"{min(r.samples) * scale:.4g}–{max(r.samples) * scale:.4g} | {len(r.samples)} | {r.note} |")
    return "\n".join(lines)


def targets_table(targets: dict[str, dict], skipped: list[tuple[str, str]]) -> str:
    lines = ["| target | measured | 95 % interval | limit | pairs | verdict | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, t in targets.items():
        bound = f"{'≥' if base_of(name) in MINIMUMS else '≤'} {t['target']:g}"
        if "pairs" in t or "n" in t:
            interval = f"{t['low']:.3g} – {t['high']:.3g}"
            n, why = (t["pairs"], t["reason"]) if "pairs" in t else (f"{t['n']} samples", t["note"])
            lines.append(f"| {name} | {t['value']:.3g} | {interval} | {bound} | {n} | {t['verdict']} | {why} |")
        else:
            lines.append(f"| {name} | {t['value']:.3g} | – | {bound} | – | {t['verdict']} | {t['note']} |")
    for name, why in skipped:
        lines.append(f"| {name} | – | – | – | – | skipped | {why} |")
    return "\n".join(lines)
