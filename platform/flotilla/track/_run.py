"""One pipeline run = one MLflow run, owned by the driver.

The driver creates (or, for a run name it has seen before, reopens) the MLflow run, logs the
spec, tags and input dataset, and at the end the artifacts, the pyfunc model and the registry
entry. Per-epoch metrics are logged live by the driver too, from a thread of its own (training never
waits on MLflow): Ray Train's controller hands each reported epoch over through the run's storage
(`flotilla._epochs`), so neither it nor the workers ever talk to MLflow. Each epoch is logged once,
with the epoch as its step: after a worker restart or a driver re-run the epochs already in MLflow
are skipped, and the end of the run fills in any epoch that could not be logged live.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pyarrow.fs as pafs
from mlflow import MlflowClient
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException

import flotilla
from flotilla._epochs import read_new
from flotilla.redact import redact
from flotilla.spec import RunSpec, spec_to_yaml
from flotilla.bundle import file_sha256, lineage_tags, load_bundle, weights_file
from flotilla.data import as_category
from flotilla.data._columns import as_numbers
from flotilla.errors import BundleError, NotFiniteError, TrackingError, summarize
from flotilla.metrics import not_finite
from flotilla.track._curves import plot_training_curves
from flotilla.track._gate import GateDecision, check_rules, compare_with_champion, evaluate_bundles
from flotilla.track._registry import (
    CANDIDATE,
    CHAMPION,
    GATE_TAG,
    AliasChange,
    alias_version,
    ensure_registered_model,
    promotion_lock,
    set_alias,
)
from flotilla.track._fetch import load_registered_bundle
from flotilla.track._store import check_tracking_uri, resolve_tracking_uri, retry_lost_insert

PACKAGE_DIR = Path(flotilla.__file__).resolve().parent
PYFUNC_CODE = Path(__file__).resolve().parent / "bundle_pyfunc.py"
RUN_NAME_TAG = "flotilla.run_name"
WEIGHTS_TAG = "flotilla.weights_sha256"  # a version's model.safetensors: one run registers given weights once
# Numbers in an epoch's report that are not per-epoch measurements.
NOT_METRICS = ("epoch", "zero_stage", "world_size", "first_step_at", "ended_at", "sync_every")
# What loading the pyfunc model needs (the bundle, not the training stack).
MODEL_REQUIREMENTS = ("torch", "ray", "safetensors", "numpy", "pandas", "pyarrow", "pydantic", "pyyaml", "mlflow")


@dataclass
class Registration:
    model_name: str
    version: str
    gate: GateDecision
    champion: AliasChange | None  # set when the gate promoted this version

    def describe(self) -> str:
        aliases = f"{CANDIDATE}, {CHAMPION}" if self.champion else CANDIDATE
        return f"registered {self.model_name} v{self.version} ({aliases}); gate {self.gate.summary()}"


def gate_with_scores(client: MlflowClient, name: str, version: str, gate,
                     versus: dict[str, tuple[float, float, bool]] | None = None,
                     champion: str | None = None) -> Registration | None:
    """The gate of a version that was waiting for its harness scores (`flotilla.gate: pending`), decided
    again now that they are among its run's metrics: every rule on the run's final metrics and the
    scores, and with `versus` ({score: (this version's, champion v`champion`'s on the same tasks,
    higher is better)}) no score worse than the champion's beyond `gate.tolerance`; promoted to
    champion when all hold. None when the version was not waiting (its gate passed or failed at
    registration, on rules that the scores do not change)."""
    found = client.get_model_version(name, version)
    if found.tags.get(GATE_TAG) != "pending":
        return None
    # The run's final metrics, and the scores as the version's own tags (a run that registered
    # several versions holds the last one's scores among its metrics).
    metrics = {k: v for k, v in client.get_run(found.run_id).data.metrics.items() if not k.startswith("eval.")}
    for key, value in found.tags.items():
        if key.startswith("eval."):
            with contextlib.suppress(ValueError):
                metrics[key] = float(value)
    decision = check_rules(gate, metrics)
    for score, (ours, theirs, higher) in sorted((versus or {}).items()):
        ok = ours >= theirs - gate.tolerance if higher else ours <= theirs + gate.tolerance
        decision.passed &= ok
        decision.numbers[f"gate.champion_{score}"] = theirs
        decision.checks.append(f"{score} {ours:.4f} vs champion v{champion} {theirs:.4f} on the same tasks "
                               f"({'higher' if higher else 'lower'} is better, tolerance {gate.tolerance:g}) "
                               f"{'ok' if ok else 'FAILED'}")
    with promotion_lock(client, name):
        now = alias_version(client, name, CHAMPION)
        if versus is not None and now != champion and decision.passed:  # promoted elsewhere while the tasks ran
            decision.pending.append(f"the comparison with v{now}")
            decision.checks.append(f"v{now} became champion while this version was compared with v{champion}; it "
                                   f"stays waiting: `flotilla eval` again compares it with v{now}")
            client.set_model_version_tag(name, version, "flotilla.gate.detail", redact(decision.summary())[:5000])
            return Registration(name, version, decision, None)
        client.set_model_version_tag(name, version, GATE_TAG, decision.verdict)
        client.set_model_version_tag(name, version, "flotilla.gate.detail", redact(decision.summary())[:5000])
        for key, value in decision.numbers.items():
            client.set_model_version_tag(name, version, f"flotilla.{key}", str(value)[:5000])
        champion = set_alias(client, name, CHAMPION, version, locked=True) if decision.verdict == "passed" else None
    return Registration(name, version, decision, champion)


class EpochMetricsLogger:
    """Logs each epoch's metrics with step = epoch, from the driver.

    Ray Train's controller hands every reported epoch over through the run's storage
    (`flotilla._epoch_relay.EpochRelay`); `watching` reads them while the run trains. A one-worker trial
    that trains in this process calls `record` instead. Training never waits on MLflow: epochs are
    queued, and a thread of this process sends them (with MLflow's own retries; after they give up,
    again every few seconds). A tracking server that is down for a while delays the metrics, not
    the epochs. Each point carries the time its epoch ended, so the end of the run, which fills in
    whatever is still missing, writes the very points this thread may yet send, and MLflow's store
    keeps one of each."""

    RETRY_S = 5.0
    POLL_S = 1.0

    def __init__(self, uri: str, run_id: str, logged_steps: set[int]):
        self.uri, self.run_id, self.logged_steps = uri, run_id, set(logged_steps)
        self._queue: queue.Queue | None = None
        self._pending = 0  # epochs queued and not yet in MLflow
        self._failing = False  # the sender is retrying an epoch the server did not take
        self._sent = threading.Condition()

    def record(self, metrics: dict[str, Any]) -> None:
        step = int(metrics.get("epoch", 0))
        if step in self.logged_steps:
            return  # re-reported after a resume: the history keeps one point per epoch
        self.logged_steps.add(step)
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._send_forever, name="flotilla-epoch-metrics", daemon=True).start()
        with self._sent:
            self._pending += 1
        self._queue.put((step, epoch_metrics(metrics)))

    @contextlib.contextmanager
    def watching(self, fs: pafs.FileSystem, directory: str):
        """While the block runs, record every epoch that `EpochRelay` writes under `directory` (a
        path on `fs`), looking every POLL_S seconds; once more when it ends."""
        stop, seen = threading.Event(), set()

        def look() -> None:
            try:
                for metrics in read_new(fs, directory, seen):
                    self.record(metrics)
            except Exception as e:  # storage trouble: the end of the run fills the epochs in
                print(f"WARNING: could not read the epochs' metrics under {directory} ({redact(summarize(e, 200))})",
                      flush=True)

        def poll() -> None:
            while not stop.wait(self.POLL_S):
                look()

        watcher = threading.Thread(target=poll, name="flotilla-epoch-watcher", daemon=True)
        watcher.start()
        try:
            yield self
        finally:
            stop.set()
            watcher.join()
            look()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the queued epochs to reach MLflow; whether they all did. A
        server that is away is waited for only until MLflow's own retries give up (False): its
        epochs follow when it is back."""
        with self._sent:
            return self._sent.wait_for(lambda: self._pending == 0 or self._failing, timeout_s) and not self._pending

    def _send_forever(self) -> None:
        client = MlflowClient(self.uri)
        while True:
            step, points = self._queue.get()
            warned = False
            while True:
                try:
                    client.log_batch(self.run_id, metrics=points)
                    break
                except Exception as e:  # the server is away: keep the epoch, try again
                    with self._sent:
                        self._failing = True
                        self._sent.notify_all()
                    if not warned:
                        print(f"WARNING: could not log epoch {step} to MLflow ({redact(summarize(e, 200))}); "
                              f"training goes on, retrying every {self.RETRY_S:.0f}s", flush=True)
                        warned = True
                    time.sleep(self.RETRY_S)
            if warned:
                print(f"MLflow reachable again: epoch {step} logged", flush=True)
            with self._sent:
                self._pending -= 1
                self._failing = False
                self._sent.notify_all()


