"""`tuner search --strategy predict`: predict every configuration of the space, measure the few that matter.

1. **Predict.** The space's configurations are enumerated (every categorical choice x `CONTINUOUS_VALUES` values of
   each continuous knob, the baseline's value included) and grouped by engine profile (the format: weight type,
   KV type, threads, ubatch; tuner.predict.profile), each profiled at the largest batch cap of its configurations
   the space file lists (`profile_cap`). A profile costs 60-90 s per format on 2 cores, so only those
   the search's time affords are profiled (cached ones are free): the baseline's format first, then the formats
   closest to it (fewest format knobs changed; ties in a seeded random order), at most `PROFILE_SHARE` of
   --timeout (`MAX_PROFILES` measured ones without --timeout). The rest, and configurations with a draft (not
   profiled yet), are left out and the answer says which and why. Each (format, batch cap) is simulated once
   (tuner.predict.estimate: the real capacity search on the simulated engine) under the engine's own admission
   limits (profile.scheduler_limits: its step budget and KV capacity), so configurations differing only in a KV
   fraction that leaves both unchanged share one prediction. A point prediction for every one;
   the band (`BAND_REPLICATES` resampled fits and the engine's speed drift, estimate.predict: four more
   simulations) for the engine defaults, and for the others only when the choosing rule could pick them (`choose`:
   ranked by the most their chance can be with a band `BAND_MARGIN` x the widest computed so far; every band of
   the whole llama.cpp space took 4/5 of its prediction time).
2. **Measure, one at a time**, through the normal Optuna loop (each choice is enqueued, so the real objective,
   child, quality gate and answer run unchanged): the engine default first, then after each measurement the
   predictions are recalibrated (x the geometric mean of measured / predicted over the configurations measured
   with a capacity, tuner.predict.choose's `calibration`; per engine, and apart past a profile's sequences: `calibrates`) and the next is
   the configuration most likely to beat the best feasible measured capacity (`chance_to_beat`: lognormal around
   the calibrated prediction, its spread the prediction's own band combined with the calibration's scatter). The
   search stops when no unmeasured configuration has a chance of at least `STOP_CHANCE` (its calibrated band's
   top, 2 spreads up, is below the best), or the trials / timeout run out. A format the quality gate prunes takes
   its configurations out. With a tail SLO (p99) each measurement is a verification at the calibrated prediction:
   one long probe there, sized for the percentile, and one above it (tuner.predict.verify), instead of a blind
   bracket.
3. The answer is the best **measured** configuration (tuner.search.answer); `report` adds what was predicted and measured,
   each measured configuration's predicted capacity beside its measured one with the signed error
   (predicted - measured) / measured, and the model's error over this search; its notes say where a measured
   capacity fell outside its band (and the profile's calibration history keeps it, widening later bands), which
   predictions were extrapolated past their profile, what each tail verification measured at which n, and the
   closest configuration when none was shown to meet the SLO.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from tuner.predict.calibration import calibrates, same_group
from tuner.predict.choose import (
    STOP_CHANCE,
    Prediction,
    add_pair,
    calibrated_band,
    calibration_of,
    calibrations,
    own_spread,
    ranking,
    replicate_spread,
)

CONTINUOUS_VALUES = 3  # values of a continuous knob predicted: low, middle, high (log or linear), + the baseline's
FORMAT_FIELDS = ("engine", "quant", "kv_type", "threads", "ubatch",  # what a profile is for (profile.profile_key)
                 "batched_tokens", "chunked_prefill", "reserved_cpus")  # vLLM's speed knobs (its profile's format)
PROFILE_S_GUESS = 90.0  # a profile's cost before one was measured here (issue 26's target per format on 2 cores)
PROFILE_SHARE = 0.4  # of the --timeout left when the search starts: what profiling may take
MAX_PROFILES = 4  # profiles measured (cached ones not counted) when there is no --timeout
BAND_REPLICATES = 2  # resampled fits per band (estimate.predict adds the engine-speed pair)
BAND_MARGIN = 1.5  # a band not computed yet is assumed within this x the widest replicate spread computed (choose)
BAND_BATCH = 4  # (profile, batch cap) bands computed at once when the choosing rule needs some (in worker processes)
SIM_WALL_S = 1e6  # a tail SLO's simulations: the capacity budget in virtual seconds (lifted: see `simulated`)
SIM_PROBE_PASSES = 3  # ... and in requests: this many probe caps per probe
PREDICTIONS = "predictions"  # study attribute: every configuration predicted (tuner.dashboard.predicted reads it)


# ------------------------------------------------------------------------------------- enumeration --- #
def knob_values(knob: Any, baseline: Any) -> list[Any]:
    """A knob's values to predict: its choices, or CONTINUOUS_VALUES points of its range (+ the baseline's)."""
    from tuner.search.space import DEFAULTS

    if knob.choices is not None:
        return list(knob.choices)
    lo, hi, n = knob.low, knob.high, CONTINUOUS_VALUES
    pts = [lo * (hi / lo) ** (i / (n - 1)) if knob.log else lo + (hi - lo) * i / (n - 1) for i in range(n)]
    if isinstance(DEFAULTS[knob.name], int):
        pts = [int(round(v)) for v in pts]
    if baseline is not None and lo <= baseline <= hi:
        pts.append(baseline)
    return sorted(set(pts))


def enumerate_space(space: Any) -> list[dict[str, Any]]:
    """Every configuration to predict as Optuna parameters, with knobs a `when:` switches off left out (as
    tuner.search.space.suggest_config samples them). A space across engines (tuner.search.space.combine_spaces):
    each engine's own space enumerated, its parameters named `<engine>.<knob>` beside `engine`."""
    if space.engines:
        return [{"engine": sub.engine, **{f"{sub.engine}.{k}": v for k, v in params.items()}}
                for sub in space.engines for params in enumerate_space(sub)]
    from tuner.search.space import switched_off_value

    out: list[tuple[dict[str, Any], dict[str, Any]]] = [({}, {})]  # (parameters, every knob's value so far)
    for name, knob in space.knobs.items():
        grown = []
        for params, values in out:
            if all(values.get(k) in allowed for k, allowed in knob.when.items()):
                grown += [({**params, name: v}, {**values, name: v})
                          for v in knob_values(knob, space.baseline.get(name))]
            else:
                grown.append((params, {**values, name: switched_off_value(space, name)}))
        out = grown
    return [params for params, _ in out]


