"""The choosing rule of `tuner search --strategy predict` (tuner.predict.strategy): each configuration's prediction
(`Prediction`), the calibration of the model by the configurations measured so far (per calibration group: engine,
within its profile's sequences or past them), and which unmeasured configuration is most likely to beat the best
measured one (`chance_to_beat`, `ranking`, `next_candidate`). Pure functions: the dashboard's what-if calibrates by
the same ones."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner.predict.calibration import upper_bound_rps

PRIOR_SIGMA = 0.3  # log-spread of measured / predicted before any measurement (README: errors of -8% to -45%)
PRIOR_WEIGHT = 2.0  # pseudo-measurements the prior spread counts as
SPREADS = 2.0  # a calibrated band is +-2 spreads (about 95%)
STOP_CHANCE = 0.5 * math.erfc(SPREADS / math.sqrt(2))  # = P(z > 2): below it, the band's top is under the best


@dataclass
class Prediction:
    """One configuration of the space and its predicted capacity (req/s within the SLO, raw: not calibrated)."""

    params: dict[str, Any]  # Optuna parameter names -> values (what enqueue_trial takes)
    config: dict[str, Any]  # the TrialConfig as a dict
    key: tuple[tuple[str, Any], ...]  # tuner.search.space.config_key
    rps: float | None = None
    band: tuple[float, float] | None = None
    profile: str | None = None
    notes: list[str] = field(default_factory=list)
    extrapolated: list[str] = field(default_factory=list)  # past what its profile measured: said, band widened
    calibrates: bool = True  # its batch cap within its profile's sequences (`calibrates`): its calibration group
    shared: tuple[Any, ...] | None = None  # (profile, batch cap, step budget, predicted rps): `twins`
    banded: bool = False  # its band was computed (a failed one leaves `band` None): see PredictStrategy.choose


def calibration(pairs: Sequence[tuple[float, float]], censored: Sequence[tuple[float, float]] = ()
                ) -> tuple[float, float]:
    """(ratio, spread) from (predicted, measured) capacities of the configurations measured so far: ratio = the
    geometric mean of measured / predicted; spread = the log-scatter of those ratios, shrunk towards PRIOR_SIGMA
    (PRIOR_WEIGHT pseudo-measurements). Pairs with a zero on either side carry no ratio. `censored`: (predicted,
    upper bound) of configurations measured at 0 (no rate shown to meet; the capacity lies below the bound): such a
    ratio is at most bound / predicted, so one below the mean of the others (1 without others) counts at that bound
    (the most it can be: the mean moves down, never to 0); one above it says nothing against it and is left out."""
    logs = [math.log(m / p) for p, m in pairs if p and m and p > 0 and m > 0]
    centre = statistics.fmean(logs) if logs else 0.0
    logs += [math.log(u / p) for p, u in censored if p and u and p > 0 and u > 0 and math.log(u / p) < centre]
    if not logs:
        return 1.0, PRIOR_SIGMA
    mean = statistics.fmean(logs)
    ss = sum((x - mean) ** 2 for x in logs)
    return math.exp(mean), math.sqrt((PRIOR_WEIGHT * PRIOR_SIGMA ** 2 + ss) / (PRIOR_WEIGHT + len(logs) - 1))


def own_spread(band: Sequence[float | None] | None) -> float:
    """A band's own log-spread (min..max of a handful of replicates, taken as +-1 spread); 0 without a band or for
    one reaching 0 (ranked by the calibration's scatter alone)."""
    if band and band[0] and band[1] and band[0] > 0:
        return math.log(band[1] / band[0]) / 2
    return 0.0


def spread_of(p: Prediction, sigma_cal: float, own: float | None = None) -> float:
    """The log-spread of one calibrated prediction: its own band's (`own_spread`, or `own`) combined with the
    calibration's scatter."""
    own = own_spread(p.band) if own is None else own
    return math.sqrt(own ** 2 + sigma_cal ** 2)


def chance_to_beat(p: Prediction, ratio: float, sigma_cal: float, best_rps: float, own: float | None = None) -> float:
    """P(the configuration's real capacity > best_rps): lognormal around its calibrated prediction (`own`: the
    band's own spread taken as this instead of p.band's)."""
    if not p.rps or p.rps <= 0:
        return 0.0
    if best_rps <= 0:
        return 1.0
    z = math.log(best_rps / (p.rps * ratio)) / spread_of(p, sigma_cal, own)
    return 0.5 * math.erfc(z / math.sqrt(2))


def chance_at_most(p: Prediction, ratio: float, sigma_cal: float, best_rps: float,
                   assumed: Sequence[float | None] | None) -> float:
    """The most `chance_to_beat` can be for a configuration whose band is not computed yet, given that its band lies
    within `assumed` (None: its chance with no band of its own, as a failed band is ranked). The chance is monotone in
    the band's spread (up below the best, down above it), so the most is at no own spread or the widest, and a band
    reaching 0 in `assumed` may be any width."""
    if assumed is None:
        return chance_to_beat(p, ratio, sigma_cal, best_rps, 0.0)
    widest = own_spread(assumed) if assumed[0] else math.inf
    if math.isinf(widest):
        return max(chance_to_beat(p, ratio, sigma_cal, best_rps, 0.0), 0.5 if p.rps and best_rps > 0 else 0.0)
    return max(chance_to_beat(p, ratio, sigma_cal, best_rps, 0.0), chance_to_beat(p, ratio, sigma_cal, best_rps, widest))


def calibrated_band(p: Prediction, ratio: float, sigma_cal: float) -> list[float] | None:
    if not p.rps:
        return None
    s = spread_of(p, sigma_cal)
    return [p.rps * ratio * math.exp(-SPREADS * s), p.rps * ratio * math.exp(SPREADS * s)]


def calibrations(pairs: dict[tuple[Any, bool], list[tuple[float, float]]],
                 censored: dict[tuple[Any, bool], list[tuple[float, float]]] | None = None
                 ) -> tuple[float, float, dict[tuple[Any, bool], tuple[float, float]]]:
    """(ratio, spread, groups) from the measured (predicted, measured) pairs of each calibration group (engine,
    within its profile's sequences: `calibrates`) and the censored ones (`calibration`): the overall (ratio, spread)
    over the groups within (an extrapolation's error says how far the fit reaches, not how far off it is where
    measured), and each group's own. The search calibrates by them, and the dashboard's what-if alike."""
    censored = censored or {}
    within = [g for g in pairs if g[1]]
    ratio, sigma = calibration([x for g in within for x in pairs[g]], [x for g in within for x in censored.get(g, ())])
    return ratio, sigma, {g: calibration(got, censored.get(g, ())) for g, got in pairs.items()}


def add_pair(pairs: dict[tuple[Any, bool], list[tuple[float, float]]],
             censored: dict[tuple[Any, bool], list[tuple[float, float]]], engine: Any,
             predicted: Mapping[str, Any], capacity: Mapping[str, Any]) -> None:
    """One measured trial into its calibration group (its engine; within its profile's sequences or past them, as its
    prediction said: `predicted_calibrates`): (predicted, measured), and a measured 0 also as (predicted, the bound it
    lies below) (tuner.predict.calibration.upper_bound_rps). The search's `state` and the dashboard's what-if both
    group by it."""
    pr, group = float(predicted["predicted_requests_per_s"]), (engine, bool(predicted.get("predicted_calibrates", True)))
    measured = float(capacity.get("requests_per_s") or 0.0)
    pairs.setdefault(group, []).append((pr, measured))
    upper = upper_bound_rps(dict(capacity)) if measured <= 0 else None
    if upper is not None:
        censored.setdefault(group, []).append((pr, upper))


def calibration_for(engine: Any, within: bool, groups: dict[tuple[Any, bool], tuple[float, float]], ratio: float,
                    sigma_cal: float) -> tuple[float, float]:
    """The (ratio, spread) a prediction of `engine` within its profile's sequences or past them (`calibrates`) is
    calibrated by: its group's, else its engine's within, else (ratio, sigma_cal)."""
    return groups.get((engine, within)) or groups.get((engine, True)) or (ratio, sigma_cal)


def calibration_of(p: Prediction, groups: dict[tuple[Any, bool], tuple[float, float]], ratio: float,
                   sigma_cal: float) -> tuple[float, float]:
    """`calibration_for` a prediction (its engine and its group)."""
    return calibration_for(p.config.get("engine"), p.calibrates, groups, ratio, sigma_cal)


def ranking(predictions: Sequence[Prediction], done: set, ratio: float, sigma_cal: float, best_rps: float,
            groups: dict[tuple[Any, bool], tuple[float, float]] | None = None,
            assumed: Callable[[Prediction], Sequence[float | None] | None] | None = None
            ) -> list[tuple[float, Prediction]]:
    """The unmeasured configurations (key not in `done`) by their chance to beat `best_rps`, highest first (ties: the
    higher calibrated prediction, then the larger KV fraction, then the earlier). `groups`: the (ratio, spread) of
    each calibration group with measurements (`calibration_of`: across engines each engine's model is off in its
    own way, and past its profile's sequences an extrapolation in its own way); (ratio, sigma_cal) for the others.
    `assumed`: for a configuration whose band is not computed (not `banded`), a band its own lies within: it is
    ranked by the most its chance can be (`chance_at_most`)."""
    def chance(p: Prediction) -> float:
        r, s = calibration_of(p, groups or {}, ratio, sigma_cal)
        if assumed is None or p.banded:
            return chance_to_beat(p, r, s, best_rps)
        return chance_at_most(p, r, s, best_rps, assumed(p))

    ranked = sorted(((chance(p), p.rps or 0.0, float(p.config.get("kv_fraction") or 0.0), -i, p)
                     for i, p in enumerate(predictions) if p.key not in done), key=lambda t: t[:4], reverse=True)
    return [(t[0], t[4]) for t in ranked]


def next_candidate(predictions: Sequence[Prediction], done: set, ratio: float, sigma_cal: float,
                   best_rps: float, groups: dict[tuple[Any, bool], tuple[float, float]] | None = None
                   ) -> tuple[Prediction | None, float]:
    """The unmeasured configuration most likely to beat `best_rps` (`ranking`, every band as it is), and its chance;
    (None, best chance) when none reaches STOP_CHANCE."""
    ranked = ranking(predictions, done, ratio, sigma_cal, best_rps, groups)
    if not ranked:
        return None, 0.0
    chance, top = ranked[0]
    return (top, chance) if chance >= STOP_CHANCE else (None, chance)


def replicate_spread(rates: Sequence[float | None]) -> float:
    """The own spread of the capacities behind a band before it is widened (infinite where one is 0 and another
    is not: such a band may be any width)."""
    xs = [x for x in rates if x is not None]
    if not xs or max(xs) <= 0:
        return 0.0
    return math.log(max(xs) / min(xs)) / 2 if min(xs) > 0 else math.inf
