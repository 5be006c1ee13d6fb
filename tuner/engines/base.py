"""The engine contract: submit a request, stream its tokens back through a sink, report capabilities.

Threading model: `submit` never blocks on generation; the engine calls the sink from its own thread(s).
A sink's methods must be cheap (they stamp the time and append); an engine must call `on_finish` exactly once
per submitted request, also on failure, so the load generator never waits forever on a lost request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol


class TokenSink(Protocol):
    def on_tokens(self, token_ids: list[int], engine_time_s: float | None) -> None:
        """New tokens of this request. `engine_time_s`: the engine's own perf_counter stamp of the first of them."""

    def on_finish(self, error: str | None, draft_proposed: int = 0, draft_accepted: int = 0) -> None:
        """The request is over (error None on success)."""


@dataclass(frozen=True)
class Capabilities:
    name: str
    notes: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)  # engine-native settings derived from the config


class Engine(ABC):
    """Lifecycle: `start()` (load, allocate) -> `submit(...)`* -> `stop()`. The bench warms an engine up with
    requests drawn from the workload itself (tuner.measure.bench), so engines need no warm-up of their own."""

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int, sink: TokenSink) -> None: ...

    @abstractmethod
    def stop(self, drain: bool = True) -> None:
        """Stop serving. drain=True finishes in-flight requests first; False abandons them (early stop)."""

    def info(self) -> dict[str, Any]:
        """Device, versions and memory facts recorded with every measurement."""
        return {}

    # Optional capabilities (the defaults say "not available").
    def weights_bytes(self) -> int | None:
        """Bytes of weights a batch-1 decode step reads, when the engine knows them (the roofline)."""
        return None

    def request_timings(self) -> dict[str, dict[str, Any]]:
        """The engine's own per-request figures by request id (llama.cpp: `timings`), to check the harness."""
        return {}

    def server_pids(self) -> list[int]:
        """Processes serving outside the tuner's own (a server engine): their memory is sampled too."""
        return []
