"""`tuner export`: golden files per target, flag validity against each engine's own flag list, the memory-fraction
formula, safe writing, and the command line on a real (small, SQLite) Optuna study.

Regenerate the goldens after an intended change with: TUNER_UPDATE_GOLDENS=1 pytest tests/test_export.py
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.conftest import assert_one_line_error
from tuner.config import TrialConfig
from tuner.errors import TunerError
from tuner.export import TARGETS, Context, exporter
from tuner.export import export as do_export
from tuner.export.common import KNOBS, memory_fraction, shell_command
from tuner.export.write import check_path, plan, render, write_files

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "export"
FLAGS = HERE / "data" / "flags"
UPDATE = os.environ.get("TUNER_UPDATE_GOLDENS") == "1"

ENGINE = {"name": "transformers-cb", "versions": {"python": "3.11.9", "torch": "2.13.0+cpu",
                                                  "transformers": "5.24.0"}, "device": "cpu"}
METRICS = {"ttft_ms": {"p50": 41.5, "p90": 80.2, "p95": 95.0, "p99": 120.25, "mean": 50.0},
           "tpot_ms": {"p50": 8.25, "p90": 10.0, "p95": 11.0, "p99": 14.5, "mean": 8.9},
           "itl_ms": {"p50": 8.0, "p90": 10.0, "p95": 11.0, "p99": 14.0, "mean": 8.7},
           "e2e_ms": {"p50": 600.0, "p90": 800.0, "p95": 850.0, "p99": 990.0, "mean": 640.0},
           "output_tokens_per_s": 412.75, "requests_per_s": 6.5, "completed": 64, "failed": 0,
           "peak_rss_mb": 1500.0, "peak_cuda_mb": 0.0, "acceptance_rate": None}
CTX = Context(study="golden", trial=7, engine=ENGINE, metrics=METRICS)
CAPACITY = {"requests_per_s": 3.25, "requests_per_s_ci": [3.25, 3.9], "verdict": "meets",
            "slo": {"bounds": ["ttft:p99<300ms"], "targets_ms": {"tpot_ms": 50.0}, "attainment": 0.9,
                    "confidence": 0.95}}

CASES = {
    "bf16-none": TrialConfig("smollm2-135m", "bf16", 8, 0.05, "none", "cuda"),
    "nf4-ngram3": TrialConfig("smollm2-135m", "bnb-nf4", 16, 0.1, "ngram:3", "auto"),
    "gptq-draft4": TrialConfig("gemma3-270m", "gptq-int4", 4, 0.2, "draft:smollm2-135m:4", "cuda"),
    "int8wo-earlyexit4": TrialConfig("smollm2-135m", "torchao-int8wo", 2, 0.05, "early-exit:4", "cpu"),
    "dir-int8-none": TrialConfig("/models/llama-3.2-1b", "bnb-int8", 32, 0.3, "none", "auto"),
    "fp32-kv1": TrialConfig("gemma3-270m", "fp32", 1, 1.0, "none", "cpu"),
    "fp4-ngram5": TrialConfig("smollm2-135m", "bnb-fp4", 3, 0.5, "ngram:5", "cuda"),
    "int4wo-draft2": TrialConfig("gemma3-270m", "torchao-int4wo", 5, 0.15, "draft:gemma3-270m:2", "auto"),
    "fp16-none": TrialConfig("smollm2-135m", "fp16", 64, 0.9, "none", "cuda"),
}
ALL = [(case, target) for case in CASES for target in TARGETS]


def golden_text(case: str, target: str) -> str:
    exp = do_export(target, CASES[case], CTX)
    return render(exp) + "\n# ==> argv <==\n" + shell_command(exp.argv) + "\n"


@pytest.mark.parametrize("case,target", ALL)
def test_golden(case: str, target: str) -> None:
    path = GOLDEN / case / f"{target}.txt"
    text = golden_text(case, target)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.is_file(), f"missing golden {path}: run with TUNER_UPDATE_GOLDENS=1"
    assert text == path.read_text(encoding="utf-8"), f"{path} differs: rerun with TUNER_UPDATE_GOLDENS=1 if intended"


def test_no_stray_goldens() -> None:
    expected = {f"{c}/{t}.txt" for c, t in ALL}
    found = {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*.txt")}
    assert found == expected


# ----------------------------------------------------------------------------------------- honesty / notes --- #
@pytest.mark.parametrize("case,target", ALL)
def test_every_knob_has_a_note_and_engine_is_named(case: str, target: str) -> None:
    exp = do_export(target, CASES[case], CTX)
    knobs = {n.knob for n in exp.notes}
    assert set(KNOBS) <= knobs, set(KNOBS) - knobs
    assert "engine" in knobs
    assert any("transformers-cb" in n.text and "transformers 5.24.0" in n.text for n in exp.notes)
    for name, text in exp.files.items():  # every file carries every note
        for n in exp.notes:
            assert str(n) in text, (name, n)
    # anything not carried over exactly is also a warning (stderr)
    assert all(n.warn for n in exp.notes if n.kind in ("approximated", "not carried over"))
    if target != "transformers":
        assert any(n.knob == "engine" and n.warn and "different engine" in n.text for n in exp.notes)


def test_same_engine_is_not_a_warning() -> None:
    exp = do_export("transformers", CASES["bf16-none"], CTX)
    assert [n for n in exp.notes if n.knob == "engine"][0].kind == "mapped"
    other = Context(engine={**ENGINE, "versions": {"transformers": "5.20.0"}})
    assert any(n.knob == "engine" and n.warn for n in do_export("transformers", CASES["bf16-none"], other).notes)
    unknown = do_export("vllm", CASES["bf16-none"], Context())
    assert any(n.knob == "engine" and "not recorded" in n.text for n in unknown.notes)


@pytest.mark.parametrize("target,needle", [("vllm", "layer-skip"), ("sglang", "layer-skip"), ("tgi", "layer-skip"),
                                           ("llamacpp", "layer-skip")])
def test_early_exit_is_reported_not_dropped(target: str, needle: str) -> None:
    exp = do_export(target, CASES["int8wo-earlyexit4"], CTX)
    dropped = [n for n in exp.notes if n.knob == "draft" and n.kind == "not carried over"]
    assert dropped and needle in dropped[0].text
    assert "early-exit" not in " ".join(exp.argv)


def test_torchao_on_tgi_and_sglang_is_reported() -> None:
    for target in ("tgi", "sglang"):
        exp = do_export(target, CASES["int8wo-earlyexit4"], CTX)
        assert any(n.knob == "quant" and n.kind == "not carried over" and "torchao" in n.text for n in exp.notes)


def test_unknown_target() -> None:
    with pytest.raises(TunerError, match="unknown export target 'foo'"):
        exporter("foo")


def test_export_json_is_accepted_by_bench_config() -> None:
    for case, target in ALL:
        exp = do_export(target, CASES[case], CTX)
        data = json.loads(exp.to_json())
        assert TrialConfig.from_json(exp.to_json()) == CASES[case]
        assert data["measured"]["engine"] == ENGINE and data["source"] == {"study": "golden", "trial": 7}
        assert data["argv"] == exp.argv and len(data["notes"]) == len(exp.notes)


@pytest.mark.parametrize("target", TARGETS)
def test_capacity_and_its_slo_are_stated_when_measured(target: str) -> None:
    """A trial measured by the capacity search: every file's header states the capacity with the SLO it was
    measured under and its verdict, and the JSON keeps the whole record (a later `bench --capacity` reads its SLO);
    a trial without one claims none."""
    ctx = Context(study="golden", trial=7, engine=ENGINE, metrics={**METRICS, "capacity": CAPACITY})
    exp = do_export(target, CASES["bf16-none"], ctx)
    for name, text in exp.files.items():
        (line,) = [ln for ln in text.splitlines() if "Capacity:" in ln]
        assert "3.25 req/s (bracket 3.25-3.9) shown to meet" in line, (name, line)
        assert "ttft:p99<300ms" in line and "90% of requests: tpot<50ms" in line, (name, line)
    assert json.loads(exp.to_json())["measured"]["metrics"]["capacity"] == CAPACITY
    plain = do_export(target, CASES["bf16-none"], CTX)
    assert not any("Capacity:" in text for text in plain.files.values())
    assert "capacity" not in json.loads(plain.to_json())["measured"]["metrics"]


# ------------------------------------------------------------------------------------------ memory formula --- #
def test_memory_fraction_formula() -> None:
    cfg = TrialConfig("smollm2-135m", "bf16", 1, 0.05)
    value, why = memory_fraction(cfg, Context(), headroom=0.02)
    w = 135e6 * 2 / 2**30 / 80
    assert value == pytest.approx(0.08) and value >= w + 0.05 * (1 - w) + 0.02
    assert "80 GiB" in why and "approximation" in why
    assert memory_fraction(cfg, Context(gpu_memory_gib=1.0), 0.0)[0] == pytest.approx(0.29)  # w = 0.2515
    assert memory_fraction(cfg.replace(kv_fraction=1.0), Context(), 0.02)[0] == 0.95  # clamped
    unknown, why = memory_fraction(TrialConfig("/models/x", "bf16", 1, 0.5), Context(), 0.0)
    assert unknown == 0.5 and "unknown" in why


# ------------------------------------------------------------------------------------------ flag validity --- #
def read_list(name: str) -> set[str]:
    path = FLAGS / name
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#") and ("Source" in lines[1] or "Source" in lines[0]), f"{name}: header missing"
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def read_choices(name: str) -> dict[str, set[str]]:
    out = {}
    for line in read_list(name):
        key, *values = line.split()
        out[key] = set(values)
    return out


def flags_of(argv: list[str]) -> list[str]:
    return [t for t in argv if t.startswith("-") and not t.lstrip("-").replace(".", "").isdigit()]


def values_of(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, t in enumerate(argv[:-1]) if t == flag]


@pytest.mark.parametrize("case", CASES)
def test_vllm_flags(case: str) -> None:
    accepted, choices = read_list("vllm-0.27.1.txt"), read_choices("vllm-0.27.1.choices.txt")
    exp = do_export("vllm", CASES[case], CTX)
    assert exp.argv[:2] == ["vllm", "serve"]
    assert set(flags_of(exp.argv)) <= accepted
    config = yaml.safe_load(exp.files["vllm-config.yaml"])
    assert {f"--{k}" for k in config} <= accepted  # vllm serve --config: keys are flag names
    # the YAML and the command line say the same thing (vLLM turns nested mappings into JSON arguments)
    pairs = dict(zip(exp.argv[3::2], exp.argv[4::2], strict=True))
    assert config["model"] == exp.argv[2]
    for key, value in config.items():
        if key != "model":
            got = pairs[f"--{key}"]
            assert (json.loads(got) == value) if isinstance(value, dict) else (got == (
                f"{value:.2f}" if isinstance(value, float) else str(value))), key
    for flag in ("--dtype", "--quantization"):
        assert set(values_of(exp.argv, flag)) <= choices[flag]
    for spec in values_of(exp.argv, "--speculative-config"):
        spec = json.loads(spec)
        assert set(spec) <= choices["speculative-config.keys"]
        assert spec["method"] in choices["speculative-config.method"]


@pytest.mark.parametrize("case", CASES)
def test_sglang_flags(case: str) -> None:
    accepted, choices = read_list("sglang-0.5.23.txt"), read_choices("sglang-0.5.23.choices.txt")
    exp = do_export("sglang", CASES[case], CTX)
    assert exp.argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert set(flags_of(exp.argv)) - {"-m"} <= accepted
    for flag in ("--dtype", "--quantization", "--load-format"):
        assert set(values_of(exp.argv, flag)) <= choices[flag]
    assert {v.upper() for v in values_of(exp.argv, "--speculative-algorithm")} <= choices["--speculative-algorithm"]


@pytest.mark.parametrize("case", CASES)
def test_tgi_flags_and_env(case: str) -> None:
    accepted, env = read_list("tgi-3.3.7.txt"), read_list("tgi-3.3.7-env.txt")
    choices = read_choices("tgi-3.3.7.choices.txt")
    exp = do_export("tgi", CASES[case], CTX)
    assert exp.argv[0] == "text-generation-launcher"
    assert set(flags_of(exp.argv)) <= accepted
    assert set(exp.env) <= env
    lines = [ln for ln in exp.files["tgi.env"].splitlines() if ln and not ln.startswith("#")]
    assert dict(ln.split("=", 1) for ln in lines) == exp.env
    assert len(exp.env) * 2 + 1 == len(exp.argv)  # every flag has its variable
    for flag in ("--quantize", "--dtype"):
        assert set(values_of(exp.argv, flag)) <= choices[flag]


@pytest.mark.parametrize("case", CASES)
def test_llamacpp_flags(case: str) -> None:
    accepted, choices = read_list("llamacpp-0c1e57098.txt"), read_choices("llamacpp-0c1e57098.choices.txt")
    exp = do_export("llamacpp", CASES[case], CTX)
    assert exp.argv[0] == "llama-server"
    assert set(flags_of(exp.argv)) <= accepted
    for flag in ("--cache-type-k", "--cache-type-v", "--spec-type"):
        short = {"--cache-type-k": "-ctk", "--cache-type-v": "-ctv"}.get(flag, flag)
        assert set(values_of(exp.argv, short)) <= choices[flag]
    assert exp.prepare, "the GGUF type is produced by llama-quantize"
    for cmd in exp.prepare:
        if cmd[0] == "llama-quantize":
            assert set(flags_of(cmd)) <= choices["llama-quantize-flags"]
            assert cmd[-1] in choices["llama-quantize"]
        else:
            assert cmd[:2] == ["python", "convert_hf_to_gguf.py"]
            assert set(flags_of(cmd)) <= choices["convert_hf_to_gguf.py-flags"]
            assert set(values_of(cmd, "--outtype")) <= choices["convert_hf_to_gguf.py--outtype"]


@pytest.fixture(scope="module")
def serve_cli() -> tuple[set[str], object | None]:
    """`transformers serve` flags and its click command from the installed package (the pinned flag list, and no
    command, when it cannot be imported)."""
    pinned = read_list("transformers-5.24.0.txt")
    try:
        import typer
        import typer.main
        from transformers.cli.serve import Serve
    except ImportError:
        return pinned, None
    app = typer.Typer()
    app.command(name="serve")(Serve)
    cmd = typer.main.get_command(app)
    live = {o for p in cmd.params for o in [*p.opts, *p.secondary_opts] if o.startswith("-")}
    import transformers

    if transformers.__version__ == "5.24.0":
        assert live == pinned, "tests/data/flags/transformers-5.24.0.txt is out of date"
    return live, cmd


@pytest.mark.parametrize("case", CASES)
def test_transformers_serve_flags_and_script(case: str, serve_cli: tuple[set[str], object | None]) -> None:
    import inspect

    from transformers import BitsAndBytesConfig, ContinuousBatchingConfig, GenerationConfig

    exp = do_export("transformers", CASES[case], CTX)
    assert exp.argv[:2] == ["transformers", "serve"]
    serve_flags, cmd = serve_cli
    assert set(flags_of(exp.argv)) <= serve_flags
    if cmd is not None:  # click parses (and type-checks) the arguments without starting a server
        ctx = cmd.make_context("serve", exp.argv[2:])
        assert ctx.params["force_model"] == exp.argv[2]
    mm = Path(inspect.getfile(GenerationConfig)).parents[1] / "cli" / "serving" / "model_manager.py"
    for q in values_of(exp.argv, "--quantization"):
        assert f'"{q}"' in mm.read_text(encoding="utf-8")  # ("bnb-4bit", "bnb-8bit")
    script = exp.files["serve_trial.py"]
    tree = ast.parse(script)
    compile(script, "serve_trial.py", "exec")
    gen_fields = set(GenerationConfig().to_dict())
    cb_fields = set(inspect.signature(ContinuousBatchingConfig).parameters)
    bnb_fields = set(inspect.signature(BitsAndBytesConfig).parameters)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            kws = {k.arg for k in node.keywords if k.arg}
            allowed = {"GenerationConfig": gen_fields, "ContinuousBatchingConfig": cb_fields,
                       "BitsAndBytesConfig": bnb_fields}.get(node.func.id)
            if allowed is not None:
                assert kws <= allowed, (node.func.id, kws - allowed)


# ---------------------------------------------------------------------------------------------- writing --- #
def test_plan_picks_file_by_extension() -> None:
    exp = do_export("vllm", CASES["bf16-none"], CTX)
    assert plan(exp, "a.yaml") == {"a.yaml": exp.files["vllm-config.yaml"]}
    assert plan(exp, "a.yml") == {"a.yml": exp.files["vllm-config.yaml"]}
    assert plan(exp, "run.sh") == {"run.sh": exp.files["serve.sh"]}
    assert plan(exp, "x.json") == {"x.json": exp.to_json()}
    assert plan(exp, "x.yaml", fmt="json") == {"x.yaml": exp.to_json()}
    assert set(plan(exp, "out/")) == {"out/vllm-config.yaml", "out/serve.sh", "out/export.json"}
    with pytest.raises(TunerError, match=r"\.json, \.sh, \.yaml"):
        plan(exp, "x.txt")
    t = do_export("transformers", CASES["bf16-none"], CTX)
    assert plan(t, "exported.py") == {"exported.py": t.files["serve_trial.py"]}


def test_write_refuses_overwrite_outside_and_is_atomic(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    sub = tmp_path / "sub"
    sub.mkdir()
    write_files({"a.txt": "one"}, cwd=sub)
    assert (sub / "a.txt").read_text() == "one"
    with pytest.raises(TunerError, match="exists: pass --force"):
        write_files({"a.txt": "two"}, cwd=sub)
    write_files({"a.txt": "two"}, force=True, cwd=sub)
    assert (sub / "a.txt").read_text() == "two"
    write_files({"../inside-tree.txt": "ok"}, cwd=sub)  # still inside the git work tree
    with pytest.raises(TunerError, match="outside the working tree"):
        write_files({"../../outside.txt": "no"}, cwd=sub)
    assert not (tmp_path.parent / "outside.txt").exists()
    absolute = tmp_path.parent / f"{tmp_path.name}-abs" / "x.yaml"
    write_files({str(absolute): "abs"}, cwd=sub)  # absolute = explicit
    assert absolute.read_text() == "abs"
    # all-or-nothing: the second path is refused before the first is written
    with pytest.raises(TunerError):
        write_files({"new/b.txt": "b", "a.txt": "clobber"}, cwd=sub)
    assert not (sub / "new").exists() and (sub / "a.txt").read_text() == "two"
    (tmp_path / "adir").mkdir()
    with pytest.raises(TunerError, match="is a directory"):
        check_path("adir", cwd=tmp_path)
    assert not list(tmp_path.rglob("*.tmp"))


# ---------------------------------------------------------------------------------- command line (real study) --- #
@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real SQLite Optuna study with the attributes `tuner search` writes, built in a child process."""
    d = tmp_path_factory.mktemp("export-study")
    code = f"""
import optuna
optuna.logging.set_verbosity(optuna.logging.WARNING)
s = optuna.create_study(study_name="s1", storage="sqlite:///tuner.db", direction="maximize")
engine, metrics = {ENGINE!r}, {METRICS!r}
configs = [{CASES['bf16-none'].to_dict()!r}, {CASES['nf4-ngram3'].to_dict()!r}]
for value, cfg in enumerate(configs):
    t = s.ask()
    t.set_user_attr("config", cfg); t.set_user_attr("metrics", metrics); t.set_user_attr("engine", engine)
    if value == 1:
        t.set_user_attr("capacity", {CAPACITY!r})  # as `tuner search` stores it, apart from the metrics
    s.tell(t, float(value))
t = s.ask(); t.set_user_attr("reason", "OOM while loading"); s.tell(t, state=optuna.trial.TrialState.FAIL)
t = s.ask(); s.tell(t, 3.0)
s.set_user_attr("recommended_trial", 1)
optuna.create_study(study_name="empty", storage="sqlite:///tuner.db")
"""
    subprocess.run([sys.executable, "-c", code], cwd=d, check=True, timeout=120)
    (d / ".git").mkdir()  # the working tree for output paths
    return d


