"""The profile's measurement protocol and fit, run against a simulated engine whose step model is known; the cache's
rule that a profile from another host or build is measured again, with a note."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tuner.errors import TunerError
from tuner.predict import profile as prof
from tuner.predict import waves
from tuner.predict.fit import bootstrap_models, fit_step_model, spanned
from tuner.predict.simulate import SimulatedEngine, StepModel

TRUTH = StepModel(decode_base_s=0.010, decode_per_seq_s=0.002, decode_per_context_token_s=2e-6,
                  prefill_base_s=0.003, prefill_per_token_s=1e-4)


def profile_samples(model: StepModel, batch_cap: int = 4, seed: int = 0) -> dict[str, Any]:
    engine = SimulatedEngine(model, batch_cap, seed=seed)
    return waves.collect_samples(lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)),
                                batch_cap, list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS), random.Random(seed))


def test_the_protocol_recovers_a_known_step_model() -> None:
    s = profile_samples(TRUTH)
    assert {d["seqs"] for d in s["decode"]} == {1, 2, 4}
    assert [k for k, _ in fit_step_model(s["decode"], s["prefill"])[0].decode_by_batch_s] == [1, 2, 4]
    model, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    for k in (1, 2, 3, 4):
        for ctx in (0, 100 * k, 300 * k):
            assert model.decode_s(k, ctx) == pytest.approx(TRUTH.decode_s(k, ctx), rel=1e-3), (k, ctx)
    assert model.decode_per_context_token_s == pytest.approx(TRUTH.decode_per_context_token_s, rel=1e-3)
    for tokens in (1, 100, 1000):
        assert model.prefill_s(tokens) == pytest.approx(TRUTH.prefill_s(tokens), rel=1e-3)
    assert fit["decode"]["rmse_s"] < 1e-6 and model.noise_sigma == pytest.approx(0.0, abs=1e-6)


def test_the_protocol_recovers_what_a_prompt_joining_running_decodes_costs() -> None:
    # an engine whose lone prompt pays a large fixed cost (an idle engine's wake-up) that a prompt joining running
    # decodes does not: the mixed waves measure the second apart; a step model fitted without them would charge it
    truth = StepModel(**{**TRUTH.to_dict(), "prefill_base_s": 0.030, "mixed": True, "mixed_base_s": 0.002,
                         "mixed_per_token_s": 5e-5, "prefill_per_token_sq_s": 2e-7, "mixed_per_token_sq_s": 1e-7})
    s = profile_samples(truth)
    assert {m["seqs"] for m in s["mixed"]} == {1, 3}  # 1 and the cap less one (the prompt needs a free slot)
    assert {m["prompt_tokens"] for m in s["mixed"]} == set(waves.PREFILL_TOKENS)
    model, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"], s["mixed"])
    assert model.mixed and fit["mixed"]["n"] == len(s["mixed"])
    for k, tokens in ((1, 16), (3, 384), (8, 100)):
        assert model.step_s(k, 100 * k, tokens) == pytest.approx(truth.step_s(k, 100 * k, tokens), rel=1e-3)
    for tokens in (16, 96, 384, 700):  # alone: the wake-up kept, the attention's square too (700: extrapolated)
        assert model.prefill_s(tokens) == pytest.approx(truth.prefill_s(tokens), rel=1e-3)
    without, _ = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    assert not without.mixed and without.step_s(3, 300, 16) > 2 * truth.step_s(3, 300, 16)
    boots = bootstrap_models(s["decode"], s["prefill"], model, 5, seed=1, mixed=s["mixed"])
    assert all(b.mixed for b in boots)


def test_a_context_slope_per_batch_size_is_fitted_only_where_the_samples_reject_one_shared_slope() -> None:
    # transformers' continuous batching on CPU: 8 sequences of long contexts cost 3.5x 8 of short ones, 4 sequences
    # hardly more; one slope through both put the 4-sequence step below every sample of it (tuner.predict.fit)
    truth = StepModel(**{**TRUTH.to_dict(), "noise_sigma": 0.03,
                         "decode_by_batch_s": ((1, 0.040), (2, 0.070), (4, 0.066), (8, 0.038)),
                         "decode_ctx_by_batch_s": ((1, 8e-6), (2, 1.4e-5), (4, 6e-6), (8, 7e-5))})
    s = profile_samples(truth, batch_cap=8, seed=3)
    model, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    assert fit["context_slope"]["per_batch"] and fit["context_slope"]["shared_slope_p"] < 1e-3
    for k in (1, 2, 4, 8):
        for ctx in (40 * k, 340 * k):
            assert model.decode_s(k, ctx) == pytest.approx(truth.decode_s(k, ctx), rel=0.05), (k, ctx)
    assert model.decode_s(6, 1200) == pytest.approx(truth.decode_s(6, 1200), rel=0.05)  # interpolated both ways
    boots = bootstrap_models(s["decode"], s["prefill"], model, 3, seed=1)
    assert all(len(b.decode_ctx_by_batch_s) == 4 for b in boots)  # the resampled fits keep the model's form
    # the same noise around one shared slope: the shared slope is kept (the F-test does not reject it)
    shared = StepModel(**{**truth.to_dict(), "decode_ctx_by_batch_s": ()})
    s = profile_samples(shared, batch_cap=8, seed=3)
    model, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    assert not fit["context_slope"]["per_batch"] and model.decode_ctx_by_batch_s == ()
    assert model.decode_per_context_token_s == pytest.approx(shared.decode_per_context_token_s, rel=0.25)


def test_llamacpps_protocol_copies_a_prefix_per_prompt_length_into_the_slots_before_each_wave() -> None:
    # prof.LLAMACPP_PROTOCOL: two prefill repeats per length; the decode prompts of one length share all but their
    # last SHARED_TAIL tokens, and before each wave the engine is asked to copy that prefix into as many slots as the
    # wave holds; two waves per length below 8 sequences, one from 8 on; the mixed waves' decodes are the short
    # waves' kind, their probes fresh
    engine = SimulatedEngine(TRUTH, 8)
    events: list[tuple[str, int, Any]] = []  # ("copy", slots, prefix) / ("wave", k or None, requests)

    def serve(reqs: list[Any], k: int | None) -> list[Any]:
        events.append(("wave", k, list(reqs)))
        return engine.run(reqs, concurrency=k).results

    s = waves.collect_samples(serve, list(range(20_000)), 8, list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS),
                             random.Random(0), protocol=prof.LLAMACPP_PROTOCOL,
                             copy=lambda prefix, slots: events.append(("copy", slots, prefix)))
    short, long = waves.DECODE_PROMPTS
    tail = waves.SHARED_TAIL
    prefill = [r for what, k, r in events if what == "wave" and k == 1 and r[0].max_tokens == 1]
    assert [(len(r), len(r[0].prompt_ids)) for r in prefill] == [(2, p) for p in waves.PREFILL_TOKENS]
    decode = [(i, k, r) for i, (what, k, r) in enumerate(events)
              if what == "wave" and k is not None and r[0].max_tokens == waves.DECODE_TOKENS]
    assert [(k, len(r[0].prompt_ids)) for _, k, r in decode] == [
        (k, p) for k in (1, 2, 4) for p in (short, short, long, long)] + [(8, short), (8, long)]
    for i, k, reqs in decode:  # each wave: its prefix copied into k slots just before
        assert events[i - 1][:2] == ("copy", k) and all(r.prompt_ids[:-tail] == events[i - 1][2] for r in reqs)
    for p in (short, long):
        sent = [r.prompt_ids for _, k, reqs in decode for r in reqs if len(r.prompt_ids) == p]
        assert len({ids[:-tail] for ids in sent}) == 1  # one prefix per length
        assert len({ids[-tail:] for ids in sent}) == len(sent) == 2 * (1 + 2 + 4) + 8  # fresh tails
    mixed = [(i, r) for i, (what, k, r) in enumerate(events) if what == "wave" and k is None]
    assert [sum(q.max_tokens > 1 for q in r) for _, r in mixed] == [1, 1, 7, 7]
    short_prefix = decode[0][2][0].prompt_ids[:-tail]
    for i, reqs in mixed:
        k = sum(q.max_tokens > 1 for q in reqs)
        assert events[i - 1] == ("copy", k, short_prefix)  # the decodes start as the short waves' did
        assert all(q.prompt_ids[:-tail] == short_prefix for q in reqs[:k])
        assert all(q.prompt_ids[:8] != short_prefix[:8] for q in reqs[k:])  # the probes: fresh prompts
    assert s["mixed"] and s["notes"] == []
    # on an engine without a prompt cache the samples are those of fresh prompts: the same fit
    model, _ = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    for k in (1, 3, 8):
        for ctx in (40 * k, 352 * k):
            assert model.decode_s(k, ctx) == pytest.approx(TRUTH.decode_s(k, ctx), rel=1e-3), (k, ctx)


def test_a_copy_the_engine_refuses_stops_the_copies_and_the_profile_says_so() -> None:
    engine = SimulatedEngine(TRUTH, 4)
    calls = []

    def refuse(prefix: tuple[int, ...], slots: int) -> None:
        calls.append(slots)
        raise TunerError("llama-server /slots/0?action=save: HTTP Error 501: This server does not support slot save")

    s = waves.collect_samples(lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)), 4,
                             list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS), random.Random(0),
                             protocol=prof.LLAMACPP_PROTOCOL, copy=refuse)
    assert calls == [1]  # not asked again
    assert s["notes"] == ["prompt copies into the engine's slots stopped (llama-server /slots/0?action=save: HTTP "
                          "Error 501: This server does not support slot save): decode prompts prefilled in full"]
    assert len(s["decode"]) == len(waves.collect_samples(
        lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)), 4, list(waves.PREFILL_TOKENS),
        list(waves.DECODE_PROMPTS), random.Random(0), protocol=prof.LLAMACPP_PROTOCOL)["decode"])


def test_vllm_waves_send_the_first_prompts_of_one_family_per_length() -> None:
    # VLLM_PROTOCOL (version 13) at cap 16, 528 tokens a step, a prefix cache of 128-token blocks: a wave of k sends
    # the first k prompts of its length's family, so the prompts of earlier waves come again (vLLM's prefix cache
    # serves their two whole blocks: 64 of 320 tokens to prefill), never twice in one wave. The long waves at 1 (its
    # second), 2, 4, 8 and 16 sequences then prefill 64, 384, 768, 1536 and 3072 tokens: 1, 1, 2, 3 and 6 steps at
    # 528 (fresh: 1, 2, 3, 5 and 10), each asking 16 more; the short prompts (the 32 tokens given here; a real vLLM
    # profile sends 8, VLLM_PROTOCOL.short_prompt: no whole block either) in full.
    engine = SimulatedEngine(TRUTH, 16, token_budget=528)
    sent: list[tuple[int, list[tuple[int, ...]], int]] = []

    def serve(reqs: list[Any], k: int | None) -> list[Any]:
        if k is not None and len(reqs[0].prompt_ids) in waves.DECODE_PROMPTS:
            sent.append((k, [tuple(r.prompt_ids) for r in reqs], reqs[0].max_tokens))
        return engine.run(reqs, concurrency=k).results

    s = waves.collect_samples(serve, list(range(20_000)), 16, list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS),
                             random.Random(0), protocol=prof.VLLM_PROTOCOL, token_budget=528, prefix_block=lambda: 128)
    short, long = waves.DECODE_PROMPTS
    for p, tokens in ((short, [17] * 6), (long, [17, 17, 17, 18, 19, 22])):
        mine = [(k, prompts, n) for k, prompts, n in sent if len(prompts[0]) == p]
        assert [(k, n) for k, _, n in mine] == list(zip((1, 1, 2, 4, 8, 16), tokens))
        family = mine[-1][1]  # the widest wave's: every prompt of this length, none twice
        assert len(set(family)) == 16 and len({f[:128] for f in family}) == 16
        assert all(prompts == family[:k] for k, prompts, _ in mine)
    assert s["reused_tokens"] == (1 + 1 + 2 + 4 + 8) * 256  # the long prompts sent again: two whole blocks each


@pytest.mark.parametrize("engine_name, prefix_block, long_tokens", [
    # vLLM (no shared prefix: its CPU attention reads a shared prefix's blocks faster, 0.81-0.89x the step of fresh
    # ones, benchmarks/bench_shared_prefix.py; here without a prefix cache, so the prompts its waves send again are
    # prefilled in full too): 16 + the steps k prompts of 320 tokens take at 528 a step: 1, 2, 3, 5, 10
    ("vllm", None, (17, 18, 19, 21, 26)),
    # transformers (version 11): the long prompts share a prefix whose whole 256-token block its prefix cache serves
    # once computed, so k of them prefill 320 + (k - 1) x 64 tokens: 1, 1, 1, 2, 3 steps. The simulated engine has no
    # prefix cache: it prefills them in full, so the wide waves keep fewer steps (16 sequences: about 9), the worst
    # case of an engine that evicted the prefix
    ("transformers", 256, (17, 17, 17, 18, 19)),
])
def test_short_single_waves_from_two_sequences_and_one_mixed_wave_per_batch_size_still_recover_the_model(
        engine_name: str, prefix_block: int | None, long_tokens: tuple[int, ...]) -> None:
    # prof.TRANSFORMERS_PROTOCOL and VLLM_PROTOCOL (versions 10-11): two waves per prompt length at 1 sequence, one
    # from 2 on, each asking 16 tokens more than the steps its prompts take to get in at the engine's tokens per step
    # (here 528, transformers' at cap 16); the four probe lengths sent into one mixed wave per batch size, 4 steps
    # apart.
    # On a noisy engine with a context slope per batch size (3% step noise) and a prompt joining running decodes
    # cheaper than alone, the fit still recovers each batch size's step and the mixed step within 5% (so did version
    # 9's mixed waves: 1-5% over five seeds)
    truth = StepModel(**{**TRUTH.to_dict(), "noise_sigma": 0.03, "prefill_base_s": 0.030, "mixed": True,
                         "mixed_base_s": 0.002, "mixed_per_token_s": 5e-5, "prefill_per_token_sq_s": 2e-7,
                         "mixed_per_token_sq_s": 1e-7,
                         "decode_by_batch_s": ((1, 0.040), (2, 0.070), (4, 0.066), (8, 0.038), (16, 0.036)),
                         "decode_ctx_by_batch_s": ((1, 8e-6), (2, 1.4e-5), (4, 6e-6), (8, 7e-5), (16, 9e-5))})
    budget = 528
    engine = SimulatedEngine(truth, 16, token_budget=budget, seed=3)
    sent: list[tuple[int | None, int, int]] = []

    def serve(reqs: list[Any], k: int | None) -> list[Any]:
        if k is None:  # a mixed wave: its decodes and probes
            sent.append((None, sum(r.max_tokens > 1 for r in reqs), sum(r.max_tokens == 1 for r in reqs)))
        elif len(reqs[0].prompt_ids) in waves.DECODE_PROMPTS:
            sent.append((k, len(reqs[0].prompt_ids), reqs[0].max_tokens))
        return engine.run(reqs, concurrency=k).results

    s = waves.collect_samples(serve, list(range(20_000)), 16, list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS),
                             random.Random(3), protocol=prof.SIDES[engine_name].protocol, token_budget=budget,
                             prefix_block=lambda: prefix_block)
    short, long = waves.DECODE_PROMPTS
    short_tokens = (17, 17, 17, 17, 17)  # 16 + 1: up to 16 prompts of 32 tokens get in in one step
    assert sent == [(1, short, 17), (1, short, 17), (1, long, long_tokens[0]), (1, long, long_tokens[0])] + [
        (k, p, tokens[i]) for i, k in enumerate((2, 4, 8, 16), start=1)
        for p, tokens in ((short, short_tokens), (long, long_tokens))] + [(None, 1, 4), (None, 15, 4)]
    assert {(m["seqs"], m["prompt_tokens"]) for m in s["mixed"]} >= {(1, p) for p in waves.PREFILL_TOKENS}
    model, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"], s["mixed"])
    assert fit["context_slope"]["per_batch"] and model.mixed
    for k in (1, 2, 4, 8, 16):
        for ctx in (40 * k, 340 * k):
            assert model.decode_s(k, ctx) == pytest.approx(truth.decode_s(k, ctx), rel=0.05), (k, ctx)
    for k, tokens in ((1, 16), (1, 384), (15, 64)):
        assert model.step_s(k, 100 * k, tokens) == pytest.approx(truth.step_s(k, 100 * k, tokens), rel=0.05)


def test_vllm_sends_long_prompts_up_to_16_sequences_and_fits_the_wider_batches_slope_from_there() -> None:
    # prof.VLLM_PROTOCOL (version 12) at --max-num-seqs 64: the long waves stop at 16 sequences (a 64-sequence one
    # would prefill 20,480 tokens); 32 and 64 get short waves only. On an engine whose slope per batch size differs
    # below 16 (so the fit takes one per batch size) and holds from 16 on, the steps at 32 and 64 sequences over long
    # contexts -- never measured -- come out within 5%; the step at each batch size measured too
    truth = StepModel(**{**TRUTH.to_dict(), "noise_sigma": 0.03,
                         "decode_by_batch_s": ((1, 0.022), (2, 0.027), (4, 0.022), (8, 0.028), (16, 0.040),
                                               (32, 0.064), (64, 0.110)),
                         "decode_ctx_by_batch_s": ((1, 8e-6), (2, 1.4e-5), (4, 6e-6), (8, 1e-6), (16, 3.3e-6))})
    engine = SimulatedEngine(truth, 64, token_budget=2048, seed=5)
    sent: list[tuple[int, int]] = []

    def serve(reqs: list[Any], k: int | None) -> list[Any]:
        if k is not None and len(reqs[0].prompt_ids) in waves.DECODE_PROMPTS:
            sent.append((k, len(reqs[0].prompt_ids)))
        return engine.run(reqs, concurrency=k).results

    s = waves.collect_samples(serve, list(range(40_000)), 64, list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS),
                             random.Random(5), protocol=prof.VLLM_PROTOCOL, token_budget=2048)
    short, long = waves.DECODE_PROMPTS
    assert sent == [(1, short), (1, short), (1, long), (1, long)] + [
        (k, p) for k in (2, 4, 8, 16) for p in (short, long)] + [(32, short), (64, short)]
    model, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"], s["mixed"])
    assert fit["context_slope"]["per_batch"] and [k for k, _ in model.decode_ctx_by_batch_s] == [1, 2, 4, 8, 16]
    for k in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (40 * k, 340 * k):
            assert model.decode_s(k, ctx) == pytest.approx(truth.decode_s(k, ctx), rel=0.05), (k, ctx)


def test_transformers_decode_prompts_share_one_prefix_per_length_with_fresh_tails() -> None:
    # prof.TRANSFORMERS_PROTOCOL (version 11): no copies (transformers' prefix cache serves the prefix's whole
    # blocks once one prompt has computed them); every wave's prompts of one length share one prefix, all but their
    # last SHARED_TAIL tokens; the mixed waves' probes stay fresh
    engine = SimulatedEngine(TRUTH, 4)
    sent: list[tuple[int | None, list[Any]]] = []
    waves.collect_samples(lambda reqs, k: sent.append((k, list(reqs))) or engine.run(reqs, concurrency=k).results,
                         list(range(20_000)), 4, list(waves.PREFILL_TOKENS), list(waves.DECODE_PROMPTS),
                         random.Random(0), protocol=prof.TRANSFORMERS_PROTOCOL, token_budget=4 + 512,
                         prefix_block=lambda: 256)
    tail = waves.SHARED_TAIL
    for p in waves.DECODE_PROMPTS:
        ids = [r.prompt_ids for k, reqs in sent if k is not None for r in reqs if len(r.prompt_ids) == p]
        assert len(ids) == 2 * 1 + 2 + 4  # two waves at 1 sequence, one at 2 and 4
        assert len({x[:-tail] for x in ids}) == 1 and len({x[-tail:] for x in ids}) == len(ids)
    long_prefix = next(r.prompt_ids[:-tail] for k, reqs in sent for r in reqs if len(r.prompt_ids) == 320)
    probes = [r.prompt_ids for k, reqs in sent if k is None for r in reqs if r.max_tokens == 1]
    assert len(probes) == 4 * 2 and all(x[:8] != long_prefix[:8] for x in probes)


def test_a_profile_fitted_by_older_rules_is_fitted_again_from_its_samples_without_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tuner.config import TrialConfig
    from tuner.predict.fit import FIT_VERSION

    monkeypatch.setattr(prof, "profiles_dir", lambda: tmp_path)
    config = TrialConfig(model="smollm2-135m", engine="llamacpp", quant="Q8_0", batch_cap=8)
    # this host's key without the llama-server build (a unit test: `make test-fast` runs before `make llamacpp`)
    key = {"engine": "llamacpp", "build": {"commit": "test", "server_sha256": "0" * 16},
           "model": {"name": "smollm2-135m", "gguf_sha256": "1" * 16},
           "format": {"quant": "Q8_0", "kv_type": "auto", "threads": None, "ubatch": None}, "host": prof.host_facts()}
    monkeypatch.setattr(prof, "profile_key", lambda c: key)
    truth = StepModel(**{**TRUTH.to_dict(), "decode_by_batch_s": ((1, 0.040), (2, 0.070), (4, 0.066), (8, 0.038)),
                         "decode_ctx_by_batch_s": ((1, 8e-6), (2, 1.4e-5), (4, 6e-6), (8, 7e-5))})
    s = profile_samples(truth, batch_cap=8)
    old = {"decode_base_s": 0.0, "decode_per_context_token_s": 5.5e-5, "noise_sigma": 0.27,
           "decode_by_batch_s": [[1, 0.031], [2, 0.054], [4, 0.029], [8, 0.062]]}  # one slope: what v1 fitted
    path = tmp_path / f"{prof.profile_id(key)}.json"
    path.write_text(json.dumps({"version": prof.VERSION, "id": prof.profile_id(key), "key": key,
                                "measured_at": "2026-12-06T03:01:25+00:00", "batch_cap": 8, "ranges": {},
                                "fit": {"model": old}, "samples": s, "notes": []}))
    monkeypatch.setattr(prof, "measure_profile", lambda *a, **k: pytest.fail("a refit needs no measurement"))
    got = prof.load_or_measure(config, 8)
    assert got["cached"] is True and got["fit"]["fit_version"] == FIT_VERSION
    assert prof.history_since(got) == got["fitted_at"] > got["measured_at"]
    assert any("fitted again from its stored samples" in n for n in got["notes"])
    model = prof.step_model(got)
    assert model.decode_s(4, 600) == pytest.approx(truth.decode_s(4, 600), rel=1e-3)  # the old fit: 62 ms of 70
    written = json.loads(path.read_text())  # kept fitted: the next read is a plain read
    assert written["fit"]["fit_version"] == FIT_VERSION and "refitted" not in written
    assert prof.read_profile(path)["fitted_at"] == written["fitted_at"]


def test_a_cap_of_one_measures_no_mixed_step() -> None:
    s = profile_samples(TRUTH, batch_cap=1)
    assert s["mixed"] == [] and not fit_step_model(s["decode"], s["prefill"], s["gaps"], s["mixed"])[0].mixed


def test_noisy_steps_give_the_noise_and_a_parameter_spread() -> None:
    noisy = StepModel(**{**TRUTH.to_dict(), "noise_sigma": 0.2})
    s = profile_samples(noisy, seed=1)
    model, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    assert model.noise_sigma == pytest.approx(0.2, rel=0.25)
    # the per-step decode cost at each batch size is recovered within the noise's reach
    for k in (1, 2, 4):
        assert model.decode_s(k, k * 100) == pytest.approx(TRUTH.decode_s(k, k * 100), rel=0.1)
    boots = bootstrap_models(s["decode"], s["prefill"], model, 20, seed=2)
    spread = [m.decode_s(4, 400) for m in boots]
    assert max(spread) > min(spread)  # the resamples differ
    assert min(spread) < TRUTH.decode_s(4, 400) * 1.15 and max(spread) > TRUTH.decode_s(4, 400) * 0.85


def test_wave_gaps_keep_only_steps_where_the_whole_wave_decodes() -> None:
    # two requests sent together whose prompts differ: the short one decodes alone while the long one's prompt runs
    # (in the same steps), and finishes first; only the gaps with both decoding and both unfinished count
    from tuner.measure.workload import Request

    engine = SimulatedEngine(TRUTH, batch_cap=2, token_budget=64)
    reqs = [Request(0, "", tuple(range(16)), 20, None), Request(1, "", tuple(range(200)), 40, None)]
    results = engine.run(reqs, concurrency=2).results
    kept = waves.wave_gaps(results)
    both_from = max(r.send_s + r.ttft_ms / 1e3 for r in results)
    first_end = min(r.send_s + r.e2e_ms / 1e3 for r in results)
    assert kept and all(k == 2 for k, _, _ in kept)
    # each kept step's context: both prompts and as many tokens out as the request whose gap it is, twice
    assert {ctx for _, ctx, _ in kept} <= {16 + 200 + 2 * j for j in range(1, 40)}
    steps = round((first_end - both_from) / TRUTH.decode_s(2, 0), 0)
    assert 0 < len(kept) <= 2 * steps


def fake_profile(key: dict[str, Any]) -> dict[str, Any]:
    s = profile_samples(TRUTH)
    _, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"])
    return {"version": prof.VERSION, "id": prof.profile_id(key), "key": key, "measured_at": "then", "batch_cap": 4,
            "ranges": {"max_seqs": 4, "max_context_per_seq": 300, "max_prompt_tokens": 384}, "fit": fit,
            "samples": {"decode": s["decode"], "prefill": s["prefill"], "gaps": []}, "notes": []}


def test_a_profile_from_another_host_is_measured_again_with_a_note(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tuner.config import TrialConfig

    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    config = TrialConfig(model="smollm2-135m", engine="llamacpp", quant="Q8_0", batch_cap=4)
    key = {"engine": "llamacpp", "build": {"commit": "x"}, "model": {"name": "m", "gguf_sha256": "abc"},
           "format": {"quant": "Q8_0"}, "host": {"cpu_model": "this", "cores": 2}}
    elsewhere = dict(key, host={"cpu_model": "another", "cores": 64})
    (tmp_path / "profiles").mkdir()
    older_build = dict(key, build={"commit": "w"})
    for other in (elsewhere, older_build):
        (tmp_path / "profiles" / f"{prof.profile_id(other)}.json").write_text(json.dumps(fake_profile(other)))
    measured: list[int] = []
    monkeypatch.setattr(prof, "profile_key", lambda c: key)

    def measure(c: Any, cap: int, log: Any = None, protocol: Any = None) -> dict[str, Any]:  # the real one starts llama-server
        measured.append(cap)
        return dict(fake_profile(key), batch_cap=cap)

    monkeypatch.setattr(prof, "measure_profile", measure)
    first = prof.load_or_measure(config, 4)
    assert measured == [4] and not first["cached"]
    assert any("from another host" in n and "not reused" in n for n in first["notes"])
    assert any("from another build" in n and "not reused" in n for n in first["notes"])
    again = prof.load_or_measure(config, 4)  # this host's is cached now
    assert measured == [4] and again["cached"]
    wider = prof.load_or_measure(config, 8)  # a wider batch than profiled: measured again
    assert measured == [4, 8] and any("covers up to 4 sequences" in n for n in wider["notes"])
    refreshed = prof.load_or_measure(config, 2, refresh=True)  # never narrower than the profile it replaces
    assert measured == [4, 8, 8] and "measured again as asked" in refreshed["notes"]


@pytest.mark.parametrize("field, value", [("short_prompt", 0), ("short_prompt", 320), ("long_waves_to", 0),
                                          ("mixed_gap_steps", -1)])
def test_a_protocol_out_of_range_is_refused_in_one_line(field: str, value: int) -> None:
    with pytest.raises(TunerError) as e:
        waves.Protocol(**{field: value})
    assert f"{field}={value}" in str(e.value) and "\n" not in str(e.value)


def test_short_prompts_alone_do_not_give_a_batch_size_its_own_context_slope() -> None:
    # VLLM_PROTOCOL at cap 32 with its 8-token short prompts: the 32-sequence waves are short only (9 to ~25 tokens a
    # sequence: 2.8x apart, yet a few tokens' step cost under the noise). With slopes per batch size fitted, 32 takes
    # the slope measured at 16 (fit.PER_BATCH_SPAN_TOKENS): before, it got its own from the short waves (a real fp32
    # profile's came out 0, 2026-12-07), so a 32-sequence step over long contexts was predicted at its short one's
    truth = StepModel(**{**TRUTH.to_dict(), "noise_sigma": 0.03, "prefill_base_s": 0.030,
                         "decode_by_batch_s": ((1, 0.040), (2, 0.050), (4, 0.045), (8, 0.050), (16, 0.067),
                                               (32, 0.110)),
                         "decode_ctx_by_batch_s": ((1, 2e-6), (2, 1.4e-5), (4, 6e-6), (8, 1.5e-5), (16, 2.5e-5))})
    engine = SimulatedEngine(truth, 32, token_budget=2048, seed=5)
    s = waves.collect_samples(lambda reqs, k: engine.run(reqs, concurrency=k).results, list(range(20_000)), 32,
                             list(waves.PREFILL_TOKENS), [8, 320], random.Random(5), protocol=prof.VLLM_PROTOCOL,
                             token_budget=2048, prefix_block=lambda: 128)
    assert {d["seqs"] for d in s["decode"] if d["prompt_tokens"] == 320} == {1, 2, 4, 8, 16}
    assert spanned(s["decode"]) == [1, 2, 4, 8, 16]
    model, fit = fit_step_model(s["decode"], s["prefill"], s["gaps"], s["mixed"])
    assert fit["context_slope"]["per_batch"] and [k for k, _ in model.decode_ctx_by_batch_s] == [1, 2, 4, 8, 16]
    assert model.decode_s(32, 32 * 330) == pytest.approx(truth.decode_s(32, 32 * 330), rel=0.1)
