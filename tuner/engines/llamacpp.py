"""llama.cpp's `llama-server` (ggml-org/llama.cpp@0c1e57098, built by `make llamacpp`) as a tuner engine.

The engine launches exactly the argv `tuner export --to llamacpp` writes for the config (tuner.export.llamacpp), plus
`--host 127.0.0.1 --port <free port>` (an engine profile, never a measured trial, adds `--slot-save-path`:
`allow_slot_copies`), and drives the server's native `POST /completion` with the prompt as token
ids, streaming, `return_tokens` (token ids in every event), greedy sampling and `ignore_eos`.

Knob mapping (recorded in the bench JSON under `engine.settings`):
  quant       -> the GGUF weight type, made once with `llama-quantize --allow-requantize` from the model's GGUF and
                 cached under $TUNER_CACHE/gguf/<source sha256[:16]>-<TYPE>.gguf
  batch cap   -> -np (server slots decoded together)
  KV fraction -> -c, the KV cache in tokens: floor(fraction x available memory / KV bytes per token), rounded down
                 to a multiple of 256, at least 256 per slot and at most the model's trained context per slot;
                 KV bytes per token = 2 (K and V) x layers x KV heads x head size x bytes per element of --kv-type
  kv_type     -> -ctk/-ctv
  (always)    -> --cache-ram 0: no prompt cache in host RAM beside the KV cache (0c1e57098 keeps up to 8192 MiB by
                 default, memory the KV fraction does not count)
  draft       -> --spec-type ngram-simple (ngram:K) or -md (draft:<model>:K, same vocabulary only)
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.base import Capabilities
from tuner.engines.http import Event, StreamingClient
from tuner.engines.server_engine import ServerEngine
from tuner.errors import TunerError, UnsupportedConfig

COMMIT = "0c1e57098"
# bytes per KV element by llama.cpp type (block types: bytes per block / elements per block)
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
CTX_ROUND = 256


def bin_dir() -> Path | None:
    """Where llama-server and llama-quantize are: $TUNER_LLAMACPP_BIN, else the `make llamacpp` cache."""
    from tuner.models import cache_root

    env = os.environ.get("TUNER_LLAMACPP_BIN")
    for d in ([Path(env)] if env else []) + [cache_root() / "llama.cpp" / COMMIT / "bin"]:
        if (d / "llama-server").is_file():
            return d
    return None


def binary(name: str) -> Path:
    d = bin_dir()
    if d is None or not (d / name).is_file():
        raise TunerError(f"{name} not found (looked in $TUNER_LLAMACPP_BIN and $TUNER_CACHE/llama.cpp/{COMMIT}/bin):"
                         " expected a build from `make llamacpp` (~5.5 min)")
    return d / name


def availability() -> tuple[bool, str]:
    """For `tuner models`/`tuner engines`: whether this engine can run here, and why not."""
    d = bin_dir()
    if d is None:
        return False, f"llama-server not built: run `make llamacpp` (llama.cpp {COMMIT}, ~5.5 min on 2 cores)"
    return True, f"llama.cpp {COMMIT} at {d}"


def source_gguf(model: str) -> Path:
    from tuner.models import resolve_source

    src = resolve_source(model)
    if src.kind == "checkpoint":
        raise UnsupportedConfig(f"engine llamacpp serves GGUF files: {model!r} is a checkpoint directory; expected an"
                                " alias or a .gguf file (convert it with llama.cpp's convert_hf_to_gguf.py)")
    return Path(src.path)


def quantized_gguf(model: str, gtype: str) -> Path:
    """The model's GGUF at weight type `gtype`, made once with llama-quantize and cached (sha256-keyed)."""
    from tuner.models import cache_root, file_sha256

    src = source_gguf(model)
    out = cache_root() / "gguf" / f"{src.stem}-{file_sha256(src)[:16]}-{gtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([str(binary("llama-quantize")), "--allow-requantize", str(src), tmp, gtype],
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            from tuner.engines.server import last_error_line

            raise UnsupportedConfig(f"llama-quantize {gtype} failed: "
                                    f"{last_error_line((proc.stderr + proc.stdout).splitlines())}")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def gguf_facts(path: Path) -> dict[str, Any]:
    """Architecture facts the KV sizing needs, read from the GGUF header."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))

    def field(key: str) -> Any:
        f = r.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    heads = field(f"{arch}.attention.head_count")
    kv_heads = field(f"{arch}.attention.head_count_kv") or heads
    emb = field(f"{arch}.embedding_length")
    k_len = field(f"{arch}.attention.key_length") or (emb // heads if emb and heads else None)
    v_len = field(f"{arch}.attention.value_length") or k_len
    return {"arch": arch, "layers": field(f"{arch}.block_count"), "kv_heads": kv_heads, "k_len": k_len,
            "v_len": v_len, "n_ctx_train": field(f"{arch}.context_length"),
            "file_type": field("general.file_type"), "size_bytes": path.stat().st_size}


def kv_bytes_per_token(facts: dict[str, Any], kv_type: str) -> float:
    kv = KV_BYTES["f16" if kv_type == "auto" else kv_type]
    return facts["layers"] * facts["kv_heads"] * (facts["k_len"] + facts["v_len"]) * kv


def resolve_ctx_tokens(config: TrialConfig, facts: dict[str, Any], available_bytes: int) -> int:
    """-c from the KV fraction (see the module docstring)."""
    per_token = kv_bytes_per_token(facts, config.kv_type)
    c = int(config.kv_fraction * available_bytes / per_token) // CTX_ROUND * CTX_ROUND
    n = config.batch_cap
    most = n * int(facts.get("n_ctx_train") or 4096)
    return max(CTX_ROUND * n, min(c, most))


class LlamaCppClient(StreamingClient):
    path = "/completion"

    def __init__(self, base_url: str, ignore_eos: bool) -> None:
        super().__init__(base_url)
        self.ignore_eos = ignore_eos

    def request_body(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        return {"prompt": prompt_ids, "n_predict": max_tokens, "stream": True, "return_tokens": True,
                "ignore_eos": self.ignore_eos, "temperature": 0.0}

    def parse_event(self, data: dict[str, Any]) -> Event:
        if data.get("stop"):
            return Event(token_ids=list(data.get("tokens") or []), done=True,
                         final={k: data.get(k) for k in ("timings", "tokens_predicted", "tokens_evaluated",
                                                         "stop_type", "id_slot", "truncated")})
        return Event(token_ids=list(data.get("tokens") or []))

    def draft_counts(self, final: dict[str, Any]) -> tuple[int, int]:
        t = final.get("timings") or {}
        return int(t.get("draft_n") or 0), int(t.get("draft_n_accepted") or 0)


class LlamaCppEngine(ServerEngine):
    def __init__(self, config: TrialConfig, ignore_eos: bool = True, log_path: Path | None = None) -> None:
        if config.engine != "llamacpp":
            raise TunerError(f"LlamaCppEngine got a config of engine {config.engine!r}: expected llamacpp")
        super().__init__(config, ignore_eos, log_path)
        self.gguf: Path | None = None
        self.facts: dict[str, Any] = {}
        self.ctx_tokens: int | None = None
        self.paths: dict[str, str] = {}  # the files exported as serve.sh's parameters (tuner.export.llamacpp)
        self.digests: dict[str, str] = {}
        self.available_bytes: int | None = None
        self.copies: set[str] = set()  # the prompt files copy_prompt saved in this server's slot-save directory

    def prepare(self) -> None:
        """Quantize (cached) and resolve the argv; raises UnsupportedConfig / TunerError."""
        import psutil

        from tuner.export.common import Context
        from tuner.export.llamacpp import export

        t = time.perf_counter()
        draft = self.config.draft_spec
        paths = {"gguf": str(source_gguf(self.config.model)),
                 "served_gguf": str(quantized_gguf(self.config.model, self.config.quant))}
        if draft.kind == "draft":
            from tuner.models import ALIASES

            fam = {getattr(ALIASES.get(m), "family", None) for m in (self.config.model, draft.model or "")}
            if len(fam) != 1 or None in fam:
                raise UnsupportedConfig(f"draft {draft.model!r} for {self.config.model!r}: llama.cpp needs a draft "
                                        "with the target's vocabulary (common/speculative.cpp refuses others)")
            paths["draft_gguf"] = str(source_gguf(draft.model or ""))
            paths["served_draft_gguf"] = str(quantized_gguf(draft.model or "", self.config.quant))
        from tuner.models import file_sha256

        self.paths = paths
        self.digests = {k: file_sha256(Path(v)) for k, v in paths.items()}
        self.gguf = Path(paths["served_gguf"])
        self.facts = gguf_facts(self.gguf)
        self.available_bytes = psutil.virtual_memory().available
        self.ctx_tokens = resolve_ctx_tokens(self.config, self.facts, self.available_bytes)
        exp = export(self.config, Context(paths=paths, ctx_tokens=self.ctx_tokens, digests=self.digests,
                                          available_gib=self.available_bytes / (1 << 30)))
        self.exported_argv = list(exp.argv)
        self.argv = [str(binary("llama-server"))] + exp.argv[1:]
        self.prepare_s = time.perf_counter() - t

    def settings(self) -> dict[str, Any]:
        return {"gguf": str(self.gguf) if self.gguf else None, "paths": dict(self.paths), "sha256": dict(self.digests),
                "available_bytes": self.available_bytes, "weight_type": self.config.quant,
                "slots": self.config.batch_cap, "ctx_tokens": self.ctx_tokens, "kv_type": self.config.kv_type,
                "argv": self.argv, "ignore_eos": self.ignore_eos, "sampling": "greedy (temperature 0)"}

    def capabilities(self) -> Capabilities:
        return Capabilities("llamacpp", settings=self.settings())

    def weights_bytes(self) -> int | None:
        return self.facts.get("size_bytes")

    def make_client(self, base_url: str) -> LlamaCppClient:
        return LlamaCppClient(base_url, self.ignore_eos)

    def info(self) -> dict[str, Any]:
        return {"build": f"llama.cpp {COMMIT}", **self.launch_info(), "ctx_tokens": self.ctx_tokens,
                "gguf": {**self.facts, "path": str(self.gguf)}}

    def allow_slot_copies(self, directory: Path) -> None:
        """Before start (an engine profile only, never a measured trial): launch with --slot-save-path `directory`,
        which enables llama-server's /slots save and restore actions and changes nothing else (`copy_prompt`)."""
        if not self.argv:
            self.prepare()
        self.argv = self.argv + ["--slot-save-path", str(directory)]

    def copy_prompt(self, prompt_ids: tuple[int, ...], slots: int, name: str) -> None:
        """Give slots 0..slots-1 the KV cache of `prompt_ids` (the file `name` in the slot-save directory: made once,
        by prefilling the prompt in slot 0 and saving that slot; then restored into each slot), as if each had
        prefilled it. Raises TunerError with llama-server's answer when it refuses."""
        import json
        import urllib.error
        import urllib.request

        if self.server is None:
            raise TunerError("copy_prompt: the llama-server is not started")

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            req = urllib.request.Request(self.server.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return json.loads(r.read())
            except (urllib.error.URLError, OSError, ValueError) as e:
                why = e.read().decode(errors="replace")[:200] if isinstance(e, urllib.error.HTTPError) else str(e)
                raise TunerError(f"llama-server {path}: {why}") from None

        first = 0
        if name not in self.copies:
            post("/completion", {"prompt": list(prompt_ids), "n_predict": 1, "id_slot": 0, "cache_prompt": True,
                                 "temperature": 0.0})
            post("/slots/0?action=save", {"filename": name})
            self.copies.add(name)
            first = 1
        for slot in range(first, slots):
            post(f"/slots/{slot}?action=restore", {"filename": name})


# ------------------------------------------------------------------ the registry's engine API (registry.py) --- #
def open_engine(config: TrialConfig, ignore_eos: bool, log_path: Path | None = None,
                launch: bool = False) -> tuple[Any, None, Any]:
    from tuner.engines.server_engine import open_server

    return open_server(LlamaCppEngine(config, ignore_eos=ignore_eos, log_path=log_path), launch)


def without_draft(config: TrialConfig, model: Any, tokenizer: Any, ignore_eos: bool) -> LlamaCppEngine:
    """A second server of the same kind, without the draft."""
    return LlamaCppEngine(config.replace(draft="none"), ignore_eos=ignore_eos)


def serves_on_host_cpu(config: TrialConfig, device: str) -> bool:
    return device == "cpu"


def format_reason(quant: str, device: str) -> str | None:
    return None  # llama.cpp runs every GGUF type on CPU


def check_runs(device: str, model: str, endpoint: str | None = None, served_model: str | None = None) -> None:
    """Before a search writes anything: a CPU device, the llama-server binary and the model's GGUF."""
    if device == "cuda":
        raise TunerError("--engine llamacpp runs on CPU here (the llama-server build has no CUDA): expected "
                         "--device cpu or auto")
    binary("llama-server")
    source_gguf(model)
