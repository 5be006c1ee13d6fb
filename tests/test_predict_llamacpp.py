"""The prediction against the real engine on a fixed seed: smollm2-135m Q8_0 at -np 4 on llama-server, profiled
afresh, its capacity at ttft:p90<2s predicted (`tuner predict`), then the capacity rate and 1.3x it measured with the
real harness (`tuner bench --rate`, same workload and seed; 24 short requests, 32:64 tokens in and 4:8 out, so the
rates are high and each run short): the measured TTFT p50 and p90 must agree with the predicted bands at each rate
(each measured percentile's 95% interval meets the band). A canary (one request alone on an idle second server: its
TTFT and ITL) before and after each step says whether the engine's own speed held within what the bands carry
(tuner.predict.estimate.SPEED_DRIFT): past it the comparison is indeterminate (skipped with the figures), since the
neighbours, not the model, would decide it. -t 1: on the shared 2-core test host, llama-server's
default two threads wait on each other behind the neighbours (decode steps 10x slower and erratic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_tuner
from tuner.predict.estimate import SPEED_DRIFT

CONFIG = ["--model", "smollm2-135m", "--engine", "llamacpp", "--quant", "Q8_0", "--batch-cap", "4", "--threads", "1"]
MOVED = SPEED_DRIFT  # the engine speed the predicted bands carry: moved further, the comparison is indeterminate
WORKLOAD = ["--requests", "24", "--input-len", "32:64", "--output-len", "4:8", "--seed", "0"]  # short: high rates


@pytest.fixture(autouse=True, scope="module")
def _built():
    from tuner.engines.llamacpp import availability

    ok, why = availability()
    if not ok:
        pytest.fail(why)


def tuner_json(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = run_tuner(*args, "--json", str(out), timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def canary():
    """The engine's own speed now: (TTFT, median inter-token gap) of one fresh 96-token prompt, 17 tokens out, alone
    on a second, otherwise idle llama-server of the same build, weight type and threads (idle, it takes no CPU from
    the runs); warmed up first (a fresh server's first request is slow)."""
    import random
    import statistics

    from tuner.config import TrialConfig
    from tuner.engines.llamacpp import LlamaCppEngine
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import token_pool
    from tuner.models import checkpoint_dir
    from tuner.predict.waves import fresh_prompts
    from tuner.quantize import load_tokenizer

    pool = token_pool(load_tokenizer(checkpoint_dir("smollm2-135m")))
    rng = random.Random(0)
    engine = LlamaCppEngine(TrialConfig(model="smollm2-135m", engine="llamacpp", quant="Q8_0", threads=1))
    engine.start()

    def speed() -> tuple[float, float]:
        r = run_load(engine, fresh_prompts(pool, 1, 96, 17, rng), concurrency=1, progress=False).results[0]
        return r.ttft_ms, statistics.median(r.itl_ms)

    try:
        speed()
        yield speed
    finally:
        engine.stop(drain=False)


@pytest.mark.slow
def test_predicted_ttft_band_holds_on_the_real_engine_at_two_rates(tmp_path: Path, canary) -> None:
    speeds = [canary()]
    # profiled afresh: on a shared host a profile minutes old carries the neighbours of then (one taken 10 min before
    # this test's measurements predicted TTFTs 30-40% too high: the engine's steps had sped up by as much since)
    predicted = tuner_json(tmp_path, "predict", "predict", *CONFIG, *WORKLOAD, "--slo", "ttft:p90<2s",
                           "--at-share", "1.0", "--at-share", "1.3", "--refresh-profile")
    speeds.append(canary())
    assert predicted["profile_cached"] is False
    assert predicted["predicted"] is True and predicted["profile"]
    # the profile found steps where a prompt joined running decodes on the real server, and fitted them
    assert predicted["calibration"]["step_model"]["mixed"] is True
    assert predicted["capacity"]["verdict"] == "meets" and predicted["capacity"]["requests_per_s"] > 0
    rows = []
    for at in predicted["at_rates"]:
        rate = at["rate_rps"]
        measured = tuner_json(tmp_path, f"bench-{rate:.3f}", "bench", *CONFIG, *WORKLOAD, "--rate", repr(rate),
                              "--no-bandwidth", "--quiet")["metrics"]["ttft_ms"]
        speeds.append(canary())
        assert measured["n"] == 24
        for stat in ("p50", "p90"):
            lo, hi = at["ttft_ms"]["band"][stat]
            m_lo, m_hi = measured["ci"][stat]  # a side is None when 24 requests cannot bound it
            rows.append((rate, stat, at["ttft_ms"][stat], lo, hi, measured[stat], m_lo or 0.0, m_hi or float("inf")))
    report = "; ".join(f"{r:.3f} req/s TTFT {stat}: predicted {p:.0f} ms [{lo:.0f}, {hi:.0f}], measured {m:.0f} ms "
                       f"(95% CI [{m_lo:.0f}, {m_hi:.0f}])" for r, stat, p, lo, hi, m, m_lo, m_hi in rows)
    moved = max(max(xs) / min(xs) - 1 for xs in zip(*speeds))
    report += (f"; engine canary (TTFT, ITL p50) {', '.join(f'({t:.0f}, {i:.1f})' for t, i in speeds)} ms "
               f"(moved {moved:.0%})")
    print(report)
    if moved > MOVED:  # the host, not the model, would decide the comparison: no verdict
        pytest.skip(f"indeterminate: the engine's own speed moved {moved:.0%} during the test ({report})")
    for _r, _stat, _p, lo, hi, _m, m_lo, m_hi in rows:
        assert m_lo <= hi and m_hi >= lo, report  # the measured interval meets the predicted band


def test_a_prefix_copied_into_llama_servers_slots_serves_prompts_as_its_own_prompt_cache_does(tmp_path: Path) -> None:
    """The premise of llama.cpp's profile protocol (tuner.predict.profile.LLAMACPP_PROTOCOL): once a prefix's KV
    cache is copied into the slots (one prefill, saved, then restored into each: `LlamaCppEngine.copy_prompt`), a
    wave of prompts that share it prefills only their own tails, whichever slot each lands in, and decodes exactly
    what it decodes when the slots' own prompt cache holds the prefix (greedy: the same tokens; a full prefill of
    the same prompts may differ from both after a few tokens, here as with any prompt-cache hit: a 4-token prefill's
    arithmetic is not a 320-token one's). The engine's own timings say what it prefilled (`prompt_n`) and what its
    cache served (`cache_n`)."""
    import random

    from tuner.config import TrialConfig
    from tuner.engines.registry import backend
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import Request, token_pool
    from tuner.predict.profile import llamacpp_copies
    from tuner.predict.waves import DECODE_PROMPTS, DECODE_TOKENS, SHARED_TAIL, DecodePrompts

    long = max(DECODE_PROMPTS)
    config = TrialConfig(model="smollm2-135m", engine="llamacpp", quant="Q8_0", batch_cap=4, threads=1)
    engine, _model, tokenizer = backend("llamacpp").open(config, ignore_eos=True)
    copy = llamacpp_copies(engine, tmp_path)
    assert engine.argv[-2:] == ["--slot-save-path", str(tmp_path)]
    prompts = DecodePrompts(token_pool(tokenizer), random.Random(0), True)  # no copies of its own
    full, again = prompts(4, long, DECODE_TOKENS), prompts(4, long, DECODE_TOKENS)
    engine.start()
    try:
        runs = []

        def wave(reqs: list[Request]) -> None:
            load = run_load(engine, [Request(i, "", r.prompt_ids, r.max_tokens, None) for i, r in enumerate(reqs)],
                            concurrency=len(reqs), progress=False)
            results = sorted(load.results, key=lambda r: r.index)
            assert all(r.ok and r.output_tokens == DECODE_TOKENS for r in results)
            timings = engine.request_timings()
            runs.append([(timings[f"r{r.index}"].get("prompt_n"), timings[f"r{r.index}"].get("cache_n"), r.ttft_ms,
                          tuple(ids)) for r, ids in zip(results, load.token_ids)])

        wave(full)  # nothing cached: prefilled whole
        wave(again)  # the same prefix, new tails: each slot's own prompt cache holds the prefix
        wave(prompts(4, min(DECODE_PROMPTS), DECODE_TOKENS))  # every slot holds another prompt now
        copy(prompts.prefixes[long], 4)
        wave(again)
    finally:
        engine.stop(drain=False)
    first, cached, other, copied = runs
    assert all(n >= long - 1 for n, *_ in first) and all(n >= min(DECODE_PROMPTS) - 1 for n, *_ in other), runs
    for served in (cached, copied):
        assert all(n <= SHARED_TAIL + 1 and c >= long - SHARED_TAIL - 1 for n, c, *_ in served), runs
    assert [ids for *_, ids in copied] == [ids for *_, ids in cached]
    assert max(t for _, _, t, _ in copied) < 0.5 * min(t for _, _, t, _ in first), runs
