"""The streaming HTTP client loses nothing a plain client would not: llama-server closes the connection after every
streamed response (while its headers say keep-alive), so a client that pools connections re-used a closing one and
lost the request ("Can not write request body"). One connection per request; a request that never reached the
server says so."""

from __future__ import annotations

import threading

from tuner.config import TrialConfig

MODEL = "smollm2-135m"


class Sink:
    def __init__(self) -> None:
        self.tokens, self.error, self.done = 0, None, threading.Event()

    def on_tokens(self, token_ids, engine_time_s) -> None:
        self.tokens += len(token_ids)

    def on_finish(self, error, draft_proposed=0, draft_accepted=0) -> None:
        self.error = error
        self.done.set()


def test_closed_loop_at_the_slot_count_loses_no_request_and_the_server_saw_each():
    """Closed loop at concurrency = slots with short requests: each request starts the moment one ends, the moment
    the old pooled client re-used the connection the server was closing (it lost 5-20% of them, measured)."""
    from tuner.engines.llamacpp import LlamaCppEngine
    from tuner.measure.loadgen import run_load
    from tuner.measure.workload import WorkloadSpec, build_workload, with_arrivals
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    tok = load_tokenizer(checkpoint_dir(MODEL))
    reqs = with_arrivals(build_workload(WorkloadSpec(requests=48, rate=None, concurrency=4, input_len=(16, 24),
                                                     output_len=(2, 2)), tok), None, "poisson", 0)
    e = LlamaCppEngine(TrialConfig(model=MODEL, engine="llamacpp", quant="Q8_0", batch_cap=4, kv_fraction=0.002))
    e.start()
    try:
        load = run_load(e, reqs, concurrency=4, timeout_s=600, progress=False)
        seen = e.request_timings()  # the server's own timings, one per request it served
    finally:
        e.stop()
    errors = [r.error for r in load.results if not r.ok]
    assert errors == [], f"{len(errors)} of {len(reqs)} lost: {sorted(set(errors))[:2]}"
    assert all(seen.get(f"r{r.index}", {}).get("predicted_n") == r.max_tokens for r in reqs)


def test_a_request_that_never_reached_a_server_says_so():
    """Failure injection: nothing listens on the port; the request is not a measurement of any server."""
    from tuner.engines.llamacpp import LlamaCppClient
    from tuner.engines.server import free_port

    client = LlamaCppClient(f"http://127.0.0.1:{free_port()}", ignore_eos=True)
    client.open()
    try:
        sink = Sink()
        client.submit("r0", [1, 2, 3], 4, sink)
        assert sink.done.wait(30)
    finally:
        client.close(drain=True)
    assert sink.error.startswith("not sent (the server never received this request): ClientConnectorError"), \
        sink.error
