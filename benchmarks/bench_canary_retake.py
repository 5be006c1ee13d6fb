"""How often does the capacity measurement take itself again? `tuner.measure.capacity.measure_capacity` (the real search
and its canary rule: a move of the engine's speed past max(10%, 3 x the canaries' own robust spread) re-measures)
run many times on a simulated engine (tuner.predict.simulate, virtual time, lognormal step noise):

  * quiet: the engine's speed never moves; every re-measure is a false alarm (issue 24's goal: <= 10% re-taken);
  * moved: the engine gets `--slowdown` slower after the saturation probe (a neighbour arrived); a re-measure is
    what the rule is for (its power).

    .venv/bin/python benchmarks/bench_canary_retake.py --runs 100 [--sigma 0.084 --slowdown 1.3]

--sigma: the step-time noise (log-sd); 0.084 is the llama-server -np 4 -t 1 profile's (tuner/predict/fit.py's
robust spread of raw decode gaps on this host). Every figure printed is simulated, measured nowhere.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner.measure.capacity import CapacityOptions, measure_capacity  # noqa: E402
from tuner.measure.workload import Request  # noqa: E402
from tuner.predict.estimate import scaled  # noqa: E402
from tuner.predict.simulate import SimulatedEngine, StepModel  # noqa: E402
from tuner.slo import SLO, parse_slo  # noqa: E402

CAP = 4


def model(sigma: float) -> StepModel:
    # ~llama-server -np 4 with SmolLM2-135M on 2 cores (benchmarks/bench_capacity_coverage.py's first scenario)
    return StepModel(decode_base_s=0.020, decode_per_seq_s=0.005, prefill_base_s=0.005,
                     prefill_per_token_s=0.0004, noise_sigma=sigma)


def workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, "x", tuple(range(rng.randint(64, 192))), rng.randint(24, 48), None) for i in range(n)]


def one(seed: int, sigma: float, slowdown: float | None) -> dict:
    engine = SimulatedEngine(model(sigma), CAP, seed=seed)
    runs = 0

    def run(*args, **kw):  # the engine slows once, after the warm-up, the first canary and the saturation probe
        nonlocal runs
        runs += 1
        if slowdown and runs == 4:
            engine.model = scaled(engine.model, slowdown)
        return engine.run(*args, **kw)

    opts = CapacityOptions(slo=SLO(tuple(parse_slo("ttft:p90<2s"))), seed=seed, max_wall_s=7200.0)
    return measure_capacity(run, workload(opts.pool_size(CAP, measurements=2), 1000 + seed), CAP, opts,
                            clock=engine.clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--sigma", type=float, default=0.084)
    ap.add_argument("--slowdown", type=float, default=1.3)
    a = ap.parse_args()
    t = time.perf_counter()
    for name, slow in (("quiet", None), (f"slowed x{a.slowdown:g} after the saturation probe", a.slowdown)):
        res = [one(seed, a.sigma, slow) for seed in range(a.runs)]
        retaken = sum("remeasured" in r for r in res)
        first = [r["remeasured"]["attempts"][0] if "remeasured" in r else r for r in res]  # the first measurement
        thresholds = sorted(f["canary"]["threshold"] for f in first)
        drifts = sorted(abs(f["canary"]["drift"] or 0) for f in first)
        print(f"{name} (step noise sigma {a.sigma:g}, simulated, n={a.runs}): re-measured {retaken} "
              f"({retaken / a.runs:.0%}); first measurement's canary threshold median {thresholds[len(thresholds) // 2]:.0%}, "
              f"|drift| median {drifts[len(drifts) // 2]:.0%}, max {drifts[-1]:.0%}")
    print(f"({time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
