"""Parsing of targets, SLOs and space files; the constraint function and the answer on hand-made trials."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tuner.errors import TunerError
from tuner.search.answer import Row, answer, pareto_front, trials_csv
from tuner.search.space import combine_spaces, default_space_path, load_space, restrict_to_device, suggest_config
from tuner.slo import Bound, build_slo, parse_duration_s, parse_metric, parse_slo, parse_slo_terms, parse_time_ms


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


def test_build_slo_target_overrides_same_key():
    primary, slo = build_slo("300ms", "ttft:p99", "ttft:p99<1s;tpot:p50<50ms")
    assert primary == Bound("ttft", "p99", 300.0)
    assert sorted(map(str, slo.bounds)) == ["tpot:p50<50ms", "ttft:p99<300ms"]
    with pytest.raises(TunerError, match="no latency target"):
        build_slo(None, "ttft:p99", None)


def test_per_request_targets_and_attainment():
    bounds, targets = parse_slo_terms("ttft<300ms;tpot<50ms;e2e:p90<2s")
    assert bounds == [Bound("e2e", "p90", 2000.0)] and targets == {"ttft_ms": 300.0, "tpot_ms": 50.0}
    primary, slo = build_slo(None, "ttft:p99", "ttft<300ms;tpot<50ms", attainment=0.9)
    assert primary is None and slo.attainment == 0.9 and slo.targets == {"ttft_ms": 300.0, "tpot_ms": 50.0}
    assert build_slo(None, "ttft:p99", "ttft<300ms")[1].attainment == 0.95  # the documented default
    with pytest.raises(TunerError, match="--attainment 0.9 needs per-request targets"):
        build_slo("300ms", "ttft:p99", None, attainment=0.9)
    with pytest.raises(TunerError, match="--attainment 1.5 is invalid"):
        build_slo(None, "ttft:p99", "ttft<1s", attainment=1.5)
    with pytest.raises(TunerError, match="per-request target METRIC<TIME with METRIC in ttft, tpot, e2e"):
        parse_slo_terms("itl<30ms")


@pytest.mark.parametrize("text,s", [("20m", 1200), ("90s", 90), ("1.5h", 5400), ("7m30s", 450), ("1h30m", 5400)])
def test_duration(text, s):
    assert parse_duration_s(text) == s


@pytest.mark.parametrize("text", ["20", "20min", "-1m", "0s", "7m30", "m30s", "0m0s"])
def test_bad_duration(text):
    with pytest.raises(TunerError, match="--timeout"):
        parse_duration_s(text)


def test_default_spaces_are_valid():
    for dev in ("cpu", "cuda"):
        space = load_space(default_space_path(dev))
        assert set(space.knobs) == {"quant", "batch_cap", "kv_fraction", "draft"}
        assert space.engine == "transformers"
        assert space.baseline["batch_cap"] == 1 and space.baseline["draft"] == "none"
        assert space.knobs["kv_fraction"].when == {"draft": ("none",)}  # KV fraction only where it applies


def test_llamacpp_space_samples_llamacpp_configs():
    """The llama.cpp space: llama.cpp's own type names, the KV-type knob, llama-server's defaults as baseline; a
    sampled point is a TrialConfig of engine llamacpp (so the bench launches llama-server for it)."""
    import optuna

    space = load_space(default_space_path("cpu", "llamacpp"))
    assert space.engine == "llamacpp" and "Q4_K_M" in space.knobs["quant"].choices
    assert space.knobs["kv_type"].choices[0] == "auto" and "q8_0" in space.knobs["kv_type"].choices
    assert space.baseline["quant"] == "Q4_1" and space.knobs["quant"].choices[0] == "Q4_1"
    assert "winogrande" not in space.quality["tasks"]
    c = suggest_config(optuna.trial.FixedTrial({"quant": "Q6_K", "batch_cap": 8, "draft": "ngram:3",
                                                "kv_fraction": 0.002, "kv_type": "q4_0", "threads": 1,
                                                "ubatch": 128}), space, "m", "cpu")
    assert (c.engine, c.quant, c.kv_type, c.batch_cap, c.draft) == ("llamacpp", "Q6_K", "q4_0", 8, "ngram:3")
    assert (c.threads, c.ubatch) == (1, 128)


def test_vllm_space_samples_vllm_configs():
    """The vLLM CPU space: dtypes the CPU backend serves, vLLM's own knobs (YAML's bare on/off read as switches), a
    baseline equal to `vllm serve MODEL` (float32 checkpoint, 128 sequences); a sampled point is a vllm TrialConfig."""
    import optuna

    space = load_space(default_space_path("cpu", "vllm"))
    assert space.engine == "vllm" and set(space.knobs["quant"].choices) == {"fp32", "bf16"}
    assert space.knobs["prefix_cache"].choices == ("auto", "off") and space.knobs["reserved_cpus"].choices == (-1, 0)
    assert (space.baseline["quant"], space.baseline["batch_cap"], space.baseline["prefix_cache"]) == ("fp32", 128,
                                                                                                        "auto")
    c = suggest_config(optuna.trial.FixedTrial({"quant": "bf16", "batch_cap": 8, "draft": "none", "kv_fraction": 0.05,
                                                "batched_tokens": 256, "prefix_cache": "off",
                                                "chunked_prefill": "auto", "reserved_cpus": 0}), space, "m", "cpu")
    assert (c.engine, c.quant, c.batch_cap, c.batched_tokens, c.prefix_cache, c.reserved_cpus) == (
        "vllm", "bf16", 8, 256, "off", 0)
    assert c.to_dict()["prefix_cache"] == "off" and "chunked_prefill" not in c.to_dict()  # defaults stay implicit
    cuda = load_space(default_space_path("cuda", "vllm"))
    kept, notes = restrict_to_device(dataclasses.replace(space, knobs={**space.knobs, "quant": cuda.knobs["quant"]}),
                                     "cpu")
    assert kept.knobs["quant"].choices == ("bf16",) and any("bnb-nf4 left out: vLLM's CPU backend" in n
                                                            for n in notes)


def test_spaces_combine_into_one_study_with_the_engine_as_first_knob():
    """Engines as a knob: `engine` is sampled first, then that engine's own knobs under `<engine>.<knob>` (each keeps
    its own choices); the first engine's default is the baseline; quality tasks some engine cannot score are left
    out with a note."""
    import optuna

    names = ("transformers", "llamacpp", "vllm")
    space, notes = combine_spaces([load_space(default_space_path("cpu", e)) for e in names])
    assert list(space.knobs) == ["engine"] and space.knobs["engine"].choices == names
    assert space.baseline["engine"] == "transformers" and space.baseline["transformers.quant"] == "fp32"
    assert "winogrande" not in space.quality["tasks"] and any("winogrande left out" in n for n in notes)
    c = suggest_config(optuna.trial.FixedTrial(space.baseline), space, "m", "cpu")
    assert (c.engine, c.quant, c.batch_cap) == ("transformers", "fp32", 1)
    c = suggest_config(optuna.trial.FixedTrial({"engine": "llamacpp", "llamacpp.quant": "Q8_0",
                                                "llamacpp.batch_cap": 8, "llamacpp.draft": "none",
                                                "llamacpp.kv_fraction": 0.002, "llamacpp.kv_type": "q8_0",
                                                "llamacpp.threads": 0, "llamacpp.ubatch": 128}), space, "m", "cpu")
    assert (c.engine, c.quant, c.kv_type, c.ubatch) == ("llamacpp", "Q8_0", "q8_0", 128)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=1))
    seen = set()
    for _ in range(12):  # a real TPE study over the combined space: no distribution clash between engines
        t = study.ask()
        seen.add(suggest_config(t, space, "m", "cpu").engine)
        study.tell(t, 1.0)
    assert seen == set(names)
    with pytest.raises(TunerError, match="each engine may appear once"):
        combine_spaces([load_space(default_space_path("cpu", "vllm"))] * 2)


@pytest.mark.parametrize("body,needle", [
    ("engine: llamacpp\nknobs: {quant: {choices: [bf16]}}", "knobs.quant.choices[0]: unknown quantization format "
                                                            "'bf16' for engine llamacpp"),
    ("knobs: {kv_type: {choices: [auto, q8_0]}}", "knobs.kv_type.choices[1]: KV type 'q8_0' is not accepted by "
                                                  "engine transformers"),
    ("engine: vllm2\nknobs: {quant: {choices: [bf16]}}", "engine: unknown engine 'vllm2'"),
    ("knobs: {threads: {choices: [0, 2]}}", "knobs.threads.choices[1]: threads 2 is a knob of engine llamacpp"),
    ("engine: llamacpp\nknobs: {prefix_cache: {choices: [auto, 'off']}}",
     "knobs.prefix_cache.choices[1]: prefix_cache off is a knob of engine vllm"),
    ("engine: vllm\nknobs: {chunked_prefill: {choices: [auto, maybe]}}",
     "knobs.chunked_prefill.choices[1]: chunked_prefill 'maybe' is invalid: expected auto, on or off"),
    ("engine: vllm\nknobs: {reserved_cpus: {choices: [-2]}}", "reserved_cpus -2 is invalid: expected an integer >= -1"),
    ("engine: vllm\nknobs: {prefix_cache: {low: 0, high: 1}}", "knobs.prefix_cache: expected choices"),
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


NAMES = ["ttft:p90<300ms", "SLO shown to hold", "quality drop<=1pp (upper bound)"]


def row(n, quant, cap, rps, ci, ttft90, drop_hi, state="COMPLETE", score=0.5, verdict="meets"):
    capacity = {"requests_per_s": rps, "requests_per_s_ci": list(ci), "output_tokens_per_s": rps * 30,
                "verdict": verdict, "probes": []}
    q = {"score": score, "drop_pp": drop_hi / 2, "gate": {"drop_ci_pp": [0.0, drop_hi]}}
    cons = [(ttft90 - 300.0) / 300.0, 0.0 if verdict == "meets" else 0.1, drop_hi - 1.0]
    return Row(n, state, {"quant": quant, "batch_cap": cap, "kv_fraction": 0.01, "draft": "none"},
               {"ttft_ms": {"p90": ttft90}}, q, cons, None if state == "COMPLETE" else "pruned on quality", None,
               capacity if state == "COMPLETE" else None, "transformers-cb")


def test_answer_on_hand_made_trials():
    rows = [
        row(0, "fp32", 1, 0.5, (0.5, 0.6), 250.0, 0.0, score=0.50),  # baseline, feasible
        row(1, "bf16", 8, 2.0, (2.0, 2.2), 290.0, 0.8, score=0.498),  # best feasible
        row(2, "bnb-nf4", 16, 3.0, (3.0, 3.3), 280.0, 3.0, score=0.47),  # more capacity, out of quality budget
        row(3, "bf16", 16, 2.5, (2.5, 2.8), 450.0, 0.8, verdict="indeterminate"),  # undecided: not feasible
        row(4, "bf16", 4, 1.9, (1.9, 2.1), 200.0, 0.8, score=0.499),  # runner-up, within trial 1's CI
        row(5, "bnb-nf4", 32, 0.0, (0, 0), 0.0, 3.0, state="PRUNED"),
    ]
    a = answer(rows, NAMES, baseline_number=0, cost_per_hour=1.0, target_rate=7.0)
    assert a["n_feasible"] == 3 and a["n_pruned"] == 1
    rec = a["recommendation"]
    assert rec["trial"] == 1
    assert rec["gain_over_baseline"] == pytest.approx(4.0)
    assert rec["gain_ci"] == pytest.approx([2.0 / 0.6, 2.2 / 0.5])
    assert rec["replicas"] == 4  # ceil(7 / 2.0)
    assert rec["cost_per_million_tokens"] == pytest.approx(1.0 / (60.0 * 3600) * 1e6)
    assert rec["indistinguishable_from"] == [4]  # [1.9, 2.1] overlaps [2.0, 2.2]
    assert "serves 2 req/s [2, 2.2] within the SLO" in rec["statement"] and "4.00x" in rec["statement"]
    assert [r["trial"] for r in a["runners_up"]] == [4, 0]
    # the two configs with more capacity broke the quality budget (2) and the "shown to hold" / latency terms (3)
    assert rec["more_capacity_stopped_by"] == {NAMES[0]: 1, NAMES[1]: 1, NAMES[2]: 1}
    # the pick's own tightest term: ttft p90 290 of 300 ms (3% to spare) before the quality bound 0.8 of 1 pp (20%)
    assert rec["binding_constraint"] == ("ttft:p90 290 ms of 300 ms (10 ms slack) at 2 req/s; configs with more "
                                         "capacity violated: ttft:p90<300ms (1), SLO shown to hold (1), "
                                         "quality drop<=1pp (upper bound) (1)")
    # 0 stays: less capacity but the best quality (0.500 > 0.499 > 0.498)
    assert [s["trial"] for s in a["pareto_front"]] == [1, 4, 0]


def test_pareto_front_keeps_the_quality_trade_off():
    rows = [row(0, "a", 1, 1.0, (1, 1), 250.0, 0.0, score=0.6), row(1, "b", 1, 2.0, (2, 2), 200.0, 0.0, score=0.5),
            row(2, "c", 1, 1.5, (1.5, 1.5), 200.0, 0.0, score=0.4)]
    assert [r.number for r in pareto_front(rows)] == [1, 0]


def test_across_engines_quality_compares_drops_not_scores():
    """llama-perplexity's acc_per_token and lm-eval's acc_norm are different metrics: across engines the front and
    the runners-up compare each engine's drop from its own reference, and each engine's best is named."""
    a = row(0, "fp32", 1, 2.0, (2.0, 2.1), 250.0, 0.0, score=0.55)  # transformers, drop 0
    b = row(1, "Q6_K", 8, 1.0, (1.0, 1.1), 250.0, 0.8, score=0.60)  # llama.cpp: higher raw score, but a drop
    b = dataclasses.replace(b, config={**b.config, "engine": "llamacpp"}, engine="llamacpp")
    assert [r.number for r in pareto_front([a, b])] == [0]  # b has less capacity and a larger drop
    out = answer([a, b], ["ttft:p90<300ms", "SLO shown to hold", "quality drop<=1pp"], baseline_number=0)
    assert set(out["best_per_engine"]) == {"transformers", "llamacpp"}
    assert "vs its engine's reference" in out["best_per_engine"]["llamacpp"]["vs_best"]
    assert "pp quality" not in out["best_per_engine"]["llamacpp"]["vs_best"]


def test_nothing_feasible_reports_closest():
    rows = [row(0, "fp32", 1, 0.0, (0, 0.2), 900.0, 0.0, verdict="misses"),
            row(1, "bf16", 4, 0.0, (0, 1.0), 350.0, 0.0, verdict="misses")]
    a = answer(rows, NAMES)
    assert "recommendation" not in a
    assert a["closest"]["trial"] == 1
    assert a["closest"]["misses"] == {"ttft:p90<300ms": pytest.approx(50 / 300), "SLO shown to hold": 0.1}
    # printed: the real term's overshoot, and the indicator in words (its 0.1 is no distance from anything)
    from types import SimpleNamespace

    from tuner.cli.search import format_answer
    from tuner.slo import SLO, parse_slo

    text = format_answer({"answer": dict(a, n_running=0), "study": "s", "storage": "sqlite:///x", "csv": "c",
                          "recommendation_path": "r"}, SimpleNamespace(slo=SLO(tuple(parse_slo("ttft:p90<300ms")))))
    line = next(ln for ln in text.splitlines() if "closest:" in ln)
    assert line.endswith("ttft:p90<300ms over by 17%; no rate was shown to meet the SLO"), line


def test_trials_csv_has_every_trial():
    rows = [row(0, "fp32", 1, 0.5, (0.5, 0.6), 250.0, 0.0), row(1, "bf16", 32, 0, (0, 0), 0.0, 3.0, state="PRUNED")]
    lines = trials_csv(rows).strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("number,state,feasible,engine")
    assert "pruned on quality" in lines[2]
    header = lines[0].split(",")
    first = dict(zip(header, lines[1].split(",")))
    assert float(first["capacity_rps"]) == 0.5 and first["capacity_verdict"] == "meets"


def test_spaces_dir_exists():
    assert Path(default_space_path("cpu")).is_file()


def test_a_pick_that_drops_when_re_measured_hands_over_to_the_next():
    """tuner.search.confirm on a real (in-memory) Optuna study: trial 1 won at 3.0 req/s in its trial but re-measured at
    1.5; trial 2 (2.0, not re-measured) is now ranked first, so it is the next to re-measure and the answer picks it,
    while trial 1 reports both its figures."""
    import optuna

    from tuner.search.answer import rows_from_study
    from tuner.search.confirm import next_to_confirm

    def attrs(rps):
        cap = {"requests_per_s": rps, "requests_per_s_ci": [rps, rps * 1.05], "verdict": "meets", "probes": []}
        return {"config": {"quant": "bf16", "batch_cap": 8, "kv_fraction": 0.01, "draft": "none"},
                "metrics": {}, "capacity": cap, "constraints": [-0.5, -1.0, -0.5]}

    study = optuna.create_study(directions=["maximize", "maximize"])
    for rps in (0.5, 3.0, 2.0):
        study.add_trial(optuna.trial.create_trial(values=[rps, 0.5], user_attrs=attrs(rps),
                                                  state=optuna.trial.TrialState.COMPLETE))
    assert next_to_confirm(rows_from_study(study)).number == 1
    again = attrs(1.5)["capacity"]
    study.set_user_attr("confirmed", {"1": {"capacity": again, "metrics": {"ttft_ms": {"p90": 12.0}}}})
    rows = rows_from_study(study)
    assert next_to_confirm(rows).number == 2
    a = answer(rows, NAMES, baseline_number=0)
    assert a["recommendation"]["trial"] == 2 and not a["recommendation"]["confirmed"]
    one = next(s for s in a["runners_up"] if s["trial"] == 1)
    assert one["confirmed"] and one["capacity_requests_per_s"] == 1.5 and one["in_trial_requests_per_s"] == 3.0
    assert one["ttft_ms"] == {"p90": 12.0}  # the metrics at the re-measured capacity point
    study.set_user_attr("confirmed", {"1": {"capacity": again, "metrics": {}},
                                      "2": {"capacity": attrs(1.8)["capacity"], "metrics": {}}})
    rows = rows_from_study(study)
    assert next_to_confirm(rows) is None  # the first ranked (trial 2 at 1.8) is confirmed: nothing left to do
    assert "re-measured after the search; 2 req/s in its trial)" in answer(rows, NAMES)["recommendation"]["statement"]
    # the host ran the engine twice as fast at the re-measure as in the trial (its canary's steps halved): said, as
    # the speed of the engine itself, so a re-measured figure that moved with it is read as the host's
    slow, fast = attrs(2.0), attrs(1.8)["capacity"]
    slow["capacity"]["canary"], fast["canary"] = {"itl_ms": [200.0, 220.0]}, {"itl_ms": [100.0, 110.0]}
    study2 = optuna.create_study(directions=["maximize", "maximize"])
    for a in (attrs(0.5), attrs(3.0), slow):
        study2.add_trial(optuna.trial.create_trial(values=[a["capacity"]["requests_per_s"], 0.5], user_attrs=a,
                                                   state=optuna.trial.TrialState.COMPLETE))
    study2.set_user_attr("confirmed", {"1": {"capacity": again, "metrics": {}}, "2": {"capacity": fast, "metrics": {}}})
    rec = answer(rows_from_study(study2), NAMES)["recommendation"]
    assert rec["trial"] == 2 and rec["speed_since_trial"] == pytest.approx(1.0)
    assert "2 req/s in its trial; the engine's own speed (its canary) +100% since)" in rec["statement"]


def test_a_re_measure_that_fails_ranks_the_pick_last_with_a_verdict_of_the_interface(monkeypatch, tmp_path):
    """tuner.search.confirm.confirm_best with the re-measure failing (failure injected in place of the child `tuner bench`):
    the pick's figure becomes 0 req/s, verdict `indeterminate` (one of meets | misses | indeterminate) with the
    reason, and the next feasible trial is re-measured and picked."""
    import optuna

    import tuner.search.confirm as C
    from tuner.search.answer import rows_from_study

    def attrs(rps):
        cap = {"requests_per_s": rps, "requests_per_s_ci": [rps, rps * 1.05], "verdict": "meets", "probes": []}
        return {"config": {"model": "smollm2-135m", "quant": "bf16", "batch_cap": 8, "kv_fraction": 0.01,
                           "draft": "none", "device": "cpu"},
                "metrics": {}, "capacity": cap, "constraints": [-0.5, -1.0, -0.5]}

    study = optuna.create_study(directions=["maximize", "maximize"])
    for rps in (0.5, 3.0, 2.0):
        study.add_trial(optuna.trial.create_trial(values=[rps, 0.5], user_attrs=attrs(rps),
                                                  state=optuna.trial.TrialState.COMPLETE))
    measured = []

    def measure(config, ctx, trial_dir):
        measured.append(trial_dir.parent.name)
        if not measured[1:]:
            return {"status": "failed", "reason": "engine failed: killed"}
        return {"status": "ok", "metrics": {"capacity": capacity_at(1.9, 250.0, missed_ttft_ms=400.0)}}

    monkeypatch.setattr(C, "measure", measure)
    ctx = search_ctx(tmp_path, "ttft:p90<300ms")
    C.confirm_best(study, ctx, 2, log=lambda s: None)
    assert measured == ["0001", "0002"]
    one = study.user_attrs["confirmed"]["1"]["capacity"]
    assert one["verdict"] == "indeterminate" and one["requests_per_s"] == 0.0 and "killed" in one["failed"]
    a = answer(rows_from_study(study), NAMES, baseline_number=0)
    assert a["recommendation"]["trial"] == 2 and a["recommendation"]["capacity_requests_per_s"] == 1.9


def test_the_answer_says_when_the_machine_moved_under_the_pick_or_the_default():
    from tuner.measure.capacity import engine_drift, machine_drift

    rows = [row(0, "fp32", 1, 0.5, (0.5, 0.6), 250.0, 0.0), row(1, "bf16", 8, 2.0, (2.0, 2.2), 290.0, 0.8)]
    assert answer(rows, NAMES)["recommendation"]["machine_drift"] == {}  # not measured (or calm): nothing said
    def canaries(*itl_ms):
        return [{"at": f"step {i}", "itl_ms": t, "n": 21} for i, t in enumerate(itl_ms)]

    calm = engine_drift(canaries(20.0, 21.0, 20.5), [])
    slowed = engine_drift(canaries(20.0, 20.0, 30.0), [])  # its last step 1.5x as slow as the others
    rows[0].capacity["machine"] = machine_drift(45.0, 30.0, calm)  # calm under the default (bandwidth aside)
    rows[1].capacity["machine"] = machine_drift(30.0, 31.0, slowed)  # slowed by a third under the pick
    drift = answer(rows, NAMES)["recommendation"]["machine_drift"]
    assert list(drift) == [1] and drift[1] == pytest.approx(-1 / 3)


def test_the_answer_says_when_the_host_was_busy_under_the_pick():
    """The host's CPU accounting of two real windows: a quiet one under the default's measurement, one with a
    neighbour process under the pick's: the answer names the pick's trial and its busiest step, not the default's."""
    import contextlib
    import time

    from tests.neighbour import neighbour
    from tuner.measure.host import load_by_step, snapshot

    def measured(busy: bool) -> dict:
        marks = [("", snapshot())]
        with neighbour() if busy else contextlib.nullcontext():
            time.sleep(1.5)
            marks.append(("the saturation probe", snapshot()))
        return load_by_step(marks, [])

    rows = [row(0, "fp32", 1, 0.5, (0.5, 0.6), 250.0, 0.0), row(1, "bf16", 8, 2.0, (2.0, 2.2), 290.0, 0.8)]
    rows[0].capacity["host"] = measured(busy=False)
    rows[1].capacity["host"] = measured(busy=True)
    busy = answer(rows, NAMES)["recommendation"]["host_busy"]
    assert list(busy) == [1] and busy[1]["step"] == "the saturation probe"


