"""Do the capacity's intervals hold? The real capacity search (tuner.measure.capacity.CapacitySearch) run hundreds of times
on a simulated engine (tuner.predict.simulate: continuous batching in virtual time, lognormal step-time noise)
whose true capacity is known from long sustained simulations: how often is the reported lower end above the truth
(goal <= 5% at 95%), how often does a probe say "meets" at a rate where the sustained SLO fails, and how far below
the truth is the figure (the cost of being right).

    .venv/bin/python benchmarks/bench_capacity_coverage.py --runs 200
    .venv/bin/python benchmarks/bench_capacity_coverage.py --runs 200 --rev 557ab37   # the search as it was then

`--rev` loads tuner/measure/capacity.py from that git revision into a module of its own (the rest of tuner as it is now)
and runs the same scenarios through it: the same engines, seeds and truth, side by side. Every figure printed is
from the simulation (a model of an engine: measured nowhere), the truth included.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner.measure.workload import Request, with_arrivals  # noqa: E402
from tuner.predict.simulate import SimulatedEngine, StepModel  # noqa: E402
from tuner.slo import SLO, parse_slo  # noqa: E402


@dataclass(frozen=True)
class Scenario:
    """An engine and a workload: `batch_cap` slots, a step model, prompts of `input_len` and outputs of
    `output_len` tokens (uniform), Poisson arrivals, one SLO bound."""

    name: str
    model: StepModel
    batch_cap: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    slo: str


SCENARIOS = [
    # ~llama-server -np 4 with SmolLM2-135M Q8_0 on 2 cores (saturation ~2.5 req/s at 24:48 out): the case
    Scenario("llamacpp-like cap 4, ttft:p90<2s", StepModel(decode_base_s=0.020, decode_per_seq_s=0.005,
                                                           prefill_base_s=0.005, prefill_per_token_s=0.0004,
                                                           noise_sigma=0.15),
             4, (64, 192), (24, 48), "ttft:p90<2s"),
    # a wider batch and a tighter bound: capacity further from saturation
    Scenario("cap 16, ttft:p90<500ms", StepModel(decode_base_s=0.015, decode_per_seq_s=0.003,
                                                 prefill_base_s=0.005, prefill_per_token_s=0.0002, noise_sigma=0.2),
             16, (64, 192), (24, 48), "ttft:p90<500ms"),
]


def workload(scenario: Scenario, n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, "x", tuple(range(rng.randint(*scenario.input_len))), rng.randint(*scenario.output_len), None)
            for i in range(n)]


def sustained_p(scenario: Scenario, rate: float, q: float, n: int = 30_000, seed: int = 12345) -> float:
    """The q-quantile of TTFT under a sustained Poisson load at `rate` (the first 15% left out): the truth a
    capacity claim is checked against. Failed or unfinished requests count as infinitely late."""
    engine = SimulatedEngine(scenario.model, scenario.batch_cap, seed=seed)
    reqs = with_arrivals(workload(scenario, n, seed), rate, "poisson", seed)
    load = engine.run(reqs, timeout_s=reqs[-1].arrival_s * 4 + 600)
    vals = sorted((r.ttft_ms if r.ok and r.ttft_ms is not None else math.inf) for r in load.results[n * 15 // 100:])
    return vals[min(len(vals) - 1, math.ceil(q * len(vals)) - 1)]


def true_capacity(scenario: Scenario, saturation_rps: float) -> float:
    """The highest rate whose sustained TTFT quantile is within the limit, by bisection (0.5%)."""
    b = parse_slo(scenario.slo)[0]
    q = float(b.stat[1:]) / 100
    lo, hi = 0.05 * saturation_rps, saturation_rps
    while hi - lo > 0.005 * hi:
        mid = (lo + hi) / 2
        if sustained_p(scenario, mid, q) <= b.limit_ms:
            lo = mid
        else:
            hi = mid
    return lo


def saturation(scenario: Scenario) -> float:
    """The engine's service rate: a long closed loop at the batch cap (steady completions per second)."""
    engine = SimulatedEngine(scenario.model, scenario.batch_cap, seed=99)
    load = engine.run(workload(scenario, 4000, 99), concurrency=scenario.batch_cap + 2)
    ends = sorted(r.send_s + r.e2e_ms / 1e3 for r in load.results if r.ok)
    a, b = ends[500], ends[-100]
    return sum(a < e <= b for e in ends) / (b - a)


