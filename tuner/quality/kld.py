"""Distance of a configuration's next-token distribution from the fp32 reference, the way llama.cpp's perplexity
tool measures it (`--kl-divergence-base` / `--kl-divergence`):

* held text (LAMBADA passages) is tokenized and cut into chunks of `KLD_CTX` tokens; in each chunk only the second
  half is scored (positions ctx/2 .. ctx-2, predicting the next token), so every scored token has context;
* the reference log-probabilities are stored as 16-bit fixed point over [-16, 0] nats (one uint16 per vocabulary
  entry and token, like llama.cpp's base-logits file); entries whose reference log-prob is below -16 (p < 1.1e-7)
  are skipped in the sum, as llama.cpp does;
* per token, KL(P_ref || Q_cfg) = sum_i p_i (log p_i - log q_i); reported as mean (with its standard error),
  99th percentile, and top-1 agreement (argmax of Q equals argmax of P).

The candidate's log-probs are put on the same 16-bit grid before the difference is taken, so a model compared
with itself gives exactly 0 (not the quantization noise of the stored reference).

Caching (under tuner.quality.gate's results folder): the fp32 reference of a model (`reference-*.npz`, shared by every
format) and each format's KLD result (`kld-<format>-*.json`), so `tuner eval --max-kld` can screen a format in
seconds before any lm-eval task runs, and a later full score reuses the number.
"""

from __future__ import annotations

import gc
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tuner.errors import TunerError
from tuner.quality.common import BASELINE, SCHEMA, digest, read_cache, results_dir, write_json_atomic

KLD_CTX = 512  # llama.cpp perplexity default context
LP_FLOOR = 16.0  # reference log-probs below -LP_FLOOR are skipped
CODE_MAX = 65535
LP_STEP = LP_FLOOR / CODE_MAX  # 2.4e-4 nats
MAX_KLD_TOKENS = 200_000  # what the LAMBADA test passages allow at KLD_CTX
DEFAULT_KLD_TOKENS = 2040  # 8 chunks of 512 tokens, 255 scored in each


@dataclass(frozen=True)
class KLDResult:
    mean: float
    mean_stderr: float
    p99: float
    top1_agree: float
    n_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Reference:
    """The fp32 model's next-token distributions at the scored positions of the held text."""

    ids: np.ndarray  # [chunks, KLD_CTX] int32 token ids fed to the model
    codes: np.ndarray  # [n_tokens, vocab] uint16: round(-log p / LP_STEP), clamped to CODE_MAX
    top1: np.ndarray  # [n_tokens] int32: argmax of the full-precision reference


def scored_per_chunk(ctx: int = KLD_CTX) -> int:
    return ctx - ctx // 2 - 1


