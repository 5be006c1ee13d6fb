"""Seeded synthetic workloads from real text, and JSONL trace replay.

A workload is a list of `Request`s with arrival times. Prompts are slices of real English text (see tuner.corpus),
cut to a token length drawn from the input-length range; an optional shared prefix (a system prompt shared by all
requests) is prepended. Arrival: Poisson at a rate, constant rate, or closed-loop concurrency (arrival_s = None:
the load generator sends the next request when one finishes).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.errors import TunerError


@dataclass(frozen=True)
class Request:
    """One request. `prompt_ids` are token ids of `prompt`; `arrival_s` is None in closed-loop mode."""

    index: int
    prompt: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float | None


@dataclass(frozen=True)
class WorkloadSpec:
    """How to generate the load. Exactly one of `rate` (req/s) or `concurrency` drives the arrivals."""

    requests: int = 32
    rate: float | None = 4.0  # req/s; None with concurrency set = closed loop
    arrival: str = "poisson"  # poisson | constant (ignored in closed loop)
    concurrency: int | None = None
    input_len: tuple[int, int] = (64, 256)  # tokens, inclusive range
    output_len: tuple[int, int] = (32, 64)  # tokens, inclusive range
    shared_prefix: int = 0  # tokens of system prompt shared by all requests
    seed: int = 0
    trace: str | None = None  # JSONL: prompt, max_tokens, arrival_s

    def __post_init__(self) -> None:
        if self.requests <= 0:
            raise TunerError(f"--requests {self.requests} is invalid: expected an integer >= 1")
        if self.concurrency is not None and self.concurrency <= 0:
            raise TunerError(f"--concurrency {self.concurrency} is invalid: expected an integer >= 1")
        if self.rate is not None and not self.rate > 0:
            raise TunerError(f"--rate {self.rate} is invalid: expected a number of requests per second > 0")
        if self.arrival not in ("poisson", "constant"):
            raise TunerError(f"--arrival {self.arrival!r} is invalid: expected poisson or constant")
        for name, (lo, hi) in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if lo <= 0 or hi < lo:
                raise TunerError(f"{name} {lo}:{hi} is invalid: expected A:B with 1 <= A <= B")
        if self.shared_prefix < 0:
            raise TunerError(f"--shared-prefix {self.shared_prefix} is invalid: expected an integer >= 0")

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["input_len"], d["output_len"] = list(self.input_len), list(self.output_len)
        return d


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'64:256' -> (64, 256); '128' -> (128, 128)."""
    try:
        parts = [int(p) for p in str(text).split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] <= 0 or parts[1] < parts[0]:
        raise TunerError(f"{name} {text!r} is invalid: expected A:B (tokens) with 1 <= A <= B, or one number")
    return parts[0], parts[1]


def arrival_times(n: int, rate: float, kind: str, seed: int) -> list[float]:
    """Arrival offsets in seconds from the start: Poisson process (exponential gaps) or constant spacing.

    The gaps come from their own random stream (seeded apart from the prompts), drawn at unit rate and scaled by
    1/rate: with one seed, every rate and every arrival mode serves the same prompts, and the arrival pattern at
    rate 2r is the one at rate r compressed (common random numbers across a rate sweep)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"arrival seed must be an int, got {type(seed).__name__}")  # a Random would seed by repr
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t / rate)
        t += rng.expovariate(1.0) if kind == "poisson" else 1.0
    return out


def with_arrivals(requests: list[Request], rate: float | None, kind: str, seed: int) -> list[Request]:
    """The same requests re-timed: open loop at `rate` (req/s), or closed loop (arrival None) when rate is None.
    Indices are renumbered from 0 so any slice of a workload is a workload."""
    import dataclasses

    times = arrival_times(len(requests), rate, kind, seed) if rate else [None] * len(requests)
    return [dataclasses.replace(r, index=i, arrival_s=t) for i, (r, t) in enumerate(zip(requests, times))]


def token_pool(tokenizer: Any) -> list[int]:
    """Token ids of the whole real-text corpus, in order (prompts are windows into it)."""
    from tuner.corpus import paragraphs

    return list(tokenizer("\n\n".join(paragraphs()), add_special_tokens=False)["input_ids"])


def build_workload(spec: WorkloadSpec, tokenizer: Any) -> list[Request]:
    """Deterministic for a given spec (seed) and tokenizer."""
    if spec.trace:
        return load_trace(spec.trace, tokenizer)
    rng = random.Random(spec.seed)  # prompts and lengths only; arrivals have their own stream
    pool = token_pool(tokenizer)
    prefix = pool[: spec.shared_prefix]
    body = pool[spec.shared_prefix :]
    open_loop = spec.concurrency is None
    arrivals = arrival_times(spec.requests, spec.rate or 1.0, spec.arrival, spec.seed) if open_loop else None
    out = []
    for i in range(spec.requests):
        n_in = rng.randint(*spec.input_len)
        n_out = rng.randint(*spec.output_len)
        n_body = max(1, n_in - len(prefix))
        start = rng.randrange(0, max(1, len(body) - n_body))
        ids = tuple(prefix + body[start : start + n_body])
        out.append(
            Request(i, tokenizer.decode(ids), ids, n_out, arrivals[i] if arrivals is not None else None)
        )
    return out


def read_trace(path: str) -> list[dict[str, Any]]:
    """Validate a JSONL trace: one object per line with `prompt` (str), `max_tokens` (int > 0), `arrival_s` (>= 0)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TunerError(f"trace {path!r} is unreadable ({type(e).__name__}): expected a JSONL file") from None
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, max_tokens, arrival = row["prompt"], int(row["max_tokens"]), float(row["arrival_s"])
            if not isinstance(prompt, str) or not prompt or max_tokens <= 0 or arrival < 0:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise TunerError(
                f"trace {path!r} line {n} is invalid: expected JSON with prompt (non-empty string), "
                "max_tokens (int > 0), arrival_s (number >= 0)"
            ) from None
        rows.append({"prompt": prompt, "max_tokens": max_tokens, "arrival_s": arrival})
    if not rows:
        raise TunerError(f"trace {path!r} has no requests: expected one JSON object per line")
    return rows


def load_trace(path: str, tokenizer: Any) -> list[Request]:
    """Trace replay, sorted by arrival time."""
    rows = sorted(read_trace(path), key=lambda r: r["arrival_s"])
    out = []
    for i, row in enumerate(rows):
        ids = tuple(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
        out.append(Request(i, row["prompt"], ids, row["max_tokens"], row["arrival_s"]))
    return out
