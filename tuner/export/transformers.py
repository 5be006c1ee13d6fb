"""transformers 5.24.0, the engine tuner measures with: a runnable Python file that loads the model the way tuner
does and generates with the same continuous-batching (or assisted-generation) settings, plus the matching
`transformers serve` command line for the knobs its flags cover.

The serve flags were checked against the installed package (transformers/cli/serve.py).
"""

from __future__ import annotations

from tuner.config import TrialConfig
from tuner.export.common import (
    APPROX,
    DROPPED,
    EXTRA_BATCH_TOKENS,
    INFO,
    MAPPED,
    Context,
    Export,
    Note,
    compute_dtype,
    engine_label,
    engine_note,
    gptq_ref,
    header_lines,
    hf_ref,
)
from tuner.export.script import BIN, Param, Serving, export_script, model_params

VERSION = "5.24.0"
ENGINE = f"transformers {VERSION}"
SCRIPT = "serve_trial.py"
SERVING = Serving(port=8000)  # transformers serve has no API key option


def engine_notes(ctx: Context) -> list[Note]:
    eng = ctx.engine or {}
    where = engine_label(ctx.engine)
    if not eng:
        return [engine_note(ctx, ENGINE, same=False)]
    if not str(eng.get("name", "")).startswith("transformers"):
        return [Note(INFO, "engine", f"figures were measured on {where}; {ENGINE} is a different engine, so its "
                                     "latency and throughput will differ: re-measure before relying on them")]
    measured = (eng.get("versions") or {}).get("transformers")
    if measured and measured != VERSION:
        return [Note(INFO, "engine", f"figures were measured on {where}; this export targets {ENGINE}: "
                                     "another version of the same engine, re-measure before relying on them")]
    return [Note(MAPPED, "engine", f"figures were measured on {where}, the engine and version this export targets")]


