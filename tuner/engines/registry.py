"""The one registry of serving engines: a config's `engine` name -> its `Backend`, which answers every question the
rest of tuner asks about an engine (how to open it, whether it runs here, what it accepts, how its quality is scored,
its default search space, where its configs export to). Adding an engine = its module, its quality module and one
entry here.

Lazy, as lm-eval's model registry and Optuna's storages: this module imports the standard library and tuner.errors only; a backend
names its engine and quality modules as strings and imports them when asked.

The engine module of a backend provides `open_engine(config, ignore_eos, log_path) -> (engine, model, tokenizer)`
(ready to start; `model` is the in-process model, None for a server; a server tuner launches also takes `launch`,
`Backend.open`), `without_draft(config, model, tokenizer, ignore_eos) -> Engine` (the same engine without the draft:
a draft's reference), `serves_on_host_cpu(config, device)`,
`format_reason(quant, device)` (why it cannot serve a format on a device, None when it can) and `availability() ->
(ok, detail)`. Its quality module provides `check_inputs(config, names)`, the two steps of
tuner.quality.template's scoring template, `plan_scoring(config, names, limit, seed, kld_tokens, progress) -> Plan`
and `score_config(config, names, limit, seed, kld_tokens, progress, plan) -> (task scores, KLD)`,
`screen_kld(config, names, limit, seed, kld_tokens, model_hash, progress) -> (KLDResult, cached, versions)` and
`baseline_description(model, source)`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tuner.errors import TunerError

ENGINE_API = ("open_engine", "without_draft", "serves_on_host_cpu", "format_reason", "availability", "check_runs")
QUALITY_API = ("check_inputs", "plan_scoring", "score_config", "screen_kld", "baseline_description")
NO_EARLY_EXIT = ("none", "ngram", "draft")  # draft kinds a server's speculative decoding serves


@dataclass(frozen=True)
class Backend:
    name: str
    engine_module: str  # provides ENGINE_API
    quality_module: str  # provides QUALITY_API
    formats: str  # "module:attr" of the `quant` names it accepts (name -> description)
    kv_types: tuple[str, ...]  # `kv_type` values it accepts (auto = the engine's default)
    default_quant: str  # the `quant` of a config that names none (tuner bench/eval)
    baseline_quant: str  # what it serves when the user changes nothing: the search's first trial
    reference_quant: str  # the full-precision reference its quality is measured against
    space_files: tuple[str, str]  # its default search space under search_spaces/: (CPU, CUDA)
    server: bool  # served over HTTP by another process (device "cpu" for the tuner's own process)
    launched: bool  # tuner launches it (False: a running server at --endpoint; no configuration to export)
    export_to: str | None  # the one export target its configs are already in the terms of; None: any target
    profiled: bool  # tuner profile / tuner predict measure and model its step times
    drafts: tuple[str, ...] = ("none", "ngram", "draft", "early-exit")  # draft kinds it serves
    draft_refusal: str = ""  # the one-line error for another draft kind ({draft!r})
    devices: tuple[str, ...] = ("auto", "cpu", "cuda")
    device_refusal: str = ""  # the one-line error for another device ({device})

    def engine(self) -> ModuleType:
        return importlib.import_module(self.engine_module)

    def quality(self) -> ModuleType:
        return importlib.import_module(self.quality_module)

    def quants(self) -> dict[str, str]:
        module, attr = self.formats.split(":")
        return getattr(importlib.import_module(module), attr)

    def open(self, config: Any, ignore_eos: bool, log_path: Any = None, launch: bool = False) -> tuple[Any, Any, Any]:
        """(engine, model, tokenizer) for `config`, ready to start: an in-process engine loads its model here (and a
        draft's assistant), a server engine prepares its files and argv (model None). `launch`: a server tuner
        launches is launched before its tokenizer loads, its start-up overlapping the rest (`start()` waits for it;
        the caller stops the engine whatever happens before); other engines ignore it."""
        if launch and self.server and self.launched:
            return self.engine().open_engine(config, ignore_eos, log_path, launch=True)
        return self.engine().open_engine(config, ignore_eos, log_path)

    def available(self) -> tuple[bool, str]:
        """Whether it can run here, and where it is or what to do."""
        return self.engine().availability()

    def space_file(self, device: str) -> str:
        return self.space_files[1 if device == "cuda" else 0]

    def config_problem(self, config: Any) -> str | None:
        """Why this engine refuses a (parsed) config's draft or device, in one line; None when it serves it."""
        if config.draft_spec.kind not in self.drafts:
            return self.draft_refusal.format(draft=config.draft)
        if config.device not in self.devices:
            return self.device_refusal.format(device=config.device)
        return None


ENGINES: dict[str, Backend] = {b.name: b for b in (
    Backend("transformers", "tuner.engines.transformers", "tuner.quality.transformers", "tuner.config:FORMATS",
            ("auto",), "bf16", "fp32", "fp32", ("cpu.yaml", "cuda.yaml"), server=False, launched=True,
            export_to=None, profiled=True),
    Backend("llamacpp", "tuner.engines.llamacpp", "tuner.quality.llamacpp", "tuner.config:GGUF_TYPES",
            ("auto", "f32", "f16", "bf16", "q8_0", "q4_0"), "F16", "F16", "F32",
            ("llamacpp-cpu.yaml", "llamacpp-cuda.yaml"), server=True, launched=True, export_to="llamacpp",
            profiled=True, drafts=NO_EARLY_EXIT,
            draft_refusal="draft {draft!r} is not served by llama.cpp (no layer-skip self-speculation): expected "
                          "none, ngram:K or draft:<model>:K",
            devices=("auto", "cpu"),
            device_refusal="engine llamacpp on device {device}: this build of llama-server is CPU-only; expected "
                           "--device cpu or auto"),
    Backend("vllm", "tuner.engines.vllm", "tuner.quality.vllm", "tuner.config:FORMATS", ("auto",), "bf16", "fp32",
            "fp32", ("vllm-cpu.yaml", "vllm-cuda.yaml"), server=True, launched=True, export_to="vllm",
            profiled=True, drafts=NO_EARLY_EXIT,
            draft_refusal="draft {draft!r} is not served by vLLM 0.27.1 (no layer-skip self-speculation): expected "
                          "none, ngram:K or draft:<model>:K"),
    Backend("endpoint", "tuner.engines.endpoint", "tuner.quality.endpoint", "tuner.config:ENDPOINT_FORMATS",
            ("auto",), "served", "served", "fp32", ("endpoint.yaml", "endpoint.yaml"), server=True, launched=False,
            export_to=None, profiled=False, drafts=("none",),
            draft_refusal="draft {draft!r} on an endpoint: its server's speculation is out of reach; expected none"),
)}
ENGINE_NAMES = tuple(ENGINES)


def backend(name: str) -> Backend:
    """The backend of engine `name`; one-line error naming the accepted engines."""
    if not isinstance(name, str) or name not in ENGINES:
        raise TunerError(f"unknown engine {name!r}: expected one of {', '.join(ENGINE_NAMES)}")
    return ENGINES[name]


def names(**where: Any) -> list[str]:
    """The engines whose fields have the given values, in registry order (e.g. names(profiled=True))."""
    return [n for n, b in ENGINES.items() if all(getattr(b, k) == v for k, v in where.items())]


def spoken(items: list[str]) -> str:
    """'a, b or c'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def availability() -> list[dict[str, Any]]:
    """Per engine: can it run here, and the reason or where it is (`tuner engines`)."""
    rows = []
    for name, b in ENGINES.items():
        ok, detail = b.available()
        rows.append({"engine": name, "available": ok, "detail": detail})
    return rows
