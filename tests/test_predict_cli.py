"""`tuner predict` / `tuner profile` bad input: one line naming the value and what is accepted, exit 2."""

from __future__ import annotations

import pytest

from tests.conftest import assert_one_line_error, run_tuner

BASE = ["--model", "smollm2-135m", "--slo", "ttft:p90<2s"]


@pytest.mark.parametrize("args,needles", [
    (["predict", *BASE, "--engine", "transformers"], ["--engine 'transformers'", "expected --engine llamacpp"]),
    (["profile", "--model", "smollm2-135m", "--engine", "transformers"], ["expected --engine llamacpp"]),
    (["predict", *BASE, "--engine", "llamacpp", "--at-share", "0"], ["--at-share 0.0 is invalid"]),
    (["predict", *BASE, "--engine", "llamacpp", "--replicates", "-1"], ["--replicates -1 is invalid"]),
    (["predict", "--model", "smollm2-135m", "--engine", "llamacpp"], ["no latency target"]),
])
def test_bad_input_is_one_line(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(run_tuner(*args, timeout=120), *needles)
