"""Data shaping for the Streamlit dashboard (`app.py`, `tuner dashboard`): pure functions over an Optuna study's
trials, so the app only lays things out.

Everything here takes trials as Optuna gives them (`study.get_trials()`: objects with `number`, `state`, `params`,
`values`, `user_attrs`, `datetime_start`, `datetime_complete`) and the study's user_attrs as `tuner search` writes
them, and returns plain lists and dicts: the trials table, the numeric fields a chart axis can use, the chart
points, the Pareto line, the target lines, latency distributions, quality per task, the answer (through
`tuner.search.answer.answer`), parameter importances and the exports of a trial. Only `check_storage_url` and
`open_storage_readonly` touch anything outside their arguments (a storage URL's driver, a file's existence).

Studies measured by capacity (`capacity` user attr: the highest request rate meeting the SLO, with its CI, verdict
and probes) get capacity fields, columns and error bars; older studies (output tok/s at one fixed arrival rate)
still render from `metrics`. The latency-load curves and the capacity-quality view are in tuner/dashboard/curves.py.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.config import ENGINE_KNOBS
from tuner.dashboard.curves import LEGACY_NOTE, capacity_attr, capacity_summary, capacity_text, ci_pair
from tuner.dashboard.curves import percentile_rows as percentile_rows
from tuner.errors import TunerError
from tuner.search.answer import DEFAULT_STORAGE, Row, answer, rows_from_study

STORAGE_ENV = "TUNER_STORAGE"
THROUGHPUT = "output_tokens_per_s"
FINISHED = ("COMPLETE", "PRUNED", "FAIL")

# Fields that are worse when larger (chart directions); everything latency-like ("..._ms...") is too.
_MINIMIZE = ("failed", "peak_rss_mb", "peak_cuda_mb", "cost_per_million_tokens", "quality.drop_pp",
             "quality.kld_mean", "quality.kld_p99", "duration_s", "capacity.cost.requests", "capacity.cost.wall_s",
             "capacity.cost.probes")
_MAXIMIZE = (THROUGHPUT, "requests_per_s", "goodput_requests_per_s", "completed", "acceptance_rate",
             "quality.score", "quality.top1_agree", "roofline.percent_of_bound", "capacity.requests_per_s",
             "capacity.output_tokens_per_s", "capacity.goodput_requests_per_s", "capacity.saturation.requests_per_s",
             "capacity.saturation.output_tokens_per_s")
_SKIP_FIELDS = ("quality.limit", "quality.seed", "quality.baseline_score", "quality.score_stderr")
CAPACITY = "capacity.requests_per_s"
_LATENCY = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


# ------------------------------------------------------------------------------------------------- storage --- #
def storage_from_argv(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The storage URL the app reads: `--storage URL` among the script's arguments (`streamlit run app.py --
    --storage URL`), else $TUNER_STORAGE, else the search's default."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--storage")
    known, _ = p.parse_known_args(list(argv))
    return known.storage or environ.get(STORAGE_ENV) or DEFAULT_STORAGE


def check_storage_url(url: str, what: str = "--storage") -> str:
    """A storage URL the dashboard can read, checked without connecting: its syntax, that SQLAlchemy has its
    driver, and for SQLite that the directory exists (a missing file is fine: the app waits for a search)."""
    if not re.match(r"^[a-z][a-z0-9+]*://", url or ""):
        raise TunerError(f"{what} {url!r} is invalid: expected an Optuna storage URL such as {DEFAULT_STORAGE} "
                         "or postgresql://user:pw@host/db")
    from sqlalchemy.engine import make_url

    try:
        from tuner.search.loop import sqlalchemy_url

        make_url(sqlalchemy_url(url)).get_dialect()
    except Exception as e:  # ArgumentError (bad URL), NoSuchModuleError (unknown scheme), ImportError (driver)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TunerError(f"{what} {url!r} is unusable: {msg[:160]}") from None
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if str(path) not in ("", ":memory:") and not path.parent.is_dir():
            raise TunerError(f"{what} {url!r}: directory {str(path.parent)!r} does not exist")
    return url


def open_storage_readonly(url: str) -> Any:
    """An Optuna RDBStorage for an existing database (a missing SQLite file is a TunerError, not a new file)."""
    from tuner.search.answer import open_storage

    return open_storage(url, create=False)


def display_url(url: str) -> str:
    """The URL with its password masked (for the page and the terminal)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)


def sqlite_path(url: str) -> Path | None:
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


