"""Text Generation Inference (TGI) v3.3.7: `text-generation-launcher` arguments and the same settings as
environment variables (for `docker run --env-file`).

Flags and variables were checked against the launcher reference of that tag (tests/data/flags/tgi-3.3.7*.txt).
"""

from __future__ import annotations

import math

from tuner.config import TrialConfig
from tuner.export.common import (
    ACTIVATION_HEADROOM,
    APPROX,
    DROPPED,
    EXTRA_BATCH_TOKENS,
    INFO,
    MAPPED,
    Context,
    Export,
    Note,
    comment,
    engine_note,
    fmt_float,
    gptq_ref,
    header_lines,
    hf_ref,
    memory_fraction,
)
from tuner.export.script import BIN, Param, Serving, export_script, model_params

VERSION = "3.3.7"
ENGINE = f"TGI {VERSION}"
IMAGE = f"ghcr.io/huggingface/text-generation-inference:{VERSION}"
QUANTIZE = {"bnb-int8": "bitsandbytes", "bnb-nf4": "bitsandbytes-nf4", "bnb-fp4": "bitsandbytes-fp4",
            "gptq-int4": "gptq"}
DTYPE = {"bf16": "bfloat16", "fp16": "float16"}
TGI_SAFETY = 0.90  # TGI uses cuda_memory_fraction x 0.90 of the device
# the launcher reads the key from API_KEY (clap `env`, launcher/src/main.rs) and its address from --hostname
SERVING = Serving(port=3000, host_flag="--hostname", api_key_env="API_KEY",
                  api_key_why="launcher/src/main.rs: api_key, #[clap(long, env)]")


def env_name(flag: str) -> str:
    """--max-batch-size -> MAX_BATCH_SIZE (the launcher's clap `env` naming)."""
    return flag.lstrip("-").replace("-", "_").upper()


