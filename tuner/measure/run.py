"""One bench run's steps that `tuner bench` and a bench job (`python -m tuner.child --job FILE`) share: the
model sources checked before anything loads, the result made final (an unsupported configuration is the user's
error; the token ids stay in the process), its exit code; and a whole bench job run, which prints
`tuner bench`'s report (tuner.measure.report) into its log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.errors import TunerError

EXIT_CODES = {"ok": 0, "pruned": 3}  # a bench's status -> its exit code; any other status: 1


def check_sources(config: TrialConfig) -> None:
    """The model (and a draft's model) exist, and a CUDA config has a device: cheap, before anything heavy."""
    from tuner.models import resolve_source

    resolve_source(config.model)
    if config.draft_spec.kind == "draft":
        resolve_source(config.draft_spec.model)
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TunerError("--device cuda: no CUDA device is visible; expected auto or cpu on this machine")


def final_result(result: dict[str, Any]) -> dict[str, Any]:
    """`run_bench`'s result as it is reported and written: an unsupported configuration raises TunerError (one line,
    exit 2); the generated token ids are dropped."""
    if result["status"] == "unsupported":
        raise TunerError(result["reason"])
    result.pop("token_ids", None)
    return result


def exit_code(result: dict[str, Any]) -> int:
    return EXIT_CODES.get(result["status"], 1)


def run_bench_job(job: Any) -> int:
    """A `tuner.job.BenchJob`: measure, write its result JSON (atomically) to `job.out_path`, and print the report
    `tuner bench` prints for it (the child's stdout is the trial's bench.log); the exit code."""
    from transformers.utils import logging as hf_logging

    from tuner.files import write_json_atomic
    from tuner.measure.bench import BenchOptions, run_bench
    from tuner.measure.report import format_report

    check_sources(job.config)
    hf_logging.disable_progress_bar()  # a job runs quiet, as `tuner bench --quiet`
    opts = BenchOptions(workload=job.workload, timeout_s=job.timeout_s, ignore_eos=job.ignore_eos,
                        measure_bandwidth=job.measure_bandwidth, progress=False, capacity=job.capacity,
                        log_path=Path(job.server_log) if job.server_log else None)
    result = final_result(run_bench(job.config, opts))
    write_json_atomic(Path(job.out_path), result)  # first: the result is the trial's data, the report its reading
    print(format_report(result), flush=True)
    return exit_code(result)
