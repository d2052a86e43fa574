"""A sweep's own MLflow run: the parent of its trials' runs (tag `mlflow.parentRunId`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Param, RunTag

from flotilla.redact import redact
from flotilla.spec import RunSpec, spec_to_yaml, trial_spec
from flotilla.track._run import Registration, Tracker, flatten, log_params, log_resources

SWEEP_TAG, TRIAL_TAG, STOP_TAG = "flotilla.sweep", "flotilla.trial_id", "flotilla.stop_reason"


class SweepRun:
    """The sweep's own MLflow run, parent of its trials' runs: found again by name when the sweep is
    resumed. `finish` records how each trial ended and the sweep's table and plot;
    `register_best` registers the best trial's bundle."""

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

    def finish(self, outcome, spec: RunSpec, artifacts: list[Path]) -> None:
        """Record the ended sweep (`flotilla.tune.SweepOutcome`): each trial's status on its child
        run, the resources, the counts, the best trial, and `artifacts` (its table, its plot)."""
        experiment_id = self.client.get_run(self.run_id).info.experiment_id
        children = {
            r.data.tags.get(TRIAL_TAG): r
            for r in self.client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{self.run_id}'")
        }
        for row in outcome.trials:
            child = children.get(row.trial_id)
            if child is None:  # it failed before its training run opened one
                child = self._child_for_failed_trial(experiment_id, row, spec)
            self.client.set_tag(child.info.run_id, STOP_TAG, redact(row.status + (f": {row.error}" if row.error else "")))
            status = {"completed": "FINISHED", "early-stopped": "KILLED", "errored": "FAILED"}[row.status]
            if child.info.status != status:
                self.client.set_terminated(child.info.run_id, status)
        if outcome.resources is not None:
            log_resources(self.client, self.run_id, outcome.resources)
        counts = {s: sum(r.status == s for r in outcome.trials) for s in ("completed", "early-stopped", "errored")}
        tags = [RunTag(f"flotilla.trials_{k.replace('-', '_')}", str(v)) for k, v in counts.items()]
        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        if outcome.best is not None:
            best = outcome.best
            tags += [RunTag("flotilla.best_trial", best.run_name), RunTag("flotilla.best_metric", str(best.metric))]
            self.client.log_batch(self.run_id, tags=tags)
            self.client.log_metric(self.run_id, f"best_{outcome.metric}", best.metric)
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

    def register_best(self, best_spec: RunSpec, trial_id: str, bundle_dir: Path, final: dict[str, Any],
                      fingerprint: str, prepared) -> Registration | None:
        """Register the best trial's bundle (in local `bundle_dir`) from its own child run, gated as
        any run's; `prepared` is its data, prepared already (the sweep's shared data)."""
        experiment_id = self.client.get_run(self.run_id).info.experiment_id
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{self.run_id}' and tags.`{TRIAL_TAG}` = '{trial_id}'",
            max_results=1)
        if not found:
            return None
        tracker = Tracker(best_spec.model_copy(update={"track": best_spec.track.model_copy(update={"uri": self.uri})}),
                          best_spec.train.run_name, run_id=found[0].info.run_id)
        registration = tracker.register_bundle(bundle_dir, final, fingerprint, prepared)
        self.client.set_tag(self.run_id, "flotilla.registered_version", f"{registration.model_name}/{registration.version}")
        return registration
