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

import functools
import math
from collections.abc import Sequence

MEETS, MISSES, INDETERMINATE = "meets", "misses", "indeterminate"
VERDICTS = (MEETS, MISSES, INDETERMINATE)
DEFAULT_CONFIDENCE = 0.95


def _check_confidence(confidence: float) -> float:
    if not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence {confidence!r} must be in (0.5, 1)")
    return confidence


def proportion_bounds(k: float, n: float, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds (lower, upper), each holding with `confidence`, for a proportion k/n."""
    from scipy.stats import beta

    _check_confidence(confidence)
    if n <= 0:
        return 0.0, 1.0
    alpha = 1.0 - confidence
    lower = 0.0 if k <= 0 else float(beta.ppf(alpha, k, n - k + 1))
    upper = 1.0 if k >= n else float(beta.ppf(1.0 - alpha, k + 1, n - k))
    return lower, upper


def attainment_verdict(k: float, n: float, target: float, confidence: float = DEFAULT_CONFIDENCE) -> str:
    """Is the share of successes (k of n) at least `target`? `meets` when the one-sided lower bound is >= target,
    `misses` when the upper bound is < target, else `indeterminate`. Exact binomial, no normal approximation; a
    non-integer k and n (a share over n independent units, e.g. the ITL gaps within target over n requests) use the
    same tails through the incomplete beta function: P(Bin(n, p) >= k) = I_p(k, n - k + 1)."""
    from scipy.stats import beta

    _check_confidence(confidence)
    if n <= 0:
        return INDETERMINATE
    alpha = 1.0 - confidence
    # meets: reject "true share < target" -- P(Bin(n, target) >= k) <= alpha
    if k > 0 and float(beta.cdf(target, k, n - k + 1)) <= alpha:
        return MEETS
    # misses: reject "true share >= target" -- P(Bin(n, target) <= k) <= alpha
    if k < n and float(beta.sf(target, k + 1, n - k)) <= alpha:
        return MISSES
    return INDETERMINATE


def effective_n(values: Sequence[float], detrend: bool = False) -> float:
    """The effective sample size of a series taken in time order: n / tau, tau the integrated autocorrelation time
    of its ranks (Geyer's initial positive sequence: the autocorrelations summed in adjacent pairs while a pair is
    positive). Requests of one load test share a queue: a burst makes many neighbours late together, and near
    saturation one slow stretch spans dozens of requests, so n requests carry the evidence of n / tau independent
    ones. Ranks make it robust to outliers and to failed requests (infinite values). Fewer than 8 values, or no
    variation: n itself. `detrend`: the autocorrelation of what a straight line through the ranks leaves (a trend
    is what a test for one looks for; left in, it reads as correlation and hides itself)."""
    import numpy as np
    from scipy.stats import rankdata

    n = len(values)
    if n < 8:
        return float(n)
    x = rankdata(np.asarray(values, dtype=float))
    x = x - x.mean()
    if detrend:
        t = np.arange(n) - (n - 1) / 2.0
        x = x - (float(t @ x) / float(t @ t)) * t
    var = float(x @ x) / n
    if var <= 0:
        return float(n)
    acf = [1.0] + [float(x[:-k] @ x[k:]) / (n * var) for k in range(1, n // 2)]
    tau = -1.0
    for m in range(len(acf) // 2):
        pair = acf[2 * m] + acf[2 * m + 1]
        if pair <= 0:
            break
        tau += 2.0 * pair
    return float(min(n, max(1.0, n / max(tau, 1.0))))


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
    _check_confidence(confidence)
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return None, None
    j, k = order_ranks(n, q, confidence)
    return (xs[j - 1] if j >= 1 else None), (xs[k - 1] if k <= n else None)


@functools.lru_cache(maxsize=4096)
def order_ranks(n: int, q: float, confidence: float) -> tuple[int, int]:
    """The ranks (1-based) of quantile_bounds' order statistics for n samples: (j, k), the lower bound X_(j) (none
    when j < 1) and the upper X_(k) (none when k > n). A function of (n, q, confidence) only: kept (the capacity
    search summarises thousands of probes of a few sizes)."""
    from scipy.stats import binom

    alpha = 1.0 - confidence
    # lower: X_(j) <= xi_q holds when at least j samples are <= xi_q: P(B >= j) = sf(j-1) >= confidence
    j = int(binom.ppf(alpha, n, q))  # largest j with P(B < j) <= alpha (approximately): check and adjust
    while j >= 1 and binom.sf(j - 1, n, q) < confidence:
        j -= 1
    while j + 1 <= n and binom.sf(j, n, q) >= confidence:
        j += 1
    # upper: X_(k) >= xi_q holds when at most k-1 samples are <= xi_q: P(B <= k-1) = cdf(k-1) >= confidence
    k = int(binom.ppf(confidence, n, q)) + 1
    while k - 1 >= 1 and binom.cdf(k - 2, n, q) >= confidence:
        k -= 1
    return j, k


def quantile_ci(values: Sequence[float], q: float, confidence: float = DEFAULT_CONFIDENCE
                ) -> tuple[float | None, float | None]:
    """Two-sided distribution-free interval for the q-quantile at `confidence` (each side at (1+confidence)/2)."""
    return quantile_bounds(values, q, 0.5 + confidence / 2.0)


def mean_bounds(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE, n_eff: float | None = None
                ) -> tuple[float | None, float | None]:
    """One-sided Student-t bounds (lower, upper) for the mean; None with fewer than 2 finite values. `n_eff`: the
    values' effective sample size when they are correlated (`effective_n`), for the standard error and the degrees
    of freedom."""
    from scipy.stats import t

    xs = [float(v) for v in values]
    if len(xs) < 2 or not all(math.isfinite(v) for v in xs):
        return None, None
    n = len(xs)
    m = sum(xs) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in xs) / (n - 1))
    m_eff = n if n_eff is None else max(min(n_eff, n), 2.0)
    half = float(t.ppf(confidence, m_eff - 1)) * sd / math.sqrt(m_eff)
    return m - half, m + half


def bound_verdict(values: Sequence[float], stat: str, limit: float, confidence: float = DEFAULT_CONFIDENCE,
                  correlated: bool = False) -> str:
    """Verdict for `stat(values) <= limit`, stat in p50/p90/p95/p99/mean. Infinite values (failed requests) count
    against the bound. `correlated`: the values are a time series (requests of one load test, in send order) and a
    percentile is judged on their effective sample size (`effective_n`), not their count."""
    if not values:
        return INDETERMINATE
    if stat == "mean":
        if any(not math.isfinite(v) for v in values):
            return MISSES  # a failed request is infinitely late: the mean is infinite, whatever the others did
        lo, hi = mean_bounds(values, confidence, effective_n(values) if correlated else None)
        if hi is not None and hi <= limit:
            return MEETS
        if lo is not None and lo > limit:
            return MISSES
        return INDETERMINATE
    q = float(stat.lstrip("p")) / 100.0
    k = sum(1 for v in values if v <= limit)
    n = len(values)
    if correlated:  # the evidence of n_eff independent requests, the same share within the limit
        n_eff = effective_n(values)
        k, n = k * n_eff / n, n_eff
    return attainment_verdict(k, n, q, confidence)


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
