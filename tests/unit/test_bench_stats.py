"""The benchmark's statistics: interleaving, the bootstrap interval of a ratio, and verdicts."""

from __future__ import annotations

import random

import pytest

from bench.stats import (
    RatioEstimate,
    Verdict,
    bootstrap_quantile,
    bootstrap_rate,
    bootstrap_ratio,
    interleave,
    interleave_rounds,
    verdict,
)


def test_pairs_alternate_which_method_runs_first():
    order = []
    a, b = interleave(lambda: order.append("A") or 1.0, lambda: order.append("B") or 2.0, 4)
    assert order == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert (a, b) == ([1.0] * 4, [2.0] * 4)
    with pytest.raises(ValueError, match="pairs must be >= 1"):
        interleave(lambda: 1.0, lambda: 1.0, 0)


def test_rounds_of_three_methods_rotate_which_goes_first():
    order = []
    runs = [lambda name=name, value=value: order.append(name) or value for name, value in (("A", 1.0), ("B", 2.0),
                                                                                             ("C", 3.0))]
    a, b, c = interleave_rounds(runs, 3)
    assert order == ["A", "B", "C", "B", "C", "A", "C", "A", "B"]
    assert (a, b, c) == ([1.0] * 3, [2.0] * 3, [3.0] * 3)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        interleave_rounds(runs, 0)


def test_a_clear_difference_gives_a_tight_interval_around_the_ratio():
    rng = random.Random(1)
    b = [1.0 + rng.gauss(0, 0.02) for _ in range(15)]
    a = [2.0 * x + rng.gauss(0, 0.02) for x in b]
    est = bootstrap_ratio(a, b)
    assert est.low <= est.ratio <= est.high and 1.9 < est.low and est.high < 2.1 and est.pairs == 15
    assert bootstrap_ratio(a, b) == est  # seeded: the same interval every time
    assert verdict(est, at_most=2.2) is Verdict.MET
    assert verdict(est, at_most=1.5) is Verdict.MISSED
    assert verdict(est, at_least=1.5) is Verdict.MET


def test_disk_like_noise_makes_a_near_target_inconclusive():
    rng = random.Random(2)  # writeback: samples spread from 0.6 s to 3.5 s on both sides
    a = [rng.uniform(0.6, 3.5) for _ in range(9)]
    b = [rng.uniform(0.6, 3.5) for _ in range(9)]
    est = bootstrap_ratio(a, b)
    assert est.low < 1.1 < est.high
    assert verdict(est, at_most=1.1) is Verdict.INCONCLUSIVE


def test_verdicts_at_the_bounds_and_bad_input():
    est = RatioEstimate(1.0, 0.9, 1.1, 9, 0.95)
    assert verdict(est, at_most=1.1) is Verdict.MET  # the whole interval within the bound
    assert verdict(est, at_least=0.9) is Verdict.MET
    assert verdict(est, at_most=1.0) is Verdict.INCONCLUSIVE
    with pytest.raises(ValueError, match="exactly one"):
        verdict(est)
    with pytest.raises(ValueError, match="same number"):
        bootstrap_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        bootstrap_ratio([1.0], [0.0])


def test_a_high_percentile_of_few_samples_is_met_only_when_its_slowest_samples_are_within_the_target():
    """The p99 of 50 commits is their slowest two: all fast is met; one slow commit is not a
    result either way (inconclusive); a slow tail of several is missed."""
    rng = random.Random(1)
    fast = [rng.uniform(10, 40) for _ in range(50)]
    met = bootstrap_quantile(fast, 0.99)
    assert met.n == 50 and met.low <= met.value <= met.high <= max(fast)
    assert verdict(met, at_most=100) is Verdict.MET
    one_slow = bootstrap_quantile(fast[:-1] + [145.0], 0.99)
    assert one_slow.low < 100 < one_slow.high and verdict(one_slow, at_most=100) is Verdict.INCONCLUSIVE
    tail = bootstrap_quantile(fast[:-5] + [150.0, 160.0, 170.0, 180.0, 190.0], 0.99)
    assert verdict(tail, at_most=100) is Verdict.MISSED
    median = bootstrap_quantile(fast, 0.5)
    assert min(fast) < median.low < median.value < median.high < max(fast)
    with pytest.raises(ValueError):
        bootstrap_quantile([], 0.5)
    with pytest.raises(ValueError):
        bootstrap_quantile([1.0], 1.5)


def test_a_rate_over_a_runs_steps_is_its_total_over_its_time_and_its_interval_is_the_steps_spread():
    """P4's rate: as many events each step, each step's wall time. Steady steps give a narrow
    interval on the right side of the limit; steps spread across it give one that straddles it;
    a slow run, every step slow, is missed."""
    rng = random.Random(2)
    steady = [rng.uniform(0.95, 1.05) for _ in range(50)]  # about 2,500 events/s
    est = bootstrap_rate([2500.0] * 50, steady)
    assert est.n == 50 and est.value == pytest.approx(2500 * 50 / sum(steady))
    assert 2300 < est.low <= est.value <= est.high < 2700 and verdict(est, at_least=2000) is Verdict.MET
    spread = [rng.choice([0.8, 1.6]) for _ in range(50)]  # 3,125/s and 1,563/s steps, as a noisy disk gives
    wide = bootstrap_rate([2500.0] * 50, spread)
    assert wide.low < 2000 < wide.high and verdict(wide, at_least=2000) is Verdict.INCONCLUSIVE
    slow = bootstrap_rate([2500.0] * 50, [s * 1.7 for s in steady])
    assert verdict(slow, at_least=2000) is Verdict.MISSED
    with pytest.raises(ValueError, match="as many"):
        bootstrap_rate([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        bootstrap_rate([1.0], [0.0])
