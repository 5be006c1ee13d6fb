"""SGLang 0.5.23: `python -m sglang.launch_server` arguments.

Flags were checked against that release's own argument parser (tests/data/flags/sglang-0.5.23.txt).
"""

from __future__ import annotations

from tuner.config import TrialConfig
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
    bnb_prequantize,
    compute_dtype,
    engine_note,
    fmt_float,
    gptq_ref,
    hf_ref,
    memory_fraction,
    same_tokenizer_note,
    vocab_differs,
)
from tuner.export.script import BIN, Param, Serving, export_script, model_params

VERSION = "0.5.23"
ENGINE = f"SGLang {VERSION}"
# SGLang takes the key as --api-key only (server_args.py has no variable for it)
SERVING = Serving(port=30000, api_key_flag="--api-key")


def export(config: TrialConfig, ctx: Context | None = None) -> Export:
    ctx = ctx or Context()
    notes = [engine_note(ctx, ENGINE, same=False)]
    prepare: list[list[str]] = []
    draft = config.draft_spec
    dmodel = None
    q = config.quant

    model, note = gptq_ref(config.model, ctx) if q == "gptq-int4" else hf_ref(config.model, ctx)
    notes.append(note)
    args: list[str] = ["--dtype", compute_dtype(q)]
    if q in ("fp32", "bf16", "fp16"):
        notes.append(Note(MAPPED, "quant", f"{q} -> --dtype {compute_dtype(q)}"))
    elif q == "bnb-nf4":
        args += ["--quantization", "bitsandbytes", "--load-format", "bitsandbytes"]
        notes.append(Note(APPROX, "quant", "bnb-nf4 -> --quantization bitsandbytes --load-format bitsandbytes: "
                                           "SGLang quantizes in flight to NF4 like tuner, but also quantizes the "
                                           "absmax scales (nested quantization), which tuner did not"))
    elif q in ("bnb-int8", "bnb-fp4"):
        model, cmd = bnb_prequantize(model, q)
        prepare.append(cmd)
        args += ["--quantization", "bitsandbytes", "--load-format", "bitsandbytes"]
        notes.append(Note(MAPPED, "quant", f"{q} -> --quantization bitsandbytes --load-format bitsandbytes on a "
                                           "pre-quantized checkpoint: SGLang quantizes in flight only to NF4, so "
                                           f"the preparation step saves the model as tuner loads {q} into {model}"))
    elif q.startswith("torchao-"):
        notes.append(Note(DROPPED, "quant", f"{q}: SGLang {VERSION} has no torchao quantization, so the weights "
                                            "are served unquantized in bfloat16 (about 2x the memory of int8, 4x "
                                            "of int4); its int8/int4 methods (w8a8_int8, gptq, awq) need a "
                                            "checkpoint quantized for them"))
    else:  # gptq-int4
        args += ["--quantization", "gptq_marlin"]
        notes.append(Note(MAPPED, "quant", "gptq-int4 -> --quantization gptq_marlin on tuner's GPTQ checkpoint "
                                           "(4 bit, group 64); use gptq on GPUs without Marlin kernels"))

    args += ["--max-running-requests", str(config.batch_cap)]
    if draft.kind == "none":
        notes.append(Note(MAPPED, "batch_cap", f"{config.batch_cap} -> --max-running-requests {config.batch_cap}"))
        budget = config.batch_cap + EXTRA_BATCH_TOKENS
        args += ["--chunked-prefill-size", str(budget)]
        notes.append(Note(APPROX, "batch_cap", f"tuner's step budget max_batch_tokens = batch_cap + "
                                               f"{EXTRA_BATCH_TOKENS} -> --chunked-prefill-size {budget}: SGLang "
                                               "caps the prefill tokens of a step, tuner caps prefill + decode"))
        if config.device == "cpu":
            notes.append(Note(DROPPED, "kv_fraction", f"{config.kv_fraction:g}: no --mem-fraction-static with "
                                                      "--device cpu: the formula is a share of a GPU's memory "
                                                      f"(--gpu-memory-gib); SGLang {VERSION} on CPU sizes its KV "
                                                      "pool itself (cap it with --max-total-tokens)"))
        else:
            frac, why = memory_fraction(config, ctx, headroom=0.0)
            args += ["--mem-fraction-static", fmt_float(frac)]
            notes.append(Note(APPROX, "kv_fraction", f"{config.kv_fraction:g} -> --mem-fraction-static {frac:.2f}. "
                                                     "SGLang's static fraction covers weights + KV pool of the memory "
                                                     f"free at start (~ the whole GPU), activations live outside it: "
                                                     f"{why}"))
    else:
        notes.append(Note(MAPPED, "batch_cap", f"{config.batch_cap} -> --max-running-requests {config.batch_cap}: "
                                               f"tuner ran {config.batch_cap} batch-1 assisted decoders at once; "
                                               "SGLang batches them with speculative decoding"))
        notes.append(Note(DROPPED, "kv_fraction", "tuner measured this draft config with assisted generation, "
                                                  "whose per-request dynamic cache ignores the KV fraction, so no "
                                                  "--mem-fraction-static is set (SGLang's default applies)"))

    if draft.kind == "none":
        notes.append(Note(MAPPED, "draft", "none -> no --speculative-algorithm"))
    elif draft.kind == "ngram":
        k = draft.tokens
        args += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k + 1),
                 "--speculative-ngram-max-bfs-breadth", "1"]
        notes.append(Note(APPROX, "draft", f"ngram:{k} -> --speculative-algorithm NGRAM, "
                                           f"--speculative-num-draft-tokens {k + 1} (the verify tree counts its root, "
                                           "the last accepted token), --speculative-ngram-max-bfs-breadth 1 (one "
                                           "chain, like prompt lookup); SGLang's n-gram trie also matches text of "
                                           "earlier requests, transformers' prompt lookup only the current one"))
    elif draft.kind == "draft" and vocab_differs(config):
        notes.append(Note(DROPPED, "draft", f"{draft}: {same_tokenizer_note(config)}; SGLang refuses such a draft "
                                            "at start-up (standalone_worker_v2.py), so no --speculative-algorithm "
                                            "is set"))
    elif draft.kind == "draft":
        dmodel, dnote = hf_ref(draft.model or "", ctx, key="draft", knob="draft")
        k = draft.tokens
        if "--quantization" in args:
            args += ["--speculative-draft-model-quantization", "unquant"]
            notes.append(Note(MAPPED, "draft", "--speculative-draft-model-quantization unquant: SGLang's draft "
                                               "otherwise inherits the target's --quantization; tuner ran the "
                                               "assistant unquantized"))
        if "--load-format" in args:  # server_args.py: unset, the draft loads with the target's --load-format
            args += ["--speculative-draft-load-format", "auto"]
            notes.append(Note(MAPPED, "draft", "--speculative-draft-load-format auto: SGLang's draft otherwise "
                                               "loads with the target's --load-format bitsandbytes "
                                               "(speculative/draft_worker_common.py), which an unquantized "
                                               "checkpoint is not"))
        args += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", dmodel,
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
        notes.append(Note(MAPPED, "draft", f"{draft} -> --speculative-algorithm STANDALONE with draft {dmodel}: "
                                           f"{k} steps of top-1 proposals (--speculative-num-steps {k}, "
                                           f"--speculative-eagle-topk 1, --speculative-num-draft-tokens {k + 1})"))
        notes.append(dnote)
        notes.append(Note(APPROX, "draft", ADAPTIVE_DRAFT))
    else:
        notes.append(Note(DROPPED, "draft", f"{draft}: SGLang {VERSION} has no layer-skip self-speculation (its "
                                            "algorithms: EAGLE, EAGLE3, STANDALONE, NGRAM, FROZEN_KV_MTP, DFLASH, "
                                            "DSPARK, UNO), so no --speculative-algorithm is set"))

    if config.device in ("cpu", "cuda"):
        args += ["--device", config.device]
        notes.append(Note(MAPPED, "device", f"{config.device} -> --device {config.device}"))
    else:
        measured = (ctx.engine or {}).get("device") or "unrecorded"
        notes.append(Note(INFO, "device", f"auto (measured on {measured}): no --device, SGLang picks the "
                                          "accelerator it finds"))

    argv = ["python", "-m", "sglang.launch_server", "--model-path", model, *args]
    params = [Param("PYTHON", "python", f"the Python of an SGLang {VERSION} environment", BIN),
              *model_params(ctx, model, prepare, config.quant, dmodel if draft.kind == "draft" else None)]
    files = {"serve.sh": export_script(ENGINE, config, ctx, notes, argv, SERVING, params, prepare)}
    return Export("sglang", ENGINE, config, argv, {}, files, notes, prepare, ctx, tuple(params))
