"""Measure one serving configuration for real: open its engine (tuner.engines.registry; an in-process engine loads
the model with its format, a server engine prepares its argv), start it, warm it up with
requests drawn from the workload itself (at the batch cap; errors surfaced, excluded from every statistic), serve
the workload -- or, with `BenchOptions.capacity`, find the highest rate it sustains within the SLO
(tuner.measure.capacity) -- and return `{config, metrics, engine, environment, workload, requests, status, reason}`.

A run never raises for what is data: an unsupported format, a load failure, an engine that dies or returns zero
tokens all come back as status "failed" (or "unsupported") with a one-line reason. Bad user input raises TunerError
before anything is loaded.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tuner.config import TrialConfig, resolve_device
from tuner.errors import TunerError, UnsupportedConfig, one_line
from tuner.measure.metrics import RequestResult, compute_metrics
from tuner.measure.workload import WorkloadSpec, build_workload


@dataclass(frozen=True)
class BenchOptions:
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    slo_ms: dict[str, float] | None = None  # per-request bounds for goodput, e.g. {"ttft_ms": 300}
    timeout_s: float = 1800.0
    ignore_eos: bool = True  # fixed output lengths, as vLLM's benchmark --ignore-eos
    verify_draft: int = 2  # requests re-generated without the draft to check greedy outputs match
    measure_bandwidth: bool = True
    progress: bool = True
    log_path: Any = None  # a server engine's log (its last lines become the failure reason)
    keep_requests: bool = True  # per-request results in the output (latency distributions)
    capacity: Any = None  # tuner.measure.capacity.CapacityOptions: measure capacity instead of one fixed load


class PeakMemory:
    """Peak memory of the process serving (the tuner's own, plus a server engine's process tree) and, on CUDA,
    the device memory in use (total - free as the driver reports it, so memory held outside PyTorch's allocator
    counts too) while a block runs.

    RSS peaks come from the kernel's own high-water marks (`VmHWM` in /proc/PID/status: exact, and free to read),
    the tuner's own reset when the block starts (`clear_refs`), read every 0.5 s (a server is stopped before the
    block ends) and at the end; the sum over the processes is an upper bound (pages they share count in each).
    Where /proc has no high-water mark, the RSS is sampled. A 20 ms psutil sampler was used first: on 2 cores its
    wake-ups took the GIL from the engine's generation thread and cost ~10% of the throughput it was watching."""

    def __init__(self, device: str, engine: Any = None, interval_s: float = 0.5) -> None:
        self.device, self.engine, self.interval_s = device, engine, interval_s
        self.peak_rss = 0
        self.peak_device = 0
        self._stop = threading.Event()

    def _pids(self) -> list[int]:
        import psutil

        pids = [os.getpid()]
        for pid in self.engine.server_pids() if self.engine is not None else []:
            try:
                server = psutil.Process(pid)
                pids += [server.pid, *(p.pid for p in server.children(recursive=True))]
            except psutil.Error:  # the server exited
                pass
        return pids

    def _rss(self) -> int:
        """Sum over the serving processes of their high-water marks (their RSS now where /proc has none)."""
        import psutil

        total = 0
        for pid in self._pids():
            peak = _vm_hwm(pid)
            if peak is None:
                try:
                    peak = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
            total += peak
        return total

    def __enter__(self) -> PeakMemory:
        device_used: Callable[[], int] | None = None
        if self.device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()

            def device_used() -> int:
                free, total = torch.cuda.mem_get_info()
                return total - free

        def sample() -> None:
            while not self._stop.wait(self.interval_s):
                self.peak_rss = max(self.peak_rss, self._rss())
                if device_used is not None:
                    self.peak_device = max(self.peak_device, device_used())

        _reset_hwm(os.getpid())  # what loading the model took before the block is not the block's
        self.peak_rss = self._rss()
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, self._rss())

    def cuda_mb(self) -> float | None:
        """Peak device memory in use (driver view), at least the allocator's own peak."""
        if self.device != "cuda":
            return None
        import torch

        return max(self.peak_device, torch.cuda.max_memory_allocated()) / 2**20


BANDWIDTH_CHILD = ("from tuner.measure.roofline import measure_bandwidth_gbs; "
                   "print(measure_bandwidth_gbs(size_mb=256, repeats=9))")


