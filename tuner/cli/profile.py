"""`tuner profile`: measure an engine's step times on this host (decode against running sequences and context,
prefill against prompt tokens), fitted to the step model `tuner predict` simulates (tuner.predict.profile)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tuner.cli.common import add_config_args, check_output_path, config_from_args, write_json_atomic


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure an engine's step times on this host (for tuner predict)",
                       description="Start the engine for the configuration (at --batch-cap server slots), measure "
                                   "decode step time against running sequences and context, and prefill time against "
                                   "prompt tokens; fit the step model and cache it under $TUNER_CACHE/profiles, keyed "
                                   "by engine build, model hash, format and host. Engines with a profile so far: "
                                   "llama.cpp, transformers (continuous batching) and vLLM; a configuration with a "
                                   "draft is not profiled.")
    add_config_args(p)
    p.add_argument("--refresh", action="store_true", help="measure again even when a profile is cached")
    p.add_argument("--json", metavar="FILE", help="also write the profile to FILE")


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from tuner.predict.profile import load_or_measure, side

    side(config)  # an engine without a profile, or a draft: one line, before anything starts
    out_path = check_output_path(args.json)

    profile = load_or_measure(config, config.batch_cap, refresh=args.refresh,
                              log=lambda s: print(s, file=sys.stderr))
    print(format_profile(profile))
    if out_path:
        write_json_atomic(out_path, profile)
    return 0


def format_profile(p: dict[str, Any]) -> str:
    m, fit, key = p["fit"]["model"], p["fit"], p["key"]
    cost = p.get("cost_s") or {}
    lines = [f"profile {p['id']} ({'cached' if p.get('cached') else 'measured now'}): {p.get('path')}",
             f"  {key['engine']} {spoken(key['build'])}, model {spoken(key['model'])}, {spoken(key['format'])}, host "
             f"{key['host']['cpu_model']} x{key['host']['cores']}",
             f"  measured {p.get('measured_at')}" + (f" (fitted again {p['fitted_at']})" if p.get("fitted_at") else "")
             + f" at batch cap {p['batch_cap']} (sequences {p['concurrencies']}"
             + ("; decode prompts sharing a prefix per length, "
                + ("copied into the slots" if key["engine"] == "llamacpp" else "served by the engine's prefix cache")
                if (p.get("protocol") or {}).get("shared_prefix") else "")
             + (f"; one decode wave per length from {wide} sequences"
                if (wide := (p.get("protocol") or {}).get("one_wave_from")) and wide <= p["batch_cap"] else "")
             + (f"; each {steps} steps past its prompts' entry"
                if (steps := (p.get("protocol") or {}).get("decode_steps")) else "")
             + (f"; long prompts up to {top} sequences, the context slope above taken from there"
                if (top := (p.get("protocol") or {}).get("long_waves_to")) and top < p["batch_cap"] else "")
             + f") in "
             f"{cost.get('total', 0):.0f} s (startup {cost.get('startup', 0):.0f}, prefill {cost.get('prefill', 0):.0f}, "
             f"decode {cost.get('decode', 0):.0f}, mixed {cost.get('mixed', 0):.0f})",
             "  decode step = " + (", ".join(f"{t * 1e3:.1f} ms at {k}" for k, t in m["decode_by_batch_s"]) + " sequences"
                                   if m.get("decode_by_batch_s") else f"{m['decode_base_s'] * 1e3:.2f} ms + "
                                   f"{m['decode_per_seq_s'] * 1e3:.3f} ms/sequence")
             + (" + " + ", ".join(f"{c * 1e6:.3f} us/context token at {k}" for k, c in m["decode_ctx_by_batch_s"])
                + f" (a slope per batch size: one shared slope rejected, p = {fit['context_slope']['shared_slope_p']:.1g})"
                if m.get("decode_ctx_by_batch_s") else f" + {m['decode_per_context_token_s'] * 1e6:.3f} us/context token")
             + f" (RMSE {fit['decode']['rmse_s'] * 1e3:.2f} "
             f"ms, {fit['decode']['relative_rmse']:.0%}, n={fit['decode']['n']}); step noise sigma "
             f"{m['noise_sigma']:.2f}",
             f"  prefill alone = {(m['decode_base_s'] + m['prefill_base_s']) * 1e3:.1f} ms + "
             f"{m['prefill_per_token_s'] * 1e3:.3f} ms/prompt token + "
             f"{m.get('prefill_per_token_sq_s', 0.0) * 1e6:.3f} us/prompt token^2 (RMSE {fit['prefill']['rmse_s'] * 1e3:.1f} ms, "
             f"{fit['prefill']['relative_rmse']:.0%}, n={fit['prefill']['n']})"]
    if m.get("mixed"):
        mixed = fit["mixed"]
        lines.append(f"  a prompt joining running decodes adds {m['mixed_base_s'] * 1e3:.1f} ms + "
                     f"{m['mixed_per_token_s'] * 1e3:.3f} ms/prompt token + "
                     f"{m.get('mixed_per_token_sq_s', 0.0) * 1e6:.3f} us/prompt token^2 to their step (RMSE "
                     f"{mixed['rmse_s'] * 1e3:.1f} ms, n={mixed['n']})")
    kv = (p.get("engine") or {}).get("kv")
    if kv:
        lines.append(f"  KV cache the engine allocated: {kv['num_blocks']} blocks x {kv['block_tokens']} tokens = "
                     f"{kv['tokens']} tokens")
    budget = (p.get("engine") or {}).get("max_num_batched_tokens")
    if budget:
        lines.append(f"  step budget the engine reported: max_num_batched_tokens {budget} (chunked prefill "
                     f"{'on' if p['engine'].get('chunked_prefill') else 'off'})")
    lines.extend(f"  note: {n}" for n in p.get("notes") or [])
    return "\n".join(lines)


def spoken(fields: dict[str, Any]) -> str:
    """'name smollm2-135m, quant fp32': a key part's fields in words."""
    return ", ".join(f"{k} {v}" for k, v in fields.items())
