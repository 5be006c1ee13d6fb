"""Statistics behind every verdict: one home for confidence bounds and tests (scipy, imported when used).

* Percentile bounds are distribution-free (order statistics): the number of samples at or below the true
  q-quantile is Binomial(n, q), so an order statistic is a one-sided confidence bound for it. The same binomial
  argument decides "is the q-quantile below LIMIT?" from the count of samples at or below LIMIT, which is also the
  test of a per-request SLO attainment ("share of requests within every target >= q"): one function serves both.
* A verdict is `meets` when the bound is met with the given confidence, `misses` when it is exceeded with that
  confidence, else `indeterminate` (more samples are needed; never a coin flip).
* Paired comparison of two scorers on the same items: McNemar's exact test and a stratified paired bootstrap of the
  difference in mean accuracy (strata = tasks, the suite score being the mean over tasks).

Caveat stated once: requests of one load test are not independent (they share queues), so these bounds are the
usual i.i.d. approximation, as in every serving benchmark that reports percentile confidence intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MEETS, MISSES, INDETERMINATE = "meets", "misses", "indeterminate"
VERDICTS = (MEETS, MISSES, INDETERMINATE)
DEFAULT_CONFIDENCE = 0.95


def _check_confidence(confidence: float) -> float:
    if not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence {confidence!r} must be in (0.5, 1)")
    return confidence


def proportion_bounds(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds (lower, upper), each holding with `confidence`, for a proportion k/n."""
    from scipy.stats import beta

    _check_confidence(confidence)
    if n <= 0:
        return 0.0, 1.0
    alpha = 1.0 - confidence
    lower = 0.0 if k <= 0 else float(beta.ppf(alpha, k, n - k + 1))
    upper = 1.0 if k >= n else float(beta.ppf(1.0 - alpha, k + 1, n - k))
    return lower, upper


def attainment_verdict(k: int, n: int, target: float, confidence: float = DEFAULT_CONFIDENCE) -> str:
    """Is the share of successes (k of n) at least `target`? `meets` when the one-sided lower bound is >= target,
    `misses` when the upper bound is < target, else `indeterminate`. Exact binomial, no normal approximation."""
    from scipy.stats import binom

    _check_confidence(confidence)
    if n <= 0:
        return INDETERMINATE
    alpha = 1.0 - confidence
    # meets: reject "true share < target" -- P(Bin(n, target) >= k) <= alpha
    if binom.sf(k - 1, n, target) <= alpha:
        return MEETS
    # misses: reject "true share >= target" -- P(Bin(n, target) <= k) <= alpha
    if binom.cdf(k, n, target) <= alpha:
        return MISSES
    return INDETERMINATE


def min_samples_to_meet(target: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """The fewest samples that can give `meets` (all of them successes): target^n <= 1 - confidence.
    p50: 5, p90: 29, p95: 59, p99: 299 at 95% confidence."""
    _check_confidence(confidence)
    if target <= 0:
        return 1
    if target >= 1:
        raise ValueError("target 1.0 can never be shown with finite samples")
    return max(1, math.ceil(math.log(1.0 - confidence) / math.log(target) - 1e-9))


def quantile_bounds(values: Sequence[float], q: float, confidence: float = DEFAULT_CONFIDENCE
                    ) -> tuple[float | None, float | None]:
    """Distribution-free one-sided bounds (lower, upper) for the q-quantile, each with `confidence`: order statistics
    chosen from Binomial(n, q). None where n is too small for that side (e.g. an upper bound on p99 needs n >= 299
    at 95%). Values may include math.inf (a failed request counts as an infinite latency)."""
    from scipy.stats import binom

    _check_confidence(confidence)
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return None, None
    alpha = 1.0 - confidence
    # lower: X_(j) <= xi_q holds when at least j samples are <= xi_q: P(B >= j) = sf(j-1) >= confidence
    j = int(binom.ppf(alpha, n, q))  # largest j with P(B < j) <= alpha (approximately): check and adjust
    while j >= 1 and binom.sf(j - 1, n, q) < confidence:
        j -= 1
    while j + 1 <= n and binom.sf(j, n, q) >= confidence:
        j += 1
    lower = xs[j - 1] if j >= 1 else None
    # upper: X_(k) >= xi_q holds when at most k-1 samples are <= xi_q: P(B <= k-1) = cdf(k-1) >= confidence
    k = int(binom.ppf(confidence, n, q)) + 1
    while k - 1 >= 1 and binom.cdf(k - 2, n, q) >= confidence:
        k -= 1
    upper = xs[k - 1] if k <= n else None
    return lower, upper


def quantile_ci(values: Sequence[float], q: float, confidence: float = DEFAULT_CONFIDENCE
                ) -> tuple[float | None, float | None]:
    """Two-sided distribution-free interval for the q-quantile at `confidence` (each side at (1+confidence)/2)."""
    return quantile_bounds(values, q, 0.5 + confidence / 2.0)


def mean_bounds(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE) -> tuple[float | None, float | None]:
    """One-sided Student-t bounds (lower, upper) for the mean; None with fewer than 2 finite values."""
    from scipy.stats import t

    xs = [float(v) for v in values]
    if len(xs) < 2 or not all(math.isfinite(v) for v in xs):
        return None, None
    n = len(xs)
    m = sum(xs) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in xs) / (n - 1))
    half = float(t.ppf(confidence, n - 1)) * sd / math.sqrt(n)
    return m - half, m + half


