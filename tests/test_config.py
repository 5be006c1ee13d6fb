from __future__ import annotations

import pytest

from tuner.config import FORMATS, Draft, TrialConfig, parse_draft
from tuner.errors import TunerError


def test_round_trip_json():
    c = TrialConfig(model="smollm2-135m", quant="bnb-nf4", batch_cap=8, kv_fraction=0.05, draft="ngram:3")
    assert TrialConfig.from_json(c.to_json()) == c
    assert TrialConfig.from_dict(c.to_dict()) == c
    # a bench JSON is accepted as a config source
    assert TrialConfig.from_json(f'{{"config": {c.to_json()}, "metrics": {{}}}}') == c


def test_frozen():
    c = TrialConfig(model="m")
    with pytest.raises(AttributeError):
        c.batch_cap = 3  # type: ignore[misc]
    assert c.replace(batch_cap=3).batch_cap == 3


@pytest.mark.parametrize("spec,expected", [
    ("none", Draft("none")),
    ("ngram:3", Draft("ngram", 3)),
    ("draft:smollm2-135m:4", Draft("draft", 4, "smollm2-135m")),
    ("draft:/models/a:b.gguf:2", Draft("draft", 2, "/models/a:b.gguf")),
    ("early-exit:6", Draft("early-exit", 6)),
])
def test_parse_draft(spec, expected):
    assert parse_draft(spec) == expected
    assert str(parse_draft(spec)) == spec


@pytest.mark.parametrize("spec", ["ngram", "ngram:0", "ngram:-1", "ngram:x", "draft:m", "draft::3", "medusa:2", ""])
def test_bad_draft(spec):
    with pytest.raises(TunerError, match="draft spec"):
        parse_draft(spec)


@pytest.mark.parametrize("kwargs,needle", [
    ({"quant": "int3"}, "unknown quantization format 'int3'"),
    ({"batch_cap": 0}, "batch cap 0"),
    ({"batch_cap": -2}, "batch cap -2"),
    ({"kv_fraction": 0.0}, "KV fraction 0.0"),
    ({"kv_fraction": 1.5}, "KV fraction 1.5"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"draft": "ngram:"}, "bad draft spec"),
])
def test_bad_values_name_value_and_accepted(kwargs, needle):
    with pytest.raises(TunerError) as e:
        TrialConfig(model="m", **kwargs)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_rejected():
    with pytest.raises(TunerError, match="unknown config key"):
        TrialConfig.from_dict({"model": "m", "tp": 2})


def test_every_format_is_documented_with_its_device_limit():
    """The README's `--quant` row lists exactly the formats a config accepts, and marks "(CUDA)" exactly those that
    cannot run on CPU because of the device (a missing package is another reason, not a device limit)."""
    import re
    from pathlib import Path

    from tuner.quantize import unsupported_reason

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    (row,) = [ln for ln in readme.splitlines() if ln.startswith("| quantization format | `--quant` |")]
    documented = dict(re.findall(r"`([a-z0-9-]+)`( \(CUDA\))?", row.split("|")[3]))
    assert set(documented) == set(FORMATS)
    for quant, cuda_mark in documented.items():
        assert TrialConfig(model="m", quant=quant).quant == quant
        on_cpu, on_cuda = unsupported_reason(quant, "cpu"), unsupported_reason(quant, "cuda")
        assert bool(cuda_mark) == (on_cpu is not None and on_cpu != on_cuda), (quant, on_cpu, on_cuda)


def test_import_tuner_is_light():
    import subprocess
    import sys

    code = "import sys, tuner, tuner.config, tuner.measure.workload, tuner.measure.metrics, tuner.cli; " \
           "print(sorted(m for m in ('torch', 'transformers', 'optuna', 'lm_eval') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
