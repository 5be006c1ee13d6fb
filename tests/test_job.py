"""The job file at the process seam (tuner.job, `python -m tuner.child --job FILE`): a job written and read back is
itself; a search trial's job carries the settings `tuner bench` builds from the same flags; a bad job is one line,
exit 2; and (model tier) a bench run from a job gives the result the command line gives for the same settings."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_one_line_error, run_tuner
from tuner.config import TrialConfig
from tuner.job import BenchJob, EvalJob, job_to_dict, read_job, write_job
from tuner.measure.capacity import CapacityOptions
from tuner.measure.workload import WorkloadSpec
from tuner.slo import build_slo

MODEL = "smollm2-135m"


def a_bench_job(tmp_path: Path) -> BenchJob:
    """Every field away from its default (a limit with more digits than `%g` keeps, targets and bounds together)."""
    _, slo = build_slo(None, "ttft:p99", "ttft:p90<1234.5678ms;e2e:p50<9s;tpot<80ms", 0.85, 0.9)
    return BenchJob(
        config=TrialConfig(model=MODEL, engine="llamacpp", quant="Q8_0", batch_cap=3, kv_fraction=0.2,
                           draft="ngram:3", kv_type="q8_0", threads=2, ubatch=128),
        workload=WorkloadSpec(requests=17, rate=None, arrival="constant", concurrency=3, input_len=(20, 40),
                              output_len=(5, 9), shared_prefix=8, seed=11, trace=None),
        out_path=str(tmp_path / "bench.json"),
        capacity=CapacityOptions(slo=slo, probe_requests=(40, 90), max_probes=4, max_requests=500, max_wall_s=300.5,
                                 tolerance=0.2, ramp_fraction=0.15, arrival="constant", seed=11,
                                 saturation_requests=64, steady_s=7.5),
        server_log=str(tmp_path / "server.log"), timeout_s=120.0, ignore_eos=False, measure_bandwidth=False)


def an_eval_job(tmp_path: Path) -> EvalJob:
    return EvalJob(config=TrialConfig(model=MODEL, engine="vllm", quant="bf16", device="cpu"),
                   tasks=("arc_easy", "piqa"), limit=20, seed=7, out_path=str(tmp_path / "quality.json"),
                   max_quality_drop=1.5, max_limit=80, confidence=0.9, max_kld=0.05, kld_tokens=1020,
                   results_dir=str(tmp_path / "res"))


def assert_same_fields(a, b) -> None:
    """Field by field, down into nested dataclasses, with the same Python types (a tuple stays a tuple)."""
    assert type(a) is type(b)
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same_fields(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            assert_same_fields(x, y)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("make", [a_bench_job, an_eval_job])
def test_a_job_written_and_read_back_is_itself(tmp_path, make):
    job = make(tmp_path)
    path = tmp_path / "job.json"
    write_job(path, job)
    back = read_job(path)
    assert_same_fields(job, back)
    assert back == job
    assert json.loads(path.read_text())["kind"] == job.kind
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # written atomically


def test_a_search_trials_bench_job_carries_what_tuner_bench_builds_from_the_same_flags(tmp_path):
    """The job a search trial hands its child equals, field by field, the workload and capacity settings that
    `tuner bench --capacity` builds from the flags the search used to pass it (parsed by the command line's own
    parser and helpers)."""
    from tuner.cli.bench import add_parser, capacity_options
    from tuner.cli.common import workload_from_args
    from tuner.search.objective import SearchContext, bench_job
    from tuner.search.space import default_space_path, load_space

    _, slo = build_slo(None, "ttft:p99", "ttft:p90<450ms;tpot<80ms", 0.9, 0.9)
    ctx = SearchContext(model=MODEL, device="cpu", space=load_space(default_space_path("cpu")), primary=None,
                        slo=slo, max_quality_drop=1.0,
                        workload=WorkloadSpec(requests=90, rate=None, concurrency=1, input_len=(64, 192),
                                              output_len=(24, 48), shared_prefix=16, seed=7, arrival="constant"),
                        quality_tasks=("arc_easy",), quality_limit=10, probe_requests=(40, 90), max_probes=4,
                        capacity_timeout_s=300.0, saturation_requests=64, study_dir=tmp_path, results_dir=tmp_path)
    config = TrialConfig(model=MODEL, quant="bf16", batch_cap=2, kv_fraction=0.01, device="cpu")
    job = bench_job(config, ctx, tmp_path / "bench.json", tmp_path / "server.log")

    cfg = tmp_path / "config.json"
    cfg.write_text(config.to_json())
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args([
        "bench", "--config", str(cfg), "--json", str(tmp_path / "bench.json"), "--quiet", "--no-bandwidth",
        "--capacity", "--slo", "ttft:p90<450ms;tpot<80ms", "--confidence", "0.9", "--probe-requests", "40:90",
        "--max-probes", "4", "--capacity-timeout", "300s", "--requests", "90", "--input-len", "64:192",
        "--output-len", "24:48", "--shared-prefix", "16", "--seed", "7", "--arrival", "constant",
        "--attainment", "0.9", "--saturation-requests", "64"])
    spec = workload_from_args(args)
    _, cli_slo = build_slo(args.latency_target, args.latency_metric, args.slo, args.attainment, args.confidence)
    assert_same_fields(job.workload, spec)
    assert_same_fields(job.capacity, capacity_options(args, cli_slo, spec.seed, spec.arrival))
    assert job.config == config and job.measure_bandwidth is False and job.ignore_eos is True
    assert job.timeout_s == args.timeout  # the bench's own request timeout, as the command line's default


def run_job(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.child", "--job", str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def edited(tmp_path: Path, change) -> Path:
    data = json.loads(json.dumps(job_to_dict(a_bench_job(tmp_path))))
    change(data)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, needles", [
    (lambda d: d["capacity"].update(max_probs=4), ("unknown field capacity.max_probs", "max_probes")),
    (lambda d: d["capacity"].update(max_probes="four"), ("capacity.max_probes 'four' is invalid", "an integer")),
    (lambda d: d["config"].update(batch_cap=True), ("config.batch_cap True is invalid", "an integer")),
    (lambda d: d["workload"].update(input_len=[20]), ("workload.input_len [20] is invalid", "a list of 2")),
    (lambda d: d.pop("out_path"), ("field out_path is missing", "a string")),
    (lambda d: d.update(kind="train"), ("kind 'train' is invalid", "bench or eval")),
    (lambda d: d["capacity"]["slo"]["bounds"][0].update(limit_ms="fast"), ("capacity.slo.bounds[0].limit_ms",)),
    (lambda d: d["config"].update(quant="Q9_9"), ("config: unknown quantization format 'Q9_9'",)),
    (lambda d: d["capacity"].update(max_wall_s=float("nan")), ("capacity.max_wall_s nan is invalid", "finite")),
    (lambda d: d.update(capacity=[1, 2]), ("capacity [1, 2] is invalid", "an object (CapacityOptions)")),
])
def test_a_bad_job_is_one_line_exit_2(tmp_path, change, needles):
    proc = run_job(edited(tmp_path, change))
    assert_one_line_error(proc, "tuner.child: error: job ", *needles)
    assert not (tmp_path / "bench.json").exists()


def test_a_missing_or_unreadable_job_file_is_one_line_exit_2(tmp_path):
    assert_one_line_error(run_job(tmp_path / "nope.json"), "nope.json' is unreadable (No such file or directory)")
    (tmp_path / "half.json").write_text('{"kind": "bench", "config": ')
    assert_one_line_error(run_job(tmp_path / "half.json"), "half.json' is not valid JSON")
    proc = subprocess.run([sys.executable, "-m", "tuner.child", "bench", "--config", "x.json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, "tuner.child: error:", "expected --job FILE")


def test_a_bad_job_comes_back_to_the_parent_as_its_one_line_reason(tmp_path):
    from tuner.child import run_child

    res = run_child(edited(tmp_path, lambda d: d["capacity"].update(max_probes=0)), tmp_path / "bench.log", 120)
    assert res.returncode == 2
    assert res.reason == (f"tuner.child: error: job {str(tmp_path / 'job.json')!r}: capacity: --max-probes 0 is "
                          "invalid: expected an integer >= 1")


def test_the_child_never_imports_the_command_line(tmp_path):
    """A job child runs the library: `tuner.cli` is not imported even once it has read and checked its job."""
    path = tmp_path / "job.json"
    write_job(path, a_bench_job(tmp_path))
    code = ("import sys; from tuner.child import run_job; import tuner.job; tuner.job.read_job(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m == 'tuner.cli' or m.startswith('tuner.cli.')))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


# A recorded bench result, trimmed to what the report reads: trial 0000 of a real `tuner search` (smollm2-135m fp32,
# SLO ttft:p90<5s, on this 2-CPU host while it was busy), floats at 6 digits. Its report is the old bench.log's.
RECORDED_BENCH = {
    "config": {"model": MODEL, "quant": "fp32", "batch_cap": 1, "kv_fraction": 0.01, "draft": "none", "device": "cpu",
               "engine": "transformers", "kv_type": "auto"},
    "status": "ok", "reason": None,
    "engine": {"name": "transformers-cb", "device": "cpu", "info": {},
               "versions": {"transformers": "5.24.0", "torch": "2.13.0+cpu"}},
    "metrics": {
        "ttft_ms": {"n": 69, "p50": 536.571, "p90": 2433.02, "p95": 2749.21, "p99": 3499.39, "mean": 991.542,
                    "ci": {"p50": [316.369, 1120.43], "p99": [2751.99, None]}},
        "tpot_ms": {"n": 69, "p50": 42.3131, "p90": 45.2982, "p95": 48.0272, "p99": 52.2469, "mean": 42.8754,
                    "ci": {"p50": [41.5527, 43.0941], "p99": [48.4308, None]}},
        "itl_ms": {"n": 2422, "p50": 42.0504, "p90": 46.9832, "p95": 49.1994, "p99": 59.6572, "mean": 43.0364,
                   "ci": {"p50": [41.8933, 42.2143], "p99": [55.5301, 76.1058]}},
        "e2e_ms": {"n": 69, "p50": 2246.16, "p90": 3934.19, "p95": 4339.6, "p99": 5053.72, "mean": 2502.18,
                   "ci": {"p50": [1991.03, 2541.08], "p99": [4358.87, None]}},
        "capacity": {
            "requests_per_s": 0.338021, "requests_per_s_ci": [0.338021, 0.729491], "output_tokens_per_s": 12.9711,
            "verdict": "meets", "method": {"looks": 10},
            "slo": {"bounds": ["ttft:p90<5000ms"], "targets_ms": {}, "attainment": None, "confidence": 0.95},
            "saturation": {"concurrency": 2, "n": 35, "requests_per_s": 0.450695, "output_tokens_per_s": 17.2136,
                           "steady": {"completions": 31, "seconds": 68.7827}},
            "probes": [{"rate_rps": 0.338021, "ramp": 23, "n": 69, "achieved_rps": 0.359295,
                        "ttft_ms": {"p50": 536.571, "p90": 2433.02, "p99": 3499.39},
                        "tpot_ms": {"p50": 42.3131, "p90": 45.2982, "p99": 52.2469}, "attainment": None,
                        "verdict": "meets"}],
            "cost": {"requests": 138, "probes": 1, "wall_s": 357.646},
            "canary": {"itl_ms": [42.6003, 42.0005, 41.6433], "drift": -0.0140794,
                       "at": ["start", "after the saturation probe", "after the 0.338 req/s probe"]},
            "host": {"cpus": 2, "others_share": 0.340188, "steal_share": 0.000252043, "own_share": 0.35307,
                     "busiest": {"step": "the warm-up", "others_share": 0.538361, "steal_share": 0.0}},
            "machine": {"memory_bandwidth_gbs": [22.3789, 52.7508]},
            "notes": [
                "0.366 req/s and above not probed: at 81% of the saturation rate the queue needs about 46 arrivals "
                "to reach its steady state and 138 measured ones to span 3 relaxation times, more than a probe's "
                "120; a short probe there measures an engine that has not queued yet, or one draw of its queue "
                "(raise --probe-requests to claim rates closer to saturation)",
                "the host was busy during the warm-up: other processes took 54% of its 2 CPUs, the hypervisor 0% "
                "(over the whole measurement 34% and 0%): the capacity is this host's under that load, and a "
                "re-measure on a quieter host may differ",
                "not re-measured: 242 s of the capacity budget left, the measurement took 358 s (a longer "
                "--capacity-timeout re-measures a moved engine)"]},
        "peak_rss_mb": 1202.38, "roofline": {"bytes_per_token": 538060288, "bandwidth_gbs": None}, "errors": []}}

# A recorded quality result, trimmed likewise: a real gated `tuner eval` of smollm2-135m bf16 (escalated, undecided).
RECORDED_EVAL = {
    "config": {"model": MODEL, "quant": "bf16", "batch_cap": 1, "kv_fraction": 0.05, "draft": "none", "device": "cpu",
               "engine": "transformers", "kv_type": "auto"},
    "tasks": {"arc_easy": {"acc": 0.375, "acc_stderr": 0.086951, "metric": "acc_norm", "n": 32}},
    "score": 0.375, "score_stderr": 0.086951, "baseline_score": 0.375,
    "baseline_tasks": {"arc_easy": {"acc": 0.375, "acc_stderr": 0.086951, "metric": "acc_norm", "n": 32}},
    "drop_pp": 0.0, "kld_mean": 0.000930623, "kld_mean_stderr": 1.76667e-05, "kld_p99": 0.00368443,
    "top1_agree": 0.97598, "kld_tokens": 2040, "limit": 32, "seed": 1234, "cached": False,
    "paired": {"tasks": {"arc_easy": {"drop_pp": 0.0, "ci_pp": [-13.0371, 13.0371], "mcnemar_p": 1.0}},
               "drop_pp": 0.0, "ci_pp": [-13.0371, 13.0371], "confidence": 0.983333, "items": 32, "discordance": 0.0},
    "gate": {"verdict": "indeterminate", "drop_pp": 0.0, "drop_ci_pp": [-13.0371, 13.0371], "budget_pp": 1.0,
             "confidence": 0.95, "looks": 3, "confidence_per_look": 0.983333, "detectable_pp": 13.0371,
             "limit": 32, "items": 32, "escalated_limits": [16, 32],
             "warning": "the budget 1 pp is below the 13.04 pp that 32 paired items (--limit 32) can detect at "
                        "0.983333 confidence (each of 3 looks); about 430 items per task (--limit 430) would",
             "baseline": "fp32 dequantized from the bundled GGUF (already 4-bit lineage: Q4_1), not the original "
                         "bf16 checkpoint"}}

# Runs `tuner.child`'s or `tuner`'s main with the measurement replayed: run_bench / evaluate return the recorded
# result; everything after them (final result, JSON, exit code, report, the log) is the real code.
REPLAY = """import json, sys
import tuner.measure.bench, tuner.quality.run
recorded = open(sys.argv[1]).read()
tuner.measure.bench.run_bench = lambda config, opts, should_stop=None: json.loads(recorded)
tuner.quality.run.evaluate = lambda *args, **kwargs: json.loads(recorded)
if sys.argv[2] == "--job":
    from tuner.child import child_main
    sys.exit(child_main(sys.argv[2:]))
