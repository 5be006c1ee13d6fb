"""The search's sampler: seeded multivariate TPE whose random draws depend on (seed, trial number), that never spends a
trial re-measuring a configuration (`no_repeat_tpe`). Constraints come from each trial's `set_constraint`; constant
liar, so parallel workers do not pick the configuration another one is running. Optuna's internals it needs are
reached through tuner.search.optuna_private only."""

from __future__ import annotations

import itertools
from typing import Any

from tuner.search.optuna_private import reseed_sampler, sampler_rng, with_acquisition_hooks
from tuner.search.workers import interrupted

TPE_SETTINGS = {"n_startup_trials": 3, "multivariate": True, "group": True, "constant_liar": True}


def make_sampler(seed: int, space: Any = None) -> Any:
    """Seeded multivariate TPE; constraints come from each trial's `set_constraint`; constant liar so parallel
    workers do not pick the same config while one is running; random state re-seeded per trial number. Given the
    search space, it never proposes a configuration the study has already measured (see `no_repeat_tpe`)."""
    import optuna

    class TrialSeededTPESampler(optuna.samplers.TPESampler):
        """TPE whose random draws for trial k depend on (seed, k) only, not on how many trials this process has
        sampled before: a resumed study or a second worker does not repeat the first worker's random startup
        configurations, and a one-worker run is still reproducible."""

        def __init__(self, seed: int, **kwargs: Any) -> None:
            super().__init__(seed=seed, **kwargs)
            self.base_seed = seed

        def before_trial(self, study: Any, trial: Any) -> None:
            reseed_sampler(self, (self.base_seed * 1_000_003 + trial.number * 7_919) % 2**32)
            super().before_trial(study, trial)

    if space is None:
        return TrialSeededTPESampler(seed=seed, **TPE_SETTINGS)
    return no_repeat_tpe(TrialSeededTPESampler)(seed=seed, space=space, **TPE_SETTINGS)


def finite_values(dist: Any) -> list[Any] | None:
    """Every value of a categorical or a small integer distribution (None: too many, or continuous)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution) and (dist.high - dist.low) // dist.step < 1024:
        return list(range(dist.low, dist.high + 1, dist.step))
    return None


def no_repeat_tpe(base: type) -> type:
    """A TPE sampler that does not spend a trial re-measuring a configuration: a search space is finite in its
    categorical knobs (a batch cap, a format), and plain TPE, whose acquisition peaks at the best point seen, keeps
    proposing configurations already measured -- each a full capacity measurement that adds nothing. Candidates all
    of whose configurations were measured (trials COMPLETE, PRUNED, RUNNING, or FAIL: a configuration that ran out of
    memory, crashed or timed out fails again; not one whose trial was interrupted, `interrupted`;
    tuner.search.space.all_measured) get an acquisition of -inf, so TPE takes its best *new* candidate; when every
    candidate is old, one of the values not yet exhausted is drawn at random; a start-up (random) draw that repeats
    one is drawn again the same way. A space with every configuration measured gets a repeat (nothing new is left).
    TPE's private steps are reached through tuner.search.optuna_private.with_acquisition_hooks."""
    import numpy as np
    from optuna.trial import TrialState

    from tuner.search.space import all_measured, config_key

    class NoRepeatTPE(with_acquisition_hooks(base)):  # type: ignore[misc]
        def __init__(self, *args: Any, space: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.space = space
            self.partial: dict[str, Any] | None = None  # relative parameters of this trial's earlier groups
            self.mask: tuple[dict[str, Any], dict[str, Any]] | None = None
            self.seen: set = set()  # configurations measured or running when this trial started

        def before_trial(self, study: Any, trial: Any) -> None:
            super().before_trial(study, trial)
            states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.FAIL)
            keys = (config_key(self.space, t.params) for t in study.get_trials(deepcopy=False, states=states)
                    if t.number != trial.number and not interrupted(t))
            self.seen = {k for k in keys if k is not None}

        def fresh(self, known: dict[str, Any], search_space: dict[str, Any]) -> dict[str, Any] | None:
            """A random combination of `search_space` values with an unmeasured configuration (None: none left)."""
            names = list(search_space)
            options = [finite_values(search_space[n]) for n in names]
            if any(o is None for o in options):
                return None
            combos = [dict(zip(names, c)) for c in itertools.product(*options)]
            new = [c for c in combos if not all_measured(self.space, {**known, **c}, self.seen)]
            return new[int(sampler_rng(self).randint(len(new)))] if new else None

        def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
            self.partial = {}
            try:
                return super().sample_relative(study, trial, search_space)
            finally:
                self.partial = None

        def sample_independent(self, study: Any, trial: Any, name: str, dist: Any) -> Any:
            value = super().sample_independent(study, trial, name, dist)
            if all_measured(self.space, {**trial.params, name: value}, self.seen):  # a start-up draw, or all old
                alt = self.fresh(dict(trial.params), {name: dist})
                value = alt[name] if alt else value
            return value

        def sample_group(self, study: Any, trial: Any, search_space: dict[str, Any], sample: Any) -> dict[str, Any]:
            known = {**trial.params, **(self.partial or {})}
            self.mask = (known, search_space)
            try:
                ret = sample()
            finally:
                self.mask = None
            if all_measured(self.space, {**known, **ret}, self.seen):
                ret = self.fresh(known, search_space) or ret
            if self.partial is not None:
                self.partial.update(ret)
            return ret

        def mask_acquisition(self, samples: dict[str, Any], values: Any) -> Any:
            if self.mask is not None:
                known, search_space = self.mask
                for i in range(len(values)):
                    cand = {n: d.to_external_repr(samples[n][i]) for n, d in search_space.items()}
                    if all_measured(self.space, {**known, **cand}, self.seen):
                        values[i] = -np.inf
            return values

    return NoRepeatTPE
