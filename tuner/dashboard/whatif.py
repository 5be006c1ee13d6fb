"""What-if: every configuration a `--strategy predict` study predicted, predicted again under another SLO, other
input/output lengths or another arrival process, and re-ranked, without measuring anything.

Each (profile, batch cap) of the study's predictions (tuner.dashboard.predicted.prediction_record) is one capacity
search on the simulated engine (tuner.predict.estimate.simulated_capacity, as the strategy ran it) with the study's
capacity settings, the scenario's SLO and the capacity pool the scenario's workload gives (`pool_for`: the prompts
`tuner bench --capacity` would send; the caller builds them with the model's tokenizer). Profiles come from the
profile cache by the ids the study recorded; without any, the what-if says so in one line. A target arrival rate
gives the replicas each configuration needs (predicted). Point predictions only (no band: the band re-runs each
search several times, too slow for an interactive page); the calibration of the study's measured trials is shown
beside the raw model, per calibration group as the search calibrates (tuner.predict.choose.calibrations: the
geometric mean of measured / predicted per engine, within the profile's sequences or past them), so a configuration
within its profile is not scaled by an extrapolation's error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tuner.dashboard.predicted import measured_trial
from tuner.dashboard.study import TrialView
from tuner.dashboard.views import config_text
from tuner.errors import TunerError
from tuner.search.answer import replicas


@dataclass(frozen=True)
class Scenario:
    """What the what-if changes: the SLO's terms, the workload's token lengths and arrivals, a target rate."""

    slo: str  # 'ttft:p90<2000ms' (bounds and per-request targets, ';'-separated)
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    arrival: str = "poisson"
    target_rate_rps: float | None = None


def slo_text(slo: Mapping[str, Any]) -> str:
    """A study's SLO (its `slo` attribute) as the what-if's text: 'ttft:p90<3000ms; tpot<50ms'."""
    terms = [str(b) for b in slo.get("bounds") or []]
    terms += [f"{k.removesuffix('_ms')}<{v:g}ms" for k, v in (slo.get("targets_ms") or {}).items()]
    return "; ".join(terms)


def study_scenario(attrs: Mapping[str, Any]) -> Scenario:
    """The scenario the study was searched under."""
    from tuner.measure.workload import WorkloadSpec

    w, default = attrs.get("workload") or {}, WorkloadSpec()
    return Scenario(slo_text(attrs.get("slo") or {}), tuple(w.get("input_len") or default.input_len),  # type: ignore[arg-type]
                    tuple(w.get("output_len") or default.output_len),  # type: ignore[arg-type]
                    str(w.get("arrival") or default.arrival))


def parse_scenario(slo: str, input_len: str, output_len: str, arrival: str, target_rate: str) -> Scenario:
    """The page's inputs as a Scenario; a bad value is a TunerError of one line naming it and what is accepted."""
    from tuner.measure.workload import WorkloadSpec, parse_range
    from tuner.slo import parse_slo_terms

    parse_slo_terms(slo)
    rate = None
    if str(target_rate).strip():
        try:
            rate = float(target_rate)
        except ValueError:
            rate = -1.0
        if not (rate > 0 and math.isfinite(rate)):
            raise TunerError(f"target rate {target_rate!r} is invalid: expected a number of requests per second > 0 "
                             "(or nothing)")
    lens = [parse_range(input_len, "input length"), parse_range(output_len, "output length")]
    WorkloadSpec(input_len=lens[0], output_len=lens[1], arrival=arrival)  # its checks: the one home of the rules
    return Scenario(slo.strip(), lens[0], lens[1], arrival, rate)


def scenario_slo(attrs: Mapping[str, Any], scenario: Scenario) -> Any:
    """The scenario's SLO at the study's attainment and confidence."""
    from tuner.slo import SLO, parse_slo_terms

    bounds, targets = parse_slo_terms(scenario.slo)
    old = attrs.get("slo") or {}
    return SLO(tuple(bounds), tuple(targets.items()), old.get("attainment") if targets else None,
               float(old.get("confidence", 0.95)))