def tuner(d: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", "export", "--storage", "sqlite:///tuner.db", *args],
                          cwd=d, capture_output=True, text=True, timeout=120, env={**os.environ})


def test_cli_best_to_stdout_and_trial_to_json(study_dir: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        best, out = pool.map(lambda a: tuner(study_dir, *a), [
            ("--study", "s1", "--best", "--to", "vllm"),
            ("--study", "s1", "--trial", "0", "--to", "transformers", "-o", "exported.json"),
        ])
    assert best.returncode == 0, best.stderr
    assert "# ==> vllm-config.yaml <==" in best.stdout and "study 's1', trial 1" in best.stdout
    assert "speculative-config" in best.stdout and "ngram" in best.stdout
    assert "# Capacity: 3.25 req/s (bracket 3.25-3.9) shown to meet the SLO ttft:p99<300ms" in best.stdout
    assert "warning: engine:" in best.stderr and "Traceback" not in best.stderr
    assert out.returncode == 0, out.stderr
    data = (study_dir / "exported.json").read_text()
    assert TrialConfig.from_json(data) == CASES["bf16-none"]
    assert json.loads(data)["measured"]["engine"]["name"] == "transformers-cb"
    assert "capacity" not in json.loads(data)["measured"]["metrics"]  # trial 0 has none
    # tuner bench --config reads it: same parser as `tuner bench` uses
    again = tuner(study_dir, "--config", "exported.json", "--to", "tgi", "--format", "json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["measured"]["metrics"]["completed"] == 64


def test_cli_writes_a_directory(study_dir: Path) -> None:
    proc = tuner(study_dir, "--study", "s1", "--trial", "1", "--to", "llamacpp", "-o", "llama/")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (study_dir / "llama").iterdir()) == ["export.json", "serve.sh"]
    assert os.access(study_dir / "llama" / "serve.sh", os.X_OK)
    script = (study_dir / "llama" / "serve.sh").read_text()
    assert script.startswith("#!/usr/bin/env bash") and 'exec "${LLAMA_SERVER}"' in script
    assert shlex.split(script.splitlines()[-1].replace("\\", ""))  # parses as shell words


@pytest.mark.parametrize("args,needle", [
    (("--study", "nope", "--best", "--to", "vllm"), "no study 'nope'"),
    (("--study", "s1", "--trial", "9", "--to", "vllm"), "has no trial 9"),
    (("--study", "s1", "--trial", "2", "--to", "vllm"), "is FAIL"),
    (("--study", "s1", "--trial", "3", "--to", "vllm"), "no 'config' attribute"),
    (("--study", "empty", "--best", "--to", "vllm"), "has no recommendation"),
    (("--study", "s1", "--best", "--to", "foo"), "invalid choice: 'foo'"),
    (("--study", "s1", "--to", "vllm"), "--trial N or --best"),
    (("--study", "s1", "--best", "--to", "vllm", "-o", "../outside.yaml"), "outside the working tree"),
    (("--study", "s1", "--best", "--to", "vllm", "-o", "exists.yaml"), "exists: pass --force"),
    (("--study", "s1", "--best", "--to", "sglang", "-o", "x.yaml"), "cannot write the sglang export"),
    (("--study", "s1", "--best", "--to", "vllm", "--storage", "sqlite:///missing.db"), "no such database file"),
])
def test_cli_bad_input(study_dir: Path, args: tuple[str, ...], needle: str) -> None:
    (study_dir / "exists.yaml").write_text("keep\n")
    before = sorted(p.name for p in study_dir.iterdir())
    proc = tuner(study_dir, *args)
    assert_one_line_error(proc, needle)
    assert proc.stdout == ""
    assert sorted(p.name for p in study_dir.iterdir()) == before  # nothing written
    assert (study_dir / "exists.yaml").read_text() == "keep\n"
    assert not (study_dir.parent / "outside.yaml").exists()


def test_cli_force_overwrites(study_dir: Path) -> None:
    (study_dir / "forced.yaml").write_text("old\n")
    proc = tuner(study_dir, "--study", "s1", "--best", "--to", "vllm", "-o", "forced.yaml", "--force")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load((study_dir / "forced.yaml").read_text())["max-num-seqs"] == 16


# ------------------------------------------------------------------------------------------ local files, docs --- #
def test_checkpoint_params_reads_safetensors_headers(tmp_path: Path) -> None:
    import struct

    from tuner.export.locate import checkpoint_params, locate

    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                         "__metadata__": {"format": "pt"}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(24))
    assert checkpoint_params(str(tmp_path)) == 6.0
    assert checkpoint_params(str(tmp_path / "missing")) is None
    cfg = TrialConfig(str(tmp_path), "gptq-int4", 1, 0.1)
    assert locate(cfg, "/x/ckpt-gptq") == {"model": "/x/ckpt-gptq", "gptq": "/x/ckpt-gptq"}
    assert locate(cfg.replace(quant="bf16"), "/x/m.gguf") == {"model": "/x/m.gguf", "gguf": "/x/m.gguf"}
    exp = do_export("vllm", TrialConfig(str(tmp_path), "bf16", 1, 0.5), Context(params=80 * 2**30 / 2))
    assert exp.files["vllm-config.yaml"].count("w = weights ~80.00 GiB") == 1  # w = 1 -> capped at 0.9
    assert "gpu-memory-utilization: 0.95" in exp.files["vllm-config.yaml"]


