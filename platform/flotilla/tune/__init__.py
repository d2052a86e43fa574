"""Sweeps with Ray Tune over the one training function.

    outcome = run_sweep(load_spec("configs/digits_sweep.yaml"))   # spec with a `tune` section
    print(outcome.table()); outcome.best; outcome.registration
"""

from flotilla.tune._space import concurrent_slots, largest_trial, trial_resources, trial_spec, tune_domains
from flotilla.tune._sweep import SweepOutcome, TrialRow, metric_and_mode, run_sweep

__all__ = [
    "SweepOutcome",
    "TrialRow",
    "concurrent_slots",
    "largest_trial",
    "metric_and_mode",
    "run_sweep",
    "trial_resources",
    "trial_spec",
    "tune_domains",
]
