"""A sweep: Ray Tune trials, each one ordinary Flotilla training run (`run_training`).

The sweep driver owns a parent MLflow run; each trial's run is its child (tag
`mlflow.parentRunId`). Trials report every epoch to Tune, so ASHA stops them on the same
per-epoch metric MLflow records. A one-worker trial trains in its own process (no Ray Train
worker group to start: seconds saved per trial); a larger one runs a TorchTrainer. A trial's
run name is derived from its Tune trial id, so a restored sweep resumes unfinished trials from
their own checkpoints and continues their MLflow runs instead of opening new ones.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from mlflow import MlflowClient
from mlflow.entities import Param, RunTag
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import BasicVariantGenerator

from flotilla.cluster import ResourceUse, check_storage_reaches_every_node, local_storage
from flotilla.spec import RunSpec, spec_to_yaml
from flotilla.data import filesystem_for, prepare_data, resolve_task
from flotilla.metrics import mode_of, primary_metric
from flotilla.errors import SpecError, summarize
from flotilla.track import (
    Registration,
    Tracker,
    check_tracking_uri,
    flatten,
    log_params,
    log_resources,
    resolve_tracking_uri,
)
from flotilla.runtime import DATA_CPUS, ensure_ray
from flotilla.bundle import read_bundle_metrics
from flotilla.train import check_cluster_fits, find_bundle, local_copy, run_resources, run_training
from flotilla.tune._plot import plot_sweep
from flotilla.tune._space import concurrent_slots, largest_trial, trial_resources, trial_spec, tune_domains

SWEEP_TAG, TRIAL_TAG, STOP_TAG = "flotilla.sweep", "flotilla.trial_id", "flotilla.stop_reason"


@dataclass
class TrialRow:
    trial_id: str
    run_name: str
    values: dict[str, Any]
    metric: float | None
    epochs: int
    status: str  # completed | early-stopped | errored
    error: str = ""


@dataclass
class SweepOutcome:
    name: str
    metric: str
    mode: str
    trials: list[TrialRow] = field(default_factory=list)
    best: TrialRow | None = None
    parent_run_id: str | None = None
    registration: Registration | None = None
    tracking_uri: str | None = None
    # CPU/GPU-hours of all trials (each trial's reservation x its time), over the sweep's wall time.
    resources: ResourceUse | None = None

    def table(self) -> str:
        paths = sorted({p for row in self.trials for p in row.values})
        header = ["trial", *paths, self.metric, "epochs", "status"]
        rows = [
            [row.run_name, *(_short(row.values.get(p)) for p in paths),
             f"{row.metric:.4f}" if row.metric is not None else "-", str(row.epochs), row.status]
            for row in self.trials
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        return "\n".join([line(header), *(line(r) for r in rows)])


def metric_and_mode(spec: RunSpec) -> tuple[str, str]:
    """What the sweep optimizes: `tune.metric`/`tune.mode`, else the task's primary metric (the one
    the gate ranks versions by), the task resolved as training will resolve it."""
    t = spec.tune
    metric = t.metric or primary_metric(resolve_task(spec)).name
    return metric, t.mode or mode_of(metric)


def run_sweep(spec: RunSpec) -> SweepOutcome:
    if spec.tune is None:
        raise SpecError(["the spec has no `tune` section; a sweep needs one (see `flotilla config`, section tune)"])
    started = time.monotonic()
    t = spec.tune
    name = t.name or f"{spec.name}-sweep"
    metric, mode = metric_and_mode(spec)
    _, storage_root = filesystem_for(spec.train.storage_path, "train.storage_path")
    storage = spec.train.storage_path.rstrip("/") if "://" in spec.train.storage_path else storage_root
    uri = None
    if spec.track.enabled:
        uri, _ = resolve_tracking_uri(spec.track.uri)  # absolute: trials run in other directories
        check_tracking_uri(uri)
    ensure_ray(largest_trial(spec))
    check_cluster_fits(largest_trial(spec))  # a trial that can never be placed is refused now
    check_storage_reaches_every_node(local_storage(spec.train.storage_path, uri))  # once here, not per trial
    slots = t.max_concurrent_trials or concurrent_slots(spec, ray.cluster_resources(), DATA_CPUS)

    parent = _ParentRun(spec, name, uri) if uri else None
    # When no trial changes what data preparation reads, the data is read, split and fitted once,
    # here, and every trial trains on the same materialized datasets (seconds saved per trial).
    shared = None if _space_changes_data(t.space) else prepare_data(trial_spec(spec, {}))
    trainable = tune.with_resources(
        tune.with_parameters(
            _trial,
            base=spec.model_dump(mode="json"),
            shared_data=shared,
            sweep=name,
            runs_storage=f"{storage}/{name}-runs",
            tracking_uri=uri,
            parent_run_id=parent.run_id if parent else None,
        ),
        lambda config: trial_resources(trial_spec(spec, config["space"])),
    )
    experiment = f"{storage}/{name}"
    if tune.Tuner.can_restore(experiment):
        print(f"[{name}] resuming the sweep in {experiment}", flush=True)
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={"space": tune_domains(t)},
            tune_config=tune.TuneConfig(
                metric=metric,
                mode=mode,
                search_alg=_searcher(t, metric, mode, slots),
                scheduler=_scheduler(spec),
                num_samples=t.num_samples,
                max_concurrent_trials=slots,
                time_budget_s=t.time_budget_s,
                trial_dirname_creator=_trial_dirname,
                # A finished trial's process (its imports, its torch.distributed group) runs the next
                # trial that asks for the same resources: no process start-up per trial.
                reuse_actors=True,
            ),
            run_config=tune.RunConfig(
                name=name,
                storage_path=storage,
                failure_config=tune.FailureConfig(max_failures=t.trial_max_failures),
                verbose=1,
            ),
        )
    results = tuner.fit()
    outcome = SweepOutcome(name, metric, mode, parent_run_id=parent.run_id if parent else None, tracking_uri=uri)
    total = None
    for result in results:
        row = _row(result, spec, name, metric)
        outcome.trials.append(row)
        held = float((result.metrics or {}).get("time_total_s") or 0.0)  # Tune's time of the trial
        use = run_resources(trial_spec(spec, row.values), held)
        total = use if total is None else total + use
    if total is not None:
        total.wall_time_s = time.monotonic() - started
        outcome.resources = total
        print(f"[{name}] {total.describe()}", flush=True)
    outcome.trials.sort(key=lambda r: r.run_name)
    done = [r for r in outcome.trials if r.status == "completed" and r.metric is not None]
    if done:
        outcome.best = (max if mode == "max" else min)(done, key=lambda r: r.metric)
    if parent:
        parent.finish(outcome, spec, f"{storage}/{name}-runs")
    return outcome


def _space_changes_data(space: dict[str, Any]) -> bool:
    """Whether a trial's data preparation can differ from the base spec's: it reads the `data`
    section and, for a GPT, the model's kind and context."""
    return any(path.startswith("data.") or path in ("model.kind", "model.context") for path in space)


