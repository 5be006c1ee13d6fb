"""What `tuner search --strategy predict` says about its real measurements: how a tail SLO is verified, whether the
model was off beyond its band, and the closest configuration when none meets the SLO.

**A tail SLO** (a percentile of p95 or above, or an attainment of 95% or above) needs long probes: `meets` at p99
takes hundreds of requests per probe (tuner.measure.capacity.requests_to_show), so a blind bracket of five such
probes costs most of an hour on a small host. The model says where the capacity lies, so a candidate's real
verification is one long probe at its (calibrated) predicted capacity and one more, above it when the first meets
(below when it does not): `VERIFY_PROBES` probes, each sized by the same rule as every capacity probe for that many
probes (tuner.measure.capacity.probe_requests_for: p99 at 95% over 2 probes x 2 looks -> a first pass of 505). The
plan travels in the trial's `capacity_plan` attribute to its `tuner bench --capacity` (tuner.search.objective).

Pure functions: the sentences of the answer from the trials' records.
"""

from __future__ import annotations

from typing import Any

TAIL_QUANTILE = 0.95  # a percentile (or attainment) at or above this is a tail: verified at the predicted capacity
VERIFY_PROBES = 2  # the long probe at the predicted capacity and one above (or below) it
LEAD_SHARE = 1.25  # a probe's time: its first pass at its rate, + a quarter for the lead-in (ramp_fraction 0.1 and
# the relaxation lead-in near saturation)
TRIAL_SHARE = 0.8  # the capacity budget stays within this share of --trial-timeout (the child is killed at it)


def tail_terms(slo: Any) -> list[str]:
    """The SLO's tail terms ('ttft:p99<300ms'; '95% of requests: ...'), none when it has no tail."""
    out = [str(b) for b in slo.bounds if b.stat != "mean" and float(b.stat[1:]) / 100 >= TAIL_QUANTILE]
    if slo.targets_ms and float(slo.attainment) >= TAIL_QUANTILE:
        out.append(slo.terms()[-1])
    return out


def verification_plan(slo: Any, rate_rps: float | None, capacity_timeout_s: float, trial_timeout_s: float
                      ) -> tuple[dict[str, Any] | None, str | None]:
    """The capacity settings that verify a tail SLO at `rate_rps` (a predicted capacity): the first probe there,
    `VERIFY_PROBES` probes sized for the percentile, a request budget that holds them, and a time budget of the
    study's --capacity-timeout (warm-up, saturation, canaries) plus the probes' time at that rate, within
    `TRIAL_SHARE` of --trial-timeout; and a note when that cap cuts it. (None, None) without a tail term or a rate to
    start at: the blind bracket then, with the study's settings."""
    from tuner.measure.capacity import probe_requests_for

    if not tail_terms(slo) or not rate_rps or rate_rps <= 0:
        return None, None
    first, cap = probe_requests_for(slo, VERIFY_PROBES, None)
    want_s = capacity_timeout_s + VERIFY_PROBES * LEAD_SHARE * first / rate_rps
    most_s = max(capacity_timeout_s, TRIAL_SHARE * trial_timeout_s)
    note = None if want_s <= most_s else (
        f"the verification of {', '.join(tail_terms(slo))} at {rate_rps:.3g} req/s needs about {want_s:.0f} s "
        f"({VERIFY_PROBES} probes of {first}+ requests), --trial-timeout {trial_timeout_s:.0f} s allows "
        f"{most_s:.0f}: a probe that does not fit moves to a higher rate (a longer --trial-timeout verifies at the "
        "predicted capacity)")
    # the first probe may pool up to its cap (plus a lead-in per look); the second still gets its first pass
    return {"start_rps": rate_rps, "max_probes": VERIFY_PROBES, "probe_requests": [first, cap],
            "max_requests": 2 * cap + first, "max_wall_s": min(want_s, most_s)}, note