def search_ctx(tmp_path, slo, budget=1.0, cost_per_hour=None, attainment=None):
    """The search's context as `tuner search` builds it (the bundled CPU space, default workload)."""
    from tuner.measure.workload import WorkloadSpec
    from tuner.search.objective import SearchContext
    from tuner.search.space import default_space_path
    from tuner.slo import build_slo

    _, s = build_slo(None, "ttft:p99", slo, attainment=attainment)
    return SearchContext(model="smollm2-135m", device="cpu", space=load_space(default_space_path("cpu")),
                         primary=None, slo=s, max_quality_drop=budget, workload=WorkloadSpec(),
                         quality_tasks=("arc_easy",), quality_limit=10, study_dir=tmp_path, results_dir=tmp_path,
                         cost_per_hour=cost_per_hour)


def capacity_at(rate, ttft_p90_ms, n=60, attained=0.95, missed_ttft_ms=2600.0, tok_s=None, above=1.25):
    """A capacity result shaped as tuner.measure.capacity writes it: probes below, at and above the capacity rate (rate 0:
    no rate met; the one probe misses)."""
    if not rate:
        probes = [{"rate_rps": 0.5, "n": n, "verdict": "misses", "ttft_ms": {"p90": missed_ttft_ms},
                   "attainment": 0.5}]
        return {"requests_per_s": 0.0, "requests_per_s_ci": [0.0, 0.5], "verdict": "misses",
                "output_tokens_per_s": 0.0, "probes": probes}
    probes = [{"rate_rps": rate / 2, "n": n, "verdict": "meets", "ttft_ms": {"p90": ttft_p90_ms / 2},
               "attainment": 1.0},
              {"rate_rps": rate, "n": n, "verdict": "meets", "ttft_ms": {"p90": ttft_p90_ms}, "attainment": attained},
              {"rate_rps": rate * above, "n": n, "verdict": "misses", "ttft_ms": {"p90": missed_ttft_ms},
               "attainment": 0.6}]
    return {"requests_per_s": rate, "requests_per_s_ci": [rate, rate * above], "verdict": "meets",
            "output_tokens_per_s": tok_s or rate * 30, "probes": probes}


