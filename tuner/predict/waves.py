"""The profile's measurement protocol: the requests an engine profile sends (prefill singles, decode waves, mixed
waves) and the samples it keeps from what the engine streamed back (tuner.predict.profile opens the engine, runs
`collect_samples` against it and fits what it returns):
* **decode**: waves of k fresh prompts sent together (k = 1, 2, 4, ... up to the batch cap), at two prompt lengths,
  `DECODE_TOKENS` out each, `DECODE_WAVES` waves per length (llama.cpp, `LLAMACPP_PROTOCOL`: version 6, the prompts
  of one length share a prefix whose KV cache is copied into the slots before each wave; version 7, one wave per
  length from 8 sequences on; transformers and vLLM, `TRANSFORMERS_PROTOCOL` and `VLLM_PROTOCOL`: versions 8 and 9, one
  wave per length from 2 sequences on; version 10, each wave asks 16 tokens more than the steps its prompts take to get
  in at the engine's tokens per step, `Protocol.wave_tokens`; version 11, transformers' prompts of one length share a
  prefix served by its prefix cache, `Side.prefix_block`; version 12, vLLM's long prompts up to 16 sequences only,
  `Protocol.long_waves_to`; version 13, vLLM's waves send the first k of one family of prompts per length, those
  sent before served by its prefix cache, `Protocol.reuse_prompts`, its short prompts 8 tokens,
  `Protocol.short_prompt`). Only the streamed gaps that fall
  while all k requests decode (after the wave's last first token, before its first finish) are kept: each is one
  step of k sequences; their medians per quarter of the output give (k, context tokens summed, step seconds) samples.
* **prefill**: single requests of several prompt lengths (one token out; `Protocol.prefill_repeats` each: 2) on
  the idle engine: TTFT against tokens
  (and the engine's own prompt time beside it where it reports one: llama-server's `prompt_ms`).
* **mixed** (version 3): prompts of those lengths sent, open loop, into a wave of running decodes (1 and the cap
  less one sequences; two prompt lengths per wave, transformers and vLLM all four, `Protocol.mixed_probes`), paced by
  the decode and prefill times just measured; the decodes' gap that ends with a
  prompt's first token is a step holding both: (sequences, context, prompt tokens, seconds). A lone prompt's TTFT
  also holds what the idle engine spends before its first step (transformers' loop waking up, llama-server's task
  launch), which a prompt joining a running batch may not pay, or pays differently.
All fitted by tuner.predict.fit (residuals kept); raw gaps and TTFTs are stored in the profile.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuner.errors import TunerError
from tuner.measure.workload import Request

PREFILL_TOKENS = (16, 64, 192, 384)
PREFILL_REPEATS = 3
DECODE_PROMPTS = (32, 320)  # + DECODE_TOKENS covers the default workload (64:256 in, 32:64 out)
DECODE_TOKENS = 32
DECODE_WAVES = 2
BIN_PARTS = 4  # a wave's kept gaps are summarised per quarter of the output (the context grows along it)
MIXED_PROBES = 2  # prompts sent one after another into one wave of running decodes
MIXED_LEAD_STEPS = 4  # decode steps after the wave's decodes all run before the first prompt is sent
MIXED_GAP_STEPS = 12  # decode steps between one prompt's expected first token and the next prompt
SHARED_TAIL = 4  # Protocol.shared_prefix: each decode prompt's own tokens after the prefix of its length

@dataclass(frozen=True)
class Protocol:
    """How much a profile measures: the prefill repeats per prompt length and the decode waves per (k, prompt
    length). The defaults are the profile's; fewer (a test's quick profile) give a noisier fit of the same shape."""

    prefill_repeats: int = PREFILL_REPEATS
    decode_waves: int = DECODE_WAVES
    mixed: bool = True  # measure mixed steps (False: a profile of version 2's protocol)
    shared_prefix: bool = False  # decode prompts of one length share all but their last SHARED_TAIL tokens, the
    # prefix copied into the engine's slots before each wave where it can (`DecodePrompts`, LLAMACPP_PROTOCOL)
    one_wave_from: int | None = None  # from this many sequences on, one decode wave per prompt length (a wave there
    # costs about k times a lone sequence's and yields as many steps); None: `decode_waves` at every concurrency
    decode_steps: int | None = None  # a decode wave's tokens out: this many more than the steps its prompts take to
    # get in at the engine's tokens per step (`wave_tokens`); None: DECODE_TOKENS
    mixed_probes: int = MIXED_PROBES
    mixed_gap_steps: int = MIXED_GAP_STEPS
    long_waves_to: int | None = None  # the widest batch size sent long decode prompts (a wider one: short prompts
    # only, its context slope the one fitted at the widest below it, tuner.predict.fit.spanned); None: every batch size
    reuse_prompts: bool = False  # the decode prompts of one length are one family, a wave of k sending its first k:
    # each its own context, those an earlier wave sent served from the engine's prefix cache (whole blocks) where it
    # has one (`DecodePrompts`, VLLM_PROTOCOL)
    short_prompt: int = DECODE_PROMPTS[0]  # the short decode prompts' tokens (the mixed waves' decodes too)

    def __post_init__(self) -> None:
        counts = ("prefill_repeats", "decode_waves", "mixed_probes", "short_prompt") + tuple(
            name for name in ("one_wave_from", "decode_steps", "long_waves_to") if getattr(self, name) is not None)
        for name in counts:
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise TunerError(f"profile protocol {name}={value!r} is invalid: expected an integer >= 1")
        if self.short_prompt >= DECODE_PROMPTS[1]:
            raise TunerError(f"profile protocol short_prompt={self.short_prompt!r} is invalid: expected fewer tokens "
                             f"than the long decode prompts' {DECODE_PROMPTS[1]}")
        if not (isinstance(self.mixed_gap_steps, int) and self.mixed_gap_steps >= 0):
            raise TunerError(f"profile protocol mixed_gap_steps={self.mixed_gap_steps!r} is invalid: expected an "
                             "integer >= 0")

    def waves_at(self, k: int, long: bool = False) -> int:
        """Decode waves per prompt length at k sequences (`long`: of the long prompts; none past `long_waves_to`)."""
        if long and self.long_waves_to is not None and k > self.long_waves_to:
            return 0
        return 1 if self.one_wave_from is not None and k >= self.one_wave_from else self.decode_waves

    def wave_tokens(self, k: int, prompt_tokens: int, token_budget: int | None, entry_tokens: int | None = None
                    ) -> int:
        """Tokens out of a decode wave of k prompts of `prompt_tokens`: DECODE_TOKENS, or (`decode_steps` set and the
        engine's tokens per step, `token_budget`, known) `decode_steps` more than the steps the wave's prompts take to
        get in at that budget: a wave's steps are kept only once all its k sequences decode. `entry_tokens`: the
        prompt tokens the wave prefills, less what the engine's prefix cache serves (`DecodePrompts.entry_tokens`;
        None: k x prompt_tokens)."""
        if self.decode_steps is None or token_budget is None:
            return DECODE_TOKENS
        return self.decode_steps + math.ceil((k * prompt_tokens if entry_tokens is None else entry_tokens)
                                             / token_budget)


def concurrencies(batch_cap: int) -> list[int]:
    """1, 2, 4, ... below the batch cap, and the cap."""
    out, k = [], 1
    while k < batch_cap:
        out.append(k)
        k *= 2
    return out + [batch_cap]


def fresh_prompts(pool: list[int], n: int, prompt_tokens: int, max_tokens: int, rng: random.Random) -> list[Request]:
    """`n` prompts of exactly `prompt_tokens` tokens, random windows of the real-text corpus (no shared prefix: an
    engine's prompt cache has nothing to reuse)."""
    out = []
    for i in range(n):
        start = rng.randrange(0, max(1, len(pool) - prompt_tokens))
        ids = tuple(pool[start:start + prompt_tokens])
        out.append(Request(i, "", ids, max_tokens, None))
    return out


class DecodePrompts:
    """`self(n, prompt_tokens, max_tokens)`: a wave's `n` decode prompts. Fresh (`fresh_prompts`), or (shared_prefix)
    each the prefix drawn once for its length followed by `SHARED_TAIL` fresh tokens, the prefix's KV cache first
    copied into the engine's first `n` slots (`copy`, where the engine can) so each prompt prefills its tail only. A
    copy the engine refuses stops the copies (`failed` says why): each prompt is then prefilled in full unless its
    slot still holds the prefix from an earlier wave (slower; the same decode steps). Without `copy` an engine with a
    prefix cache (transformers' block sharing) serves the prefix's whole blocks once a prompt has computed them.
    Or (reuse) the first `n` of one family of fresh prompts per length, drawn as needed: none shares a prefix with
    another, and a prompt an earlier wave sent finds its whole blocks in an engine's prefix cache (vLLM's)."""

    def __init__(self, pool: list[int], rng: random.Random, shared_prefix: bool,
                 copy: Callable[[tuple[int, ...], int], None] | None = None, reuse: bool = False) -> None:
        self.pool, self.rng, self.shared_prefix, self.copy, self.reuse = pool, rng, shared_prefix, copy, reuse
        self.prefixes: dict[int, tuple[int, ...]] = {}
        self.families: dict[int, list[Request]] = {}  # reuse: per length, the prompts drawn so far
        self.sent: dict[int, int] = {}  # reuse: per length, how many of its family waves have sent
        self.again: dict[int, int] = {}  # reuse: per length, the prompts sent again (`cache_served`)
        self.failed: str | None = None

    def cached(self, prompt_tokens: int, block: int | None) -> int:
        """Tokens of a prompt of this length that an engine's prefix cache of `block` tokens a block serves once its
        prefix is in the cache: the prefix's whole blocks (0: prompts not shared, or no prefix cache)."""
        if not self.shared_prefix or not block or prompt_tokens <= SHARED_TAIL:
            return 0
        return (prompt_tokens - SHARED_TAIL) // block * block

    @staticmethod
    def reusable(prompt_tokens: int, block: int | None) -> int:
        """Tokens of a prompt sent again that a prefix cache of `block` tokens a block serves: all its whole blocks but
        one holding its last token (at least that token is computed: vLLM's rule); 0 without a prefix cache."""
        return (prompt_tokens - 1) // block * block if block else 0

    def entry_tokens(self, n: int, prompt_tokens: int, block: int | None) -> int:
        """The prompt tokens the next wave of `n` prompts of this length prefills, with an engine's prefix cache of
        `block` tokens a block (None: none): shared, the prefix's whole blocks once; reused, each prompt sent before
        all but its last block (at least its last token is computed: vLLM's rule), each new one in full."""
        if self.shared_prefix:
            return prompt_tokens + (n - 1) * (prompt_tokens - self.cached(prompt_tokens, block))
        again = min(n, self.sent.get(prompt_tokens, 0)) if self.reuse else 0
        return n * prompt_tokens - again * self.reusable(prompt_tokens, block)

    def __call__(self, n: int, prompt_tokens: int, max_tokens: int) -> list[Request]:
        if self.reuse:
            family = self.families.setdefault(prompt_tokens, [])
            family += fresh_prompts(self.pool, n - len(family), prompt_tokens, 0, self.rng) if n > len(family) else []
            self.again[prompt_tokens] = self.again.get(prompt_tokens, 0) + min(n, self.sent.get(prompt_tokens, 0))
            self.sent[prompt_tokens] = max(self.sent.get(prompt_tokens, 0), n)
            return [Request(i, "", r.prompt_ids, max_tokens, None) for i, r in enumerate(family[:n])]
        if not self.shared_prefix or prompt_tokens <= SHARED_TAIL:
            return fresh_prompts(self.pool, n, prompt_tokens, max_tokens, self.rng)
        if prompt_tokens not in self.prefixes:
            self.prefixes[prompt_tokens] = fresh_prompts(self.pool, 1, prompt_tokens - SHARED_TAIL, 0,
                                                         self.rng)[0].prompt_ids
        prefix = self.prefixes[prompt_tokens]
        if self.copy is not None and self.failed is None:
            try:
                self.copy(prefix, n)
            except TunerError as e:
                self.failed = str(e)
        return [Request(r.index, "", prefix + r.prompt_ids, max_tokens, None)
                for r in fresh_prompts(self.pool, n, SHARED_TAIL, max_tokens, self.rng)]

    def cache_served(self, block: int | None) -> int:
        """Reuse: the prompt tokens a prefix cache of `block` tokens a block can have served the prompts sent again."""
        return sum(n * self.reusable(p, block) for p, n in self.again.items())


def wave_gaps(results: list[Any]) -> list[tuple[int, int, float]]:
    """(sequences, context tokens summed, seconds) of each streamed gap that fell while every request of the wave
    was decoding: after the wave's last first token, before its first finish. The context: every request's prompt
    and as many tokens out as the one whose gap it is (the wave's requests decode in the same steps)."""
    ok = [r for r in results if r.ok and r.ttft_ms is not None and r.e2e_ms is not None]
    if len(ok) != len(results) or not ok:
        return []
    k, prompts = len(ok), sum(r.prompt_tokens for r in ok)
    all_decoding = max(r.send_s + r.ttft_ms / 1e3 for r in ok)
    first_end = min(r.send_s + r.e2e_ms / 1e3 for r in ok)
    out = []
    for r in ok:
        t = r.send_s + r.ttft_ms / 1e3
        for j, g_ms in enumerate(r.itl_ms, start=1):  # this gap's step extends a context of prompt + j tokens
            start, t = t, t + g_ms / 1e3
            if start >= all_decoding - 1e-6 and t <= first_end + 1e-6:
                out.append((k, prompts + k * j, g_ms / 1e3))
    return out


def decode_samples(gaps: list[tuple[int, int, float]], parts: int = BIN_PARTS) -> list[dict[str, Any]]:
    """Medians of one wave's kept gaps per part of its output (the context grows along it)."""
    if not gaps:
        return []
    lo = min(g[1] for g in gaps)
    hi = max(g[1] for g in gaps)
    width = max(1, (hi - lo + 1) / parts)
    out = []
    for p in range(parts):
        part = [g for g in gaps if lo + p * width <= g[1] < lo + (p + 1) * width]
        if len(part) >= 3:
            out.append({"seqs": part[0][0], "context_tokens": statistics.median(g[1] for g in part),
                        "step_s": statistics.median(g[2] for g in part), "n": len(part)})
    return out


def mixed_seqs(batch_cap: int) -> list[int]:
    """The running decodes a prompt joins in the mixed waves: 1 and the cap less one (the prompt needs a free
    slot); none at cap 1, where a prompt never shares a step with a decode."""
    return sorted({1, batch_cap - 1}) if batch_cap >= 2 else []


def mixed_wave(pool: list[int], k: int, lengths: list[int], decoding_s: float, step_s: float,
               ttft_s: Callable[[int], float], room: int, rng: random.Random,
               decodes: Callable[[int, int, int], list[Request]] | None = None,
               gap_steps: int = MIXED_GAP_STEPS, entered_s: float = 0.0, decode_prompt: int = DECODE_PROMPTS[0]
               ) -> list[Request]:
    """k decodes of `decode_prompt` tokens (`decodes(k, prompt tokens, max tokens)`: the decode waves' kind of prompts;
    fresh by default) sent at once, then one fresh prompt of each length (1 token out) sent while they run: the first
    `MIXED_LEAD_STEPS` decode steps after `decoding_s` (when the k decode, as measured), the next `gap_steps` steps
    after the previous prompt's expected TTFT; the decodes ask for the tokens that outlast the last prompt counted
    from `entered_s`, the earliest they may all decode (a decode has no token out before it gets in; within `room`,
    the context one sequence may hold)."""
    arrivals, t = [], decoding_s + MIXED_LEAD_STEPS * step_s
    for p in lengths:
        arrivals.append(t)
        t += ttft_s(p) + gap_steps * step_s
    out_tokens = min(room - decode_prompt, math.ceil((t - entered_s) / step_s) + MIXED_LEAD_STEPS)
    make = decodes or (lambda n, p, m: fresh_prompts(pool, n, p, m, rng))
    reqs = [Request(r.index, "", r.prompt_ids, r.max_tokens, 0.0) for r in make(k, decode_prompt, out_tokens)]
    for i, (p, at) in enumerate(zip(lengths, arrivals)):
        (probe,) = fresh_prompts(pool, 1, p, 1, rng)
        reqs.append(Request(k + i, "", probe.prompt_ids, 1, at))
    return reqs


def mixed_steps(results: list[Any], k: int) -> list[dict[str, Any]]:
    """The steps of a mixed wave (requests 0..k-1 decode, the rest are prompts) where prompts joined the k running
    decodes: each prompt's first token ends a step; that step is the decodes' gap ending with it (each decode's
    nearest token within a quarter of its median gap), kept when all k decoded through it. Prompts whose first
    tokens end the same step are one sample (their tokens summed). (seqs, context tokens summed, prompt tokens,
    seconds: the median of the k decodes' gaps)."""
    by_index = {r.index: r for r in results}
    decodes = [by_index.get(i) for i in range(k)]
    if any(r is None or not r.ok or r.ttft_ms is None or r.e2e_ms is None or not r.itl_ms for r in decodes):
        return []
    ends = []  # per decode: the end time of each token after its first
    for r in decodes:
        t, row = r.send_s + r.ttft_ms / 1e3, []
        for g in r.itl_ms:
            t += g / 1e3
            row.append(t)
        ends.append(row)
    all_decoding = max(r.send_s + r.ttft_ms / 1e3 for r in decodes)
    first_end = min(r.send_s + r.e2e_ms / 1e3 for r in decodes)
    steps: dict[tuple[int, ...], list[int]] = {}  # the decodes' gap indices -> the prompts ending with them
    for r in results:
        if r.index < k or not r.ok or r.ttft_ms is None:
            continue
        first = r.send_s + r.ttft_ms / 1e3
        at = []
        for d, row in zip(decodes, ends):
            j = min(range(len(row)), key=lambda i: abs(row[i] - first))
            if abs(row[j] - first) > 0.25 * statistics.median(d.itl_ms) / 1e3:
                break
            at.append(j)
        else:
            starts = [ends[i][j] - decodes[i].itl_ms[j] / 1e3 for i, j in enumerate(at)]
            if min(starts) >= all_decoding - 1e-6 and first <= first_end + 1e-6:
                steps.setdefault(tuple(at), []).append(r.prompt_tokens)
    return [{"seqs": k, "context_tokens": sum(d.prompt_tokens + j + 1 for d, j in zip(decodes, at)),
             "prompt_tokens": sum(tokens), "prompt_sq": sum(p * p for p in tokens),
             "step_s": statistics.median(d.itl_ms[j] for d, j in zip(decodes, at)) / 1e3, "n": k}
            for at, tokens in steps.items()]


def collect_samples(serve: Callable[[list[Request], int | None], list[Any]], pool: list[int], batch_cap: int,
                    prefill_lengths: list[int], decode_prompts: list[int], rng: random.Random,
                    log: Callable[[str], None] = lambda s: None,
                    engine_prompt_ms: Callable[[int], float | None] = lambda index: None,
                    protocol: Protocol = Protocol(), room: int | None = None,
                    copy: Callable[[tuple[int, ...], int], None] | None = None,
                    token_budget: int | None = None, prefix_block: Callable[[], int | None] = lambda: None
                    ) -> dict[str, Any]:
    """The profile's measurement protocol against `serve(requests, concurrency) -> results` (a real engine through
    the load generator, or a simulated one; concurrency None: open loop at the requests' arrival times): a warm-up,
    prefill samples, decode waves at each concurrency, then mixed waves (prompts joining running decodes). `room`:
    the context one sequence may hold (None: no limit of its own).
    `engine_prompt_ms(index)`: the engine's own prompt time of the last run's request `index`, kept beside TTFT.
    `copy`: the engine's prompt copies (Side.copies) for `DecodePrompts`. `token_budget`: the engine's tokens per
    step (Side.step_tokens), and `prefix_block()` its prefix cache's tokens per block (Side.prefix_block, asked once
    the warm-up has run: transformers builds its cache in its first step), for `Protocol.wave_tokens`."""
    serve(fresh_prompts(pool, max(2, batch_cap), 16, 8, rng), batch_cap)  # warm-up (every slot), not kept
    block = prefix_block()
    prefill: list[dict[str, Any]] = []
    t = time.perf_counter()
    for p in prefill_lengths:
        for r in serve(fresh_prompts(pool, protocol.prefill_repeats, p, 1, rng), 1):
            if r.ok and r.ttft_ms is not None:
                prefill.append({"prompt_tokens": p, "ttft_s": r.ttft_ms / 1e3,
                                "engine_prompt_ms": engine_prompt_ms(r.index)})
    prefill_s = time.perf_counter() - t
    log("prefill TTFT: " + ", ".join(f"{s['prompt_tokens']} tokens {s['ttft_s'] * 1e3:.0f} ms" for s in prefill))
    decode: list[dict[str, Any]] = []
    gaps: list[tuple[int, int, float]] = []
    decoding_s: dict[int, float] = {}  # per concurrency: the longest its short waves took until all decoded
    waves = DecodePrompts(pool, rng, protocol.shared_prefix, copy, protocol.reuse_prompts)
    asked: dict[tuple[int, int], int] = {}  # (k, prompt tokens) -> the tokens out its waves asked
    t = time.perf_counter()
    for k in concurrencies(batch_cap):
        t_k = time.perf_counter()
        for p in decode_prompts:
            for _ in range(protocol.waves_at(k, long=p > min(decode_prompts))):
                tokens = protocol.wave_tokens(k, p, token_budget, waves.entry_tokens(k, p, block))
                asked[k, p] = tokens if room is None else min(tokens, room - p)
                results = serve(waves(k, p, asked[k, p]), k)
                wave = wave_gaps(results)
                gaps += wave
                decode += [dict(s, prompt_tokens=p) for s in decode_samples(wave)]
                if p == decode_prompts[0] and wave:
                    decoding_s[k] = max(decoding_s.get(k, 0.0), max(r.send_s + r.ttft_ms / 1e3 for r in results))
        kept = [g[2] for g in gaps if g[0] == k]
        log(f"decode at {k} sequences: {len(kept)} steps kept, median "
            f"{statistics.median(kept) * 1e3 if kept else float('nan'):.1f} ms ({time.perf_counter() - t_k:.1f} s)")
    decode_s = time.perf_counter() - t
    t = time.perf_counter()
    mixed = collect_mixed(serve, pool, batch_cap, prefill_lengths, decode_prompts, prefill, gaps, decoding_s, room,
                          rng, protocol, waves)
    log("mixed steps: " + (", ".join(f"{s['seqs']} decoding + {s['prompt_tokens']} prompt tokens "
                                     f"{s['step_s'] * 1e3:.0f} ms" for s in mixed) or "none"))
    notes = ([f"prompt copies into the engine's slots stopped ({waves.failed}): decode prompts prefilled in full"]
             if waves.failed else [])
    return {"prefill": prefill, "decode": decode, "gaps": gaps, "mixed": mixed, "notes": notes,
            "reused_tokens": waves.cache_served(block),
            "wave_tokens": [[k, p, n] for (k, p), n in asked.items()], "prefix_block": block,
            "cost_s": {"prefill": prefill_s, "decode": decode_s, "mixed": time.perf_counter() - t}}


def collect_mixed(serve: Callable[[list[Request], int | None], list[Any]], pool: list[int], batch_cap: int,
                  prefill_lengths: list[int], decode_prompts: list[int], prefill: list[dict[str, Any]],
                  gaps: list[tuple[int, int, float]], decoding_s: dict[int, float], room: int | None,
                  rng: random.Random, protocol: Protocol,
                  decodes: Callable[[int, int, int], list[Request]] | None = None) -> list[dict[str, Any]]:
    """Mixed waves (`mixed_wave`, sent open loop; `decodes`: the decode waves' kind of prompts, so the decodes start
    as those waves' did) at each of `mixed_seqs`, the prompt lengths in groups of `protocol.mixed_probes`, paced by
    what the short decode waves at the nearest concurrency at or above took (steps, time until all decoded) and by
    the prefill TTFTs measured before."""
    if not protocol.mixed or not gaps or not prefill or not decoding_s:
        return []
    median_ttft = {p: statistics.median(s["ttft_s"] for s in prefill if s["prompt_tokens"] == p)
                   for p in {s["prompt_tokens"] for s in prefill}}
    room = room if room is not None else max(prefill_lengths) + DECODE_TOKENS + max(decode_prompts)
    out: list[dict[str, Any]] = []
    for k in mixed_seqs(batch_cap):
        near = min((m for m in decoding_s if m >= k), default=max(decoding_s))
        # the short waves' step (the mixed decodes' prompts are theirs): the longer prompts' steps, slower, would
        # space the probes wider and leave the decodes too few tokens to outlast them
        short = [g[2] for g in gaps if g[0] == near and g[1] < near * max(decode_prompts)]
        step_s = statistics.median(short or [g[2] for g in gaps if g[0] == near])
        for i in range(0, len(prefill_lengths), protocol.mixed_probes):
            lengths = prefill_lengths[i:i + protocol.mixed_probes]
            # the probes start after 1.25x the decodes' measured entry; the decodes count their tokens from 0.75x it
            reqs = mixed_wave(pool, k, lengths, decoding_s[near] * 1.25, step_s,
                              lambda p: median_ttft.get(p, max(median_ttft.values())), room, rng, decodes,
                              protocol.mixed_gap_steps, entered_s=decoding_s[near] * 0.75,
                              decode_prompt=min(decode_prompts))
            out += mixed_steps(serve(reqs, None), k)
    return out
