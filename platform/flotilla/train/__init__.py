"""Training: Ray Train `TorchTrainer` workers running DeepSpeed ZeRO, from a run spec.

    outcome = fit(spec, run_name, prepared)     # Ray running, data prepared: flotilla.pipeline
    outcome.bundle_path, outcome.metrics, outcome.history

A whole run (tracking, Ray, data, fit, registry, gate, export) is `flotilla.pipeline.run_training`.
"""

from flotilla.train._checkpoint import problems as checkpoint_problems
from flotilla.train._deepspeed_config import deepspeed_config, optimizer_steps
from flotilla.train._layout import Layout, choose_layout
from flotilla.train._loop import BUNDLE_DIR, consolidated_fp32_state_dict, format_epoch, train_loop_per_worker
from flotilla.train._precision import cpu_has_native_bf16, measured_peak_flops, resolve_precision
from flotilla.train._run import (
    RunRecorder,
    TrainingOutcome,
    check_cluster_fits,
    fit,
    find_bundle,
    latest_run,
    local_copy,
    new_run_name,
    run_directory,
    run_resources,
)

__all__ = [
    "BUNDLE_DIR",
    "Layout",
    "RunRecorder",
    "TrainingOutcome",
    "check_cluster_fits",
    "choose_layout",
    "checkpoint_problems",
    "consolidated_fp32_state_dict",
    "cpu_has_native_bf16",
    "deepspeed_config",
    "find_bundle",
    "fit",
    "format_epoch",
    "latest_run",
    "local_copy",
    "measured_peak_flops",
    "new_run_name",
    "run_directory",
    "optimizer_steps",
    "resolve_precision",
    "run_resources",
    "train_loop_per_worker",
]
