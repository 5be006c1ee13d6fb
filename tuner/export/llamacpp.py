"""llama.cpp (ggml-org/llama.cpp@0c1e57098): `llama-server` arguments, plus the `llama-quantize` (and, for
checkpoint directories, `convert_hf_to_gguf.py`) commands that produce the GGUF type matching the format.

Flags were checked against that tree's generated server reference (tests/data/flags/llamacpp-0c1e57098.txt).
"""

from __future__ import annotations

from pathlib import PurePath

from tuner.config import TrialConfig
from tuner.errors import TunerError
from tuner.export.common import (
    ADAPTIVE_DRAFT,
    APPROX,
    DROPPED,
    EXTRA_BATCH_TOKENS,
    INFO,
    MAPPED,
    Context,
    Export,
    Note,
    engine_note,
    gguf_ref,
    is_alias,
    model_name,
    same_tokenizer_note,
    vocab_differs,
)
from tuner.export.script import BIN, DIR, FILE, OUTPUT, VALUE, Param, Serving, export_script

VERSION = "0c1e57098"
ENGINE = f"llama.cpp @{VERSION}"
SLOT_CTX = 4096  # context tokens per server slot (-c = slots x SLOT_CTX)

# Format -> GGUF type, and why that type is the closest one.
GGUF_TYPE = {"fp32": "F32", "bf16": "BF16", "fp16": "F16", "bnb-int8": "Q8_0", "torchao-int8wo": "Q8_0",
             "bnb-nf4": "IQ4_NL", "bnb-fp4": "IQ4_NL", "gptq-int4": "Q4_K_M", "torchao-int4wo": "Q4_K_M"}
WHY = {
    "fp32": "same float32 weights",
    "bf16": "same bfloat16 weights",
    "fp16": "same float16 weights",
    "bnb-int8": "8-bit absmax weights: Q8_0 scales blocks of 32, LLM.int8() rows (plus fp16 outlier columns); "
                "both are near-lossless",
    "torchao-int8wo": "int8 weight-only with symmetric scales: Q8_0 is symmetric int8 with a scale per block of 32 "
                      "(torchao: per output channel)",
    "bnb-nf4": "a non-linear 4-bit codebook with one scale per block: IQ4_NL (blocks of 32, 4.5 bits/weight) is "
               "GGUF's counterpart of NF4 (blocks of 64); Q4_0/Q4_K are uniform grids",
    "bnb-fp4": "GGUF has no dense FP4 type (MXFP4 only for MoE experts); FP4's non-uniform 4-bit grid is closest "
               "to IQ4_NL's non-linear codebook",
    "gptq-int4": "uniform 4-bit with per-group scales and zero points: Q4_K_M (4-bit k-quants with per-32 scales "
                 "and mins, a few sensitive tensors at 6 bits); add --imatrix from llama-imatrix for GPTQ-like "
                 "calibration",
    "torchao-int4wo": "uniform asymmetric 4-bit with group scales and zero points (group 128): Q4_K_M (4-bit "
                      "k-quants with per-32 scales and mins)",
}


def _gguf_for(model: str, ctx: Context, gtype: str, key: str,
              var: str) -> tuple[str, list[list[str]], str, list[Param]]:
    """The GGUF file to serve for `model` at `gtype`, the commands that make it, where it comes from, and serve.sh's
    parameters for them (`var` the source's, `var`_GGUF the made file's). A file tuner already made and served
    (ctx.paths["served_" + key]) is the one named; the script makes it again where it is missing."""
    out = ctx.paths.get(f"served_{key}") or f"{model_name(model)}-{gtype}.gguf"
    what = "the model" if var == "MODEL" else f"the draft {model}"
    made = Param(f"{var}_GGUF", out, f"{what} as GGUF {gtype}, made from {var} by the step below when missing "
                                     "(llama-quantize is deterministic: the same bytes as the measured file)",
                 OUTPUT, ctx.digests.get(f"served_{key}"), flag="-m" if var == "MODEL" else "-md")
    src = gguf_ref(model, ctx, key)
    if src:
        origin = (f"requantized from the alias's GGUF {src} (tuner also dequantized that file before applying the "
                  "format, so the lineage matches)" if is_alias(model) else f"requantized from {src}")
        return out, [["llama-quantize", "--allow-requantize", src, out, gtype]], origin, [
            Param(var, src, f"{what}'s GGUF file ({PurePath(src).name})", FILE, ctx.digests.get(key)), made]
    f32 = f"{model_name(model)}-F32.gguf"
    cmds = [["python", "convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", f32],
            ["llama-quantize", f32, out, gtype]]
    params = [Param(var, model, f"{what}'s checkpoint directory", DIR, ctx.digests.get(key.replace("gguf", "model"))),
              Param(f"{var}_F32", f32, f"{what} as float32 GGUF, made from {var} by the step below", OUTPUT), made]
    return out, cmds, f"converted from {model} with convert_hf_to_gguf.py, then quantized", params