# ------------------------------------------------------------------------------------------------- studies --- #
@dataclass(frozen=True)
class StudyInfo:
    """What the dashboard needs from a study's user_attrs (written by `tuner search`)."""

    name: str
    model: str | None = None
    primary: str | None = None  # "ttft:p99<3000ms"
    latency_metric: str | None = None  # "ttft:p99"
    latency_target_ms: float | None = None
    bounds: tuple[str, ...] = ()
    constraint_names: tuple[str, ...] = ()
    recommended_trial: int | None = None
    max_quality_drop: float | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)
    slo: Mapping[str, Any] = field(default_factory=dict)  # as capacity.slo: bounds, targets_ms, attainment, ...

    @property
    def latency_field(self) -> str | None:
        """The flattened field of the latency metric, e.g. 'ttft_ms.p99'; for an SLO of per-request targets only,
        the first target's metric at the attainment's percentile ('ttft_ms.p90' for ttft<2s met by 90%)."""
        if self.latency_metric:
            return metric_field(self.latency_metric)
        share = _num(self.slo.get("attainment"))
        key = next(iter(self.slo.get("targets_ms") or {}), None)
        stat = f"p{round(100 * share)}" if share else None
        return f"{key}.{stat}" if key and stat in ("p50", "p90", "p95", "p99") else None

    @property
    def from_search(self) -> bool:
        return bool(self.constraint_names and (self.primary or self.slo))


def metric_field(metric: str) -> str | None:
    """'ttft:p99' -> 'ttft_ms.p99' (None when it is not METRIC:STAT)."""
    m = re.fullmatch(r"\s*([a-z0-9]+)\s*:\s*([a-z0-9]+)\s*", metric or "")
    return f"{m.group(1)}_ms.{m.group(2)}" if m else None


def study_info(name: str, attrs: Mapping[str, Any]) -> StudyInfo:
    primary = attrs.get("primary")
    metric = attrs.get("latency_metric")
    if not metric and isinstance(primary, str) and "<" in primary:
        metric = primary.split("<", 1)[0]
    target = attrs.get("latency_target_ms")
    rec = attrs.get("recommended_trial")
    return StudyInfo(
        name=name, model=attrs.get("model"), primary=primary if isinstance(primary, str) else None,
        latency_metric=metric if isinstance(metric, str) else None,
        latency_target_ms=float(target) if isinstance(target, (int, float)) else None,
        bounds=tuple(str(b) for b in attrs.get("bounds") or ()),
        constraint_names=tuple(str(c) for c in attrs.get("constraint_names") or ()),
        recommended_trial=int(rec) if isinstance(rec, int) else None,
        max_quality_drop=attrs.get("max_quality_drop"), attrs=dict(attrs),
        slo=dict(attrs["slo"]) if isinstance(attrs.get("slo"), Mapping) else {})


def bound_lines(info: StudyInfo) -> dict[str, list[tuple[float, str]]]:
    """Field -> [(limit ms, label)] for the latency target and every latency bound of the study (its `bounds`, or
    `slo.bounds`), and, for an attainment SLO (`slo.targets_ms` met by a share `slo.attainment` of requests), the
    per-request target on every percentile of that metric."""
    from tuner.slo import parse_slo

    out: dict[str, list[tuple[float, str]]] = {}
    texts = list(info.bounds) or [str(b) for b in info.slo.get("bounds") or ()] or (
        [info.primary] if info.primary else [])
    for text in texts:
        try:
            bounds = parse_slo(text)
        except TunerError:
            continue
        for b in bounds:
            f = f"{b.metric}_ms.{b.stat}"
            label = ("latency target " if b.key == info.latency_metric else "bound ") + str(b)
            if all(v != b.limit_ms for v, _ in out.get(f, [])):
                out.setdefault(f, []).append((b.limit_ms, label))
    share = _num(info.slo.get("attainment"))
    for key, limit in (info.slo.get("targets_ms") or {}).items():
        if _num(limit) is None or not str(key).endswith("_ms"):
            continue
        label = f"per-request target {key[:-3]}<{limit:g}ms" + (f" for {share:.0%} of requests" if share else "")
        for stat in ("p50", "p90", "p95", "p99", "mean"):
            if all(v != limit for v, _ in out.get(f"{key}.{stat}", [])):
                out.setdefault(f"{key}.{stat}", []).append((float(limit), label))
    if info.latency_field and info.latency_target_ms and info.latency_field not in out:
        out[info.latency_field] = [(info.latency_target_ms, f"latency target {info.latency_metric}<"
                                                              f"{info.latency_target_ms:g}ms")]
    return out


# -------------------------------------------------------------------------------------------------- trials --- #
class _Trials:
    """Gives a list of trials the `get_trials` of a study, so `tuner.search.answer.rows_from_study` reads it."""

    def __init__(self, trials: Sequence[Any], user_attrs: Mapping[str, Any] | None = None) -> None:
        self._trials = list(trials)
        self.user_attrs = dict(user_attrs or {})  # the study's: re-measures of picked trials (tuner.search.confirm)

    def get_trials(self, deepcopy: bool = False, states: Any = None) -> list[Any]:
        return self._trials


def state_name(trial: Any) -> str:
    s = trial.state
    return getattr(s, "name", str(s))