def bound_verdict(values: Sequence[float], stat: str, limit: float, confidence: float = DEFAULT_CONFIDENCE) -> str:
    """Verdict for `stat(values) <= limit`, stat in p50/p90/p95/p99/mean. Infinite values (failed requests) count
    against the bound."""
    if not values:
        return INDETERMINATE
    if stat == "mean":
        if any(not math.isfinite(v) for v in values):
            return MISSES if sum(1 for v in values if math.isfinite(v)) == 0 else INDETERMINATE
        lo, hi = mean_bounds(values, confidence)
        if hi is not None and hi <= limit:
            return MEETS
        if lo is not None and lo > limit:
            return MISSES
        return INDETERMINATE
    q = float(stat.lstrip("p")) / 100.0
    k = sum(1 for v in values if v <= limit)
    return attainment_verdict(k, len(values), q, confidence)


def combine_verdicts(verdicts: Sequence[str]) -> str:
    """All bounds must hold: any `misses` -> misses; all `meets` -> meets; else indeterminate."""
    if any(v == MISSES for v in verdicts):
        return MISSES
    if verdicts and all(v == MEETS for v in verdicts):
        return MEETS
    return INDETERMINATE


# ------------------------------------------------------------------------------ paired comparisons ---- #
def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts (a right / b wrong, and the reverse)."""
    from scipy.stats import binomtest

    n = only_a + only_b
    if n == 0:
        return 1.0
    return float(binomtest(only_a, n, 0.5, alternative="two-sided").pvalue)


def paired_bootstrap_ci(diffs_by_stratum: Sequence[Sequence[float]], confidence: float = DEFAULT_CONFIDENCE,
                        n_boot: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Stratified paired bootstrap of the mean over strata of the per-stratum mean difference.

    `diffs_by_stratum[s][i]` is (baseline - candidate) on item i of stratum s (e.g. 1 - 0 when only the baseline
    was right). Returns (estimate, lower, upper): two one-sided percentile bounds, each at `confidence`."""
    import numpy as np

    _check_confidence(confidence)
    strata = [np.asarray(d, dtype=float) for d in diffs_by_stratum if len(d)]
    if not strata:
        raise ValueError("no paired items")
    rng = np.random.default_rng(seed)
    est = float(np.mean([s.mean() for s in strata]))
    boot = np.zeros(n_boot)
    for s in strata:
        idx = rng.integers(0, len(s), size=(n_boot, len(s)))
        boot += s[idx].mean(axis=1)
    boot /= len(strata)
    lo, hi = np.quantile(boot, [1.0 - confidence, confidence])
    return est, float(lo), float(hi)


def detectable_difference(n: int, discordance: float, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """Half-width (as a proportion) of a one-sided paired bound on a difference of accuracies over n items when a
    share `discordance` of the items disagree: z * sqrt(discordance / n). A budget below it cannot be shown."""
    from scipy.stats import norm

    if n <= 0:
        return math.inf
    return float(norm.ppf(confidence)) * math.sqrt(max(discordance, 1e-9) / n)


def items_to_detect(budget: float, discordance: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """Items needed so that `detectable_difference` <= budget (both proportions)."""
    from scipy.stats import norm

    if budget <= 0:
        return 10**9
    z = float(norm.ppf(confidence))
    return math.ceil(max(discordance, 1e-9) * (z / budget) ** 2)
