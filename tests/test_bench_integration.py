"""Real measurements of smollm2-135m on this CPU: a handful of requests each, through the real engines."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_one_line_error, run_tuner
from tuner.config import TrialConfig
from tuner.measure.bench import BenchOptions, run_bench
from tuner.measure.workload import WorkloadSpec

MODEL = "smollm2-135m"


def options(**kw):
    spec = kw.pop("workload", None) or WorkloadSpec(requests=6, rate=8.0, input_len=(32, 96), output_len=(8, 16),
                                                    seed=0)
    return BenchOptions(workload=spec, progress=False, measure_bandwidth=False, **kw)


def assert_ordered(summary):
    assert summary["p50"] <= summary["p90"] <= summary["p95"] <= summary["p99"]


def test_continuous_batching_bench():
    out = run_bench(TrialConfig(model=MODEL, quant="bf16", batch_cap=4, kv_fraction=0.01), options())
    assert out["status"] == "ok", out["reason"]
    m = out["metrics"]
    assert m["failed"] == 0 and m["completed"] == 6
    assert m["total_output_tokens"] == sum(r["output_tokens"] for r in out["requests"]) > 0
    for r in out["requests"]:
        assert 8 <= r["output_tokens"] <= 16  # fixed lengths (EOS ignored)
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert 1 <= r["chunks"] <= r["output_tokens"] and len(r["itl_ms"]) == r["chunks"] - 1  # a gap per chunk
        assert r["e2e_ms"] == pytest.approx(r["ttft_ms"] + sum(r["itl_ms"]), abs=0.5)  # E2E at the last token
        assert r["dispatch_lag_ms"] >= 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert_ordered(m[key])
    assert m["ttft_ms"]["p99"] <= m["e2e_ms"]["p99"]
    assert m["output_tokens_per_s"] > 0 and m["requests_per_s"] > 0
    assert m["peak_rss_mb"] > 100 and m["peak_cuda_mb"] is None
    assert out["engine"]["name"] == "transformers-cb"
    assert out["engine"]["settings"]["max_requests_per_batch"] == 4
    assert out["engine"]["settings"]["max_memory_percent"] == 0.01
    assert m["harness_overhead_ms"]["p50"] is not None and m["harness_overhead_ms"]["p50"] >= 0
    assert m["roofline"]["bytes_per_token"] > 100e6  # ~135M params in bf16
    assert out["warmup"]["n"] == 4 and out["warmup"]["failed"] == 0  # warm-up at the batch cap, from the workload
    assert m["ttft_ms"]["n"] == 6 and m["itl_ms"]["n"] == sum(len(r["itl_ms"]) for r in out["requests"])
    lo, hi = m["e2e_ms"]["ci"]["p50"]
    assert lo <= m["e2e_ms"]["p50"] <= hi


THREADS = ("import sys, torch\n"
           "def threads(): return int([l for l in open('/proc/self/status') if l.startswith('Threads')][0].split()[1])\n"
           "before = threads()\n"
           "from tuner.measure.bench import memory_bandwidth\n"
           "from tuner.measure.roofline import measure_bandwidth_gbs\n"
           "gbs = memory_bandwidth() if sys.argv[1] == 'harness' else measure_bandwidth_gbs(size_mb=256, repeats=9)\n"
           "print(gbs, before, threads())\n")


def test_the_bandwidth_probe_starts_no_thread_in_the_serving_process():
    """`tuner bench --capacity` measures the host's memory bandwidth before the engine starts; measured in the
    serving process, torch's intra-op thread pool it starts stays, and an in-process engine's generation thread then
    shares the cores with it for the whole measurement (transformers bf16 cap 4 saturated at 3.2 req/s instead of
    4.1-4.5, its canary's gaps 42 ms instead of 26-31). The harness measures it in a child: a fresh process (torch
    imported, no op run) has as many threads after it as before; the same figure measured in-process adds them."""
    import subprocess
    import sys

    import torch

    runs = {how: subprocess.run([sys.executable, "-c", THREADS, how], capture_output=True, text=True, timeout=300,
                                check=True).stdout.split() for how in ("harness", "in-process")}
    gbs, before, after = runs["harness"]
    assert float(gbs) > 1 and int(after) == int(before)
    gbs, before, after = runs["in-process"]
    assert float(gbs) > 1
    if torch.get_num_threads() > 1:  # the hazard the child avoids: a pool of intra-op threads left running
        assert int(after) > int(before)


def test_capacity_on_the_real_engine(tmp_path):
    """`tuner bench --capacity` end to end on smollm2 (a small probe budget): the interface the search reads."""
    path = tmp_path / "cap.json"
    proc = run_tuner("bench", "--model", MODEL, "--quant", "bf16", "--batch-cap", "2", "--kv-fraction", "0.01",
                     "--input-len", "32:64", "--output-len", "6:8", "--capacity", "--slo", "e2e:p50<60s",
                     "--probe-requests", "8:12", "--max-probes", "2", "--no-bandwidth", "--quiet",
                     "--json", str(path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "capacity:" in proc.stdout and "verdict" in proc.stdout
    cap = json.loads(path.read_text())["metrics"]["capacity"]
    assert set(cap) >= {"requests_per_s", "requests_per_s_ci", "output_tokens_per_s", "verdict", "probes",
                        "saturation", "warmup", "cost", "slo"}
    assert cap["verdict"] in ("meets", "misses", "indeterminate") and cap["slo"]["bounds"] == ["e2e:p50<60000ms"]
    assert cap["saturation"]["requests_per_s"] > 0 and cap["warmup"]["failed"] == 0
    steady = cap["saturation"]["steady"]  # counted while the loop kept its 3 in flight: after the fill, before drain
    assert steady["completions"] <= cap["saturation"]["completed"] - cap["saturation"]["concurrency"]
    before, after = cap["machine"]["memory_bandwidth_gbs"]  # the host's speed around the measurement
    assert before > 1 and after > 1 and "machine: memory bandwidth" in proc.stdout
    # the engine's own speed at the start, after the saturation probe and after every rate probe
    assert len(cap["canary"]["n"]) == 2 + len(cap["probes"]) and min(cap["canary"]["n"]) >= 3 * 5  # 3 x 6-8 tokens
    assert min(cap["canary"]["itl_ms"]) > 0
    assert cap["machine"]["drift"] == cap["canary"]["drift"] and "engine canary" in proc.stdout
    # measured twice when its canary moved past 10% (the cost counts both): the probes listed are the kept one's
    attempts = (cap.get("remeasured") or {}).get("attempts") or [{"probes": len(cap["probes"])}]
    assert 1 <= len(cap["probes"]) <= 2 and cap["cost"]["probes"] == sum(a["probes"] for a in attempts)
    for p in cap["probes"]:
        assert p["rate_rps"] < cap["saturation"]["requests_per_s"]  # never probed above the saturation rate
        assert p["n"] >= 8 and p["verdict"] in ("meets", "misses", "indeterminate")
        assert set(p["ttft_ms"]) >= {"p50", "p99", "n", "ci"}
    lo, hi = cap["requests_per_s_ci"]
    assert lo == cap["requests_per_s"] <= hi
    if cap["verdict"] == "meets":  # a minute of E2E at the median is far above what smollm2 takes here
        assert cap["requests_per_s"] > 0 and cap["output_tokens_per_s"] > 0


def test_ngram_draft_output_equals_no_draft_output():
    """Greedy decoding with prompt lookup must produce exactly the tokens of greedy decoding without it (fp32: the
    reference numerics; in bf16 different kernel shapes can flip near-ties, which the bench reports per run)."""
    spec = WorkloadSpec(requests=3, rate=None, concurrency=1, input_len=(48, 96), output_len=(16, 16), seed=2)
    plain = run_bench(TrialConfig(model=MODEL, quant="fp32", batch_cap=1, kv_fraction=0.01), options(workload=spec))
    draft = run_bench(TrialConfig(model=MODEL, quant="fp32", batch_cap=1, draft="ngram:3"), options(workload=spec))
    assert plain["status"] == draft["status"] == "ok"
    assert draft["engine"]["name"] == "transformers-assisted"
    assert all(len(t) == 16 for t in plain["token_ids"])
    assert draft["token_ids"] == plain["token_ids"]
    m = draft["metrics"]
    assert m["draft_outputs_match"] is True and m["draft_outputs_checked"] == 2
    assert m["draft_proposed"] > 0 and 0.0 <= m["acceptance_rate"] <= 1.0


def test_self_draft_accepts_almost_everything():
    """A model drafting for itself proposes exactly what the target picks: acceptance must be (near) 100%."""
    spec = WorkloadSpec(requests=2, rate=None, concurrency=1, input_len=(32, 32), output_len=(16, 16), seed=3)
    out = run_bench(TrialConfig(model=MODEL, quant="fp32", draft=f"draft:{MODEL}:4"), options(workload=spec))
    assert out["status"] == "ok", out["reason"]
    assert out["metrics"]["acceptance_rate"] >= 0.9
    assert out["metrics"]["draft_outputs_match"] is True


def test_kv_memory_too_small_fails_with_reason():
    """A KV fraction far too small for any request: the engine fails the warm-up (drawn from the workload); the
    run says so with the engine's reason, no crash."""
    out = run_bench(TrialConfig(model=MODEL, quant="bf16", batch_cap=2, kv_fraction=1e-6), options())
    assert out["status"] == "failed"
    assert "every warm-up request failed" in out["reason"]
    assert out["metrics"] is None