@dataclass(frozen=True)
class TrialView:
    """One trial: tuner.search.answer's Row (config, metrics, quality, constraints, reason, cost) plus what only the
    dashboard shows (per-request latencies, engine, timing, baseline flag, the capacity measurement)."""

    row: Row
    params: Mapping[str, Any]
    requests: list[Mapping[str, Any]]
    engine: Mapping[str, Any] | None
    baseline: bool
    duration_s: float | None
    capacity: Mapping[str, Any] | None = None

    @property
    def capacity_rps(self) -> float | None:
        return _num((self.capacity or {}).get("requests_per_s"))

    @property
    def tok_s(self) -> float:
        """Output tok/s: at the capacity point, or (an older study) at the one rate the trial was measured at."""
        v = _num((self.capacity or {}).get(THROUGHPUT)) if self.capacity else _num(self.row.metrics.get(THROUGHPUT))
        return v or 0.0

    @property
    def engine_label(self) -> str | None:
        """Which engine served the trial ('transformers-cb', 'transformers-assisted'), None when not recorded."""
        name = (self.engine or {}).get("name") or self.row.config.get("engine")
        return str(name) if name else None

    @property
    def number(self) -> int:
        return self.row.number

    @property
    def state(self) -> str:
        return self.row.state

    @property
    def feasible(self) -> bool:
        return self.row.feasible

    @property
    def finished(self) -> bool:
        return self.row.state in FINISHED


def trial_views(trials: Sequence[Any], study_attrs: Mapping[str, Any] | None = None) -> list[TrialView]:
    rows = rows_from_study(_Trials(trials, study_attrs))
    out = []
    for t, r in zip(trials, rows):
        ua = t.user_attrs or {}
        start, end = getattr(t, "datetime_start", None), getattr(t, "datetime_complete", None)
        dur = (end - start).total_seconds() if start and end else None
        reqs = ua.get("requests")
        eng = ua.get("engine")
        out.append(TrialView(r, dict(getattr(t, "params", {}) or {}), list(reqs) if isinstance(reqs, list) else [],
                             eng if isinstance(eng, dict) else None, bool(ua.get("baseline")), dur,
                             r.capacity if r.trial_capacity is not None else capacity_attr(ua)))
    return sorted(out, key=lambda v: v.number)


def has_capacity(views: Sequence[TrialView]) -> bool:
    """Whether the study was measured by capacity (else: output tok/s at one fixed arrival rate, before capacity)."""
    return any(v.capacity is not None for v in views)


def signature(trials: Iterable[Any]) -> tuple[tuple[int, str], ...]:
    """What changes when a running search makes progress (the live page reloads when it does)."""
    return tuple(sorted((t.number, state_name(t)) for t in trials))


def state_counts(views: Sequence[TrialView]) -> dict[str, int]:
    counts = {"trials": len(views), "COMPLETE": 0, "feasible": 0, "PRUNED": 0, "FAIL": 0, "RUNNING": 0,
              "WAITING": 0}
    for v in views:
        counts[v.state] = counts.get(v.state, 0) + 1
        counts["feasible"] += v.feasible
    return counts