def _trial(config: dict[str, Any], base: dict, shared_data, sweep: str, runs_storage: str, tracking_uri: str | None,
           parent_run_id: str | None) -> None:
    """One trial: the ordinary training run, reporting to Tune, with a child MLflow run."""
    ensure_ray()  # connected already; quiets Ray Data's progress output in this process too
    trial_id = tune.get_context().get_trial_id()
    fixed = {"train.run_name": f"{sweep}-{trial_id}", "train.storage_path": runs_storage, "track.register_model": False}
    if tracking_uri:
        fixed["track.uri"] = tracking_uri
    spec = trial_spec(RunSpec.model_validate(base), config["space"], **fixed)
    tags = {SWEEP_TAG: sweep, TRIAL_TAG: trial_id}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run_training(spec, in_trial=True, prepared=shared_data, tracking_tags=tags, check_storage=False)


def _searcher(t, metric: str, mode: str, slots: int):
    if t.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(metric=metric, mode=mode, seed=t.seed)  # Tune limits it to `slots`
    # Tune ignores max_concurrent_trials for a SearchAlgorithm passed in; it is set here instead.
    return BasicVariantGenerator(random_state=t.seed, max_concurrent=slots)


def _scheduler(spec: RunSpec):
    t = spec.tune
    if t.scheduler == "fifo":
        return FIFOScheduler()
    # The time axis is the epoch a trial reports (not Tune's iteration count), so a trial that
    # resumes from a checkpoint after a restore sits on the same rung it left.
    # max_t is one past the last epoch: ASHA stops a trial that reaches max_t, which would cut
    # a finishing trial off between its last report and writing its bundle and MLflow records.
    return ASHAScheduler(time_attr="epoch", max_t=spec.train.epochs + 1, grace_period=t.grace_period,
                         reduction_factor=t.reduction_factor)


def _row(result, spec: RunSpec, sweep: str, metric: str) -> TrialRow:
    config = result.config or {}
    values = config.get("space", {})
    trial_id = _trial_id(result)
    m = result.metrics or {}
    epochs_wanted = int(values.get("train.epochs", spec.train.epochs))
    epochs = int(m.get("epoch", 0) or 0)
    if result.error is not None:
        status = "errored"
    elif epochs >= epochs_wanted:
        status = "completed"
    else:
        status = "early-stopped"
    value = m.get(metric)
    return TrialRow(trial_id, f"{sweep}-{trial_id}", values, float(value) if value is not None else None, epochs, status,
                    summarize(result.error, 300) if result.error is not None else "")


def _trial_dirname(trial) -> str:
    return trial.trial_id  # so a result's directory names its trial, reported or not


