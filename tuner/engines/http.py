"""Streaming HTTP client behind the engine contract: `submit` hands a request to an asyncio loop (aiohttp) on its
own thread; each server-sent event becomes `sink.on_tokens`, the end of the stream `sink.on_finish`.

A request never raises: a refused connection, an HTTP error status, a malformed event or a stream that ends
without its final event all finish the request with a one-line error. A server engine subclasses `StreamingClient`
for its wire format (`request_body`, `parse_event`).

One connection per request (`Connection: close`, never pooled): llama-server (llama.cpp 0c1e57098, cpp-httplib
0.58) closes the connection after every streamed response although its headers said `Keep-Alive: timeout=5,
max=100` (its chunk provider ends the stream with `sink.done()` and returns false, which httplib takes as "close").
A pooling client puts that connection back in its pool; when the next request takes it before the server's FIN is
read, the request body cannot be written and the request is lost (1-3 of 16 at concurrency = slots, measured). A
fresh loopback connection costs ~0.1 ms, inside the measured TTFT as it would be for any client. A request that
failed before it reached the server says so: "not sent: ...", it is no measurement of the server.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from tuner.engines.base import TokenSink


@dataclass
class Event:
    """One parsed server-sent event."""

    token_ids: list[int] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    final: dict[str, Any] = field(default_factory=dict)  # the last event's server-side facts (timings, counters)


def not_sent(e: BaseException) -> bool:
    """Whether a request failed before the server could have received it: no connection was made, or the request
    body could not be written (aiohttp's own wording for a write to a closed connection)."""
    import aiohttp

    return isinstance(e, aiohttp.ClientConnectorError) or (
        isinstance(e, aiohttp.ClientOSError) and "Can not write request body" in str(e))


class StreamingClient:
    path = "/completion"
    ends_at_done = False  # `data: [DONE]` is the end of a good stream (OpenAI style), not a premature end

    def __init__(self, base_url: str, request_timeout_s: float = 1800.0) -> None:
        self.base_url = base_url
        self.request_timeout_s = request_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: Any = None
        self._tasks: set[asyncio.Future] = set()
        self.finals: dict[str, dict[str, Any]] = {}  # request id -> the server's own figures for it

    # -------------------------------------------------------------- wire format (per server) --- #
    def request_body(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        raise NotImplementedError

    def parse_event(self, data: dict[str, Any]) -> Event:
        raise NotImplementedError

    def draft_counts(self, final: dict[str, Any]) -> tuple[int, int]:
        return 0, 0

    def headers(self) -> dict[str, str]:
        """Sent with every request (an API key's Authorization header)."""
        return {}

    # ------------------------------------------------------------------------------ lifecycle --- #
    def open(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="http-client", daemon=True)
        self._thread.start()
        ready.wait()

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int, sink: TokenSink) -> None:
        assert self.loop is not None, "open() first"
        body = self.request_body(list(prompt_ids), max_tokens)

        def schedule() -> None:
            task = asyncio.ensure_future(self._stream(request_id, body, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self.loop.call_soon_threadsafe(schedule)

    async def _ensure_session(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                headers={"Connection": "close", **self.headers()},
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=10))
        return self._session

    async def _stream(self, request_id: str, body: dict[str, Any], sink: TokenSink) -> None:
        error: str | None = "stream ended before the server's final event"
        final: dict[str, Any] = {}
        try:
            session = await self._ensure_session()
            async with session.post(self.base_url + self.path, json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300].replace("\n", " ")
                    error = f"HTTP {resp.status}: {text}"
                else:
                    n = 0
                    async for ev in self._events(resp):
                        if ev.token_ids:
                            sink.on_tokens(ev.token_ids, None)
                            n += len(ev.token_ids)
                        if ev.error:
                            error = ev.error
                            break
                        if ev.done:
                            error, final = None, ev.final
                            break
                    missing = int(final.get("completion_tokens") or 0) - n
                    if missing > 0:  # the server's own count (usage) is the truth when chunks did not say
                        sink.on_tokens([-1] * missing, None)
        except asyncio.CancelledError:
            error = "request cancelled: engine stopped"
        except Exception as e:  # connection refused or reset, timeout, bad JSON: data, never raised
            msg = str(e).splitlines()[0] if str(e) else ""
            error = f"{type(e).__name__}: {msg}".rstrip(": ")
            if not_sent(e):
                error = f"not sent (the server never received this request): {error}"
        self.finals[request_id] = final
        proposed, accepted = self.draft_counts(final) if final else (0, 0)
        sink.on_finish(error, proposed, accepted)

    async def _events(self, resp: Any) -> Any:
        """Server-sent events: `data: {json}` lines; `data: [DONE]` ends (OpenAI style)."""
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                line = line.strip()
                if not line.startswith(b"data:"):
                    if line.startswith(b"error:"):
                        yield Event(error=line.decode(errors="replace")[:300])
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    if self.ends_at_done:
                        yield Event(done=True)
                    return
                try:
                    data = json.loads(payload)
                except ValueError:
                    yield Event(error=f"malformed event from the server: {payload[:120]!r}")
                    return
                if isinstance(data, dict) and "error" in data and not data.get("choices"):
                    err = data["error"]
                    yield Event(error=f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
                    return
                yield self.parse_event(data)

    def close(self, drain: bool, drain_timeout_s: float = 60.0) -> None:
        """drain=True waits for in-flight requests (up to `drain_timeout_s`), then cancels what is left."""
        if self.loop is None:
            return
        loop = self.loop

        async def shutdown() -> None:
            pending = [t for t in self._tasks if not t.done()]
            if pending and drain:
                await asyncio.wait(pending, timeout=drain_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            if self._session is not None:
                await self._session.close()
                self._session = None

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=drain_timeout_s + 30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            loop.close()
            self.loop = None