def judged(ctx, number, capacity, drop_hi_pp, quant="bf16"):
    """A trial judged by the search's own constraint functions (tuner.search.objective)."""
    from tuner.search.objective import constraint_names, quality_constraint, slo_constraints

    q = {"score": 0.5 - drop_hi_pp / 200, "drop_pp": drop_hi_pp / 2,
         "gate": {"verdict": "within" if drop_hi_pp <= ctx.max_quality_drop else "indeterminate",
                  "drop_pp": drop_hi_pp / 2, "drop_ci_pp": [0.0, drop_hi_pp], "budget_pp": ctx.max_quality_drop,
                  "confidence": 0.95}}
    cons = slo_constraints(capacity, ctx) + [quality_constraint(q, ctx)]
    assert len(cons) == len(constraint_names(ctx))
    return Row(number, "COMPLETE", {"quant": quant, "batch_cap": 8, "kv_fraction": 0.01, "draft": "none"}, {}, q,
               cons, None, None, capacity, "transformers-cb")


def test_the_binding_constraint_is_the_picks_tightest_real_term_in_its_own_unit(tmp_path):
    """`make demo` printed "binding constraint: SLO shown to hold (least slack: -0% of its limit)": that indicator
    is 0 for every feasible trial, so it won `max` over terms that are all <= 0. The binding constraint is now the
    pick's tightest real term, with its value, its limit and its slack in its own unit."""
    from tuner.search.objective import constraint_names

    ctx = search_ctx(tmp_path, "ttft:p90<2s")
    names = constraint_names(ctx)
    assert names[1] == "SLO shown to hold"
    base = judged(ctx, 0, capacity_at(0.4, 700.0), 0.0, quant="fp32")
    pick = judged(ctx, 1, capacity_at(1.23, 1620.0), 0.5)  # ttft 19% of its limit to spare, quality 50%
    rec = answer([base, pick], names, baseline_number=0)["recommendation"]
    assert rec["trial"] == 1
    assert rec["binding_constraint"] == "ttft:p90 1.62 s of 2 s (0.38 s slack, n=60) at 1.23 req/s"
    b = rec["binding"]
    assert b["term"] == "ttft:p90<2000ms" and b["unit"] == "s" and b["n"] == 60 and b["at_rps"] == 1.23
    assert (b["value"], b["limit"], b["slack"]) == pytest.approx((1.62, 2.0, 0.38))
    # the same pick with a quality upper bound of 0.95 pp against a 1 pp budget: now quality binds
    tight = judged(ctx, 1, capacity_at(1.23, 1620.0), 0.95)
    rec = answer([base, tight], names, baseline_number=0)["recommendation"]
    assert rec["binding_constraint"] == "quality drop (upper 95% bound) 0.95 pp of 1 pp (0.05 pp slack)"
    assert rec["binding"]["unit"] == "pp" and rec["binding"]["slack"] == pytest.approx(0.05)
    # per-request targets: the attainment at the capacity point against the share required
    ctx2 = search_ctx(tmp_path, "ttft<300ms", attainment=0.9, budget=5.0)
    pick2 = judged(ctx2, 1, capacity_at(2.0, 250.0, attained=0.95), 0.5)
    rec = answer([pick2], constraint_names(ctx2), baseline_number=None)["recommendation"]
    assert rec["binding_constraint"] == "95.0% of requests within ttft<300ms, 90% required (5.0 pp slack, n=60) " \
                                        "at 2 req/s"