def load_capacity_module(rev: str | None) -> Any:
    if rev is None:
        import tuner.measure.capacity

        return tuner.measure.capacity
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:tuner/measure/capacity.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"capacity_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"capacity_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def one_search(cap_mod: Any, scenario: Scenario, seed: int) -> dict[str, Any]:
    engine = SimulatedEngine(scenario.model, scenario.batch_cap, seed=seed)
    opts = cap_mod.CapacityOptions(slo=SLO(tuple(parse_slo(scenario.slo))), seed=seed, max_wall_s=3600.0)
    pool = workload(scenario, opts.pool_size(scenario.batch_cap), 1000 + seed)
    kw = {"clock": engine.clock} if "clock" in cap_mod.CapacitySearch.__init__.__code__.co_varnames else {}
    return cap_mod.CapacitySearch(engine.run, pool, scenario.batch_cap, opts, **kw).search()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200, help="simulated capacity searches per scenario")
    ap.add_argument("--rev", help="git revision whose tuner/measure/capacity.py to run instead of the working tree's")
    args = ap.parse_args()
    cap_mod = load_capacity_module(args.rev)
    print(f"capacity search: {'tuner/measure/capacity.py at ' + args.rev if args.rev else 'working tree'}; "
          f"every figure simulated (virtual time), none measured")
    for sc in SCENARIOS:
        t0 = time.perf_counter()
        sat = saturation(sc)
        truth = true_capacity(sc, sat)
        q = float(parse_slo(sc.slo)[0].stat[1:]) / 100
        limit = parse_slo(sc.slo)[0].limit_ms
        over, under, false_meets, meets_probes, bad_runs, ratios, verdicts, costs = 0, 0, 0, 0, 0, [], [], []
        for seed in range(args.runs):
            res = one_search(cap_mod, sc, seed)
            low = res["requests_per_s"]
            verdicts.append(res["verdict"])
            costs.append(res["cost"]["requests"])
            over += low > truth
            under += res["requests_per_s_ci"][1] < truth
            if low > 0:
                ratios.append(low / truth)
            wrong = [p for p in res["probes"] if p["verdict"] == "meets" and p["rate_rps"] > truth]
            meets_probes += sum(p["verdict"] == "meets" for p in res["probes"])
            false_meets += len(wrong)
            bad_runs += bool(wrong)
        n = args.runs
        print(f"\n{sc.name}: saturation {sat:.3f} req/s (simulated closed loop), true capacity {truth:.3f} req/s "
              f"({truth / sat:.0%} of saturation; sustained 30k-request TTFT p{q * 100:g} = "
              f"{sustained_p(sc, truth, q):.0f} ms at it, limit {limit:.0f} ms)")
        print(f"  runs {n}: lower end above the truth in {over} ({over / n:.1%}; goal <= 5%); upper end below it in "
              f"{under} ({under / n:.1%}); the interval missed the truth in {over + under} ({(over + under) / n:.1%})")
        print(f"  'meets' said at a rate above the truth: {false_meets} of {meets_probes} meeting probes "
              f"({false_meets / max(meets_probes, 1):.1%}), in {bad_runs} runs ({bad_runs / n:.1%})")
        if ratios:
            qs = statistics.quantiles(ratios, n=10)
            print(f"  reported / true capacity (runs with a capacity, n={len(ratios)}): median "
                  f"{statistics.median(ratios):.3f}, p10 {qs[0]:.3f}, p90 {qs[-1]:.3f}")
        print("  verdicts: " + ", ".join(f"{v} {verdicts.count(v)}" for v in ("meets", "misses", "indeterminate")))
        print(f"  requests per search: median {statistics.median(costs):.0f}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
