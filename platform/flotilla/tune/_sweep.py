"""A sweep: Ray Tune trials, each one ordinary Flotilla training run (`flotilla.pipeline.run_training`).

The sweep driver owns a parent MLflow run; each trial's run is its child (tag
`mlflow.parentRunId`). Trials report every epoch to Tune, so ASHA stops them on the same
per-epoch metric MLflow records. A one-worker trial trains in its own process (no Ray Train
worker group to start: seconds saved per trial); a larger one runs a TorchTrainer. A trial's
run name is derived from its Tune trial id, so a restored sweep resumes unfinished trials from
their own checkpoints and continues their MLflow runs instead of opening new ones.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import BasicVariantGenerator

from flotilla.cluster import ResourceUse
from flotilla.data import filesystem_for, resolve_task
from flotilla.errors import summarize
from flotilla.metrics import mode_of, primary_metric
from flotilla.runtime import DATA_CPUS, ensure_ray
from flotilla.spec import RunSpec
from flotilla.track import SWEEP_TAG, TRIAL_TAG, Registration
from flotilla.train import find_bundle, run_resources
from flotilla.tune._space import concurrent_slots, trial_resources, tune_domains
from flotilla.spec import trial_spec


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


def sweep(spec: RunSpec, run_trial: Callable[..., Any], *, shared_data=None, tracking_uri: str | None = None,
          parent_run_id: str | None = None) -> SweepOutcome:
    """Run the sweep's trials with Ray Tune, each one `run_trial(spec, in_trial=True, prepared=...,
    tracking_tags=..., check_storage=False)` (the orchestration layer passes its `run_training`);
    Ray is running, the cluster and the storage were checked. `shared_data` is the data every trial
    trains on when no trial changes what data preparation reads (`space_changes_data`)."""
    started = time.monotonic()
    t = spec.tune
    name = sweep_name(spec)
    metric, mode = metric_and_mode(spec)
    storage = runs_storage(spec)
    slots = t.max_concurrent_trials or concurrent_slots(spec, ray.cluster_resources(), DATA_CPUS)
    trainable = tune.with_resources(
        tune.with_parameters(
            _trial,
            run_trial=run_trial,
            base=spec.model_dump(mode="json"),
            shared_data=shared_data,
            sweep=name,
            runs_storage=f"{storage}/{name}-runs",
            tracking_uri=tracking_uri,
            parent_run_id=parent_run_id,
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
    outcome = SweepOutcome(name, metric, mode, parent_run_id=parent_run_id, tracking_uri=tracking_uri)
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
    return outcome


def sweep_name(spec: RunSpec) -> str:
    return spec.tune.name or f"{spec.name}-sweep"


def runs_storage(spec: RunSpec) -> str:
    """Where the sweep's experiment lives: `train.storage_path` as written (a URI) or made absolute."""
    _, storage_root = filesystem_for(spec.train.storage_path, "train.storage_path")
    return spec.train.storage_path.rstrip("/") if "://" in spec.train.storage_path else storage_root


def best_trial_bundle(spec: RunSpec, outcome: SweepOutcome) -> tuple[RunSpec, Any, str]:
    """The best trial's spec, and its bundle as (filesystem, path)."""
    best = outcome.best
    fs, root = filesystem_for(f"{runs_storage(spec)}/{outcome.name}-runs", "train.storage_path")
    best_spec = trial_spec(spec, best.values, **{"train.run_name": best.run_name})
    return best_spec, fs, find_bundle(fs, root, best.run_name)


def space_changes_data(space: dict[str, Any]) -> bool:
    """Whether a trial's data preparation can differ from the base spec's: it reads the `data`
    section and, for a GPT, the model's kind and context."""
    return any(path.startswith("data.") or path in ("model.kind", "model.context") for path in space)


def _trial(config: dict[str, Any], run_trial: Callable[..., Any], base: dict, shared_data, sweep: str,
           runs_storage: str, tracking_uri: str | None, parent_run_id: str | None) -> None:
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
    run_trial(spec, in_trial=True, prepared=shared_data, tracking_tags=tags, check_storage=False)


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


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if not isinstance(value, str) else value
