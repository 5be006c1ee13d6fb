"""The one place tuner touches Optuna's private API (declared range: optuna>=5,<6, pyproject).

Everything that reads or overrides an underscored Optuna name lives here, behind a small public function, so an
Optuna upgrade is checked against this file alone (tests/test_sampler.py, tests/test_workers.py and
tests/test_reliability.py exercise every function below on real studies):

  * a TPE sampler's random state (`_rng`, `_random_sampler`): re-seeded per trial number, drawn from;
  * two TPE internals overridden through hooks (`_sample`: one group's relative sampling; `_compute_acquisition_func`:
    the acquisition of each candidate);
  * a study's storage and a trial's storage id (`Study._storage`, `Study._study_id`, `FrozenTrial._trial_id`);
  * the heartbeat's stale trials (`optuna.storages._heartbeat`, `RDBStorage._get_stale_trial_ids`, the cached
    storage's `_backend`).
"""

from __future__ import annotations

from typing import Any


# ------------------------------------------------------------------------------------ sampler internals --- #
def sampler_rng(sampler: Any) -> Any:
    """A TPESampler's own random state (a numpy RandomState)."""
    return sampler._rng.rng


def reseed_sampler(sampler: Any, seed: int) -> None:
    """Re-seed a TPESampler's random state (TPE and its start-up random sampler)."""
    sampler._rng.rng.seed(seed)
    sampler._random_sampler._rng.rng.seed((seed + 1) % 2**32)


def with_acquisition_hooks(base: type) -> type:
    """`base` (a TPESampler class) whose two private steps call public hooks of the subclass:
    `sample_group(study, trial, search_space, sample)` wraps TPE's `_sample` (one group's relative sampling; `sample()`
    runs TPE's own) and `mask_acquisition(samples, values)` may rewrite the acquisition `values` TPE computed for its
    candidate `samples` (internal representation, one array per parameter) in `_compute_acquisition_func`."""

    class AcquisitionHooks(base):  # type: ignore[misc, valid-type]
        def sample_group(self, study: Any, trial: Any, search_space: dict[str, Any], sample: Any) -> dict[str, Any]:
            return sample()

        def mask_acquisition(self, samples: dict[str, Any], values: Any) -> Any:
            return values

        def _sample(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
            parent = super()._sample
            return self.sample_group(study, trial, search_space, lambda: parent(study, trial, search_space))

        def _compute_acquisition_func(self, samples: dict[str, Any], below: Any, above: Any) -> Any:
            return self.mask_acquisition(samples, super()._compute_acquisition_func(samples, below, above))

    return AcquisitionHooks


# ---------------------------------------------------------------------------------- storage internals --- #
def storage_of(study: Any) -> Any:
    """The storage a study reads and writes."""
    return study._storage


def trial_id(trial: Any) -> int:
    """A trial's id in its storage (not its number in the study)."""
    return trial._trial_id


def stale_trial_ids(study: Any) -> tuple[set[int], float | None]:
    """Ids of RUNNING trials whose heartbeat is older than the grace period, and that grace period (s); (set(), None)
    when the storage keeps no heartbeats."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    storage = study._storage
    if not (is_heartbeat_enabled(storage) and hasattr(storage, "_get_stale_trial_ids")):
        return set(), None
    backend = getattr(storage, "_backend", storage)  # optuna wraps an RDBStorage in a _CachedStorage
    grace = getattr(backend, "grace_period", None) or 2 * storage.get_heartbeat_interval()
    return set(storage._get_stale_trial_ids(study._study_id)), grace