def scenario_options(attrs: Mapping[str, Any], scenario: Scenario) -> tuple[Any, Any]:
    """(CapacityOptions, WorkloadSpec) of the scenario: the study's capacity settings and workload, the scenario's
    SLO, lengths and arrivals."""
    from tuner.measure.capacity import CapacityOptions
    from tuner.measure.workload import WorkloadSpec

    w = dict(attrs.get("workload") or {})
    spec = WorkloadSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in w.items()
                           if k in WorkloadSpec.__dataclass_fields__})
    spec = replace(spec, input_len=scenario.input_len, output_len=scenario.output_len, arrival=scenario.arrival)
    cap = ((attrs.get("settings") or {}).get("capacity") or {})
    kwargs: dict[str, Any] = {"slo": scenario_slo(attrs, scenario), "arrival": spec.arrival, "seed": spec.seed}
    if cap.get("probe_requests"):
        kwargs["probe_requests"] = tuple(cap["probe_requests"])
    for key, name in (("max_probes", "max_probes"), ("timeout_s", "max_wall_s"),
                      ("saturation_requests", "saturation_requests")):
        if cap.get(key) is not None:
            kwargs[name] = cap[key]
    return CapacityOptions(**kwargs), spec


def load_profiles(record: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(id -> profile) of the study's profiles found in the cache, and the ids not found."""
    from tuner.predict.profile import profiles_dir, read_profile

    ids = sorted({str(e["profile"]) for e in record.get("configurations") or [] if e.get("profile")})
    found, missing = {}, []
    for pid in ids:
        path = profiles_dir() / f"{pid}.json"
        prof = read_profile(path) if path.exists() else None
        if prof is None:
            missing.append(pid)
        else:
            found[pid] = prof
    return found, missing


def study_calibration(views: Sequence[TrialView]) -> tuple[float, float, dict[Any, tuple[float, float]],
                                                             dict[str, Any]]:
    """(ratio, spread, groups, shown) of the study's measured trials, as the search calibrates
    (tuner.predict.choose.calibrations): each trial's raw prediction beside its measured capacity in its group
    (its engine; within its profile's sequences or past them, as its prediction said), a measured 0 censored at its
    bound. `shown`: the overall ratio, spread and n (the groups within) and each group's."""
    from tuner.predict.choose import add_pair, calibrations

    pairs: dict[tuple[Any, bool], list[tuple[float, float]]] = {}
    censored: dict[tuple[Any, bool], list[tuple[float, float]]] = {}
    for v in views:
        cap = v.row.trial_capacity if v.row.trial_capacity is not None else v.capacity
        if v.state == "COMPLETE" and (v.predicted or {}).get("predicted_requests_per_s") is not None and \
                isinstance(cap, Mapping):
            add_pair(pairs, censored, (v.row.config or {}).get("engine"), v.predicted or {}, cap)
    ratio, sigma, groups = calibrations(pairs, censored)
    n = sum(len(got) for g, got in pairs.items() if g[1])
    shown = {"ratio": ratio, "spread": sigma, "n": n,
             "groups": [{"engine": g[0], "within": g[1], "ratio": r, "spread": sg, "n": len(pairs[g])}
                        for g, (r, sg) in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), not kv[0][1]))]}
    return ratio, sigma, groups, shown


def calibration_text(shown: Mapping[str, Any]) -> str:
    """`study_calibration`'s `shown` in words: 'calibrated = the model x 0.52 within their profile's sequences (3
    measured), x 0.14 past their profile's sequences (1 measured): ...', each engine named when the study has
    several."""
    groups = list(shown.get("groups") or [])
    if not groups:
        return "calibrated = the model x 1.00 (no measured trial yet)"
    engines = {g["engine"] for g in groups}
    parts = [f"x {g['ratio']:.2f} " + ("within" if g["within"] else "past") + " their profile's sequences"
             + (f" on {g['engine']}" if len(engines) > 1 else "") + f" ({g['n']} measured)" for g in groups]
    return ("calibrated = the model " + ", ".join(parts)
            + ": the geometric mean of measured / predicted per group, as the search calibrates")


PoolFor = Callable[[Any, Any, Any], list[Any]]  # (TrialConfig, WorkloadSpec, CapacityOptions) -> capacity pool


