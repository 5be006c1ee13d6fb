"""One quality run's steps that `tuner eval` and an eval job (`python -m tuner.child --job FILE`) share: the
gate's settings checked before anything runs, the scoring (gated on a budget, or plain with its paired
comparison); and a whole eval job run, which prints `tuner eval`'s table (tuner.quality.report) into its log."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tuner.config import TrialConfig
from tuner.errors import TunerError


def check_eval_settings(max_quality_drop: Any, limit: Any, max_limit: Any, confidence: Any, max_kld: Any) -> None:
    """The gate's flags: `--max-limit` and `--max-kld` need a budget; every value in its range."""
    from tuner.quality.gate import check_confidence, check_gate_args

    if max_quality_drop is None:
        for flag, value in (("--max-limit", max_limit), ("--max-kld", max_kld)):
            if value is not None:
                raise TunerError(f"{flag} {value!r} needs --max-quality-drop PP (the budget it gates on)")
        check_confidence(confidence)
    else:
        check_gate_args(max_quality_drop, limit, max_limit if max_limit is not None else limit, confidence, max_kld)


def evaluate(config: TrialConfig, tasks: Any, limit: int, seed: int, *, max_quality_drop: float | None,
             max_limit: int | None, confidence: float, max_kld: float | None, kld_tokens: int | None
             ) -> dict[str, Any]:
    """The quality result as `tuner eval --json` writes it (without `wall_s`): gated when there is a budget,
    else the score with its paired comparison."""
    from tuner.quality.gate import gated_quality, paired_comparison, score_quality

    if max_quality_drop is None:
        result = score_quality(config, tasks, limit, seed, kld_tokens=kld_tokens)
        res = result.to_dict()
        res["paired"] = paired_comparison(result, confidence).to_dict()
        return res
    return gated_quality(config, tasks, limit, seed, max_drop_pp=max_quality_drop, max_limit=max_limit,
                         confidence=confidence, max_kld=max_kld, kld_tokens=kld_tokens).to_dict()


def run_eval_job(job: Any) -> int:
    """A `tuner.job.EvalJob`: score, write its result JSON (atomically) to `job.out_path`, and print the table
    `tuner eval` prints for it (the child's stdout is the trial's quality.log); the exit code."""
    from tuner.files import write_json_atomic
    from tuner.quality.evaldata import set_offline
    from tuner.quality.report import format_table

    t0 = time.perf_counter()
    check_eval_settings(job.max_quality_drop, job.limit, job.max_limit, job.confidence, job.max_kld)
    set_offline()
    if job.results_dir:
        os.environ["TUNER_RESULTS"] = str(Path(job.results_dir).expanduser())
    res = evaluate(job.config, job.tasks, job.limit, job.seed, max_quality_drop=job.max_quality_drop,
                   max_limit=job.max_limit, confidence=job.confidence, max_kld=job.max_kld,
                   kld_tokens=job.kld_tokens)
    res["wall_s"] = time.perf_counter() - t0
    write_json_atomic(Path(job.out_path), res)  # first: the result is the trial's data, the table its reading
    print(format_table(res), flush=True)
    return 0
