"""Fitting a StepModel to an engine profile's samples, and its parameter uncertainty (residual bootstrap).

Decode samples are (running sequences k, their context tokens summed, seconds per step) and fit
step = t_k + c * context_tokens: one base time per batch size measured (the `decode_by_batch_s` table; engines are
not linear in k: llama-server -t 1's step at 2 sequences took 3.7x its step at 1 on the shared 2-core host) and one context slope.
Prefill samples are (prompt tokens, TTFT seconds of a request alone on an idle engine) and fit
ttft = d + e * tokens + f * tokens^2 (prefill_base_s, prefill_per_token_s, prefill_per_token_sq_s: attention over
the prompt; llama-server with a q8_0 KV cache took 20, 76, 280 and 790 ms for 16, 64, 192 and 384 tokens, a line
through them 45% high at 96). Mixed samples are steps where prompts joined running
decodes (running sequences, their context, the prompt tokens, seconds); what each took beyond the fitted decode step
fits mixed_base_s + mixed_per_token_s * tokens + mixed_per_token_sq_s * tokens^2 (a lone prompt's TTFT also holds what an idle engine spends before
its first step, which a prompt joining a running batch does not pay). Both by non-negative least squares (a step cannot get
faster with more work); the residuals are kept. The step-time noise is the robust spread (1.4826 x MAD) of
log(observed gap / fitted step) over every raw decoding gap. Pure functions of the samples.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

from tuner.predict.simulate import StepModel


def nnls_fit(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Non-negative least squares, columns scaled to unit norm for the solver's sake."""
    import numpy as np
    from scipy.optimize import nnls

    x = np.asarray(rows, dtype=float)
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(x / scale, np.asarray(y, dtype=float))
    return [float(c) for c in coef / scale]


def batch_sizes(samples: Sequence[dict[str, Any]]) -> list[int]:
    return sorted({int(s["seqs"]) for s in samples})


def decode_rows(samples: Sequence[dict[str, Any]]) -> tuple[list[list[float]], list[float]]:
    """One indicator column per batch size measured, then the context tokens."""
    ks = batch_sizes(samples)
    return ([[float(int(s["seqs"]) == k) for k in ks] + [float(s["context_tokens"])] for s in samples],
            [s["step_s"] for s in samples])


def decode_model(coef: Sequence[float], ks: Sequence[int]) -> tuple[tuple[tuple[int, float], ...], float]:
    """(the per-batch table, the context slope) from decode coefficients; a batch size fitted to 0 s (all its
    samples below the context's share) keeps a floor of 1 us, a step never being free."""
    return tuple((k, max(t, 1e-6)) for k, t in zip(ks, coef)), coef[-1]


def prefill_rows(samples: Sequence[dict[str, Any]]) -> tuple[list[list[float]], list[float]]:
    """A base, the prompt tokens, and their square (attention over the prompt)."""
    return ([[1.0, float(s["prompt_tokens"]), float(s["prompt_tokens"]) ** 2] for s in samples],
            [s["ttft_s"] for s in samples])


def prompt_sq(s: dict[str, Any]) -> float:
    """A mixed sample's attention pairs: the squares of its prompts summed (one prompt: its tokens squared)."""
    return float(s.get("prompt_sq", float(s["prompt_tokens"]) ** 2))


def mixed_rows(samples: Sequence[dict[str, Any]]) -> list[list[float]]:
    return [[1.0, float(s["prompt_tokens"]), prompt_sq(s)] for s in samples]


def mixed_extras(samples: Sequence[dict[str, Any]], ym: Sequence[float], model: StepModel) -> list[float]:
    """What each mixed step took beyond the decodes' own step at its batch and context (the fitted decode model)."""
    return [y - model.decode_s(int(s["seqs"]), s["context_tokens"]) for s, y in zip(samples, ym)]


def fits_mixed(samples: Sequence[dict[str, Any]]) -> bool:
    """Enough mixed steps to fit: 3 or more, at 2 or more prompt lengths (with 2 the square is not identified and
    NNLS keeps a fit through them)."""
    return len(samples) >= 3 and len({s["prompt_tokens"] for s in samples}) >= 2


def residual_summary(y: Sequence[float], fitted: Sequence[float]) -> dict[str, Any]:
    res = [a - b for a, b in zip(y, fitted)]
    rmse = math.sqrt(sum(r * r for r in res) / len(res)) if res else None
    mean = statistics.fmean(y) if y else None
    return {"n": len(res), "residuals_s": [round(r, 7) for r in res], "rmse_s": rmse,
            "relative_rmse": rmse / mean if rmse is not None and mean else None}