def memory_bandwidth() -> float | None:
    """The host's memory bandwidth now (GB/s): decoding a small model on CPU is bound by it, and a shared host's
    moves with its other tenants' traffic (by a third within a minute on the 2-core VM this was built on). Measured
    in a child process (None if it fails): measured here, torch's thread pool it starts on this thread stays, and an
    in-process engine's generation thread then shares the cores with it for the whole run -- transformers bf16 at
    batch cap 4 saturated at 3.2 req/s instead of 4.5 and its idle canary's gaps went from 26 to 42 ms
    (`tuner bench --capacity`, same seed, 2026-12-06)."""
    import subprocess

    try:
        out = subprocess.run([sys.executable, "-c", BANDWIDTH_CHILD], capture_output=True, text=True, timeout=120,
                             check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None


def serves_on_host_cpu(config: TrialConfig, device: str) -> bool:
    """Whether this host's CPU does the serving (so its memory bandwidth bounds the capacity): not a remote endpoint,
    not a CUDA vLLM build, not an in-process engine on a GPU."""
    from tuner.engines.registry import backend

    return backend(config.engine).engine().serves_on_host_cpu(config, device)


def _reset_hwm(pid: int) -> None:
    """Reset a process's high-water mark to its RSS now (Linux `clear_refs` 5); nothing where that is refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass


def _vm_hwm(pid: int) -> int | None:
    """The kernel's peak RSS of a process (bytes), None where /proc does not have it."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("tuner", "torch", "transformers", "bitsandbytes", "torchao", "gptqmodel", "accelerate"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"device": device, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                           "platform": platform.platform(), "versions": versions()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    else:
        try:
            with open("/proc/cpuinfo") as f:
                env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        except OSError:
            env["cpu"] = platform.processor()
    return env


def bench_prompts(config: TrialConfig, spec: WorkloadSpec, tokenizer: Any, capacity: Any = None
                  ) -> tuple[list[Any], list[Any]]:
    """The requests and the warm-up a bench sends for `spec` (the one home: `tuner predict` and the dashboard's
    what-if simulate the same prompts). Warm-up requests are drawn from the workload after the measured ones (a
    trace's first ones). `capacity` (CapacityOptions): one fresh prompt per request the capacity search may send,
    re-timed by it."""
    warm_n = max(2, config.batch_cap)
    if capacity is not None:
        spec = replace(spec, requests=max(spec.requests, capacity.pool_size(config.batch_cap, measurements=2)))
    if spec.trace:
        requests = build_workload(spec, tokenizer)
        return requests, requests[:warm_n]
    pool = build_workload(replace(spec, requests=spec.requests + warm_n), tokenizer)
    return pool[: spec.requests], pool[spec.requests:]


def check_draft_outputs(engine: Any, model: Any, requests: list[Any], token_ids: list[list[int]], n: int) -> dict:
    """Re-generate the first n requests greedily WITHOUT the draft and compare token ids with what was served."""
    import torch

    checked = matched = 0
    for req, got in list(zip(requests, token_ids))[:n]:
        if not got:
            continue
        x = torch.tensor([list(req.prompt_ids)], device=model.device)
        with torch.inference_mode():
            ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=len(got),
                                 min_new_tokens=len(got), do_sample=False,
                                 pad_token_id=engine.tokenizer.pad_token_id)[0, x.shape[1]:].tolist()
        checked += 1
        matched += int(ref == got)
    return {"draft_outputs_checked": checked, "draft_outputs_match": matched == checked if checked else None}


