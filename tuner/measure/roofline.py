"""Memory-bandwidth roofline for decode: at batch 1 every step reads all weights once, so
tok/s <= bandwidth / bytes_read_per_token. Bandwidth is measured in the same run (a streaming read)."""

from __future__ import annotations

import time
from typing import Any


def tensor_bytes(t: Any) -> int:
    """Stored bytes of a tensor, looking inside tensor subclasses (torchao, bitsandbytes) at what they hold."""
    import torch

    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(tensor_bytes(getattr(t, n)) for n in names)


def bytes_per_token(model: Any) -> int:
    """Bytes a batch-1 decode step reads: every parameter and buffer once (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += tensor_bytes(t)
    # bitsandbytes keeps 4-bit quantization state (absmax, code) outside the parameters
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None and getattr(state, "absmax", None) is not None:
            total += tensor_bytes(state.absmax)
    return total


def measure_bandwidth_gbs(size_mb: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Median read bandwidth (GB/s) of summing a buffer far larger than the caches."""
    import torch

    x = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32, device=device)
    x.sum()  # touch the pages
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return x.numel() * 4 / times[len(times) // 2] / 1e9


def roofline(b: int | None, decode_tokens_per_s: float | None, bandwidth_gbs: float | None) -> dict[str, Any]:
    """`b`: bytes a batch-1 decode step reads (`bytes_per_token(model)`, or a GGUF file's weight bytes); None where
    the engine does not know them (vLLM, a remote endpoint): the bound is then "unknown", said, never guessed."""
    out: dict[str, Any] = {"bytes_per_token": b, "bandwidth_gbs": bandwidth_gbs}
    if not b:
        out.update(bound_tokens_per_s=None, unknown="bytes read per decoded token unknown for this engine")
        return out
    if bandwidth_gbs:
        out["bound_tokens_per_s"] = bandwidth_gbs * 1e9 / b
        if decode_tokens_per_s:
            out["percent_of_bound"] = 100.0 * decode_tokens_per_s / out["bound_tokens_per_s"]
    return out
