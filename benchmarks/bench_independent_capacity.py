"""Is the capacity tuner reports the capacity a server sustains? Checked with a client that shares no code with the
harness (benchmarks/independent_client.py: stdlib threads + http.client, one connection per request).

  1. `tuner bench --capacity <ARGS>` (a fresh process) measures the configuration's capacity under its SLO;
  2. the exact server argv (and environment) the bench JSON records under `engine.info` is launched here, by this
     script, on a free port (llama-server: `--host/--port` appended, as the engine does; vLLM the same);
  3. the independent client drives it open-loop (Poisson) at the reported capacity and at --over x it, --n requests
     each (the first 10% left out as warm-up), with prompts from tuner's workload at the same length ranges and seed,
     written to a JSON file of token ids (each rate gets its own prompts, so no prompt is served from a cache);
  4. each rate's SLO verdict, measured: MEETS / MISSES / INDETERMINATE from a distribution-free 95% interval of
     the client's percentile.

Goal (issue 24): at the reported capacity the independent client meets the SLO; at 1.15x it does not. When tuner
reports no capacity (the SLO missed at every rate probed), its "misses" at the lowest probed rate is checked instead.

Usage: .venv/bin/python benchmarks/bench_independent_capacity.py [--n 150] [--over 1.15] [--bench-json FILE] \\
           -- --engine llamacpp --model smollm2-135m --quant Q8_0 --batch-cap 4 --slo "ttft:p90<2s" \\
              --input-len 64:192 --output-len 24:48 --seed 3
(--bench-json FILE: reuse an earlier `tuner bench --capacity` JSON instead of measuring again.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CLIENT = REPO / "benchmarks" / "independent_client.py"


def flag(args: list[str], name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default


def measure_capacity(bench_args: list[str], out: Path) -> dict:
    cmd = [str(REPO / ".venv" / "bin" / "tuner"), "bench", "--capacity", *bench_args, "--quiet", "--json", str(out)]
    print("$", " ".join(cmd), flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    print(proc.stdout.rstrip())
    print(f"(tuner bench --capacity: {time.perf_counter() - t:.0f} s, exit {proc.returncode})", flush=True)
    if proc.returncode != 0:
        sys.exit(f"tuner bench failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.read_text())


def write_prompts(bench: dict, n: int, path: Path) -> None:
    """`n` requests from tuner's workload at the bench's length ranges and seed: token ids and output lengths."""
    from tuner.measure.workload import WorkloadSpec, build_workload
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    w = bench["workload"]
    spec = WorkloadSpec(requests=n, rate=1.0, input_len=tuple(w["input_len"]), output_len=tuple(w["output_len"]),
                        shared_prefix=w.get("shared_prefix", 0), seed=w.get("seed", 0))
    reqs = build_workload(spec, load_tokenizer(checkpoint_dir(bench["config"]["model"])))
    path.write_text(json.dumps({"requests": [{"prompt_ids": list(r.prompt_ids), "max_tokens": r.max_tokens}
                                             for r in reqs]}))


def launch(info: dict, log: Path):
    """The recorded argv and environment, launched as is (+ --host/--port) by tuner's ServerProcess (it waits for
    /health and stops the server with everything it started)."""
    from tuner.engines.server import ServerProcess, free_port

    port = free_port()
    argv = list(info["argv"]) + ["--host", "127.0.0.1", "--port", str(port)]
    print("$ " + " ".join(f"{k}={v}" for k, v in (info.get("env") or {}).items()) + " " + " ".join(argv), flush=True)
    server = ServerProcess(argv, port, log_path=log, env=info.get("env") or {}, startup_timeout_s=600)
    try:
        server.start()
    except Exception as e:
        server.stop()
        sys.exit(f"the recorded server did not start: {e}")
    return server


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=150, help="requests per rate (default 150; the first 10%% left out)")
    ap.add_argument("--over", type=float, default=1.15, help="the second rate, as a multiple of the capacity")
    ap.add_argument("--bench-json", help="an earlier `tuner bench --capacity` JSON to use instead of measuring")
    ap.add_argument("--out", help="write every figure as JSON")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    work = Path(tempfile.mkdtemp(prefix="indep-cap."))
    bench = json.loads(Path(a.bench_json).read_text()) if a.bench_json else measure_capacity(bench_args,
                                                                                               work / "bench.json")
    cap = bench["metrics"]["capacity"]
    rate = cap.get("requests_per_s")
    slo = flag(bench_args, "--slo") or flag(bench_args, "--latency-target") and (
        f"{flag(bench_args, '--latency-metric', 'ttft:p99')}<{flag(bench_args, '--latency-target')}")
    print(f"tuner: capacity {rate or 0:.3f} req/s {cap.get('requests_per_s_ci')} verdict {cap.get('verdict')} under "
          f"{slo!r}; saturation {cap.get('saturation', {}).get('requests_per_s')} req/s (measured by tuner)")
    missed = sorted(p["rate_rps"] for p in cap.get("probes") or [] if p.get("verdict") == "misses")
    if rate:
        rates, expect = [rate, rate * a.over], ["MEETS", "MISSES"]
    elif missed:  # no rate met: check tuner's "misses" at the lowest rate it probed instead
        rates, expect = [missed[0]], ["MISSES"]
        print(f"no capacity reported: checking tuner's 'misses' at its lowest probed rate, {missed[0]:.3f} req/s")
    else:
        sys.exit(f"the bench reported no capacity and no missed rate (verdict {cap.get('verdict')!r}): nothing to check")
    api = "llamacpp" if bench["config"]["engine"] == "llamacpp" else "openai"
    prompts = work / "prompts.json"
    write_prompts(bench, a.n * len(rates), prompts)
    all_reqs = json.loads(prompts.read_text())["requests"]
    server = launch(bench["engine"]["info"], work / "server.log")
    url = server.url
    figures = []
    try:
        for i, r in enumerate(rates):
            part = work / f"prompts{i}.json"
            part.write_text(json.dumps({"requests": all_reqs[i * a.n:(i + 1) * a.n]}))
            out = work / f"client{i}.json"
            cmd = [sys.executable, str(CLIENT), "--url", url, "--api", api, "--requests-file", str(part),
                   "--rate", f"{r:.4f}", "--seed", str(i), "--json", str(out)] + (["--slo", slo] if slo else [])
            print(f"\n[{r:.3f} req/s, tuner's verdict expected: {expect[i]}] $ " + " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)
            figures.append({"expect": expect[i], **json.loads(out.read_text())["summary"]})
    finally:
        server.stop()
    print("\nindependent client (stdlib, one connection per request), measured:")
    agree = []
    for f in figures:
        verdicts = ", ".join(f"{v['bound']} {v['verdict']}" for v in f["slo"]) or "no SLO given"
        print(f"  {f['rate_rps']:.3f} req/s (tuner implies {f['expect']}): n={f['n']} failed={f['failed']}: {verdicts}")
        got = [v["verdict"] for v in f["slo"]]
        agree.append(bool(got) and (all(g == "MEETS" for g in got) if f["expect"] == "MEETS" else "MISSES" in got))
    what = (f"meets at the capacity, misses at {a.over:g}x" if rate else "misses at tuner's lowest missed rate")
    print(f"goal ({what}): {'MET' if all(agree) else 'NOT MET'} (measured by the independent client)")
    if a.out:
        Path(a.out).write_text(json.dumps({"bench_args": bench_args, "capacity": {k: cap.get(k) for k in (
            "requests_per_s", "requests_per_s_ci", "verdict")}, "argv": bench["engine"]["info"]["argv"],
            "goal_met": all(agree), "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
