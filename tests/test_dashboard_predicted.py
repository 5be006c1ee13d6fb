"""The dashboard on a `tuner search --strategy predict` study (tuner/dashboard/predicted.py, whatif.py, app.py).

The study is made by the real PredictStrategy driven as tuner.search.loop drives it: it predicts every configuration
of tests/data/tiny_predict_space.yaml from engine profiles taken by the real profile protocol
(tuner.predict.waves.collect_samples) on a simulated engine and stored in a temporary profile cache, and each
trial it enqueues is "measured" by the real capacity search (tuner.measure.capacity.CapacitySearch) on a simulated
engine twice as slow as its profile says (the model over-predicts, as a profile taken on a quieter host does). No
model, no server: every figure comes from the real strategy, simulator and capacity search.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest

from tests.conftest import REPO
from tests.test_dashboard import browser, page  # noqa: F401  (the real-browser fixtures, shared)
from tuner.dashboard import predicted as pr
from tuner.dashboard import whatif as wi
from tuner.dashboard.study import CAPACITY, study_info, trial_views
from tuner.dashboard.views import config_text
from tuner.errors import TunerError

SPACE = REPO / "tests" / "data" / "tiny_predict_space.yaml"
SLOWER = 2.0  # the "real" engine's steps against its profile's
STEPS = {"Q4_1": 0.002, "Q8_0": 0.001}  # decode time per running sequence (s) of each weight type's engine


def step_model(quant: str, factor: float = 1.0) -> Any:
    from tuner.predict.simulate import StepModel

    return StepModel(decode_base_s=0.010 * factor, decode_per_seq_s=STEPS[quant] * factor,
                     prefill_base_s=0.003 * factor, prefill_per_token_s=1e-4 * factor, noise_sigma=0.1)


def simulated_profile(quant: str, cap: int) -> dict[str, Any]:
    """A profile taken by the real protocol on a simulated engine, as profile.py writes it (id, version, fit)."""
    from tuner.predict import profile as prof
    from tuner.predict import waves
    from tuner.predict.fit import fit_step_model
    from tuner.predict.simulate import SimulatedEngine

    engine = SimulatedEngine(step_model(quant), cap, seed=5)
    s = waves.collect_samples(lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)), cap,
                             list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS), random.Random(0))
    _, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    return {"version": prof.VERSION, "id": f"sim-{quant}", "key": {"host": {}, "build": {}}, "fit": fit,
            "samples": s, "notes": [], "batch_cap": cap,
            "ranges": {"max_seqs": cap, "max_context_per_seq": max(waves.DECODE_PROMPTS) + waves.DECODE_TOKENS,
                       "max_prompt_tokens": max(waves.PREFILL_TOKENS)}}


def pool_for(config: Any, spec: Any, options: Any) -> list[Any]:
    """A capacity pool of the workload's token lengths (token ids only: no tokenizer in the unit tier)."""
    from tuner.measure.workload import Request

    rng = random.Random(spec.seed)
    return [Request(i, "", tuple(range(rng.randint(*spec.input_len))), rng.randint(*spec.output_len), None)
            for i in range(options.pool_size(config.batch_cap, measurements=2))]