def export(config: TrialConfig, ctx: Context | None = None) -> Export:
    ctx = ctx or Context()
    notes = engine_notes(ctx)
    draft = config.draft_spec
    q = config.quant
    dtype = compute_dtype(q)

    model, note = gptq_ref(config.model, ctx) if q == "gptq-int4" else hf_ref(config.model, ctx)
    notes.append(note)
    serve = ["transformers", "serve", model, "--device", config.device, "--dtype", dtype]
    notes.append(Note(MAPPED, "device", f"{config.device} -> DEVICE in {SCRIPT}, --device {config.device}"))

    # quantization
    script_q = {"fp32": f"dtype {dtype}", "bf16": f"dtype {dtype}", "fp16": f"dtype {dtype}",
                "bnb-int8": "BitsAndBytesConfig(load_in_8bit=True)",
                "bnb-nf4": "BitsAndBytesConfig(load_in_4bit=True, nf4, bf16 compute)",
                "bnb-fp4": "BitsAndBytesConfig(load_in_4bit=True, fp4, bf16 compute)",
                "torchao-int8wo": "TorchAoConfig(Int8WeightOnlyConfig())",
                "torchao-int4wo": "TorchAoConfig(Int4WeightOnlyConfig())",
                "gptq-int4": "GPTQModel.load of tuner's GPTQ checkpoint"}[q]
    notes.append(Note(MAPPED, "quant", f"{q} -> {SCRIPT}: {script_q}, as tuner loads it"))
    if q == "bnb-int8":
        serve += ["--quantization", "bnb-8bit"]
        notes.append(Note(MAPPED, "quant", "bnb-int8 -> transformers serve --quantization bnb-8bit"))
    elif q == "bnb-nf4":
        serve += ["--quantization", "bnb-4bit"]
        notes.append(Note(APPROX, "quant", "bnb-nf4 -> transformers serve --quantization bnb-4bit: NF4 with "
                                           "nested quantization and bitsandbytes' default compute dtype, tuner used "
                                           "no nesting and bfloat16 compute"))
    elif q in ("bnb-fp4", "torchao-int8wo", "torchao-int4wo"):
        notes.append(Note(DROPPED, "quant", f"{q}: transformers serve --quantization offers only bnb-4bit (NF4) "
                                            f"and bnb-8bit, so the serve command loads unquantized {dtype} weights; "
                                            f"{SCRIPT} carries it"))
    elif q == "gptq-int4":
        notes.append(Note(MAPPED, "quant", "gptq-int4 -> transformers serve loads the GPTQ checkpoint directory "
                                           "quantized (its config.json carries the quantization config)"))
    else:
        notes.append(Note(MAPPED, "quant", f"{q} -> transformers serve --dtype {dtype}"))

    n = config.batch_cap
    if draft.kind == "none":
        budget = n + EXTRA_BATCH_TOKENS
        serve += ["--continuous-batching", "--cb-max-batch-tokens", str(budget),
                  "--cb-max-memory-percent", repr(config.kv_fraction)]
        notes.append(Note(MAPPED, "batch_cap", f"{n} -> ContinuousBatchingConfig(max_requests_per_batch={n}, "
                                               f"max_batch_tokens={budget}) in {SCRIPT}"))
        notes.append(Note(DROPPED, "batch_cap", "transformers serve has no flag for max_requests_per_batch; "
                                                f"--cb-max-batch-tokens {budget} carries the step budget only "
                                                f"(use {SCRIPT} for the cap)"))
        notes.append(Note(MAPPED, "kv_fraction", f"{config.kv_fraction:g} -> max_memory_percent in {SCRIPT}, "
                                                 f"--cb-max-memory-percent {config.kv_fraction!r}"))
        notes.append(Note(MAPPED, "draft", "none -> continuous batching, no assisted generation"))
    else:
        notes.append(Note(MAPPED, "batch_cap", f"{n} -> {n} batch-1 assisted decoders in threads sharing the "
                                               f"weights ({SCRIPT}), as tuner serves draft configs"))
        notes.append(Note(DROPPED, "batch_cap", "transformers serve runs assisted generation without continuous "
                                                "batching, so the serve command has no concurrency cap"))
        notes.append(Note(INFO, "kv_fraction", f"{config.kv_fraction:g}: not used by assisted generation "
                                               "(per-request dynamic cache), as in tuner's measurement"))
        gen = {"ngram": f'{{"prompt_lookup_num_tokens": {draft.tokens}}}',
               "early-exit": f'{{"assistant_early_exit": {draft.tokens}}}'}.get(draft.kind)
        what = {"ngram": f"prompt_lookup_num_tokens={draft.tokens}",
                "early-exit": f"assistant_early_exit={draft.tokens}",
                "draft": f"assistant_model={draft.model}, num_assistant_tokens={draft.tokens} (constant schedule)"}
        notes.append(Note(MAPPED, "draft", f"{draft} -> GenerationConfig {what[draft.kind]} in {SCRIPT}"))
        if gen:
            notes.append(Note(DROPPED, "draft", f"transformers serve has no flag for {draft}; send it per request "
                                                f"as the body field generation_config = '{gen}'"))
        else:
            notes.append(Note(DROPPED, "draft", f"transformers serve cannot load an assistant model: {draft} "
                                                f"runs through {SCRIPT} only"))

    argv = serve
    script = _script(config, ctx, notes, model)
    params = [Param("TRANSFORMERS", "transformers", f"the `transformers` command of transformers {VERSION} (with "
                                                    "its serving extras)", BIN), *model_params(ctx, model, [], q, None)]
    files = {SCRIPT: script, "serve.sh": export_script(ENGINE, config, ctx, notes, argv, SERVING, params)}
    return Export("transformers", ENGINE, config, argv, {}, files, notes, [], ctx, tuple(params))


