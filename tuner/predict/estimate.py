"""Predicted capacity: the real capacity search (tuner.measure.capacity.CapacitySearch: same warm-up, canaries, saturation
probe, bracket and verdict rules) driven by a simulated engine (tuner.predict.simulate) whose step times come from
an engine profile (tuner.predict.profile), and the load generator's figures at fixed rates (what `tuner bench
--rate R` would print), every figure predicted.

The band: the same search re-run with `replicates` StepModels refitted to the profile's fitted values plus
resampled residuals (tuner.predict.fit.bootstrap_models), each with its own step-noise seed; band = [min, max] of
those capacities and the point's. It carries the fit's parameter uncertainty and the simulated run's own sampling
noise, and the engine's own speed moving since the profile was taken: the same search re-run with every step time
x (1 + speed_drift) and / (1 + speed_drift) (`SPEED_DRIFT`, what a shared host's engine moved between a profile and
its use: a canary on an idle second server moved 13% and 18% within two minutes in the runs of
tests/test_predict_llamacpp.py quiet enough for a verdict;
near saturation a few percent of step time moves the queue's latency by tens of percent, so this term dominates
there). And the model's structural error as measured: the band joined with the predicted rate x every measured /
predicted capacity ratio recorded for this profile (tuner.predict.calibration; `tuner predict --measured`). A configuration
outside what the profile measured (more sequences, longer contexts or prompts) is extrapolated: said in `notes`, and
the band widened each way by (f - 1) x the predicted rate, f the largest ratio by which it goes out of range.

The simulated scheduler admits by the engine's own limits (tuner.predict.profile.scheduler_limits: the step's
token budget and the KV capacity in tokens); the prediction says which it used (`limits`, and a
note naming their source).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from tuner.measure.capacity import CapacityOptions, CapacitySearch
from tuner.measure.metrics import compute_metrics
from tuner.measure.workload import Request, with_arrivals
from tuner.predict.calibration import same_group, widen
from tuner.predict.fit import bootstrap_models
from tuner.predict.profile import scheduler_limits, step_model
from tuner.predict.simulate import SimulatedEngine, StepModel

CURVE_SHARES = (0.25, 0.5, 0.75, 0.9, 1.0)  # curve rates, as shares of the predicted saturation rate
CURVE_REQUESTS = 120
REPLICATES = 4  # simulations with resampled fit parameters behind a band
SPEED_DRIFT = 0.2  # the band's engine speed: every step x 1.2 and / 1.2 (see the module docstring)
HOST_NOTE = "the host was busy"  # CapacitySearch's note on the real host's CPU load: meaningless in virtual time
SEARCHES_KEPT = 4096  # simulated capacity searches remembered (a whole llama.cpp space: 480 points, 2,400 with bands)


def scaled(model: StepModel, factor: float) -> StepModel:
    """`model` with every step `factor` times as long (noise unchanged): the same engine running slower or faster."""
    d = model.to_dict()
    tables = ("decode_by_batch_s", "decode_ctx_by_batch_s")
    times = {k: v * factor for k, v in d.items() if k.endswith("_s") and k not in tables}
    return StepModel(**{**d, **times, **{k: tuple((b, t * factor) for b, t in getattr(model, k)) for k in tables}})


def speed_models(model: StepModel, speed_drift: float) -> list[StepModel]:
    """The engine `speed_drift` slower and as much faster (none at 0)."""
    return [scaled(model, 1 + speed_drift), scaled(model, 1 / (1 + speed_drift))] if speed_drift > 0 else []


_DIGESTS: OrderedDict[int, tuple[tuple[Request, ...], str]] = OrderedDict()  # id(pool) -> (its requests, digest)


def pool_digest(pool: Sequence[Request]) -> str:
    """What a simulated capacity search reads of its pool, hashed: each prompt's token count and output length, in
    order (the text and arrival times are not read: the search re-times the requests it takes). The last few pools'
    digests are kept with their requests (a pool of a tail SLO holds ~40,000: hashing took 40 ms, comparing the
    same requests a fraction of one)."""
    import hashlib
    from array import array

    snapshot = tuple(pool)
    kept = _DIGESTS.get(id(pool))
    if kept is not None and kept[0] == snapshot:
        return kept[1]
    lengths = array("q", [len(r.prompt_ids) for r in snapshot]) + array("q", [r.max_tokens for r in snapshot])
    digest = hashlib.blake2b(lengths.tobytes(), digest_size=16).hexdigest()
    _DIGESTS[id(pool)] = (snapshot, digest)
    while len(_DIGESTS) > 8:
        _DIGESTS.popitem(last=False)
    return digest


_SEARCHES: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()  # the last SEARCHES_KEPT searches


def binding_kv(kv_tokens: int | None, batch_cap: int, pool: Sequence[Request]) -> int | None:
    """`kv_tokens`, or None where it never binds: `batch_cap` requests of the pool's largest prompt + output fit in
    it (a capacity search sends only the pool's requests, its canary shorter ones), so the simulation is the same to
    the last bit and KV spaces that differ only there share one (cached) search."""
    if kv_tokens is None:
        return None
    largest = max((max(1, len(r.prompt_ids)) + r.max_tokens for r in pool), default=0)
    return None if batch_cap * largest <= kv_tokens else kv_tokens


def simulated_capacity(model: StepModel, batch_cap: int, pool: Sequence[Request], options: CapacityOptions,
                       budget: int | None, seed: int, kv_tokens: int | None = None) -> dict[str, Any]:
    """One capacity search in virtual time; the real host's CPU accounting (meaningless here) left out. A pure
    function of its arguments (the simulation is deterministic for a seed): the last `SEARCHES_KEPT` are kept and a
    repeated one is a copy of the first (the search strategy simulates each point, then its band with the point
    again)."""
    import copy

    key = search_key(model, batch_cap, pool, options, budget, seed, kv_tokens)
    if key in _SEARCHES:
        _SEARCHES.move_to_end(key)
        return copy.deepcopy(_SEARCHES[key])
    engine = SimulatedEngine(model, batch_cap, kv_tokens=key[-1], token_budget=budget, seed=seed)
    result = CapacitySearch(engine.run, pool, batch_cap, options, clock=engine.clock).search()
    result.pop("host", None)
    result["notes"] = [n for n in result["notes"] if not n.startswith(HOST_NOTE)]
    keep(key, result)
    return result


def search_key(model: StepModel, batch_cap: int, pool: Sequence[Request], options: CapacityOptions,
               budget: int | None, seed: int, kv_tokens: int | None = None) -> tuple[Any, ...]:
    """What a simulated capacity search's result depends on: simulated_capacity's arguments, the pool by digest
    and the KV capacity only where it binds (its last element)."""
    return (model, batch_cap, pool_digest(pool), options, budget, seed, binding_kv(kv_tokens, batch_cap, pool))


def keep(key: tuple[Any, ...], result: dict[str, Any]) -> None:
    """Remember a search's result (a copy) under its key; the oldest beyond SEARCHES_KEPT are forgotten."""
    import copy

    _SEARCHES[key] = copy.deepcopy(result)
    _SEARCHES.move_to_end(key)
    while len(_SEARCHES) > SEARCHES_KEPT:
        _SEARCHES.popitem(last=False)


_PENDING: list[tuple[Any, ...]] = []  # prefetch's calls, read by its forked workers


def _run_pending(i: int) -> tuple[int, dict[str, Any] | None]:
    try:
        return i, simulated_capacity(*_PENDING[i])
    except Exception:  # the caller's own call raises it again, where it is handled
        return i, None


def workers_available() -> int:
    """CPUs this process may run on."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def prefetch(calls: Sequence[tuple[Any, ...]], workers: int) -> int:
    """Run the simulated_capacity calls `calls` (argument tuples) not kept yet in `workers` forked processes and keep
    each result as if it had run here: a search is a pure function of its arguments, so the serial code that then
    makes the same calls gets the same figures, only sooner (what it does not find kept it runs itself, as
    before). Nothing when fewer than 2 workers or searches, or where processes cannot fork. Returns the searches
    run."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    global _PENDING
    todo: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for call in calls:
        key = search_key(*call)
        if key not in _SEARCHES and key not in todo:
            todo[key] = call
    if workers < 2 or len(todo) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    keys, _PENDING = list(todo), list(todo.values())
    try:
        with ProcessPoolExecutor(min(workers, len(keys)), mp_context=multiprocessing.get_context("fork")) as pool:
            for i, result in pool.map(_run_pending, range(len(keys))):
                if result is not None:
                    keep(keys[i], result)
    finally:
        _PENDING = []
    return len(keys)


def percentiles(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k) for k in ("p50", "p90", "p99", "n")}


