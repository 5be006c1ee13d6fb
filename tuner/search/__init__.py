"""The search: the loop over an Optuna study (loop), one trial's objective and the search's defaults (objective), the
search spaces (space), the sampler (samplers), every use of Optuna's private API (optuna_private), where studies live
(storage), the workers and the trials they leave (workers), the pick's re-measure (confirm) and the answer
(answer)."""