def run_bench(
    config: TrialConfig,
    options: BenchOptions | None = None,
    should_stop: Callable[[list[RequestResult], int], str | None] | None = None,
) -> dict[str, Any]:
    """Measure `config` under `options.workload`. See module docstring for the failure contract."""
    from tuner.engines.registry import backend
    from tuner.measure.loadgen import run_load
    from tuner.quantize import unsupported_reason

    options = options or BenchOptions()
    engine_backend = backend(config.engine)
    device = "cpu" if engine_backend.server else resolve_device(config.device)
    out: dict[str, Any] = {"config": config.to_dict(), "workload": options.workload.to_dict(), "status": "ok",
                           "reason": None, "metrics": None}
    reason = None if engine_backend.server else unsupported_reason(config.quant, device)  # before loading a model
    if reason:
        out.update(status="unsupported", reason=f"format {config.quant!r} is unsupported on {device}: {reason}")
        return out
    out["environment"] = environment(device)
    t = time.perf_counter()
    try:
        engine, model, tokenizer = engine_backend.open(config, options.ignore_eos, options.log_path)
    except UnsupportedConfig as e:
        out.update(status="unsupported", reason=str(e))
        return out
    except TunerError:
        raise
    except Exception as e:
        out.update(status="failed", reason=f"loading {config.quant} failed: {one_line(e)}")
        return out
    out["load_s"] = time.perf_counter() - t
    requests, warmup = bench_prompts(config, options.workload, tokenizer, options.capacity)
    caps = engine.capabilities()
    out["engine"] = {"name": caps.name, "settings": caps.settings, "notes": list(caps.notes),
                     "versions": out["environment"]["versions"], "device": device}

    def serve(reqs: list[Any], concurrency: int | None, timeout_s: float, should_stop: Any = None) -> Any:
        return run_load(engine, reqs, concurrency, timeout_s, should_stop, options.progress,
                        settle=options.capacity is not None)  # a probe stopped early must not slow the next

    host = options.capacity is not None and serves_on_host_cpu(config, device)
    bandwidth_before = memory_bandwidth() if host else None  # outside PeakMemory: its 256 MB are not the engine's

    with PeakMemory(device, engine) as mem:
        load_done = False
        try:
            engine.start()
            out["engine"]["info"] = engine.info()
            if options.capacity is not None:
                from tuner.measure.capacity import measure_capacity

                capacity = measure_capacity(serve, requests, config.batch_cap, options.capacity, log=progress_log())
                load = None
            else:
                out["warmup"] = warm_up(serve, warmup, config.batch_cap)
                load = serve(requests, options.workload.concurrency, options.timeout_s, should_stop)
                timings = engine.request_timings()
                if timings:
                    out["engine"]["harness_check"] = harness_check(load.results, timings)
            load_done = True
            out["engine"]["info"] = engine.info()
        except Exception as e:
            out.update(status="failed", reason=f"engine failed: {one_line(e)}")
            return out
        finally:
            # drain only a run that ended normally; an error or Ctrl-C abandons what is in flight
            engine.stop(drain=load_done and not (load is not None and load.stopped_reason))
    if load is None:
        from tuner.measure.capacity import machine_drift

        capacity["machine"] = machine_drift(bandwidth_before, memory_bandwidth() if host else None,
                                            capacity.get("canary"))
    if load is None and config.draft != "none":
        try:
            capacity["draft_effect"] = draft_effect(model, tokenizer, config, options, requests, capacity)
        except Exception as e:  # the reference run is extra evidence: its failure is said, not fatal
            capacity["draft_effect"] = {"error": f"no-draft reference failed: {one_line(e)}"}
    if load is None:
        from tuner.measure.capacity import capacity_point

        point = capacity_point(capacity) or capacity["saturation"]
        metrics = {k: point.get(k) for k in ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms", "dispatch_lag_ms",
                                             "output_tokens_per_s", "completed", "failed", "errors")}
        metrics["requests_per_s"] = point.get("achieved_rps", point.get("requests_per_s"))
        metrics["capacity"] = capacity
        out["warmup"] = capacity["warmup"]
    else:
        metrics = compute_metrics(load.results, load.duration_s, options.slo_ms)
    metrics["peak_rss_mb"] = mem.peak_rss / 2**20
    metrics["peak_cuda_mb"] = mem.cuda_mb()
    tpot_mean = (metrics.get("tpot_ms") or {}).get("mean")
    metrics["decode_tokens_per_s_per_seq"] = 1e3 / tpot_mean if tpot_mean else None
    bandwidth = None
    if options.measure_bandwidth:
        from tuner.measure.roofline import measure_bandwidth_gbs

        bandwidth = measure_bandwidth_gbs(device=device)
    from tuner.measure.roofline import bytes_per_token, roofline

    weights = engine.weights_bytes() if model is None else bytes_per_token(model)
    metrics["roofline"] = roofline(weights, metrics["decode_tokens_per_s_per_seq"], bandwidth)
    if load is not None and config.draft != "none" and options.verify_draft and model is not None:
        metrics.update(check_draft_outputs(engine, model, requests, load.token_ids, options.verify_draft))
    out["metrics"] = metrics
    if load is None:
        return out
    if options.keep_requests:
        out["requests"] = [r.to_dict() for r in load.results]
    out["token_ids"] = load.token_ids
    if load.stopped_reason:
        out.update(status="pruned", reason=load.stopped_reason)
    elif metrics["completed"] == 0:
        first = metrics["errors"][0] if metrics["errors"] else "no request completed"
        out.update(status="failed", reason=f"all {metrics['failed']} requests failed: {first}")
    return out


