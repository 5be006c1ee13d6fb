"""Speculative decoding through transformers' assisted generation.

transformers runs assisted generation at batch 1 only. How a draft config serves concurrent load: `batch_cap`
worker threads share the weights, each one a batch-1 assisted decoder pulling requests from one FIFO queue
(so batch cap = sequences decoded at once, as for continuous batching). The KV fraction does not apply (each
decoder keeps a dynamic cache); it is recorded as such. Drafts:
  ngram:K        prompt lookup (`prompt_lookup_num_tokens=K`), no extra model
  draft:M:K      assistant model M proposing K tokens per step (`num_assistant_tokens=K`, constant schedule);
                 universal assisted decoding when the tokenizers differ
  early-exit:L   self-speculation from the model's first L layers (`assistant_early_exit=L`)
  none           the same batch-1 decoders without a draft: the reference a draft's effect is measured against
                 (tuner.measure.bench measures it on the same engine, weights and prompts as the draft run)
Acceptance rate = accepted / proposed draft tokens, counted on the candidate generator of each request.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.base import Capabilities, Engine, TokenSink


class _Counter(threading.local):
    proposed = 0
    accepted = 0


class _Streamer:
    """transformers BaseStreamer: the first put() is the prompt, the rest are accepted tokens."""

    def __init__(self, sink: TokenSink) -> None:
        self.sink, self.prompt_seen, self.count = sink, False, 0

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        ids = value.reshape(-1).tolist()
        self.count += len(ids)
        self.sink.on_tokens(ids, time.perf_counter())

    def end(self) -> None:
        pass


class AssistedEngine(Engine):
    def __init__(self, model: Any, tokenizer: Any, config: TrialConfig, ignore_eos: bool = True,
                 assistant: tuple[Any, Any] | None = None) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.ignore_eos = ignore_eos
        self.assistant = assistant  # (model, tokenizer) for draft:<model>:K
        self.draft = config.draft_spec
        self._queue: queue.Queue[Any] = queue.Queue()
        self._workers: list[threading.Thread] = []
        self._counter = _Counter()
        self._patch_candidate_generator()

    def settings(self) -> dict[str, Any]:
        s: dict[str, Any] = {"workers": self.config.batch_cap, "do_sample": False, "ignore_eos": self.ignore_eos,
                             "kv_fraction": "not applicable (dynamic cache per decoder)"}
        s.update(self.generate_kwargs_summary())
        return s

    def generate_kwargs_summary(self) -> dict[str, Any]:
        d = self.draft
        if d.kind == "none":
            return {}
        if d.kind == "ngram":
            return {"prompt_lookup_num_tokens": d.tokens}
        if d.kind == "early-exit":
            return {"assistant_early_exit": d.tokens}
        return {"assistant_model": d.model, "num_assistant_tokens": d.tokens,
                "num_assistant_tokens_schedule": "constant"}

    def capabilities(self) -> Capabilities:
        return Capabilities("transformers-assisted", notes=("assisted generation is batch-1; one decoder per slot",),
                            settings=self.settings())

    def _patch_candidate_generator(self) -> None:
        """Count proposed/accepted draft tokens per thread by wrapping the candidate generator generate() builds."""
        original = self.model._get_candidate_generator
        counter = self._counter

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            gen = original(*args, **kwargs)
            get_candidates, update = gen.get_candidates, gen.update_candidate_strategy

            def counted_get(input_ids: Any, *a: Any, **k: Any) -> Any:
                cand, logits = get_candidates(input_ids, *a, **k)
                counter.proposed += int(cand.shape[1] - input_ids.shape[1])
                return cand, logits

            def counted_update(input_ids: Any, scores: Any, num_matches: Any) -> Any:
                counter.accepted += int(num_matches)
                return update(input_ids, scores, num_matches)

            gen.get_candidates, gen.update_candidate_strategy = counted_get, counted_update
            return gen

        self.model._get_candidate_generator = wrapped

    def generate_kwargs(self, max_tokens: int) -> dict[str, Any]:
        eos = self.tokenizer.eos_token_id
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens if self.ignore_eos else 0,
                              "do_sample": False, "pad_token_id": self.tokenizer.pad_token_id or eos}
        d = self.draft
        if d.kind == "none":
            return kw
        if d.kind == "ngram":
            kw["prompt_lookup_num_tokens"] = d.tokens
        elif d.kind == "early-exit":
            kw["assistant_early_exit"] = d.tokens
        else:
            amodel, atok = self.assistant
            kw.update(assistant_model=amodel, num_assistant_tokens=d.tokens,
                      num_assistant_tokens_schedule="constant")
            if type(atok).__name__ != type(self.tokenizer).__name__ or atok.get_vocab() != self.tokenizer.get_vocab():
                kw.update(tokenizer=self.tokenizer, assistant_tokenizer=atok)  # universal assisted decoding
        return kw

    def start(self) -> None:
        for i in range(self.config.batch_cap):
            t = threading.Thread(target=self._serve, name=f"assisted-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        ids = self.tokenizer("Warm-up request for the serving engine.", add_special_tokens=False)["input_ids"]
        self.generate_once(list(ids), 4)

    def generate_once(self, prompt_ids: list[int], max_tokens: int, streamer: Any = None) -> list[int]:
        import torch

        x = torch.tensor([prompt_ids], device=self.model.device)
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), streamer=streamer,
                                      **self.generate_kwargs(max_tokens))
        return out[0, len(prompt_ids):].tolist()

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int, sink: TokenSink) -> None:
        self._queue.put((request_id, list(prompt_ids), max_tokens, sink))

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _, prompt_ids, max_tokens, sink = item
            self._counter.proposed = self._counter.accepted = 0
            streamer = _Streamer(sink)
            try:
                self.generate_once(prompt_ids, max_tokens, streamer)
                error = None if streamer.count else "engine returned zero tokens without an error"
            except Exception as e:  # an error is data: this request fails, the run goes on
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            sink.on_finish(error, self._counter.proposed, self._counter.accepted)

    def stop(self, drain: bool = True) -> None:
        if not drain:  # abandon queued requests; running ones finish their current generate()
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[3].on_finish("engine stopped before the request started")
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join(timeout=30)
        self._workers.clear()
