"""`tuner predict`: the capacity `tuner bench --capacity` would measure, predicted in seconds from an engine profile.

The same configuration, workload and SLO flags as `tuner bench --capacity`; the engine's profile (tuner profile) is
measured first when this host and build have none. The real capacity search runs against a simulated engine in
virtual time (tuner.predict); every figure printed or written is predicted, never measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any

from tuner.cli.bench import add_capacity_args, capacity_options
from tuner.cli.common import (
    add_config_args,
    add_workload_args,
    check_output_path,
    config_from_args,
    workload_from_args,
    write_json_atomic,
)
from tuner.errors import TunerError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tuner.predict.estimate import REPLICATES, SPEED_DRIFT  # light: no numpy, no scipy

    p = sub.add_parser("predict", help="predict a configuration's capacity from its engine profile (no measuring)",
                       description="Predict what `tuner bench --capacity` would measure: the real capacity search "
                                   "(same bracket and verdict rules) run on a simulated engine whose step times come "
                                   "from this host's engine profile (`tuner profile`, measured first when missing). "
                                   "Every figure is predicted. Engines with a profile: llama.cpp, transformers "
                                   "(continuous batching) and vLLM.")
    add_config_args(p)
    add_workload_args(p)
    add_capacity_args(p)  # --capacity is implied (accepted for the same command line as bench)
    g = p.add_argument_group("prediction")
    g.add_argument("--at-rate", type=float, action="append", default=[], metavar="R",
                   help="also predict what `tuner bench --rate R` (same workload flags) would print; repeatable")
    g.add_argument("--at-share", type=float, action="append", default=[], metavar="S",
                   help="the same at S x the predicted capacity (x the saturation rate when no rate meets); "
                        "repeatable")
    g.add_argument("--replicates", type=int, default=REPLICATES,
                   help=f"simulations with resampled fit parameters for the band (default {REPLICATES})")
    g.add_argument("--speed-drift", type=float, default=None, metavar="U",
                   help="the band also carries the engine running U slower or faster than its profile "
                        f"(default {SPEED_DRIFT:g}: every step x {1 + SPEED_DRIFT:g} and / {1 + SPEED_DRIFT:g}; "
                        "0: the fit's uncertainty only)")
    g.add_argument("--refresh-profile", action="store_true", help="measure the engine profile again")
    g.add_argument("--json", metavar="FILE", help="write the prediction as JSON")
    g.add_argument("--measured", metavar="BENCH_JSON",
                   help="the --json of `tuner bench --capacity` with the same flags: the prediction is compared with "
                        "it and the comparison recorded in this profile's calibration history, whose errors every "
                        "later prediction's band carries")


def check_args(args: argparse.Namespace, config: Any) -> None:
    from tuner.engines.registry import backend, names, spoken

    if not backend(config.engine).profiled:
        profiled = names(profiled=True)
        raise TunerError(f"--engine {config.engine!r}: predictions need an engine profile, measured for "
                         f"{spoken(profiled)} only so far; expected --engine {spoken(profiled)}")
    if not 0 <= args.replicates <= 100:
        raise TunerError(f"--replicates {args.replicates} is invalid: expected an integer in [0, 100]")
    if args.speed_drift is not None and not 0 <= args.speed_drift <= 1:
        raise TunerError(f"--speed-drift {args.speed_drift} is invalid: expected a share in [0, 1]")
    for r in args.at_rate:
        if not r > 0:
            raise TunerError(f"--at-rate {r} is invalid: expected a number of requests per second > 0")
    for r in args.at_share:
        if not 0 < r <= 10:
            raise TunerError(f"--at-share {r} is invalid: expected a share of the predicted capacity in (0, 10]")


class TokenIdsOnly:
    """A tokenizer whose `decode` gives no text: the prompts `bench_prompts` builds with it have the same token ids
    (the same seed, windows and lengths) and an empty text, which a simulated engine never reads (decoding the
    ~40,000 prompts of a tail SLO's lifted capacity pool took 3 s, most of a prediction). The last text encoded is
    kept (every pool is a window into the one corpus: a search builds a pool per batch cap)."""

    last: list[Any] = []  # [tokenizer, text, kwargs, encoding] of the last call

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        last = TokenIdsOnly.last
        if not (last and last[0] is self.tokenizer and last[1] == text and last[2] == kwargs):
            TokenIdsOnly.last = [self.tokenizer, text, kwargs, self.tokenizer(text, **kwargs)]
        return TokenIdsOnly.last[3]

    def decode(self, ids: Any, **_: Any) -> str:
        return ""


def capacity_pool(config: Any, spec: Any, options: Any, tokenizer: Any) -> list[Any]:
    """The prompts `tuner bench --capacity` builds for this workload (same seed, same prompts, same order), as
    token ids: their text is left empty (the simulated engine reads token counts only)."""
    from tuner.measure.bench import bench_prompts

    return bench_prompts(config, spec, TokenIdsOnly(tokenizer), options)[0]


def bench_requests(config: Any, spec: Any, tokenizer: Any, rate: float) -> tuple[list[Any], list[Any]]:
    """The requests and warm-up `tuner bench --rate R` sends for this workload."""
    from tuner.measure.bench import bench_prompts

    return bench_prompts(config, replace(spec, rate=rate, concurrency=None), tokenizer)


def run(args: argparse.Namespace) -> int:
    from tuner.slo import build_slo

    config = config_from_args(args)
    check_args(args, config)
    spec = workload_from_args(args)
    out_path = check_output_path(args.json)
    bench = read_bench_json(args.measured) if args.measured else None
    _, slo = build_slo(args.latency_target, args.latency_metric, args.slo, args.attainment, args.confidence)
    options = capacity_options(args, slo, spec.seed, spec.arrival)
    if bench is not None:  # before any profiling: a bench of something else is said at once
        from tuner.predict.calibration import check_same

        check_same(config.to_dict(), slo.to_dict(), spec.to_dict(), bench)
    from tuner.predict.estimate import SPEED_DRIFT, predict
    from tuner.predict.profile import history_since, load_or_measure

    def log(s: str) -> None:
        print(s, file=sys.stderr)

    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    profile = load_or_measure(config, config.batch_cap, refresh=args.refresh_profile, log=log)
    tokenizer = load_tokenizer(checkpoint_dir(config.model))
    pool = capacity_pool(config, spec, options, tokenizer)
    t, cpu = time.perf_counter(), time.process_time()
    from tuner.predict.calibration import compare, read_history, record

    result = predict(profile, config, pool, options, replicates=args.replicates, seed=spec.seed, rates=args.at_rate,
                     shares=args.at_share, requests_at=lambda r: bench_requests(config, spec, tokenizer, r),
                     speed_drift=SPEED_DRIFT if args.speed_drift is None else args.speed_drift,
                     history=read_history(profile["id"], since=history_since(profile)))
    result["predict_s"], result["predict_cpu_s"] = time.perf_counter() - t, time.process_time() - cpu
    result = {"predicted": True, "config": config.to_dict(), "workload": spec.to_dict(), **result,
              "profile_path": profile.get("path"), "profile_cached": profile.get("cached")}
    if bench is not None:
        rec = compare(result, bench)
        result["measured"] = rec
        result["calibration_path"] = str(record(profile["id"], rec))
    print(format_prediction(result))
    if out_path:
        write_json_atomic(out_path, result)
    return 0


def history_text(h: dict[str, Any] | None) -> str:
    if not h or not h.get("n"):
        return ", no measured calibration yet"
    med = "" if h["median_error"] is None else f", median error {h['median_error']:+.0%}"
    return f", {h['n']} measured calibration{'s' if h['n'] != 1 else ''}{med}"


def read_bench_json(path: str) -> dict[str, Any]:
    import json

    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise TunerError(f"--measured {path}: cannot read it ({e.strerror}); expected the --json of `tuner bench "
                         "--capacity`") from None
    except ValueError:
        raise TunerError(f"--measured {path}: not JSON; expected the --json of `tuner bench --capacity`") from None
    if not isinstance(data, dict):
        raise TunerError(f"--measured {path}: not a bench result; expected the --json of `tuner bench --capacity`")
    return data


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.0f}"


def _band(b: Any, digits: int = 0) -> str:
    lo, hi = b or (None, None)
    return "[-]" if lo is None else f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def format_prediction(r: dict[str, Any]) -> str:
    c, cap, cal = r["config"], r["capacity"], r["calibration"]
    slo = r["search"]["slo"]
    lines = [f"PREDICTED (not measured): model={c['model']} engine={c['engine']} quant={c['quant']} "
             f"batch_cap={c['batch_cap']} kv_type={c.get('kv_type')}",
             f"  profile {r['profile']} ({'cached' if r.get('profile_cached') else 'measured now'}, "
             f"{cal['profile_measured_at']}, {cal['profile_host'].get('cpu_model')} x{cal['profile_host'].get('cores')}"
             f"); decode fit RMSE {1e3 * (cal['decode_fit']['rmse_s'] or 0):.2f} ms over {cal['decode_fit']['n']}, "
             f"prefill fit RMSE {1e3 * (cal['prefill_fit']['rmse_s'] or 0):.1f} ms over {cal['prefill_fit']['n']}",
             f"predicted capacity: {cap['requests_per_s']:.3f} req/s, band {_band(cap['band'], 3)} "
             f"({cal['replicates']} resampled fits, engine speed ±{cal['speed_drift']:.0%}"
             f"{history_text(cal.get('history'))}), verdict {cap['verdict'].upper()} for SLO "
             f"{'; '.join(slo['bounds'])} at {slo['confidence']:.0%}",
             *([f"EXTRAPOLATED past the profile ({'; '.join(cap['extrapolated'])}): the band is widened, the "
                "figures are less certain than the profile's fit says"] if cap.get("extrapolated") else []),
             f"predicted saturation: {cap['saturation_rps']:.3f} req/s",
             f"  {'rate req/s':>11}{'ttft p50':>10}{'ttft p90':>10}{'ttft p99':>10}{'tpot p50':>10}{'e2e p90':>10}"
             "   (predicted, ms)"]
    for p in r["curve"]:
        lines.append(f"  {p['rate_rps']:>11.3f}{_ms(p['ttft_ms']['p50']):>10}{_ms(p['ttft_ms']['p90']):>10}"
                     f"{_ms(p['ttft_ms']['p99']):>10}{_ms(p['tpot_ms']['p50']):>10}{_ms(p['e2e_ms']['p90']):>10}")
    for p in r.get("at_rates") or []:
        t = p["ttft_ms"]
        share = f" ({p['share']:g} x the capacity)" if p.get("share") else ""
        lines.append(f"at {p['rate_rps']:.4g} req/s{share} as `tuner bench --rate` (predicted, n={t['n']}): TTFT p50 "
                     f"{_ms(t['p50'])} {_band(t['band']['p50'])}, p90 {_ms(t['p90'])} {_band(t['band']['p90'])}, "
                     f"p99 {_ms(t['p99'])} ms; TPOT p50 {_ms(p['tpot_ms']['p50'])} ms")
    lines.append(f"predicted in {r['predict_s']:.2f} s ({r['predict_cpu_s']:.2f} s CPU)")
    m = r.get("measured")
    if m:
        err = "" if m["error"] is None else f", error of the prediction {m['error']:+.0%}"
        lines.append(f"MEASURED (tuner bench --capacity): {m['measured_requests_per_s']:.3f} req/s "
                     f"{_band(m['measured_ci'], 3)}, verdict {str(m['measured_verdict']).upper()}{err}: "
                     + ("within the predicted band" if m["within_band"] else "OUTSIDE the predicted band"
                        if m["within_band"] is False else f"censored: no rate met, the capacity lies below "
                        f"{m.get('measured_upper_rps') or 0:.3g} req/s, which the band reaches below")
                     + f"; recorded in {r['calibration_path']} (later bands carry it)")
    lines.extend(f"  note: {n}" for n in r.get("notes") or [])
    return "\n".join(lines)
