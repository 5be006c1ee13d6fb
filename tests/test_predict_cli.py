"""`tuner predict` / `tuner profile` bad input: one line naming the value and what is accepted, exit 2."""

from __future__ import annotations

import pytest

from tests.conftest import assert_one_line_error, run_tuner

BASE = ["--model", "smollm2-135m", "--slo", "ttft:p90<2s"]


@pytest.mark.parametrize("args,needles", [
    (["predict", *BASE, "--engine", "endpoint", "--endpoint", "http://127.0.0.1:1"],
     ["--engine 'endpoint'", "expected --engine transformers, llamacpp or vllm"]),
    (["profile", "--model", "smollm2-135m", "--engine", "endpoint", "--endpoint", "http://127.0.0.1:1"],
     ["expected --engine transformers, llamacpp or vllm"]),
    (["profile", "--model", "smollm2-135m", "--draft", "ngram:3"], ["--draft 'ngram:3'", "expected --draft none"]),
    (["predict", *BASE, "--draft", "ngram:3"], ["--draft 'ngram:3'", "expected --draft none"]),
    (["predict", *BASE, "--engine", "llamacpp", "--at-share", "0"], ["--at-share 0.0 is invalid"]),
    (["predict", *BASE, "--engine", "llamacpp", "--replicates", "-1"], ["--replicates -1 is invalid"]),
    (["predict", "--model", "smollm2-135m", "--engine", "llamacpp"], ["no latency target"]),
])
def test_bad_input_is_one_line(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(run_tuner(*args, timeout=120), *needles)


def test_a_measured_bench_of_another_configuration_is_refused_before_any_profiling(tmp_path) -> None:
    import json

    missing = run_tuner("predict", *BASE, "--engine", "llamacpp", "--measured", str(tmp_path / "none.json"),
                        timeout=120)
    assert_one_line_error(missing, "--measured", "none.json", "cannot read it")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"config": {"model": "smollm2-135m", "engine": "llamacpp", "quant": "Q4_0"},
                                 "metrics": {"capacity": {"requests_per_s": 1.0, "slo": {"bounds": []}}}}))
    other = run_tuner("predict", *BASE, "--engine", "llamacpp", "--quant", "Q8_0", "--measured", str(bench),
                      timeout=120)
    assert_one_line_error(other, "--measured: the bench measured", "quant='Q4_0'", "quant='Q8_0'", "expected the same")
    assert "profiling" not in other.stdout + other.stderr