def test_docs_table_names_every_target_version() -> None:
    import importlib

    doc = (HERE.parent / "docs" / "export.md").read_text(encoding="utf-8")
    headers = [ln for ln in doc.splitlines() if ln.startswith("| knob")]
    assert len(headers) == 1
    for target, ref in TARGETS.items():
        module = importlib.import_module(ref.split(":")[0])
        assert module.ENGINE.split(" ", 1)[1].lstrip("@") in headers[0], target


def test_registries_agree() -> None:
    from tuner.cli.export import TARGET_NAMES

    assert tuple(TARGETS) == TARGET_NAMES


def test_the_alias_table_names_the_files_its_weights_packages_ship() -> None:
    """tuner.models.ALIASES is the one table of bundled-model facts: its module, GGUF file name and part packages
    are those of the installed weights packages (exports and locate name the file by gguf_name)."""
    import importlib
    import importlib.util

    from tuner.models import ALIASES

    for name, alias in ALIASES.items():
        assert alias.name == name
        spec = importlib.util.find_spec(alias.module)
        assert spec is not None, alias.module
        if alias.part_packages:
            assert importlib.import_module(alias.module).MODEL_NAME == alias.gguf_name
            for part in alias.part_packages:
                assert importlib.util.find_spec(part.replace("-", "_")) is not None, part
        else:
            assert (Path(next(iter(spec.submodule_search_locations))) / alias.gguf_name).is_file()