from tuner.cli import main
sys.exit(main(sys.argv[2:]))
"""


def replayed(tmp_path: Path, recorded: dict, args: list[str], log: Path | None = None) -> str:
    """`tuner ARGS`' stdout, or (`--job FILE` with a log) what the job child wrote to its log, for the recorded
    result; the child runs under tuner.child's own process runner, its stdout and stderr into the log."""
    from tuner.child import child_env, run_process

    (tmp_path / "recorded.json").write_text(json.dumps(recorded))
    argv = [sys.executable, "-c", REPLAY, str(tmp_path / "recorded.json"), *args]
    if log is None:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout
    res = run_process(argv, log, 120, child_env(None, None))
    assert res.returncode == 0, res.reason
    return log.read_text()


def test_a_bench_jobs_log_holds_the_report_tuner_bench_prints(tmp_path):
    """For the same (recorded) capacity result, the job child's bench.log holds every line `tuner bench` prints:
    the capacity head, the probe table, the cost, canary, host and bandwidth lines, every note (the host was busy,
    not re-measured), and the percentile table with each n and 95% interval."""
    printed = replayed(tmp_path, RECORDED_BENCH, [
        "bench", "--model", MODEL, "--quant", "fp32", "--batch-cap", "1", "--kv-fraction", "0.01", "--device", "cpu",
        "--quiet", "--json", str(tmp_path / "cli.json")])
    job = BenchJob(config=TrialConfig(model=MODEL, quant="fp32", batch_cap=1, kv_fraction=0.01, device="cpu"),
                   workload=WorkloadSpec(requests=4), out_path=str(tmp_path / "bench.json"))
    write_job(tmp_path / "bench_job.json", job)
    log = replayed(tmp_path, RECORDED_BENCH, ["--job", str(tmp_path / "bench_job.json")], tmp_path / "bench.log")
    for needle in ("capacity: 0.338 req/s [0.338, 0.729] = 13.0 output tok/s, verdict MEETS", "  note: the host was "
                   "busy during the warm-up", "  note: not re-measured: 242 s", "at the capacity point:",
                   "ttft_ms       69     536.6    2433.0"):
        assert needle in printed
    assert printed.strip() in log
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads((tmp_path / "cli.json").read_text())


