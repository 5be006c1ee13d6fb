"""Every engine passes the shared contract (tests/engine_contract.py), on the bundled SmolLM2-135M."""

from __future__ import annotations

import functools

import pytest

from tests.engine_contract import EngineContract
from tuner.config import TrialConfig

MODEL = "smollm2-135m"


@functools.cache
def _loaded(quant: str):
    from tuner.quantize import load_model

    return load_model(TrialConfig(model=MODEL, quant=quant, device="cpu"))


@functools.cache
def _tokenizer():
    from tuner.models import checkpoint_dir
    from tuner.quantize import load_tokenizer

    return load_tokenizer(checkpoint_dir(MODEL))


class TestTransformersCB(EngineContract):
    name = "transformers-cb"

    def make_engine(self, batch_cap: int):
        from tuner.engines.transformers_cb import ContinuousBatchingEngine

        model, tok = _loaded("bf16")
        return ContinuousBatchingEngine(model, tok, TrialConfig(model=MODEL, quant="bf16", batch_cap=batch_cap,
                                                                kv_fraction=0.01, device="cpu"))

    def tokenizer(self):
        return _tokenizer()


class TestLlamaCpp(EngineContract):
    name = "llamacpp"

    @pytest.fixture(autouse=True)
    def _built(self):
        from tuner.engines.llamacpp import availability

        ok, why = availability()
        if not ok:
            pytest.fail(why)  # `make test` builds it: a missing build is a set-up failure, not a skip

    def make_engine(self, batch_cap: int):
        from tuner.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(TrialConfig(model=MODEL, engine="llamacpp", quant="Q8_0", batch_cap=batch_cap,
                                          kv_fraction=0.01, device="cpu"))

    def tokenizer(self):
        return _tokenizer()
