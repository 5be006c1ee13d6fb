"""Capacity benchmark on smollm2-135m, all figures from one run on this machine (`tuner bench --capacity`, each
measurement in a fresh process, interleaved so slow drifts of the shared machine hit every config alike).

(a) gain: the capacity of a chosen config (default bf16, batch cap 16, KV 0.01) vs the engine default
    (fp32, batch cap 1, KV 0.01, no draft) at the same SLO and workload. Goal >= 5x.
(b) repeatability: the chosen config measured --repeat times: spread of capacity around the median. Goal +-10%.

Usage: .venv/bin/python benchmarks/bench_capacity.py [--slo "ttft:p90<2s"] [--repeat 3] [--json out.json]
       [--engine llamacpp|vllm --skip-default --config Q8_0,8,0.002,none]
       [--config quant,cap,kv,draft] [--input-len 64:192] [--output-len 24:48] [--probe-requests 30:60]
       [--neighbour-after S [--neighbour-for S]]  (a neighbour process arriving S s into each run, leaving after
       S s: does the engine canary flag it, and does the re-measure it triggers recover the quiet figure?)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m"
DEFAULT = ("fp32", 1, 0.01, "none")


def machine_gflops() -> float:
    """This machine's speed right now: median GFLOP/s of 1024^2 fp32 matmuls over ~1 s (a shared 2-core VM drifts;
    printed next to each capacity so a drift of the machine is told apart from one of the measure)."""
    import torch

    x = torch.randn(1024, 1024)
    rates = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(8):
            x @ x
        rates.append(8 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


def measure(cfg: tuple, args: argparse.Namespace) -> dict:
    gflops = machine_gflops()
    from tuner.measure.bench import memory_bandwidth  # the probe tuner bench runs around each CPU measurement

    bw_before = memory_bandwidth()
    quant, cap, kv, draft = cfg
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "cap.json"
        t = time.perf_counter()
        argv = [sys.executable, "-m", "tuner", "bench", "--engine", args.engine, "--model", MODEL,
                "--quant", quant, "--batch-cap", str(cap), "--kv-fraction", str(kv), "--draft", draft, "--capacity",
                "--slo", args.slo, "--input-len", args.input_len, "--output-len", args.output_len,
                "--probe-requests", args.probe_requests, "--max-probes", str(args.max_probes),
                "--capacity-timeout", args.capacity_timeout, "--seed", str(args.seed),
                "--no-bandwidth", "--quiet", "--json", str(out), *shlex.split(args.bench_args)]
        proc = with_neighbour(args.neighbour_after, args.neighbour_for, argv) if args.neighbour_after else \
            subprocess.run(argv, capture_output=True, text=True)
        wall = time.perf_counter() - t
        bw = [bw_before, memory_bandwidth()]
        if proc.returncode != 0 or not out.is_file():
            return {"config": cfg, "error": (proc.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall,
                    "gflops": gflops, "bandwidth_gbs": bw}
        cap_ = json.loads(out.read_text())["metrics"]["capacity"]
    return {"config": cfg, "requests_per_s": cap_["requests_per_s"], "ci": cap_["requests_per_s_ci"],
            "verdict": cap_["verdict"], "output_tokens_per_s": cap_["output_tokens_per_s"],
            "saturation_rps": cap_["saturation"]["requests_per_s"], "probes": len(cap_["probes"]),
            "requests": cap_["cost"]["requests"], "wall_s": wall, "notes": cap_["notes"], "gflops": gflops,
            "bandwidth_gbs": bw, "canary": cap_.get("canary") or {},
            "rates": [(p["rate_rps"], p["n"], p["verdict"]) for p in cap_["probes"]],
            "remeasured": cap_.get("remeasured"), "host": cap_.get("host") or {}}


NEIGHBOUR = "import numpy as np\na = np.ones(2**25)\nb = np.empty_like(a)\nwhile True:\n    np.copyto(b, a)\n"


def with_neighbour(after_s: float, for_s: float, argv: list[str]) -> subprocess.CompletedProcess:
    """Run `argv` while, from `after_s` seconds on (for `for_s` seconds, 0: until it ends), another process copies
    256 MB arrays in a loop on one core (a neighbour arriving on the host mid-measurement: memory bandwidth and a
    core taken)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hog = None
    try:
        try:
            out, err = proc.communicate(timeout=after_s)
        except subprocess.TimeoutExpired:
            hog = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
            try:
                out, err = proc.communicate(timeout=for_s or None)
            except subprocess.TimeoutExpired:
                hog.kill()
                out, err = proc.communicate()
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def show(r: dict) -> str:
    q, cap, kv, draft = r["config"]
    name = f"{q} cap {cap} kv {kv} draft {draft}"
    if "error" in r:
        return f"  {name:<36} ERROR {r['error']}"
    lo, hi = r["ci"]
    return (f"  {name:<36} {r['requests_per_s']:.3f} req/s [{lo:.3f}, {hi:.3f}] {r['verdict']:<13} "
            f"sat {r['saturation_rps']:.3f}  {r['probes']} probes, {r['requests']} req, {r['wall_s']:.0f} s; "
            f"machine {r['gflops']:.0f} GFLOP/s before, memory {r['bandwidth_gbs'][0]:.1f} -> "
            f"{r['bandwidth_gbs'][1]:.1f} GB/s; {canary(r)}; {host(r)}" + remeasured(r))