# -------------------------------------------------------------------------------------------------- fields --- #
def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numeric leaves of nested dicts, keys joined with '.' (booleans and lists are left out)."""
    out: dict[str, float] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


def trial_fields(v: TrialView) -> dict[str, float]:
    """Every numeric value of a trial a chart axis can use: metrics ('ttft_ms.p99', 'output_tokens_per_s',
    'roofline.percent_of_bound'), quality ('quality.score', 'quality.tasks.arc_easy.acc'), the numeric knobs
    ('config.batch_cap', 'config.kv_fraction'), capacity ('capacity.requests_per_s',
    'capacity.saturation.requests_per_s'), cost and duration. Sample counts ('.n') are left out."""
    r = v.row
    out = {k: x for k, x in flatten({k: m for k, m in r.metrics.items() if k != "capacity"}).items()
           if not k.endswith(".n")}
    if v.capacity:
        out.update({k: x for k, x in flatten({k: c for k, c in v.capacity.items() if k != "slo"}, "capacity.").items()
                    if not k.endswith(".n")})
    out.update({k: x for k, x in flatten(r.quality, "quality.").items()
                if k not in _SKIP_FIELDS and not k.endswith((".n", "_stderr")) and not k.startswith("quality.gate.")})
    out.update({f"config.{k}": x for k, x in flatten(r.config).items()})
    if isinstance(r.cost, (int, float)) and math.isfinite(r.cost):
        out["cost_per_million_tokens"] = float(r.cost)
    if v.duration_s is not None:
        out["duration_s"] = v.duration_s
    out["trial"] = float(v.number)
    return out


def axis_fields(views: Sequence[TrialView], info: StudyInfo | None = None) -> list[str]:
    """Fields present in at least one trial: throughput and the study's latency metric first, then the other
    latency percentiles, then the rest alphabetically."""
    seen: set[str] = set()
    for v in views:
        seen.update(trial_fields(v))
    first = [CAPACITY, "quality.score", THROUGHPUT] if has_capacity(views) else [THROUGHPUT]
    if info and info.latency_field:
        first.append(info.latency_field)
    first += [f"{m}_ms.{s}" for m in _LATENCY for s in ("p50", "p90", "p95", "p99", "mean")]
    first += ["requests_per_s", "quality.score", "capacity.output_tokens_per_s", "capacity.goodput_requests_per_s"]
    ordered = [f for f in dict.fromkeys(first) if f in seen]
    return ordered + sorted(seen - set(ordered))


def default_axes(fields: Sequence[str], info: StudyInfo | None, by_capacity: bool) -> tuple[str, str]:
    """The chart's default (x, y): capacity vs quality score for a study measured by capacity (vs its latency at
    capacity when quality was not scored); latency vs output tok/s for an older study."""
    lat = info.latency_field if info else None

    def first(*choices: str | None) -> str:
        return next((c for c in choices if c and c in fields), fields[0])

    if by_capacity and CAPACITY in fields:
        return CAPACITY, first("quality.score", lat, THROUGHPUT, "trial")
    return first(lat), first(THROUGHPUT)


def field_label(f: str) -> str:
    """'ttft_ms.p99' -> 'TTFT p99 (ms)', 'output_tokens_per_s' -> 'output tok/s', 'config.batch_cap' -> 'batch cap'."""
    m = re.fullmatch(r"([a-z0-9]+)_ms\.([a-z0-9]+)", f)
    if m and m.group(1) in _LATENCY:
        return f"{_LATENCY[m.group(1)]} {m.group(2)} (ms)"
    special = {THROUGHPUT: "output tok/s", "requests_per_s": "requests/s", "quality.score": "quality score",
               "cost_per_million_tokens": "$ per 1M output tokens", "duration_s": "trial duration (s)",
               "trial": "trial number", "peak_rss_mb": "peak RSS (MB)", "peak_cuda_mb": "peak CUDA memory (MB)",
               "quality.drop_pp": "quality drop (pp)", "acceptance_rate": "draft acceptance rate",
               CAPACITY: "capacity (req/s)", "capacity.output_tokens_per_s": "output tok/s at capacity",
               "capacity.goodput_requests_per_s": "goodput at capacity (req/s)",
               "capacity.saturation.requests_per_s": "saturation (req/s, closed loop)",
               "capacity.saturation.output_tokens_per_s": "saturation output tok/s (closed loop)",
               "capacity.cost.wall_s": "capacity search wall time (s)"}
    if f in special:
        return special[f]
    if f.startswith("capacity."):
        return f[len("capacity."):].replace("_", " ").replace(".", " ") + " (capacity search)"
    if f.startswith("config."):
        return f[len("config."):].replace("_", " ")
    return f.replace("_", " ")


def direction(f: str) -> str | None:
    """'max' or 'min' when larger is better or worse for this field; None for knobs and neutral fields."""
    if f in _MAXIMIZE or (f.startswith("quality.tasks.") and f.endswith(".acc")):
        return "max"
    if f in _MINIMIZE or re.fullmatch(r"[a-z0-9]+_ms\.[a-z0-9]+", f):
        return "min"
    return None


# ------------------------------------------------------------------------------------------------ the table --- #
def _pct(m: Mapping[str, Any], key: str, stat: str) -> float | None:
    v = (m.get(key) or {}).get(stat) if isinstance(m.get(key), Mapping) else None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def table_rows(views: Sequence[TrialView], info: StudyInfo | None = None,
               recommended: int | None = None) -> list[dict[str, Any]]:
    """One dict per trial, every trial (failed and pruned ones with their reason, next to their state), column
    names as in results/<study>/trials.csv plus the study's latency metric and the engine. A study measured by
    capacity adds its capacity (req/s) with CI and verdict and the quality gate's verdict; output tok/s and the
    latencies are then those at the capacity point."""
    lat = info.latency_field if info else None
    by_capacity = has_capacity(views)
    out = []
    for v in views:
        r, m, q, c = v.row, v.row.metrics, v.row.quality, v.row.config
        row: dict[str, Any] = {
            "number": v.number, "state": v.state, "reason": first_line(r.reason),
            "feasible": v.feasible if v.state == "COMPLETE" else None,
            "recommended": v.number == recommended, "baseline": v.baseline,
        }
        if by_capacity:  # the figures that decide, first
            cap = v.capacity or {}
            lo, hi = ci_pair(cap.get("requests_per_s_ci"))
            gate = q.get("gate") if isinstance(q.get("gate"), Mapping) else {}
            row.update({"capacity_rps": v.capacity_rps, "capacity_ci_low_rps": lo, "capacity_ci_high_rps": hi,
                        "verdict": cap.get("verdict"), "quality_gate": gate.get("verdict"),
                        "goodput_rps": _num(cap.get("goodput_requests_per_s"))})
        row.update({"engine": v.engine_label, "quant": c.get("quant"), "batch_cap": c.get("batch_cap"),
                    "kv_fraction": c.get("kv_fraction"), "kv_type": c.get("kv_type", "auto"), "draft": c.get("draft")})
        row["output_tokens_per_s"] = _num((v.capacity or {}).get(THROUGHPUT)) if v.capacity else _num(m.get(THROUGHPUT))
        if lat and lat not in ("ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "tpot_ms.p99", "e2e_ms.p99"):
            key, stat = lat.split(".")
            row[f"{key[:-3]}_{stat}_ms"] = _pct(m, key, stat)
        row.update({
            "ttft_p50_ms": _pct(m, "ttft_ms", "p50"), "ttft_p99_ms": _pct(m, "ttft_ms", "p99"),
            "tpot_p50_ms": _pct(m, "tpot_ms", "p50"), "tpot_p99_ms": _pct(m, "tpot_ms", "p99"),
            "e2e_p99_ms": _pct(m, "e2e_ms", "p99"), "quality_score": _num(q.get("score")),
            "quality_stderr": _num(q.get("score_stderr")), "drop_pp": _num(q.get("drop_pp")),
            "failed": m.get("failed"), "acceptance_rate": _num(m.get("acceptance_rate")),
            "peak_rss_mb": _num(m.get("peak_rss_mb")), "peak_cuda_mb": _num(m.get("peak_cuda_mb")),
            "cost_per_million_tokens": _num(r.cost), "duration_s": v.duration_s,
        })
        out.append(row)
    return out


def first_line(text: Any, limit: int = 300) -> str | None:
    if not text:
        return None
    s = str(text).strip().splitlines()
    return s[0][:limit] if s else None


def filter_rows(rows: Sequence[Mapping[str, Any]], formats: Iterable[str] | None = None,
                feasible: str = "all", states: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Rows of the formats (quant) and states given (None = all) and feasibility 'all' | 'feasible' |
    'infeasible' (anything not feasible, unfinished trials included)."""
    if feasible not in ("all", "feasible", "infeasible"):
        raise ValueError(f"feasible={feasible!r}: expected all, feasible or infeasible")
    fmts = None if formats is None else set(formats)
    sts = None if states is None else set(states)
    out = []
    for r in rows:
        if fmts is not None and r.get("quant") not in fmts:
            continue
        if sts is not None and r.get("state") not in sts:
            continue
        if feasible == "feasible" and r.get("feasible") is not True:
            continue
        if feasible == "infeasible" and r.get("feasible") is True:
            continue
        out.append(dict(r))
    return out


