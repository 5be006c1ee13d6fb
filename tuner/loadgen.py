"""Load generator: send a workload to an engine as it arrives, stamp every token, never raise per request.

Open loop: each request is sent at its arrival time (Poisson / constant / trace). Closed loop: `concurrency`
requests are kept in flight; the next one is sent when one finishes. TTFT counts from the moment the request is
handed to the engine, so time spent queued inside the engine (waiting for a batch slot) is included.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tuner.engines.base import Engine
from tuner.metrics import RequestResult
from tuner.workload import Request


class _Recorder:
    """TokenSink for one request: stamps tokens with the harness clock (time.perf_counter)."""

    def __init__(self, request: Request, t0: float, done: Callable[[_Recorder], None]) -> None:
        self.request, self.t0, self._done = request, t0, done
        self.result = RequestResult(index=request.index, prompt_tokens=len(request.prompt_ids))
        self.sent = 0.0
        self.last = 0.0
        self.tokens: list[int] = []
        self.finished = threading.Event()

    def mark_sent(self) -> None:
        self.sent = time.perf_counter()
        self.result.send_s = self.sent - self.t0

    def on_tokens(self, token_ids: list[int], engine_time_s: float | None) -> None:
        now = time.perf_counter()
        if not token_ids:
            return
        if not self.tokens:
            self.result.ttft_ms = (now - self.sent) * 1e3
            if engine_time_s is not None:
                self.result.harness_overhead_ms = (now - engine_time_s) * 1e3
        else:
            self.result.itl_ms.append((now - self.last) * 1e3)
        self.result.itl_ms.extend([0.0] * (len(token_ids) - 1))  # tokens delivered together (accepted drafts)
        self.tokens.extend(token_ids)
        self.last = now

    def on_finish(self, error: str | None, draft_proposed: int = 0, draft_accepted: int = 0) -> None:
        if self.finished.is_set():
            return
        now = time.perf_counter()
        r = self.result
        r.output_tokens = len(self.tokens)
        r.e2e_ms = (now - self.sent) * 1e3
        r.error = error
        if error is None and not self.tokens:
            r.error = "engine returned zero tokens without an error"
        r.draft_proposed, r.draft_accepted = draft_proposed, draft_accepted
        self.finished.set()
        self._done(self)


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration_s: float  # first send to last completion
    token_ids: list[list[int]]  # generated ids per request (in request order), for output checks
    stopped_reason: str | None = None  # early stop (pruned) reason


def run_load(
    engine: Engine,
    requests: Sequence[Request],
    concurrency: int | None = None,
    timeout_s: float = 3600.0,
    should_stop: Callable[[list[RequestResult], int], str | None] | None = None,
    progress: bool = True,
) -> LoadResult:
    """Drive `requests` through a started engine. `should_stop(finished_results, total)` may end the run early."""
    from tqdm import tqdm

    lock = threading.Lock()
    finished: list[RequestResult] = []
    all_done = threading.Event()
    stop_reason: list[str] = []
    slots = threading.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()

    def done(rec: _Recorder) -> None:
        with lock:
            finished.append(rec.result)
            n = len(finished)
            if should_stop is not None and not stop_reason:
                reason = should_stop(list(finished), len(requests))
                if reason:
                    stop_reason.append(reason)
        bar.update(1)
        if slots is not None:
            slots.release()
        if n == len(requests) or stop_reason:
            all_done.set()

    recorders = [_Recorder(r, t0, done) for r in requests]
    sent: list[_Recorder] = []
    deadline = t0 + timeout_s
    for rec in recorders:
        if stop_reason or time.perf_counter() > deadline:
            break
        if slots is not None:
            while not slots.acquire(timeout=0.1):
                if stop_reason or time.perf_counter() > deadline:
                    break
            else:
                pass
            if stop_reason or time.perf_counter() > deadline:
                break
        elif rec.request.arrival_s is not None:
            delay = t0 + rec.request.arrival_s - time.perf_counter()
            if delay > 0 and all_done.wait(timeout=delay):
                break
        rec.mark_sent()
        sent.append(rec)
        engine.submit(f"r{rec.request.index}", list(rec.request.prompt_ids), rec.request.max_tokens, rec)
    all_done.wait(timeout=max(0.0, deadline - time.perf_counter()))
    bar.close()
    end = max((rec.sent + (rec.result.e2e_ms or 0) / 1e3 for rec in sent if rec.finished.is_set()), default=t0)
    first = min((rec.sent for rec in sent), default=t0)
    reason = stop_reason[0] if stop_reason else None
    results = []
    for rec in recorders:
        if not rec.finished.is_set():
            rec.result.error = (
                "not sent: run stopped early" if rec not in sent and reason
                else f"timed out after {timeout_s:.0f}s" if rec in sent else "not sent: run timed out"
            )
            rec.result.output_tokens = len(rec.tokens)
        results.append(rec.result)
    if reason:  # pruned runs only count what finished
        results = [rec.result for rec in recorders if rec.finished.is_set()]
    return LoadResult(results, end - first, [list(rec.tokens) for rec in recorders], reason)
