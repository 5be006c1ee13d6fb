"""Fitting a StepModel to an engine profile's samples, and its parameter uncertainty (residual bootstrap).

Decode samples are (running sequences k, their context tokens summed, seconds per step) and fit
step = t_k + c * context_tokens: one base time per batch size measured (the `decode_by_batch_s` table; engines are
not linear in k: llama-server -t 1's step at 2 sequences took 3.7x its step at 1 on the shared 2-core host) and one
context slope -- or one slope per batch size (`decode_ctx_by_batch_s`) where the samples reject a shared one (an
F-test at `PER_BATCH_P`, and the residuals' squares cut to under `PER_BATCH_GAIN`), fitted for each batch size
measured over contexts at least `PER_BATCH_SPAN` and `PER_BATCH_SPAN_TOKENS` a sequence apart (`spanned`: a protocol
that sends its long prompts only up to some batch size, `Protocol.long_waves_to`, leaves the wider ones with short
contexts alone, and each of those takes the slope of the widest spanned batch size below it, as `StepModel.ctx_slope`
holds its table's last slope): transformers' continuous batching on CPU took 65 ms a step for 8 sequences of ~40
context tokens and 225 ms for 8 of ~340, while 4 sequences went from 68 to 75 ms; one slope through both put the
4-sequence step at 29 ms, below every sample of it.
llama-server's and vLLM's samples keep one slope (per-batch slopes cut their RMSE by 0-10%).
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

FIT_VERSION = 4  # the fitting rules' version: a profile fitted by older rules is fitted again from its samples
# (3: per-batch context slopes where some batch sizes were measured over one context length only; 4: a batch size's
# own slope only where its contexts span PER_BATCH_SPAN_TOKENS a sequence too)


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


PER_BATCH_P = 0.001  # per-batch context slopes when an F-test rejects one shared slope at this level
PER_BATCH_SPAN = 2.0  # ... and every batch size's contexts span at least this ratio (its slope is identified)
PER_BATCH_SPAN_TOKENS = 64  # ... and this many tokens a sequence: short prompts alone (vLLM's 8 tokens + 17 out: 9 to
# 25 a sequence, 2.8x) span the ratio, but their few tokens' step cost is under the step noise (a 32-sequence slope
# fitted at 0 from them, 2026-12-07)
PER_BATCH_GAIN = 0.8  # ... and they leave under this share of the shared slope's squared residuals (material)


def spanned(samples: Sequence[dict[str, Any]]) -> list[int]:
    """The batch sizes measured over contexts at least PER_BATCH_SPAN apart and PER_BATCH_SPAN_TOKENS a sequence
    apart: those whose own slope is identified."""
    ctx: dict[int, list[float]] = {}
    for s in samples:
        ctx.setdefault(int(s["seqs"]), []).append(s["context_tokens"])
    return sorted(k for k, c in ctx.items() if min(c) > 0 and max(c) >= PER_BATCH_SPAN * min(c)
                  and max(c) - min(c) >= PER_BATCH_SPAN_TOKENS * k)


def slope_owner(k: int, owners: Sequence[int]) -> int:
    """The batch size whose context slope batch size `k` takes: itself if spanned, else the widest spanned one below
    it (the slope held, as StepModel.ctx_slope holds past its table), else the narrowest."""
    below = [o for o in owners if o <= k]
    return below[-1] if below else owners[0]


def decode_rows(samples: Sequence[dict[str, Any]], per_batch: bool = False) -> tuple[list[list[float]], list[float]]:
    """One indicator column per batch size measured, then the context tokens (`per_batch`: one context column per
    spanned batch size, `slope_owner`)."""
    ks = batch_sizes(samples)
    if per_batch:
        owners = spanned(samples)
        return ([[float(int(s["seqs"]) == k) for k in ks]
                 + [float(slope_owner(int(s["seqs"]), owners) == o) * s["context_tokens"] for o in owners]
                 for s in samples], [s["step_s"] for s in samples])
    return ([[float(int(s["seqs"]) == k) for k in ks] + [float(s["context_tokens"])] for s in samples],
            [s["step_s"] for s in samples])


def decode_model(coef: Sequence[float], ks: Sequence[int], owners: Sequence[int] = ()
                 ) -> tuple[tuple[tuple[int, float], ...], float, tuple[tuple[int, float], ...]]:
    """(the per-batch table, the shared context slope, the per-batch slopes) from decode coefficients (`owners`: the
    spanned batch sizes of a per-batch fit, none for one shared slope); a batch size fitted to 0 s (all its samples
    below the context's share) keeps a floor of 1 us, a step never being free."""
    table = tuple((k, max(t, 1e-6)) for k, t in zip(ks, coef))
    if owners:
        return table, 0.0, tuple(zip(owners, coef[len(ks):]))
    return table, coef[-1], ()


def rss(rows: Sequence[Sequence[float]], y: Sequence[float], coef: Sequence[float]) -> float:
    return sum((yi - sum(a * b for a, b in zip(r, coef))) ** 2 for r, yi in zip(rows, y))


def slopes_per_batch(samples: Sequence[dict[str, Any]]) -> tuple[bool, float | None]:
    """Whether the decode samples reject one shared context slope (F-test of the per-batch slopes, one per spanned
    batch size, against it at PER_BATCH_P), and its p-value; (False, None) where it cannot be tested: fewer than two
    spanned batch sizes, or too few samples."""
    from scipy.stats import f as f_dist

    ks, owners = batch_sizes(samples), spanned(samples)
    n, p0, p1 = len(samples), len(ks) + 1, len(ks) + len(owners)
    if len(owners) < 2 or n <= p1:
        return False, None
    x0, y = decode_rows(samples)
    x1, _ = decode_rows(samples, per_batch=True)
    rss0, rss1 = rss(x0, y, nnls_fit(x0, y)), rss(x1, y, nnls_fit(x1, y))
    if rss0 <= 1e-12 * sum(v * v for v in y):  # one slope fits to rounding: nothing to test
        return False, None
    stat = max(rss0 - rss1, 0.0) / (p1 - p0) / max(rss1 / (n - p1), 1e-300)
    p = float(f_dist.sf(stat, p1 - p0, n - p1))
    return p < PER_BATCH_P and rss1 < PER_BATCH_GAIN * rss0, p


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
    per_batch, p_shared = slopes_per_batch(decode)
    model = refit(decode, prefill, [s["step_s"] for s in decode], [s["ttft_s"] for s in prefill], 0.0, mixed, ym,
                  per_batch)
    model = StepModel(**{**model.to_dict(), "noise_sigma": step_noise_sigma(raw_gaps, model)})
    yd = [s["step_s"] for s in decode]
    yp = [s["ttft_s"] for s in prefill]
    fit = {"decode": residual_summary(yd, [model.decode_s(int(s["seqs"]), s["context_tokens"]) for s in decode]),
           "prefill": residual_summary(yp, [model.prefill_s(int(s["prompt_tokens"])) for s in prefill]),
           "mixed": residual_summary(ym, [mixed_step_s(model, s) for s in mixed]),
           "noise_sigma": model.noise_sigma, "model": model.to_dict(),
           "context_slope": {"per_batch": per_batch, "shared_slope_p": p_shared}, "fit_version": FIT_VERSION}
    return model, fit


def mixed_step_s(model: StepModel, s: dict[str, Any]) -> float:
    return model.step_s(int(s["seqs"]), s["context_tokens"], int(s["prompt_tokens"]), prompt_sq(s))


def refit(decode: Sequence[dict[str, Any]], prefill: Sequence[dict[str, Any]], yd: Sequence[float],
          yp: Sequence[float], sigma: float, mixed: Sequence[dict[str, Any]] = (),
          ym: Sequence[float] = (), per_batch: bool = False) -> StepModel:
    """The StepModel fitted to the samples' designs with responses `yd` (decode), `yp` (prefill) and `ym` (mixed
    steps: fitted on what each took beyond the decodes' step this decode fit gives); `per_batch`: a context slope
    per batch size."""
    xd, _ = decode_rows(decode, per_batch)
    xp, _ = prefill_rows(prefill)
    table, c, slopes = decode_model(nnls_fit(xd, yd), batch_sizes(decode), spanned(decode) if per_batch else ())
    d, e, f = nnls_fit(xp, yp)
    model = StepModel(decode_base_s=0.0, decode_per_context_token_s=c, prefill_base_s=d, prefill_per_token_s=e,
                      prefill_per_token_sq_s=f, noise_sigma=sigma, decode_by_batch_s=table,
                      decode_ctx_by_batch_s=slopes)
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
        out.append(refit(decode, prefill, yd, yp, model.noise_sigma, mixed, ym, bool(model.decode_ctx_by_batch_s)))
    return out