def kv_ctx_tokens(config: TrialConfig, ctx: Context) -> tuple[int, str]:
    """The server's -c and why: the tokens resolved from the KV fraction when the trial was measured
    (tuner.engines.llamacpp.resolve_ctx_tokens), else SLOT_CTX per slot."""
    n = config.batch_cap
    if ctx.ctx_tokens:
        avail = f" ({ctx.available_gib:.1f} GiB available then)" if ctx.available_gib else ""
        return ctx.ctx_tokens, (f"{config.kv_fraction:g} -> -c {ctx.ctx_tokens} KV tokens in all ({ctx.ctx_tokens // n}"
                                f" per slot), as resolved on the measuring machine{avail}: fraction x available "
                                "memory / KV bytes per token, clamped to [256, the model's context] per slot")
    return n * SLOT_CTX, (f"{config.kv_fraction:g}: not resolved for this machine (no measurement); -c {n * SLOT_CTX}"
                          f" gives each of the {n} slots {SLOT_CTX} tokens")


UBATCH_LOGICAL = 2048  # llama-server's default -b
# llama-server keeps prompts in host RAM up to --cache-ram MiB beside the KV cache (0c1e57098's default 8192:
# common/arg.cpp `--cache-ram`, tools/server, ggml-org/llama.cpp PR 16391), memory -c's sizing from the KV
# fraction does not count: the engine (and so its export) turns it off
CACHE_RAM_MIB = 0
# llama-server reads the key from LLAMA_API_KEY when --api-key is not given, so it stays off the command line
SERVING = Serving(port=8080, api_key_env="LLAMA_API_KEY",
                  api_key_why="common/arg.cpp: --api-key ... set_env(LLAMA_API_KEY)")


def binaries(prepare: list[list[str]]) -> list[Param]:
    """serve.sh's binary parameters: llama-server, and the preparation steps' tools."""
    params = [Param("LLAMA_SERVER", "llama-server", f"llama.cpp's llama-server (build {VERSION})", BIN)]
    if any(cmd[0] == "llama-quantize" for cmd in prepare):
        params.append(Param("LLAMA_QUANTIZE", "llama-quantize", f"llama.cpp's llama-quantize (build {VERSION})",
                            BIN))
    if any(cmd[0] == "python" for cmd in prepare):
        params += [Param("PYTHON", "python", "a Python with llama.cpp's gguf-py requirements", BIN),
                   Param("CONVERT_HF_TO_GGUF", "convert_hf_to_gguf.py",
                         f"llama.cpp's convert_hf_to_gguf.py (source tree at {VERSION})", FILE)]
    return params