def test_a_re_measured_pick_is_judged_on_its_re_measure(monkeypatch, tmp_path):
    """tuner.search.confirm on a real Optuna study, the re-measure injected in place of the child `tuner bench`: trial 1
    won at 3 req/s but its re-measure meets the SLO at no rate. It is judged on that measure (constraints, slack,
    cost: infeasible), not kept "feasible" with a capacity of 0; the next candidate is re-measured and recommended,
    and the answer says why trial 1 is not. With a budget of one re-measure, no configuration is confirmed."""
    import optuna

    import tuner.search.confirm as C
    from tuner.search.answer import rows_from_study
    from tuner.search.objective import constraint_names

    ctx = search_ctx(tmp_path, "ttft:p90<2s", cost_per_hour=1.0)
    names = constraint_names(ctx)

    def new_study():
        study = optuna.create_study(directions=["maximize", "maximize"])
        study.set_user_attr("constraint_names", names)
        for n, rps in enumerate((0.5, 3.0, 2.0)):
            r = judged(ctx, n, capacity_at(rps, 1500.0, tok_s=rps * 40), 0.5)
            attrs = {"config": dict(r.config, model="smollm2-135m", device="cpu"), "metrics": {},
                     "capacity": r.capacity, "quality": r.quality, "constraints": r.constraints,
                     "cost_per_million_tokens": 1e6 / (rps * 40 * 3600)}
            study.add_trial(optuna.trial.create_trial(values=[rps, 0.5], user_attrs=attrs,
                                                      state=optuna.trial.TrialState.COMPLETE))
        return study

    again = {"1": capacity_at(0.0, 0.0, missed_ttft_ms=5200.0), "2": capacity_at(1.9, 1700.0, tok_s=70.0)}
    measured = []

    def measure(config, ctx, trial_dir):
        measured.append(trial_dir.parent.name)
        return {"status": "ok", "metrics": {"capacity": again[str(int(trial_dir.parent.name))]}}

    monkeypatch.setattr(C, "measure", measure)
    study, said = new_study(), []
    C.confirm_best(study, ctx, 2, log=said.append)
    assert measured == ["0001", "0002"]
    assert any("trial 1 re-measured: the re-measure met the SLO at no rate (verdict misses): not recommended" in s
               for s in said)
    rows = {r.number: r for r in rows_from_study(study)}
    assert not rows[1].feasible and rows[1].rps == 0.0  # judged on the re-measure: ttft 5.2 s at the lowest rate
    assert rows[1].constraints[0] == pytest.approx((5200.0 - 2000.0) / 2000.0) and rows[1].cost is None
    a = answer(list(rows.values()), names, baseline_number=0, cost_per_hour=1.0)
    assert a["n_feasible"] == 2 and 1 not in [r["trial"] for r in a["runners_up"] + a["pareto_front"]]
    assert a["not_confirmed"] == [{"trial": 1, "in_trial_requests_per_s": 3.0,
                                   "why": "the re-measure met the SLO at no rate (verdict misses)"}]
    rec = a["recommendation"]
    assert rec["trial"] == 2 and rec["confirmed"] and rec["capacity_requests_per_s"] == 1.9
    assert rec["slack"]["ttft:p90<2000ms"] == pytest.approx((2000.0 - 1700.0) / 2000.0)  # from the re-measure
    assert rec["binding_constraint"].startswith("ttft:p90 1.7 s of 2 s (0.3 s slack")
    assert rec["cost_per_million_tokens"] == pytest.approx(1e6 / (70.0 * 3600))  # the re-measure's tok/s
    assert "trial 1 (3 req/s in its trial) is not recommended: the re-measure met the SLO at no rate" \
        in rec["statement"]
    # one re-measure only: trial 1 fails it, trial 2 is first now but not re-measured -- nothing is confirmed
    study, said, measured[:] = new_study(), [], []
    C.confirm_best(study, ctx, 1, log=said.append)
    assert measured == ["0001"] and said[-1].startswith("no configuration confirmed: the --confirm budget (1) is spent")
    rec = answer(rows_from_study(study), names, baseline_number=0)["recommendation"]
    assert rec["trial"] == 2 and not rec["confirmed"]
    assert rec["statement"].endswith("no configuration confirmed: this figure is its trial's own (not re-measured)")


