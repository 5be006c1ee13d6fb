"""Quality of what a running endpoint serves (engine endpoint: a server tuner did not launch), scored through it.

* Tasks: lm-eval's own `local-completions` model against `{URL}/v1/completions` (prompt log-probs with `echo`,
  token-id prompts, the API key from $TUNER_API_KEY as a header), on the `evals/` tasks with the same items, seed and
  metrics as every other path, so tuner.quality.gate's paired comparison and gate apply unchanged. An endpoint that does
  not return prompt log-probs (llama-server, chat-only APIs) cannot be scored this way: said in one line.
* Baseline: the fp32 model named by `--model` (its tokenizer is the workload's too), scored by the transformers path
  on the same items: the endpoint is judged against the full-precision weights it claims to serve.
* KLD (approximation, as tuner.quality.vllm): the endpoint's top-K prompt log-probs against the top-K of the fp32
  reference distributions (tuner.quality.kld's stored reference), on the same held text and positions.
* Not cached (its plan has no key): the server behind a URL can change between two calls. Its fp32 baseline is
  (the transformers entry, found or written by the same template).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from tuner.config import TrialConfig
from tuner.errors import TunerError, UnsupportedConfig, one_line
from tuner.quality.common import BASELINE, library_versions
from tuner.quality.kld import LP_STEP, KLDResult
from tuner.quality.template import Plan
from tuner.quality.vllm import TOP_K, endpoint_suite, prompt_topk, served_topk, topk_kld
from tuner.quality.vllm import screen_kld as screen_kld  # the top-K KLD comes with the scoring, as on vLLM


def reference_topk(codes: np.ndarray, k: int = TOP_K) -> list[dict[int, float]]:
    """The top-k log-probs of every stored reference distribution (16-bit grid codes, lower = more likely)."""
    idx = np.argpartition(codes, k, axis=1)[:, :k]
    return [{int(t): -float(codes[i, t]) * LP_STEP for t in row} for i, row in enumerate(idx)]


def probe_prompt_logprobs(base_url: str, model_name: str, headers: dict[str, str]) -> None:
    """One echo + logprobs request before lm-eval's hundreds: a server that does not return prompt log-probs is
    refused in one line (lm-eval would retry and fail noisily)."""
    try:
        dists, _ = prompt_topk(base_url, model_name, [1, 2, 3, 4], headers)
        ok = len(dists) == 3 and all(dists)
    except Exception:  # HTTP error, missing fields: the server cannot do it
        ok = False
    if not ok:
        raise UnsupportedConfig(f"endpoint {base_url} returns no prompt log-probs (echo with logprobs on "
                                "/v1/completions), which lm-eval local-completions scores: expected a server that "
                                "does (vLLM, SGLang); llama-server and chat-only APIs do not")


def plan_scoring(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                 progress: bool = True) -> Plan:
    """The template's first step (tuner.quality.template): the endpoint reached, its key accepted, its model name
    resolved and its prompt log-probs probed (before the baseline's work); no cache key; the baseline the fp32 model
    `config.model` on transformers."""
    from tuner.engines.endpoint import EndpointEngine, api_headers
    from tuner.models import resolve_source, source_hash

    engine = EndpointEngine(config, ignore_eos=False)
    engine.prepare()  # reachable, key accepted, model name resolved (TunerError otherwise)
    probe_prompt_logprobs(engine.base_url, engine.model_name, api_headers())
    versions = {**library_versions(BASELINE), "endpoint": engine.base_url, "served_model": engine.model_name}
    return Plan(source_hash(resolve_source(config.model)), versions, None, reference_config(config), state=engine)


def reference_config(config: TrialConfig) -> TrialConfig:
    """The fp32 model the endpoint is judged against: `config.model` on transformers, on the CPU."""
    return TrialConfig(model=config.model, quant=BASELINE, device="cpu")


def score_config(config: TrialConfig, names: tuple[str, ...], limit: int, seed: int, kld_tokens: int,
                 progress: bool, plan: Plan) -> tuple[tuple[Any, ...], KLDResult]:
    """The tasks through the endpoint (lm-eval local-completions), and its top-K KLD from the fp32 reference."""
    from tuner.engines.endpoint import api_headers
    from tuner.models import checkpoint_dir
    from tuner.quality.kld import ensure_reference, held_chunks
    from tuner.quantize import load_tokenizer

    engine = plan.state
    tok_dir = checkpoint_dir(config.model)
    headers = api_headers()
    if progress:
        print(f"tuner eval: scoring {engine.model_name!r} through {engine.base_url}", file=sys.stderr, flush=True)
    scores = endpoint_suite(engine.base_url, engine.model_name, str(tok_dir), names, limit, seed, headers)
    ref, _ = ensure_reference(reference_config(config), plan.model_hash, kld_tokens, library_versions(BASELINE),
                              progress)
    chunks = held_chunks(load_tokenizer(tok_dir), kld_tokens)
    try:
        cand = served_topk(engine.base_url, engine.model_name, chunks, headers)
    except Exception as e:
        raise TunerError(f"endpoint {engine.base_url} returned no prompt top-{TOP_K} log-probs "
                         f"({one_line(e)}): expected echo with logprobs") from None
    n = min(len(cand), len(ref.codes))
    kld = topk_kld(reference_topk(ref.codes[:n]), cand[:n]) if n else KLDResult(float("nan"), 0.0, 0.0, 0.0, 0)
    return scores, kld


# ------------------------------------------------------------------ the registry's quality API (registry.py) --- #
def check_inputs(config: TrialConfig, names: tuple[str, ...]) -> None:
    """Nothing to check before scoring: the server is reached (and probed) when it is scored."""


def baseline_description(model: str, source: Any) -> str:
    return (f"fp32 of {model} on transformers (dequantized from {source.path.name}), the weights the endpoint "
            "is taken to serve; the endpoint scored through its /v1/completions by lm-eval local-completions")