# ------------------------------------------------------------------------------------------------ the chart --- #
def config_text(config: Mapping[str, Any]) -> str:
    if not config:
        return "no config recorded"
    kv = config.get("kv_fraction")
    kv_s = f"{kv:g}" if isinstance(kv, (int, float)) else str(kv)
    kv_type = f" ({config['kv_type']})" if config.get("kv_type", "auto") != "auto" else ""
    engine = f"{config['engine']} " if config.get("engine", "transformers") != "transformers" else ""
    extra = "".join(f" · {k} {config[k]}" for k, spec in ENGINE_KNOBS.items() if config.get(k, spec[1]) != spec[1])
    return (f"{engine}{config.get('quant')} · batch cap {config.get('batch_cap')} · KV fraction {kv_s}{kv_type} · "
            f"draft {config.get('draft')}{extra}")


def hover_text(v: TrialView, info: StudyInfo | None = None) -> str:
    r = v.row
    status = v.state + (", feasible" if v.feasible else (", infeasible" if v.state == "COMPLETE" else ""))
    lines = [f"<b>trial {v.number}</b> ({status})" + (" · baseline" if v.baseline else ""),
             f"model {r.config.get('model')} on {r.config.get('device')}"
             + (f" · engine {v.engine_label}" if v.engine_label else ""), config_text(r.config)]
    if v.capacity:
        lines.append(f"capacity {capacity_text(v.capacity)}")
    parts = [f"{v.tok_s:.2f} output tok/s" + (" at capacity" if v.capacity else "")]
    lat = info.latency_field if info else None
    if lat:
        key, stat = lat.split(".")
        val = _pct(r.metrics, key, stat)
        if val is not None:
            parts.append(f"{field_label(lat).replace(' (ms)', '')} {val:.0f} ms")
    q = _num(r.quality.get("score"))
    if q is not None:
        se = _num(r.quality.get("score_stderr"))
        parts.append(f"quality {q:.3f}" + (f" ± {se:.3f}" if se is not None else ""))
    gate = r.quality.get("gate")
    if isinstance(gate, Mapping) and gate.get("verdict"):
        parts.append(f"quality gate {gate['verdict']}")
    lines.append(" · ".join(parts))
    if r.reason:
        lines.append(f"reason: {first_line(r.reason, 120)}")
    return "<br>".join(lines)


