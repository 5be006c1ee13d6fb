"""A running OpenAI-compatible server tuner did not launch (`--endpoint URL`): a managed API, a remote vLLM, a
llama-server started by someone else. Its server knobs are out of reach; what a request can ask for is a knob
(`service_tier` on APIs with processing tiers).

* Requests: `POST {URL}/v1/completions`, the prompt as token ids (the workload is tokenized with `--model`'s
  tokenizer, which must be the served model's), streaming with `stream_options.include_usage`, greedy, `ignore_eos`
  (honoured by vLLM and llama-server; an API that ignores it ends requests early, which the lengths show).
* Token counts: a chunk's `token_ids` when the server sends them, else one token per chunk that carries text (what
  vLLM, llama-server and OpenAI stream); the server's `usage.completion_tokens` at the end settles the total (tokens
  it reports beyond the chunks are counted at the end of the stream).
* API key: `$TUNER_API_KEY`, sent as `Authorization: Bearer`; never a flag, never written to a result.
* The model name sent is `served_model`, by default the first id of `GET /v1/models`.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.base import Capabilities, Engine, TokenSink
from tuner.engines.http import Event, StreamingClient
from tuner.errors import TunerError

API_KEY_ENV = "TUNER_API_KEY"


def api_headers() -> dict[str, str]:
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def get_json(url: str, timeout_s: float = 15.0) -> Any:
    """GET `url` with the API key; a refusal or an unreachable server is a one-line TunerError."""
    req = urllib.request.Request(url, headers=api_headers())
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        hint = (f": expected the API key in ${API_KEY_ENV}" + (" (it is unset)" if not os.environ.get(API_KEY_ENV)
                                                                else " (the one set was refused)")
                if e.code in (401, 403) else ": expected an OpenAI-compatible server")
        raise TunerError(f"endpoint {url!r} answered HTTP {e.code}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise TunerError(f"endpoint {url!r} is unreachable ({why}): expected a running OpenAI-compatible server") \
            from None


def served_models(base_url: str) -> list[str]:
    data = get_json(f"{base_url.rstrip('/')}/v1/models")
    ids = [m.get("id") for m in (data.get("data") or []) if isinstance(m, dict)] if isinstance(data, dict) else []
    return [i for i in ids if i]


class EndpointClient(StreamingClient):
    path = "/v1/completions"
    ends_at_done = True

    def __init__(self, base_url: str, model: str, ignore_eos: bool, service_tier: str) -> None:
        super().__init__(base_url)
        self.model, self.ignore_eos, self.service_tier = model, ignore_eos, service_tier

    def headers(self) -> dict[str, str]:
        return api_headers()

    def request_body(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": 0.0}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.service_tier != "none":
            body["service_tier"] = self.service_tier
        return body

    def parse_event(self, data: dict[str, Any]) -> Event:
        usage = data.get("usage")
        choices = data.get("choices") or []
        if not choices:
            if isinstance(usage, dict):  # the usage chunk closes the stream
                return Event(done=True, final={"completion_tokens": usage.get("completion_tokens"),
                                               "usage": usage, "service_tier": data.get("service_tier")})
            return Event()
        c = choices[0]
        ids = c.get("token_ids")
        tokens = [int(t) for t in ids] if isinstance(ids, list) else ([-1] if c.get("text") else [])
        if isinstance(usage, dict):  # a server that puts usage on the last choice chunk
            return Event(token_ids=tokens, done=True, final={"completion_tokens": usage.get("completion_tokens"),
                                                             "usage": usage, "finish_reason": c.get("finish_reason")})
        return Event(token_ids=tokens)


class EndpointEngine(Engine):
    """Measures a server it did not start: `start()` checks it answers, `stop()` closes the client only."""

    def __init__(self, config: TrialConfig, ignore_eos: bool = True, log_path: Any = None) -> None:
        if config.engine != "endpoint":
            raise TunerError(f"EndpointEngine got a config of engine {config.engine!r}: expected endpoint")
        self.config, self.ignore_eos = config, ignore_eos
        self.base_url = config.endpoint.rstrip("/")
        self.model_name = config.served_model
        self.models: list[str] = []
        self.client: EndpointClient | None = None
        self.prepare_s: float | None = None

    def prepare(self) -> None:
        """Reach the server and resolve the model name (one-line TunerError when it cannot be measured)."""
        t = time.perf_counter()
        self.models = served_models(self.base_url)
        if not self.model_name:
            if not self.models:
                raise TunerError(f"endpoint {self.base_url!r} lists no model at /v1/models: expected --served-model "
                                 "NAME")
            self.model_name = self.models[0]
        self.prepare_s = time.perf_counter() - t

    def start(self) -> None:
        if not self.model_name:
            self.prepare()
        self.client = EndpointClient(self.base_url, self.model_name, self.ignore_eos, self.config.service_tier)
        self.client.open()

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int, sink: TokenSink) -> None:
        if self.client is None:
            sink.on_finish("engine not started")
            return
        self.client.submit(request_id, prompt_ids, max_tokens, sink)

    def stop(self, drain: bool = True) -> None:
        if self.client is not None:
            try:
                self.client.close(drain=drain)
            finally:
                self.client = None

    def capabilities(self) -> Capabilities:
        return Capabilities("endpoint", notes=("the server was not launched by tuner: its knobs and version are its own",),
                            settings={"endpoint": self.base_url, "served_model": self.model_name,
                                      "service_tier": self.config.service_tier, "ignore_eos": self.ignore_eos,
                                      "api_key": f"${API_KEY_ENV} " + ("set" if os.environ.get(API_KEY_ENV)
                                                                       else "unset"),
                                      "max_in_flight": self.config.batch_cap})

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.base_url, "served_model": self.model_name, "models": self.models,
                "prepare_s": self.prepare_s}


# ------------------------------------------------------------------ the registry's engine API (registry.py) --- #
def open_engine(config: TrialConfig, ignore_eos: bool, log_path: Any = None) -> tuple[Any, None, Any]:
    """Reached and its model name resolved (not started), with the tokenizer of --model (the served model's)."""
    from tuner.engines.server_engine import open_server

    return open_server(EndpointEngine(config, ignore_eos=ignore_eos, log_path=log_path))


def without_draft(config: TrialConfig, model: Any, tokenizer: Any, ignore_eos: bool) -> EndpointEngine:
    return EndpointEngine(config.replace(draft="none"), ignore_eos=ignore_eos)


def serves_on_host_cpu(config: TrialConfig, device: str) -> bool:
    return False  # a remote server: this host's CPU does not bound it


def availability() -> tuple[bool, str]:
    return True, "any running OpenAI-compatible server: --endpoint URL (API key from $TUNER_API_KEY)"


def format_reason(quant: str, device: str) -> str | None:
    from tuner.quantize import unsupported_reason

    return unsupported_reason(quant, device)


def check_runs(device: str, model: str, endpoint: str | None = None, served_model: str | None = None) -> None:
    """Before a search writes anything: the endpoint is reachable and takes the API key (one-line error if not)."""
    from tuner.config import ENDPOINT_QUANT

    EndpointEngine(TrialConfig(model=model, engine="endpoint", quant=ENDPOINT_QUANT, endpoint=endpoint,
                               served_model=served_model)).prepare()