def verification(capacity: dict[str, Any], plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a planned measurement verified: each probe's rate, n and verdict, the first at the planned rate."""
    if not plan:
        return None
    probes = [{"rate_rps": p["rate_rps"], "n": p["n"], "verdict": p["verdict"]} for p in capacity.get("probes") or []]
    return {"start_rps": plan["start_rps"], "probe_requests": plan["probe_requests"], "probes": probes,
            "started_at_prediction": any(abs(p["rate_rps"] - plan["start_rps"]) <= 1e-9 * plan["start_rps"]
                                         for p in probes)}


def verified_text(trial: int, slo: Any, v: dict[str, Any]) -> str:
    """'trial 3: ttft:p99<300ms verified by 2 probes: n=505 at 0.31 req/s (the predicted capacity): meets; ...'"""
    parts = []
    for p in sorted(v["probes"], key=lambda p: p["rate_rps"]):
        at = " (the predicted capacity)" if abs(p["rate_rps"] - v["start_rps"]) <= 1e-9 * v["start_rps"] else ""
        parts.append(f"n={p['n']} at {p['rate_rps']:.3g} req/s{at}: {p['verdict']}")
    how = "; ".join(parts) if parts else "no probe ran (the capacity budget)"
    moved = "" if v["started_at_prediction"] or not parts else (
        f" (not started at the predicted {v['start_rps']:.3g} req/s: at or above the saturation rate, or past the "
        "capacity budget)")
    return (f"trial {trial}: {', '.join(tail_terms(slo))} verified on the real engine by {len(parts)} probe(s) "
            f"sized for the percentile (first pass {v['probe_requests'][0]}): {how}{moved} (measured)")


def off_band_text(m: dict[str, Any]) -> str | None:
    """'trial 2: the model was off by +45% (predicted 1.2 req/s, band [0.9, 1.4]; measured 0.83), outside its band
    ...' for a measured capacity outside its prediction's band; None inside it or without a band."""
    pr, band, got = m.get("predicted_requests_per_s"), m.get("predicted_band"), m.get("requests_per_s")
    if pr is None or not band or band[0] is None or band[1] is None or got is None or band[0] <= got <= band[1]:
        return None
    head = (f"the model was off by {m['signed_error']:+.0%}" if m.get("signed_error") is not None else
            "the model was off: no rate was shown to meet the SLO on the real engine")
    return (f"trial {m['trial']}: {head}, outside its band (predicted {pr:.3g} req/s, band [{band[0]:.3g}, "
            f"{band[1]:.3g}]; measured {got:.3g} req/s): recorded in the profile's calibration history"
            + (", so later predictions from it carry a band widened to this ratio" if got else ""))


def closest_text(slo: Any, measured: list[tuple[int, dict[str, Any], dict[str, Any]]]) -> str | None:
    """When no measured configuration was shown to meet the SLO: 'no configuration meets ttft:p99<300ms here; the
    closest is trial 2 (...) at 412 ms ...'. `measured`: (trial, config, capacity result) of each measured one."""
    from tuner.measure.capacity import bound_value_at

    if not measured or any(c.get("verdict") == "meets" for _, _, c in measured):
        return None
    rows = []
    for trial, config, cap in measured:
        worst = None
        for b in slo.bounds:
            v = bound_value_at(cap, b)
            if v is not None and (worst is None or v / b.limit_ms > worst[0]):
                worst = (v / b.limit_ms, b, v)
        if worst is not None:
            rows.append((worst, trial, config, cap))
    head = f"no configuration meets {slo} here (none of the {len(measured)} measured was shown to)"
    if not rows:
        return head + "; no probe measured its latency"
    (_, b, v), trial, config, cap = min(rows, key=lambda r: r[0][0])
    probes = cap.get("probes") or []
    p = min(probes, key=lambda q: q["rate_rps"]) if probes else None
    where = f" at {p['rate_rps']:.3g} req/s, the lowest rate probed, n={p['n']}" if p else " at saturation"
    cfg = " ".join(f"{k}={config.get(k)}" for k in ("quant", "batch_cap", "kv_type") if config.get(k) is not None)
    return (f"{head}; the closest is trial {trial} ({cfg}) at {v:.0f} ms ({b.key}{where}, measured; "
            f"{b.limit_ms:g} ms asked)")