def draft_effect(model: Any, tokenizer: Any, config: TrialConfig, options: BenchOptions, requests: list[Any],
                 capacity: dict[str, Any]) -> dict[str, Any]:
    """A draft's effect, measured fairly: the saturation throughput of the same assisted-generation engine (same
    weights, same number of batch-1 decoders, same prompts) without the draft, next to the draft run's own."""
    from tuner.engines.registry import backend
    from tuner.measure.capacity import CapacitySearch
    from tuner.measure.loadgen import run_load

    ref = backend(config.engine).engine().without_draft(config, model, tokenizer, options.ignore_eos)
    ref.start()
    try:
        search = CapacitySearch(lambda reqs, concurrency, timeout_s, should_stop=None:
                                run_load(ref, reqs, concurrency, timeout_s, should_stop, False, settle=True),
                                requests, config.batch_cap, options.capacity)
        search.warm_up()
        sat = search.saturate()
    finally:
        ref.stop(drain=False)
    with_draft = capacity["saturation"]["requests_per_s"]
    return {"engine": ref.capabilities().name, "reference": "same engine, draft none",
            "with_draft_rps": with_draft, "without_draft_rps": sat["requests_per_s"],
            "with_draft_tokens_per_s": capacity["saturation"]["output_tokens_per_s"],
            "without_draft_tokens_per_s": sat["output_tokens_per_s"],
            "speedup": with_draft / sat["requests_per_s"] if sat["requests_per_s"] else None, "n": sat["n"]}


def harness_check(results: list[RequestResult], timings: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The client's figures against the server's own per request (llama.cpp `timings`): TTFT minus the server's
    prompt time (= queueing in the server + HTTP + harness), and the client's TPOT minus the server's time per
    generated token. Medians over the completed requests, with n."""
    import statistics

    ttft_gap, tpot_gap = [], []
    for r in results:
        t = timings.get(f"r{r.index}") or {}
        if not r.ok or r.ttft_ms is None or t.get("prompt_ms") is None:
            continue
        ttft_gap.append(r.ttft_ms - (r.dispatch_lag_ms or 0.0) - t["prompt_ms"])
        if r.tpot_ms is not None and t.get("predicted_per_token_ms") is not None:
            tpot_gap.append(r.tpot_ms - t["predicted_per_token_ms"])
    med = statistics.median
    return {"n": len(ttft_gap), "ttft_minus_server_prompt_ms_p50": med(ttft_gap) if ttft_gap else None,
            "tpot_minus_server_per_token_ms_p50": med(tpot_gap) if tpot_gap else None,
            "note": "server timings exclude its queue: at concurrency <= slots the TTFT gap is HTTP + harness"}


def warm_up(serve: Callable[..., Any], requests: list[Any], batch_cap: int) -> dict[str, Any]:
    """Serve `requests` (drawn from the workload) in a closed loop at the batch cap before anything is timed.
    Errors are surfaced: when every warm-up request fails the engine is not serving, and the run fails."""
    from tuner.measure.workload import with_arrivals

    reqs = with_arrivals(list(requests), None, "poisson", 0)
    load = serve(reqs, batch_cap, 600.0, None)
    failed = [r for r in load.results if not r.ok]
    if reqs and len(failed) == len(reqs):
        raise RuntimeError(f"every warm-up request failed: {failed[0].error}")
    return {"n": len(reqs), "concurrency": batch_cap, "failed": len(failed),
            "errors": sorted({r.error or "" for r in failed})[:3], "duration_s": load.duration_s}


def progress_log() -> Callable[[str], None]:
    """One stderr line per capacity probe (a few lines a run; in a search they go to the trial's log)."""
    import sys

    def log(line: str) -> None:
        print(f"capacity: {line}", file=sys.stderr, flush=True)

    return log


def stop_when_past(bounds: list[Any], min_fraction: float = 0.5) -> Callable[[list[RequestResult], int], str | None]:
    """Early stop: once `min_fraction` of the requests finished, stop if a bound is already exceeded (or the
    finished requests all failed)."""

    def should_stop(finished: list[RequestResult], total: int) -> str | None:
        if len(finished) < max(1, int(total * min_fraction)):
            return None
        m = compute_metrics(finished, 1.0)
        if m["completed"] == 0:
            return f"stopped at {len(finished)}/{total} requests: every finished request failed"
        for b in bounds:
            v = b.value(m)
            if v is not None and v > b.limit_ms:
                return f"stopped at {len(finished)}/{total} requests: {b.key} = {v:.0f} ms > {b.limit_ms:g} ms"
        return None

    return should_stop


