"""Seconds to predict: one configuration (`tuner predict`, as a user runs it, and in process with the tail SLO's
lifted budget, the ~20 s case of issue 26) and the whole llama.cpp space (search_spaces/llamacpp-cpu.yaml) through
the code `tuner search --strategy predict` runs (PredictStrategy.prepare: enumerate, predict_group, the engine
default's band), then the bands its choosing rule computes over a search in which every measurement equals its
prediction (PredictStrategy.choose until it stops: `choose_until_stop`). Goals (issue 26): <= 2 s per configuration,
the whole space <= 60 s. Every capacity here is PREDICTED. `--band-every` times the whole space with every band
computed at the start instead (the rule before 2026-12-06), and prints both strategies' choices.

Profiles: the cached real llama-server profile `--profile` (default: this host's Q8_0 -t 1 of smollm2-135m, `tuner
profile --model smollm2-135m --engine llamacpp --quant Q8_0 --batch-cap 16 --threads 1`: at the space's widest -np,
nothing extrapolated; one at --batch-cap 4 makes the space's -np 8 and 16 extrapolations). The space's 84 formats are not all
profiled on this host, so for the space each format gets a copy of that profile with its step times (fit and
samples) x a factor of its own (1 + 0.01 i): distinct profiles, so no format shares another's simulations, with the
costs of a real one (the capacities themselves are stand-ins: this measures seconds, not accuracy).

The machine may be shared: the script times a fixed CPU loop (`canary`) before and after, and prints the load
average; a canary slower than on a quiet host says the figures are slower by about as much. The space's simulations
run in one worker process per CPU (PredictStrategy.prefetch; `--workers 1,2` times serial and 2 processes in one
run); each space figure also says the CPU seconds it took, its worker processes' included (less moved by a neighbour
than the wall seconds, which a neighbour taking a core doubles).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_predict_space.py [--repeats 3] [--skip-cli] [--skip-space]
        [--profile-file saved.json] [--workers 1,2]
        [--slo-median 'ttft:p90<2s'] [--slo-tail 'ttft:p99<2s'] [--configs Q8_0:4,Q8_0:1,...] [--json out.json]

`--configs` with `--json` writes each configuration's predicted capacity and band (the before/after table: run it
with PYTHONPATH pointing at another checkout to compare two versions of the code side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path and not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m"
PROFILE_CONFIG = {"quant": "Q8_0", "threads": 1}  # the default profile: Q8_0 -t 1 of smollm2-135m, this host and build
SPACE = ROOT / "search_spaces" / "llamacpp-cpu.yaml"


def canary_s(n: int = 20_000_000) -> float:
    """A fixed pure-Python loop's seconds: the same work every time, slower when the CPU is shared."""
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i % 7
    return time.perf_counter() - t


