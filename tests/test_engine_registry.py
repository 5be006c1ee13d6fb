"""The engine registry's contract (tuner.engines.registry), for every registered engine, in the pattern of Optuna's
StorageTestCase: one test body run over each entry, so a new engine is held to the same contract by registering it.
No model, no server: an entry resolves lazily, names modules that provide the API the rest of tuner calls, a default
search space of its own, and accepts what it says it serves. Opening and serving are the engine contract suite's
(tests/test_engines.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import assert_one_line_error
from tests.test_reliability import tuner_argv
from tuner.engines.registry import ENGINE_API, ENGINE_NAMES, ENGINES, QUALITY_API, availability, backend
from tuner.errors import TunerError

HEAVY = ("torch", "transformers", "vllm", "lm_eval", "numpy")


def test_importing_the_registry_and_config_imports_no_engine_and_nothing_heavy() -> None:
    code = ("import sys, json, tuner.config, tuner.engines.registry as r; "
            "r.backend('vllm'); r.ENGINES['llamacpp'].space_file('cpu'); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{HEAVY!r} or m.startswith(('tuner.engines.', 'tuner.quality.gate')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["tuner.engines.registry"]


@pytest.mark.parametrize("name", ENGINE_NAMES)
class TestEveryEngine:
    def test_resolves_by_name_to_its_own_entry(self, name: str) -> None:
        assert backend(name).name == name
        assert ENGINES[name] is backend(name)

    def test_its_engine_module_provides_the_engine_api(self, name: str) -> None:
        module = backend(name).engine()
        missing = [f for f in ENGINE_API if not callable(getattr(module, f, None))]
        assert not missing, f"{module.__name__} lacks {missing}"

    def test_its_quality_module_provides_the_quality_api(self, name: str) -> None:
        module = backend(name).quality()
        missing = [f for f in QUALITY_API if not callable(getattr(module, f, None))]
        assert not missing, f"{module.__name__} lacks {missing}"

    def test_its_default_space_is_a_file_of_that_engine(self, name: str) -> None:
        from tuner.search.space import default_space_path, load_space

        path = default_space_path("cpu", name)
        assert path.is_file(), path
        assert load_space(str(path)).engine == name

    def test_it_accepts_the_formats_it_names_and_refuses_another_engine_s(self, name: str) -> None:
        from tuner.config import TrialConfig

        b = backend(name)
        quants = b.quants()
        assert {b.default_quant, b.baseline_quant} <= set(quants)
        assert "auto" in b.kv_types
        extra = {} if b.launched else {"endpoint": "http://127.0.0.1:9"}
        for quant in (b.default_quant, b.baseline_quant):
            assert TrialConfig(model="smollm2-135m", engine=name, quant=quant, **extra).quant == quant
        foreign = next(q for other in ENGINES.values() for q in other.quants() if q not in quants)
        with pytest.raises(TunerError, match=f"unknown quantization format '{foreign}' for engine {name}"):
            TrialConfig(model="smollm2-135m", engine=name, quant=foreign, **extra)

    def test_availability_is_a_verdict_with_a_reason(self, name: str) -> None:
        ok, detail = backend(name).available()
        assert isinstance(ok, bool) and isinstance(detail, str) and detail


def test_availability_lists_every_engine_in_registry_order() -> None:
    assert [r["engine"] for r in availability()] == list(ENGINE_NAMES)


def test_only_the_engines_that_refuse_a_draft_kind_refuse_it_with_their_one_line() -> None:
    from tuner.config import TrialConfig

    for name in ("llamacpp", "vllm"):
        with pytest.raises(TunerError, match=r"is not served by .* \(no layer-skip self-speculation\)"):
            TrialConfig(model="smollm2-135m", engine=name, quant=backend(name).default_quant, draft="early-exit:4")
    assert TrialConfig(model="smollm2-135m", draft="early-exit:4").draft == "early-exit:4"  # transformers serves it


@pytest.mark.parametrize("bad", ["nope", "vLLM", ""])
def test_an_unknown_engine_is_one_line_naming_the_accepted_ones(bad: str) -> None:
    with pytest.raises(TunerError) as e:
        backend(bad)
    assert str(e.value) == f"unknown engine {bad!r}: expected one of transformers, llamacpp, vllm, endpoint"


def test_an_unknown_engine_on_the_command_line_is_one_line_and_exit_2(tmp_path) -> None:
    proc = subprocess.run(tuner_argv("eval", "--model", "smollm2-135m", "--engine", "nope"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, "unknown engine 'nope': expected one of transformers, llamacpp, vllm, endpoint")
    assert not any(tmp_path.iterdir())
