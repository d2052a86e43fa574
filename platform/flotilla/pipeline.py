"""The steps of a run and of a sweep, composed in one place.

    outcome = run_training(load_spec("configs/digits.yaml"))
    sweep = run_sweep(load_spec("configs/digits_sweep.yaml"))

A run: open the tracking run (the URI is checked before anything starts), start or join Ray,
check the cluster fits and every node sees the storage, prepare the data, fit (the bundle is
written by the workers), record and register the bundle behind its quality gate, and export its
ONNX variants when `export.after_training` asks. A sweep: the same checks once, the data prepared
once when no trial changes it, Ray Tune's trials (each one `run_training`), and the best trial
registered with the data the sweep prepared. This is the only module that calls `train`, `tune`,
`track` and `export` together; each of them knows nothing of the others' place in a run.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from flotilla.cluster import check_storage_reaches_every_node, local_storage, start_autoscaling_coordinator
from flotilla.bundle import read_bundle_metrics
from flotilla.data import PreparedData, filesystem_for, prepare_data
from flotilla.errors import SpecError
from flotilla.export import export_model
from flotilla.runtime import ensure_ray
from flotilla.spec import RunSpec, pretrained_made_absolute, trial_spec
from flotilla.track import SweepRun, check_tracking_uri, open_tracker, resolve_tracking_uri
from flotilla.train import (TrainingOutcome, check_cluster_fits, choose_layout, fit, local_copy, new_run_name,
                            run_directory)
from flotilla.tune import (SweepOutcome, best_trial_bundle, largest_trial, plot_sweep, space_changes_data, sweep,
                           sweep_name)


def run_training(spec: RunSpec, *, in_trial: bool = False, prepared: PreparedData | None = None,
                 tracking_tags: dict[str, str] | None = None, check_storage: bool = True) -> TrainingOutcome:
    """Preprocess, train, evaluate, bundle and (with `track.enabled`) record and register one run.

    `in_trial=True` inside a Ray Tune trial (every epoch reported to Tune; nothing exported);
    `prepared` is this spec's data, prepared already (a sweep's trials share theirs);
    `tracking_tags` are set on the run's MLflow run (a sweep links trials to its parent run);
    `check_storage=False` skips the check that every node sees the run's storage (a sweep checks once).
    """
    started = time.monotonic()
    spec = pretrained_made_absolute(spec)
    run_name = spec.train.run_name or new_run_name(spec)
    tracker = open_tracker(spec, run_name, tracking_tags)  # checks the tracking URI before Ray starts
    ensure_ray(spec)
    if spec.train.elastic and not in_trial:  # before Ray Data starts Ray's own (see the function)
        start_autoscaling_coordinator()
    if not spec.train.auto_layout:  # (else once the layout is chosen, which needs the data)
        check_cluster_fits(spec)
    if check_storage:
        for note in check_storage_reaches_every_node(local_storage(spec.train.storage_path,
                                                                     tracker.uri if tracker else None)):
            print(f"[{run_name}] {note}", flush=True)
    prepared = prepared or prepare_data(spec)
    if spec.train.auto_layout:
        spec, layout = choose_layout(spec, prepared, run_directory(spec, run_name), label=run_name)
        check_cluster_fits(spec)
        if tracker is not None:
            tracker.ran_as(spec, layout.tags())
    outcome = fit(spec, run_name, prepared, recorder=tracker, in_trial=in_trial)
    if tracker is None:
        return outcome
    outcome.mlflow_run_id, outcome.tracking_uri = tracker.run_id, tracker.uri
    fs, bundle_path = filesystem_for(outcome.bundle_path, "train.storage_path")
    with local_copy(fs, bundle_path) as local_bundle:
        outcome.registration = tracker.finish(outcome, prepared, time.monotonic() - started, local_bundle)
    if spec.export.after_training and outcome.registration is not None and not in_trial:
        r = outcome.registration
        outcome.exported = export_model(f"{r.model_name}/{r.version}", tracking_uri=tracker.uri, spec=spec,
                                        prepared=prepared)
    return outcome


def run_sweep(spec: RunSpec) -> SweepOutcome:
    """Sweep `spec.tune`'s space with Ray Tune, every trial an ordinary tracked run; with
    `track.register_model`, the best trial's bundle is registered and gated."""
    if spec.tune is None:
        raise SpecError(["the spec has no `tune` section; a sweep needs one (see `flotilla config`, section tune)"])
    spec = pretrained_made_absolute(spec)
    name = sweep_name(spec)
    uri = None
    if spec.track.enabled:
        uri, _ = resolve_tracking_uri(spec.track.uri)  # absolute: trials run in other directories
        check_tracking_uri(uri)
    ensure_ray(largest_trial(spec))
    check_cluster_fits(largest_trial(spec))  # a trial that can never be placed is refused now
    for note in check_storage_reaches_every_node(local_storage(spec.train.storage_path, uri)):  # once, not per trial
        print(f"[{name}] {note}", flush=True)
    parent = SweepRun(spec, name, uri) if uri else None
    # When no trial changes what data preparation reads, the data is read, split and fitted once,
    # here, and every trial trains on the same materialized datasets (seconds saved per trial).
    shared = None if space_changes_data(spec.tune.space) else prepare_data(trial_spec(spec, {}))
    outcome = sweep(spec, run_training, shared_data=shared, tracking_uri=uri,
                    parent_run_id=parent.run_id if parent else None)
    if parent is None:
        return outcome
    with tempfile.TemporaryDirectory(prefix="flotilla-sweep-") as tmp:
        table = Path(tmp) / "trials.txt"
        table.write_text(outcome.table() + "\n")
        parent.finish(outcome, spec, [table, plot_sweep(outcome, Path(tmp) / "sweep.png")])
    if outcome.best is not None and spec.track.register_model:
        best_spec, fs, bundle = best_trial_bundle(spec, outcome)
        # The input example and the champion comparison use the best trial's data: the sweep's own
        # when its trials shared it; prepared here only when the space changed what it reads.
        prepared = shared or prepare_data(best_spec)
        final = read_bundle_metrics(fs, bundle)["final"]
        with local_copy(fs, bundle) as bundle_dir:
            outcome.registration = parent.register_best(best_spec, outcome.best.trial_id, bundle_dir, final,
                                                        prepared.fingerprint, prepared)
    return outcome