def format_of(config: dict[str, Any]) -> tuple[Any, ...]:
    """The profile's format of a configuration (TrialConfig.to_dict leaves engine knobs at their default out)."""
    from tuner.search.space import DEFAULTS

    return tuple(config.get(k, DEFAULTS.get(k)) for k in FORMAT_FIELDS)


SHOWN_FIELDS = {"llamacpp": ("quant", "kv_type", "threads", "ubatch")}  # an engine's format fields always shown


def describe_format(fmt: tuple[Any, ...]) -> str:
    """'quant=Q8_0 kv_type=auto threads=1 ubatch=0 on llamacpp', 'quant=bf16 batched_tokens=512 on vllm': the quant,
    the engine's own always-shown fields (`SHOWN_FIELDS`), and any other field away from its default; the engine
    last (one space's formats read alike)."""
    from tuner.search.space import DEFAULTS

    named = dict(zip(FORMAT_FIELDS, fmt))
    shown = SHOWN_FIELDS.get(named["engine"], ("quant",))
    return " ".join(f"{k}={v}" for k, v in named.items() if k != "engine" and (k in shown or v != DEFAULTS.get(k))
                    ) + f" on {named['engine']}"


def profile_order(formats: Sequence[tuple[Any, ...]], baseline: tuple[Any, ...], seed: int,
                  others: Sequence[tuple[Any, ...]] = ()) -> list[tuple[Any, ...]]:
    """The baseline's format first, then the other engines' default formats (`others`, across engines), then by how
    many format knobs differ from the nearest of these, ties in a seeded order."""
    rng = random.Random(seed)
    shuffled = list(formats)
    rng.shuffle(shuffled)
    anchors = [baseline, *others]
    return sorted(shuffled, key=lambda f: (f != baseline, f not in anchors,
                                           min(sum(a != b for a, b in zip(f, x)) for x in anchors)))


def engine_defaults(space: Any) -> list[dict[str, Any]]:
    """Each engine's default as Optuna parameters: the space's baseline, then (across engines) every other engine's,
    as tuner.search.loop.enqueue_start measures them first."""
    return [dict(space.baseline)] + [{"engine": o.engine, **{f"{o.engine}.{k}": o.baseline[k] for k in o.knobs}}
                                     for o in space.engines[1:]]


def profile_cap(members: Sequence[Prediction], space: Any) -> int:
    """The batch cap a format is profiled at: the largest of its configurations' up to the largest the space file
    lists (its increasing knob's `top`; all of them where it has none). The engine default's cap, which the space
    adds to the choices when the file does not list it (vLLM's 128 sequences on the vllm-cpu space's 2-32), is then
    predicted past the profile -- extrapolated, its band widened, calibrated apart (`calibrates`) -- rather than
    every search profiling each format at sequences the file did not ask for (vLLM fp32 at 128 sequences took 118-122
    s on 2 cores, at 32 62-102 s, vLLM's own start-up 34-53 s of it)."""
    caps = [p.config["batch_cap"] for p in members]
    engine = members[0].config.get("engine")
    sub = next((s for s in space.engines if s.engine == engine), space) if space.engines else space
    knob = sub.knobs.get("batch_cap")
    top = knob.top if knob is not None else None
    return max([c for c in caps if top is None or c <= top] or caps)


