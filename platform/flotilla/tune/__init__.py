"""Sweeps with Ray Tune over the one training function.

    outcome = sweep(spec, run_trial)     # Ray running, cluster checked: flotilla.pipeline.run_sweep
    print(outcome.table()); outcome.best
"""

from flotilla.spec import trial_spec
from flotilla.tune._plot import plot_sweep
from flotilla.tune._space import concurrent_slots, largest_trial, trial_resources, tune_domains
from flotilla.tune._sweep import (SweepOutcome, TrialRow, best_trial_bundle, metric_and_mode, runs_storage,
                                  space_changes_data, sweep, sweep_name)

__all__ = [
    "SweepOutcome",
    "TrialRow",
    "concurrent_slots",
    "largest_trial",
    "metric_and_mode",
    "best_trial_bundle",
    "plot_sweep",
    "runs_storage",
    "space_changes_data",
    "sweep",
    "sweep_name",
    "trial_resources",
    "trial_spec",
    "tune_domains",
]
