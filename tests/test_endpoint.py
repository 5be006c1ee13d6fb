"""`--endpoint URL`: measuring a running OpenAI-compatible server the tuner did not launch. The servers here are
started by the tests themselves (a llama-server from `make llamacpp`; a vLLM from `make vllm`, run from its exported
serve.sh by tests/conftest.py's session fixture `exported_vllm_server`, which tests/test_export_run.py also reads),
each behind an API key, which reaches the tuner only through $TUNER_API_KEY and is never written to a result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import (
    assert_one_line_error,
    run_tuner,
    start_llama_server,
    stop_server,
)

MODEL = "smollm2-135m"
KEY = "test-key-7f3a9c"
SMALL = ["--input-len", "16:32", "--output-len", "8:12", "--no-bandwidth", "--quiet"]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    proc, url = start_llama_server(tmp_path_factory.mktemp("llama") / "server.log", api_key=KEY)
    yield url
    stop_server(proc)


def no_key_in(root: Path, key: str = KEY) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            assert key not in p.read_text(errors="replace"), p


@pytest.mark.slow
def test_capacity_of_a_server_tuner_did_not_start(llama_server, tmp_path):
    """The same capacity measure as a launched engine: SLO, probes, verdict; the lengths asked for are the lengths
    served (ignore_eos reaches the server); the config says engine endpoint and its URL; the key is nowhere."""
    out = tmp_path / "b.json"
    proc = run_tuner("bench", "--endpoint", llama_server, "--model", MODEL, "--batch-cap", "2", "--capacity",
                     "--slo", "e2e:p50<30s", "--probe-requests", "8:12", "--max-probes", "2",
                     "--saturation-requests", "8", "--json", str(out), *SMALL, env={"TUNER_API_KEY": KEY})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["status"] == "ok" and res["config"]["engine"] == "endpoint"
    assert res["config"]["endpoint"] == llama_server and res["config"]["quant"] == "served"
    info = res["engine"]["info"]
    assert info["served_model"].endswith(".gguf") and res["engine"]["settings"]["api_key"] == "$TUNER_API_KEY set"
    cap = res["metrics"]["capacity"]
    assert cap["verdict"] in ("meets", "indeterminate", "exceeds") and cap["probes"]
    assert cap["saturation"]["completed"] == 8 and cap["saturation"]["failed"] == 0
    assert "endpoint " + llama_server in proc.stdout
    no_key_in(tmp_path)


@pytest.mark.slow
def test_fixed_load_on_an_endpoint_serves_the_asked_lengths(llama_server, tmp_path):
    out = tmp_path / "b.json"
    proc = run_tuner("bench", "--endpoint", llama_server, "--model", MODEL, "--requests", "6", "--concurrency", "2",
                     "--json", str(out), *SMALL, env={"TUNER_API_KEY": KEY})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    from tuner.measure.workload import WorkloadSpec, build_workload
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    # the bench's prompts: the first 6 of a pool of 6 + 2 warm-up requests (tuner.measure.bench)
    pool = build_workload(WorkloadSpec(requests=8, rate=None, concurrency=2, input_len=(16, 32), output_len=(8, 12)),
                          load_tokenizer(checkpoint_dir(MODEL)))
    asked = [q.max_tokens for q in pool[:6]]
    got = [r["output_tokens"] for r in sorted(res["requests"], key=lambda r: r["index"])]
    assert got == asked and all(8 <= n <= 12 for n in got)
    assert all(r["ttft_ms"] <= r["e2e_ms"] for r in res["requests"])


@pytest.mark.parametrize("env,url,needles", [
    ({"TUNER_API_KEY": ""}, None, ["answered HTTP 401", "$TUNER_API_KEY (it is unset)"]),
    ({"TUNER_API_KEY": "wrong"}, None, ["answered HTTP 401", "(the one set was refused)"]),
    ({"TUNER_API_KEY": KEY}, "http://127.0.0.1:9", ["is unreachable", "expected a running OpenAI-compatible server"]),
    ({"TUNER_API_KEY": KEY}, "ftp://x", ["endpoint 'ftp://x' is invalid", "http(s)://host:port"]),
])
def test_endpoint_refusals_are_one_line(llama_server, tmp_path, env, url, needles):
    proc = run_tuner("bench", "--endpoint", url or llama_server, "--model", MODEL, "--requests", "4",
                     "--json", str(tmp_path / "b.json"), *SMALL, env=env)
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "b.json").exists()


def test_quality_needs_prompt_logprobs_one_line(llama_server, tmp_path):
    proc = run_tuner("eval", "--endpoint", llama_server, "--model", MODEL, "--tasks", "arc_easy", "--limit", "8",
                     "--results-dir", str(tmp_path), env={"TUNER_API_KEY": KEY})
    assert_one_line_error(proc, "returns no prompt log-probs", "vLLM")


@pytest.mark.slow
def test_quality_and_search_through_a_running_vllm(exported_vllm_server, tmp_path):
    """Quality through the endpoint: lm-eval local-completions on the served bf16 weights, judged against the fp32
    transformers model of the same weights on the same items (paired), with a top-K KLD; then `tuner search
    --endpoint` ends with a recommendation of engine endpoint. The key is nowhere in the results. The server: bf16,
    batch cap 2, run from its exported serve.sh (the session's, shared with tests/test_export_run.py, which only
    reads it: one vLLM start for both)."""
    vllm_server, key = exported_vllm_server.url, exported_vllm_server.key
    out = tmp_path / "q.json"
    results = tmp_path / "results"
    env = {"TUNER_API_KEY": key, "TUNER_RESULTS": str(results)}
    proc = run_tuner("eval", "--endpoint", vllm_server, "--model", MODEL, "--tasks", "arc_easy", "--limit", "30",
                     "--json", str(out), "--max-quality-drop", "10", env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    q = json.loads(out.read_text())
    assert q["config"]["engine"] == "endpoint" and "served_model" not in q["config"] and q["versions"][
        "served_model"] == exported_vllm_server.served_model
    items, base = q["items"]["arc_easy"], q["baseline_items"]["arc_easy"]
    assert len(items) == 30 and set(items) == set(base)  # the same lm-eval items on both sides
    agree = sum(items[k] == base[k] for k in items) / len(items)
    assert agree >= 0.85 and abs(q["drop_pp"]) <= 2 * 100 * q["score_stderr"]  # bf16 vs fp32, same weights
    assert 0 <= q["kld_mean"] < 0.1 and q["top1_agree"] > 0.8 and q["gate"]["verdict"] in ("within", "indeterminate")
    # the search scores its trial on the eval's 30 items in the eval's results: the fp32 baseline and the KLD
    # reference are the cache's (scored above), the endpoint is scored anew (a URL's scores are never cached); 30
    # paired items decide a 30 pp budget at once (at 8 they did not: 8 -> 16 -> 32, three baselines, ~70 s)
    cached = sorted(p.name for p in (results / "quality").rglob("*"))
    proc = run_tuner("search", "--endpoint", vllm_server, "--model", MODEL, "--latency-target", "60s",
                     "--latency-metric", "e2e:p50", "--trials", "1", "--results-dir", str(results),
                     "--study", "ep", "--quiet", "--probe-requests", "8:12", "--max-probes", "1",
                     "--saturation-requests", "8", "--requests", "24", "--quality-tasks", "arc_easy",
                     "--quality-limit", "30", "--max-quality-drop", "30", "--confirm", "0", env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trial_quality = json.loads((results / "ep" / "trials" / "0000" / "quality.json").read_text())
    assert trial_quality["gate"]["verdict"] == "within" and set(trial_quality["items"]["arc_easy"]) == set(items)
    assert sorted(p.name for p in (results / "quality").rglob("*")) == cached  # nothing scored again but the URL
    rec = json.loads((results / "ep" / "recommendation.json").read_text())["recommendation"]
    assert rec["config"]["engine"] == "endpoint" and rec["config"]["endpoint"] == vllm_server
    assert "RECOMMENDED: trial 0" in proc.stdout
    no_key_in(tmp_path, key)