def test_the_readme_example_is_what_the_answer_prints(tmp_path):
    """README's example of the answer is the output of `tuner search`'s answer (tuner.search.answer.answer and the CLI's
    format_answer) on these two trials, judged by the search's own constraint functions: every line of its example
    block is printed, as written."""
    from tuner.cli.search import format_answer
    from tuner.search.objective import constraint_names

    ctx = search_ctx(tmp_path, "ttft:p90<3s", budget=1.0, cost_per_hour=2.5)
    base = judged(ctx, 0, capacity_at(0.31, 2400.0, tok_s=9.6, above=1.16), 0.0, quant="fp32")
    base = dataclasses.replace(base, config=dict(base.config, batch_cap=1))
    pick = judged(ctx, 7, capacity_at(1.6, 2620.0, tok_s=48.0, above=1.125), 0.6)
    pick = dataclasses.replace(pick, config=dict(pick.config, batch_cap=16, kv_fraction=0.5))
    a = answer([base, pick], constraint_names(ctx), baseline_number=0, cost_per_hour=2.5, target_rate=20)
    printed = format_answer({"answer": a, "study": "s", "storage": "sqlite:///results/tuner.db",
                             "csv": "trials.csv", "recommendation_path": "recommendation.json"}, ctx).splitlines()
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("<!-- answer example: tests/test_search_units.py -->\n```text\n", 1)[1].split("```", 1)[0]
    lines = block.strip("\n").splitlines()
    assert len(lines) >= 3 and lines[0].startswith("RECOMMENDED: trial 7")
    assert all(line in printed for line in lines), [line for line in lines if line not in printed]