# ----------------------------------------------------------------------------------------- strategy --- #
class PredictStrategy:
    """The search loop's chooser (tuner.search.loop.run_search calls `prepare` once, `enqueue_next` before each trial and
    `report` for the answer). `pool_for(config, options)`: the capacity pool `tuner bench --capacity` builds."""

    def __init__(self, pool_for: Callable[[Any, Any], list[Any]], seed: int = 0,
                 log: Callable[[str], None] = lambda s: None, why: str = "--strategy predict",
                 workers: int | None = None, band_every: bool = False) -> None:
        self.pool_for = pool_for
        self.band_every = band_every  # every band at prepare (the A/B of the lazy bands); else as `choose` needs them
        self.workers = workers  # processes the simulations run in (prefetch); None: one per CPU
        self.why = why  # why this strategy runs (tuner.cli.search.choose_strategy): the answer says it
        self.seed = seed
        self.log = log
        self.predictions: list[Prediction] = []
        self.n_configurations = 0
        self.left_out: list[dict[str, Any]] = []
        self.left_out_keys: dict[str, list[Any]] = {}  # why -> the keys of the configurations left out for it
        self.profiles: dict[str, dict[str, Any]] = {}
        self.timing: dict[str, Any] = {}
        self.notes: list[str] = []
        self.stopped: str | None = None
        self.by_id: dict[str, dict[str, Any]] = {}  # profile id -> profile
        self.pools: dict[int, list[Any]] = {}  # batch cap -> capacity pool
        self.space: Any = None  # the study's space (prepare)
        self.slo: Any = None  # the study's SLO (prepare): a tail term is verified at the predicted capacity
        self.timeouts_s = (0.0, 0.0)  # the study's --capacity-timeout and --trial-timeout (prepare)
        self.pool_options: Any = None  # the study's capacity settings (prepare): what the pools are built for
        self.sim_options: Any = None  # the settings the simulations run with (prepare: `simulated`)
        self.histories: dict[str, list[dict[str, Any]]] = {}  # profile id -> its calibration history (prepare)
        self.factors: dict[tuple[str, int], float] = {}  # (profile, batch cap) -> extrapolation factor
        self.widest = 0.0  # the widest replicate spread of the bands computed (assumed_band)
        self.wider_than_assumed: list[str] = []  # bands computed wider than `assumed_band` had assumed
        self._stored = -1  # bands computed when the predictions were last stored in the study

    # ---------------------------------------------------------------------------------- predict --- #
    def options(self, ctx: Any) -> Any:
        """The capacity settings each trial's `tuner bench --capacity` runs with (tuner.search.objective.bench_args)."""
        from tuner.measure.capacity import CapacityOptions

        return CapacityOptions(slo=ctx.slo, probe_requests=tuple(ctx.probe_requests), max_probes=ctx.max_probes,
                               max_wall_s=ctx.capacity_timeout_s, saturation_requests=ctx.saturation_requests,
                               arrival=ctx.workload.arrival, seed=ctx.workload.seed)

    def simulated(self, options: Any) -> Any:
        """The settings the simulations run with: the study's, except with a tail SLO, whose probes of hundreds of
        requests a --capacity-timeout cuts to one or two: there the budget is lifted (virtual time costs no wall
        time), so the prediction is the capacity the same rules find with room to spare -- where each measured
        configuration is then verified (tuner.predict.verify) -- not the figure a budget-cut blind bracket would
        stop at."""
        from dataclasses import replace

        from tuner.predict.verify import tail_terms

        if not tail_terms(options.slo):
            return options
        return replace(options, max_wall_s=SIM_WALL_S,
                       max_requests=SIM_PROBE_PASSES * options.max_probes * options.probe_requests[1])

    def prepare(self, ctx: Any, time_left_s: float | None) -> None:
        """Enumerate, profile what the time affords, predict every profiled configuration."""
        from optuna.trial import FixedTrial

        from tuner.predict.calibration import read_history, widen
        from tuner.predict.estimate import history_notes
        from tuner.predict.profile import history_since
        from tuner.predict.verify import tail_terms
        from tuner.search.space import config_key, suggest_config

        space = self.space = ctx.space
        self.slo, self.timeouts_s = ctx.slo, (ctx.capacity_timeout_s, ctx.trial_timeout_s)
        groups: dict[tuple[Any, ...], list[Prediction]] = {}
        grid = enumerate_space(space)
        self.n_configurations = len(grid)
        for params in grid:
            config = suggest_config(FixedTrial(params), space, ctx.model, ctx.device)
            p = Prediction(params, config.to_dict(), config_key(space, params) or tuple(params.items()))
            if config.draft != "none":
                self.leave_out(p, f"draft {config.draft}: speculative decoding is not profiled yet")
                continue
            groups.setdefault(format_of(p.config), []).append(p)
        anchors = [format_of(suggest_config(FixedTrial(d), space, ctx.model, ctx.device).to_dict())
                   for d in engine_defaults(space)]
        order = profile_order(list(groups), anchors[0], self.seed, anchors[1:])
        budget_s = PROFILE_SHARE * time_left_s if time_left_s is not None else None
        spent_s, measured, longest_s = 0.0, 0, PROFILE_S_GUESS
        self.pool_options = self.options(ctx)
        options = self.simulated(self.pool_options)
        if options is not self.pool_options:
            self.notes.append(f"{', '.join(tail_terms(ctx.slo))}: predicted without the capacity budget (virtual "
                              f"time; a blind measurement within --capacity-timeout {ctx.capacity_timeout_s:.0f} s "
                              "stops after a probe or two): each measured configuration is verified at its "
                              "prediction instead")
        profiled: list[tuple[list[Prediction], dict[str, Any]]] = []
        for fmt in order:
            members = groups[fmt]
            cap = profile_cap(members, space)
            try:
                cached = self.cached(members, cap)
            except Exception as e:  # the format's GGUF or the engine build is missing
                self.fail(fmt, members, e)
                continue
            if cached is None and fmt not in anchors:  # each engine's default is profiled: it is measured
                why = None
                if budget_s is not None and spent_s + longest_s > budget_s:
                    why = (f"the time budget: profiling may take {PROFILE_SHARE:.0%} of --timeout ({budget_s:.0f} s), "
                           f"{spent_s:.0f} s spent, ~{longest_s:.0f} s more per format")
                elif budget_s is None and measured >= MAX_PROFILES:
                    why = f"at most {MAX_PROFILES} formats are profiled without --timeout"
                if why:
                    for p in members:
                        self.leave_out(p, f"{describe_format(fmt)} not profiled ({why})")
                    continue
            t = time.perf_counter()
            try:
                profile = cached or self.measure(members, cap)
            except Exception as e:  # a format llama-server cannot serve here: said, its configurations left out
                self.fail(fmt, members, e)
                continue
            took = time.perf_counter() - t
            if cached is None:
                spent_s, measured, longest_s = spent_s + took, measured + 1, max(longest_s if measured else 0, took)
            self.profiles[describe_format(fmt)] = {"id": profile["id"], "cached": cached is not None,
                                                   "batch_cap": profile["batch_cap"], "profile_s": took,
                                                   "measured_at": profile.get("measured_at"),
                                                   "since": history_since(profile)}
            if cached is None:  # why it was measured (another host or build's profile not reused, ...)
                self.notes += [f"profile of {describe_format(fmt)}: {n}" for n in profile.get("notes") or []]
            profiled.append((members, profile))
        self.sim_options = options
        since = {v["id"]: v.get("since") or v.get("measured_at") for v in self.profiles.values()}
        self.histories = {prof["id"]: read_history(prof["id"], since.get(prof["id"])) for _, prof in profiled}
        for pid, history in self.histories.items():
            self.notes += [f"profile {pid}: {n}" for n in history_notes(widen(1.0, [1.0, 1.0], history)[1])]
        defaults = {config_key(space, d) or tuple(d.items()) for d in engine_defaults(space)}
        self.prefetch(profiled, options, defaults)
        for members, profile in profiled:
            self.predict_group(members, profile, options)
        n_extra = sum(bool(p.extrapolated) for p in self.predictions)
        if n_extra:
            self.notes.append(f"{n_extra} configuration(s) predicted past what their profile measured "
                              "(extrapolated: their band is widened; each says how far)")
        self.band(self.predictions if self.band_every else [p for p in self.predictions if p.key in defaults])
        self.timing["profile_s"] = spent_s
        for k in (k for k in space.knobs.values() if k.choices is None):
            self.notes.append(f"{k.name}: {CONTINUOUS_VALUES} values of its range (+ the baseline's) predicted" +
                              ("; the simulator admits by the KV capacity it gives (the engine's own limits): "
                               "configurations whose KV holds every request alike share one prediction"
                               if k.name == "kv_fraction" else ""))

    def fail(self, fmt: tuple[Any, ...], members: list[Prediction], e: Exception) -> None:
        from tuner.errors import one_line

        for p in members:
            self.leave_out(p, f"{describe_format(fmt)}: its profile failed: {one_line(e)}")

    def leave_out(self, p: Prediction, why: str) -> None:
        """A configuration neither predicted nor (unless it is an engine default) measured: counted under its reason
        (its key kept, so the answer counts those measured all the same)."""
        self.left_out_keys.setdefault(why, []).append(p.key)
        for entry in self.left_out:
            if entry["why"] == why:
                entry["configurations"] += 1
                return
        self.left_out.append({"why": why, "configurations": 1})

    def cached(self, members: list[Prediction], cap: int) -> dict[str, Any] | None:
        """The cached profile of this format on this host and build covering `cap` sequences, or None."""
        from tuner.config import TrialConfig
        from tuner.predict.profile import profile_id, profile_key, profiles_dir, read_profile

        config = TrialConfig.from_dict(members[0].config)
        path = profiles_dir() / f"{profile_id(profile_key(config))}.json"
        prof = read_profile(path) if path.exists() else None
        return prof if prof is not None and prof["batch_cap"] >= cap else None

    def measure(self, members: list[Prediction], cap: int) -> dict[str, Any]:
        """Profile the format at `cap` (`profile_cap`), served with the largest KV fraction of its configurations
        up to that cap (room per slot)."""
        from tuner.config import TrialConfig
        from tuner.predict.profile import load_or_measure

        widest = max((p for p in members if p.config["batch_cap"] <= cap),
                     key=lambda p: (p.config["batch_cap"], p.config.get("kv_fraction") or 0))
        self.log(f"predict: profiling {describe_format(format_of(widest.config))} at batch cap {cap}")
        return load_or_measure(TrialConfig.from_dict(widest.config), cap, log=self.log)

    def limit_groups(self, members: list[Prediction], profile: dict[str, Any]
                     ) -> tuple[list[tuple[tuple[int, int | None, int], list[Prediction]]], list[tuple[Prediction, str]]]:
        """This format's configurations by (batch cap, KV tokens, step budget), in the order they are predicted, and
        those whose limits the profile cannot give (with why)."""
        from tuner.config import TrialConfig
        from tuner.errors import one_line
        from tuner.predict.profile import scheduler_limits

        by_cap: dict[tuple[int, int | None, int], list[Prediction]] = {}  # (batch cap, KV tokens, step budget)
        failed = []
        for p in members:
            try:
                lim = scheduler_limits(profile, TrialConfig.from_dict(p.config))
            except Exception as e:  # e.g. a profile that recorded no limits: said, left out
                failed.append((p, f"{describe_format(format_of(p.config))}: its scheduler limits ({one_line(e)})"))
                continue
            by_cap.setdefault((p.config["batch_cap"], lim["kv_tokens"], lim["token_budget"]), []).append(p)
        return sorted(by_cap.items(), key=lambda g: (g[0][0], g[0][1] or 0, g[0][2])), failed

    def prefetch(self, profiled: list[tuple[list[Prediction], dict[str, Any]]], options: Any,
                 banded: set[Any] = frozenset()) -> None:
        """Every point simulation predict_group will make, and the band searches of the configurations keyed in
        `banded` (every one with `band_every`), run at once in worker processes (one per CPU,
        tuner.predict.estimate.prefetch): they then find each search's result kept, the same figures sooner. The
        band of a (profile, batch cap) is its first group's (`band` takes the first prediction's limits)."""
        from tuner.config import TrialConfig
        from tuner.predict.estimate import predict_searches, workers_available
        from tuner.predict.profile import step_model

        workers = self.workers if self.workers is not None else workers_available()
        if workers < 2:
            return
        calls = []
        for members, profile in profiled:
            firsts: set[int] = set()
            try:
                model = step_model(profile)
                for (cap, kv, budget), same in self.limit_groups(members, profile)[0]:
                    config = TrialConfig.from_dict(same[0].config)
                    requests = self.pool(config, options)
                    first = cap not in firsts
                    firsts.add(cap)
                    if first and (self.band_every or any(p.key in banded for p in members
                                                         if p.config["batch_cap"] == cap)):
                        calls += predict_searches(profile, config, requests, options, BAND_REPLICATES, self.seed)
                    else:
                        calls.append((model, cap, requests, options, budget, self.seed, kv))
            except Exception:  # predict_group and band meet it again and say it
                continue
        self.run_prefetch(calls, workers)

    def run_prefetch(self, calls: list[tuple[Any, ...]], workers: int) -> None:
        from tuner.predict.estimate import prefetch

        t = time.perf_counter()
        ran = prefetch(calls, workers)
        done = self.timing.setdefault("prefetch", {"workers": workers, "simulations": 0, "s": 0.0})
        done["simulations"] += ran
        done["s"] += time.perf_counter() - t

    def predict_group(self, members: list[Prediction], profile: dict[str, Any], options: Any) -> None:
        """A point prediction per batch cap and admission limits of this format (one simulation, shared by the KV
        fractions that give the same limits)."""
        from tuner.config import TrialConfig
        from tuner.errors import one_line
        from tuner.predict.estimate import extrapolation, held_slope, simulated_capacity
        from tuner.predict.profile import step_model

        groups, failed = self.limit_groups(members, profile)
        for p, why in failed:
            self.leave_out(p, why)
        model = step_model(profile)
        for (cap, kv, budget), same in groups:
            config = TrialConfig.from_dict(same[0].config)
            requests = self.pool(config, options)
            t = time.perf_counter()
            try:
                got = simulated_capacity(model, cap, requests, options, budget, self.seed, kv)
            except Exception as e:  # e.g. a profile so slow no simulated request ends in time: said, left out
                for p in same:
                    self.leave_out(p, f"{describe_format(format_of(p.config))} at batch cap {cap}: its simulation "
                                      f"failed ({one_line(e)})")
                continue
            self.timing.setdefault("point_s", []).append(time.perf_counter() - t)
            factor, extra = extrapolation(profile, cap, requests)  # what its band will be widened by, and why
            self.factors[(profile["id"], cap)] = factor
            for p in same:
                p.rps, p.profile = float(got.get("requests_per_s") or 0.0), profile["id"]
                p.notes, p.extrapolated = list(got.get("notes") or []) + held_slope(profile, cap), list(extra)
                p.calibrates, p.shared = calibrates(profile, cap), (profile["id"], cap, budget, p.rps)
            self.predictions += same
        self.by_id[profile["id"]] = profile

    def pool(self, config: Any, options: Any) -> list[Any]:
        """The capacity pool for this batch cap (it depends on the batch cap only: built once per cap)."""
        if config.batch_cap not in self.pools:  # sized for the study's budget: a lifted one repeats its prompts
            self.pools[config.batch_cap] = self.pool_for(config, self.pool_options or options)
        return self.pools[config.batch_cap]

    def band(self, wanted: Sequence[Prediction], ranked: bool = False) -> None:
        """The band of each (profile, batch cap) of `wanted` not computed yet (estimate.predict with BAND_REPLICATES
        resampled fits and the speed pair, widened past the profile's measured ranges and by its calibration
        history), set on every prediction sharing it; their searches run in worker processes first when several.
        `ranked`: they were ranked with `assumed_band` (`choose`): a band wider than it is counted."""
        from tuner.config import TrialConfig
        from tuner.errors import one_line
        from tuner.predict.estimate import predict, predict_searches, workers_available

        for p in wanted:
            p.banded = p.banded or not p.profile  # no profile: no prediction to band
        keys = list(dict.fromkeys((p.profile, p.config["batch_cap"]) for p in wanted if not p.banded))
        if not keys:
            return
        members: dict[tuple[str, int], list[Prediction]] = {}
        for p in self.predictions:
            if (p.profile, p.config["batch_cap"]) in keys:
                members.setdefault((p.profile, p.config["batch_cap"]), []).append(p)
        firsts = {k: TrialConfig.from_dict(members[k][0].config) for k in keys}  # the first prediction's limits
        workers = self.workers if self.workers is not None else workers_available()
        if workers >= 2 and len(keys) > 1:
            calls = []
            for k in keys:
                try:
                    calls += predict_searches(self.by_id[k[0]], firsts[k], self.pool(firsts[k], self.sim_options),
                                              self.sim_options, BAND_REPLICATES, self.seed)[1:]
                except Exception:  # met again below, and said
                    continue
            self.run_prefetch(calls, workers)
        for k in keys:
            config, assumed = firsts[k], self.assumed_band(members[k][0]) if ranked else None
            t = time.perf_counter()
            try:
                got = predict(self.by_id[k[0]], config, self.pool(config, self.sim_options), self.sim_options,
                              replicates=BAND_REPLICATES, seed=self.seed, history=self.histories.get(k[0]) or (),
                              curve=False)
            except Exception as e:  # a resampled fit's simulation failed: the point stands, without a band
                self.notes.append(f"profile {k[0]} batch cap {k[1]}: no band ({one_line(e)}): its prediction is "
                                  "ranked by the calibration's spread alone")
                band = None
            else:
                c = got["capacity"]
                lo, hi = c["band"]
                band = (lo, hi) if lo is not None and hi is not None else None
                self.widest = max(self.widest, replicate_spread([c["requests_per_s"], *c["replicates"], *c["speed"]]))
                if band and assumed and assumed[0] and own_spread(band) > own_spread(assumed) * (1 + 1e-9):
                    self.wider_than_assumed.append(f"profile {k[0]} batch cap {k[1]}: band [{lo:.3g}, {hi:.3g}] "
                                                   f"beyond the [{assumed[0]:.3g}, {assumed[1]:.3g}] assumed")
            self.timing["band_s"] = self.timing.get("band_s", 0.0) + time.perf_counter() - t
            self.timing["bands"] = self.timing.get("bands", 0) + 1
            for p in members[k]:
                p.band, p.banded = band, True

    def assumed_band(self, p: Prediction) -> tuple[float, float] | None:
        """Where a configuration's band lies if its replicates spread no wider than BAND_MARGIN x the widest of the
        bands computed in this search (at least the engine-speed pair's 1 + SPEED_DRIFT), widened as `predict`
        widens it (its extrapolation, its profile's calibration history); None when it has no prediction, or when
        it lies 2x or more past its profile's ranges (its band then surely reaches 0: `chance_at_most` ranks it
        exactly as its computed band would be)."""
        from tuner.predict.estimate import SPEED_DRIFT, widened_band

        if not p.rps or not p.profile:
            return None
        factor = self.factors.get((p.profile, p.config["batch_cap"]), 1.0)
        if factor >= 2:  # widened by (factor - 1) x its rate, its band reaches 0 whatever its replicates (their least
            return None  # is at most the rate): ranked as such a band is, by the calibration's scatter alone
        s = BAND_MARGIN * max(math.log(1 + SPEED_DRIFT), self.widest)
        (lo, hi), _ = widened_band(p.rps, [p.rps * math.exp(-s), p.rps * math.exp(s)], factor,
                                   same_group(self.by_id.get(p.profile), p.config["batch_cap"],
                                              self.histories.get(p.profile) or []))
        return lo, hi

    def choose(self, candidates: Sequence[Prediction], done: set, ratio: float, sigma: float, best: float,
               groups: dict[tuple[Any, bool], tuple[float, float]] | None = None) -> tuple[Prediction | None, float]:
        """`next_candidate` with each band computed only when the choosing rule could pick its configuration: the
        configurations are ranked with the most their chance can be where the band is not computed yet
        (`assumed_band`); while the top of the ranking is such a one, the bands of those ranked above the best
        computed one are computed (BAND_BATCH at a time) and the ranking made again. The top is then a computed
        chance at least every other's most: the configuration computing every band would choose (as long as no band
        is wider than assumed -- the chance reads a band's own spread only, and an assumed band reaching 0 allows
        any -- one that is widens the assumption, and `report_prediction` counts it)."""
        while True:
            ranked = ranking(candidates, done, ratio, sigma, best, groups, self.assumed_band)
            if not ranked:
                return None, 0.0
            chance, top = ranked[0]
            if chance < STOP_CHANCE:
                return None, chance
            if top.banded:
                return top, chance
            floor = max(STOP_CHANCE, next((c for c, p in ranked if p.banded), 0.0))
            batch: dict[tuple[str | None, int], Prediction] = {}
            for c, p in ranked:
                if c < floor or len(batch) >= BAND_BATCH:
                    break
                if not p.banded:
                    batch.setdefault((p.profile, p.config["batch_cap"]), p)
            self.band(list(batch.values()), ranked=True)

    # ---------------------------------------------------------------------------------- measure --- #
    def state(self, study: Any, space: Any) -> dict[str, Any]:
        """What the trials so far say: `done` (keys measured or tried), `pairs` {group: [(predicted, measured)]}
        and `censored` {group: [(predicted, upper bound)]} (a measured 0: tuner.predict.calibration), a group being
        (engine, whether the prediction lay within its profile's sequences: `calibrates`), `best`
        (feasible measured req/s) and `best_trial`, `pruned` (quality keys the gate put out), `defaults` (engine
        defaults enqueued or measured, as Optuna parameters' engines) and `measured` {key: trial number} of those
        measured with a capacity."""
        from tuner.search.objective import quality_key
        from tuner.search.space import config_key
        from tuner.search.workers import interrupted

        got: dict[str, Any] = {"done": set(), "pairs": {}, "censored": {}, "best": 0.0, "best_trial": None,
                               "pruned": set(), "defaults": set(), "measured": {}}
        for t in study.get_trials(deepcopy=False):
            ua = t.user_attrs
            if ua.get("baseline") or ua.get("engine_default"):
                got["defaults"].add(t.params.get("engine") or (ua.get("config") or {}).get("engine") or "")
            if t.state.name == "WAITING" or interrupted(t):
                continue
            key = config_key(space, t.params)
            if key is not None:
                got["done"].add(key)
            if ((ua.get("quality") or {}).get("gate") or {}).get("verdict") == "exceeds" and ua.get("config"):
                got["pruned"].add(quality_key(ua["config"]))  # the format is out of the quality budget (the baseline too)
            if t.state.name != "COMPLETE":
                continue
            cap = ua.get("capacity") or {}
            measured = float(cap.get("requests_per_s") or 0.0)
            if key is not None and isinstance(ua.get("capacity"), dict):
                got["measured"][key] = t.number
            if ua.get("predicted_requests_per_s") is not None:
                add_pair(got["pairs"], got["censored"], (ua.get("config") or {}).get("engine"), ua, cap)
            if all(c <= 0 for c in ua.get("constraints") or [1]) and measured > got["best"]:
                got["best"], got["best_trial"] = measured, t.number
        return got

    def enqueue_next(self, study: Any, space: Any) -> bool:
        """Enqueue the next configuration to measure (the engine default first: across engines every engine's);
        False, with `stopped` said, when none has a meaningful chance. A WAITING trial already enqueued is measured
        first."""
        from tuner.search.objective import quality_key
        from tuner.search.space import config_key

        self.store_predictions(study)
        trials = study.get_trials(deepcopy=False)
        if any(t.state.name == "WAITING" for t in trials):
            return True
        s = self.state(study, space)
        done, best, best_trial = s["done"], s["best"], s["best_trial"]
        ratio, sigma, groups = calibrations(s["pairs"], s["censored"])  # extrapolations apart (`calibrates`)
        for i, params in enumerate(engine_defaults(space)):
            engine = params.get("engine") or space.engine
            if engine in s["defaults"] or (i == 0 and any(t.user_attrs.get("baseline") for t in trials)):
                continue
            key = config_key(space, params)
            p = next((p for p in self.predictions if p.key == key), None)
            self.band([p] if p is not None else [])
            r, sg = calibration_of(p, groups, ratio, sigma) if p is not None else (ratio, sigma)
            study.enqueue_trial(params, user_attrs={("engine_default" if i else "baseline"): True,
                                                    **self.attrs(p, r, sg, best, None)})
            return True
        twins = self.twins(s["measured"])
        open_ = [p for p in self.predictions if quality_key(p.config) not in s["pruned"] and p.key not in twins]
        p, chance = self.choose(open_, done, ratio, sigma, best, groups)
        self.store_predictions(study)  # with the bands the choice computed
        if p is None:
            left = sum(p.key not in done for p in open_)
            self.stopped = (f"no unmeasured configuration of the {left} predicted has a chance of {STOP_CHANCE:.1%} "
                            f"to beat the best measured ({best:.3g} req/s, trial {best_trial}); the best chance left "
                            f"{chance:.1%} (predictions x {ratio:.2f} calibrated, spread {sigma:.2f})"
                            if left else "every predicted configuration was measured"
                            + (f" or shares its prediction with a measured one ({len(twins)})" if twins else ""))
            return False
        r, sg = calibration_of(p, groups, ratio, sigma)
        study.enqueue_trial(dict(p.params), user_attrs=self.attrs(p, r, sg, best, chance))
        return True

    def twins(self, measured: dict[Any, int]) -> dict[Any, int]:
        """The unmeasured configurations predicted the same capacity as a measured one from the same profile, batch cap
        and step budget (they differ only in knobs the model sees no effect of at this load: prefix caching, a KV
        fraction whose KV holds every request alike), each with that trial's number. They are not chosen: measuring
        one tells what the model cannot, at a whole measurement's cost (two of a vllm-cpu search's five trials were
        twins of its trial 1: 2.91 and 3.11 req/s against 2.91). `--strategy measure` samples them."""
        by_sim = {p.shared: measured[p.key] for p in self.predictions if p.key in measured and p.shared is not None}
        return {p.key: by_sim[p.shared] for p in self.predictions
                if p.shared in by_sim and p.key not in measured}

    def store_predictions(self, study: Any) -> None:
        """Every prediction of this run into the study (attribute PREDICTIONS, once per run), so the dashboard draws
        the predicted configurations apart from the measured ones and re-ranks them under another SLO or workload."""
        banded = sum(p.banded for p in self.predictions)
        if self._stored == banded:
            return
        study.set_user_attr(PREDICTIONS, {
            **{k: v for k, v in self.report_prediction().items() if k != "top_predicted"},
            "configurations": [{"config": p.config, "predicted_requests_per_s": p.rps,
                                "predicted_band": list(p.band) if p.band else None, "profile": p.profile,
                                "extrapolated": list(p.extrapolated)}
                               for p in self.predictions if p.rps is not None]})
        self._stored = banded

    def attrs(self, p: Prediction | None, ratio: float, sigma: float, best: float, chance: float | None
              ) -> dict[str, Any]:
        from tuner.predict.verify import verification_plan

        if p is None or p.rps is None:
            return {"strategy": "predict", "predicted_requests_per_s": None}
        plan, note = (verification_plan(self.slo, p.rps * ratio, *self.timeouts_s) if self.slo is not None
                      else (None, None))
        return {"strategy": "predict", "predicted_requests_per_s": p.rps,
                "predicted_band": list(p.band) if p.band else None, "predicted_profile": p.profile,
                "predicted_calibrates": p.calibrates,
                "predicted_extrapolated": list(p.extrapolated), **({"capacity_plan": plan} if plan else {}),
                **({"capacity_plan_note": note} if note else {}),
                "predicted_calibrated_requests_per_s": p.rps * ratio,
                "predicted_calibrated_band": calibrated_band(p, ratio, sigma),
                "predicted_chance_to_beat": chance, "best_measured_before_rps": best}

    # ----------------------------------------------------------------------------------- answer --- #
    def report(self, study: Any) -> dict[str, Any]:
        """What recommendation.json adds: every figure labelled predicted or measured; `notes` says what the
        model got wrong (a measured capacity outside its band), how each tail SLO was verified and at which n, and
        the closest configuration when none was shown to meet the SLO."""
        from tuner.predict.calibration import upper_bound_rps
        from tuner.predict.verify import closest_text, off_band_text, verification, verified_text
        from tuner.search.space import config_key

        measured, said, runs, measured_keys = [], [], [], set()
        for t in study.get_trials(deepcopy=False):
            ua = t.user_attrs
            if t.state.name != "COMPLETE" or not isinstance(ua.get("capacity"), dict):
                continue
            m = float(ua["capacity"].get("requests_per_s") or 0.0)
            pr = ua.get("predicted_requests_per_s")
            band = ua.get("predicted_band")
            v = verification(ua["capacity"], ua.get("capacity_plan"))
            runs.append((t.number, ua.get("config") or {}, ua["capacity"]))
            measured_keys.add(config_key(self.space, t.params) if self.space is not None else None)
            upper = upper_bound_rps(ua["capacity"]) if m <= 0 else None  # a measured 0 is censored: below `upper`
            has_band = pr is not None and bool(band) and band[0] is not None
            measured.append({"trial": t.number, "config": ua.get("config"), "predicted_requests_per_s": pr,
                             "predicted_band": band, "predicted_extrapolated": ua.get("predicted_extrapolated") or [],
                             "within_band": (None if not has_band else band[0] <= m <= band[1] if m > 0 else
                                             (False if upper is not None and upper < band[0] else None)),
                             "censored": m <= 0, "measured_upper_rps": upper, "verification": v,
                             "predicted_calibrated_requests_per_s": ua.get("predicted_calibrated_requests_per_s"),
                             "calibrates": ua.get("predicted_calibrates", True) if pr is not None else None,
                             "predicted_chance_to_beat": ua.get("predicted_chance_to_beat"),
                             "requests_per_s": m, "requests_per_s_ci": ua["capacity"].get("requests_per_s_ci"),
                             "verdict": ua["capacity"].get("verdict"),
                             "signed_error": (pr - m) / m if pr is not None and m > 0 else None})
            said += [s for s in (censored_text(measured[-1]) if m <= 0 else off_band_text(measured[-1]),) if s]
            if v is not None and self.slo is not None:
                said.append(verified_text(t.number, self.slo, v)
                            + (f"; {ua['capacity_plan_note']}" if ua.get("capacity_plan_note") else ""))
        errors = [abs(e["signed_error"]) for e in measured if e["signed_error"] is not None]
        self.record_calibration(study)
        closest = closest_text(self.slo, runs) if self.slo is not None else None
        prediction = self.report_prediction()
        left = [{**e, "measured": sum(k in measured_keys for k in self.left_out_keys.get(e["why"], []))}
                for e in prediction["left_out"]]
        past = [e["trial"] for e in measured if e["calibrates"] is False]
        if past:
            said.append(f"trial(s) {', '.join(map(str, past))}: predicted past the sequences their profile measured "
                        "(extrapolated): in the model's error, but calibrating only the predictions past their "
                        "profile's sequences, not those within")
        twins = self.twins(self.state(study, self.space)["measured"]) if self.space is not None else {}
        if twins:
            said.append(f"{len(twins)} configuration(s) not measured: each shares its prediction (the same capacity from "
                        "the same profile, batch cap and step budget) with a measured one (trials "
                        f"{', '.join(map(str, sorted(set(twins.values()))))}): the model sees no effect of what "
                        "differs (prefix caching, a KV fraction whose KV holds every request alike) at this load; "
                        "`--strategy measure` samples them")
        return {**prediction, "notes": prediction["notes"] + said + ([closest] if closest else []),
                "n_shared_with_measured": len(twins),
                "left_out": left, "n_not_predicted_not_measured": sum(e["configurations"] - e["measured"]
                                                                      for e in left),
                "n_measured": len(measured), "measured": measured,
                "model_error": {"n": len(errors), "median_abs": statistics.median(errors) if errors else None,
                                "worst_abs": max(errors) if errors else None,
                                "definition": "(predicted - measured) / measured, raw model (not calibrated)"},
                "stopped": self.stopped}

    def record_calibration(self, study: Any) -> None:
        """Every measured trial's predicted vs measured capacity into its profile's calibration history
        (tuner.predict.calibration; each trial once, over resumes: study attribute `calibration_recorded`), so
        later predictions from the profile (`tuner predict`) carry the errors this search measured."""
        from tuner.predict.calibration import entry, record

        done = set(study.user_attrs.get("calibration_recorded") or [])
        new = []
        for t in study.get_trials(deepcopy=False):
            ua = t.user_attrs
            if (t.state.name != "COMPLETE" or t.number in done or not isinstance(ua.get("capacity"), dict)
                    or ua.get("predicted_requests_per_s") is None or not ua.get("predicted_profile")):
                continue
            cap = ua["capacity"]
            record(ua["predicted_profile"], entry(
                ua["predicted_profile"], {k: v for k, v in (ua.get("config") or {}).items() if k != "device"},
                (cap.get("slo") or {}).get("bounds"), {}, float(ua["predicted_requests_per_s"]),
                ua.get("predicted_band"), cap, f"tuner search --strategy predict (study {study.study_name}, "
                                               f"trial {t.number})"))
            new.append(t.number)
        if new:
            study.set_user_attr("calibration_recorded", sorted(done | set(new)))

    def report_prediction(self) -> dict[str, Any]:
        """What was predicted, left out and what it cost (every figure here predicted, none measured)."""
        points = self.timing.get("point_s") or []
        bands = self.timing.get("bands", 0)
        return {"strategy": "predict", "strategy_why": self.why, "n_configurations": self.n_configurations,
                "n_predicted": sum(p.rps is not None for p in self.predictions),
                "n_banded": sum(p.banded for p in self.predictions),
                "bands": {"computed": bands, "every": self.band_every, "margin": BAND_MARGIN,
                          "wider_than_assumed": list(self.wider_than_assumed),
                          "rule": "every band computed at the start" if self.band_every else
                          "a configuration's band is computed when the choosing rule could pick it: ranked by the "
                          f"most its chance can be with a band {BAND_MARGIN}x the widest replicate spread computed "
                          "so far (the engine defaults' at the start); the others keep their point prediction only"},
                "left_out": self.left_out, "profiles": self.profiles, "notes": self.notes,
                "prediction_cost": {"simulations": len(points) + bands * (BAND_REPLICATES + 2),
                                    "point_s_per_simulation": statistics.median(points) if points else None,
                                    "point_s_total": sum(points), "band_s_total": self.timing.get("band_s"),
                                    "profile_s_total": self.timing.get("profile_s"),
                                    "prefetch": self.timing.get("prefetch"),  # the searches run in worker processes
                                    "s_per_configuration": ((sum(points) + (self.timing.get("band_s") or 0.0)
                                                             + (self.timing.get("prefetch") or {}).get("s", 0.0))
                                                            / max(1, len(self.predictions)))},
                "top_predicted": [{"config": p.config, "predicted_requests_per_s": p.rps,
                                   "predicted_band": list(p.band) if p.band else None,
                                   "predicted_extrapolated": list(p.extrapolated)}
                                  for p in sorted(self.predictions, key=lambda p: -(p.rps or 0))[:10]]}


def censored_text(m: dict[str, Any]) -> str | None:
    """A measured capacity of 0 in words: no rate was shown to meet the SLO, so the capacity lies below the bound;
    recorded as that bound, not as a ratio of 0 (tuner.predict.calibration)."""
    pr, band, upper = m.get("predicted_requests_per_s"), m.get("predicted_band") or [None, None], m["measured_upper_rps"]
    if pr is None:
        return None
    bound = (f"its capacity is below {upper:.3g} req/s (the lowest rate probed that missed, or its saturation)"
             if upper is not None else "no bound on its capacity was kept")
    where = ("below its band: the model was off" if m["within_band"] is False else
             "its band reaches below that bound: the model is neither confirmed nor contradicted")
    return (f"trial {m['trial']}: no rate was shown to meet the SLO on the real engine: {bound}; predicted {pr:.3g} "
            f"req/s" + (f", band [{band[0]:.3g}, {band[1]:.3g}]" if band[0] is not None else "") + f" ({where}); "
            "recorded in the profile's calibration history as censored (the ratio measured / predicted is at most "
            "bound / predicted), not as a ratio of 0")
