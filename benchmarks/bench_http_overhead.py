"""The harness's own overhead over HTTP, isolated: tuner's streaming client (tuner.engines.llamacpp.LlamaCppClient,
the one every llama.cpp measurement uses) against a null server that answers llama.cpp's streaming `/completion`
wire format at once, stamping when it received the request and when it wrote the first event.

    overhead per request = (client: first token seen - submit) - (server: first event written - request received)

i.e. everything between the load generator and the server's socket both ways: JSON encoding, aiohttp, the kernel's
loopback, SSE parsing, the sink. Goal: median < 1 ms. Printed with its n and a distribution-free 95% interval, at
concurrency 1 and 8. (A real server adds its own work outside the measured prompt time: `engine.harness_check` in a
bench JSON reports client TTFT minus llama-server's prompt_ms, which includes that.)

Usage: .venv/bin/python benchmarks/bench_http_overhead.py [--requests 400]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NULL_SERVER = r'''
import json, sys, time
from aiohttp import web

async def completion(request):
    recv = time.time()
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(int(body.get("n_predict", 4))):
        ev = {"tokens": [7], "stop": False}
        if i == 0:
            ev.update(rid=body.get("rid"), srv_recv=recv, srv_first=time.time())
        await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
    await resp.write(b"data: " + json.dumps({"tokens": [], "stop": True, "timings": {}}).encode() + b"\n\n")
    await resp.write_eof()
    return resp

async def health(request):
    return web.Response(text="ok")

app = web.Application()
app.add_routes([web.post("/completion", completion), web.get("/health", health)])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
'''


class Stamp:
    """A sink that stamps the submit and the first token (wall clock: the server stamps with the same clock)."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.first: float | None = None
        self.error: str | None = None
        self.done = threading.Event()

    def on_tokens(self, token_ids: list[int], engine_time_s: float | None) -> None:
        if self.first is None:
            self.first = time.time()

    def on_finish(self, error: str | None, draft_proposed: int = 0, draft_accepted: int = 0) -> None:
        self.error = error
        self.done.set()


def make_client(url: str):
    from tuner.engines.llamacpp import LlamaCppClient

    class StampedClient(LlamaCppClient):
        """The real client; the request carries its id and the server's stamps are kept from the first event."""

        def __init__(self) -> None:
            super().__init__(url, ignore_eos=True)
            self.server_stamps: dict[str, tuple[float, float]] = {}
            self._rid = ""

        def submit(self, request_id, prompt_ids, max_tokens, sink) -> None:
            self._rid = request_id  # request_body runs inside submit, on this thread
            super().submit(request_id, prompt_ids, max_tokens, sink)

        def request_body(self, prompt_ids, max_tokens):
            return {**super().request_body(prompt_ids, max_tokens), "rid": self._rid}

        def parse_event(self, data):
            if "srv_recv" in data:
                self.server_stamps[data["rid"]] = (data["srv_recv"], data["srv_first"])
            return super().parse_event(data)

    return StampedClient()


def run(client, n: int, concurrency: int, tag: str) -> list[float]:
    """n requests in waves of `concurrency`; per request the client's TTFT minus the server's own."""
    out: list[float] = []
    for start in range(0, n, concurrency):
        wave = [(f"{tag}{i}", Stamp()) for i in range(start, min(n, start + concurrency))]
        for rid, s in wave:
            s.sent = time.time()
            client.submit(rid, [1, 2, 3, 4], 4, s)
        for rid, s in wave:
            s.done.wait(30)
            if s.error is None and s.first is not None and rid in client.server_stamps:
                recv, first = client.server_stamps[rid]
                out.append(((s.first - s.sent) - (first - recv)) * 1000.0)
    return out


def main() -> int:
    import urllib.request

    from tuner.engines.server import free_port
    from tuner.stats import quantile_ci

    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=400)
    args = p.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", NULL_SERVER, str(port)])
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        client = make_client(f"http://127.0.0.1:{port}")
        client.open()
        try:
            run(client, 20, 1, "warm")  # the connection pool and the event loop
            for conc in (1, 8):
                o = sorted(run(client, args.requests, conc, f"c{conc}-"))
                lo, hi = quantile_ci(o, 0.5, 0.95)
                print(f"concurrency {conc}: harness overhead over HTTP, median {statistics.median(o):.3f} ms "
                      f"[{lo:.3f}, {hi:.3f}] (n={len(o)}), p90 {o[int(0.9 * (len(o) - 1))]:.3f} ms "
                      "(goal: median < 1 ms)", flush=True)
        finally:
            client.close(drain=True)
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