def context(space: Any) -> Any:
    """The predict strategy's unit-test search context (e2e:p50<5s, probes of 12-30 requests, 3 probes) with
    short requests (a cheaper simulation)."""
    from tests.test_predict_strategy import context as strategy_context
    from tuner.measure.workload import WorkloadSpec

    return replace(strategy_context(space), workload=WorkloadSpec(requests=24, input_len=(32, 64), output_len=(8, 16)))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A cache holding the two simulated profiles ($TUNER_CACHE for this module's tests); the rest of the cache
    (converted models, GGUFs, engine builds) is the usual one, linked, so nothing is converted again."""
    from tuner.files import write_json_atomic
    from tuner.models import cache_root

    root = tmp_path_factory.mktemp("tuner-cache")
    usual = cache_root()
    for entry in (usual.iterdir() if usual.is_dir() else ()):
        if entry.name != "profiles":
            (root / entry.name).symlink_to(entry)
    for quant in STEPS:
        write_json_atomic(root / "profiles" / f"sim-{quant}.json", simulated_profile(quant, 4))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TUNER_CACHE", str(root))
        yield root


def predict_search(cache_dir: Any, space: Any, slower: Any = lambda config: SLOWER) -> tuple:
    """(study, ctx, strategy) of a predict search on `space`: predictions from the cached profiles, the trials the
    strategy chose (4 at most) measured on an engine `slower(config)` times as slow as its profile says."""
    import optuna

    from tuner.measure.capacity import CapacitySearch
    from tuner.predict.profile import read_profile
    from tuner.predict.simulate import SimulatedEngine
    from tuner.predict.strategy import PredictStrategy
    from tuner.search.space import suggest_config

    class FromCache(PredictStrategy):
        def cached(self, members: list[Any], cap: int) -> dict[str, Any]:
            return read_profile(cache_dir / "profiles" / f"sim-{members[0].config['quant']}.json")

    ctx = context(space)
    strategy = FromCache(lambda config, options: pool_for(config, ctx.workload, options))
    strategy.prepare(ctx, time_left_s=None)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(directions=["maximize", "maximize"])
    attrs = {"model": ctx.model, "slo": ctx.slo.to_dict(), "workload": ctx.workload.to_dict(),
             "settings": ctx.settings(), "primary": str(ctx.primary), "bounds": [str(ctx.primary)],
             "constraint_names": ["e2e:p50<5000ms", "failed requests=0"], "latency_metric": "e2e:p50",
             "latency_target_ms": 5000.0}
    for k, v in attrs.items():
        study.set_user_attr(k, v)
    options = strategy.options(ctx)

    def objective(trial: Any) -> tuple[float, float]:
        config = suggest_config(trial, space, ctx.model, ctx.device)
        engine = SimulatedEngine(step_model(config.quant, slower(config)), config.batch_cap, seed=11)
        cap = CapacitySearch(engine.run, pool_for(config, ctx.workload, options), config.batch_cap, options,
                             clock=engine.clock).search()
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("capacity", cap)
        trial.set_user_attr("constraints", [0.0 if cap["verdict"] == "meets" else 1.0, 0.0])
        return float(cap["requests_per_s"] or 0.0), 0.0

    for _ in range(4):
        if not strategy.enqueue_next(study, space):
            break
        study.optimize(objective, n_trials=1)
    return study, ctx, strategy


@pytest.fixture(scope="module")
def predict_study(cache_dir):
    """(study, ctx, strategy) of a predict search on the tiny space (`predict_search`), every engine SLOWER."""
    from tuner.search.space import load_space

    return predict_search(cache_dir, load_space(SPACE))


def views_of(study: Any) -> list[Any]:
    return trial_views(study.get_trials(deepcopy=False), study.user_attrs)


# ------------------------------------------------------------------------------ predicted vs measured --- #
def test_every_predicted_configuration_is_in_the_study_and_on_the_chart(predict_study) -> None:
    study, ctx, strategy = predict_study
    record = pr.prediction_record(study.user_attrs)
    views = views_of(study)
    assert record is not None and record["n_configurations"] == 6
    assert len(record["configurations"]) == record["n_predicted"] == 6  # Q4_1 and Q8_0 x batch caps 1, 2, 4
    assert {e["profile"] for e in record["configurations"]} == {"sim-Q4_1", "sim-Q8_0"}
    points = pr.predicted_points(record, views, CAPACITY, "config.batch_cap")
    assert sorted((p["config"]["quant"], p["y"]) for p in points) == [
        ("Q4_1", 1.0), ("Q4_1", 2.0), ("Q4_1", 4.0), ("Q8_0", 1.0), ("Q8_0", 2.0), ("Q8_0", 4.0)]
    measured = {v.number: v for v in views if v.state == "COMPLETE"}
    assert 2 <= len(measured) < 6  # the search measured some, not all
    for p in points:  # a measured configuration is still drawn as predicted, and names its trial
        assert "<b>predicted</b>" in p["hover"]
        if p["x_err"] is None:  # its band was never computed: the choosing rule did not need it (said)
            assert p["measured_trial"] is None and "no band: the search's choosing rule never needed it" in p["hover"]
            continue
        lo, hi = p["x"] - p["x_err"]["minus"], p["x"] + p["x_err"]["plus"]
        assert lo <= p["x"] <= hi and hi > lo
        if p["measured_trial"] is not None:
            assert measured[p["measured_trial"]].row.config["batch_cap"] == p["y"]
    assert sum(p["measured_trial"] is not None for p in points) == len(measured)
    # the batch cap goes up with the capacity the model predicts for a continuous-batching engine
    q8 = sorted((p["y"], p["x"]) for p in points if p["config"]["quant"] == "Q8_0")
    assert q8[0][1] < q8[-1][1]
    # predictions have no latency: on a latency axis none is drawn, and the default y avoids it
    assert pr.predicted_points(record, views, CAPACITY, "e2e_ms.p50") == []
    assert pr.axes_for_predictions([CAPACITY, "e2e_ms.p50", "config.batch_cap"], CAPACITY, "e2e_ms.p50",
                                   record) == (CAPACITY, "config.batch_cap")


def test_predicted_vs_measured_rows_scatter_and_summary(predict_study) -> None:
    study, _, _ = predict_study
    views = views_of(study)
    rows = pr.prediction_rows(views)
    complete = [v for v in views if v.state == "COMPLETE"]
    assert [r["trial"] for r in rows] == [v.number for v in complete]
    for r in rows:
        # the engine was twice as slow as profiled: the model over-predicted every measured configuration
        assert r["measured_rps"] > 0 and r["predicted_rps"] > r["measured_rps"]
        assert r["signed_error"] > 0 and r["config"].startswith("llamacpp ")
        assert r["within_band"] == (r["predicted_band_low_rps"] <= r["measured_rps"] <= r["predicted_band_high_rps"])
    line = pr.prediction_summary(rows, pr.prediction_record(study.user_attrs))
    assert line.startswith(f"predicted 6 of 6 configurations, measured {len(rows)} of them; model error")
    assert f"{sum(r['within_band'] for r in rows)} of {len(rows)} measured within their predicted band" in line
    fig = pr.scatter_figure(rows)
    traces = {t.name: t for t in fig.data}
    ident = traces["predicted = measured"]
    assert list(ident.x) == list(ident.y)  # the identity line
    drawn = [(x, y) for t in fig.data if t.name != "predicted = measured" for x, y in zip(t.x, t.y)]
    assert sorted(drawn) == sorted((r["predicted_rps"], r["measured_rps"]) for r in rows)
    assert all(x > y for x, y in drawn)  # below the identity line: over-predicted
    assert "predicted" in fig.layout.xaxis.title.text and "measured" in fig.layout.yaxis.title.text


def test_a_study_without_predictions_shows_none_of_it() -> None:
    from tests.test_dashboard import _mixed_specs, _study

    study = _study(_mixed_specs())
    views = views_of(study)
    assert pr.prediction_record(study.user_attrs) is None and not pr.has_predictions(study.user_attrs, views)
    assert pr.predicted_points(None, views, CAPACITY, "quality.score") == []
    assert pr.prediction_rows(views) == [] and pr.prediction_summary([], None) is None


def test_the_app_shows_the_predicted_tab_only_for_a_predict_study(predict_study, tmp_path, monkeypatch) -> None:
    """The real app.py run by Streamlit's script runner (no server, no browser) on a sqlite copy of each study."""
    from streamlit.testing.v1 import AppTest

    from tests.test_dashboard import _mixed_specs, _study

    study, _, _ = predict_study
    url = sqlite_copy(study, tmp_path / "studies.db")
    _study(_mixed_specs(), storage=url, name="mixed")
    monkeypatch.setenv("TUNER_STORAGE", url)
    seen = {}
    for name in ("pred", "mixed"):
        at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        at.query_params["study"] = name
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        seen[name] = [t.label for t in at.tabs]
        text = " ".join(m.value for m in at.markdown)
        if name == "pred":
            assert "predicted 6 of 6 configurations, measured" in text
            assert "What-if (predicted: nothing is measured)" in text
            titles = [c.proto.spec for c in at.get("plotly_chart")]
            assert any("measured trials and predicted configurations" in t for t in titles)
            assert any("predicted (x, band) vs measured (y, 95% CI)" in t for t in titles)
    assert "Predicted vs measured" in seen["pred"] and "Predicted vs measured" not in seen["mixed"]


def sqlite_copy(study: Any, path: Any, name: str = "pred") -> str:
    """The study copied into a SQLite storage (what `tuner dashboard` reads)."""
    import optuna

    url = f"sqlite:///{path}"
    copy = optuna.create_study(study_name=name, storage=url, directions=study.directions)
    for k, v in study.user_attrs.items():
        copy.set_user_attr(k, v)
    copy.add_trials(study.get_trials(deepcopy=False))
    return url


def test_a_predict_study_in_a_real_browser(predict_study, page, tmp_path) -> None:  # noqa: F811 (fixture)
    """`tuner dashboard` (a real Streamlit server) in real Chromium: the front's predicted configurations, the
    predicted-vs-measured chart, and the what-if with the model's real tokenizer and prompts (a bad SLO is one line;
    a tighter one re-predicts every configuration)."""
    from tests.test_dashboard import LOAD_S, no_exception, plot_traces, shot, tab, tuner_dashboard

    study, _, _ = predict_study
    n_measured = len(pr.prediction_rows(views_of(study)))
    srv = tuner_dashboard(sqlite_copy(study, tmp_path / "pred.db"), tmp_path / "dashboard.log")
    try:
        page.goto(f"{srv.url}/?study=pred")
        page.get_by_role("tab", name="Predicted vs measured", exact=True).wait_for(timeout=LOAD_S * 1000)
        page.locator(".js-plotly-plot").first.wait_for()
        assert plot_traces(page, 0)[pr.PREDICTED_NAME] == 6  # the Pareto chart: every predicted configuration
        tab(page, "Predicted vs measured")
        page.locator(".st-key-predicted_vs_measured .js-plotly-plot").wait_for()
        drawn = plot_traces(page, "predicted_vs_measured")
        assert sum(n for name, n in drawn.items() if name != "predicted = measured") == n_measured
        box = page.get_by_label("SLO", exact=True)
        box.fill("e2e:p50<5")
        page.get_by_role("button", name="Predict every configuration").click()
        page.get_by_text("is invalid: expected a number with a unit").wait_for()
        box.fill("e2e:p50<250ms")
        page.get_by_role("button", name="Predict every configuration").click()
        page.locator(".st-key-whatif_rows").wait_for(timeout=LOAD_S * 1000)
        page.get_by_text("6 configurations predicted in").wait_for()
        shot(page, "predicted")
        no_exception(page)
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------- what-if --- #
def test_what_if_at_the_studys_own_scenario_reproduces_the_searchs_predictions(predict_study) -> None:
    study, _, _ = predict_study
    record = pr.prediction_record(study.user_attrs)
    views = views_of(study)
    out = wi.what_if(record, study.user_attrs, views, wi.study_scenario(study.user_attrs), pool_for)
    assert out["message"] is None and out["same_as_study"] and out["simulations"] == 6
    assert len(out["rows"]) == 6 and [r["rank"] for r in out["rows"]] == list(range(1, 7))
    for r in out["rows"]:  # the study's capacity options and workload rebuilt from its attributes: the same searches
        assert r["predicted_rps"] == pytest.approx(r["study_predicted_rps"], rel=1e-9)
    rates = [r["predicted_rps"] for r in out["rows"]]
    assert rates == sorted(rates, reverse=True)
    measured = {v.number: v.capacity["requests_per_s"] for v in views if v.state == "COMPLETE"}
    assert {r["measured_trial"]: r["measured_rps"] for r in out["rows"] if r["measured_trial"] is not None} == measured
    cal = out["calibration"]  # the model over-predicted: the calibration scales it down
    assert cal["n"] == len(measured) and cal["ratio"] < 1


def test_what_if_calibrates_each_configuration_as_the_search_did(cache_dir, tmp_path) -> None:
    """The vllm-cpu space's shape (batch caps 1-4 listed, the engine default at 8, past the profiles' 4 sequences):
    the engine is 2x slower than its profile within and 6x at 8. The default, measured first, calibrates only the
    predictions past their profile; the what-if, given the trials measured before each choice, calibrates the chosen
    configuration as the search did when it chose it (one ratio over every trial scaled the ones within by the
    default's error too)."""
    from tuner.search.space import load_space

    path = tmp_path / "space.yaml"
    path.write_text(SPACE.read_text().replace("batch_cap: {choices: [1, 2, 4]}",
                                              "batch_cap: {choices: [1, 2, 4], increasing: true}")
                    .replace("batch_cap: 1,", "batch_cap: 8,"))
    study, _, _ = predict_search(cache_dir, load_space(path), lambda c: 6.0 if c.batch_cap > 4 else SLOWER)
    trials = study.get_trials(deepcopy=False)
    assert trials[0].user_attrs["predicted_calibrates"] is False and len(trials) >= 3
    assert any(t.user_attrs["predicted_calibrates"] for t in trials[1:])
    record = pr.prediction_record(study.user_attrs)
    for i, t in enumerate(trials[1:], 1):  # what the search knew when it chose trial i: the trials before it
        views = trial_views(trials[:i], study.user_attrs)
        out = wi.what_if(record, study.user_attrs, views, wi.study_scenario(study.user_attrs), pool_for)
        row = next(r for r in out["rows"] if r["config"] == config_text(t.user_attrs["config"]))
        assert row["predicted_rps"] == pytest.approx(t.user_attrs["predicted_requests_per_s"], rel=1e-9)
        assert row["calibrated_rps"] == pytest.approx(t.user_attrs["predicted_calibrated_requests_per_s"], rel=1e-9)
        assert row["calibration"] == ("within its profile" if t.user_attrs["predicted_calibrates"]
                                      else "past its profile (extrapolated)")
    out = wi.what_if(record, study.user_attrs, views_of(study), wi.study_scenario(study.user_attrs), pool_for)
    ratio = {g["within"]: g["ratio"] for g in out["calibration"]["groups"]}
    assert ratio[False] < 0.5 * ratio[True] < 0.5  # 6x against 2x slower than the profiles say
    for r in out["rows"]:  # every row by its own group's ratio
        within = r["batch_cap"] <= 4
        assert r["calibration"] == ("within its profile" if within else "past its profile (extrapolated)")
        assert r["calibrated_rps"] == pytest.approx(r["predicted_rps"] * ratio[within], rel=1e-9)
    text = wi.calibration_text(out["calibration"])
    assert f"x {ratio[True]:.2f} within their profile's sequences" in text and "past their" in text


def test_what_if_re_ranks_under_a_tighter_slo_longer_outputs_and_a_target_rate(predict_study) -> None:
    study, _, _ = predict_study
    record = pr.prediction_record(study.user_attrs)
    views = views_of(study)
    base = wi.study_scenario(study.user_attrs)
    cache: dict = {}
    at = {name: {r["config"]: r for r in wi.what_if(record, study.user_attrs, views, sc, pool_for, cache=cache)["rows"]}
          for name, sc in {"base": base, "tight": replace(base, slo="e2e:p50<250ms"),
                           "long": replace(base, output_len=(24, 32)),
                           "target": replace(base, target_rate_rps=10.0)}.items()}
    # the pools per batch cap of two workloads (the SLO's scenario reuses the base's) and 3 scenarios' simulations
    # (the target rate's are the base's)
    assert len(cache) == 2 * 3 + 3 * 6
    for config, r in at["base"].items():
        assert at["tight"][config]["predicted_rps"] <= r["predicted_rps"]
        assert at["long"][config]["predicted_rps"] < r["predicted_rps"]  # twice the tokens out per request
        assert at["tight"][config]["measured_rps"] is None  # measured under another SLO: not shown
        n, cal = at["target"][config]["replicas_needed"], at["target"][config]["calibrated_rps"]
        assert n * cal >= 10.0 > (n - 1) * cal
    assert any(r["predicted_rps"] < at["base"][c]["predicted_rps"] for c, r in at["tight"].items())
    ranked = {name: sorted(rows, key=lambda c: rows[c]["rank"]) for name, rows in at.items()}
    assert ranked["tight"] != ranked["base"]  # the tighter SLO costs the configurations unevenly: re-ranked
    assert all(r["replicas_needed"] is None for r in at["base"].values())


def test_what_if_without_a_profile_says_so_in_one_line(predict_study, tmp_path, monkeypatch) -> None:
    study, _, _ = predict_study
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path / "empty"))
    out = wi.what_if(pr.prediction_record(study.user_attrs), study.user_attrs, views_of(study),
                     wi.study_scenario(study.user_attrs), pool_for)
    assert out["rows"] == [] and "\n" not in out["message"]
    assert out["message"].startswith("no profile of this study is in the profile cache")


