"""tuner.stats checked against independent references: scipy's own tests and intervals, closed forms, and
simulation of the coverage the bounds promise (fixed seeds, so each run draws the same samples)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest, norm

from tuner import stats


# ---------------------------------------------------------------------------------- attainment / bounds ---- #
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_attainment_verdict_agrees_with_scipy_binomtest(confidence: float):
    """meets <=> the one-sided exact test rejects 'share < target'; misses <=> it rejects 'share >= target'."""
    alpha = 1.0 - confidence
    checked = {stats.MEETS: 0, stats.MISSES: 0, stats.INDETERMINATE: 0}
    for n in (1, 5, 20, 59, 100, 299, 500):
        for target in (0.5, 0.9, 0.95, 0.99):
            for k in sorted({0, 1, n // 2, int(n * target) - 2, int(n * target), n - 1, n} & set(range(n + 1))):
                greater = binomtest(k, n, target, alternative="greater").pvalue
                less = binomtest(k, n, target, alternative="less").pvalue
                expected = stats.MEETS if greater <= alpha else stats.MISSES if less <= alpha else stats.INDETERMINATE
                got = stats.attainment_verdict(k, n, target, confidence)
                assert got == expected, (k, n, target, confidence, greater, less)
                checked[got] += 1
    assert all(checked.values()), checked  # the grid exercised every verdict
    assert stats.attainment_verdict(0, 0, 0.9) == stats.INDETERMINATE


@pytest.mark.parametrize("target,expected", [(0.5, 5), (0.9, 29), (0.95, 59), (0.99, 299)])
def test_min_samples_to_meet(target: float, expected: int):
    n = stats.min_samples_to_meet(target, 0.95)
    assert n == expected
    # the smallest n at which all-successes is significant by scipy's exact test, and one fewer is not
    assert binomtest(n, n, target, alternative="greater").pvalue <= 0.05
    assert binomtest(n - 1, n - 1, target, alternative="greater").pvalue > 0.05
    assert stats.attainment_verdict(n, n, target) == stats.MEETS
    assert stats.attainment_verdict(n - 1, n - 1, target) != stats.MEETS


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (10, 10), (3, 200), (150, 200), (999, 1000)])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_proportion_bounds_equal_scipy_one_sided_exact_intervals(k: int, n: int, confidence: float):
    lower, upper = stats.proportion_bounds(k, n, confidence)
    ref_lower = binomtest(k, n, alternative="greater").proportion_ci(confidence, method="exact").low
    ref_upper = binomtest(k, n, alternative="less").proportion_ci(confidence, method="exact").high
    assert lower == pytest.approx(ref_lower, abs=1e-9)
    assert upper == pytest.approx(ref_upper, abs=1e-9)
    assert lower <= k / n <= upper


def test_proportion_bounds_zero_successes_is_the_rule_of_three():
    """0 of n: the exact 95% upper bound is 1 - 0.05^(1/n) (about 3/n)."""
    for n in (20, 100, 1000):
        assert stats.proportion_bounds(0, n, 0.95)[1] == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)


@pytest.mark.parametrize("q,n", [(0.5, 40), (0.9, 100), (0.99, 400)])
def test_quantile_bounds_cover_the_true_quantile(q: float, n: int):
    """Simulated coverage of each one-sided 95% bound on the q-quantile of Exp(1) (true value -ln(1-q)) is at least
    95% (order statistics are exact, so it cannot be materially lower), and not absurdly conservative."""
    rng = np.random.default_rng(7)
    truth = -math.log(1.0 - q)
    reps = 1000
    lower_ok = upper_ok = 0
    for _ in range(reps):
        lo, hi = stats.quantile_bounds(rng.exponential(size=n).tolist(), q, 0.95)
        assert lo is not None and hi is not None and lo <= hi
        lower_ok += lo <= truth
        upper_ok += hi >= truth
    slack = 3 * math.sqrt(0.05 * 0.95 / reps)  # three binomial standard errors of the simulation
    for covered in (lower_ok / reps, upper_ok / reps):
        assert 0.95 - slack <= covered <= 0.995, (q, n, lower_ok, upper_ok)


def test_quantile_upper_bound_on_p99_needs_299_samples():
    xs = list(range(298))
    assert stats.quantile_bounds(xs, 0.99)[1] is None
    assert stats.quantile_bounds(xs + [298], 0.99)[1] == 298  # with 299 samples, the largest one


def test_quantile_bounds_bracket_numpy_quantile():
    xs = np.random.default_rng(3).normal(size=500)
    for q in (0.5, 0.9, 0.95):
        lo, hi = stats.quantile_bounds(xs.tolist(), q)
        assert lo < float(np.quantile(xs, q)) < hi


# ------------------------------------------------------------------------------------------- paired ---- #
def test_mcnemar_p_is_the_exact_binomial_test_on_discordant_pairs():
    for a, b in [(0, 0), (3, 0), (10, 2), (5, 5), (40, 25)]:
        n = a + b
        # exact two-sided test of a ~ Bin(a + b, 1/2): twice the smaller tail, capped at 1
        ref = 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2**n)
        assert stats.mcnemar_p(a, b) == pytest.approx(ref, rel=1e-9)
        assert stats.mcnemar_p(a, b) == pytest.approx(stats.mcnemar_p(b, a), rel=1e-12)


def _paired_diffs(rng: np.random.Generator, n: int, p_base_only: float, p_cand_only: float) -> np.ndarray:
    """Per-item (baseline - candidate) in {-1, 0, 1}."""
    u = rng.random(n)
    return np.where(u < p_base_only, 1.0, np.where(u < p_base_only + p_cand_only, -1.0, 0.0))


def test_paired_bootstrap_agrees_with_normal_approximation_on_large_n():
    """Two strata of 5,000 items (suite = mean of the strata): the bootstrap's one-sided 95% bounds match
    estimate -/+ z * sqrt(sum var_s / n_s) / 2 to within a few percent of the half-width."""
    rng = np.random.default_rng(11)
    strata = [_paired_diffs(rng, 5000, 0.08, 0.05), _paired_diffs(rng, 5000, 0.12, 0.04)]
    est, lo, hi = stats.paired_bootstrap_ci([s.tolist() for s in strata], 0.95, n_boot=4000, seed=1)
    mean = float(np.mean([s.mean() for s in strata]))
    se = math.sqrt(sum(s.var(ddof=1) / len(s) for s in strata)) / len(strata)
    half = norm.ppf(0.95) * se
    assert est == pytest.approx(mean, abs=1e-12)
    assert lo == pytest.approx(mean - half, abs=0.06 * half)
    assert hi == pytest.approx(mean + half, abs=0.06 * half)


def test_paired_bootstrap_covers_the_true_difference():
    """Simulated coverage of the upper bound at 90% (moderate n, 300 repetitions)."""
    rng = np.random.default_rng(5)
    truth = 0.10 - 0.04
    covered = 0
    reps = 300
    for i in range(reps):
        strata = [_paired_diffs(rng, 400, 0.10, 0.04).tolist() for _ in range(2)]
        _, _, hi = stats.paired_bootstrap_ci(strata, 0.90, n_boot=1000, seed=i)
        covered += hi >= truth
    assert covered / reps >= 0.90 - 3 * math.sqrt(0.9 * 0.1 / reps)


def test_detectable_difference_is_the_95th_percentile_of_a_null_paired_mean():
    """Under no true difference with discordance d, the mean of n paired diffs exceeds detectable_difference(n, d)
    about 5% of the time (simulated)."""
    rng = np.random.default_rng(2)
    n, d = 400, 0.1
    means = np.array([_paired_diffs(rng, n, d / 2, d / 2).mean() for _ in range(4000)])
    dd = stats.detectable_difference(n, d, 0.95)
    assert float(np.mean(means > dd)) == pytest.approx(0.05, abs=0.015)


@pytest.mark.parametrize("budget,d", [(0.01, 0.05), (0.02, 0.2), (0.005, 0.01)])
def test_items_to_detect_is_the_smallest_count_that_detects_the_budget(budget: float, d: float):
    n = stats.items_to_detect(budget, d)
    assert stats.detectable_difference(n, d) <= budget + 1e-12
    assert stats.detectable_difference(n - 1, d) > budget