def test_unsupported_format_is_reported_not_raised():
    out = run_bench(TrialConfig(model=MODEL, quant="torchao-int4wo", device="cpu"), options())
    assert out["status"] == "unsupported" and "needs CUDA" in out["reason"]


def test_cli_bench_writes_json(tmp_path):
    path = tmp_path / "out.json"
    proc = run_tuner("bench", "--model", MODEL, "--quant", "bf16", "--batch-cap", "2", "--kv-fraction", "0.01",
                     "--requests", "4", "--rate", "8", "--input-len", "32:64", "--output-len", "8:8",
                     "--seed", "0", "--no-bandwidth", "--quiet", "--goodput", "ttft:5000", "--json", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ttft_ms" in proc.stdout and "output tok/s" in proc.stdout
    data = json.loads(path.read_text())
    assert set(data) >= {"config", "metrics", "engine", "environment", "workload", "requests"}
    assert data["config"]["batch_cap"] == 2
    m = data["metrics"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(m[key]) == {"p50", "p90", "p95", "p99", "mean", "n", "ci"}
    for key in ("output_tokens_per_s", "requests_per_s", "completed", "failed", "peak_rss_mb", "peak_cuda_mb",
                "acceptance_rate", "goodput_requests_per_s"):
        assert key in m
    assert m["completed"] == 4 and m["failed"] == 0
    # closed loop: --config replays the same configuration from the bench JSON
    proc2 = run_tuner("bench", "--config", str(path), "--requests", "2", "--concurrency", "1", "--output-len", "4",
                      "--no-bandwidth", "--quiet")
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert "batch_cap=2" in proc2.stdout


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "smollm2-135m", "--quant", "int3"], "unknown quantization format 'int3'"),
    (["--model", "smollm2-135m", "--batch-cap", "0"], "batch cap 0"),
    (["--model", "smollm2-135m", "--kv-fraction", "1.5"], "KV fraction 1.5"),
    (["--model", "smollm2-135m", "--kv-fraction", "0"], "KV fraction 0.0"),
    (["--model", "smollm2-135m", "--draft", "ngram:x"], "bad draft spec 'ngram:x'"),
    (["--model", "smollm2-135m", "--draft", "draft:nope:3"], "unknown model 'nope'"),
    (["--model", "smollm2-135m", "--trace", "/nonexistent/t.jsonl"], "unreadable"),
    (["--model", "smollm2-135m", "--input-len", "9:3"], "--input-len '9:3'"),
    (["--model", "smollm2-135m", "--requests", "0"], "--requests 0"),
    (["--model", "smollm2-135m", "--rate", "-1"], "--rate -1"),
    (["--model", "smollm2-135m", "--goodput", "ttfb:3"], "--goodput 'ttfb:3'"),
    (["--model", "smollm2-135m", "--quant", "torchao-int4wo", "--device", "cpu"], "needs CUDA"),
    (["--model", "smollm2-135m", "--device", "cuda"], "no CUDA device"),
    (["--model", "smollm2-135m", "--batch-cap", "two"], "invalid int value: 'two'"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, needle):
    out = tmp_path / "o.json"
    proc = run_tuner("bench", *args, "--requests" if "--requests" not in args else "--seed", "1", "--json", str(out),
                     timeout=300)
    assert_one_line_error(proc, needle)
    assert not out.exists()