@pytest.mark.parametrize("args,needle", [
    (("e2e:p50<5", "64:200", "32:64", "poisson", ""), "is invalid: expected a number with a unit"),
    (("e2e:p50<5s", "200:64", "32:64", "poisson", ""), "input length '200:64' is invalid"),
    (("e2e:p50<5s", "64:200", "x", "poisson", ""), "output length 'x' is invalid"),
    (("e2e:p50<5s", "64:200", "32:64", "bursty", ""), "arrival 'bursty' is invalid"),
    (("e2e:p50<5s", "64:200", "32:64", "poisson", "-3"), "target rate '-3' is invalid"),
    (("e2e:p50<5s", "64:200", "32:64", "poisson", "nan"), "target rate 'nan' is invalid"),
])
def test_what_if_bad_input_is_one_line(args, needle) -> None:
    with pytest.raises(TunerError, match=needle) as e:
        wi.parse_scenario(*args)
    assert "\n" not in str(e.value)


def test_a_good_scenario_and_the_studys_own() -> None:
    s = wi.parse_scenario("ttft:p90<2s; tpot<50ms", "16:32", "8", "constant", " 2.5 ")
    assert s == wi.Scenario("ttft:p90<2s; tpot<50ms", (16, 32), (8, 8), "constant", 2.5)
    attrs = {"slo": {"bounds": ["ttft:p90<2000ms"], "targets_ms": {"tpot_ms": 50.0}, "attainment": 0.9,
                     "confidence": 0.9}, "workload": {"input_len": [64, 200], "output_len": [32, 64],
                                                      "arrival": "constant"}}
    own = wi.study_scenario(attrs)
    assert own == wi.Scenario("ttft:p90<2000ms; tpot<50ms", (64, 200), (32, 64), "constant")
    slo = wi.scenario_slo(attrs, own)  # the study's attainment and confidence carried over
    assert slo.to_dict() == attrs["slo"]
    assert wi.replicas(None, 1.0) is None and wi.replicas(3.0, 0.0) is None and wi.replicas(3.0, 1.0) == 3
    assert math.isclose(study_info("s", attrs).slo["confidence"], 0.9)
