"""Apply a quantization format to a real model: `load_model(config) -> (model, tokenizer)`.

Heavy libraries (torch, transformers, bitsandbytes, torchao, gptqmodel) are imported inside the functions that
need them. A format the device cannot run raises UnsupportedConfig with the reason, never crashes.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig, resolve_device
from tuner.errors import TunerError, UnsupportedConfig
from tuner.models import cache_root, checkpoint_dir, resolve_source, source_hash

# format -> python module it needs (for a cheap availability check) and the pip package to install.
_NEEDS: dict[str, tuple[str, str]] = {
    "bnb-int8": ("bitsandbytes", "bitsandbytes"),
    "bnb-nf4": ("bitsandbytes", "bitsandbytes"),
    "bnb-fp4": ("bitsandbytes", "bitsandbytes"),
    "torchao-int8wo": ("torchao", "torchao"),
    "torchao-int4wo": ("torchao", "torchao"),
    "gptq-int4": ("gptqmodel", "gptqmodel==7.6.0"),
}
_CUDA_ONLY = {
    "fp16": "fp16 matmuls are not supported for serving on CPU; use bf16",
    "torchao-int4wo": "torchao int4 weight-only needs CUDA (its tinygemm kernel has no CPU path); use torchao-int8wo",
}


def unsupported_reason(quant: str, device: str) -> str | None:
    """Why `quant` cannot run on `device` ('cpu' or 'cuda'), or None when it can. Cheap: imports nothing heavy."""
    if device == "cpu" and quant in _CUDA_ONLY:
        return _CUDA_ONLY[quant]
    if quant in _NEEDS:
        module, pip_name = _NEEDS[quant]
        if importlib.util.find_spec(module) is None:
            return f"{quant} needs the {module} package: pip install {pip_name}"
    return None


def torch_dtype(quant: str, device: str) -> Any:
    """Activation/compute dtype for a format: fp32 only for the fp32 reference, else bf16 (fp16 for fp16)."""
    import torch

    if quant == "fp32":
        return torch.float32
    if quant == "fp16":
        return torch.float16
    return torch.bfloat16


def quantization_config(quant: str, device: str) -> Any:
    """The transformers quantization config for a format (None for plain dtypes and GPTQ)."""
    import torch

    if quant.startswith("bnb-"):
        import warnings

        from transformers import BitsAndBytesConfig

        # LLM.int8() warns on every matmul that bf16 inputs are cast to fp16: once is information, not per token
        warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")

        if quant == "bnb-int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant[4:], bnb_4bit_compute_dtype=torch.bfloat16
        )
    if quant.startswith("torchao-"):
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        return TorchAoConfig(Int8WeightOnlyConfig() if quant == "torchao-int8wo" else Int4WeightOnlyConfig())
    return None


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(config: TrialConfig) -> tuple[Any, Any]:
    """Load `config.model` with `config.quant` applied on the resolved device. Returns (model, tokenizer)."""
    device = resolve_device(config.device)
    reason = unsupported_reason(config.quant, device)
    if reason:
        raise UnsupportedConfig(f"format {config.quant!r} is unsupported on {device}: {reason}")
    model_dir = checkpoint_dir(config.model)
    if config.quant == "gptq-int4":
        return load_gptq(config.model, model_dir, device), load_tokenizer(model_dir)
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch_dtype(config.quant, device), "trust_remote_code": False}
    qc = quantization_config(config.quant, device)
    if qc is not None:
        kwargs["quantization_config"] = qc
        kwargs["device_map"] = device
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if qc is None:
        model = model.to(device)
    model.eval()
    return model, load_tokenizer(model_dir)


# ------------------------------------------------------------------------------------------------------- GPTQ --- #
def calibration_texts(n: int = 64, min_chars: int = 400) -> list[str]:
    """Local calibration text: paragraphs of the Python reference manual shipped with CPython (pydoc_data)."""
    from tuner.corpus import paragraphs

    return [p for p in paragraphs() if len(p) >= min_chars][:n]


def gptq_dir(spec: str) -> Path:
    source = resolve_source(spec)
    return cache_root() / "quant" / f"{Path(source.path).stem}-{source_hash(source)}-gptq-int4-g64"


def quantize_gptq(model_dir: Path, target: Path) -> None:
    """Quantize with GPTQModel (4 bit, group 64) on local calibration text and save atomically to `target`."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import GPTQModel, QuantizeConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        qcfg = QuantizeConfig(bits=4, group_size=64)
        model = GPTQModel.load(str(model_dir), qcfg)
        model.quantize(calibration_texts(), batch_size=1)
        model.save(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_gptq(spec: str, model_dir: Path, device: str) -> Any:
    """Load (quantizing once, cached) the GPTQ 4-bit model; returns the transformers model inside GPTQModel."""
    target = gptq_dir(spec)
    if not (target / "config.json").is_file():
        quantize_gptq(model_dir, target)
    from gptqmodel import BACKEND, GPTQModel

    backend = BACKEND.AUTO if device == "cuda" else BACKEND.GPTQ_TORCH_INT8
    wrapped = GPTQModel.load(str(target), backend=backend, device=device)
    model = wrapped.model
    model.eval()
    return model


def weight_bytes(model: Any) -> int:
    """Bytes of parameters and buffers actually held by the model (quantized storage counted as stored)."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        total += t.numel() * t.element_size()
    return total


def fail_if_user_error(e: Exception) -> None:
    if isinstance(e, TunerError):
        raise e