def _trial_id(result) -> str:
    return (result.metrics or {}).get("trial_id") or Path(result.path).name


class _ParentRun:
    """The sweep's own MLflow run: found again by name when the sweep is resumed."""

    def __init__(self, spec: RunSpec, name: str, uri: str):
        self.client = MlflowClient(uri)
        self.uri, self.name = uri, name
        tracker = Tracker(spec.model_copy(update={"tune": None}), name)
        experiment_id = tracker.experiment_id()
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{name}' and tags.`flotilla.role` = 'sweep'",
            max_results=1,
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=name, tags={SWEEP_TAG: name, "flotilla.role": "sweep"})
            self.run_id = run.info.run_id
            params = flatten(spec.model_dump(mode="json"))
            log_params(self.client, self.run_id, [Param(k, v) for k, v in params.items()])
            with tempfile.TemporaryDirectory(prefix="flotilla-sweep-") as tmp:
                path = Path(tmp) / "sweep.yaml"
                path.write_text(spec_to_yaml(spec))
                self.client.log_artifact(self.run_id, str(path))
        print(f"[{name}] MLflow parent run {self.run_id} at {uri}", flush=True)

    def finish(self, outcome: SweepOutcome, spec: RunSpec, runs_storage: str) -> None:
        experiment_id = self.client.get_run(self.run_id).info.experiment_id
        children = {
            r.data.tags.get(TRIAL_TAG): r
            for r in self.client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{self.run_id}'")
        }
        for row in outcome.trials:
            child = children.get(row.trial_id)
            if child is None:  # it failed before its training run opened one
                child = self._child_for_failed_trial(experiment_id, row, spec)
            self.client.set_tag(child.info.run_id, STOP_TAG, row.status + (f": {row.error}" if row.error else ""))
            status = {"completed": "FINISHED", "early-stopped": "KILLED", "errored": "FAILED"}[row.status]
            if child.info.status != status:
                self.client.set_terminated(child.info.run_id, status)
        if outcome.resources is not None:
            log_resources(self.client, self.run_id, outcome.resources)
        counts = {s: sum(r.status == s for r in outcome.trials) for s in ("completed", "early-stopped", "errored")}
        tags = [RunTag(f"flotilla.trials_{k.replace('-', '_')}", str(v)) for k, v in counts.items()]
        with tempfile.TemporaryDirectory(prefix="flotilla-sweep-") as tmp:
            (Path(tmp) / "trials.txt").write_text(outcome.table() + "\n")
            self.client.log_artifact(self.run_id, str(Path(tmp) / "trials.txt"))
            plot = plot_sweep(outcome, Path(tmp) / "sweep.png")
            self.client.log_artifact(self.run_id, str(plot))
        if outcome.best is not None:
            best = outcome.best
            tags += [RunTag("flotilla.best_trial", best.run_name), RunTag("flotilla.best_metric", str(best.metric))]
            self.client.log_batch(self.run_id, tags=tags)
            self.client.log_metric(self.run_id, f"best_{outcome.metric}", best.metric)
            if spec.track.register_model:
                outcome.registration = self._register_best(outcome, spec, runs_storage, children.get(best.trial_id))
        else:
            self.client.log_batch(self.run_id, tags=tags)
        self.client.set_terminated(self.run_id, "FINISHED")

    def _child_for_failed_trial(self, experiment_id: str, row: TrialRow, spec: RunSpec):
        tags = {"flotilla.run_name": row.run_name, SWEEP_TAG: self.name, TRIAL_TAG: row.trial_id,
                "mlflow.parentRunId": self.run_id}
        child = self.client.create_run(experiment_id, run_name=row.run_name, tags=tags)
        params = flatten(trial_spec(spec, row.values).model_dump(mode="json"))
        log_params(self.client, child.info.run_id, [Param(k, v) for k, v in params.items()])
        return self.client.get_run(child.info.run_id)

    def _register_best(self, outcome: SweepOutcome, spec: RunSpec, runs_storage: str, child) -> Registration | None:
        if child is None:
            return None
        best = outcome.best
        best_spec = trial_spec(spec, best.values, **{"train.run_name": best.run_name, "track.uri": self.uri})
        fs, root = filesystem_for(runs_storage, "train.storage_path")
        prepared = prepare_data(best_spec)  # for the input example and the champion comparison
        tracker = Tracker(best_spec, best.run_name)
        tracker.run_id = child.info.run_id
        bundle = find_bundle(fs, root, best.run_name)
        metrics = read_bundle_metrics(fs, bundle)
        with local_copy(fs, bundle) as bundle_dir:
            registration = tracker.register_bundle(bundle_dir, metrics["final"], prepared.fingerprint, prepared)
        self.client.set_tag(self.run_id, "flotilla.registered_version", f"{registration.model_name}/{registration.version}")
        return registration


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if not isinstance(value, str) else value