def what_if(record: Mapping[str, Any], attrs: Mapping[str, Any], views: Sequence[TrialView], scenario: Scenario,
            pool_for: PoolFor, seed: int = 0, cache: dict[Any, Any] | None = None) -> dict[str, Any]:
    """Every predicted configuration's capacity under `scenario`, ranked: {"rows", "message", "seconds",
    "simulations", "left_out", "calibration"}. `message` (one line, no rows) when nothing can be predicted. Each
    row's calibrated capacity is its prediction x its calibration group's ratio (`study_calibration`; the row's
    `calibration` says which group).
    `cache` (a dict the caller keeps between calls) holds the capacity pools per (batch cap, workload, pool size) and
    each simulation's result, so a scenario changing the SLO only does not rebuild the prompts, and one seen before
    is not simulated again."""
    from tuner.config import TrialConfig
    from tuner.predict.calibration import calibrates
    from tuner.predict.choose import calibration_for
    from tuner.predict.estimate import simulated_capacity
    from tuner.predict.profile import profiles_dir, scheduler_limits, step_model

    t0 = time.perf_counter()
    entries = list(record.get("configurations") or [])
    profiles, missing = load_profiles(record)
    out: dict[str, Any] = {"rows": [], "message": None, "seconds": 0.0, "simulations": 0, "left_out": [],
                           "calibration": None}
    if not profiles:
        out["message"] = (f"no profile of this study is in the profile cache ({profiles_dir()}): the what-if needs "
                          "them (`tuner profile` measures one)")
        return out
    options, spec = scenario_options(attrs, scenario)
    ratio, sigma, groups, out["calibration"] = study_calibration(views)
    same = scenario == replace(study_scenario(attrs), target_rate_rps=scenario.target_rate_rps)
    cache = {} if cache is None else cache
    got: dict[tuple[Any, ...], float | None] = {}  # (profile, batch cap, KV tokens, step budget)
    rows = []
    for e in entries:
        pid = str(e.get("profile"))
        if pid not in profiles:
            continue
        config = TrialConfig.from_dict(dict(e["config"]))
        lim = scheduler_limits(profiles[pid], config)  # the engine's own step budget and KV capacity
        key = (pid, config.batch_cap, lim["kv_tokens"], lim["token_budget"])
        if key not in got:
            pool_key = ("pool", config.batch_cap, spec, options.pool_size(config.batch_cap, measurements=2))
            if pool_key not in cache:
                cache[pool_key] = pool_for(config, spec, options)
            sim_key = ("simulation", *key, spec, options, seed)
            if sim_key not in cache:
                res = simulated_capacity(step_model(profiles[pid]), config.batch_cap, cache[pool_key], options,
                                         lim["token_budget"], seed, lim["kv_tokens"])
                cache[sim_key] = float(res.get("requests_per_s") or 0.0)
            got[key] = cache[sim_key]
        rps = got[key]
        within = calibrates(profiles[pid], config.batch_cap)
        r_cal = calibration_for(config.engine, within, groups, ratio, sigma)[0]
        m = measured_trial(e["config"], views)
        m_cap = (m.row.trial_capacity if m is not None and m.row.trial_capacity is not None else
                 m.capacity if m is not None else None) or {}
        rows.append({"rank": 0, "config": config_text(e["config"]), "quant": e["config"].get("quant"),
                     "batch_cap": config.batch_cap, "predicted_rps": rps,
                     "calibrated_rps": rps * r_cal if rps is not None else None,
                     "calibration": "within its profile" if within else "past its profile (extrapolated)",
                     "study_predicted_rps": e.get("predicted_requests_per_s"),
                     "measured_trial": m.number if m is not None else None,
                     "measured_rps": (m_cap.get("requests_per_s") if same else None),
                     "replicas_needed": replicas(scenario.target_rate_rps, rps * r_cal if rps else None),
                     "profile": pid})
    rows.sort(key=lambda r: (-(r["predicted_rps"] or 0.0), r["config"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    n_missing = sum(str(e.get("profile")) in missing for e in entries)
    if missing:
        out["left_out"].append(f"{n_missing} configuration(s) of profile(s) {', '.join(missing)}: not in the "
                               f"profile cache ({profiles_dir()})")
    out.update(rows=rows, seconds=time.perf_counter() - t0, simulations=len(got), same_as_study=same)
    return out
