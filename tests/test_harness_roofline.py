"""The roofline where the bytes read per token are unknown (vLLM, a remote endpoint): it says "unknown" and the
bench measures, instead of a traceback from `bandwidth / None` (the bandwidth probe is on by default)."""

from __future__ import annotations

import json

from tests.conftest import run_tuner
from tuner.measure.roofline import roofline

MODEL = "smollm2-135m"


def test_unknown_bytes_per_token_is_said_not_divided():
    r = roofline(None, 40.0, 12.5)
    assert r["bound_tokens_per_s"] is None and "percent_of_bound" not in r
    assert "unknown" in r["unknown"] and r["bandwidth_gbs"] == 12.5  # the measured bandwidth is still reported


def test_bench_with_the_default_bandwidth_probe_measures_an_engine_that_does_not_know_its_weights(tmp_path):
    """A real server whose weights tuner cannot see (`--endpoint`, a llama-server the test starts; vLLM's engine
    reports None the same way): the default run (bandwidth probe on) completes and its report says "unknown"."""
    from tests.conftest import start_llama_server, stop_server

    proc, url = start_llama_server(tmp_path / "server.log", slots=2)
    try:
        out = tmp_path / "b.json"
        res = run_tuner("bench", "--endpoint", url, "--model", MODEL, "--batch-cap", "2", "--requests", "4",
                        "--concurrency", "2", "--input-len", "16:32", "--output-len", "8:8", "--quiet",
                        "--json", str(out))
    finally:
        stop_server(proc)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    m = json.loads(out.read_text())["metrics"]
    assert m["completed"] == 4 and m["roofline"]["bound_tokens_per_s"] is None
    assert m["roofline"]["bandwidth_gbs"] > 0  # the probe ran
    assert "roofline: unknown (bytes read per decoded token unknown" in res.stdout
