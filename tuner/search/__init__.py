"""The search: the loop over an Optuna study (loop), one trial's objective, the search spaces, the pick's
re-measure (confirm) and the answer (answer)."""