def chart_points(views: Sequence[TrialView], x: str, y: str, info: StudyInfo | None = None,
                 recommended: int | None = None) -> list[dict[str, Any]]:
    """One point per trial that has both values: x, y, their error bars (`x_err`, `y_err`: see `field_error`),
    quality (None when not scored), feasible, state, whether it is the recommendation, the engine, and the hover
    text (its config and key figures)."""
    out = []
    for v in views:
        f = trial_fields(v)
        if x not in f or y not in f:
            continue
        out.append({"number": v.number, "x": f[x], "y": f[y], "x_err": field_error(v, x, f[x]),
                    "y_err": field_error(v, y, f[y]), "quality": _num(v.row.quality.get("score")),
                    "feasible": v.feasible, "state": v.state, "recommended": v.number == recommended,
                    "baseline": v.baseline, "engine": v.engine_label, "hover": hover_text(v, info)})
    return out


def field_error(v: TrialView, f: str, value: float) -> dict[str, Any] | None:
    """The uncertainty of a trial's value on a field, as error-bar lengths {'minus', 'plus', 'open_minus',
    'open_plus'} (an open side has no bound: too few samples; its length is 0): the capacity's CI, the quality
    score's standard error (±), a latency percentile's CI (`metrics[...].ci`, `capacity.saturation` has none).
    None when the field carries no uncertainty."""
    lo: float | None
    hi: float | None
    if f == CAPACITY and v.capacity and "requests_per_s_ci" in v.capacity:
        lo, hi = ci_pair(v.capacity.get("requests_per_s_ci"))
    elif f == "quality.score" and _num(v.row.quality.get("score_stderr")) is not None:
        se = float(v.row.quality["score_stderr"])
        lo, hi = value - se, value + se
    else:
        m = re.fullmatch(r"([a-z0-9]+_ms)\.(p50|p90|p95|p99)", f)
        ci = (v.row.metrics.get(m.group(1)) or {}).get("ci") if m else None
        if m is None or not isinstance(ci, Mapping) or not isinstance(ci.get(m.group(2)), (list, tuple)):
            return None
        lo, hi = ci_pair(ci.get(m.group(2)))
    return {"minus": max(0.0, value - lo) if lo is not None else 0.0, "open_minus": lo is None,
            "plus": max(0.0, hi - value) if hi is not None else 0.0, "open_plus": hi is None}


def pareto_line(points: Sequence[Mapping[str, Any]], x_dir: str | None, y_dir: str | None) -> list[dict[str, Any]]:
    """The feasible points not dominated on the two axes (directions 'max'/'min'), sorted by x: the front drawn
    as a line. Empty when an axis has no direction (a knob) or nothing is feasible."""
    if x_dir not in ("max", "min") or y_dir not in ("max", "min"):
        return []
    sx, sy = (1 if x_dir == "max" else -1), (1 if y_dir == "max" else -1)
    pts = [p for p in points if p["feasible"]]
    front = []
    for p in pts:
        a, b = sx * p["x"], sy * p["y"]
        if not any(sx * o["x"] >= a and sy * o["y"] >= b and (sx * o["x"], sy * o["y"]) != (a, b) for o in pts):
            front.append(p)
    # one point per distinct position (ties keep the lowest trial number)
    uniq: dict[tuple[float, float], Mapping[str, Any]] = {}
    for p in sorted(front, key=lambda p: p["number"]):
        uniq.setdefault((p["x"], p["y"]), p)
    return [dict(p) for p in sorted(uniq.values(), key=lambda p: (p["x"], p["y"]))]


def quality_range(points: Sequence[Mapping[str, Any]]) -> tuple[float, float] | None:
    qs = [p["quality"] for p in points if p.get("quality") is not None]
    if not qs:
        return None
    lo, hi = min(qs), max(qs)
    return (lo, hi) if hi > lo else (lo - 0.05, hi + 0.05)


def target_lines(info: StudyInfo | None, x: str, y: str) -> list[dict[str, Any]]:
    """The latency target (and other latency bounds) that fall on an axis: {'axis': 'x'|'y', 'value', 'label'}."""
    if info is None:
        return []
    lines = bound_lines(info)
    out = []
    for axis, f in (("x", x), ("y", y)):
        for value, label in lines.get(f, []):
            out.append({"axis": axis, "value": value, "label": label})
    return out