def epoch_metrics(m: dict[str, Any]) -> list[Metric]:
    """An epoch's points; their timestamp is when the epoch ended (so the same epoch logged twice is
    the same point twice, which MLflow's SQL store keeps once)."""
    when = int(float(m.get("ended_at") or time.time()) * 1000)
    step = int(m.get("epoch", 0))
    return [
        Metric(key, float(value), when, step)
        for key, value in m.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in NOT_METRICS
    ]


class Tracker:
    """The MLflow side of one pipeline run."""

    def __init__(self, spec: RunSpec, run_name: str, tags: dict[str, str] | None = None, run_id: str | None = None):
        """`run_id`: an MLflow run that exists already (a sweep's trial, whose bundle is registered
        after the sweep); else `start` finds the run by name or opens one."""
        self.spec, self.run_name, self.extra_tags = spec, run_name, dict(tags or {})
        self.uri, self.artifact_location = resolve_tracking_uri(spec.track.uri)
        check_tracking_uri(self.uri)  # before Ray or data: a bad URI costs seconds, not a run
        self.client = MlflowClient(self.uri)
        self.experiment_name = spec.track.experiment or spec.name
        self.model_name = spec.track.model_name or spec.name
        self.run_id: str | None = run_id
        self.continued = False
        self.logged_steps: set[int] = set()

    def ran_as(self, spec: RunSpec, tags: dict[str, str]) -> None:
        """The spec as the run chose to run it (`train.num_workers: auto` made a number), and tags that
        say how it chose; logged at `start` in place of the spec as written."""
        self.spec = spec
        self.extra_tags.update(tags)

    # ------------------------------------------------------------------ start
    def start(self, prepared, storage_dir: str) -> None:
        experiment_id = self.experiment_id()
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{self.run_name}'", max_results=2
        )
        if found:
            self.run_id, self.continued = found[0].info.run_id, True
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                experiment_id, run_name=self.run_name, tags={RUN_NAME_TAG: self.run_name, **self.extra_tags}
            )
            self.run_id = run.info.run_id
        self._log_params()
        t = self.spec.train
        tags = {
            "flotilla.storage": storage_dir,
            "flotilla.data_fingerprint": prepared.fingerprint,
            "flotilla.data_source": prepared.source.description,
            "resources.num_workers": t.describe_workers(),  # `1-4` for an elastic run
            "resources.cpus": f"{t.max_workers * t.cpus_per_worker:g}",  # (at most)
            "resources.gpus": f"{t.max_workers * t.gpus_per_worker:g}",
            **self.extra_tags,
            **_versions(),
            **_git(),
        }
        self.client.log_batch(self.run_id, tags=[RunTag(k, redact(v)) for k, v in tags.items()])
        self._log_text(spec_to_yaml(self.spec), "spec.yaml")
        if prepared.profile is not None:  # per feature column: type, gaps, range or values, encoding
            self._log_text(json.dumps(prepared.profile, indent=1), "data_profile.json")
        self._log_input(prepared)
        self.logged_steps = {m.step for m in self.client.get_metric_history(self.run_id, "train_loss")}
        how = f"continued, {len(self.logged_steps)} epochs logged before" if self.continued else "new"
        print(f"[{self.run_name}] MLflow run {self.run_id} ({how}) in experiment {self.experiment_name!r} at "
              f"{redact(self.uri)}", flush=True)

    def epoch_logger(self) -> EpochMetricsLogger:
        return EpochMetricsLogger(self.uri, self.run_id, self.logged_steps)

    # ----------------------------------------------------------------- finish
    def finish(self, outcome, prepared, wall_time_s: float, bundle_dir: Path) -> Registration | None:
        """Fill in the metric history, log artifacts and the model, register and gate it."""
        try:
            history = outcome.history
            logged = {m.step for m in self.client.get_metric_history(self.run_id, "train_loss")}
            missing = [m for m in history if m["epoch"] not in logged]
            for m in missing:
                self.client.log_batch(self.run_id, metrics=epoch_metrics(m))
            final = outcome.metrics
            self.client.log_batch(
                self.run_id,
                metrics=[Metric("wall_time_s", wall_time_s, int(time.time() * 1000), int(final["epoch"]))],
                tags=[RunTag(f"flotilla.{k}", str(final[k])) for k in ("precision", "zero_stage", "backend", "gradient_dtype", "sync_every", "sync_auto") if k in final],
            )
            if outcome.resources is not None:
                self.log_resources(outcome.resources)
            with tempfile.TemporaryDirectory(prefix="flotilla-track-") as tmp:
                curve = plot_training_curves(history, Path(tmp) / "training_curves.png", self.run_name)
                self.client.log_artifact(self.run_id, str(curve))
                if (bundle_dir / "preprocessors.json").is_file():  # (a pretrained model's bundle has its tokenizer)
                    self.client.log_artifact(self.run_id, str(bundle_dir / "preprocessors.json"))
                self._log_events(bundle_dir, Path(tmp))
            broken = not_finite(final)
            if broken:
                error = NotFiniteError(f"run {self.run_name!r} finished with metrics that are not finite numbers "
                                       f"({', '.join(f'{k} {final[k]}' for k in broken)}); not registered")
                self.fail(error)
                raise error
            if self.spec.track.register_model:
                registration = self.register_bundle(bundle_dir, final, outcome.fingerprint, prepared)
            else:
                registration = None
            self.client.set_terminated(self.run_id, "FINISHED")
            return registration
        except MlflowException as e:
            self.fail(e)
            raise TrackingError(f"recording run {self.run_name!r} in MLflow at {self.uri} failed: {e.message}") from None

    def _log_events(self, bundle_dir: Path, tmp: Path) -> None:
        """The run's resizes, restarts and drain notices (the bundle's record): `events.json`, the count
        as `restarts`, and the number of workers over the optimizer steps as `workers`."""
        try:
            record = json.loads((bundle_dir / "metrics.json").read_text())
        except (OSError, ValueError):
            return
        events, segments = record.get("events") or [], record.get("segments") or []
        if not segments:
            return
        points = [(segments[0]["workers"], segments[0]["from"], 0)] + \
                 [(e["to_workers"], e["at"], e["resumed_step"]) for e in events]
        metrics = [Metric("workers", float(n), int(at * 1000), int(step)) for n, at, step in points]
        metrics.append(Metric("restarts", float(len(events)), int(time.time() * 1000), 0))
        self.client.log_batch(self.run_id, metrics=metrics)
        (tmp / "events.json").write_text(json.dumps({"events": events, "segments": segments}, indent=1))
        self.client.log_artifact(self.run_id, str(tmp / "events.json"))

    def fail(self, error: BaseException, resources=None) -> None:
        if self.run_id is None:
            return
        try:
            if resources is not None:
                self.log_resources(resources)
            self.client.set_tag(self.run_id, "flotilla.error", redact(str(error))[:4000])
            self.client.set_terminated(self.run_id, "FAILED")
        except Exception:  # the original error matters more than this one
            pass

    def stopped(self, resources=None) -> None:
        """The run was stopped from outside (a sweep's scheduler ended its trial): KILLED, not FAILED."""
        if self.run_id is None:
            return
        try:
            if resources is not None:
                self.log_resources(resources)
            self.client.set_terminated(self.run_id, "KILLED")
        except Exception:  # the sweep's driver marks it too when the sweep ends
            pass

    def log_resources(self, use) -> None:
        """CPU-hours, GPU-hours, wall time and the estimated cost (a `flotilla.cluster.ResourceUse`)."""
        log_resources(self.client, self.run_id, use)

    # ---------------------------------------------------------------- helpers
    def experiment_id(self) -> str:
        """The id of this run's experiment, created (with the store's artifact location) if new."""
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(self.experiment_name, artifact_location=self.artifact_location)
        except MlflowException:  # created by a concurrent pipeline in the meantime
            return self.client.get_experiment_by_name(self.experiment_name).experiment_id

    def _log_params(self) -> None:
        params = flatten(self.spec.model_dump(mode="json"))
        before = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in before]
        changed = {k: f"{before[k]} -> {v}" for k, v in params.items() if k in before and before[k] != v}
        log_params(self.client, self.run_id, new)
        if changed:  # params are immutable in MLflow; the change is kept as tags
            self.client.log_batch(self.run_id, tags=[RunTag(f"flotilla.changed.{k}", v) for k, v in changed.items()])

    def _log_text(self, text: str, name: str) -> None:
        with tempfile.TemporaryDirectory(prefix="flotilla-track-") as tmp:
            path = Path(tmp) / name
            path.write_text(redact(text))
            self.client.log_artifact(self.run_id, str(path))

    def _log_input(self, prepared) -> None:
        from mlflow.data.meta_dataset import MetaDataset

        dataset = MetaDataset(
            source=_dataset_source(prepared.source),
            name=redact(f"{self.spec.name}:{prepared.source.description}")[:500],
            digest=prepared.fingerprint[:16],  # MLflow keeps 36 characters; the full hash is a run tag
        )
        tags = [InputTag("mlflow.data.context", "training"), InputTag("flotilla.data_fingerprint", prepared.fingerprint)]
        # Two runs of the same data starting together race in MLflow's store: both see no dataset
        # row, both insert it, one fails on the unique key; its retry only links this run to it.
        retry_lost_insert(lambda: self.client.log_inputs(
            self.run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags=tags)]))

    def _log_model(self, bundle_dir: Path, prepared) -> str:
        from mlflow.models import infer_signature


        bundle = load_bundle(bundle_dir, factories=self.spec.allowed_factories())
        own = getattr(self.spec.model, "factory", None)
        if bundle.task == "lm":
            example = pd.DataFrame({"prompt": ["def "]})
            params = {"max_tokens": 16, "temperature": 1.0, "top_k": 0, "seed": 0}
        else:
            # Numeric features as float64, the type the bundle scales them in (MLflow's schema then
            # accepts float32 and int32 columns too: safe widenings); categorical ones as strings.
            example = _example_rows(prepared.val_raw.limit(3).to_pandas(), prepared.schema.feature_columns,
                                    bundle.categorical, bundle.profile or {})
            params = None
        output = bundle.predict_frame(example, params)
        with warnings.catch_warnings():
            # Predicted class indices are integers and never missing: MLflow's hint that integer
            # columns cannot hold missing values does not apply to a model's own output.
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer column")
            signature = infer_signature(example, output, params)
        mlflow.set_tracking_uri(self.uri)
        with mlflow.start_run(run_id=self.run_id):
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=str(PYFUNC_CODE),
                artifacts={"bundle": str(bundle_dir)},
                code_paths=[str(PACKAGE_DIR)],
                signature=signature,
                input_example=(example, params) if params else example,
                pip_requirements=[_pin(p) for p in MODEL_REQUIREMENTS],
                # The pyfunc runs code the registry holds anyway (see bundle_pyfunc); a custom model's
                # may run the factory this run built it with, and only that one (MLflow also logs
                # a model config as the run's params: `allow_factories`, custom models only).
                model_config={"allow_factories": [own]} if own else None,
            )
        return info.model_uri

    def register_bundle(self, bundle_dir: Path, metrics: dict[str, Any], fingerprint: str, prepared) -> Registration:
        """Log the bundle as this run's pyfunc model, register it as `candidate`, and gate it. A run
        registers one version: when an earlier attempt of this run (a driver that died after
        registering, or the same command run again) already did, that version is gated again."""
        weights = file_sha256(weights_file(bundle_dir))
        earlier = self._registered_version(weights) if self.continued else None
        if earlier is not None:
            print(f"[{self.run_name}] already registered as {self.model_name} v{earlier} by an earlier attempt of "
                  "this run (the same weights); not registering another version", flush=True)
            return self._register(None, metrics, fingerprint, prepared, bundle_dir, version=earlier)
        model_uri = self._log_model(bundle_dir, prepared)
        return self._register(model_uri, metrics, fingerprint, prepared, bundle_dir, weights=weights)

    def _registered_version(self, weights: str) -> str | None:
        """The version of this model that this MLflow run registered with these weights, if any (a
        continued run that trained further registers its new weights as a new version)."""
        versions = self.client.search_model_versions(f"name = '{self.model_name}' and run_id = '{self.run_id}'")
        same = [int(v.version) for v in versions if v.tags.get(WEIGHTS_TAG) == weights]
        return str(max(same)) if same else None

    def _register(self, model_uri: str | None, metrics: dict[str, Any], fingerprint: str, prepared, bundle_dir: Path,
                  version: str | None = None, weights: str = "") -> Registration:
        name, gate = self.model_name, self.spec.track.gate
        ensure_registered_model(self.client, name)
        if version is None:
            version = str(self.client.create_model_version(
                name,
                source=model_uri,
                run_id=self.run_id,
                tags={RUN_NAME_TAG: self.run_name, "flotilla.data_fingerprint": fingerprint, WEIGHTS_TAG: weights,
                      **lineage_tags(bundle_dir)},
                model_id=model_uri.removeprefix("models:/"),
            ).version)
        set_alias(self.client, name, CANDIDATE, version)
        decision = check_rules(gate, metrics)
        if gate.beat_champion:
            self._compare_with_champion(decision, prepared, bundle_dir)
        with promotion_lock(self.client, name):  # no other champion change until this one is decided
            now = alias_version(self.client, name, CHAMPION)
            if gate.beat_champion and decision.passed and now != decision.numbers.get("gate.champion_version"):
                # Another gate promoted v{now} while this one compared: compared again, with it.
                decision = check_rules(gate, metrics)
                decision.checks.append(f"v{now} became champion while this run was compared; compared again")
                self._compare_with_champion(decision, prepared, bundle_dir)
            tags = {GATE_TAG: decision.verdict,
                    "flotilla.gate.detail": redact(decision.summary())}
            tags.update({f"flotilla.{k}": str(v) for k, v in decision.numbers.items()})
            for key, value in tags.items():
                self.client.set_model_version_tag(name, version, key, value[:5000])
            champion = set_alias(self.client, name, CHAMPION, version, locked=True) if decision.verdict == "passed" else None
        self.client.set_tag(self.run_id, "flotilla.registered_version", f"{name}/{version}")
        return Registration(name, version, decision, champion)

    def _compare_with_champion(self, decision: GateDecision, prepared, bundle_dir: Path) -> None:

        task = prepared.schema.task
        current = alias_version(self.client, self.model_name, CHAMPION)
        # A custom model's factory runs only if this run's spec names it (model or serve), the champion's too.
        allowed = self.spec.allowed_factories()
        candidate = load_bundle(bundle_dir, factories=allowed)
        bundles = [candidate]
        if current is not None:
            try:
                bundles.append(load_registered_bundle(self.client, self.model_name, current, factories=allowed))
            except Exception as e:
                decision.passed = False
                decision.checks.append(f"champion v{current} could not be loaded to compare: {type(e).__name__}: {e}")
                return
        label = prepared.schema.label_column
        text = prepared.schema.text_column
        # A pretrained model's rows are scored as token windows, this run's (`input_ids`, `labels`):
        # both models must share the tokenizer for their perplexities to be comparable.
        rows_of = prepared.val if prepared.schema.masked else prepared.val_raw
        try:
            values, rows = evaluate_bundles(
                bundles, rows_of.iter_batches(batch_size=256 if prepared.schema.masked else 2048,
                                              batch_format="pandas"), label, text
            )
        except BundleError as e:
            decision.passed = False
            decision.checks.append(f"champion v{current} cannot score this run's validation rows: {e}")
            return
        compare_with_champion(decision, self.spec.track.gate, task, values[0],
                              values[1] if current is not None else None, current, rows)


