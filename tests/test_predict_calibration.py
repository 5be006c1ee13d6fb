"""A measured capacity of 0 is censored, not a ratio of 0 (tuner.predict.calibration, tuner.predict.strategy): the
record keeps the bound the capacity lies below, later bands reach down to it (not to 0), and the search's
recalibration counts it as at most that bound."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.test_predict_strategy import SPACE, context, pool, simulated_profile
from tuner.predict import calibration as cal
from tuner.predict import choose
from tuner.predict import strategy as st

PREDICTED, BAND = 2.0, [1.6, 2.5]


def nothing_met(missed_at: tuple[float, ...] = (0.9, 1.8), saturation: float = 3.0) -> dict[str, Any]:
    """A capacity result (the shape `tuner bench --capacity` writes) where no probed rate met the SLO: every probe
    missed, so its interval is [0, the lowest rate that missed]."""
    probes = [{"rate_rps": r, "n": 12, "verdict": "misses"} for r in sorted(missed_at)]
    return {"requests_per_s": 0.0, "requests_per_s_ci": [0.0, min(missed_at, default=saturation)],
            "verdict": "misses", "probes": probes, "saturation": {"requests_per_s": saturation}}


def test_a_measured_zero_is_recorded_as_censored_below_the_lowest_rate_that_missed() -> None:
    rec = cal.entry("p", {"quant": "Q4_1"}, ["e2e:p50<5000ms"], {}, PREDICTED, BAND, nothing_met(), "test")
    assert rec["censored"] is True and rec["ratio"] is None and rec["error"] is None
    assert rec["measured_upper_rps"] == 0.9 and rec["ratio_upper"] == pytest.approx(0.9 / PREDICTED)
    # the bound (0.9) is below the band (1.6..2.5): the prediction was too high whatever the real capacity is
    assert rec["within_band"] is False and rec["contradicts"] is True
    # a bound inside the band: the measurement neither confirms nor contradicts the band
    inside = cal.entry("p", {}, [], {}, PREDICTED, BAND, nothing_met((2.0,)), "test")
    assert inside["within_band"] is None and inside["contradicts"] is False and inside["ratio_upper"] == 1.0
    # no probe missed (all indeterminate): the saturation end of the interval bounds it
    undecided = nothing_met(())
    undecided["probes"] = [{"rate_rps": 1.0, "n": 12, "verdict": "indeterminate"}]
    assert cal.entry("p", {}, [], {}, PREDICTED, BAND, undecided, "test")["measured_upper_rps"] == 3.0
    # a capacity that was measured is a ratio as before
    met = cal.entry("p", {}, [], {}, PREDICTED, BAND, {"requests_per_s": 1.8, "requests_per_s_ci": [1.8, 2.2]}, "t")
    assert met["censored"] is False and met["ratio"] == pytest.approx(0.9) and met["within_band"] is True


def test_a_censored_record_widens_the_band_down_to_its_bound_not_to_zero(monkeypatch, tmp_path) -> None:
    """The record read back from the profile's history: the next band's low end is rate x bound / predicted (the
    most the measurement shows), where a ratio of 0 put it at 0 for every later prediction."""
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    cal.record("p", cal.entry("p", {}, [], {}, PREDICTED, BAND, nothing_met(), "test"))
    history = cal.read_history("p")
    assert len(history) == 1
    (lo, hi), summary = cal.widen(3.0, [2.7, 3.3], history)
    assert lo == pytest.approx(3.0 * 0.9 / PREDICTED) and lo > 0 and hi == 3.3
    assert summary["n"] == 1 and summary["censored"] == 1 and summary["contradicted"] == 1
    # a bound above the band's low end says nothing the band does not already: unchanged
    (lo2, _), _ = cal.widen(3.0, [1.0, 3.3], history)
    assert lo2 == 1.0


def test_a_re_measured_profile_starts_its_history_anew(monkeypatch, tmp_path) -> None:
    """A profile measured again keeps its id (same engine, model, format, host): the records that judged its earlier
    measurement (here a +400% miss) are not read for it, so they no longer widen its bands; its own records are."""
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    miss = cal.entry("p", {}, [], {}, PREDICTED, BAND, {"requests_per_s": 0.4, "requests_per_s_ci": [0.4, 0.5]}, "t")
    cal.record("p", {**miss, "at": "2026-01-01T00:00:00+00:00"})
    met = cal.entry("p", {}, [], {}, PREDICTED, BAND, {"requests_per_s": 1.8, "requests_per_s_ci": [1.8, 2.2]}, "t")
    cal.record("p", met)
    assert len(cal.read_history("p")) == 2  # without the profile's date: every record
    history = cal.read_history("p", since="2026-06-01T00:00:00+00:00")
    assert [r["ratio"] for r in history] == [pytest.approx(0.9)]
    assert cal.widen(3.0, [2.7, 3.3], history)[0][0] == pytest.approx(2.7)  # the old miss no longer reaches 0.6
    assert cal.widen(3.0, [2.7, 3.3], cal.read_history("p"))[0][0] == pytest.approx(0.6)


def test_an_old_record_of_a_zero_ratio_is_read_as_censored(monkeypatch, tmp_path) -> None:
    """History written before censoring (ratio 0, error null) is read as the censored record it is; one that kept
    no bound is dropped (it says nothing about the ratio)."""
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    old = {"predicted_requests_per_s": 2.0, "measured_requests_per_s": 0.0, "measured_ci": [0.0, 1.0], "ratio": 0.0,
           "error": None, "within_band": False, "band": BAND}
    path = cal.history_path("old")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old) + "\n" + json.dumps({**old, "measured_ci": [0.0, 0.0]}) + "\n")
    history = cal.read_history("old")
    assert len(history) == 1 and history[0]["censored"] and history[0]["ratio_upper"] == pytest.approx(0.5)
    assert cal.widen(4.0, [3.0, 5.0], history)[0] == [pytest.approx(2.0), 5.0]


def test_the_search_recalibrates_with_a_censored_measurement_as_an_upper_bound() -> None:
    # two measured at 0.5x; a third nothing met below 0.8 req/s of a predicted 2.0 (ratio at most 0.4): counted at 0.4
    ratio, _ = choose.calibration([(2.0, 1.0), (4.0, 2.0)], [(2.0, 0.8)])
    assert ratio == pytest.approx((0.5 * 0.5 * 0.4) ** (1 / 3))
    # a bound at 1.5x of the prediction (the real ratio anywhere below 1.5) says nothing against 0.5: left out
    assert choose.calibration([(2.0, 1.0), (4.0, 2.0)], [(2.0, 3.0)]) == choose.calibration([(2.0, 1.0), (4.0, 2.0)])
    # alone, below the prior's ratio of 1: the bound is the estimate (never 0)
    assert choose.calibration([(2.0, 0.0)], [(2.0, 0.5)])[0] == pytest.approx(0.25)


def test_a_prediction_after_a_censored_measurement_keeps_a_band_above_zero(monkeypatch, tmp_path) -> None:
    """End to end through the profile's history: a profile taken on a simulated engine, a measured 0 recorded for
    it (as the search records each trial), then the next prediction from it (tuner.predict.estimate.predict, what
    `tuner predict` and the search's bands run): its band's low end is above 0."""
    from tuner.config import TrialConfig
    from tuner.predict.estimate import predict
    from tuner.predict.simulate import StepModel
    from tuner.search.space import load_space

    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    profile = simulated_profile(StepModel(decode_base_s=0.010, decode_per_seq_s=0.002, prefill_base_s=0.003,
                                          prefill_per_token_s=1e-4, noise_sigma=0.1), 2, "sim-censored")
    strategy = st.PredictStrategy(pool)
    options = strategy.options(context(load_space(SPACE)))
    config = TrialConfig(model="smollm2-135m", engine="llamacpp", quant="Q4_1", batch_cap=2, kv_fraction=0.01,
                         threads=1, device="cpu")
    requests = pool(config, options)
    first = predict(profile, config, requests, options, replicates=2, seed=0)
    rate = first["capacity"]["requests_per_s"]
    assert rate > 0
    cal.record(profile["id"], cal.entry(profile["id"], config.to_dict(), [], {}, rate, first["capacity"]["band"],
                                        nothing_met((0.5 * rate, rate)), "test"))
    again = predict(profile, config, requests, options, replicates=2, seed=0, history=cal.read_history(profile["id"]))
    lo, hi = again["capacity"]["band"]
    assert lo == pytest.approx(0.5 * rate) and 0 < lo < rate <= hi
