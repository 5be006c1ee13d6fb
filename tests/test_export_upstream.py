"""Exports against the upstream rules they must satisfy: each rule written down once here, from the pinned upstream
source (file and line in a comment), and every export of the combinations tuner's search spaces allow checked
against it; plus a golden file per fixed case.

Regenerate the goldens after an intended change with: TUNER_UPDATE_GOLDENS=1 pytest tests/test_export_upstream.py
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, assert_one_line_error, run_tuner
from tests.test_export import CTX, values_of
from tuner.config import TrialConfig
from tuner.errors import TunerError
from tuner.export import Context
from tuner.export import export as do_export
from tuner.export.common import shell_command
from tuner.export.write import render

GOLDEN = Path(__file__).resolve().parent / "golden" / "upstream"
UPDATE = os.environ.get("TUNER_UPDATE_GOLDENS") == "1"

CASES = {
    "vllm-cuda-chunked-off": ("vllm", TrialConfig("smollm2-135m", "bf16", 64, 0.5, "none", "cuda", engine="vllm",
                                                  chunked_prefill="off")),
    "vllm-cpu-unmeasured-kv": ("vllm", TrialConfig("smollm2-135m", "bf16", 4, 0.1, "none", "cpu", engine="vllm")),
    "sglang-nf4-draft": ("sglang", TrialConfig("smollm2-135m", "bnb-nf4", 4, 0.2, "draft:smollm2-135m:3", "cuda")),
    "sglang-cpu": ("sglang", TrialConfig("smollm2-135m", "bf16", 4, 0.2, "none", "cpu")),
    "tgi-prefill-budget": ("tgi", TrialConfig("smollm2-135m", "bf16", 16, 0.3, "none", "cuda")),
    "llamacpp-native": ("llamacpp", TrialConfig("smollm2-135m", "Q8_0", 2, 0.002, "ngram:3", "cpu", engine="llamacpp")),
}


def case_ctx(target: str, config: TrialConfig) -> Context:
    if config.engine == "llamacpp":
        return Context(study="golden", trial=7, paths={"gguf": "/m/SmolLM2-135M-Instruct.Q4_1.gguf",
                                                       "served_gguf": "/cache/SmolLM2-135M-Instruct-Q8_0.gguf"},
                       ctx_tokens=1792, available_gib=19.6, digests={"gguf": "ab" * 32, "served_gguf": "cd" * 32})
    return CTX


@pytest.mark.parametrize("name", CASES)
def test_golden(name: str) -> None:
    target, config = CASES[name]
    exp = do_export(target, config, case_ctx(target, config))
    text = render(exp) + "\n# ==> argv <==\n" + shell_command(exp.argv) + "\n"
    path = GOLDEN / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.is_file(), f"missing golden {path}: run with TUNER_UPDATE_GOLDENS=1"
    assert text == path.read_text(encoding="utf-8"), f"{path} differs: rerun with TUNER_UPDATE_GOLDENS=1 if intended"


# ------------------------------------------------------------------------------------------------- vLLM --- #
def vllm_batched_tokens(argv: list[str], max_model_len: int) -> int:
    """vLLM 0.27.1's max_num_batched_tokens for this argv, or ValueError as its scheduler config raises it.

    vllm/engine/arg_utils.py:2751-2760: unset and chunked prefill off -> max(max_model_len, default);
    vllm/config/scheduler.py:250-261 (verify_max_model_len): chunked prefill off and max_num_batched_tokens <
    max_model_len -> ValueError; :263-268: max_num_batched_tokens < max_num_seqs -> ValueError."""
    default = 2048  # get_batch_defaults on a < 70 GB GPU (OPENAI_API_SERVER), the smaller of its two values
    chunked = "--no-enable-chunked-prefill" not in argv
    given = values_of(argv, "--max-num-batched-tokens")
    n = int(given[0]) if given else (default if chunked else max(max_model_len, default))
    if n < max_model_len and not chunked:
        raise ValueError(f"max_num_batched_tokens ({n}) is smaller than max_model_len ({max_model_len})")
    seqs = values_of(argv, "--max-num-seqs")
    if seqs and n < int(seqs[0]):
        raise ValueError(f"max_num_batched_tokens ({n}) must be >= max_num_seqs ({seqs[0]})")
    return n


def test_every_vllm_cuda_space_combination_is_accepted_by_vllms_scheduler_rule():
    """search_spaces/vllm-cuda.yaml allows chunked prefill off with batched_tokens 0 (vLLM's default); the export
    must then leave --max-num-batched-tokens to vLLM (it was batch_cap + 512, which vLLM refuses)."""
    space = yaml.safe_load((REPO / "search_spaces" / "vllm-cuda.yaml").read_text())["knobs"]
    for cap, tokens, chunked in itertools.product(space["batch_cap"]["choices"], space["batched_tokens"]["choices"],
                                                  space["chunked_prefill"]["choices"]):
        chunked = {False: "off", True: "on"}.get(chunked, chunked)  # YAML 1.1 reads `off` as false
        if chunked != "auto" and tokens not in space["chunked_prefill"]["when"]["batched_tokens"]:
            continue
        config = TrialConfig("smollm2-135m", "bf16", cap, 0.5, "none", "cuda", engine="vllm", batched_tokens=tokens,
                             chunked_prefill=chunked)
        for max_model_len in (2048, 8192, 32768):
            vllm_batched_tokens(do_export("vllm", config, CTX).argv, max_model_len)  # raises where vLLM would


def test_vllm_cpu_kv_space_unmeasured_is_sized_by_the_script_with_the_engines_rule(tmp_path):
    """Unset, VLLM_CPU_KVCACHE_SPACE leaves vLLM 0.27.1 at 0.9 x the node's total memory (vllm/platforms/cpu.py:
    137-140 reads it only when set; vllm/v1/worker/cpu_worker.py:73-77): the script sizes it the way the engine
    measures (floor(fraction x available GiB), at least 1), not a fixed 4 GiB."""
    import subprocess

    import psutil

    from tuner.engines.vllm import kv_cache_gib

    config = CASES["vllm-cpu-unmeasured-kv"][1].replace(kv_fraction=0.5)
    exp = do_export("vllm", config, CTX)
    assert "VLLM_CPU_KVCACHE_SPACE" not in exp.env
    line = next(ln for ln in exp.files["serve.sh"].splitlines() if ln.startswith("export VLLM_CPU_KVCACHE_SPACE="))
    before = kv_cache_gib(0.5, psutil.virtual_memory().available)
    got = subprocess.run(["bash", "-c", f"{line}; echo $VLLM_CPU_KVCACHE_SPACE"], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"]}).stdout.strip()
    after = kv_cache_gib(0.5, psutil.virtual_memory().available)
    assert int(got) in {before, after}, (got, before, after)


# ----------------------------------------------------------------------------------------------- SGLang --- #
def test_sglang_draft_of_a_bitsandbytes_target_loads_as_an_unquantized_checkpoint():
    """SGLang 0.5.23 server_args.py: --speculative-draft-load-format 'If not specified, will use the same format as
    --load-format' (speculative/draft_worker_common.py loads the draft with it): a bitsandbytes target's draft needs
    its own load format, as it needs --speculative-draft-model-quantization unquant."""
    for quant in ("bnb-nf4", "bnb-int8", "bnb-fp4"):
        argv = do_export("sglang", TrialConfig("smollm2-135m", quant, 4, 0.2, "draft:smollm2-135m:3", "cuda"),
                         CTX).argv
        if values_of(argv, "--load-format") not in ([], ["auto"]):
            assert values_of(argv, "--speculative-draft-load-format") == ["auto"], quant
            assert values_of(argv, "--speculative-draft-model-quantization") == ["unquant"], quant


def test_sglang_on_cpu_gets_no_gpu_memory_fraction():
    argv = do_export("sglang", CASES["sglang-cpu"][1], CTX).argv
    assert "--mem-fraction-static" not in argv and values_of(argv, "--device") == ["cpu"]
    assert "--mem-fraction-static" in do_export("sglang", CASES["sglang-cpu"][1].replace(device="cuda"), CTX).argv


# -------------------------------------------------------------------------------------------------- TGI --- #
def tgi_router_accepts(argv: list[str], support_chunking: bool, max_input_tokens: int) -> bool:
    """TGI v3 router (backends/v3/src/main.rs, after connect_backend, ~L165 of the stored tree): refuses
    `max_input_tokens > max_batch_prefill_tokens && !support_chunking`; nothing else ties the two."""
    prefill = values_of(argv, "--max-batch-prefill-tokens")
    limit = int(prefill[0]) if prefill else max_input_tokens + 50  # the launcher's default when unset
    return not (max_input_tokens > limit and not support_chunking)


def test_tgi_carries_the_step_budget_where_the_router_accepts_it():
    for cap in (1, 16, 256):
        argv = do_export("tgi", TrialConfig("smollm2-135m", "bf16", cap, 0.3, "none", "cuda"), CTX).argv
        assert values_of(argv, "--max-batch-prefill-tokens") == [str(cap + 512)]
        assert tgi_router_accepts(argv, support_chunking=True, max_input_tokens=8191)


# ------------------------------------------------------------------------------------------------ llama.cpp --- #
def test_llamacpp_export_refuses_a_draft_of_another_vocabulary_itself(tmp_path):
    """llama-server refuses a draft whose vocabulary differs at start-up (common/speculative.cpp,
    common_speculative_are_compatible); the export of such a llamacpp config says so in one line."""
    config = TrialConfig("gemma3-270m", "Q8_0", 2, 0.01, "draft:smollm2-135m:3", "cpu", engine="llamacpp")
    with pytest.raises(TunerError, match="common_speculative_are_compatible"):
        do_export("llamacpp", config, CTX)
    path = tmp_path / "c.json"
    path.write_text(config.to_json())
    assert_one_line_error(run_tuner("export", "--config", str(path), "--to", "llamacpp"), "vocabulary")


def test_llamacpp_prompt_cache_in_host_ram_is_off_so_the_kv_fraction_counts_all_context_memory():
    ctx, config = case_args("llamacpp-native")
    argv = do_export("llamacpp", config, ctx).argv
    assert values_of(argv, "--cache-ram") == ["0"]


def case_args(name: str) -> tuple[Context, TrialConfig]:
    target, config = CASES[name]
    return case_ctx(target, config), config


# ------------------------------------------------------------------------------------------------ vLLM GPTQ --- #
def test_vllm_engine_serves_tuners_gptq_checkpoint_not_a_placeholder(tmp_path, monkeypatch):
    """search_spaces/vllm-cuda.yaml offers gptq-int4: the vllm engine on CUDA points vLLM at the GPTQ checkpoint
    tuner builds (the transformers engine's, tuner.quantize.gptq_dir), which the export then names; before, the
    engine launched the placeholder name `<model>-gptq-int4-g64`. (The checkpoint here is already cached: building
    one is tuner.quantize's job, covered with the transformers engine.)"""
    from tuner.engines.vllm import gptq_checkpoint
    from tuner.quantize import gptq_dir

    monkeypatch.setenv("TUNER_CACHE", str(tmp_path))
    cached = gptq_dir("smollm2-135m")
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert gptq_checkpoint("smollm2-135m", tmp_path / "unused") == cached
    config = TrialConfig("smollm2-135m", "gptq-int4", 16, 0.5, "none", "cuda", engine="vllm")
    exp = do_export("vllm", config, Context(paths={"model": "/ckpt", "gptq": str(cached)}))
    assert exp.argv[2] == str(cached) and not any("placeholder" in n.text for n in exp.notes)
    assert any("placeholder" in n.text for n in do_export("vllm", config, CTX).notes)  # what it was without it