def step_noise_sigma(gaps: Sequence[Sequence[float]], model: StepModel) -> float:
    """Robust log-spread of raw gaps (seqs, context tokens, seconds) around the fitted step time."""
    logs = [math.log(g / model.decode_s(int(k), int(ctx))) for k, ctx, g in gaps
            if g > 0 and model.decode_s(int(k), int(ctx)) > 0]
    if len(logs) < 8:
        return 0.0
    med = statistics.median(logs)
    return 1.4826 * statistics.median(abs(v - med) for v in logs)


def fit_step_model(decode: Sequence[dict[str, Any]], prefill: Sequence[dict[str, Any]],
                   raw_gaps: Sequence[Sequence[float]] = (), mixed: Sequence[dict[str, Any]] = ()
                   ) -> tuple[StepModel, dict[str, Any]]:
    """The StepModel and the fit's record: coefficients, residuals per sample, RMSE. `mixed`: steps where a prompt
    joined running decodes (seqs, context tokens, prompt tokens, step seconds), fitted when `fits_mixed`."""
    mixed = mixed if fits_mixed(mixed) else ()
    ym = [s["step_s"] for s in mixed]
    model = refit(decode, prefill, [s["step_s"] for s in decode], [s["ttft_s"] for s in prefill], 0.0, mixed, ym)
    model = StepModel(**{**model.to_dict(), "noise_sigma": step_noise_sigma(raw_gaps, model)})
    yd = [s["step_s"] for s in decode]
    yp = [s["ttft_s"] for s in prefill]
    fit = {"decode": residual_summary(yd, [model.decode_s(int(s["seqs"]), s["context_tokens"]) for s in decode]),
           "prefill": residual_summary(yp, [model.prefill_s(int(s["prompt_tokens"])) for s in prefill]),
           "mixed": residual_summary(ym, [mixed_step_s(model, s) for s in mixed]),
           "noise_sigma": model.noise_sigma, "model": model.to_dict()}
    return model, fit


def mixed_step_s(model: StepModel, s: dict[str, Any]) -> float:
    return model.step_s(int(s["seqs"]), s["context_tokens"], int(s["prompt_tokens"]), prompt_sq(s))


def refit(decode: Sequence[dict[str, Any]], prefill: Sequence[dict[str, Any]], yd: Sequence[float],
          yp: Sequence[float], sigma: float, mixed: Sequence[dict[str, Any]] = (),
          ym: Sequence[float] = ()) -> StepModel:
    """The StepModel fitted to the samples' designs with responses `yd` (decode), `yp` (prefill) and `ym` (mixed
    steps: fitted on what each took beyond the decodes' step this decode fit gives)."""
    xd, _ = decode_rows(decode)
    xp, _ = prefill_rows(prefill)
    table, c = decode_model(nnls_fit(xd, yd), batch_sizes(decode))
    d, e, f = nnls_fit(xp, yp)
    model = StepModel(decode_base_s=0.0, decode_per_context_token_s=c, prefill_base_s=d, prefill_per_token_s=e,
                      prefill_per_token_sq_s=f, noise_sigma=sigma, decode_by_batch_s=table)
    if not mixed:
        return model
    mb, mt, mf = nnls_fit(mixed_rows(mixed), mixed_extras(mixed, ym, model))
    return StepModel(**{**model.to_dict(), "mixed_base_s": mb, "mixed_per_token_s": mt, "mixed_per_token_sq_s": mf,
                        "mixed": True})


def bootstrap_models(decode: Sequence[dict[str, Any]], prefill: Sequence[dict[str, Any]], model: StepModel,
                     n: int, seed: int = 0, mixed: Sequence[dict[str, Any]] = ()) -> list[StepModel]:
    """`n` StepModels refitted to the fitted values plus resampled residuals (residual bootstrap): the spread of
    the parameters the samples allow (the mixed steps' too, when the model was fitted with them)."""
    rng = random.Random(f"bootstrap-{seed}")
    mixed = mixed if model.mixed and fits_mixed(mixed) else ()
    fd = [model.decode_s(int(s["seqs"]), s["context_tokens"]) for s in decode]
    fp = [model.prefill_s(int(s["prompt_tokens"])) for s in prefill]
    fm = [mixed_step_s(model, s) for s in mixed]
    rd = [s["step_s"] - f for s, f in zip(decode, fd)]
    rp = [s["ttft_s"] - f for s, f in zip(prefill, fp)]
    rm = [s["step_s"] - f for s, f in zip(mixed, fm)]
    out = []
    for _ in range(n):
        yd = [f + rng.choice(rd) for f in fd]
        yp = [f + rng.choice(rp) for f in fp]
        ym = [f + rng.choice(rm) for f in fm]
        out.append(refit(decode, prefill, yd, yp, model.noise_sigma, mixed, ym))
    return out