# ------------------------------------------------------------------------------------------------- script --- #
def _script(config: TrialConfig, ctx: Context, notes: list[Note], model: str) -> str:
    q = config.quant
    draft = config.draft_spec
    head = header_lines(ENGINE, config, ctx, notes)
    doc = "\n".join(head).replace("\\", "\\\\").replace('"""', "'''")
    device = ('"cuda" if torch.cuda.is_available() else "cpu"' if config.device == "auto"
              else repr(config.device))
    imports = ["AutoModelForCausalLM", "AutoTokenizer", "GenerationConfig"]
    if draft.kind == "none":
        imports.append("ContinuousBatchingConfig")
    quant_lines: list[str] = []
    if q.startswith("bnb-"):
        imports.append("BitsAndBytesConfig")
        if q == "bnb-int8":
            quant_lines.append("QUANTIZATION = BitsAndBytesConfig(load_in_8bit=True)")
        else:
            quant_lines.append(f"QUANTIZATION = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="
                               f"{q[4:]!r}, bnb_4bit_compute_dtype=torch.bfloat16)")
    elif q.startswith("torchao-"):
        imports.append("TorchAoConfig")
        cls = "Int8WeightOnlyConfig" if q == "torchao-int8wo" else "Int4WeightOnlyConfig"
        quant_lines += [f"from torchao.quantization import {cls}", "",
                        f"QUANTIZATION = TorchAoConfig({cls}())"]
    else:
        quant_lines.append("QUANTIZATION = None")
    torch_dtype = {"float32": "torch.float32", "float16": "torch.float16"}.get(compute_dtype(q), "torch.bfloat16")

    lines = [
        "#!/usr/bin/env python",
        f'"""{doc}',
        "",
        f"Run: python {SCRIPT} 'prompt one' 'prompt two' ...",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import os",
        "import sys",
        "",
        "import torch",
        f"from transformers import {', '.join(sorted(imports))}",
        "",
        *quant_lines,
        f"MODEL = os.environ.get('MODEL', {model!r})  # a checkpoint directory or a Hugging Face repository",
        f"DEVICE = {device}",
        f"DTYPE = {torch_dtype}",
        f"BATCH_CAP = {config.batch_cap}",
        "MAX_NEW_TOKENS = 128",
        "",
        "",
        "def load_tokenizer(path: str):",
        "    tok = AutoTokenizer.from_pretrained(path)",
        "    if tok.pad_token_id is None:",
        "        tok.pad_token = tok.eos_token",
        "    return tok",
        "",
        "",
    ]
    if q == "gptq-int4":
        lines += [
            "def load_model():",
            "    from gptqmodel import BACKEND, GPTQModel  # the GPTQ checkpoint was written by GPTQModel",
            "",
            '    backend = BACKEND.AUTO if DEVICE == "cuda" else BACKEND.GPTQ_TORCH_INT8',
            "    return GPTQModel.load(MODEL, backend=backend, device=DEVICE).model.eval()",
        ]
    else:
        lines += [
            "def load_model():",
            "    if QUANTIZATION is None:",
            "        return AutoModelForCausalLM.from_pretrained(MODEL, dtype=DTYPE).to(DEVICE).eval()",
            "    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=DTYPE, quantization_config=QUANTIZATION,",
            "                                                device_map=DEVICE).eval()",
        ]
    lines += ["", ""]
    if draft.kind == "none":
        budget = config.batch_cap + EXTRA_BATCH_TOKENS
        lines += [
            "def main(prompts: list[str]) -> None:",
            "    model, tok = load_model(), load_tokenizer(MODEL)",
            "    cb = ContinuousBatchingConfig(",
            "        max_requests_per_batch=BATCH_CAP,  # batch cap: sequences running at once",
            f"        max_batch_tokens=BATCH_CAP + {EXTRA_BATCH_TOKENS},  # = {budget} tokens per step",
            f"        max_memory_percent={config.kv_fraction!r},  # KV fraction of the memory free after the weights",
            "    )",
            "    gen = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tok.eos_token_id,",
            "                           pad_token_id=tok.pad_token_id)",
            '    inputs = [tok(p)["input_ids"] for p in prompts]',
            "    outputs = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb)",
            "    for out in sorted(outputs.values(), key=lambda o: o.request_id):",
            "        print(tok.decode(out.generated_tokens, skip_special_tokens=True))",
        ]
    else:
        if draft.kind == "ngram":
            gen_kw = f"prompt_lookup_num_tokens={draft.tokens}"
        elif draft.kind == "early-exit":
            gen_kw = f"assistant_early_exit={draft.tokens}"
        else:
            gen_kw = f'num_assistant_tokens={draft.tokens}, num_assistant_tokens_schedule="constant"'
        assist = []
        if draft.kind == "draft":
            dmodel, _ = hf_ref(draft.model or "", ctx, key="draft", knob="draft")
            assist = [
                f"    # assistant {draft.model}: unquantized at the compute dtype, as tuner loads it",
                f"    assistant = AutoModelForCausalLM.from_pretrained({dmodel!r}, dtype=DTYPE).to(DEVICE).eval()",
                f"    assistant_tok = load_tokenizer({dmodel!r})",
                "    extra = {'assistant_model': assistant}",
                "    if assistant_tok.get_vocab() != tok.get_vocab():  # universal assisted decoding",
                "        extra.update(tokenizer=tok, assistant_tokenizer=assistant_tok)",
            ]
        else:
            assist = ["    extra = {}"]
        lines += [
            "def main(prompts: list[str]) -> None:",
            "    from concurrent.futures import ThreadPoolExecutor",
            "",
            "    model, tok = load_model(), load_tokenizer(MODEL)",
            *assist,
            "    gen = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tok.eos_token_id,",
            f"                           pad_token_id=tok.pad_token_id, {gen_kw})",
            "",
            "    def one(prompt: str) -> str:  # assisted generation runs at batch 1",
            '        x = tok(prompt, return_tensors="pt").input_ids.to(model.device)',
            "        with torch.inference_mode():",
            "            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen, **extra)",
            "        return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)",
            "",
            "    with ThreadPoolExecutor(BATCH_CAP) as pool:  # batch cap: decoders running at once",
            "        for text in pool.map(one, prompts):",
            "            print(text)",
        ]
    lines += [
        "",
        "",
        'if __name__ == "__main__":',
        '    main(sys.argv[1:] or ["The capital of France is"])',
    ]
    return "\n".join(lines) + "\n"
