"""transformers' own continuous batching (`init_continuous_batching`) as a tuner engine.

Knob mapping (recorded in the bench JSON under `engine.settings`):
  batch cap   -> max_requests_per_batch (sequences scheduled per step)
                 max_batch_tokens = batch cap + PREFILL_CHUNK (each running sequence decodes one token per step,
                 the rest of the step's token budget goes to chunked prefill)
  KV fraction -> max_memory_percent (fraction of the memory left free after the weights that the paged KV cache
                 may take; on CPU "free" is system RAM, on CUDA it is device memory)
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.base import Capabilities, Engine, TokenSink

PREFILL_CHUNK = 512  # tokens of prefill per step on top of one decode token per running sequence
ZERO_TOKENS = "engine returned zero tokens without an error (KV cache too small for the request?)"


def batch_tokens(batch_cap: int) -> int:
    """max_batch_tokens for a batch cap: one decode token per running sequence plus the prefill chunk."""
    return batch_cap + PREFILL_CHUNK


class ContinuousBatchingEngine(Engine):
    def __init__(self, model: Any, tokenizer: Any, config: TrialConfig, ignore_eos: bool = True) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.ignore_eos = ignore_eos
        self.manager: Any = None
        self._sinks: dict[str, tuple[TokenSink, list[int]]] = {}
        self._lock = threading.Lock()
        self._collector: threading.Thread | None = None
        self._stopping = threading.Event()

    def settings(self) -> dict[str, Any]:
        return {
            "max_requests_per_batch": self.config.batch_cap,
            "max_batch_tokens": batch_tokens(self.config.batch_cap),
            "max_memory_percent": self.config.kv_fraction,
            "do_sample": False,
            "ignore_eos": self.ignore_eos,
        }

    def capabilities(self) -> Capabilities:
        return Capabilities("transformers-cb", settings=self.settings())

    def start(self) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        s = self.settings()
        eos = self.tokenizer.eos_token_id
        gen = GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=-1 if self.ignore_eos else eos,
                               pad_token_id=self.tokenizer.pad_token_id or eos)
        cb = ContinuousBatchingConfig(
            max_requests_per_batch=s["max_requests_per_batch"],
            max_batch_tokens=s["max_batch_tokens"],
            max_memory_percent=s["max_memory_percent"],
        )
        self.manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()
        self._collector = threading.Thread(target=self._collect, name="cb-collector", daemon=True)
        self._collector.start()

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int, sink: TokenSink) -> None:
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:  # an out-of-range id would kill the generation loop for every request: refuse this one only
            sink.on_finish(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            return
        with self._lock:
            self._sinks[request_id] = (sink, [])
        eos = -1 if self.ignore_eos else self.tokenizer.eos_token_id
        try:
            rid = self.manager.add_request(list(prompt_ids), request_id=request_id, max_new_tokens=max_tokens,
                                           streaming=True, record_timestamps=True, eos_token_id=eos)
        except Exception as e:  # a full queue, a stopped manager: the request fails, the run goes on
            rid, err = None, f"{type(e).__name__}: {e}"
        else:
            fatal = self.manager.background_thread_status.fatal_error
            err = None if rid is not None else (
                f"engine failed: {str(fatal).splitlines()[0] if str(fatal) else type(fatal).__name__}" if fatal
                else "engine refused the request (manager not accepting requests)")
        if err:
            self._finish(request_id, err)

    def _finish(self, request_id: str, error: str | None) -> None:
        with self._lock:
            entry = self._sinks.pop(request_id, None)
        if entry is not None:
            entry[0].on_finish(error)

    def _collect(self) -> None:
        """Route streamed outputs to their sinks; fail everything pending if the generation thread dies."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        while not self._stopping.is_set():
            out = self.manager.get_result(timeout=0.05)
            if out is None:
                if not self.manager.is_running() and self._sinks:
                    fatal = self.manager.background_thread_status.fatal_error
                    reason = f"generation loop died: {fatal}" if fatal else "generation loop stopped"
                    for rid in list(self._sinks):
                        self._finish(rid, reason)
                continue
            with self._lock:
                entry = self._sinks.get(out.request_id)
            if entry is None:
                continue
            sink, seen = entry
            tokens = list(out.generated_tokens)
            if len(tokens) > len(seen):
                new = tokens[len(seen):]
                stamps = out.timestamps or []
                engine_t = stamps[len(seen)] if len(stamps) > len(seen) else None
                seen.extend(new)
                sink.on_tokens(new, engine_t)
            if out.is_finished():
                error = out.error if out.status == RequestStatus.FAILED else None
                if error is None and out.status == RequestStatus.FAILED:
                    error = "request failed in the engine"
                if error is None and not seen:
                    error = ZERO_TOKENS
                self._finish(out.request_id, error)

    def stop(self, drain: bool = True) -> None:
        if self.manager is not None:
            try:
                self.manager.stop(block=True, timeout=30, hard_stop=not drain)
            finally:
                self._stopping.set()
                if self._collector is not None:
                    self._collector.join(timeout=5)
                for rid in list(self._sinks):
                    self._finish(rid, "engine stopped before the request finished")
                self.manager = None

    def _cache(self) -> Any:
        """transformers' paged KV cache of the running engine (None before its generation loop has built it)."""
        processor = getattr(self.manager, "batch_processor", None) if self.manager is not None else None
        return getattr(processor, "cache", None)

    def kv_capacity(self) -> dict[str, int] | None:
        """The paged KV cache the running engine allocated: whole-model blocks, tokens per block and tokens in all
        (read from transformers' cache, not recomputed); None before its generation loop has built it."""
        cache = self._cache()
        page = getattr(getattr(self.manager, "continuous_batching_config", None), "page_size", None)
        if cache is None or not page:
            return None
        return {"num_blocks": int(cache.num_blocks), "block_tokens": int(page), "tokens": int(cache.num_blocks) * int(page)}

    def prefix_cache_block(self) -> int | None:
        """Tokens per block of the running engine's prefix cache (transformers' block sharing: a prompt whose first
        whole blocks match blocks already computed reuses them and prefills the rest); None when it does not share
        blocks, or before its generation loop has built the cache."""
        kv = self.kv_capacity()
        return kv["block_tokens"] if kv and getattr(self._cache(), "use_prefix_sharing", False) else None

    def info(self) -> dict[str, Any]:
        cb = getattr(self.manager, "continuous_batching_config", None) if self.manager else None
        resolved = {}
        if cb is not None:
            for k in ("num_blocks", "page_size", "max_batch_tokens", "max_requests_per_batch", "max_memory_percent"):
                resolved[k] = getattr(cb, k, None)
        return {"resolved": resolved, "attn_implementation": self.model.config._attn_implementation,
                "time": time.time()}
