"""A real tiny search on smollm2-135m: real benches in child processes, real lm-eval quality, a real SQLite study."""

from __future__ import annotations

import csv
import json
import math
import shutil

import pytest

from tests.conftest import REPO, TINY_SEARCH, assert_one_line_error, run_tuner

SPACE = str(REPO / "tests" / "data" / "tiny_space.yaml")


def search(tmp_path, *extra):
    return run_tuner("search", "--model", "smollm2-135m", "--space", SPACE, "--results-dir", str(tmp_path),
                     "--study", "tiny", "--seed", "0", "--quiet", "--cost-per-hour", "2.5", "--strategy", "measure",
                     "--probe-requests", "8:12", "--max-probes", "2", *extra, timeout=1800)


@pytest.mark.slow
def test_tiny_search_recommends_and_resumes(tiny_search, tmp_path):
    """The session's tiny search (tests/conftest.py: 3 trials at e2e:p50<60s, quality, --target-rate 10) is read
    here, and the dashboard's browser tests read its study too; the resume runs on a copy of its results."""
    import optuna

    searched, proc = tiny_search
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RECOMMENDED: trial" in proc.stdout and "within the SLO" in proc.stdout
    rec = json.loads((searched / "tiny" / "recommendation.json").read_text())
    r = rec["recommendation"]
    # the space holds drafts: on a loaded host an ngram draft's trial (transformers-assisted) can measure highest
    assert r["config"]["model"] == "smollm2-135m" and r["engine"] in ("transformers-cb", "transformers-assisted")
    assert rec["slo"]["bounds"] == ["e2e:p50<60000ms"] and rec["workload"]["input_len"] == [32, 64]
    storage = f"sqlite:///{searched / 'tuner.db'}"
    study = optuna.load_study(study_name="tiny", storage=storage)
    by_number = {t.number: t for t in study.trials}
    own = by_number[r["trial"]].user_attrs["capacity"]
    # the pick was re-measured after the last trial (a fresh child bench) and the answer reports that measure
    confirmed = study.user_attrs["confirmed"][str(r["trial"])]
    cap = confirmed["capacity"]
    # confirm-k: the k-th re-measure of the search (when the first pick fell below another trial, that one is next)
    again = list((searched / "tiny" / "trials" / f"{r['trial']:04d}").glob("confirm-*/bench.json"))
    assert len(again) == 1, again  # a trial is re-measured at most once
    written = json.loads(again[0].read_text())
    assert written["metrics"]["capacity"]["requests_per_s"] == cap["requests_per_s"] == r["capacity_requests_per_s"]
    assert r["confirmed"] and r["in_trial_requests_per_s"] == own["requests_per_s"]
    assert "re-measured after the search" in proc.stdout and study.user_attrs.get("confirming") is None
    # the recommended capacity is a probed rate that was shown to meet the SLO, and the highest among feasible trials
    assert cap["verdict"] == "meets" and own["verdict"] == "meets"
    assert any(p["rate_rps"] == cap["requests_per_s"] and p["verdict"] == "meets" for p in cap["probes"])
    feasible = [s for s in rec["pareto_front"]]
    assert r["capacity_requests_per_s"] == max(s["capacity_requests_per_s"] for s in feasible)
    assert r["quality"]["gate"]["verdict"] == "within"
    assert r["replicas"] == math.ceil(10 / r["capacity_requests_per_s"])
    base = by_number[0]
    assert rec["baseline"]["trial"] == 0 and base.user_attrs["config"]["quant"] == "fp32"
    assert base.user_attrs["capacity"]["cost"]["requests"] > 0  # the default measured the same way
    rows = list(csv.DictReader(open(searched / "tiny" / "trials.csv")))
    assert len(rows) == 3 and rows[0]["quant"] == "fp32" and rows[0]["batch_cap"] == "1"
    assert all(row["capacity_verdict"] in ("meets", "misses", "indeterminate") for row in rows)
    first = [(t.number, t.params, t.state) for t in study.trials]
    t0 = study.trials[0]
    assert {"config", "metrics", "capacity", "engine", "environment", "constraints"} <= set(t0.user_attrs)
    assert t0.user_attrs["engine"]["versions"]["transformers"]
    assert study.user_attrs["recommended_trial"] == r["trial"]

    # closed loop: the transformers export of the recommendation re-measures the same configuration, workload and
    # SLO (recorded in the export) with the capacity measure (one rate probe: what is checked is what it measured,
    # not the capacity it found)
    exported = tmp_path / "exported.json"
    proc_x = run_tuner("export", "--study", "tiny", "--storage", storage, "--best", "--to", "transformers",
                       "-o", str(exported))
    assert proc_x.returncode == 0, proc_x.stderr[-2000:]
    again = tmp_path / "again.json"
    proc_b = run_tuner("bench", "--config", str(exported), "--capacity", "--probe-requests", "8:12",
                       "--max-probes", "1", "--json", str(again), "--quiet", "--no-bandwidth")
    assert proc_b.returncode == 0, proc_b.stderr[-2000:]
    re = json.loads(again.read_text())
    assert re["config"] == r["config"]
    assert re["workload"] == by_number[r["trial"]].user_attrs["workload"]
    assert re["metrics"]["capacity"]["slo"] == cap["slo"]  # the SLO came from the export, not from a flag

    # the same command with a larger budget resumes the study (a copy of the session's results: others read them):
    # finished trials stay, one more is added
    resumed = tmp_path / "resumed"
    shutil.copytree(searched, resumed)
    storage = f"sqlite:///{resumed / 'tuner.db'}"
    proc2 = run_tuner(*TINY_SEARCH, "--results-dir", str(resumed), "--trials", "4", timeout=1800)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert len(study.trials) == 4
    assert [(t.number, t.params, t.state) for t in study.trials[:3]] == first
    # quality is scored once per format: the resumed run reused the cache (no quality.log for a known format)
    quants = [t.user_attrs["config"]["quant"] for t in study.trials]
    logs = sorted(p.parent.name for p in (resumed / "tiny" / "trials").glob("*/quality.log"))
    assert len(logs) == len(set(quants))
    # resuming with a study-defining setting changed is refused, in one line, before any trial runs
    proc3 = search(resumed, "--latency-target", "30s", "--latency-metric", "e2e:p50", "--trials", "5")
    assert_one_line_error(proc3, "study 'tiny' already exists with slo.bounds")
    assert len(optuna.load_study(study_name="tiny", storage=storage).trials) == 4