def simulated_run(model: StepModel, batch_cap: int, requests: Sequence[Request], warmup: Sequence[Request],
                  rate: float, arrival: str, arrival_seed: int, noise_seed: int, budget: int | None,
                  ramp: int = 0, kv_tokens: int | None = None) -> dict[str, Any]:
    """What `tuner bench --rate` measures: a warm-up at the batch cap, then `requests` at `rate` (the arrivals the
    workload's seed gives, as the real harness sends them); the first `ramp` requests left out of the figures."""
    engine = SimulatedEngine(model, batch_cap, kv_tokens=kv_tokens, token_budget=budget, seed=noise_seed)
    if warmup:
        engine.run(list(warmup), concurrency=batch_cap)
    load = engine.run(with_arrivals(list(requests), rate, arrival, arrival_seed))
    m = compute_metrics([r for r in load.results if r.index >= ramp], load.duration_s)
    return {"rate_rps": rate, "ttft_ms": percentiles(m["ttft_ms"]), "tpot_ms": percentiles(m["tpot_ms"]),
            "e2e_ms": percentiles(m["e2e_ms"]), "achieved_rps": m["requests_per_s"], "failed": m["failed"]}


def band_of(values: Sequence[float | None]) -> list[float | None]:
    xs = [v for v in values if v is not None]
    return [min(xs), max(xs)] if xs else [None, None]