def log_resources(client: MlflowClient, run_id: str, use) -> None:
    now = int(time.time() * 1000)
    tags = [RunTag("flotilla.cost_currency", use.currency)]
    if use.price_source:
        tags.append(RunTag("flotilla.price_source", use.price_source))
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in use.metrics().items()], tags=tags)


def open_tracker(spec: RunSpec, run_name: str, tags: dict[str, str] | None = None) -> Tracker | None:
    return Tracker(spec, run_name, tags) if spec.track.enabled else None


def log_params(client: MlflowClient, run_id: str, params: list[Param]) -> None:
    for i in range(0, len(params), 100):  # MLflow's batch limit
        client.log_batch(run_id, params=params[i : i + 100])


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"train": {"lr": 0.001}}` -> `{"train.lr": "0.001"}`; lists and nulls as JSON; passwords in
    URIs masked (`flotilla.redact`): the params of a run are readable by everyone who reads the store."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = redact(value if isinstance(value, str) else json.dumps(value))
    return out


def _dataset_source(source):
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    # The dataset input keeps the location as MLflow shows it to everyone who reads the store: its
    # credentials masked (the run reads the data with the real URI).
    location = redact(source.description) if "://" in source.description else \
        str(Path(source.paths[0]).resolve().parent)
    try:
        with warnings.catch_warnings():
            # MLflow registers its local-artifact source class twice, so a local path "can be
            # interpreted in multiple ways" -- both the same class; it picks one, which is right.
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
            return resolve_dataset_source(location)
    except Exception:
        return CodeDatasetSource({"location": location})


def _versions() -> dict[str, str]:
    tags = {"flotilla.version": flotilla.__version__}
    for dist in ("ray", "deepspeed", "torch", "mlflow"):
        try:
            tags[f"{dist}.version"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            tags[f"{dist}.version"] = "not installed"
    return tags


def _git() -> dict[str, str]:
    """The commit of the checkout this code runs from, and whether its tree had changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=PACKAGE_DIR, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # a `ray job submit` working dir has no .git
        return {"mlflow.source.git.commit": "unknown", "flotilla.git_dirty": "unknown"}
    return {"mlflow.source.git.commit": commit, "flotilla.git_dirty": str(dirty).lower()}


def _example_rows(df: pd.DataFrame, columns: list[str], categorical: list[str], profile: dict) -> pd.DataFrame:
    """The model's input example: raw validation rows, numbers as float64, categories as strings (a
    gap in a categorical column shown as the column's most frequent value)."""

    out = pd.DataFrame(index=df.index)
    for c in columns:
        if c in categorical:
            top = (profile.get(c, {}).get("top") or [["missing"]])[0][0]
            out[c] = df[c].map(as_category).fillna(top).astype(object)
        else:
            out[c] = as_numbers(df[c])
    return out.reset_index(drop=True)


def _pin(dist: str) -> str:
    try:
        return f"{dist}=={metadata.version(dist)}"
    except metadata.PackageNotFoundError:
        return dist