def held_chunks(tokenizer: Any, n_tokens: int, ctx: int = KLD_CTX) -> np.ndarray:
    """Token chunks [n_chunks, ctx] of LAMBADA passages (joined by blank lines) covering `n_tokens` scored tokens."""
    from tuner.quality.evaldata import lambada_passages

    if not 0 < n_tokens <= MAX_KLD_TOKENS:
        raise TunerError(f"KLD token count {n_tokens!r} is invalid: expected an integer in [1, {MAX_KLD_TOKENS}]")
    n_chunks = -(-n_tokens // scored_per_chunk(ctx))
    need = n_chunks * ctx
    ids: list[int] = []
    for passage in lambada_passages():
        ids.extend(tokenizer("\n\n" + passage if ids else passage, add_special_tokens=False)["input_ids"])
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise TunerError(f"held text has {len(ids)} tokens, fewer than the {need} that --kld-tokens {n_tokens} needs")
    chunks = np.asarray(ids[:need], dtype=np.int32).reshape(n_chunks, ctx)
    bos = getattr(tokenizer, "bos_token_id", None)
    probe = tokenizer("a")["input_ids"]
    if bos is not None and probe and probe[0] == bos:  # the model expects BOS first, as llama.cpp sets it per chunk
        chunks[:, 0] = bos
    return chunks


def chunk_logprobs(model: Any, chunk: np.ndarray, n_scored: int) -> Any:
    """Float32 log-softmax [n_scored, vocab] at positions ctx/2 .. ctx/2 + n_scored - 1 of one chunk."""
    import torch

    ctx = len(chunk)
    first = ctx // 2
    keep = ctx - first  # positions first .. ctx-1; the last one predicts past the chunk and is dropped
    input_ids = torch.as_tensor(chunk, dtype=torch.long, device=model.device).unsqueeze(0)
    with torch.inference_mode():
        try:
            logits = model(input_ids=input_ids, logits_to_keep=keep).logits[0]
        except TypeError:  # a model class without logits_to_keep
            logits = model(input_ids=input_ids).logits[0]
        logits = logits[-keep:-1][:n_scored].float()
        return torch.log_softmax(logits, dim=-1).cpu()


def to_codes(logprobs: Any) -> Any:
    """log-probs -> int64 grid codes round(-lp / LP_STEP) (unclamped)."""
    import torch

    return torch.round(-logprobs.double() / LP_STEP).to(torch.int64)


def token_kld(ref_codes: np.ndarray, ref_top1: np.ndarray, logprobs: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-token KL(P_ref || Q) and top-1 agreement for candidate log-probs [n, vocab] against stored reference."""
    import torch

    ref = torch.from_numpy(ref_codes.astype(np.int64))
    cand = to_codes(logprobs.clamp(min=-1e4))  # a -inf log-prob (masked token) stays finite on the grid
    mask = ref < CODE_MAX
    p = torch.exp(-ref.double() * LP_STEP) * mask
    kld = (p * (cand - ref).double() * LP_STEP).sum(dim=-1)
    agree = logprobs.argmax(dim=-1).numpy() == ref_top1
    return kld.numpy(), agree


def reference_logprobs(model: Any, chunks: np.ndarray, n_tokens: int, progress: bool = True) -> Reference:
    """Run the reference model over the held chunks and keep its distributions on the 16-bit grid."""
    from tqdm import tqdm

    per = scored_per_chunk(chunks.shape[1])
    codes, top1 = [], []
    for i in tqdm(range(len(chunks)), desc="KLD reference (fp32)", disable=not progress, leave=False):
        lp = chunk_logprobs(model, chunks[i], min(per, n_tokens - i * per))
        codes.append(to_codes(lp).clamp_(max=CODE_MAX).numpy().astype(np.uint16))
        top1.append(lp.argmax(dim=-1).numpy().astype(np.int32))
    return Reference(chunks, np.concatenate(codes), np.concatenate(top1))


def kl_divergence(ref: Reference, model: Any, progress: bool = True) -> KLDResult:
    """KL divergence of `model`'s next-token distributions from the stored reference, over the same chunks."""
    from tqdm import tqdm

    per = scored_per_chunk(ref.ids.shape[1])
    n_tokens = len(ref.top1)
    klds, agrees = [], []
    for i in tqdm(range(len(ref.ids)), desc="KLD vs fp32", disable=not progress, leave=False):
        lo, hi = i * per, min((i + 1) * per, n_tokens)
        lp = chunk_logprobs(model, ref.ids[i], hi - lo)
        k, a = token_kld(ref.codes[lo:hi], ref.top1[lo:hi], lp)
        klds.append(k)
        agrees.append(a)
    return kld_stats(np.concatenate(klds), np.concatenate(agrees))


def kld_stats(kld: np.ndarray, agree: np.ndarray) -> KLDResult:
    n = len(kld)
    mean = float(kld.mean())
    stderr = float(kld.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0
    return KLDResult(mean, stderr, float(np.percentile(kld, 99)), float(agree.mean()), n)


def save_reference(ref: Reference, path: Path) -> None:
    """Write an .npz (deflate level 1: ~40% of 2 bytes per vocabulary entry and token) atomically
    (tuner.files.write_atomic): an interrupted write leaves no file at `path`."""
    from tuner.files import write_atomic

    def write(f: Any) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
            for name, arr in (("ids", ref.ids), ("codes", ref.codes), ("top1", ref.top1)):
                with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.ascontiguousarray(arr), allow_pickle=False)

    write_atomic(path, write, binary=True)


def load_reference(path: Path, chunks: np.ndarray, n_tokens: int) -> Reference | None:
    """The stored reference when it was made from exactly these chunks and token count, else None."""
    try:
        with np.load(path, allow_pickle=False) as z:
            ref = Reference(z["ids"], z["codes"], z["top1"])
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    if ref.ids.shape != chunks.shape or not np.array_equal(ref.ids, chunks) or len(ref.top1) != n_tokens:
        return None
    return ref


# ------------------------------------------------------------------------------------------------ cache ---- #
def reference_path(model_hash: str, kld_tokens: int, versions: dict[str, str]) -> Path:
    """Where the fp32 reference distributions for KLD live (shared by every format of these weights)."""
    base = {k: versions[k] for k in ("torch", "transformers")}
    key = {"schema": SCHEMA, "model_hash": model_hash, "kld_tokens": kld_tokens, "versions": base}
    return results_dir() / model_hash / f"reference-{digest(key)}.npz"


def kld_key(model_hash: str, quant: str, kld_tokens: int, versions: dict[str, str]) -> dict[str, Any]:
    return {"schema": SCHEMA, "kind": "kld", "model_hash": model_hash, "quant": quant, "kld_tokens": kld_tokens,
            "ctx": KLD_CTX, "versions": versions}


def kld_path(key: dict[str, Any]) -> Path:
    return results_dir() / key["model_hash"] / f"kld-{key['quant']}-{digest(key)}.json"


def ensure_reference(config: Any, model_hash: str, kld_tokens: int, versions: dict[str, str], progress: bool,
                     model: Any = None, tokenizer: Any = None) -> tuple[Reference, bool]:
    """The fp32 reference distributions on the held text, from the cache or computed (with `model` when given,
    else by loading the fp32 model). Returns (reference, computed_now)."""
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_model, load_tokenizer

    path = reference_path(model_hash, kld_tokens, versions)
    tok = tokenizer if tokenizer is not None else load_tokenizer(checkpoint_dir(config.model))
    chunks = held_chunks(tok, kld_tokens)
    ref = load_reference(path, chunks, kld_tokens)
    if ref is not None:
        return ref, False
    own = model is None
    if own:
        model, _ = load_model(config.replace(quant=BASELINE))
    try:
        ref = reference_logprobs(model, chunks, kld_tokens, progress=progress)
    finally:
        if own:
            del model
            gc.collect()
    save_reference(ref, path)
    return ref, True


def score_kld(config: Any, model_hash: str, kld_tokens: int, versions: dict[str, str], progress: bool = True,
              model: Any = None, tokenizer: Any = None) -> tuple[KLDResult, bool]:
    """KLD of `config`'s model (loaded here unless given) from the fp32 reference, through the cache.
    Returns (result, cached). For the fp32 model itself, a freshly computed reference gives exactly 0."""
    from tuner.quantize import load_model

    key = kld_key(model_hash, config.quant, kld_tokens, versions)
    path = kld_path(key)
    hit = read_cache(path, key)
    if hit is not None:
        return KLDResult(**hit), True
    baseline = config.quant == BASELINE
    ref = None
    if not baseline:  # before the candidate is loaded: at most one model in memory
        ref, _ = ensure_reference(config, model_hash, kld_tokens, versions, progress)
    own = model is None
    if own:
        model, tokenizer = load_model(config)
    try:
        if baseline:
            ref, fresh = ensure_reference(config, model_hash, kld_tokens, versions, progress, model, tokenizer)
            if fresh:  # the reference was just computed from this very model: compared with itself, exactly 0
                result = KLDResult(0.0, 0.0, 0.0, 1.0, kld_tokens)
            else:
                result = kl_divergence(ref, model, progress)
        else:
            result = kl_divergence(ref, model, progress)
    finally:
        if own:
            del model, tokenizer
            gc.collect()
    write_json_atomic(path, {"key": key, "result": result.to_dict()})
    return result, False
