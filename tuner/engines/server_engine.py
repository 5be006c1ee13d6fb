"""The lifecycle every server engine shares (llama.cpp, vLLM): `prepare()` resolves the argv from the target's
exporter (one source of truth), `start()` launches it on a free local port and opens the streaming client,
`submit` streams one request, `stop()` closes the client and stops the server with everything it started.

A subclass provides `prepare()` (fills `argv`, `env`, `exported_argv`), `make_client(url)` and `capabilities()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.base import Engine, TokenSink
from tuner.engines.http import StreamingClient
from tuner.engines.server import ServerFailed, ServerProcess, free_port


class ServerEngine(Engine):
    health_path = "/health"
    startup_timeout_s = 300.0

    def __init__(self, config: TrialConfig, ignore_eos: bool = True, log_path: Path | None = None) -> None:
        self.config, self.ignore_eos, self.log_path = config, ignore_eos, log_path
        self.server: ServerProcess | None = None
        self.client: StreamingClient | None = None
        self.argv: list[str] = []  # what is launched (+ --host/--port)
        self.env: dict[str, str] = {}  # environment the server needs (recorded)
        self.exported_argv: list[str] = []  # what `tuner export` writes for the config
        self.prepare_s: float | None = None
        self.launched = False  # launch() ran and start() has not yet waited for it

    def prepare(self) -> None:
        raise NotImplementedError

    def make_client(self, base_url: str) -> StreamingClient:
        raise NotImplementedError

    def launch(self) -> None:
        """Launch the server and return at once: `start()` then waits for it, so its start-up overlaps whatever the
        caller does in between (the caller stops the engine whatever happens there)."""
        if not self.argv:
            self.prepare()
        port = free_port()
        self.server = ServerProcess(self.argv + ["--host", "127.0.0.1", "--port", str(port)], port,
                                    health_path=self.health_path, log_path=self.log_path, env=self.env,
                                    startup_timeout_s=self.startup_timeout_s)
        try:
            self.server.launch()
        except ServerFailed:
            self.server.stop()
            raise
        self.launched = True

    def start(self) -> None:
        if not self.launched:
            self.launch()
        self.launched = False
        try:
            self.server.wait()
        except ServerFailed:
            self.server.stop()
            raise
        self.client = self.make_client(self.server.url)
        self.client.open()

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int, sink: TokenSink) -> None:
        if self.client is None:
            sink.on_finish("engine not started")
            return
        self.client.submit(request_id, prompt_ids, max_tokens, DeathAware(sink, self.server))

    def stop(self, drain: bool = True) -> None:
        try:
            if self.client is not None:
                self.client.close(drain=drain)
        finally:
            self.client = None
            if self.server is not None:
                self.server.stop()

    def request_timings(self) -> dict[str, dict[str, Any]]:
        return {rid: f.get("timings") or {} for rid, f in (self.client.finals if self.client else {}).items()}

    def server_pids(self) -> list[int]:
        return [self.server.proc.pid] if self.server and self.server.proc and self.server.alive() else []

    def launch_info(self) -> dict[str, Any]:
        s = self.server
        return {"argv": self.argv, "exported_argv": self.exported_argv, "env": dict(self.env),
                "startup_s": s.startup_s if s else None, "prepare_s": self.prepare_s,
                "log": str(self.log_path) if self.log_path else None,
                "pid": s.proc.pid if s and s.proc else None}


class DeathAware:
    """Wraps a sink so a request that fails because the server died says so (with the server's last error)."""

    def __init__(self, sink: TokenSink, server: ServerProcess | None) -> None:
        self.sink, self.server = sink, server

    def on_tokens(self, token_ids: list[int], engine_time_s: float | None) -> None:
        self.sink.on_tokens(token_ids, engine_time_s)

    def on_finish(self, error: str | None, draft_proposed: int = 0, draft_accepted: int = 0) -> None:
        if error and self.server is not None:
            if not error.startswith("HTTP ") and self.server.proc is not None:
                try:  # a reset connection may be seen a moment before the exit status is
                    self.server.proc.wait(timeout=1.0)
                except Exception:
                    pass
            died = self.server.death_reason()
            if died:
                error = f"{died} ({error})"
        self.sink.on_finish(error, draft_proposed, draft_accepted)


def open_server(engine: Any, launch: bool = False) -> tuple[Any, None, Any]:
    """A server engine's `open_engine`: its files and argv prepared (not launched), with the tokenizer of the model
    it serves (the workload's). (engine, None, tokenizer): no model in this process. `launch`: the server is
    launched before the tokenizer loads (2.7-4 s with transformers' import), so the two overlap; `start()` then
    waits for it, and the caller stops the engine whatever happens before that."""
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    engine.prepare()
    if launch:
        engine.launch()
    try:
        return engine, None, load_tokenizer(checkpoint_dir(engine.config.model))
    except BaseException:
        engine.stop(drain=False)
        raise