def test_an_eval_jobs_log_holds_the_table_tuner_eval_prints(tmp_path):
    """For the same (recorded) gated quality result, the job child's quality.log holds every line `tuner eval`
    prints (the task and suite rows, KLD, the gate's verdict, escalation, warning and baseline), its own wall time
    last."""
    args = ["--max-quality-drop", "1", "--max-limit", "32"]
    printed = replayed(tmp_path, RECORDED_EVAL, ["eval", "--model", MODEL, "--quant", "bf16", "--limit", "16",
                                                 "--results-dir", str(tmp_path / "res"), *args])
    job = EvalJob(config=TrialConfig(model=MODEL, quant="bf16", device="cpu"), tasks=("arc_easy",), limit=16,
                  seed=1234, out_path=str(tmp_path / "quality.json"), max_quality_drop=1.0, max_limit=32,
                  results_dir=str(tmp_path / "res"))
    write_job(tmp_path / "eval_job.json", job)
    log = replayed(tmp_path, RECORDED_EVAL, ["--job", str(tmp_path / "eval_job.json")], tmp_path / "quality.log")
    table, wall = printed.strip().rsplit("\n", 1)
    assert wall.startswith("wall ") and "gate: INDETERMINATE  drop +0.0 pp [-13.0, +13.0]" in table
    assert "  escalated: --limit 16 -> 32" in table and "arc_easy        acc_norm        0.3750" in table
    assert table in log
    assert log.strip().splitlines()[-1].startswith("wall ")