def test_a_draft_with_another_vocabulary_is_not_emitted_where_the_server_would_refuse_to_start():
    """llama.cpp (common/speculative.cpp) and SGLang (standalone_worker_v2.py) refuse a draft whose vocabulary
    differs at start-up: no draft flags there; vLLM 0.27.1 bridges them with use_heterogeneous_vocab."""
    c = CASES["gptq-draft4"]  # gemma3-270m target, smollm2-135m draft
    assert "-md" not in do_export("llamacpp", c).argv and "--spec-type" not in do_export("llamacpp", c).argv
    assert "--speculative-algorithm" not in do_export("sglang", c).argv
    spec = json.loads(do_export("vllm", c).argv[do_export("vllm", c).argv.index("--speculative-config") + 1])
    assert spec["use_heterogeneous_vocab"] is True
    same = CASES["int4wo-draft2"]  # gemma3 draft for gemma3: nothing refused, no bridge
    assert "-md" in do_export("llamacpp", same).argv
    spec = json.loads(do_export("vllm", same).argv[do_export("vllm", same).argv.index("--speculative-config") + 1])
    assert "use_heterogeneous_vocab" not in spec


def test_sglang_draft_of_a_quantized_target_stays_unquantized():
    c = TrialConfig("gemma3-270m", "bnb-nf4", 4, 0.2, "draft:gemma3-270m:3", "cuda")
    argv = do_export("sglang", c).argv
    assert argv[argv.index("--speculative-draft-model-quantization") + 1] == "unquant"
    plain = TrialConfig("gemma3-270m", "bf16", 4, 0.2, "draft:gemma3-270m:3", "cuda")
    assert "--speculative-draft-model-quantization" not in do_export("sglang", plain).argv