def export_native(config: TrialConfig, ctx: Context) -> Export:
    """A config of engine llamacpp: the argv tuner's llama.cpp engine launches (plus --host/--port), unchanged."""
    notes = [engine_note(ctx, ENGINE, same=True)]
    draft = config.draft_spec
    gtype = config.quant
    gguf, prepare, origin, params = _gguf_for(config.model, ctx, gtype, "gguf", "MODEL")
    notes.append(Note(MAPPED, "model", f"{config.model} -> -m {gguf}, {origin}"))
    notes.append(Note(MAPPED, "quant", f"{gtype} (llama-quantize {gtype})"))
    n = config.batch_cap
    c, why = kv_ctx_tokens(config, ctx)
    argv = ["llama-server", "-m", gguf, "-np", str(n), "-c", str(c), "--cache-ram", str(CACHE_RAM_MIB)]
    notes.append(Note(MAPPED, "batch_cap", f"{n} -> -np {n} (server slots decoded together)"))
    notes.append(Note(MAPPED, "kv_fraction", why))
    notes.append(Note(MAPPED, "kv_fraction", f"--cache-ram {CACHE_RAM_MIB}: no prompt cache in host RAM beside the "
                                             "KV cache (llama-server's default keeps up to 8192 MiB, which the KV "
                                             "fraction's -c does not count)"))
    if config.kv_type != "auto":
        argv += ["-ctk", config.kv_type, "-ctv", config.kv_type]
        notes.append(Note(MAPPED, "kv_type", f"{config.kv_type} -> -ctk/-ctv {config.kv_type}"))
    else:
        notes.append(Note(MAPPED, "kv_type", "auto -> llama-server's default KV type (f16)"))
    if draft.kind == "ngram":
        argv += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                 "--spec-ngram-simple-size-m", str(draft.tokens)]
        notes.append(Note(MAPPED, "draft", f"ngram:{draft.tokens} -> --spec-type ngram-simple, 2-gram lookup, "
                                           f"{draft.tokens} drafted tokens"))
    elif draft.kind == "draft":
        if vocab_differs(config):  # the server would refuse it at start-up: say so here, not there
            raise TunerError(f"draft {draft.model} for {config.model}: {same_tokenizer_note(config)}; llama-server "
                             "refuses such a draft at start-up (common/speculative.cpp, "
                             "common_speculative_are_compatible): expected a draft of the target's family")
        dgguf, dprep, dorigin, dparams = _gguf_for(draft.model or "", ctx, gtype, "draft_gguf", "DRAFT")
        prepare += dprep
        params += dparams
        argv += ["--spec-type", "draft-simple", "-md", dgguf, "--spec-draft-n-max", str(draft.tokens)]
        notes.append(Note(MAPPED, "draft", f"{draft} -> -md {dgguf} ({dorigin}), --spec-draft-n-max {draft.tokens}"))
    else:
        notes.append(Note(MAPPED, "draft", "none -> no --spec-type"))
    if config.threads:
        argv += ["-t", str(config.threads)]
        notes.append(Note(MAPPED, "threads", f"{config.threads} -> -t {config.threads}"))
    if config.ubatch:  # the logical batch (-b, default 2048) must hold the physical one
        argv += ["-ub", str(config.ubatch), "-b", str(max(UBATCH_LOGICAL, config.ubatch))]
        notes.append(Note(MAPPED, "ubatch", f"{config.ubatch} -> -ub {config.ubatch} -b "
                                            f"{max(UBATCH_LOGICAL, config.ubatch)} (tokens per prompt step)"))
    argv += ["-ngl", "0"] + (["-ngld", "0"] if draft.kind == "draft" else [])
    notes.append(Note(MAPPED, "device", "cpu -> -ngl 0 (no layer offloaded to a GPU)"))
    notes.append(Note(INFO, "serving", "tuner adds only --host 127.0.0.1 --port <free port> when it launches this"))
    if ctx.ctx_tokens:
        params.append(Param("CTX_TOKENS", str(c), "the KV cache in tokens (-c) as sized on the measuring machine "
                                                  "(kv_fraction above): size it for this machine's memory",
                            VALUE, flag="-c"))
    params = binaries(prepare) + params
    files = {"serve.sh": export_script(ENGINE, config, ctx, notes, argv, SERVING, params, prepare)}
    return Export("llamacpp", ENGINE, config, argv, {}, files, notes, prepare, ctx, tuple(params))


