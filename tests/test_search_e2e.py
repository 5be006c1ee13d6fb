"""A real tiny search on smollm2-135m: real benches in child processes, real lm-eval quality, a real SQLite study."""

from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import REPO, assert_one_line_error, run_tuner

SPACE = str(REPO / "tests" / "data" / "tiny_space.yaml")


def search(tmp_path, *extra):
    return run_tuner("search", "--model", "smollm2-135m", "--space", SPACE, "--results-dir", str(tmp_path),
                     "--study", "tiny", "--seed", "0", "--quiet", "--cost-per-hour", "2.5", *extra, timeout=1800)


@pytest.mark.slow
def test_tiny_search_recommends_and_resumes(tmp_path):
    import optuna

    proc = search(tmp_path, "--latency-target", "60s", "--trials", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RECOMMENDED: trial" in proc.stdout
    rec = json.loads((tmp_path / "tiny" / "recommendation.json").read_text())
    r = rec["recommendation"]
    assert r["config"]["model"] == "smollm2-135m"
    assert r["output_tokens_per_s"] > 0 and r["latency_ms"] < 60000
    assert r["quality"]["score"] is not None and r["cost_per_million_tokens"] > 0
    assert rec["baseline"]["config"]["quant"] == "fp32" and rec["baseline"]["trial"] == 0
    assert r["gain_over_baseline"] > 0
    rows = list(csv.DictReader(open(tmp_path / "tiny" / "trials.csv")))
    assert len(rows) == 3 and rows[0]["quant"] == "fp32" and rows[0]["batch_cap"] == "1"

    storage = f"sqlite:///{tmp_path / 'tuner.db'}"
    study = optuna.load_study(study_name="tiny", storage=storage)
    first = [(t.number, t.params, t.state) for t in study.trials]
    t0 = study.trials[0]
    assert t0.user_attrs["config"]["quant"] == "fp32"
    assert {"config", "metrics", "engine", "environment"} <= set(t0.user_attrs)
    assert t0.user_attrs["engine"]["versions"]["transformers"]
    assert study.user_attrs["recommended_trial"] == r["trial"]

    # closed loop: the transformers export of the recommendation re-measures the same configuration and workload
    exported = tmp_path / "exported.json"
    proc_x = run_tuner("export", "--study", "tiny", "--storage", storage, "--best", "--to", "transformers",
                       "-o", str(exported))
    assert proc_x.returncode == 0, proc_x.stderr[-2000:]
    again = tmp_path / "again.json"
    proc_b = run_tuner("bench", "--config", str(exported), "--json", str(again), "--quiet", "--no-bandwidth")
    assert proc_b.returncode == 0, proc_b.stderr[-2000:]
    stored = study.trials[r["trial"]].user_attrs["metrics"]
    re = json.loads(again.read_text())
    assert re["config"] == r["config"]
    assert re["workload"] == study.trials[r["trial"]].user_attrs["workload"]
    assert re["metrics"]["completed"] == stored["completed"]
    assert re["metrics"]["total_output_tokens"] == stored["total_output_tokens"]  # fixed lengths, same seed
    ratio = re["metrics"]["output_tokens_per_s"] / stored["output_tokens_per_s"]
    assert 0.2 < ratio < 5  # timing fidelity is a benchmark (benchmarks/bench_export_fidelity.py), not a test

    # the same command with a larger budget resumes the study: finished trials stay, one more is added
    proc2 = search(tmp_path, "--latency-target", "60s", "--trials", "4")
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert len(study.trials) == 4
    assert [(t.number, t.params, t.state) for t in study.trials[:3]] == first
    # quality is scored once per format: the resumed run reused the cache (no quality.log for a known format)
    quants = [t.user_attrs["config"]["quant"] for t in study.trials]
    logs = sorted(p.parent.name for p in (tmp_path / "tiny" / "trials").glob("*/quality.log"))
    assert len(logs) == len(set(quants))


@pytest.mark.slow
def test_impossible_target_says_so(tmp_path):
    proc = search(tmp_path, "--latency-target", "1ms", "--trials", "2", "--no-quality")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NO FEASIBLE CONFIGURATION" in proc.stdout
    rows = list(csv.DictReader(open(tmp_path / "tiny" / "trials.csv")))
    assert {r["state"] for r in rows} <= {"PRUNED", "COMPLETE"}
    assert all(r["reason"] for r in rows if r["state"] == "PRUNED")


@pytest.mark.parametrize("args,needle", [
    (["--latency-target", "300"], "latency target '300'"),
    (["--latency-target", "300ms", "--latency-metric", "ttft:p42"], "latency metric 'ttft:p42'"),
    (["--slo", "ttft:p99<3"], "SLO bound"),
    (["--latency-target", "300ms", "--max-quality-drop", "-1"], "--max-quality-drop -1.0"),
    (["--latency-target", "300ms", "--trials", "0"], "--trials 0"),
    (["--latency-target", "300ms", "--timeout", "20"], "--timeout '20'"),
    (["--latency-target", "300ms", "--storage", "nosuch://x"], "unreachable"),
    (["--latency-target", "300ms", "--storage", "sqlite:////nonexistent/dir/x.db"], "does not exist"),
    (["--latency-target", "300ms", "--storage", "not a url"], "storage 'not a url' is invalid"),
    (["--latency-target", "300ms", "--study", "bad name!"], "study name 'bad name!'"),
    (["--latency-target", "300ms", "--quality-tasks", "arc_easy,nosuchtask"], "nosuchtask"),
    (["--latency-target", "300ms", "--cost-per-hour", "0"], "--cost-per-hour"),
])
def test_bad_search_input(tmp_path, args, needle):
    res = tmp_path / "res"
    proc = run_tuner("search", "--model", "smollm2-135m", "--results-dir", str(res), *args, timeout=300)
    assert_one_line_error(proc, needle)
    assert not (res / "tuner.db").exists()


def test_bad_space_file_via_cli(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("knobs: {batch_cap: {choices: [1, -4]}}\n")
    proc = run_tuner("search", "--model", "smollm2-135m", "--latency-target", "1s", "--space", str(bad),
                     "--results-dir", str(tmp_path / "r"))
    assert_one_line_error(proc, "knobs.batch_cap.choices[1]")
    assert not (tmp_path / "r" / "tuner.db").exists()