def export(config: TrialConfig, ctx: Context | None = None) -> Export:
    ctx = ctx or Context()
    notes = [engine_note(ctx, ENGINE, same=False)]
    draft = config.draft_spec
    q = config.quant

    model, note = gptq_ref(config.model, ctx) if q == "gptq-int4" else hf_ref(config.model, ctx)
    notes.append(note)
    opts: list[tuple[str, str]] = [("--model-id", model)]
    if q in DTYPE:
        opts.append(("--dtype", DTYPE[q]))
        notes.append(Note(MAPPED, "quant", f"{q} -> --dtype {DTYPE[q]}"))
    elif q == "fp32":
        notes.append(Note(DROPPED, "quant", "fp32: TGI serves float16 or bfloat16 only (--dtype), so no dtype is "
                                            "forced and TGI loads the model in its half-precision default"))
    elif q == "gptq-int4":
        opts.append(("--quantize", "gptq"))
        notes.append(Note(MAPPED, "quant", "gptq-int4 -> --quantize gptq on tuner's GPTQ checkpoint (4 bit, "
                                           "group 64); TGI picks exllama/Marlin kernels itself"))
    elif q in QUANTIZE:
        opts += [("--quantize", QUANTIZE[q]), ("--dtype", "bfloat16")]
        notes.append(Note(MAPPED, "quant", f"{q} -> --quantize {QUANTIZE[q]} --dtype bfloat16 (quantized in flight "
                                           "like tuner, computing in bfloat16 as tuner did; TGI accepts --dtype "
                                           "with the bitsandbytes methods)"))
    else:
        notes.append(Note(DROPPED, "quant", f"{q}: TGI has no torchao quantization, so the weights are served "
                                            "unquantized (half precision); the nearest TGI option, --quantize eetq "
                                            "(8-bit weight-only), is a different kernel and format and is not "
                                            "substituted"))

    opts += [("--max-concurrent-requests", str(config.batch_cap)), ("--max-batch-size", str(config.batch_cap))]
    notes.append(Note(APPROX, "batch_cap", f"{config.batch_cap} -> --max-concurrent-requests {config.batch_cap}: "
                                           "the only hard cap on in-flight requests in TGI, but requests past it are "
                                           "rejected (HTTP 429) where tuner queued them"))
    notes.append(Note(APPROX, "batch_cap", f"{config.batch_cap} -> --max-batch-size {config.batch_cap}: caps the "
                                           "running batch, but TGI v3 ignores it for models served with chunked "
                                           "prefill (most flash-attention models on CUDA)"))
    if draft.kind == "none":
        budget = config.batch_cap + EXTRA_BATCH_TOKENS
        opts.append(("--max-batch-prefill-tokens", str(budget)))
        notes.append(Note(APPROX, "batch_cap", f"tuner's step budget max_batch_tokens = batch_cap + "
                                               f"{EXTRA_BATCH_TOKENS} -> --max-batch-prefill-tokens {budget}: TGI caps "
                                               "the prefill tokens of a batch, tuner caps prefill + decode. The router "
                                               "requires it >= --max-input-tokens only for a model served without "
                                               "chunked prefill (backends/v3/src/main.rs: `max_input_tokens > "
                                               "max_batch_prefill_tokens && !support_chunking`); flash-attention "
                                               "models on CUDA chunk"))
        share, why = memory_fraction(config, ctx, ACTIVATION_HEADROOM)
        frac = min(1.0, math.ceil(round(share / TGI_SAFETY * 100, 6)) / 100)
        opts.append(("--cuda-memory-fraction", fmt_float(frac)))
        notes.append(Note(APPROX, "kv_fraction", f"{config.kv_fraction:g} -> --cuda-memory-fraction {frac:.2f} = "
                                                 f"{share:.2f} / {TGI_SAFETY} (TGI multiplies the flag by a "
                                                 f"{TGI_SAFETY} safety factor). TGI caps the process at that share "
                                                 "of TOTAL GPU memory and fills what weights and warm-up leave with "
                                                 "KV cache: " + why))
    else:
        notes.append(Note(DROPPED, "kv_fraction", "tuner measured this draft config with assisted generation, "
                                                  "whose per-request dynamic cache ignores the KV fraction, so no "
                                                  "--cuda-memory-fraction is set (TGI's default 1.0 applies)"))

    if draft.kind == "none":
        notes.append(Note(MAPPED, "draft", "none -> no --speculate"))
    elif draft.kind == "ngram":
        opts.append(("--speculate", str(draft.tokens)))
        notes.append(Note(APPROX, "draft", f"ngram:{draft.tokens} -> --speculate {draft.tokens}: TGI's n-gram "
                                           "speculation (for models without Medusa heads) proposes the tokens that "
                                           "followed the first earlier occurrence of the last token, transformers' "
                                           "prompt lookup matches the last 2-gram, then 1-gram"))
    elif draft.kind == "draft":
        notes.append(Note(DROPPED, "draft", f"{draft}: TGI has no separate draft model (it speculates with "
                                            "n-grams or with Medusa/MLP-speculator heads stored in the checkpoint), "
                                            "so no --speculate is set"))
    else:
        notes.append(Note(DROPPED, "draft", f"{draft}: TGI has no layer-skip self-speculation, so no --speculate "
                                            "is set"))

    measured = (ctx.engine or {}).get("device") or config.device
    notes.append(Note(INFO, "device", f"{config.device} (measured on {measured}): TGI has no device flag; the "
                                      f"image decides ({IMAGE} is the CUDA build)"))

    argv = ["text-generation-launcher"]
    for flag, value in opts:
        argv += [flag, value]
    env = {env_name(flag): value for flag, value in opts}
    head = header_lines(ENGINE, config, ctx, notes)
    env_text = comment(head + ["", "Use: docker run --gpus all --shm-size 1g -p 8080:80 -v $PWD:/data "
                               f"--env-file tgi.env {IMAGE}",
                               "(a local --model-id must be a path inside the container, e.g. under /data)"])
    env_text += "".join(f"{k}={v}\n" for k, v in env.items())
    params = [Param("TGI_LAUNCHER", "text-generation-launcher", f"TGI {VERSION}'s text-generation-launcher", BIN),
              *model_params(ctx, model, [], q, None)]
    files = {"serve.sh": export_script(ENGINE, config, ctx, notes, argv, SERVING, params), "tgi.env": env_text}
    return Export("tgi", ENGINE, config, argv, env, files, notes, [], ctx, tuple(params))