# ----------------------------------------------------------------------------- one home per default --- #
def command_parser(command: str) -> argparse.ArgumentParser:
    """The real parser of one `tuner` command, built as tuner.cli builds it."""
    import importlib

    from tuner.cli import COMMANDS, OneLineParser

    sub = OneLineParser(prog="tuner").add_subparsers(dest="command")
    importlib.import_module(COMMANDS[command][0]).add_parser(sub)
    return sub.choices[command]


def test_every_search_bench_and_eval_flag_default_is_its_homes_value():
    """Parsed with no flag, `tuner search`, `tuner worker`, `tuner bench` and `tuner eval` hold the value of each
    setting's one home: a literal re-typed in the CLI that differs from it fails here."""
    from tuner.cli.bench import capacity_settings
    from tuner.config import TrialConfig
    from tuner.measure.bench import BenchOptions
    from tuner.measure.capacity import CapacityOptions
    from tuner.quality.common import DEFAULT_LIMIT, DEFAULT_SEED
    from tuner.quality.gate import DEFAULT_CONFIDENCE
    from tuner.quality.kld import DEFAULT_KLD_TOKENS
    from tuner.search import objective as home
    from tuner.slo import DEFAULT_LATENCY_METRIC, SLO

    for command in ("search", "worker"):
        a = command_parser(command).parse_args(["--model", "m"])
        assert (a.trials, a.confirm, a.max_quality_drop, a.seed, a.results_dir, a.device, a.served_model) == \
            (home.TRIALS, home.CONFIRM, home.MAX_QUALITY_DROP_PP, home.SEED, home.RESULTS_DIR, TrialConfig.device,
             TrialConfig.served_model)
        assert parse_duration_s(a.trial_timeout) == home.TRIAL_TIMEOUT_S
        assert (a.confidence, a.latency_metric) == (SLO.confidence, DEFAULT_LATENCY_METRIC)
        cap = capacity_settings(a)
        assert (cap["max_probes"], cap["timeout_s"], cap["probe_requests"], cap["saturation_requests"]) == \
            (CapacityOptions.max_probes, CapacityOptions.max_wall_s, None, CapacityOptions.saturation_requests)
    b = command_parser("bench").parse_args([])
    assert (b.timeout, b.confidence, b.latency_metric) == (BenchOptions.timeout_s, SLO.confidence,
                                                          DEFAULT_LATENCY_METRIC)
    cap = capacity_settings(b)
    assert (cap["max_probes"], cap["timeout_s"]) == (CapacityOptions.max_probes, CapacityOptions.max_wall_s)
    e = command_parser("eval").parse_args(["--model", "m"])
    assert (e.limit, e.seed, e.confidence, e.kld_tokens, e.engine, e.kv_type, e.device, e.served_model) == \
        (DEFAULT_LIMIT, DEFAULT_SEED, DEFAULT_CONFIDENCE, DEFAULT_KLD_TOKENS, TrialConfig.engine, TrialConfig.kv_type,
         TrialConfig.device, TrialConfig.served_model)


