"""A virtual-time simulation of a continuous-batching engine, with the load generator's contract (tuner.measure.loadgen).

`SimulatedEngine.run(requests, concurrency, timeout_s, should_stop)` returns a `tuner.measure.loadgen.LoadResult` as
`run_load` does on a real engine, so the real capacity search (tuner.measure.capacity.CapacitySearch, with
`clock=engine.clock`) drives it unchanged: same warm-up, canaries, saturation probe, bracket and verdicts.

The scheduler, one step at a time (llama-server's slots and vLLM's scheduler share this shape):
* **Sending** as the load generator does: open loop at each request's `arrival_s` from the run's start; closed loop
  with `concurrency` in flight, the next request scheduled the moment one finishes (coordinated omission counted:
  latencies run from the scheduled time; the simulated harness has no dispatch lag).
* **Admission**, FCFS at each step's start: while fewer than `batch_cap` run and, with `kv_tokens`, the head's
  prompt + max_tokens fits in what the running requests have reserved (reserved whole at admission, so nothing is
  ever preempted; a request larger than the whole KV fails at once). The head blocks the queue behind it.
* **A step**: every running request past its prompt decodes one token; prompts are processed in the same step
  (FCFS, whole, or with `token_budget` the tokens left after the decodes, in chunks). A request whose prompt
  finishes in a step gets its first token at that step's end. Requests arriving during a step wait for its end.
* **Step time** from a `StepModel`: one forward pass costs a fixed part, a part per decoding sequence, a part per
  context token those sequences attend to, and, when the step holds prompt tokens, a fixed prefill part plus a
  part per prompt token (measured apart for a prompt joining running decodes, `StepModel.mixed`); times an optional lognormal noise factor (mean 1) drawn from the engine's seeded RNG.

Runs are back to back in virtual time (`clock()`), the engine idle between them. A run stopped by `should_stop`
returns only the requests that had finished, after the requests already handed over have run to their end (the
load generator's `settle`); a run past `timeout_s` drops what was still running. Deterministic for a seed and
the same sequence of runs. Per step the work is O(running requests).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from tuner.errors import TunerError
from tuner.measure.loadgen import LoadResult
from tuner.measure.metrics import RequestResult
from tuner.measure.workload import Request
from tuner.predict.noise import LognormalStream

STRETCH_MIN = 8  # decode-only steps before the next finishing one that are computed together (fewer: one by one)


@dataclass(frozen=True)
class StepModel:
    """Seconds one engine step takes. `decode_s(batch, context_tokens)` = a + b*batch + c*context_tokens (the
    decoding sequences and the context they attend to, summed), or with `decode_by_batch_s` ((batch, seconds), ...
    measured per batch size) that table interpolated linearly in the batch (extended with its last slope) plus
    c*context_tokens, c the `decode_ctx_by_batch_s` table's ((batch, seconds per context token), ...: the context's
    cost per token measured per batch size, where the samples reject one shared slope) interpolated the same way, or
    else `decode_per_context_token_s`; a step holding prompt tokens adds prefill_base_s + prefill_per_token_s * tokens +
    prefill_per_token_sq_s * pairs (attention over the prompt: a whole prompt of p tokens is p^2 pairs, a chunk the
    pairs it adds), so a prompt alone on an idle engine costs `prefill_s(tokens)` = a + prefill_base_s +
    prefill_per_token_s * tokens + prefill_per_token_sq_s * tokens^2.
    `noise_sigma`: each step's time is multiplied by a lognormal factor of mean 1 and this log-standard deviation
    (0: constant).
    `mixed`: the profile measured steps where a prompt joins running decodes (`mixed_base_s`, `mixed_per_token_s`,
    `mixed_per_token_sq_s`:
    what a step holding prompt tokens costs beyond the decodes' own step when at least one sequence decodes in it);
    without it (a profile older than version 3) such a step costs the decodes plus a lone prompt's time."""

    decode_base_s: float
    decode_per_seq_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    noise_sigma: float = 0.0
    decode_by_batch_s: tuple[tuple[int, float], ...] = ()
    mixed_base_s: float = 0.0
    mixed_per_token_s: float = 0.0
    mixed: bool = False
    prefill_per_token_sq_s: float = 0.0
    mixed_per_token_sq_s: float = 0.0
    decode_ctx_by_batch_s: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("decode_base_s", "decode_per_seq_s", "decode_per_context_token_s", "prefill_base_s",
                     "prefill_per_token_s", "noise_sigma", "mixed_base_s", "mixed_per_token_s",
                     "prefill_per_token_sq_s", "mixed_per_token_sq_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise TunerError(f"step model {name}={v!r} is invalid: expected a finite number >= 0")
        table = tuple((int(k), float(t)) for k, t in self.decode_by_batch_s)
        object.__setattr__(self, "decode_by_batch_s", tuple(sorted(table)))
        if any(k < 1 or not (math.isfinite(t) and t > 0) for k, t in table) or len({k for k, _ in table}) < len(table):
            raise TunerError(f"step model decode_by_batch_s={self.decode_by_batch_s!r} is invalid: expected distinct "
                             "batch sizes >= 1 with seconds > 0")
        slopes = tuple(sorted((int(k), float(c)) for k, c in self.decode_ctx_by_batch_s))
        object.__setattr__(self, "decode_ctx_by_batch_s", slopes)
        if any(k < 1 or not (math.isfinite(c) and c >= 0) for k, c in slopes) or len({k for k, _ in slopes}) < len(slopes):
            raise TunerError(f"step model decode_ctx_by_batch_s={slopes!r} is invalid: expected distinct batch sizes "
                             ">= 1 with seconds per context token >= 0")
        if not table and self.decode_base_s + self.decode_per_seq_s <= 0:
            raise TunerError("step model decode_base_s + decode_per_seq_s is 0: a decoding step must take time")

    def batch_s(self, batch: int) -> float:
        """A decoding step's time at `batch` sequences, before the context's share."""
        table = self.decode_by_batch_s
        if not table or batch == 0:
            return self.decode_base_s + self.decode_per_seq_s * batch
        if len(table) == 1:
            return table[0][1] * batch / table[0][0]
        i = 1
        while i < len(table) - 1 and table[i][0] < batch:
            i += 1
        (k0, t0), (k1, t1) = table[i - 1], table[i]
        return max(t0 + (t1 - t0) * (batch - k0) / (k1 - k0), 0.0)

    def ctx_slope(self, batch: int) -> float:
        """Seconds per context token of a decoding step at `batch` sequences: the per-batch table interpolated
        linearly (held at its ends: a slope is not extrapolated), or the one shared slope."""
        table = self.decode_ctx_by_batch_s
        if not table:
            return self.decode_per_context_token_s
        if batch <= table[0][0]:
            return table[0][1]
        for (k0, c0), (k1, c1) in zip(table, table[1:]):
            if batch <= k1:
                return c0 + (c1 - c0) * (batch - k0) / (k1 - k0)
        return table[-1][1]

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return self.batch_s(batch) + self.ctx_slope(batch) * context_tokens

    def prefill_s(self, tokens: int) -> float:
        return self.step_s(0, 0, tokens)

    def step_s(self, batch: int, context_tokens: int, prompt_tokens: int, prompt_sq: float | None = None) -> float:
        """One step: `batch` decoding sequences over `context_tokens` in all, and `prompt_tokens` of prompts
        (`prompt_sq`: their attention's token pairs, `pairs`; None: one whole prompt, prompt_tokens squared)."""
        t = self.decode_s(batch, context_tokens)
        if prompt_tokens:
            t += self.prompt_s(batch, prompt_tokens, prompt_tokens * prompt_tokens if prompt_sq is None else prompt_sq)
        return t

    def prompt_s(self, batch: int, prompt_tokens: int, prompt_sq: float) -> float:
        """What `prompt_tokens` of prompts (attention pairs `prompt_sq`) add to a step of `batch` decoding sequences."""
        if batch and self.mixed:
            return self.mixed_base_s + self.mixed_per_token_s * prompt_tokens + self.mixed_per_token_sq_s * prompt_sq
        return self.prefill_base_s + self.prefill_per_token_s * prompt_tokens + self.prefill_per_token_sq_s * prompt_sq

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["decode_by_batch_s"] = [list(kt) for kt in self.decode_by_batch_s]
        d["decode_ctx_by_batch_s"] = [list(kc) for kc in self.decode_ctx_by_batch_s]
        return d


def pairs(done: int, take: int) -> int:
    """The attention work of a prompt chunk of `take` tokens after `done` of its prompt, in units where a whole
    prompt of p tokens is p squared (each token attends to those before it: (done + take)^2 - done^2)."""
    return (done + take) ** 2 - done * done


class _Seq:
    """One request inside the simulation. Its decoding is kept as step indices: every running sequence past its
    prompt decodes one token in every step, so its first token's step `first` says how many it has (`out`) at any
    step and the step it finishes; its gaps are the step times between."""

    __slots__ = ("req", "result", "scheduled", "prompt_left", "plen", "need", "first", "order", "ended_s")

    def __init__(self, req: Request, scheduled: float, t0: float) -> None:
        self.req = req
        self.scheduled = scheduled
        self.plen = len(req.prompt_ids)
        self.prompt_left = max(1, self.plen)  # an empty prompt still takes one token (BOS)
        self.need = self.prompt_left + req.max_tokens  # KV reserved at admission
        self.first = -1  # the step (index within the run) of its first token; -1 before
        self.order = 0  # admission order (ties between sequences finishing in one step)
        self.ended_s: float | None = None  # when it finished (virtual seconds)
        self.result = RequestResult(index=req.index, prompt_tokens=self.plen, send_s=scheduled - t0,
                                    dispatch_lag_ms=0.0)


class SimulatedEngine:
    """A continuous-batching engine in virtual time (see the module docstring)."""

    def __init__(self, model: StepModel, batch_cap: int, kv_tokens: int | None = None,
                 token_budget: int | None = None, seed: int = 0) -> None:
        if batch_cap < 1:
            raise TunerError(f"batch cap {batch_cap} is invalid: expected an integer >= 1")
        if kv_tokens is not None and kv_tokens < 1:
            raise TunerError(f"KV capacity {kv_tokens} tokens is invalid: expected an integer >= 1 or None")
        if token_budget is not None and token_budget < batch_cap:
            raise TunerError(f"token budget {token_budget} is invalid: expected an integer >= the batch cap "
                             f"({batch_cap}), so every running sequence can decode in a step")
        self.model, self.cap, self.kv_tokens, self.token_budget = model, batch_cap, kv_tokens, token_budget
        # the step noise: random.Random(f"simulated-engine-{seed}").lognormvariate(mu, sigma), value for value
        sigma = model.noise_sigma
        self.noise = LognormalStream(f"simulated-engine-{seed}", -sigma * sigma / 2.0, sigma) if sigma > 0 else None
        self.now = 0.0
        self.steps = 0  # steps simulated so far, all runs together
        self.batch_times = [model.batch_s(k) for k in range(batch_cap + 1)]  # a decoding step's base, per batch
        self.ctx_slopes = [model.ctx_slope(k) for k in range(batch_cap + 1)]  # ... and its context's cost per token

    def clock(self) -> float:
        """Virtual seconds since the engine was made (advanced by each run, and during one)."""
        return self.now

    def step_time_s(self, batch: int, context_tokens: int, prompt_tokens: int) -> float:
        t = self.model.step_s(batch, context_tokens, prompt_tokens)
        return t * self.noise.next() if self.noise is not None else t

    def stretch(self, k: int, decoding: int, ctx_decoding: int, t: float, t_prev: float, deadline: float,
                arrival_s: float, gaps_ms: list[float]) -> tuple[int, float]:
        """Up to `k` decode-only steps of `decoding` sequences over `ctx_decoding` context tokens from `t`, computed
        together with the step loop's own operations in its order (each step's time, its noise draw, the running sum
        of end times: `accumulate` adds one after another), so every figure is the loop's to the last bit. The
        stretch ends early after the step that reaches `arrival_s` (a request the next step's start admits) and
        before a step that would pass `deadline` (the loop itself takes that one). Appends the steps' gaps to
        `gaps_ms`, counts them in `steps`, consumes their noise; (steps taken, the last one's end)."""
        base, per_ctx = self.batch_times[decoding], self.ctx_slopes[decoding]
        if self.noise is not None:
            factors = self.noise.peek(k)
            dts = [(base + per_ctx * (ctx_decoding + decoding * j)) * f for j, f in enumerate(factors)]
        else:
            dts = [base + per_ctx * (ctx_decoding + decoding * j) for j in range(k)]
        ends = list(accumulate(dts, initial=t))
        del ends[0]
        m = k if ends[-1] <= deadline else bisect_right(ends, deadline)  # ends[:m] <= deadline
        if m and arrival_s <= ends[m - 1]:
            m = bisect_left(ends, arrival_s) + 1  # through the first end >= arrival_s
        if m == 0:
            return 0, t
        gaps_ms.append((ends[0] - t_prev) * 1e3)
        gaps_ms += [(b - a) * 1e3 for a, b in zip(ends, ends[1:m])]
        self.steps += m
        if self.noise is not None:
            self.noise.skip(m)
        return m, ends[m - 1]

    def run(self, requests: Sequence[Request], concurrency: int | None = None, timeout_s: float = 3600.0,
            should_stop: Callable[[list[RequestResult], int], str | None] | None = None,
            **_: Any) -> LoadResult:
        """Serve `requests` (open loop at their `arrival_s`, or closed loop at `concurrency`) from the current
        virtual time; the same contract as tuner.measure.loadgen.run_load (extra keywords such as `progress` ignored).

        Per step the work is O(1) plus the prompts in it: the decoding sequences are counted (`decoding`, their
        context `ctx_decoding`), not visited; each one's finishing step is known when its first token comes (a heap),
        and its gaps are a slice of the run's step gaps (`gaps_ms`, the same differences of step end times). Between
        one step with a prompt or a finish and the next, decode-only steps that nothing can interrupt (`stretch`) are
        computed together; the step noise comes in blocks (tuner.predict.noise: the same values)."""
        t0 = self.now
        n = len(requests)
        deadline = t0 + timeout_s
        seqs: list[_Seq | None] = [None] * n
        sent: list[_Seq] = []
        waiting: deque[_Seq] = deque()
        prefilling: list[_Seq] = []  # running, prompt not done (admission order)
        ending: list[tuple[int, int, _Seq]] = []  # (finishing step, admission order, seq) of the decoding ones
        done: list[_Seq] = []  # in the order they finished
        done_results: list[RequestResult] = []
        free_at: deque[float] = deque([t0] * concurrency) if concurrency else deque()
        cap, kv_cap = self.cap, self.kv_tokens
        model = self.model
        batch_times, ctx_slopes = self.batch_times, self.ctx_slopes
        pre_base, pre_tok = model.prefill_base_s, model.prefill_per_token_s
        mixed, mix_base, mix_tok = model.mixed, model.mixed_base_s, model.mixed_per_token_s
        pre_sq, mix_sq = model.prefill_per_token_sq_s, model.mixed_per_token_sq_s
        quadratic = pre_sq > 0 or mix_sq > 0
        noise = self.noise
        draw = noise.next if noise is not None else None
        budget_cap = self.token_budget
        gaps_ms: list[float] = []  # per step of this run: its end minus the previous step's end, ms
        kv_used = 0
        decoding = 0  # running requests past their prompt
        ctx_decoding = 0  # their context tokens
        admitted = 0
        cursor = 0  # next request to send
        reason: str | None = None
        finished_count = 0  # requests finished when `should_stop` ended the run
        t = t0
        t_prev = t0  # the previous step's end
        step = -1  # this run's last step

        def send_due() -> None:
            nonlocal cursor
            while cursor < n:
                req = requests[cursor]
                if concurrency:
                    if not free_at:
                        return
                    scheduled = free_at.popleft()
                else:
                    scheduled = t0 + (req.arrival_s or 0.0)
                    if scheduled > t:
                        return
                s = _Seq(req, scheduled, t0)
                seqs[cursor] = s
                sent.append(s)
                waiting.append(s)
                cursor += 1

        def finish(s: _Seq, out: int, error: str | None) -> None:
            r = s.result
            r.output_tokens, r.chunks, r.error = out, out, error
            if error is None:
                r.e2e_ms = (t - s.scheduled) * 1e3
                r.itl_ms = gaps_ms[s.first + 1:step + 1]
            s.ended_s = t
            done.append(s)
            done_results.append(r)
            if concurrency:
                free_at.append(t)

        while True:
            if reason is None and cursor < n and (free_at if concurrency
                                                  else t0 + (requests[cursor].arrival_s or 0.0) <= t):
                send_due()  # only when one is due (free_at: a closed loop's free slots)
            while waiting and len(prefilling) + decoding < cap:  # admission, FCFS
                head = waiting[0]
                if kv_cap is not None:
                    if head.need > kv_cap:
                        waiting.popleft()
                        finish(head, 0, f"prompt + max_tokens = {head.need} tokens exceed the KV capacity "
                                        f"({kv_cap} tokens)")
                        if reason is None:
                            send_due()
                        continue
                    if kv_used + head.need > kv_cap:
                        break
                    kv_used += head.need
                s = waiting.popleft()
                s.order = admitted
                admitted += 1
                prefilling.append(s)
            if not prefilling and not decoding:
                if waiting:  # only when every waiting request was rejected above and more were sent: go round
                    continue
                if reason is not None or cursor >= n:
                    break
                if concurrency:  # closed loop with nothing in flight: every slot is free, so all were sent
                    break
                t_next = t0 + (requests[cursor].arrival_s or 0.0)
                if t_next > deadline:
                    t = deadline
                    break
                t = max(t, t_next)  # idle until the next arrival
                self.now = t
                continue
            if not prefilling and ending[0][0] - step > STRETCH_MIN:
                # a stretch of decode-only steps up to the next finishing one: the same steps, computed together
                m, t_end = self.stretch(ending[0][0] - step - 1, decoding, ctx_decoding, t, t_prev, deadline,
                                        t0 + (requests[cursor].arrival_s or 0.0)
                                        if reason is None and cursor < n and not concurrency and not waiting
                                        and decoding < cap else math.inf, gaps_ms)
                if m:
                    step += m
                    ctx_decoding += decoding * m
                    t = t_prev = self.now = t_end
                    continue
            # one step: decodes first, then prompt tokens (whole, or what the token budget leaves)
            prompt_tokens = 0
            prompt_sq = 0  # the attention pairs of this step's prompt chunks (`pairs`), when the model prices them
            chunks: list[tuple[_Seq, int]] = []
            if prefilling:
                budget = math.inf if budget_cap is None else budget_cap - decoding
                for s in prefilling:
                    if budget <= 0:
                        break
                    take = int(min(s.prompt_left, budget))
                    chunks.append((s, take))
                    prompt_tokens += take
                    if quadratic:
                        prompt_sq += pairs(max(1, s.plen) - s.prompt_left, take)
                    budget -= take
            dt = batch_times[decoding] + ctx_slopes[decoding] * ctx_decoding
            if prompt_tokens:
                dt += ((mix_base + mix_tok * prompt_tokens + mix_sq * prompt_sq) if mixed and decoding
                       else pre_base + pre_tok * prompt_tokens + pre_sq * prompt_sq)
            if draw is not None:
                dt *= draw()
            self.steps += 1
            if t + dt > deadline:
                t = deadline
                break
            t += dt
            self.now = t
            step += 1
            gaps_ms.append((t - t_prev) * 1e3)
            t_prev = t
            ctx_decoding += decoding
            started = False
            for s, take in chunks:
                s.prompt_left -= take
                if s.prompt_left == 0:  # its first token
                    s.result.ttft_ms = (t - s.scheduled) * 1e3
                    s.first = step
                    started = True
                    decoding += 1
                    ctx_decoding += s.plen + 1
                    heapq.heappush(ending, (step + max(s.req.max_tokens, 1) - 1, s.order, s))
            if started:
                prefilling = [s for s in prefilling if s.prompt_left]
            if ending and ending[0][0] == step:
                while ending and ending[0][0] == step:
                    s = heapq.heappop(ending)[2]
                    if kv_cap is not None:
                        kv_used -= s.need
                    decoding -= 1
                    ctx_decoding -= s.plen + 1 + step - s.first
                    finish(s, step - s.first + 1, None)
                if should_stop is not None and reason is None:
                    reason = should_stop(list(done_results), n)
                    if reason is not None:
                        finished_count = len(done)
        self.now = t
        finished = done[:finished_count] if reason is not None else done
        finished_ids = {id(s) for s in finished}
        if reason is not None:  # the requests handed over ran to their end (settle); only the finished count
            results = [s.result for s in sent if id(s) in finished_ids]
        else:
            results = []
            for i, req in enumerate(requests):
                seq = seqs[i]
                if seq is None:
                    results.append(RequestResult(index=req.index, prompt_tokens=len(req.prompt_ids),
                                                 error="not sent: run timed out"))
                    continue
                if id(seq) not in finished_ids:
                    out = step - seq.first + 1 if seq.first >= 0 else 0
                    seq.result.output_tokens = seq.result.chunks = out
                    if seq.first >= 0:
                        seq.result.itl_ms = gaps_ms[seq.first + 1:step + 1]
                    seq.result.error = f"timed out after {timeout_s:g}s"
                results.append(seq.result)
        end = max((s.ended_s for s in finished if s.ended_s is not None), default=t0)
        first = min((s.scheduled for s in sent), default=t0)
        last = max((s.scheduled for s in sent), default=None)
        return LoadResult(results=results, duration_s=end - first, token_ids=[[] for _ in requests],
                          stopped_reason=reason, sent=len(sent), last_send_s=None if last is None else last - t0)
