"""The dashboard's what-if (tuner/dashboard/whatif.py): seconds to re-predict and re-rank every configuration of a
`--strategy predict` study under another SLO / workload, against the goal of issue 26 (under 2 s).

The study is made the way `tuner search --strategy predict` makes it, up to its first measurement: the real
PredictStrategy enumerates a llama.cpp space and predicts every configuration from this host's cached llama-server
profiles (`tuner profile`; a format without a cached profile covering its batch caps is measured, so run this where
the formats below are profiled: tests/test_predict_llamacpp.py or `tuner profile --model smollm2-135m --engine
llamacpp --quant Q8_0 --batch-cap 4 --threads 1` and the same with Q4_1), and stores the predictions in an Optuna
study in memory. Then the what-if runs with the real capacity pool (tuner.measure.bench.bench_prompts, the model's
tokenizer), `--repeats` times per scenario; the tokenizer load is left out (the page loads it once).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_dashboard_whatif.py [--caps 1,2,3,4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPACE = """description: what-if benchmark space (formats this host has profiles of)
engine: llamacpp
knobs:
  quant: {{choices: [Q8_0, Q4_1]}}
  batch_cap: {{choices: [{caps}]}}
  kv_fraction: {{low: 0.001, high: 0.01, log: true}}
baseline: {{quant: Q4_1, batch_cap: 1, kv_fraction: 0.01, kv_type: auto, draft: none, threads: 1, ubatch: 0}}
workload: {{requests: 24, input_len: "32:64", output_len: "8:12"}}
quality: {{tasks: [arc_easy], limit: 20}}
capacity: {{saturation_requests: 8}}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default="1,2,3,4", help="batch caps of the space (within the cached profiles' cap)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import optuna

    from tuner.dashboard.predicted import prediction_record
    from tuner.dashboard.study import trial_views
    from tuner.dashboard.whatif import Scenario, study_scenario, what_if
    from tuner.measure.bench import bench_prompts
    from tuner.measure.workload import WorkloadSpec
    from tuner.models import checkpoint_dir
    from tuner.predict.strategy import PredictStrategy
    from tuner.quantize import load_tokenizer
    from tuner.search.objective import SearchContext
    from tuner.search.space import load_space
    from tuner.slo import SLO, parse_slo

    tokenizer = load_tokenizer(checkpoint_dir("smollm2-135m"))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "space.yaml"
        path.write_text(SPACE.format(caps=", ".join(args.caps.split(","))))
        space = load_space(path)
    slo = SLO(bounds=tuple(parse_slo("ttft:p90<2s")))
    ctx = SearchContext(model="smollm2-135m", device="cpu", space=space, primary=slo.bounds[0], slo=slo,
                        max_quality_drop=1.0, workload=WorkloadSpec(requests=24, input_len=(32, 64),
                                                                    output_len=(8, 12)),
                        quality_tasks=("arc_easy",), quality_limit=20, score_quality=False, saturation_requests=8)
    strategy = PredictStrategy(lambda c, o: bench_prompts(c, ctx.workload, tokenizer, o)[0])
    t = time.perf_counter()
    strategy.prepare(ctx, time_left_s=0.0)  # cached profiles only: a format without one is left out, not measured
    prepare_s = time.perf_counter() - t
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "maximize"])
    for k, v in {"slo": slo.to_dict(), "workload": ctx.workload.to_dict(), "settings": ctx.settings()}.items():
        study.set_user_attr(k, v)
    strategy.store_predictions(study)
    record = prediction_record(study.user_attrs)
    if record is None:
        print(f"no configuration predicted (left out: {strategy.left_out}): profile the formats first")
        return 1
    views = trial_views(study.get_trials(deepcopy=False), study.user_attrs)

    def pool_for(config, spec, options):
        return bench_prompts(config, spec, tokenizer, options)[0]

    base = study_scenario(study.user_attrs)
    scenarios = {"the study's own": base,
                 "tighter SLO ttft:p90<500ms": Scenario("ttft:p90<500ms", base.input_len, base.output_len),
                 "longer outputs 32:64": Scenario(base.slo, base.input_len, (32, 64)),
                 "constant arrivals, target 5 req/s": Scenario(base.slo, base.input_len, base.output_len,
                                                               "constant", 5.0)}
    print(f"{len(record['configurations'])} configurations predicted by the strategy in {prepare_s:.1f} s "
          f"(left out: {strategy.left_out or 'none'})")
    warm: dict = {}  # the page keeps one cache per study: the prompts of the study's own workload built once
    what_if(record, study.user_attrs, views, base, pool_for, cache=warm)
    pools = {k: v for k, v in warm.items() if k[0] == "pool"}
    scenarios["tighter SLO, the prompts cached (the page's second what-if)"] = scenarios["tighter SLO ttft:p90<500ms"]
    for name, sc in scenarios.items():
        times, out = [], None
        for _ in range(args.repeats):
            cache = dict(pools) if "cached" in name else None
            t = time.perf_counter()
            out = what_if(record, study.user_attrs, views, sc, pool_for, cache=cache)
            times.append(time.perf_counter() - t)
        assert out is not None and not out["message"], out
        top = out["rows"][0]
        print(f"what-if, {name}: {len(out['rows'])} configurations, {out['simulations']} simulations, median "
              f"{statistics.median(times):.2f} s over {args.repeats} (min {min(times):.2f}, max {max(times):.2f}); "
              f"top (predicted): {top['config']} {top['predicted_rps']:.3g} req/s"
              + (f", {top['replicas_needed']} replica(s)" if top["replicas_needed"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