def test_bad_model_sources(tmp_path):
    empty = tmp_path / "ckpt"
    empty.mkdir()
    assert_one_line_error(run_tuner("bench", "--model", str(empty)), "has no config.json")
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"NOPE" + b"\0" * 100)
    assert_one_line_error(run_tuner("bench", "--model", str(fake)), "is not a GGUF file")
    from tuner.models import alias_gguf

    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(alias_gguf(MODEL).read_bytes()[: 5 * 2**20])
    assert_one_line_error(run_tuner("bench", "--model", str(truncated)), "truncated or corrupt")
    assert_one_line_error(run_tuner("bench", "--model", str(tmp_path / "missing.gguf")), "does not exist")


def test_batch_cap_bounds_the_sequences_generating_at_once():
    """Knob -> effect, from the harness's own timestamps: with 8 requests offered at once and batch cap 2, no more
    than 2 requests are ever between their first and last token (CB schedules at most `batch_cap` sequences)."""
    spec = WorkloadSpec(requests=8, rate=None, concurrency=8, input_len=(16, 32), output_len=(12, 12), seed=1)
    out = run_bench(TrialConfig(model=MODEL, quant="bf16", batch_cap=2, kv_fraction=0.01), options(workload=spec))
    assert out["status"] == "ok", out["reason"]
    spans = [(r["send_s"] + r["ttft_ms"] / 1e3, r["send_s"] + r["e2e_ms"] / 1e3) for r in out["requests"]]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak == 2


