"""A deterministic-timing fake engine for tests of the harness (load generator, capacity search) only.

`servers` requests run at once (a FIFO queue in front, like a batch cap); a request's first chunk comes
`prefill_s` after it starts, then one chunk of `chunk` tokens every `chunk * token_s`. Real threads and real
sleeps: what is under test is the harness's clock, not the engine's. `paced`: each chunk is due at those offsets
from the request's start (a late wake-up on a busy host delays that chunk, not every later one), so a request's
service time holds at its figure, as a faster fake needs; by default each sleep follows the last chunk.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from tuner.engines.base import Capabilities, Engine, TokenSink


class FakeEngine(Engine):
    def __init__(self, servers: int = 1, prefill_s: float = 0.01, token_s: float = 0.005, chunk: int = 1,
                 slow: Callable[[int], float] | None = None, submit_delay_s: float = 0.0, paced: bool = False) -> None:
        self.servers, self.prefill_s, self.token_s, self.chunk = servers, prefill_s, token_s, chunk
        self.slow = slow or (lambda n: 1.0)  # service-time factor for the n-th request started
        self.submit_delay_s = submit_delay_s
        self.paced = paced
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.in_flight = 0  # submitted, not finished
        self.max_in_flight = 0
        self.started = 0
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._threads: list[threading.Thread] = []

    def capabilities(self) -> Capabilities:
        return Capabilities("fake")

    def start(self) -> None:
        for _ in range(self.servers):
            t = threading.Thread(target=self._serve, daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int, sink: TokenSink) -> None:
        if self.submit_delay_s:
            time.sleep(self.submit_delay_s)
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._q.put((max_tokens, sink))

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                max_tokens, sink = self._q.get(timeout=0.01)
            except queue.Empty:
                continue
            with self._lock:
                self.running += 1
                self.max_running = max(self.max_running, self.running)
                factor = self.slow(self.started)
                self.started += 1
            due = time.perf_counter() + self.prefill_s * factor
            self._wait(due, self.prefill_s * factor)
            sent = 0
            while sent < max_tokens and not self._abandon.is_set():
                k = min(self.chunk if sent else 1, max_tokens - sent)
                if sent:
                    due += self.token_s * k * factor
                    self._wait(due, self.token_s * k * factor)
                sink.on_tokens(list(range(sent, sent + k)), time.perf_counter())
                sent += k
            with self._lock:
                self.running -= 1
                self.in_flight -= 1
            sink.on_finish("abandoned" if self._abandon.is_set() else None)

    def _wait(self, due: float, step_s: float) -> None:
        time.sleep(max(0.0, due - time.perf_counter()) if self.paced else step_s)

    def stop(self, drain: bool = True) -> None:
        if drain:
            while not self._q.empty() or self.running:
                time.sleep(0.01)
        else:
            self._abandon.set()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
