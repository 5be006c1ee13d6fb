"""Cross-check against lm-eval itself: the stock `lm_eval` command line, pointed at our resolved task folder and the
fp32 checkpoint, must report the same per-task accuracy and stderr as `score_quality` on the same items, and (with
`--log_samples`) the same per-item values, under the same doc ids, that the paired comparison matches on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.config import TrialConfig

MODEL = "smollm2-135m"
LIMIT = 10
SEED = 1234
LM_EVAL = Path(sys.executable).parent / "lm_eval"


@pytest.mark.slow
def test_score_equals_stock_lm_eval_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from tuner.models import checkpoint_dir
    from tuner.quality.common import BATCH_SIZE
    from tuner.quality.evaldata import DEFAULT_SUITE, resolve_tasks
    from tuner.quality.gate import score_quality

    assert LM_EVAL.is_file(), "the lm_eval console script is not installed next to this python"
    monkeypatch.setenv("TUNER_RESULTS", str(tmp_path / "results"))
    ours = score_quality(TrialConfig(MODEL, quant="fp32", device="cpu"), DEFAULT_SUITE, LIMIT, SEED,
                         kld_tokens=255, progress=False)

    include = resolve_tasks(DEFAULT_SUITE, tmp_path / "evals")
    out = tmp_path / "lm_eval_out"
    cmd = [str(LM_EVAL), "--model", "hf", "--model_args", f"pretrained={checkpoint_dir(MODEL)},dtype=float32",
           "--include_path", str(include), "--tasks", ",".join(DEFAULT_SUITE), "--limit", str(LIMIT),
           "--seed", str(SEED), "--batch_size", str(BATCH_SIZE), "--device", "cpu", "--output_path", str(out),
           "--log_samples"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(out.rglob("results_*.json"))
    assert len(files) == 1, proc.stderr[-3000:]
    stock = json.loads(files[0].read_text())

    for task in ours.tasks:
        cfg = stock["configs"][task.name]
        assert cfg["dataset_path"] == "arrow", f"{task.name} did not come from our include path"
        assert stock["n-samples"][task.name]["effective"] == LIMIT == task.n
        res = stock["results"][task.name]
        assert abs(res[f"{task.metric},none"] - task.acc) <= 1e-6, (task, res)
        assert abs(res[f"{task.metric}_stderr,none"] - task.acc_stderr) <= 1e-6, (task, res)
        # per item: stock lm-eval's logged samples against the values the paired comparison uses
        logged = sorted(out.rglob(f"samples_{task.name}_*.jsonl"))
        assert len(logged) == 1, [p.name for p in out.rglob("samples_*")]
        rows = [json.loads(line) for line in logged[0].read_text().splitlines() if line.strip()]
        stock_items = {str(r["doc_id"]): float(r[task.metric]) for r in rows}
        assert stock_items == dict(task.items), task.name
    expected_metric = {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
                       "piqa": "acc_norm", "winogrande": "acc"}
    assert {t.name: t.metric for t in ours.tasks} == expected_metric