@pytest.mark.slow
def test_impossible_target_says_so(tmp_path):
    # one rate probe per trial (it starts at half the saturation rate): a capacity is `misses` only when every probe
    # was shown to miss, so one probe decides it; a second, at a quarter, showed the same 1 ms bound missed again.
    # One trial (the engine default): a 1 ms TTFT is out of every configuration's reach, and a second trial only
    # repeated the same miss (~25 s); a search whose every trial failed says the same (tests/test_reliability.py)
    proc = search(tmp_path, "--latency-target", "1ms", "--latency-metric", "ttft:p50", "--trials", "1",
                  "--no-quality", "--max-probes", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NO FEASIBLE CONFIGURATION" in proc.stdout
    rows = list(csv.DictReader(open(tmp_path / "tiny" / "trials.csv")))
    assert [r["capacity_verdict"] for r in rows] == ["misses"]  # shown to miss, not a coin flip
    assert all(r["reason"] and r["state"] == "COMPLETE" for r in rows)


@pytest.mark.parametrize("args,needle", [
    (["--latency-target", "300"], "latency target '300'"),
    (["--latency-target", "300ms", "--latency-metric", "ttft:p42"], "latency metric 'ttft:p42'"),
    (["--slo", "ttft:p99<3"], "SLO bound"),
    (["--latency-target", "300ms", "--max-quality-drop", "-1"], "--max-quality-drop -1.0"),
    (["--latency-target", "300ms", "--trials", "0"], "--trials 0"),
    (["--latency-target", "300ms", "--timeout", "20"], "--timeout '20'"),
    (["--latency-target", "300ms", "--storage", "nosuch://x"], "storage 'nosuch://x' is unusable"),
    (["--latency-target", "300ms", "--storage", "sqlite:////nonexistent/dir/x.db"], "does not exist"),
    (["--latency-target", "300ms", "--storage", "not a url"], "storage 'not a url' is invalid"),
    (["--latency-target", "300ms", "--study", "bad name!"], "study name 'bad name!'"),
    (["--latency-target", "300ms", "--quality-tasks", "arc_easy,nosuchtask"], "nosuchtask"),
    (["--latency-target", "300ms", "--cost-per-hour", "0"], "--cost-per-hour"),
    (["--latency-target", "300ms", "--confirm", "-1"], "--confirm -1"),
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


@pytest.mark.slow
def test_llamacpp_search_recommends_the_exact_server_command(tmp_path):
    """`tuner search --engine llamacpp`: every trial is a real llama-server; quality is llama-perplexity's on the
    served GGUF + KV type; the answer prints the exact llama-server argv that was measured, and `tuner export --to
    llamacpp` of the recommendation writes that same argv. One rate probe per trial: nothing here reads a capacity
    beyond the recommendation's existence, and one probe at half the saturation rate shows a 60 s e2e p50 met. Two
    trials (the engine default and one sampled): each new weight/KV format costs a llama-perplexity scoring and a
    KLD run, and nothing here depends on a third."""
    import optuna

    space = str(REPO / "tests" / "data" / "tiny_llamacpp_space.yaml")
    proc = run_tuner("search", "--model", "smollm2-135m", "--engine", "llamacpp", "--space", space,
                     "--strategy", "measure", "--results-dir", str(tmp_path), "--study", "tinyllama", "--seed", "0",
                     "--quiet",
                     "--probe-requests", "8:12", "--max-probes", "1", "--latency-target", "60s",
                     "--latency-metric", "e2e:p50", "--trials", "2", "--max-quality-drop", "30", "--confirm", "0",
                     timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RECOMMENDED: trial" in proc.stdout
    launch_line = next(line for line in proc.stdout.splitlines() if "launch (exactly what was measured)" in line)
    rec = json.loads((tmp_path / "tinyllama" / "recommendation.json").read_text())
    r = rec["recommendation"]
    assert r["engine"] == "llamacpp" and r["config"]["engine"] == "llamacpp"
    assert r["launch"][0] == "llama-server" and launch_line.split(": ", 1)[1].startswith("llama-server -m ")
    assert "llama-perplexity" in r["quality"]["gate"]["baseline"]
    storage = f"sqlite:///{tmp_path / 'tuner.db'}"
    study = optuna.load_study(study_name="tinyllama", storage=storage)
    base = study.trials[0].user_attrs["config"]
    assert (base["engine"], base["quant"], base["batch_cap"]) == ("llamacpp", "Q4_1", 1)
    exported = tmp_path / "exported.json"
    proc_x = run_tuner("export", "--study", "tinyllama", "--storage", storage, "--best", "--to", "llamacpp",
                       "-o", str(exported))
    assert proc_x.returncode == 0, proc_x.stderr[-2000:]
    assert json.loads(exported.read_text())["argv"] == r["launch"]


def test_engine_flag_conflicting_with_the_space_is_one_line(tmp_path):
    proc = run_tuner("search", "--model", "smollm2-135m", "--engine", "transformers", "--latency-target", "1s",
                     "--space", str(REPO / "tests" / "data" / "tiny_llamacpp_space.yaml"),
                     "--results-dir", str(tmp_path / "r"))
    assert_one_line_error(proc, "--engine transformers conflicts with space file")
    assert not (tmp_path / "r" / "tuner.db").exists()
