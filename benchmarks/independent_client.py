"""An independent open-loop streaming client: Python's standard library only (threads + http.client), no import
from `tuner`, so a figure it prints shares no code with the harness it checks.

Requests are read from a JSON file: {"requests": [{"prompt_ids": [...], "max_tokens": N}, ...]} (written by the
benchmark from tuner's workload; this client only reads token ids and lengths). Arrivals are Poisson at --rate
(exponential gaps from its own seeded stream); each request opens its own connection at its scheduled time, posts,
and reads the stream:

  --api llamacpp   POST /completion      {"prompt": ids, "n_predict", "stream", "return_tokens", "ignore_eos"}
  --api openai     POST /v1/completions  {"model", "prompt": ids, "max_tokens", "stream", "ignore_eos",
                                          "stream_options": {"include_usage": true}}  (vLLM)

Per request: TTFT = first token's arrival - the SCHEDULED send time (a late send is the client's queueing and is
counted, as a user would see it), E2E = end of stream - scheduled send, TPOT = (E2E - TTFT) / (output tokens - 1).
The first 10% of requests (by arrival) are left out as warm-up. Percentiles are nearest-rank, each printed with its
n and a distribution-free 95% interval (binomial order statistics); `--slo "ttft:p90<2s"` adds a verdict per bound:
MEETS (the interval's upper end is under the limit), MISSES (its lower end is over), else INDETERMINATE.

`--concurrency C` instead of `--rate` runs a closed loop (C threads, each sending its next request when its last
one ends; TTFT from the actual send), for throughput side by side with the harness at the same concurrency.

Usage: python benchmarks/independent_client.py --url http://127.0.0.1:8080 --api llamacpp --requests-file r.json
           (--rate 2.0 | --concurrency 4) [--n 150] [--seed 0] [--warmup-share 0.1] [--slo "ttft:p90<2s"]
           [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import sys
import threading
import time
import urllib.parse

PERCENTS = (50, 90, 99)
WARMUP_SHARE = 0.10


def request_body(api: str, model: str | None, prompt_ids: list[int], max_tokens: int) -> dict:
    if api == "llamacpp":
        return {"prompt": prompt_ids, "n_predict": max_tokens, "stream": True, "return_tokens": True,
                "ignore_eos": True, "temperature": 0.0}
    return {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}


def tokens_in_event(api: str, data: dict) -> tuple[int, bool, int | None]:
    """(tokens this event carries, whether it ends the stream, the server's own final count if it says one)."""
    if api == "llamacpp":
        n = len(data.get("tokens") or [])
        return n, bool(data.get("stop")), data.get("tokens_predicted") if data.get("stop") else None
    usage = data.get("usage") or {}
    n = sum(1 for c in data.get("choices") or [] if c.get("text"))
    return n, False, usage.get("completion_tokens")


def one_request(url: str, api: str, model: str | None, req: dict, scheduled: float, out: dict) -> None:
    """Send at `scheduled` (perf_counter), one connection, stream to the end; fills `out` (never raises)."""
    u = urllib.parse.urlsplit(url)
    path = "/completion" if api == "llamacpp" else "/v1/completions"
    body = json.dumps(request_body(api, model, list(req["prompt_ids"]), int(req["max_tokens"]))).encode()
    delay = scheduled - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    out.update(send_lag_s=time.perf_counter() - scheduled, tokens=0, error=None)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", "Connection": "close"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        final = None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            data = json.loads(payload)
            n, stop, count = tokens_in_event(api, data)
            if n:
                now = time.perf_counter()
                if out["tokens"] == 0:
                    out["ttft_s"] = now - scheduled
                out["tokens"] += n
                out["last_s"] = now - scheduled
            if count is not None:
                final = count
            if stop:
                break
        out["e2e_s"] = time.perf_counter() - scheduled
        if final is not None and final > out["tokens"]:
            out["tokens"] = final  # the server's own count when chunks carried no token (usage at the end)
        if out["tokens"] < int(req["max_tokens"]):
            out["error"] = f"stream ended after {out['tokens']} of {req['max_tokens']} tokens"
    except Exception as e:  # a failure is a result, counted
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def poisson_arrivals(n: int, rate_rps: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate_rps)
    return out


def run(url: str, api: str, model: str | None, requests: list[dict], rate_rps: float, seed: int) -> list[dict]:
    arrivals = poisson_arrivals(len(requests), rate_rps, seed)
    results: list[dict] = [{"index": i, "arrival_s": a} for i, a in enumerate(arrivals)]
    t0 = time.perf_counter() + 0.5
    threads = [threading.Thread(target=one_request, args=(url, api, model, r, t0 + a, res), daemon=True)
               for r, a, res in zip(requests, arrivals, results)]
    return run_threads(threads, results, t0)


def run_threads(threads: list[threading.Thread], results: list[dict], t0: float) -> list[dict]:
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    for r in results:
        r["wall_s"] = wall
    return results


def run_closed(url: str, api: str, model: str | None, requests: list[dict], concurrency: int) -> list[dict]:
    """Closed loop: `concurrency` threads, each sends its next request when its last one ends (no think time);
    the scheduled time of a request is its send time."""
    results: list[dict] = [{"index": i} for i in range(len(requests))]
    lock, cursor = threading.Lock(), [0]
    t0 = time.perf_counter()

    def worker() -> None:
        while True:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(requests):
                return
            now = time.perf_counter()
            results[i]["arrival_s"] = now - t0
            one_request(url, api, model, requests[i], now, results[i])

    return run_threads([threading.Thread(target=worker, daemon=True) for _ in range(concurrency)], results, t0)


def nearest_rank(sorted_xs: list[float], p: float) -> float:
    return sorted_xs[max(0, math.ceil(p / 100 * len(sorted_xs)) - 1)]


def binom_cdf(k: int, n: int, q: float) -> float:
    """P(Bin(n, q) <= k), each term in log space (math.comb(n, i) overflows a float past n ~ 1000)."""
    if k < 0:
        return 0.0
    if q <= 0 or q >= 1:
        return 1.0 if q <= 0 or k >= n else 0.0
    lq, l1q, lgn = math.log(q), math.log1p(-q), math.lgamma(n + 1)
    return min(1.0, sum(math.exp(lgn - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lq + (n - i) * l1q)
                        for i in range(min(k, n) + 1)))


def percentile_interval(sorted_xs: list[float], p: float, conf: float = 0.95) -> tuple[float | None, float | None]:
    """Distribution-free interval for the p-th percentile: order statistics (l, u) with P(X(l) <= q_p <= X(u)) >=
    conf under the binomial; an end the sample cannot reach is None (too few requests for that percentile)."""
    n, q, a = len(sorted_xs), p / 100, (1 - conf) / 2
    lo = hi = None
    for k in range(n, 0, -1):  # largest l with P(Bin(n,q) <= l-1) <= a
        if binom_cdf(k - 1, n, q) <= a:
            lo = sorted_xs[k - 1]
            break
    for k in range(1, n + 1):  # smallest u with P(Bin(n,q) <= u-1) >= 1-a
        if binom_cdf(k - 1, n, q) >= 1 - a:
            hi = sorted_xs[k - 1]
            break
    return lo, hi


def summarize(results: list[dict], warmup_share: float = WARMUP_SHARE) -> dict:
    kept = results[math.ceil(warmup_share * len(results)):]
    ok = [r for r in kept if not r.get("error") and "ttft_s" in r]
    out: dict = {"sent": len(results), "warmup_left_out": len(results) - len(kept), "n": len(ok),
                 "failed": sum(1 for r in results if r.get("error")),
                 "errors": sorted({r["error"] for r in results if r.get("error")})[:5]}
    if kept:
        span = max(r["arrival_s"] + r.get("e2e_s", 0) for r in kept) - min(r["arrival_s"] for r in kept)
        out["output_tokens_per_s"] = sum(r["tokens"] for r in ok) / span if span > 0 else None
        out["max_send_lag_ms"] = 1e3 * max(r.get("send_lag_s", 0) for r in kept)
    metrics = {"ttft": [r["ttft_s"] for r in ok],
               "e2e": [r["e2e_s"] for r in ok],
               "tpot": [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]}
    for name, xs in metrics.items():
        xs = sorted(xs)
        out[name] = {"n": len(xs)}
        for p in PERCENTS:
            if xs:
                lo, hi = percentile_interval(xs, p)
                out[name][f"p{p}_ms"] = 1e3 * nearest_rank(xs, p)
                out[name][f"p{p}_ci_ms"] = [None if lo is None else 1e3 * lo, None if hi is None else 1e3 * hi]
    return out


def parse_slo(text: str) -> list[tuple[str, int, float]]:
    """'ttft:p90<2s;tpot:p50<50ms' -> [(metric, percent, limit_ms)]."""
    bounds = []
    for part in filter(None, (s.strip() for s in text.split(";"))):
        try:
            left, limit = part.split("<")
            metric, stat = left.split(":")
            limit = limit.strip()
            ms = float(limit[:-2]) if limit.endswith("ms") else float(limit.rstrip("s")) * 1e3
            bounds.append((metric.strip(), int(stat.strip().lstrip("p")), ms))
        except ValueError:
            sys.exit(f"--slo {part!r} is invalid: expected METRIC:pNN<LIMIT (ms or s), e.g. ttft:p90<2s")
    return bounds


def verdicts(summary: dict, slo: list[tuple[str, int, float]]) -> list[dict]:
    out = []
    for metric, p, limit_ms in slo:
        m = summary.get(metric) or {}
        if f"p{p}_ms" not in m:  # a percentile this client does not print: compute from nothing is wrong
            out.append({"bound": f"{metric}:p{p}<{limit_ms:g}ms", "verdict": "INDETERMINATE (no data)"})
            continue
        lo, hi = m[f"p{p}_ci_ms"]
        v = ("MEETS" if hi is not None and hi < limit_ms else "MISSES" if lo is not None and lo > limit_ms
             else "INDETERMINATE")
        out.append({"bound": f"{metric}:p{p}<{limit_ms:g}ms", "value_ms": m[f"p{p}_ms"], "ci95_ms": [lo, hi],
                    "n": m["n"], "verdict": v})
    return out


def format_summary(summary: dict) -> str:
    load = (f"rate {summary['rate_rps']:.3f} req/s" if summary.get("rate_rps") is not None
            else f"concurrency {summary['concurrency']}")
    lines = [f"{load}: sent {summary['sent']}, first {summary['warmup_left_out']} left out, "
             f"ok {summary['n']}, failed {summary['failed']}, output {summary.get('output_tokens_per_s') or 0:.1f} "
             f"tok/s, max send lag {summary.get('max_send_lag_ms', 0):.0f} ms (measured)"]
    for name in ("ttft", "tpot", "e2e"):
        m = summary[name]
        parts = [f"p{p} {m[f'p{p}_ms']:.0f}" for p in PERCENTS if f"p{p}_ms" in m]
        lines.append(f"  {name:4s} ms (n={m['n']}): " + ", ".join(parts))
    for v in summary.get("slo", []):
        ci = v.get("ci95_ms") or [None, None]
        fmt = ["-" if x is None else f"{x:.0f}" for x in ci]
        lines.append(f"  SLO {v['bound']}: {v.get('value_ms', float('nan')):.0f} ms, 95% [{fmt[0]}, {fmt[1]}] "
                     f"(n={v.get('n', 0)}) -> {v['verdict']}")
    if summary["errors"]:
        lines.append("  errors: " + "; ".join(summary["errors"]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--api", choices=("llamacpp", "openai"), required=True)
    ap.add_argument("--model", help="the model name (openai api; default: the first of GET /v1/models)")
    ap.add_argument("--requests-file", required=True)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="open loop: Poisson arrival rate (req/s)")
    mode.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    ap.add_argument("--warmup-share", type=float, default=WARMUP_SHARE, help="first share left out (default 0.1)")
    ap.add_argument("--n", type=int, help="requests to send (default: all in the file)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo", default="")
    ap.add_argument("--json", help="write the summary (and per-request results) as JSON")
    a = ap.parse_args()
    reqs = json.load(open(a.requests_file))["requests"]
    if a.n is not None:
        if a.n > len(reqs):
            sys.exit(f"--n {a.n} is more than the {len(reqs)} requests in {a.requests_file}")
        reqs = reqs[: a.n]
    model = a.model
    if a.api == "openai" and not model:
        u = urllib.parse.urlsplit(a.url)
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        c.request("GET", "/v1/models")
        model = json.loads(c.getresponse().read())["data"][0]["id"]
        c.close()
    if a.rate is not None:
        results = run(a.url, a.api, model, reqs, a.rate, a.seed)
    else:
        results = run_closed(a.url, a.api, model, reqs, a.concurrency)
    summary = summarize(results, a.warmup_share)
    summary["rate_rps"], summary["concurrency"] = a.rate, a.concurrency
    summary["slo"] = verdicts(summary, parse_slo(a.slo)) if a.slo else []
    print(format_summary(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