def remeasured(r: dict) -> str:
    """The run measured twice (its canary moved or its host was busy past 10% in the first): both figures, under
    which conditions, which one it reported."""
    from tuner.measure.capacity import describe_conditions

    again = r.get("remeasured")
    if not again:
        return ""
    parts = [f"{a['requests_per_s']:.3f} ({describe_conditions(a)})" for a in again["attempts"]]
    return f"; measured twice: {' then '.join(parts)}, reported #{again['kept'] + 1}"


def host(r: dict) -> str:
    from tuner.measure.host import busy_share

    h = r.get("host") or {}
    if not h.get("busiest"):
        return "host -"
    return (f"host: others {h['others_share']:.0%}, steal {h['steal_share']:.0%} (busiest {h['busiest']['step']}: "
            f"{busy_share(h['busiest']):.0%})")


def canary(r: dict) -> str:
    c = r.get("canary") or {}
    if c.get("drift") is None:
        return "canary -"
    return f"canary ITL p50 {' '.join(f'{t:.0f}' for t in c['itl_ms'] if t)} ms (largest move {c['drift']:+.0%})"


def steady(r: dict) -> bool:
    """The run's conditions held: its engine canary within tuner.measure.capacity.DRIFT_NOTE and its host not busy (no
    note of a moved engine or a busy host, tuner.measure.capacity.disturbed)."""
    from tuner.measure.capacity import disturbed

    return r.get("canary", {}).get("drift") is not None and disturbed(r) is None