def test_tgi_memory_fraction_undoes_its_safety_factor():
    """TGI serves cuda_memory_fraction x 0.90: the flag is the intended share / 0.90, rounded up."""
    from tuner.export.common import ACTIVATION_HEADROOM, memory_fraction

    c = CASES["bf16-none"]
    share, _ = memory_fraction(c, Context(), ACTIVATION_HEADROOM)
    argv = do_export("tgi", c).argv
    flag = float(argv[argv.index("--cuda-memory-fraction") + 1])
    assert flag * 0.90 >= share and (flag - 0.01) * 0.90 < share


def test_vllm_engine_knobs_become_flags_the_pinned_vllm_accepts() -> None:
    """vLLM's own knobs (batched tokens, prefix caching, chunked prefill, reserved CPUs) reach the command line and
    the environment only when set, as flags vLLM 0.27.1's parser accepts; the YAML file says the same (vLLM's config
    loader turns `key: true` into `--key`)."""
    accepted = read_list("vllm-0.27.1.txt")
    base = TrialConfig("smollm2-135m", "bf16", 4, 0.05, "none", "cpu", engine="vllm")
    plain = do_export("vllm", base, Context(kv_cache_gib=1))
    assert not {"--max-num-batched-tokens", "--no-enable-prefix-caching", "--enable-chunked-prefill"} & set(plain.argv)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in plain.env
    cfg = base.replace(batched_tokens=512, prefix_cache="off", chunked_prefill="on", reserved_cpus=0)
    exp = do_export("vllm", cfg, Context(kv_cache_gib=1))
    # the CPU build is launched the way the vllm engine launches it (vllm-cpu's `vllm` script fails)
    assert exp.argv[:4] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert set(flags_of(exp.argv[3:])) <= accepted
    assert values_of(exp.argv, "--max-num-batched-tokens") == ["512"]
    assert "--no-enable-prefix-caching" in exp.argv and "--enable-chunked-prefill" in exp.argv
    assert exp.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and exp.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    yaml_args = []
    for key, value in yaml.safe_load(exp.files["vllm-config.yaml"]).items():
        if key != "model":
            yaml_args += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    assert yaml_args == exp.argv[5:]
    assert {n.knob for n in exp.notes} >= {"batched_tokens", "prefix_cache", "chunked_prefill", "reserved_cpus"}
    with pytest.raises(TunerError, match="prefix_cache off is a knob of engine vllm"):
        TrialConfig("smollm2-135m", engine="llamacpp", quant="F16", prefix_cache="off")
