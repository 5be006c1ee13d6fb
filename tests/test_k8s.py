"""`tuner export --to vllm|llamacpp --k8s`: a Deployment + Service that validate offline against the Kubernetes
schemas (kubernetes-validate, strict: no unknown field), run the export's argv in the engine's pinned image with
the model from a volume, probes on /health, resources from the measured peak memory (+ stated headroom), a GPU on
CUDA; for vLLM, production-stack Helm values whose flags are the export's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import PurePath

import pytest
import yaml

from tests.conftest import assert_one_line_error, run_tuner
from tests.test_export import CASES, CTX, METRICS
from tuner.config import TrialConfig
from tuner.export import Context
from tuner.export import export as do_export
from tuner.export.k8s import HELM_FILE, K8S_FILE, MEMORY_HEADROOM, manifests

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -c constraints.txt '.[test]'")
K8S_VERSIONS = ("1.30.0", "1.37.0")

NATIVE = {
    "llamacpp-cpu": ("llamacpp", TrialConfig("smollm2-135m", "Q8_0", 2, 0.002, "draft:smollm2-135m:3", "cpu",
                                             engine="llamacpp", threads=2),
                     Context(paths={"gguf": "/m/S.gguf", "served_gguf": "/cache/S-Q8_0.gguf",
                                    "draft_gguf": "/m/S.gguf", "served_draft_gguf": "/cache/S-Q8_0.gguf"},
                             ctx_tokens=1792, digests={"served_gguf": "ab" * 32}, metrics=METRICS)),
    "vllm-cpu": ("vllm", TrialConfig("smollm2-135m", "bf16", 4, 0.05, "ngram:3", "cpu", engine="vllm",
                                     prefix_cache="off"),
                 Context(paths={"model": "/cache/models/S-abc"}, kv_cache_gib=2, digests={"model": "cd" * 32})),
    "vllm-cuda": ("vllm", CASES["bf16-none"], CTX),
    "llamacpp-cuda": ("llamacpp", CASES["fp16-none"], CTX),
}


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("name", NATIVE)
def test_manifests_validate_against_the_kubernetes_schemas(name):
    target, config, ctx = NATIVE[name]
    files = manifests(do_export(target, config, ctx))
    objs = docs(files[K8S_FILE])
    assert [o["kind"] for o in objs] == ["Deployment", "Service"]
    for version in K8S_VERSIONS:
        for obj in objs:
            kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError with the path


@pytest.mark.parametrize("name", NATIVE)
def test_the_container_runs_the_exported_argv_with_the_model_from_the_volume(name):
    target, config, ctx = NATIVE[name]
    exp = do_export(target, config, ctx)
    deployment, service = docs(manifests(exp)[K8S_FILE])
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    assert args[-4:] == ["--host", "0.0.0.0", "--port", str(c["ports"][0]["containerPort"])]
    flags = list(exp.argv[1:]) if target == "llamacpp" else (
        ["--model", exp.argv[2], *exp.argv[3:]] if exp.argv[:2] == ["vllm", "serve"] else list(exp.argv[3:]))
    assert len(args) - 4 == len(flags)
    for got, want in zip(args[:-4], flags, strict=True):  # the same tokens, local files moved under /models
        assert got == want or (got.startswith("/models/") and PurePath(got).name == PurePath(want).name), (got, want)
    tag = c["image"].rsplit(":", 1)[1]
    assert tag not in ("latest", "server", "server-cuda") and ("b11312" in tag or tag == "v0.27.1")
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {m["mountPath"]: m["readOnly"] for m in c["volumeMounts"]} == {"/models": True}
    assert pod["volumes"][0]["persistentVolumeClaim"]["readOnly"] is True
    gpu = config.device == "cuda"
    assert (c["resources"]["limits"].get("nvidia.com/gpu") == 1) is gpu
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    for k, v in exp.env.items():
        assert {"name": k, "value": v} in c["env"]
    assert any(e.get("valueFrom", {}).get("secretKeyRef", {}).get("optional") for e in c["env"])


def test_memory_request_is_the_measured_peak_plus_stated_headroom_or_says_it_is_not_measured():
    target, config, ctx = NATIVE["llamacpp-cpu"]
    text = manifests(do_export(target, config, ctx))[K8S_FILE]
    (c,) = docs(text)[0]["spec"]["template"]["spec"]["containers"]
    mib = int(c["resources"]["requests"]["memory"].removesuffix("Mi"))
    assert METRICS["peak_rss_mb"] * (1 + MEMORY_HEADROOM) <= mib < METRICS["peak_rss_mb"] * (1 + MEMORY_HEADROOM) + 1
    assert "headroom" in text and c["resources"]["requests"]["cpu"] == "2"  # the trial's threads
    target, config, ctx = NATIVE["vllm-cpu"]
    assert "NOT measured" in manifests(do_export(target, config, ctx))[K8S_FILE]


def chart_flags(spec: dict) -> list[str]:
    """The flags vllm-stack's chart gives `vllm serve <modelURL>` for a modelSpec (helm/templates/
    deployment-vllm-multi.yaml: --host/--port, then enableChunkedPrefill when present, enablePrefixCaching always
    (false -> --no-enable-prefix-caching), maxModelLen, dtype, tensorParallelSize, maxNumSeqs,
    gpuMemoryUtilization as --gpu_memory_utilization, then extraArgs)."""
    v = spec["vllmConfig"]
    out = []
    if "enableChunkedPrefill" in v:
        out.append("--enable-chunked-prefill" if v["enableChunkedPrefill"] else "--no-enable-chunked-prefill")
    out.append("--enable-prefix-caching" if v["enablePrefixCaching"] else "--no-enable-prefix-caching")
    for key, flag in (("maxModelLen", "--max-model-len"), ("dtype", "--dtype"), ("maxNumSeqs", "--max-num-seqs"),
                      ("gpuMemoryUtilization", "--gpu-memory-utilization")):
        if key in v:
            out += [flag, str(v[key]) if key != "gpuMemoryUtilization" else f"{v[key]:.2f}"]
    return out + list(v.get("extraArgs") or [])


@pytest.mark.parametrize("name", ["vllm-cpu", "vllm-cuda"])
def test_production_stack_values_carry_the_exported_flags(name):
    target, config, ctx = NATIVE[name]
    exp = do_export(target, config, ctx)
    values = yaml.safe_load(manifests(exp)[HELM_FILE])
    (spec,) = values["servingEngineSpec"]["modelSpec"]
    argv = ["--model", exp.argv[2], *exp.argv[3:]] if exp.argv[:2] == ["vllm", "serve"] else list(exp.argv[3:])
    model = argv[argv.index("--model") + 1]
    rest = argv[:argv.index("--model")] + argv[argv.index("--model") + 2:]
    if config.prefix_cache == "auto":  # the chart always says it: vLLM's default, made explicit
        rest.append("--enable-prefix-caching")
    assert sorted(chart_flags(spec)) == sorted(r.replace(str(PurePath(model)), "/data/" + PurePath(model).name)
                                               for r in rest)
    assert spec["modelURL"] == (model if not model.startswith("/") else "/data/" + PurePath(model).name)
    assert spec["requestGPU"] == (1 if config.device == "cuda" else 0) and spec["tag"] == "v0.27.1"
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "2"} in spec["env"] or config.device == "cuda"


def test_cli_writes_the_manifests_and_kubernetes_validate_accepts_them(tmp_path):
    target, config, ctx = NATIVE["vllm-cpu"]
    path = tmp_path / "c.json"
    path.write_text(config.to_json())
    proc = run_tuner("export", "--config", str(path), "--to", "vllm", "--k8s", "-o", f"{tmp_path}/k8s/")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "k8s").iterdir()) == sorted(["export.json", HELM_FILE, K8S_FILE])
    cli = shutil.which("kubernetes-validate", path=str(PurePath(sys.executable).parent))
    out = subprocess.run([cli, "--strict", str(tmp_path / "k8s" / K8S_FILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((tmp_path / "k8s" / "export.json").read_text())["target"] == "vllm"
    assert_one_line_error(run_tuner("export", "--config", str(path), "--to", "sglang", "--k8s"), "--k8s",
                          "--to vllm or --to llamacpp")