# ----------------------------------------------------------------------------------------------- the detail --- #
def latency_samples(requests: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per-request TTFT and E2E (ms) of the requests that succeeded."""
    out: dict[str, list[float]] = {"ttft_ms": [], "e2e_ms": []}
    for r in requests:
        if r.get("error"):
            continue
        for k in out:
            v = _num(r.get(k))
            if v is not None:
                out[k].append(v)
    return out


def ecdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """Empirical CDF: sorted values and the share of values <= each."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def quality_tasks(quality: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per-task accuracy with its standard error, sorted by task name."""
    tasks = quality.get("tasks") or {}
    out = []
    for name in sorted(tasks):
        t = tasks[name] or {}
        out.append({"task": name, "acc": _num(t.get("acc")), "acc_stderr": _num(t.get("acc_stderr"))})
    return out


def detail(v: TrialView) -> dict[str, Any]:
    """What the trial page shows besides its charts."""
    r, m = v.row, v.row.metrics
    draft = str(r.config.get("draft") or "none")
    failed_requests = [first_line(q.get("error"), 200) for q in v.requests if q.get("error")]
    return {
        "number": v.number, "state": v.state, "feasible": v.feasible, "baseline": v.baseline,
        "config": dict(r.config), "reason": r.reason, "uses_draft": draft != "none",
        "acceptance_rate": _num(m.get("acceptance_rate")),
        "peak_rss_mb": _num(m.get("peak_rss_mb")), "peak_cuda_mb": _num(m.get("peak_cuda_mb")),
        "output_tokens_per_s": _num(m.get(THROUGHPUT)), "requests_per_s": _num(m.get("requests_per_s")),
        "completed": m.get("completed"), "failed": m.get("failed"),
        "percentiles": {k: {s: _pct(m, k, s) for s in ("p50", "p90", "p95", "p99", "mean")}
                        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") if isinstance(m.get(k), Mapping)},
        "quality": {k: r.quality.get(k) for k in ("score", "score_stderr", "baseline_score", "drop_pp",
                                                  "within_noise", "kld_mean", "top1_agree", "limit")
                    if r.quality.get(k) is not None},
        "tasks": quality_tasks(r.quality), "constraints": r.constraints, "failed_requests": failed_requests,
        "engine": v.engine, "engine_label": v.engine_label, "duration_s": v.duration_s,
        "gate": dict(r.quality["gate"]) if isinstance(r.quality.get("gate"), Mapping) else None,
        "capacity": capacity_summary(v.capacity),
    }


# ------------------------------------------------------------------------------------------ why this one --- #
def study_answer(views: Sequence[TrialView], info: StudyInfo) -> dict[str, Any] | None:
    """`tuner.search.answer.answer` over the trials so far. None when the study was not written by `tuner search`, or
    predates the capacity measure (the answer is now computed from capacities: an older study keeps the
    recommendation its search stored)."""
    if not info.from_search or not has_capacity(views):
        return None
    baseline = next((v.number for v in views if v.baseline), 0)
    return answer([v.row for v in views], list(info.constraint_names), baseline_number=baseline)


def latency_at(v: TrialView, info: StudyInfo) -> float | None:
    """The study's latency metric in the trial's metrics (at its capacity point), ms."""
    if not info.latency_field:
        return None
    key, stat = info.latency_field.split(".")
    return _pct(v.row.metrics, key, stat)


def recommended_number(ans: Mapping[str, Any] | None, info: StudyInfo) -> int | None:
    """The recommendation computed from the trials so far, else the one the search stored."""
    if ans and ans.get("recommendation"):
        return int(ans["recommendation"]["trial"])
    return info.recommended_trial


def constraint_table(names: Sequence[str], values: Sequence[float] | None) -> list[dict[str, Any]]:
    """Each constraint with its value (<= 0 satisfied) and slack."""
    out = []
    for n, c in zip(names, values or []):
        ok = c <= 0
        out.append({"constraint": n, "value": c if math.isfinite(c) else None, "satisfied": ok,
                    "slack": -c if math.isfinite(c) else None})
    return out


def param_importances(trials: Sequence[Any], directions: Sequence[Any] | None = None, min_trials: int = 3,
                      seed: int = 0) -> dict[str, dict[str, Any]]:
    """Optuna's fANOVA parameter importances for each objective over the COMPLETE trials with finite values:
    capacity and quality in a study measured by capacity (2 objectives), throughput and latency in an older
    study (3 objectives: tok/s, latency, quality). Returns {target: {"importances": {param: share}} or
    {"message": why not}}; never raises (too few trials, a constant search space... are messages)."""

    import optuna

    n_obj = len(directions) if directions else max((len(t.values) for t in trials
                                                    if getattr(t, "values", None)), default=3)
    targets = importance_targets(n_obj)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory" lines
    try:
        return _importances(trials, targets, directions, min_trials, seed)
    finally:
        optuna.logging.set_verbosity(verbosity)


def importance_targets(n_objectives: int) -> dict[str, int]:
    """Label -> objective index of the importances shown for a study with that many objectives."""
    return {"capacity": 0, "quality": 1} if n_objectives == 2 else {"throughput": 0, "latency": 1}


def _importances(trials: Sequence[Any], targets: Mapping[str, int], directions: Sequence[Any] | None,
                 min_trials: int, seed: int) -> dict[str, dict[str, Any]]:
    import warnings

    import optuna

    done = [t for t in trials if state_name(t) == "COMPLETE" and t.values is not None
            and len(t.values) > max(targets.values())]
    out: dict[str, dict[str, Any]] = {}
    for label, i in targets.items():
        usable = [t for t in done if math.isfinite(t.values[i])]
        if len(usable) < min_trials:
            out[label] = {"message": f"needs at least {min_trials} completed trials with a {label} value "
                                     f"(has {len(usable)})"}
            continue
        try:
            n = len(usable[0].values)
            study = optuna.create_study(directions=list(directions) if directions else
                                        ["maximize"] * 2 if n == 2 else ["maximize", "minimize", "maximize"][:n])
            study.add_trials(usable)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                imp = optuna.importance.get_param_importances(
                    study, target=lambda t, i=i: t.values[i],
                    evaluator=optuna.importance.FanovaImportanceEvaluator(seed=seed))
        except Exception as e:  # optuna raises ValueError/RuntimeError for degenerate inputs
            msg = first_line(str(e), 200) or type(e).__name__
            out[label] = {"message": f"cannot be computed yet: {msg}"}
            continue
        imp = {k: float(v) for k, v in imp.items() if math.isfinite(v)}
        if not imp:
            out[label] = {"message": "cannot be computed yet: no parameter varies across the completed trials"}
        else:
            out[label] = {"importances": imp}
    return out


def why(views: Sequence[TrialView], info: StudyInfo) -> dict[str, Any]:
    """The answer of `tuner.search.answer.answer` (the recommendation, its gain over the baseline, the binding constraint,
    runners-up; or the closest miss), the constraint table of the recommended (or closest) trial, and the
    recommendation's and the baseline's capacity summaries (`capacity`). A study from before the capacity measure
    gets `legacy` (a note), its stored recommendation and that trial's constraints: its answer is not recomputed."""
    if not info.from_search:
        return {"message": "this study was not written by `tuner search` (no SLO or constraint names in its "
                           "attributes): no recommendation"}
    by_number = {v.number: v for v in views}
    if not has_capacity(views):
        best = by_number.get(info.recommended_trial) if info.recommended_trial is not None else None
        return {"legacy": LEGACY_NOTE + " Its recommendation is the one its search stored (the feasible trial with "
                                        "the highest output tok/s); it is not recomputed.",
                "recommended": best.number if best else None,
                "constraints": constraint_table(info.constraint_names, best.row.constraints) if best else []}
    ans = study_answer(views, info) or {}
    out: dict[str, Any] = {"answer": ans}
    rec = ans.get("recommendation")
    if rec and rec.get("trial") in by_number:
        best = by_number[rec["trial"]]
        out["constraints"] = constraint_table(info.constraint_names, best.row.constraints)
        base = by_number.get((ans.get("baseline") or {}).get("trial"))
        out["capacity"] = {"recommended": capacity_summary(best.capacity),
                           "baseline": capacity_summary(base.capacity) if base else None}
    elif (ans.get("closest") or {}).get("trial") in by_number:
        c = by_number[ans["closest"]["trial"]]
        out["constraints"] = constraint_table(info.constraint_names, c.row.constraints)
    return out


# --------------------------------------------------------------------------------------------------- export --- #
def exports(v: TrialView, study: str | None, targets: Sequence[str] | None = None,
            paths: Callable[[Any], Mapping[str, str]] | None = None) -> list[dict[str, Any]]:
    """The serving configs of a COMPLETE trial for every `tuner.export` target: {target, engine, command, files
    {name: text}, notes, warnings, json} or {target, error}. `paths(config)` gives the model references
    (`tuner.export.locate.locate`, as `tuner export` does); without it the pure defaults are used."""
    from tuner.config import TrialConfig
    from tuner.export import TARGETS, Context, export

    if v.state != "COMPLETE":
        raise TunerError(f"trial {v.number} is {v.state}: only COMPLETE trials can be exported")
    if not v.row.config:
        raise TunerError(f"trial {v.number} has no 'config' attribute: it cannot be exported")
    from tuner.export.locate import measured_settings

    config = TrialConfig.from_dict(dict(v.row.config))
    located = dict(paths(config)) if paths else {}
    ctx = Context(study=study, trial=v.number, engine=v.engine, metrics=v.row.metrics or None, paths=located,
                  **measured_settings(config, v.engine, located))
    out = []
    for target in targets or list(TARGETS):
        try:
            exp = export(target, config, ctx)
        except TunerError as e:
            out.append({"target": target, "error": str(e)})
            continue
        out.append({"target": target, "engine": exp.engine, "command": exp.command(), "files": dict(exp.files),
                    "notes": [str(n) for n in exp.notes], "warnings": [str(n) for n in exp.warnings],
                    "json": exp.to_json()})
    return out


def config_json(v: TrialView) -> str:
    """The trial's TrialConfig as JSON (what `tuner bench --config` reads)."""
    from tuner.config import TrialConfig

    return TrialConfig.from_dict(dict(v.row.config)).to_json()