def with_bands(point: dict[str, Any], replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """A simulated run's figures with each percentile's band over the replicas (and the point)."""
    out = dict(point)
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        out[metric] = dict(point[metric])
        out[metric]["band"] = {p: band_of([point[metric][p]] + [r[metric][p] for r in replicas])
                               for p in ("p50", "p90", "p99")}
    return out


def extrapolation(profile: dict[str, Any], batch_cap: int, pool: Sequence[Request]) -> tuple[float, list[str]]:
    """How far past the profile's measured ranges this prediction goes (1 = within), and what it says."""
    r = profile["ranges"]
    longest = max((len(q.prompt_ids) + q.max_tokens for q in pool), default=0)
    longest_prompt = max((len(q.prompt_ids) for q in pool), default=0)
    factors = {"sequences": batch_cap / r["max_seqs"], "context per sequence": longest / r["max_context_per_seq"],
               "prompt tokens": longest_prompt / r["max_prompt_tokens"]}
    limits = {"sequences": r["max_seqs"], "context per sequence": r["max_context_per_seq"],
              "prompt tokens": r["max_prompt_tokens"]}
    longest_output = max((q.max_tokens for q in pool), default=0)
    values = {"sequences": batch_cap, "context per sequence": longest, "prompt tokens": longest_prompt}
    what = {"context per sequence": f" (prompt + output tokens; outputs up to {longest_output})"}
    notes = [f"extrapolated: {values[k]} {k}{what.get(k, '')}, the profile measured up to {limits[k]}"
             for k, f in factors.items() if f > 1]
    if notes:
        notes.append(f"the band is widened by {max(factors.values()) - 1:.0%} of the predicted rate each way")
    return max([1.0, *factors.values()]), notes


def held_slope(profile: dict[str, Any], batch_cap: int) -> list[str]:
    """What a prediction past the widest batch size its profile sent long prompts at says (not an extrapolation of
    the profile's ranges: the batch and the context were each measured, the two together not)."""
    top = (profile.get("protocol") or {}).get("long_waves_to")
    if top is None or batch_cap <= top or profile.get("batch_cap", 0) <= top:
        return []
    return [f"above {top} sequences a step's cost per context token is the one fitted at {top} (the profile sent its "
            f"long prompts up to {top} sequences)"]


def history_notes(calibrated: dict[str, Any]) -> list[str]:
    """What a profile's calibration history (calibration.widen's summary) says of its bands, if anything."""
    if not calibrated["outside_band"]:
        return []
    return [f"{calibrated['outside_band']} of {calibrated['n']} capacities measured for predictions from this "
            f"profile fell outside their band ({calibrated['contradicted']} beyond the measurement's own "
            "interval): this band carries every measured / predicted ratio recorded"
            + (f" (error median {calibrated['median_error']:+.0%}, worst {calibrated['worst_error']:+.0%})"
               if calibrated["median_error"] is not None else "")]


def widened_band(rate: float, band: Sequence[float | None], factor: float, history: Sequence[dict[str, Any]]
                 ) -> tuple[list[float | None], dict[str, Any]]:
    """A band of replicate capacities as `predict` widens it: by (factor - 1) x `rate` each way past the profile's
    ranges (`extrapolation`), then joined with `rate` x every measured / predicted ratio of `history`."""
    lo, hi = band
    if factor > 1 and lo is not None and hi is not None:
        lo, hi = max(lo - (factor - 1) * rate, 0.0), hi + (factor - 1) * rate
    return widen(rate, [lo, hi], list(history))


def predict_searches(profile: dict[str, Any], config: Any, pool: Sequence[Request], options: CapacityOptions,
                     replicates: int = REPLICATES, seed: int = 0, speed_drift: float = SPEED_DRIFT
                     ) -> list[tuple[Any, ...]]:
    """The capacity searches `predict` runs, as simulated_capacity's arguments: the point (the profile's own step
    model, `seed`), then the band's `replicates` resampled fits and the speed pair (seeds `seed` + 1 ...)."""
    limit = scheduler_limits(profile, config)
    base = step_model(profile)
    fits = bootstrap_models(profile["samples"]["decode"], profile["samples"]["prefill"], base, replicates, seed,
                            profile["samples"].get("mixed", ()))
    models = [base, *fits, *speed_models(base, speed_drift)]
    return [(m, config.batch_cap, pool, options, limit["token_budget"], seed + i, limit["kv_tokens"])
            for i, m in enumerate(models)]


def predict(profile: dict[str, Any], config: Any, pool: Sequence[Request], options: CapacityOptions,
            replicates: int = REPLICATES, seed: int = 0, rates: Sequence[float] = (), shares: Sequence[float] = (),
            requests_at: Callable[[float], tuple[Sequence[Request], Sequence[Request]]] | None = None,
            speed_drift: float = SPEED_DRIFT, history: Sequence[dict[str, Any]] = (), curve: bool = True
            ) -> dict[str, Any]:
    """The predicted capacity of `config` under `options` on the capacity pool `pool`, its band, a latency-load
    curve (`curve`; else `curve` is []), and the figures `tuner bench --rate R` would measure at each of `rates` and
    at each of `shares` x the predicted capacity (x the saturation rate when no rate meets), `requests_at(R)` giving
    its (requests, warm-up). `history`: the profile's calibration records; those of the prediction's own group widen
    its band (within the profile's sequences or past them: calibration.same_group)."""
    cap = config.batch_cap
    limit = scheduler_limits(profile, config)
    budget, kv = limit["token_budget"], limit["kv_tokens"]
    calls = predict_searches(profile, config, pool, options, replicates, seed, speed_drift)
    base, models = calls[0][0], [c[0] for c in calls[1:]]
    point = simulated_capacity(*calls[0])
    reps = [simulated_capacity(*c) for c in calls[1:]]
    factor, notes = extrapolation(profile, cap, pool)
    notes += held_slope(profile, cap)
    notes.append(f"scheduler limits: {budget} tokens a step, "
                 + (f"KV {kv} tokens" if kv is not None else "no KV admission limit") + f" ({limit['source']})")
    longest_prompt = max((len(q.prompt_ids) for q in pool), default=0)
    if limit.get("chunked") is False and cap * longest_prompt > budget - cap:
        notes.append(f"without chunked prefill the engine takes a prompt only whole; the simulator splits one at the "
                     f"step budget's edge ({budget} tokens), which {cap} prompts of up to {longest_prompt} tokens "
                     "can reach: the figures may differ there")
    rate = point["requests_per_s"]
    (lo, hi), calibrated = widened_band(rate, band_of([rate] + [r["requests_per_s"] for r in reps]), factor,
                                        same_group(profile, cap, list(history)))
    notes += history_notes(calibrated)
    sat = point["saturation"]["requests_per_s"]
    n = min(CURVE_REQUESTS, len(pool))
    ramp = max(1, int(options.ramp_fraction * n))
    points = []
    for share in CURVE_SHARES if curve else ():
        r = share * sat
        runs = [simulated_run(m, cap, pool[:n], (), r, options.arrival, options.seed, seed + i, budget, ramp, kv)
                for i, m in enumerate([base, *models])]
        points.append(dict(with_bands(runs[0], runs[1:]), share_of_saturation=share))
    fixed = []
    wanted = [(r, None) for r in rates] + [(sh * (rate or sat), sh) for sh in shares]
    for r, share in wanted if requests_at is not None else []:
        reqs, warm = requests_at(r)
        runs = [simulated_run(m, cap, reqs, warm, r, options.arrival, options.seed, seed + i, budget, 0, kv)
                for i, m in enumerate([base, *models])]
        fixed.append(dict(with_bands(runs[0], runs[1:]), share=share))
    fit = profile["fit"]
    return {
        "predicted": True,
        "capacity": {"requests_per_s": rate, "band": [lo, hi], "requests_per_s_ci": point["requests_per_s_ci"],
                     "extrapolated": [n for n in notes if n.startswith("extrapolated")],
                     "verdict": point["verdict"], "saturation_rps": sat,
                     "replicates": [r["requests_per_s"] for r in reps[:replicates]],
                     "speed": [r["requests_per_s"] for r in reps[replicates:]]},
        "curve": points,
        "at_rates": fixed,
        "search": point,
        "profile": profile["id"],
        "limits": limit,
        "calibration": {"step_model": base.to_dict(), "replicates": replicates, "speed_drift": speed_drift,
                        "decode_fit": {k: fit["decode"][k] for k in ("n", "rmse_s", "relative_rmse")},
                        "prefill_fit": {k: fit["prefill"][k] for k in ("n", "rmse_s", "relative_rmse")},
                        "extrapolation_factor": factor, "profile_measured_at": profile.get("measured_at"),
                        "profile_host": profile["key"]["host"], "profile_build": profile["key"]["build"],
                        "history": calibrated},
        "notes": notes + [f"profile{' (when it was measured)' if profile.get('cached') else ''}: {n}"
                          for n in profile.get("notes") or []]
        + [f"simulated search: {n}" for n in point["notes"]],
    }