# ------------------------------------------------------------------------------------------ model tier --- #
def test_a_bench_job_gives_the_result_tuner_bench_gives_for_the_same_settings(tmp_path):
    """The same fixed-load bench on smollm2-135m, once as `tuner bench` and once as a job in `tuner.child`: the same
    JSON (every key), the same config, workload, engine settings and requests (prompt and output lengths);
    timings are measured twice, so only their presence and shape are compared."""
    from tuner.child import run_child

    cli_out, job_out = tmp_path / "cli.json", tmp_path / "job_result.json"
    proc = run_tuner("bench", "--model", MODEL, "--quant", "bf16", "--batch-cap", "2", "--kv-fraction", "0.01",
                     "--device", "cpu", "--requests", "4", "--rate", "8", "--input-len", "16:32", "--output-len",
                     "4:6", "--seed", "3", "--no-bandwidth", "--quiet", "--json", str(cli_out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = BenchJob(config=TrialConfig(model=MODEL, quant="bf16", batch_cap=2, kv_fraction=0.01, device="cpu"),
                   workload=WorkloadSpec(requests=4, rate=8.0, input_len=(16, 32), output_len=(4, 6), seed=3),
                   out_path=str(job_out), measure_bandwidth=False)
    write_job(tmp_path / "bench_job.json", job)
    res = run_child(tmp_path / "bench_job.json", tmp_path / "bench.log", 600)
    assert res.returncode == 0, res.reason
    a, b = json.loads(cli_out.read_text()), json.loads(job_out.read_text())
    assert set(a) == set(b) and set(a["metrics"]) == set(b["metrics"])
    for key in ("config", "workload", "status", "reason"):
        assert a[key] == b[key], key
    assert a["engine"]["name"] == b["engine"]["name"] and a["engine"]["settings"] == b["engine"]["settings"]
    assert a["metrics"]["completed"] == b["metrics"]["completed"] == 4
    assert a["metrics"]["total_output_tokens"] == b["metrics"]["total_output_tokens"]
    keep = ("index", "prompt_tokens", "output_tokens")
    assert [{k: r.get(k) for k in keep} for r in a["requests"]] == [{k: r.get(k) for k in keep} for r in b["requests"]]
    from tuner.measure.report import format_report  # what `tuner bench` prints with

    report = format_report(b)  # the job's own result, as `tuner bench` reports it: in its log, whole
    assert report in (tmp_path / "bench.log").read_text()
    assert [ln.split()[0] for ln in report.splitlines()] == [ln.split()[0] for ln in proc.stdout.strip().splitlines()]
    assert "metric         n       p50" in report and "ttft_ms        4" in report
