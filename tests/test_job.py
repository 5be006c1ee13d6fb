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
from tuner.capacity import CapacityOptions
from tuner.config import TrialConfig
from tuner.job import BenchJob, EvalJob, job_to_dict, read_job, write_job
from tuner.targets import build_slo
from tuner.workload import WorkloadSpec

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
    from tuner.objective import SearchContext, bench_job
    from tuner.space import default_space_path, load_space

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
    assert "bench: status ok" in (tmp_path / "bench.log").read_text()