def report_gain(runs: list[dict], base: dict) -> dict:
    """The gain with its bounds from the two capacity intervals: [chosen low / default high, chosen high / default
    low]. The goal is decided when the lower bound clears it (a default with no capacity has an infinite upper)."""
    ok = [r for r in runs if "error" not in r]
    med = statistics.median(r["requests_per_s"] for r in ok)
    lo_c = min(r["ci"][0] for r in ok)  # the most pessimistic of the repeats
    hi_c = max(r["ci"][1] for r in ok)
    b, (lo_b, hi_b) = base["requests_per_s"], base["ci"]
    point = med / b if b else None
    lower = lo_c / hi_b if hi_b else None
    upper = hi_c / lo_b if lo_b else None
    fmt = lambda v: "inf" if v is None else f"{v:.1f}x"  # noqa: E731
    verdict = "meets" if lower is not None and lower >= 5 else "misses" if upper is not None and upper < 5 else \
        "indeterminate"
    print(f"(a) gain: chosen {med:.3f} req/s (median; lowest bound {lo_c:.3f}) vs default {b:.3f} req/s "
          f"[{lo_b:.3f}, {hi_b:.3f}]: point {fmt(point)}, bounds [{fmt(lower)}, {fmt(upper)}] -> goal >= 5x "
          f"{verdict}")
    return {"point": point, "lower": lower, "upper": upper, "verdict": verdict}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--slo", default="ttft:p90<2s")
    p.add_argument("--config", default="bf16,16,0.01,none", help="quant,cap,kv,draft of the config to compare")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--input-len", default="64:192")
    p.add_argument("--output-len", default="24:48")
    p.add_argument("--probe-requests", default="30:60")
    p.add_argument("--max-probes", type=int, default=4)
    p.add_argument("--capacity-timeout", default="10m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-default", action="store_true", help="repeatability only")
    p.add_argument("--engine", default="transformers", choices=("transformers", "llamacpp", "vllm"),
                   help="who serves --config (the gain (a) compares with transformers' default only)")
    p.add_argument("--bench-args", default="", help="more `tuner bench` flags for --config, e.g. the engine's own "
                   "knobs: '--reserved-cpus 0 --chunked-prefill off'")
    p.add_argument("--neighbour-after", type=float, default=0.0, metavar="S",
                   help="from S s into each run of --config, a neighbour process copies 256 MB arrays on one core "
                        "until the run ends (does the canary see it?); 0: none")
    p.add_argument("--neighbour-for", type=float, default=0.0, metavar="S",
                   help="the neighbour leaves after S s (a transient neighbour); 0: it stays until the run ends")
    p.add_argument("--json")
    args = p.parse_args()
    if args.engine != "transformers" and not args.skip_default:
        print(f"--engine {args.engine}: the gain (a) is against transformers' default; expected --skip-default",
              file=sys.stderr)
        return 2
    q, cap, kv, draft = args.config.split(",")
    chosen = (q, int(cap), float(kv), draft)
    print(f"engine {args.engine}, SLO {args.slo}, workload in {args.input_len} out {args.output_len}, "
          f"probes {args.probe_requests} x {args.max_probes}"
          + (f"; a neighbour copying memory from {args.neighbour_after:g} s into each run"
             + (f" for {args.neighbour_for:g} s" if args.neighbour_for else "") if args.neighbour_after else ""))
    runs: list[dict] = []
    base: list[dict] = []
    for i in range(args.repeat):  # interleaved: chosen, default, chosen, ...
        runs.append(measure(chosen, args))
        print(show(runs[-1]), flush=True)
        if i == 0 and not args.skip_default:
            base.append(measure(DEFAULT, args))
            print(show(base[-1]), flush=True)
    ok = [r["requests_per_s"] for r in runs if "error" not in r]
    out: dict = {"slo": args.slo, "chosen": runs, "default": base}
    if ok and base and "error" not in base[0]:
        out["gain"] = report_gain(runs, base[0])
    if len(ok) >= 2:
        med = statistics.median(ok)
        spread = [100 * (x - med) / med for x in ok] if med else []
        out["repeatability_percent"] = spread
        print(f"(b) repeatability over {len(ok)} runs: median {med:.3f} req/s, deviations "
              + ", ".join(f"{s:+.1f}%" for s in spread) + " (goal within +-10%)")
        # which runs the tool itself flagged: the engine canary moved or the host was busy > 10% under them (their
        # notes say a re-measure may differ by as much); the spread of the others is what an unflagged figure is worth
        flagged = [i + 1 for i, r in enumerate(runs) if "error" not in r and not steady(r)]  # as printed above
        calm = [r["requests_per_s"] for r in runs if "error" not in r and steady(r)]
        out["flagged_runs"] = flagged
        print(f"    runs the tool flagged (canary moved or host busy > 10%): {flagged or 'none'}")
        if len(calm) >= 2 and flagged:
            med_calm = statistics.median(calm)
            out["unflagged_percent"] = [100 * (x - med_calm) / med_calm for x in calm]
            print(f"    unflagged runs: median {med_calm:.3f} req/s, deviations "
                  + ", ".join(f"{x:+.1f}%" for x in out["unflagged_percent"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
