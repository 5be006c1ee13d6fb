"""Load generator: send a workload to an engine as it arrives, stamp every token, never raise per request.

Open loop: each request is *scheduled* at its arrival time (Poisson / constant / trace) and handed to the engine
as close to it as the harness can; closed loop: `concurrency` requests are kept in flight, a request being
scheduled the moment a slot frees. Latencies count from the scheduled time (see tuner.measure.metrics), and the gap
between scheduled and actual hand-over is recorded as `dispatch_lag_ms`, so a harness that falls behind shows up
in the figures instead of hiding queueing (coordinated omission).

Threads: the engine calls each request's sink from its own thread(s); a sink only stamps and appends under a
per-request lock. Every decision (sending, early stop, time-out) is taken on the calling thread, never on the
engine's token-delivery thread. When `run_load` returns, every result is frozen: a request still running then
is recorded as failed (timed out / not finished), and whatever the engine delivers afterwards (while it is
stopped) is ignored. A run stopped early (`should_stop`) with `settle` returns only once the requests it had handed
over have ended in the engine (up to its deadline): otherwise they would still be running, unseen, under the next
run.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tuner.engines.base import Engine
from tuner.measure.metrics import RequestResult
from tuner.measure.workload import Request

POLL_S = 0.05  # how often the run loop wakes without an event (time-out checks)


class _Recorder:
    """TokenSink for one request: stamps chunks with the harness clock (time.perf_counter)."""

    def __init__(self, request: Request, t0: float, finished: Callable[[_Recorder], None]) -> None:
        self.request, self.t0, self._finished_cb = request, t0, finished
        self.result = RequestResult(index=request.index, prompt_tokens=len(request.prompt_ids))
        self.scheduled = 0.0
        self.sent = 0.0
        self.last = 0.0
        self.tokens: list[int] = []
        self.finished = threading.Event()
        self.ended = threading.Event()  # the engine is done with it (also after the results were frozen)
        self.frozen = False
        self._lock = threading.Lock()

    def mark_sent(self, scheduled: float) -> None:
        self.sent = time.perf_counter()
        self.scheduled = min(scheduled, self.sent)
        self.result.send_s = self.scheduled - self.t0
        self.result.dispatch_lag_ms = (self.sent - self.scheduled) * 1e3

    def on_tokens(self, token_ids: list[int], engine_time_s: float | None) -> None:
        now = time.perf_counter()
        if not token_ids:
            return
        with self._lock:
            if self.frozen or self.finished.is_set():
                return
            r = self.result
            if not self.tokens:
                r.ttft_ms = (now - self.scheduled) * 1e3
                if engine_time_s is not None:
                    r.harness_overhead_ms = (now - engine_time_s) * 1e3
            else:
                r.itl_ms.append((now - self.last) * 1e3)  # one gap per chunk (vLLM's convention)
            r.chunks += 1
            self.tokens.extend(token_ids)
            r.output_tokens = len(self.tokens)
            self.last = now

    def on_finish(self, error: str | None, draft_proposed: int = 0, draft_accepted: int = 0) -> None:
        now = time.perf_counter()
        self.ended.set()
        with self._lock:
            if self.frozen or self.finished.is_set():
                return
            r = self.result
            r.output_tokens = len(self.tokens)
            r.e2e_ms = ((self.last if self.tokens else now) - self.scheduled) * 1e3  # E2E at the last token
            r.error = error
            if error is None and not self.tokens:
                r.error = "engine returned zero tokens without an error"
            r.draft_proposed, r.draft_accepted = draft_proposed, draft_accepted
            self.finish_time = now
            self.finished.set()
        self._finished_cb(self)

    def freeze(self, error: str | None) -> RequestResult:
        """Stop accepting callbacks and return a copy of the result (`error` for a request not finished)."""
        with self._lock:
            self.frozen = True
            r = replace(self.result, itl_ms=list(self.result.itl_ms))
            if not self.finished.is_set():
                r.error = error
                r.output_tokens = len(self.tokens)
                r.e2e_ms = None
            return r


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration_s: float  # first scheduled send to last completion
    token_ids: list[list[int]]  # generated ids per request (in request order), for output checks
    stopped_reason: str | None = None  # early stop (pruned) reason
    sent: int = 0  # requests handed to the engine (a stopped run's results hold only those that finished)
    last_send_s: float | None = None  # when the last of them was scheduled, from the run's start


def run_load(
    engine: Engine,
    requests: Sequence[Request],
    concurrency: int | None = None,
    timeout_s: float = 3600.0,
    should_stop: Callable[[list[RequestResult], int], str | None] | None = None,
    progress: bool = True,
    settle: bool = False,
) -> LoadResult:
    """Drive `requests` through a started engine. `should_stop(finished_results, total)` may end the run early; it
    is called on this thread after new requests finish. A pruned run returns only the requests that finished;
    with `settle` it returns once the requests it had handed over have ended in the engine (up to the deadline), so
    the next run starts on an idle engine (the capacity search's probes; `tuner bench --stop-if` abandons them)."""
    from tqdm import tqdm

    wake = threading.Event()
    lock = threading.Lock()
    newly_done: list[_Recorder] = []

    def finished(rec: _Recorder) -> None:  # engine thread: record and wake the run loop, nothing else
        with lock:
            newly_done.append(rec)
        wake.set()

    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()
    recorders = [_Recorder(r, t0, finished) for r in requests]
    pending = deque(recorders)
    sent: list[_Recorder] = []
    done: list[_Recorder] = []
    free_at: deque[float] = deque([t0] * concurrency) if concurrency else deque()  # closed loop: slot free times
    deadline = t0 + timeout_s
    reason: str | None = None
    while True:
        with lock:
            new, newly_done[:] = list(newly_done), []
        if new:
            done.extend(new)
            bar.update(len(new))
            if concurrency:
                free_at.extend(rec.finish_time for rec in new)
            if should_stop is not None:
                reason = should_stop([rec.result for rec in done], len(requests))
                if reason:
                    break
        if len(done) == len(requests):
            break
        now = time.perf_counter()
        if now > deadline:
            break
        while pending:
            if concurrency:
                if not free_at:
                    break
                scheduled = free_at.popleft()
            else:
                arrival = pending[0].request.arrival_s or 0.0
                scheduled = t0 + arrival
                if scheduled > now:
                    break
            rec = pending.popleft()
            rec.mark_sent(scheduled)
            sent.append(rec)
            engine.submit(f"r{rec.request.index}", list(rec.request.prompt_ids), rec.request.max_tokens, rec)
            now = time.perf_counter()
        next_send = (t0 + (pending[0].request.arrival_s or 0.0)) if pending and not concurrency else deadline
        wake.wait(timeout=max(0.0, min(next_send, deadline, now + POLL_S) - now))
        wake.clear()
    bar.close()
    sent_set = set(map(id, sent))
    results = []
    for rec in recorders:
        if id(rec) in sent_set:
            err = f"timed out after {timeout_s:g}s" if reason is None else "not finished: run stopped early"
        else:
            err = "not sent: run stopped early" if reason else "not sent: run timed out"
        results.append(rec.freeze(err))
    finished_ids = {r.index for r in (rec.result for rec in done)}
    end = max((rec.finish_time for rec in done), default=t0)
    first = min((rec.scheduled for rec in sent), default=t0)
    token_ids = [list(rec.tokens) for rec in recorders]
    if reason:  # pruned runs only count what finished
        results = [r for r in results if r.index in finished_ids]
        # the requests already handed to the engine still run there: wait for them (up to the run's deadline), so
        # whatever runs next (the next probe) starts on an idle engine; their results stay as frozen above
        for rec in sent if settle else []:
            rec.ended.wait(timeout=max(0.0, deadline - time.perf_counter()))
    last = max((rec.scheduled for rec in sent), default=None)
    return LoadResult(results, end - first, token_ids, reason, len(sent), None if last is None else last - t0)