def export(config: TrialConfig, ctx: Context | None = None) -> Export:
    from tuner.engines.registry import backend

    ctx = ctx or Context()
    if backend(config.engine).export_to == "llamacpp":  # measured on llama.cpp itself: its own GGUF type and knobs
        return export_native(config, ctx)
    notes = [engine_note(ctx, ENGINE, same=False)]
    draft = config.draft_spec
    q = config.quant
    gtype = GGUF_TYPE[q]

    gguf, prepare, origin, params = _gguf_for(config.model, ctx, gtype, "gguf", "MODEL")
    notes.append(Note(MAPPED, "model", f"{config.model} -> -m {gguf}, {origin}"))
    notes.append(Note(MAPPED if q in ("fp32", "bf16", "fp16") else APPROX, "quant",
                      f"{q} -> GGUF {gtype} (llama-quantize {gtype}): {WHY[q]}"))

    n = config.batch_cap
    argv = ["llama-server", "-m", gguf, "-np", str(n), "-c", str(n * SLOT_CTX)]
    notes.append(Note(MAPPED, "batch_cap", f"{n} -> -np {n} (server slots decoded together)"))
    if draft.kind == "none":
        argv += ["-b", str(n + EXTRA_BATCH_TOKENS)]
        notes.append(Note(MAPPED, "batch_cap", f"tuner's step budget max_batch_tokens = batch_cap + "
                                               f"{EXTRA_BATCH_TOKENS} -> -b {n + EXTRA_BATCH_TOKENS} (tokens per "
                                               "decode call)"))
    kv_type = "f32" if q == "fp32" else "f16"
    argv += ["-ctk", kv_type, "-ctv", kv_type]
    if q in ("fp32", "fp16"):
        notes.append(Note(MAPPED, "quant", f"KV cache -> -ctk/-ctv {kv_type} (the compute dtype tuner used)"))
    else:
        notes.append(Note(APPROX, "quant", "KV cache -> -ctk/-ctv f16: tuner kept it in bfloat16; f16 is "
                                           "llama.cpp's default with the widest backend support, same 2 bytes per "
                                           "value"))
    notes.append(Note(DROPPED, "kv_fraction", f"{config.kv_fraction:g}: llama.cpp sizes its KV cache in tokens, "
                                              f"not as a share of memory; -c {n * SLOT_CTX} gives each of the {n} "
                                              f"slots {SLOT_CTX} tokens (lower -c to use less memory)"))

    if draft.kind == "none":
        notes.append(Note(MAPPED, "draft", "none -> no --spec-type"))
    elif draft.kind == "ngram":
        argv += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                 "--spec-ngram-simple-size-m", str(draft.tokens)]
        notes.append(Note(APPROX, "draft", f"ngram:{draft.tokens} -> --spec-type ngram-simple, lookup 2-gram "
                                           f"(--spec-ngram-simple-size-n 2), {draft.tokens} drafted tokens "
                                           f"(--spec-ngram-simple-size-m {draft.tokens}); transformers' prompt "
                                           "lookup also falls back to 1-grams"))
    elif draft.kind == "draft" and vocab_differs(config):
        notes.append(Note(DROPPED, "draft", f"{draft}: {same_tokenizer_note(config)}; llama.cpp refuses such a "
                                            "draft at start-up (common/speculative.cpp), so no -md is set"))
    elif draft.kind == "draft":
        dtype = "F32" if q == "fp32" else "BF16"  # tuner loads the assistant unquantized at the compute dtype
        dgguf, dprep, dorigin, dparams = _gguf_for(draft.model or "", ctx, dtype, "draft_gguf", "DRAFT")
        prepare += dprep
        params += dparams
        argv += ["--spec-type", "draft-simple", "-md", dgguf, "--spec-draft-n-max", str(draft.tokens)]
        notes.append(Note(MAPPED, "draft", f"{draft} -> --spec-type draft-simple -md {dgguf} "
                                           f"--spec-draft-n-max {draft.tokens}; the draft is {dorigin}, as {dtype} "
                                           "(tuner runs the assistant unquantized at the compute dtype)"))
        notes.append(Note(APPROX, "draft", ADAPTIVE_DRAFT))
    else:
        notes.append(Note(DROPPED, "draft", f"{draft}: llama.cpp has no layer-skip self-speculation, so no "
                                            "--spec-type is set"))

    if config.device == "cpu":
        argv += ["-ngl", "0"] + (["-ngld", "0"] if draft.kind == "draft" else [])
        notes.append(Note(MAPPED, "device", "cpu -> -ngl 0 (no layer offloaded to a GPU)"))
    elif config.device == "cuda":
        argv += ["-ngl", "all"] + (["-ngld", "all"] if draft.kind == "draft" else [])
        notes.append(Note(MAPPED, "device", "cuda -> -ngl all (every layer on the GPU; needs a CUDA build)"))
    else:
        measured = (ctx.engine or {}).get("device") or "unrecorded"
        notes.append(Note(INFO, "device", f"auto (measured on {measured}): -ngl left at its default (auto: "
                                          "offload what fits to the GPU of a GPU build)"))

    params = binaries(prepare) + params
    files = {"serve.sh": export_script(ENGINE, config, ctx, notes, argv, SERVING, params, prepare)}
    return Export("llamacpp", ENGINE, config, argv, {}, files, notes, prepare, ctx, tuple(params))
