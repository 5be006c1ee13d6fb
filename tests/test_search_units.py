"""Parsing of targets, SLOs and space files; the constraint function and the answer on hand-made trials."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tuner.errors import TunerError
from tuner.space import default_space_path, load_space, suggest_config
from tuner.study import Row, answer, pareto_front, trials_csv
from tuner.targets import Bound, build_bounds, parse_duration_s, parse_metric, parse_slo, parse_time_ms


@pytest.mark.parametrize("text,ms", [("300ms", 300.0), ("1.5s", 1500.0), ("2 s", 2000.0), ("0.5ms", 0.5)])
def test_parse_time(text, ms):
    assert parse_time_ms(text) == ms


@pytest.mark.parametrize("text", ["300", "300us", "ms", "-3ms", "0ms", "3m", ""])
def test_bad_time(text):
    with pytest.raises(TunerError, match="expected a"):
        parse_time_ms(text)


def test_parse_metric_and_slo():
    assert parse_metric("TTFT:p99") == ("ttft", "p99")
    bounds = parse_slo("ttft:p99<300ms;tpot:p50<50ms")
    assert bounds == [Bound("ttft", "p99", 300.0), Bound("tpot", "p50", 50.0)]
    assert parse_slo("e2e:mean<2s, itl:p95 < 80ms")[0].limit_ms == 2000.0


@pytest.mark.parametrize("text,needle", [
    ("ttft:p99<300", "SLO bound"),
    ("ttft:p42<300ms", "latency metric"),
    ("latency:p99<300ms", "latency metric"),
    ("ttft:p99>300ms", "SLO term"),
    ("ttft:p99<300ms;ttft:p99<200ms", "twice"),
    (";", "empty"),
])
def test_bad_slo(text, needle):
    with pytest.raises(TunerError, match=needle):
        parse_slo(text)


def test_build_bounds_target_overrides_same_key():
    primary, bounds = build_bounds("300ms", "ttft:p99", "ttft:p99<1s;tpot:p50<50ms")
    assert primary == Bound("ttft", "p99", 300.0)
    assert sorted(map(str, bounds)) == ["tpot:p50<50ms", "ttft:p99<300ms"]
    with pytest.raises(TunerError, match="no latency target"):
        build_bounds(None, "ttft:p99", None)


@pytest.mark.parametrize("text,s", [("20m", 1200), ("90s", 90), ("1.5h", 5400)])
def test_duration(text, s):
    assert parse_duration_s(text) == s


@pytest.mark.parametrize("text", ["20", "20min", "-1m", "0s"])
def test_bad_duration(text):
    with pytest.raises(TunerError, match="--timeout"):
        parse_duration_s(text)


def test_default_spaces_are_valid():
    for dev in ("cpu", "cuda"):
        space = load_space(default_space_path(dev))
        assert set(space.knobs) == {"quant", "batch_cap", "kv_fraction", "draft"}
        assert space.baseline["batch_cap"] == 1 and space.baseline["draft"] == "none"
        assert space.baseline["quant"] in space.knobs["quant"].choices  # enqueueable


@pytest.mark.parametrize("body,needle", [
    ("knobs: {quant: {choices: [bf16, int3]}}", "knobs.quant.choices[1]: unknown quantization format 'int3'"),
    ("knobs: {batch_cap: {choices: [1, 0]}}", "knobs.batch_cap.choices[1]: batch cap 0"),
    ("knobs: {kv_fraction: {low: 0.5, high: 0.1}}", "knobs.kv_fraction: low 0.5 must be below high 0.1"),
    ("knobs: {kv_fraction: {low: 0.0, high: 0.1}}", "knobs.kv_fraction.low: KV fraction 0.0"),
    ("knobs: {draft: {choices: [none, 'ngram:x']}}", "knobs.draft.choices[1]: bad draft spec"),
    ("knobs: {draft: {choices: [none], when: {batch_cap: [1]}}}", "knobs.draft.when.batch_cap"),
    ("knobs: {tp: {choices: [1]}}", "knobs.tp: unknown knob"),
    ("knobs: {quant: {choices: []}}", "knobs.quant.choices: expected a non-empty list"),
    ("knobs: {quant: {choices: [bf16], step: 2}}", "knobs.quant.step: unknown key"),
    ("knobs: {batch_cap: {low: 1}}", "knobs.batch_cap: expected choices, or both low and high"),
    ("knobs: {quant: {choices: [bf16]}}\nbaseline: {quant: int3}", "baseline.quant: unknown quantization"),
    ("knobs: {quant: {choices: [bf16]}}\nextra: 1", "extra: unknown key"),
    ("knobs: [1, 2]", "knobs: expected a mapping"),
    ("knobs: {quant: {choices: [bf16]\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a YAML mapping"),
])
def test_bad_space_files_name_the_key(tmp_path, body, needle):
    p = tmp_path / "space.yaml"
    p.write_text(body)
    with pytest.raises(TunerError) as e:
        load_space(p)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_conditional_draft_and_fixed_trial(tmp_path):
    import optuna

    p = tmp_path / "s.yaml"
    p.write_text("knobs:\n  quant: {choices: [bf16]}\n  batch_cap: {choices: [1, 4]}\n"
                 "  kv_fraction: {low: 0.01, high: 0.1, log: true}\n"
                 "  draft: {choices: [none, 'ngram:3'], when: {batch_cap: [1]}}\n")
    space = load_space(p)
    c = suggest_config(optuna.trial.FixedTrial({"quant": "bf16", "batch_cap": 1, "kv_fraction": 0.02,
                                                "draft": "ngram:3"}), space, "m", "cpu")
    assert c.draft == "ngram:3" and c.batch_cap == 1
    c4 = suggest_config(optuna.trial.FixedTrial({"quant": "bf16", "batch_cap": 4, "kv_fraction": 0.02}), space,
                        "m", "cpu")
    assert c4.draft == "none"  # the draft knob is not even sampled at batch cap 4
    assert space.knobs["quant"].choices == ("fp32", "bf16")  # the fp32 baseline is made a point of the space


NAMES = ["ttft:p99<300ms", "quality drop<=1pp", "failed requests=0"]
PRIMARY = Bound("ttft", "p99", 300.0)


def row(n, quant, cap, tok_s, ttft99, drop, failed=0, state="COMPLETE", score=0.5):
    metrics = {"output_tokens_per_s": tok_s, "ttft_ms": {"p99": ttft99}, "failed": failed}
    q = {"score": score, "drop_pp": drop}
    cons = [ttft99 - 300.0, drop - 1.0, float(failed)] if state == "COMPLETE" else None
    return Row(n, state, {"quant": quant, "batch_cap": cap, "kv_fraction": 0.01, "draft": "none"}, metrics, q,
               cons, None if state == "COMPLETE" else "pruned early", None)


def test_answer_on_hand_made_trials():
    rows = [
        row(0, "fp32", 1, 10.0, 250.0, 0.0, score=0.50),  # baseline, feasible
        row(1, "bf16", 8, 40.0, 290.0, 0.2, score=0.498),  # best feasible
        row(2, "bnb-nf4", 16, 60.0, 280.0, 3.0, score=0.47),  # faster but breaks the quality budget
        row(3, "bf16", 16, 55.0, 450.0, 0.2),  # faster but misses the latency target
        row(4, "bf16", 4, 30.0, 200.0, 0.2, score=0.498),  # feasible runner-up, lower latency
        row(5, "bf16", 32, 0.0, 0.0, 0.0, state="PRUNED"),
        row(6, "bf16", 2, 35.0, 260.0, 0.2, failed=1),  # a failed request makes it infeasible
    ]
    a = answer(rows, NAMES, PRIMARY, baseline_number=0)
    assert a["n_feasible"] == 3 and a["n_pruned"] == 1
    rec = a["recommendation"]
    assert rec["trial"] == 1
    assert rec["gain_over_baseline"] == pytest.approx(4.0)
    assert [r["trial"] for r in a["runners_up"]] == [4, 0]
    assert "0.75x tok/s" in a["runners_up"][0]["vs_best"] and "-90 ms" in a["runners_up"][0]["vs_best"]
    # faster configs were stopped once by the latency bound and once by the quality budget: tie -> first
    assert rec["binding_constraint"].startswith(("ttft:p99<300ms", "quality drop<=1pp"))
    front = [s["trial"] for s in a["pareto_front"]]
    assert front == [1, 4, 0]  # none of the three dominates another on (tok/s, latency, quality)


def test_pareto_front_drops_dominated():
    rows = [row(0, "a", 1, 10.0, 250.0, 0.0, score=0.5), row(1, "b", 1, 20.0, 200.0, 0.0, score=0.5)]
    assert [r.number for r in pareto_front(rows, lambda r: r.metrics["ttft_ms"]["p99"])] == [1]


def test_nothing_feasible_reports_closest():
    rows = [row(0, "fp32", 1, 10.0, 900.0, 0.0), row(1, "bf16", 4, 20.0, 350.0, 0.0)]
    a = answer(rows, NAMES, PRIMARY)
    assert "recommendation" not in a
    assert a["closest"]["trial"] == 1
    assert a["closest"]["misses"] == {"ttft:p99<300ms": pytest.approx(50.0)}


def test_trials_csv_has_every_trial():
    rows = [row(0, "fp32", 1, 10.0, 250.0, 0.0), row(1, "bf16", 32, 0.0, 0.0, 0.0, state="PRUNED")]
    text = trials_csv(rows)
    lines = text.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("number,state,feasible")
    assert "pruned early" in lines[2]
    assert not math.isnan(float(lines[1].split(",")[9]))


def test_spaces_dir_exists():
    assert Path(default_space_path("cpu")).is_file()