def cpu_s() -> float:
    """CPU seconds this process and its finished children (worker processes) have used: less moved by a neighbour
    than wall seconds."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def read_profile(pid: str, path: Path | None = None) -> dict[str, Any]:
    """The cached profile `pid`, or with `path` that file read as it is (a copy kept for a before/after comparison:
    a profile of another version than the code's own, which its cache lookup would not read)."""
    from tuner.predict.profile import profiles_dir
    from tuner.predict.profile import read_profile as read

    if path is not None:
        return {**json.loads(path.read_text(encoding="utf-8")), "cached": True}
    prof = read(profiles_dir() / f"{pid}.json")
    if prof is None:
        raise SystemExit(f"no cached profile {pid} under {profiles_dir()}: run `tuner profile` first (see the docstring)")
    return {**prof, "cached": True}


def default_profile_id() -> str:
    """The cache id of `tuner profile --model smollm2-135m --engine llamacpp --quant Q8_0 --threads 1` here."""
    from tuner.config import TrialConfig
    from tuner.predict.profile import profile_id, profile_key

    return profile_id(profile_key(TrialConfig(model=MODEL, engine="llamacpp", **PROFILE_CONFIG)))


def scaled_profile(prof: dict[str, Any], factor: float, pid: str, cap: int) -> dict[str, Any]:
    """`prof` with every step time x `factor` (the fit's model and the samples it was fitted to) under id `pid`."""
    from tuner.predict.estimate import scaled
    from tuner.predict.simulate import StepModel

    fit = {**prof["fit"], "model": scaled(StepModel(**prof["fit"]["model"]), factor).to_dict()}
    s = prof["samples"]
    samples = {**s, "decode": [{**d, "step_s": d["step_s"] * factor} for d in s["decode"]],
               "prefill": [{**p, "ttft_s": p["ttft_s"] * factor} for p in s["prefill"]]}
    return {**prof, "id": pid, "fit": fit, "samples": samples, "batch_cap": max(cap, prof["batch_cap"])}


def capacity_options(slo_text: str, lifted: bool, max_probes: int = 5) -> Any:
    """The capacity settings of a search's trial for this SLO (probes sized by its percentile), and with `lifted`
    those its tail-SLO simulations run with (PredictStrategy.simulated: no wall budget, 3 probe caps per probe)."""
    from tuner.measure.capacity import CapacityOptions, probe_requests_for
    from tuner.slo import SLO, parse_slo

    slo = SLO(bounds=tuple(parse_slo(slo_text)))
    o = CapacityOptions(slo=slo, probe_requests=probe_requests_for(slo, max_probes, None), max_probes=max_probes)
    if lifted:
        from tuner.predict.strategy import PredictStrategy

        o = PredictStrategy(lambda c, op: []).simulated(o)
    return o


def workload_spec(space_path: Path = SPACE) -> Any:
    from tuner.measure.workload import WorkloadSpec
    from tuner.search.space import load_space

    w = load_space(space_path).workload
    return WorkloadSpec(requests=int(w.get("requests", 32)), input_len=tuple(int(x) for x in w["input_len"].split(":")),
                        output_len=tuple(int(x) for x in w["output_len"].split(":")))


def predict_in_process(prof: dict[str, Any], quant: str, cap: int, slo_text: str, lifted: bool, tokenizer: Any,
                       spec: Any) -> tuple[dict[str, Any], float]:
    """estimate.predict as `tuner predict` calls it (pool, replicates, speed drift, history), timed."""
    from tuner.cli.predict import capacity_pool
    from tuner.config import TrialConfig
    from tuner.predict.calibration import read_history
    from tuner.predict.estimate import REPLICATES, SPEED_DRIFT, predict

    config = TrialConfig(model=MODEL, engine="llamacpp", quant=quant, batch_cap=cap, threads=1)
    options = capacity_options(slo_text, lifted)
    pool = capacity_pool(config, spec, options, tokenizer)
    forget_searches()
    t = time.perf_counter()
    got = predict(prof, config, pool, options, replicates=REPLICATES, seed=spec.seed, speed_drift=SPEED_DRIFT,
                  history=read_history(prof["id"]))
    return got, time.perf_counter() - t


def code_root() -> Path:
    """The checkout whose `tuner` this process imported (PYTHONPATH may name another than this file's)."""
    import tuner

    return Path(tuner.__file__).resolve().parent.parent


def forget_searches() -> None:
    """Empty estimate's kept searches (where this version keeps them): each timing simulates afresh."""
    import tuner.predict.estimate as est

    getattr(est, "_SEARCHES", {}).clear()


def cli_predict_s(quant: str, cap: int, slo_text: str) -> float:
    """`tuner predict` as a user runs it (a fresh process: imports, tokenizer, profile read), wall seconds."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tuner", "predict", "--model", MODEL, "--engine", "llamacpp",
                           "--quant", quant, "--batch-cap", str(cap), "--threads", "1", "--slo", slo_text,
                           *spec_args()], capture_output=True, text=True, cwd=code_root())
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"tuner predict failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return wall


def spec_args() -> list[str]:
    s = workload_spec()
    return ["--requests", str(s.requests), "--input-len", f"{s.input_len[0]}:{s.input_len[1]}",
            "--output-len", f"{s.output_len[0]}:{s.output_len[1]}"]


def choose_until_stop(strategy: Any, trials: int) -> dict[str, Any]:
    """The choosing rule after prepare, over a search in which the engine default and then each chosen configuration
    measures exactly its prediction (the calibration as enqueue_next makes it), until it stops or `trials` are
    measured (`tuner search --trials`): the configurations chosen, the bands computed for the choices, how many came
    out wider than the rule had assumed, and the seconds (wall, CPU with the worker processes') they took."""
    from tuner.predict import choose
    from tuner.predict import strategy as st

    t, cpu, before = time.perf_counter(), cpu_s(), sum(p.banded for p in strategy.predictions)
    from tuner.search.space import config_key

    default = config_key(strategy.space, st.engine_defaults(strategy.space)[0])
    base = next(p for p in strategy.predictions if p.key == default)  # the engine default, measured first
    measured = [base]
    while len(measured) < trials:
        ratio, sigma = choose.calibration([(p.rps, p.rps) for p in measured])
        p, _ = strategy.choose(strategy.predictions, {m.key for m in measured}, ratio, sigma,
                               max(m.rps for m in measured))
        if p is None:
            break
        measured.append(p)
    return {"chosen": [(p.config["quant"], p.config["batch_cap"], p.config.get("kv_type"), p.config.get("threads"),
                        p.config.get("ubatch"), p.config.get("kv_fraction"), round(p.rps, 4)) for p in measured],
            "bands": sum(p.banded for p in strategy.predictions) - before, "s": time.perf_counter() - t,
            "cpu_s": cpu_s() - cpu, "stopped": p is None if len(measured) > 1 else None,
            "wider_than_assumed": len(strategy.wider_than_assumed)}


def predict_space(prof: dict[str, Any], slo_text: str, tokenizer: Any, space_path: Path = SPACE,
                  workers: int | None = None, band_every: bool = False, trials: int = 20) -> dict[str, Any]:
    """The whole space predicted by PredictStrategy.prepare (the cached-profile lookup answered with each format's
    stand-in profile, nothing measured), timed; what it predicted and its own cost record."""
    from tuner.cli.predict import capacity_pool
    from tuner.predict import strategy as st
    from tuner.search.space import load_space

    space = load_space(space_path)
    spec = workload_spec(space_path)
    options = capacity_options(slo_text, False)
    ctx = SimpleNamespace(space=space, slo=options.slo, capacity_timeout_s=options.max_wall_s, trial_timeout_s=None,
                          model=MODEL, device="cpu", probe_requests=options.probe_requests,
                          max_probes=options.max_probes, saturation_requests=None, workload=spec)
    formats: dict[tuple[Any, ...], dict[str, Any]] = {}

    def cached(self: Any, members: list[Any], cap: int) -> dict[str, Any]:
        fmt = st.format_of(members[0].config)
        if fmt not in formats:
            formats[fmt] = scaled_profile(prof, 1 + 0.01 * len(formats), f"{prof['id']}-x{len(formats)}", cap)
        return formats[fmt]

    kw = {"workers": workers} if workers is not None else {}  # (a version without worker processes takes none)
    if band_every:
        kw["band_every"] = True
    strategy = st.PredictStrategy(lambda config, o: capacity_pool(config, spec, o, tokenizer), seed=spec.seed, **kw)
    strategy.cached = cached.__get__(strategy)
    forget_searches()
    t, cpu = time.perf_counter(), cpu_s()
    strategy.prepare(ctx, None)
    took, cpu = time.perf_counter() - t, cpu_s() - cpu
    predicted = sum(p.rps is not None for p in strategy.predictions)
    banded = sum(getattr(p, "banded", p.band is not None) for p in strategy.predictions)
    cost = strategy.report_prediction()["prediction_cost"]  # prepare's (before the choices band more)
    return {"slo": slo_text, "s": took, "cpu_s": cpu, "configurations": strategy.n_configurations, "predicted": predicted,
            "banded": banded, "choosing": choose_until_stop(strategy, trials) if hasattr(strategy, "choose") else None,
            "left_out": sum(e["configurations"] for e in strategy.left_out), "formats": len(formats),
            "cost": cost,
            "top": [(p.config["quant"], p.config["batch_cap"], p.rps, p.band)
                    for p in sorted(strategy.predictions, key=lambda p: -(p.rps or 0))[:3]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timings per configuration (the median is printed)")
    ap.add_argument("--profile", default=None,
                    help="cached profile id (default: this host's and build's profile of smollm2-135m Q8_0 -t 1)")
    ap.add_argument("--profile-file", type=Path, default=None,
                    help="a profile JSON read as it is instead of the cache's --profile (any version the code reads)")
    ap.add_argument("--slo-median", default="ttft:p90<2s")
    ap.add_argument("--slo-tail", default="ttft:p99<2s")
    ap.add_argument("--configs", default="Q8_0:4,Q8_0:1",
                    help="QUANT:CAP,... predicted one at a time (the profile's format: QUANT names the config only)")
    ap.add_argument("--skip-cli", action="store_true", help="leave out the `tuner predict` processes")
    ap.add_argument("--skip-space", action="store_true", help="leave out the whole space")
    ap.add_argument("--skip-configs", action="store_true", help="leave out the configurations one at a time")
    ap.add_argument("--space", type=Path, default=SPACE, help=f"the space file (default {SPACE.name})")
    ap.add_argument("--space-slos", default=None, help="SLOs the space is predicted at, ';'-separated (default: "
                    "--slo-median and --slo-tail)")
    ap.add_argument("--workers", default=None,
                    help="processes the space's simulations run in, ','-separated to time several in one run "
                         "(default: the strategy's own, one per CPU; 1: serial)")
    ap.add_argument("--trials", type=int, default=20,
                    help="measurements the choosing scenario stops at (tuner search's --trials default: 20)")
    ap.add_argument("--band-every", action="store_true",
                    help="also time the whole space with every band computed at the start (the A/B of the lazy bands)")
    ap.add_argument("--json", help="write every figure as JSON")
    args = ap.parse_args()

    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    print(f"code: {code_root()}")
    before = canary_s()
    print(f"canary (fixed CPU loop): {before:.2f} s; {load_line()}", flush=True)
    prof = read_profile(args.profile or default_profile_id(), args.profile_file)
    tokenizer = load_tokenizer(checkpoint_dir(MODEL))
    spec = workload_spec()
    out: dict[str, Any] = {"canary_s": [before], "load": [os.getloadavg()], "configs": [], "cli": [], "space": []}
    configs = [(q, int(c)) for q, c in (item.split(":") for item in args.configs.split(","))]
    for slo_text, lifted in ((args.slo_median, False), (args.slo_tail, False), (args.slo_tail, True)
                             ) if not args.skip_configs else ():
        for quant, cap in configs:
            times, got = [], None
            for _ in range(args.repeats):
                got, s = predict_in_process(prof, quant, cap, slo_text, lifted, tokenizer, spec)
                times.append(s)
            c = got["capacity"]
            row = {"quant": quant, "batch_cap": cap, "slo": slo_text, "lifted": lifted, "s": times,
                   "median_s": statistics.median(times), "requests_per_s": c["requests_per_s"], "band": c["band"],
                   "saturation_rps": c["saturation_rps"], "verdict": c["verdict"]}
            out["configs"].append(row)
            band = "[-]" if c["band"][0] is None else f"[{c['band'][0]:.3f}, {c['band'][1]:.3f}]"
            print(f"predict {quant} -np {cap} {slo_text}{' (budget lifted, as the strategy)' if lifted else ''}: "
                  f"median {row['median_s']:.2f} s of {args.repeats} (in process); PREDICTED "
                  f"{c['requests_per_s']:.3f} req/s band {band}, saturation {c['saturation_rps']:.3f}", flush=True)
    if not args.skip_cli:
        for slo_text in (args.slo_median, args.slo_tail):
            quant, cap = configs[0]
            times = [cli_predict_s(quant, cap, slo_text) for _ in range(args.repeats)]
            out["cli"].append({"slo": slo_text, "s": times, "median_s": statistics.median(times)})
            print(f"`tuner predict` {quant} -np {cap} {slo_text}: median {statistics.median(times):.2f} s of "
                  f"{args.repeats} (a fresh process each, imports and tokenizer included)", flush=True)
    if not args.skip_space:
        slos = args.space_slos.split(";") if args.space_slos else [args.slo_median, args.slo_tail]
        runs = [(s, w, every) for s in slos for w in (args.workers.split(",") if args.workers else [None])
                for every in ((False, True) if args.band_every else (False,))]
        for slo_text, workers, every in runs:
            r = predict_space(prof, slo_text, tokenizer, args.space, None if workers is None else int(workers), every,
                              args.trials)
            out["space"].append({**r, "workers": workers, "band_every": every})
            print(f"whole space {args.space.name} at {slo_text}"
                  + (f" ({workers} worker process{'es' if workers != '1' else ''})" if workers else "")
                  + (" EVERY BAND at the start" if every else "")
                  + f": {r['s']:.1f} s for {r['configurations']} configurations "
                  f"({r['predicted']} predicted, {r['banded']} with their band, {r['left_out']} left out: drafts; "
                  f"{r['formats']} formats, {r['cost']['simulations']} simulations): "
                  f"{r['configurations'] / r['s']:.1f} configurations/s ({r['predicted'] / r['s']:.1f} predicted/s); "
                  f"{r['cpu_s']:.1f} CPU s", flush=True)
            c = r["choosing"]
            if c is not None:
                print(f"  choosing (each measurement = its prediction) until it stops or {args.trials} are measured: "
                      f"{len(c['chosen'])} measured (the default included; "
                      f"{'stopped by the rule' if c['stopped'] else 'trials spent'}), {c['bands']} more bands computed "
                      f"({c['wider_than_assumed']} wider than assumed), {c['s']:.1f} s ({c['cpu_s']:.1f} CPU s); "
                      f"chosen: {c['chosen']}", flush=True)
    after = canary_s()
    out["canary_s"].append(after)
    out["load"].append(os.getloadavg())
    print(f"canary (fixed CPU loop): {after:.2f} s after; {load_line()}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
