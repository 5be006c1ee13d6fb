"""The engine contract every engine passes (Optuna's `StorageTestCase` pattern): a subclass says how to build a
started engine for a batch cap, and inherits every test. Real engines, real small model, driven by the real load
generator (tuner.measure.loadgen.run_load) -- nothing here is faked.

Subclasses set `name` and implement `make_engine(batch_cap) -> Engine` (not started) and `tokenizer()`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tuner.measure.loadgen import run_load
from tuner.measure.workload import WorkloadSpec, build_workload, with_arrivals


class Sink:
    """A TokenSink that records what the engine delivered, and how often it finished the request."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finished = 0
        self.error: str | None = None
        self.done = threading.Event()

    def on_tokens(self, token_ids: list[int], engine_time_s: float | None) -> None:
        self.tokens.extend(token_ids)

    def on_finish(self, error: str | None, draft_proposed: int = 0, draft_accepted: int = 0) -> None:
        self.finished += 1
        self.error = error
        self.done.set()


def peak_generating(results: list[Any]) -> int:
    """Most requests ever between their first and last token, from the harness's own timestamps."""
    spans = [(r.send_s + r.ttft_ms / 1e3, r.send_s + r.e2e_ms / 1e3) for r in results if r.ok]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


class EngineContract:
    name = "?"

    def make_engine(self, batch_cap: int) -> Any:
        raise NotImplementedError

    def tokenizer(self) -> Any:
        raise NotImplementedError

    def alive_pids(self, engine: Any) -> list[int]:
        return engine.server_pids()

    def engine_to_stop(self, request: pytest.FixtureRequest) -> Any:
        """A started engine at batch cap 2 that the stop test stops: a fresh one (a subclass whose start is costly
        may hand over the one its reading tests shared, which they leave as they found it)."""
        engine = self.make_engine(2)
        engine.start()
        return engine

    # ------------------------------------------------------------------------------------------ helpers --- #
    def requests(self, n: int, out_len: tuple[int, int], seed: int = 3) -> list[Any]:
        spec = WorkloadSpec(requests=n, rate=None, concurrency=n, input_len=(16, 48), output_len=out_len, seed=seed)
        return with_arrivals(build_workload(spec, self.tokenizer()), None, "poisson", 0)

    @pytest.fixture
    def engine2(self):
        e = self.make_engine(2)
        e.start()
        yield e
        e.stop(drain=False)

    # ------------------------------------------------------------------------------------------- tests --- #
    def test_exact_output_lengths_streamed_in_order(self, engine2):
        """ignore-EOS: every request gets exactly its max_tokens, TTFT <= E2E, and greedy decoding of the same
        prompt twice streams the same token ids."""
        reqs = self.requests(4, (9, 17))
        load = run_load(engine2, reqs, concurrency=4, timeout_s=300, progress=False)
        assert [r.error for r in load.results] == [None] * 4
        assert [r.output_tokens for r in load.results] == [q.max_tokens for q in reqs]
        assert [len(t) for t in load.token_ids] == [q.max_tokens for q in reqs]
        assert all(0 < r.ttft_ms <= r.e2e_ms for r in load.results)
        again = run_load(engine2, reqs[:1], concurrency=1, timeout_s=300, progress=False)
        assert again.token_ids[0] == load.token_ids[0]

    def test_batch_cap_is_honoured(self, engine2):
        """6 requests offered at once, cap 2: never more than 2 between their first and last token."""
        reqs = self.requests(6, (12, 12))
        load = run_load(engine2, reqs, concurrency=6, timeout_s=300, progress=False)
        assert all(r.ok for r in load.results), [r.error for r in load.results]
        assert peak_generating(load.results) == 2

    def test_a_bad_request_is_data_and_the_engine_keeps_serving(self, engine2):
        """A prompt with a token id outside the vocabulary finishes with an error (never raised, finished once),
        and the next good request is served."""
        bad, good = Sink(), Sink()
        engine2.submit("bad", [10**8, 1, 2], 4, bad)
        assert bad.done.wait(60)
        assert bad.finished == 1 and bad.error, bad.error
        engine2.submit("good", list(self.requests(1, (5, 5))[0].prompt_ids), 5, good)
        assert good.done.wait(120)
        assert (good.error, len(good.tokens), good.finished) == (None, 5, 1)

    def test_stop_without_drain_finishes_every_request_once_and_leaves_nothing_running(self, request):
        engine = self.engine_to_stop(request)
        pids = self.alive_pids(engine)
        sinks = [Sink() for _ in range(4)]
        for i, (s, q) in enumerate(zip(sinks, self.requests(4, (400, 400)))):
            engine.submit(f"r{i}", list(q.prompt_ids), q.max_tokens, s)
        time.sleep(1.0)
        engine.stop(drain=False)
        assert all(s.done.wait(30) for s in sinks)
        assert [s.finished for s in sinks] == [1, 1, 1, 1]
        assert any(s.error for s in sinks)  # 400 tokens cannot all be done within a second here
        time.sleep(0.5)
        import psutil

        assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []
