"""Tracking with MLflow: one pipeline run = one MLflow run; bundles become registered models.

    tracker = open_tracker(spec, run_name)      # checks the tracking URI before anything runs
    tracker.start(prepared, run_dir)            # params, tags, spec, input dataset
    with tracker.epoch_logger().watching(fs, run_dir + "/epoch_metrics"): trainer.fit()   # per-epoch metrics
    registration = tracker.finish(outcome, prepared, wall_time_s)   # curves, model, registry, gate

    set_alias(client, "digits", "champion", "3"); rollback_champion(client, "digits")
"""

from flotilla.track._gate import BundleEvaluator, GateDecision, check_rules, evaluate_bundles
from flotilla.track._reference import ModelReference, parse_model_reference
from flotilla.track._registry import (
    CANDIDATE,
    CHAMPION,
    GATE_TAG,
    AliasChange,
    alias_version,
    champion_history,
    promotion_lock,
    resolve_reference,
    rollback_champion,
    set_alias,
)
from flotilla.track._fetch import (LocalBundle, bundle_in_model, download_model, load_registered_bundle, local_bundle,
                                   model_file, registered_bundle_file, registered_variants)
from flotilla.track._run import (
    EpochMetricsLogger,
    Registration,
    Tracker,
    flatten,
    gate_with_scores,
    log_params,
    log_resources,
    open_tracker,
)
from flotilla.track._store import check_tracking_uri, registry_client, resolve_tracking_uri
from flotilla.track._sweep_run import STOP_TAG, SWEEP_TAG, TRIAL_TAG, SweepRun

__all__ = [
    "CANDIDATE",
    "CHAMPION",
    "GATE_TAG",
    "AliasChange",
    "BundleEvaluator",
    "EpochMetricsLogger",
    "GateDecision",
    "LocalBundle",
    "ModelReference",
    "Registration",
    "STOP_TAG",
    "SWEEP_TAG",
    "SweepRun",
    "TRIAL_TAG",
    "Tracker",
    "alias_version",
    "champion_history",
    "promotion_lock",
    "check_rules",
    "check_tracking_uri",
    "evaluate_bundles",
    "flatten",
    "gate_with_scores",
    "bundle_in_model",
    "download_model",
    "load_registered_bundle",
    "local_bundle",
    "model_file",
    "registered_bundle_file",
    "registered_variants",
    "resolve_reference",
    "log_params",
    "log_resources",
    "open_tracker",
    "parse_model_reference",
    "registry_client",
    "resolve_tracking_uri",
    "rollback_champion",
    "set_alias",
]
