"""Quality of what llama.cpp serves, scored by llama.cpp's own `llama-perplexity` on the exact GGUF and KV type
(tuner.quality.llamacpp), cross-checked against the transformers fp32 model of the same weights."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import assert_one_line_error, run_tuner
from tuner.config import TrialConfig

MODEL = "smollm2-135m"


@pytest.fixture(autouse=True, scope="module")
def _built():
    from tuner.engines.llamacpp import bin_dir

    d = bin_dir()
    if d is None or not (d / "llama-perplexity").is_file():
        pytest.fail("llama-perplexity is not built: run `make llamacpp` (make test does)")


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNER_RESULTS", str(tmp_path))
    return tmp_path


def token_mean_choice(model, tokenizer, question: str, answers: tuple[str, ...]) -> int:
    """An independent scorer of llama.cpp's multiple-choice rule on transformers: mean log-prob per token of each
    `question + " " + answer` after the tokens every choice shares; the best choice."""
    import torch

    seqs = [tokenizer(question + " " + a)["input_ids"] for a in answers]
    prefix = 0
    while all(len(s) > prefix for s in seqs) and len({s[prefix] for s in seqs}) == 1:
        prefix += 1
    means = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            lp = [logp[j - 1, s[j]].item() for j in range(prefix, len(s))]
            means.append(sum(lp) / len(lp))
    return max(range(len(answers)), key=lambda i: means[i])


@pytest.mark.slow
def test_f32_gguf_scores_like_transformers_fp32_on_the_same_items(results):
    """The same weights (the bundled GGUF dequantized to F32 by llama-quantize; fp32 in transformers) scored by
    llama-perplexity and by an independent transformers scorer of the same rule agree item by item, and their
    accuracies are within one standard error."""
    from tuner.quality.gate import score_quality
    from tuner.quality.llamacpp import choice_tasks
    from tuner.quantize import load_model

    cfg = TrialConfig(model=MODEL, engine="llamacpp", quant="F32", kv_type="f32")
    res = score_quality(cfg, ("arc_easy",), 60, 1234, kld_tokens=255, progress=False)
    (task,) = res.tasks
    assert task.metric == "acc_per_token" and task.n == 60 and len(task.items) == 60
    llama = dict(task.items)
    model, tokenizer = load_model(TrialConfig(model=MODEL, quant="fp32"))
    items = choice_tasks("arc_easy", 60)
    hf = {str(t.doc_id): float(token_mean_choice(model, tokenizer, t.question, t.answers) == t.gold) for t in items}
    agree = sum(llama[k] == hf[k] for k in hf) / len(hf)
    acc_hf = sum(hf.values()) / len(hf)
    se = math.sqrt(acc_hf * (1 - acc_hf) / (len(hf) - 1))
    assert agree >= 0.9, (agree, task.acc, acc_hf)
    assert abs(task.acc - acc_hf) <= se, (task.acc, acc_hf, se)
    # the baseline compared with itself: no drop, no divergence
    assert res.drop_pp == 0.0 and res.kld_mean == 0.0 and res.top1_agree == 1.0


@pytest.mark.slow
def test_kld_orders_weight_and_kv_types_and_is_cached(results):
    """KLD from the F32/f32 baseline: 8-bit weights diverge less than 4-bit ones; a q4_0 KV cache on F32 weights
    diverges (the KV type is really applied); a second call is a cache hit with the same figures."""
    from tuner.engines.llamacpp import source_gguf
    from tuner.models import file_sha256
    from tuner.quality.llamacpp import score_kld

    h = file_sha256(source_gguf(MODEL))[:16]
    base = TrialConfig(model=MODEL, engine="llamacpp", quant="F32", kv_type="f32")
    q8, cached = score_kld(base.replace(quant="Q8_0"), h, 510, progress=False)
    assert not cached and q8.n_tokens == 510
    q4, _ = score_kld(base.replace(quant="Q4_0"), h, 510, progress=False)
    kv4, _ = score_kld(base.replace(kv_type="q4_0"), h, 510, progress=False)
    assert 0 < q8.mean < q4.mean, (q8, q4)
    assert q8.top1_agree > q4.top1_agree and q8.top1_agree > 0.9
    assert kv4.mean > 0 and kv4.top1_agree < 1.0
    again, cached = score_kld(base.replace(quant="Q8_0"), h, 510, progress=False)
    assert cached and again == q8


@pytest.mark.slow
def test_eval_cli_gates_a_served_gguf(tmp_path):
    """`tuner eval --engine llamacpp`: per-task acc_per_token vs the F32 baseline paired on the same items, KLD, the
    gate's verdict and its baseline sentence; the JSON names the engine and KV type."""
    out = tmp_path / "q.json"
    proc = run_tuner("eval", "--model", MODEL, "--engine", "llamacpp", "--quant", "Q8_0", "--kv-type", "q8_0",
                     "--tasks", "arc_easy,piqa", "--limit", "40", "--kld-tokens", "255", "--max-quality-drop", "20",
                     "--json", str(out), "--results-dir", str(tmp_path), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "llamacpp Q8_0 KV q8_0" in proc.stdout and "acc_per_token" in proc.stdout
    res = json.loads(out.read_text())
    assert res["config"]["engine"] == "llamacpp" and res["config"]["kv_type"] == "q8_0"
    assert set(res["items"]) == {"arc_easy", "piqa"} and len(res["items"]["arc_easy"]) == 40
    assert set(res["items"]["piqa"]) == set(res["baseline_items"]["piqa"])  # paired on the same doc ids
    gate = res["gate"]
    assert gate["verdict"] in ("within", "indeterminate") and "F32 GGUF" in gate["baseline"]
    assert gate["drop_ci_pp"][0] <= res["drop_pp"] <= gate["drop_ci_pp"][1]
    assert 0 < res["kld_mean"] and res["kld_tokens"] == 255


@pytest.mark.parametrize("args,needle", [
    (["--tasks", "winogrande"], "task 'winogrande': its choices change the context"),
    (["--quant", "bnb-nf4"], "unknown quantization format 'bnb-nf4' for engine llamacpp"),
    (["--kv-type", "q5_9"], "KV type 'q5_9' is not accepted by engine llamacpp"),
])
def test_eval_llamacpp_bad_input_is_one_line(tmp_path, args, needle):
    proc = run_tuner("eval", "--model", MODEL, "--engine", "llamacpp", "--limit", "5", "--kld-tokens", "255",
                     "--results-dir", str(tmp_path), *args, timeout=600)
    assert_one_line_error(proc, needle)
