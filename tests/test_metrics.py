from __future__ import annotations

import math

import numpy as np
import pytest

from tuner.measure.metrics import RequestResult, compute_metrics, percentile, summarize


def req(i, ttft, e2e, n, itl=None, error=None, proposed=0, accepted=0):
    return RequestResult(index=i, prompt_tokens=10, output_tokens=n, ttft_ms=ttft, e2e_ms=e2e,
                         itl_ms=list(itl or []), error=error, draft_proposed=proposed, draft_accepted=accepted)


@pytest.mark.parametrize("xs", [[1.0], [3.0, 1.0], [5, 1, 4, 2, 3], list(range(100)), [0.5, 0.25, 10.0, 7.0]])
def test_percentiles_match_numpy(xs):
    s = summarize(xs)
    for p in (50, 90, 95, 99):
        assert s[f"p{p}"] == pytest.approx(float(np.percentile(xs, p)))
    assert s["mean"] == pytest.approx(float(np.mean(xs)))


def test_summarize_empty_is_none():
    assert summarize([]) == {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None, "n": 0,
                             "ci": {"p50": [None, None], "p90": [None, None], "p95": [None, None],
                                    "p99": [None, None]}}


def test_percentile_intervals_are_the_textbook_order_statistics():
    """Distribution-free 95% intervals of the median from the standard tables (Conover, Practical Nonparametric
    Statistics): ranks 6 and 15 of 20 samples, ranks 40 and 61 of 100; the input order does not matter."""
    import random

    xs = [float(v) for v in range(1, 101)]
    random.Random(0).shuffle(xs)
    s = summarize(xs)
    assert s["n"] == 100
    assert s["ci"]["p50"] == [40.0, 61.0]
    for p in ("p50", "p90", "p95"):
        lo, hi = s["ci"][p]
        assert lo <= s[p] <= hi, p
    assert s["ci"]["p99"][1] is None  # 100 samples cannot bound p99 from above at 97.5%
    assert summarize(range(1, 21))["ci"]["p50"] == [6.0, 15.0]
    assert summarize([3.0, 1.0])["ci"]["p50"] == [None, None]  # two samples bound nothing at 97.5% a side


def test_percentile_single():
    assert percentile([4.0], 99) == 4.0


def test_tpot_excludes_first_token():
    r = req(0, ttft=100.0, e2e=400.0, n=4)
    assert r.tpot_ms == pytest.approx(100.0)  # (400-100)/(4-1)
    assert req(1, 100.0, 100.0, 1).tpot_ms is None


def test_compute_metrics_by_hand():
    results = [
        req(0, 100.0, 400.0, 4, itl=[100, 100, 100]),
        req(1, 200.0, 200.0 + 2 * 50.0, 3, itl=[50, 50]),
        req(2, None, 10.0, 0, error="boom"),
        req(3, None, 5.0, 0),  # zero tokens, no error: still a failure
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 2
    assert m["total_output_tokens"] == 7
    assert m["output_tokens_per_s"] == pytest.approx(3.5)
    assert m["requests_per_s"] == pytest.approx(1.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(75.0)
    assert m["itl_ms"]["mean"] == pytest.approx((300 + 100) / 5)
    assert (m["ttft_ms"]["n"], m["tpot_ms"]["n"], m["itl_ms"]["n"], m["e2e_ms"]["n"]) == (2, 2, 5, 2)  # failed: none
    assert m["e2e_ms"]["p99"] == pytest.approx(np.percentile([400.0, 300.0], 99))
    assert m["acceptance_rate"] is None
    assert m["errors"] == ["boom"]


def test_dispatch_lag_is_summarized():
    results = [RequestResult(index=i, prompt_tokens=4, output_tokens=2, ttft_ms=10.0, e2e_ms=20.0,
                             dispatch_lag_ms=lag) for i, lag in enumerate([0.5, 1.5, None])]
    lag = compute_metrics(results, 1.0)["dispatch_lag_ms"]
    assert lag["n"] == 2 and lag["mean"] == pytest.approx(1.0) and lag["p50"] == pytest.approx(1.0)
    assert compute_metrics(results[2:], 1.0)["dispatch_lag_ms"]["n"] == 0


def test_acceptance_rate_and_goodput():
    results = [req(0, 100.0, 300.0, 5, proposed=12, accepted=3), req(1, 400.0, 500.0, 5, proposed=8, accepted=5)]
    m = compute_metrics(results, 1.0, slo_ms={"ttft_ms": 300.0})
    assert m["acceptance_rate"] == pytest.approx(8 / 20)
    assert m["goodput_requests_per_s"] == pytest.approx(1.0)  # only request 0 meets TTFT <= 300 ms
    m2 = compute_metrics(results, 1.0, slo_ms={"ttft_ms": 500.0, "tpot_ms": 30.0})
    assert m2["goodput_requests_per_s"] == pytest.approx(1.0)  # request 0 has TPOT 50 ms > 30


def test_all_failed_gives_none_percentiles():
    m = compute_metrics([req(0, None, 1.0, 0, error="x")], 1.0)
    assert m["completed"] == 0 and m["ttft_ms"]["p50"] is None
    assert not math.isnan(m["output_tokens_per_s"])