def test_every_default_a_help_text_states_is_its_homes_value():
    """Each default a `--help` line states ("(default ...)") is read back from the help and compared with its home;
    a line that states a figure as its default and is not listed here fails too (a new default typed into a help
    string must be added here, and then equals its home)."""
    import re

    from tuner.config import TrialConfig
    from tuner.engines.registry import backend
    from tuner.measure.bench import BenchOptions
    from tuner.measure.capacity import CapacityOptions, probe_requests_for
    from tuner.measure.workload import WorkloadSpec
    from tuner.quality.common import DEFAULT_LIMIT, DEFAULT_SEED
    from tuner.quality.gate import DEFAULT_CONFIDENCE
    from tuner.quality.kld import DEFAULT_KLD_TOKENS
    from tuner.search import objective as home
    from tuner.slo import DEFAULT_ATTAINMENT, DEFAULT_LATENCY_METRIC, SLO

    _, p90 = build_slo("1s", "ttft:p90", None, None, SLO.confidence)
    o, c, w = CapacityOptions, TrialConfig, WorkloadSpec
    number, word, text_ = r"\(default ([0-9.]+)\)", r"\(default ([\w.:-]+)\)", str
    capacity = {  # flag: (pattern read from its help, the home's values, how a match is read)
        "--attainment": (number, (DEFAULT_ATTAINMENT,), float),
        "--confidence": (number, (SLO.confidence,), float),
        "--probe-requests": (r"at least (\d+):(\d+); p90: (\d+):(\d+)\)",
                             (*o.probe_requests, *probe_requests_for(p90, o.max_probes, None)), int),
        "--max-probes": (number, (o.max_probes,), int),
        "--capacity-timeout": (word, (o.max_wall_s,), parse_duration_s),
        "--saturation-requests": (r"max\(in-flight, (\d+)\) completions over ([0-9.]+) s \(default 2 x",
                                  (o.steady_count(1), o.steady_s), float),
        "--latency-metric": (word, (DEFAULT_LATENCY_METRIC,), text_),
    }
    search = {
        **capacity,
        "--max-quality-drop": (number, (home.MAX_QUALITY_DROP_PP,), float),
        "--quality-max-limit": (r"else (\d+)x --quality-limit\)", (home.QUALITY_MAX_LIMIT_FACTOR,), int),
        "--quality-limit": (r"else (\d+)\)", (home.QUALITY_LIMIT,), int),
        "--quality-tasks": (r"else ([\w,]+)\)", (",".join(home.QUALITY_TASKS),), text_),
        "--trials": (number, (home.TRIALS,), int),
        "--confirm": (r"\(default (\d+);", (home.CONFIRM,), int),
        "--trial-timeout": (word, (home.TRIAL_TIMEOUT_S,), parse_duration_s),
        "--seed": (number, (home.SEED,), int),
        "--device": (word, (c.device,), text_),
        "--results-dir": (r"\(default (\w+)/\)", (home.RESULTS_DIR,), text_),
    }
    quant = (r"\(default (\S+)\); llamacpp: .* \(default (\S+)\)$",
             (backend("transformers").default_quant, backend("llamacpp").default_quant), text_)
    expected = {
        "search": search, "worker": search,
        "bench": {**capacity, "--timeout": (number, (BenchOptions.timeout_s,), float),
                  "--engine": (word, (c.engine,), text_), "--quant": quant, "--kv-type": (word, (c.kv_type,), text_),
                  "--batch-cap": (number, (c.batch_cap,), int), "--kv-fraction": (number, (c.kv_fraction,), float),
                  "--draft": (word, (c.draft,), text_), "--device": (word, (c.device,), text_),
                  "--requests": (number, (w.requests,), int), "--rate": (number, (w.rate,), float),
                  "--arrival": (word, (w.arrival,), text_),
                  "--input-len": (r"\(default (\d+):(\d+)\)", w.input_len, int),
                  "--output-len": (r"\(default (\d+):(\d+)\)", w.output_len, int),
                  "--shared-prefix": (number, (w.shared_prefix,), int), "--seed": (number, (w.seed,), int)},
        "eval": {
            "--engine": (r"\(default (\w+);", (c.engine,), text_), "--quant": quant,
            "--kv-type": (word, (c.kv_type,), text_), "--device": (word, (c.device,), text_),
            "--limit": (number, (DEFAULT_LIMIT,), int), "--seed": (number, (DEFAULT_SEED,), int),
            "--kld-tokens": (number, (DEFAULT_KLD_TOKENS,), int),
            "--confidence": (number, (DEFAULT_CONFIDENCE,), float),
        },
    }
    for command, checks in expected.items():
        helps = {a.option_strings[-1]: " ".join((a.help or "").split()) for a in command_parser(command)._actions
                 if a.option_strings}
        stating = {f for f, t in helps.items() if re.search(r"\b\d", "".join(t.split("(default")[1:]))}
        assert stating <= set(checks), (command, sorted(stating - set(checks)))  # a figure no home vouches for
        for flag, (pattern, values, read) in checks.items():
            m = re.search(pattern, helps[flag])
            assert m, (command, flag, helps[flag])
            assert tuple(read(g) for g in m.groups()) == tuple(values), (command, flag, helps[flag])