def test_kv_fraction_maps_monotonically_to_kv_blocks():
    """Knob -> effect: a larger KV fraction resolves to more paged-KV blocks in transformers' CB."""
    blocks = []
    for kv in (0.01, 0.02, 0.05):
        out = run_bench(TrialConfig(model=MODEL, quant="bf16", batch_cap=2, kv_fraction=kv),
                        options(workload=WorkloadSpec(requests=2, rate=None, concurrency=2, input_len=(16, 16),
                                                      output_len=(2, 2), seed=0)))
        assert out["status"] == "ok", out["reason"]
        blocks.append(out["engine"]["info"]["resolved"]["num_blocks"])
    assert blocks[0] < blocks[1] < blocks[2], blocks


PEAK_SCRIPT = r"""
import subprocess, sys, time
from tuner.measure.bench import PeakMemory

class Engine:  # stands in for a server engine: only its process list is read
    def server_pids(self):
        return [server.pid] if server.poll() is None else []

with PeakMemory("cpu") as own:
    spike = bytearray(400 * 2**20)  # touched (zero-filled): resident for a few milliseconds only
    del spike
    time.sleep(0.05)
with PeakMemory("cpu") as quiet:  # the next block: the spike is not its own
    pass
server = subprocess.Popen([sys.executable, "-c",
                           "import sys, time; b = bytearray(300 * 2**20); sys.stdout.write('up\\n'); "
                           "sys.stdout.flush(); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
assert server.stdout.readline() == "up\n"
with PeakMemory("cpu", Engine()) as tree:
    time.sleep(1.2)
    server.kill()  # as run_bench does: the engine is stopped before the block ends
    server.wait()
print(own.peak_rss, quiet.peak_rss, tree.peak_rss)
"""


def test_peak_memory_sees_a_spike_between_samples_and_a_server_stopped_before_the_end(tmp_path):
    """Peaks come from the kernel's high-water marks: a 400 MB spike lasting milliseconds (far shorter than the
    0.5 s sampling interval) is counted in its block and not in the next one (the mark is reset per block), and a
    server's 300 MB count though the server is stopped before the block ends."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    own, quiet, tree = map(int, out.stdout.split())
    assert own - quiet > 350 * 2**20  # the spike is in its block's peak only
    assert tree - quiet > 250 * 2**20  # + the server's 300 MB, read while it ran
