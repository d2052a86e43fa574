"""The driver side of training: check the cluster fits, fit (Ray Train workers, or in a Tune trial's
process), and bring the bundle to its place in the run. Tracking and export are composed around
it by `flotilla.pipeline`."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow.fs as pafs
import ray
import torch
import ray.train
from ray import tune
from ray.data.dataset import MaterializedDataset
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from flotilla._epoch_relay import EpochRelay
from flotilla._epochs import EPOCHS_DIR
from flotilla.bundle import BUNDLE_COPYING, read_bundle_metrics
from flotilla.cluster import (
    AUTOSCALING_COORDINATOR,
    ResourceUse,
    prices_for,
    resource_use,
    start_autoscaling_coordinator,
    usable_nodes,
    wait_for_room,
)
from flotilla.data import PreparedData, describe_columns, filesystem_for
from flotilla.errors import ClusterError, FlotillaError, NotFiniteError, TrainingError, summarize
from flotilla.models import build_model
from flotilla.runtime import DATA_CPUS, environment, started_local_ray
from flotilla.spec import RunSpec, spec_to_yaml
from flotilla.train._in_trial import InProcess, train_in_trial
from flotilla.train._loop import BUNDLE_DIR, CHECKPOINT_PREFIX, train_loop_per_worker
from flotilla.train._worker_config import WorkerConfig


@dataclass
class TrainingOutcome:
    run_name: str
    run_dir: str  # storage_path/run_name (a local path or a URI)
    task: str  # classification | regression | lm (see flotilla.metrics)
    bundle_path: str
    metrics: dict[str, Any]  # the last epoch's
    history: list[dict[str, Any]] = field(default_factory=list)
    fingerprint: str = ""
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    registration: Any = None  # flotilla.track.Registration when the bundle was registered (flotilla.pipeline)
    resources: ResourceUse | None = None  # what the workers held while training, and its cost
    exported: Any = None  # flotilla.export.ExportOutcome with `export.after_training` (flotilla.pipeline)


def check_cluster_fits(spec: RunSpec) -> None:
    """Fail fast when the workers can never be placed, instead of pending forever.

    On a running cluster a shortfall first goes to its autoscaler, which has
    `train.scale_up_timeout_s` to add the nodes (see `flotilla.cluster.wait_for_room`). An elastic
    run (`train.num_workers: [min, max]`) needs room for `min` workers: it starts with what fits and
    Ray Train asks the autoscaler for `max`.
    """
    t = spec.train
    n = t.min_workers
    worker = {"CPU": t.cpus_per_worker, "GPU": t.gpus_per_worker}
    need = {"CPU": n * t.cpus_per_worker + DATA_CPUS, "GPU": n * t.gpus_per_worker}
    missing, why = wait_for_room(need, [worker] * n + [{"CPU": DATA_CPUS}],
                            timeout_s=t.scale_up_timeout_s, may_wait=not started_local_ray(),
                            label=t.run_name or spec.name)
    problems = []
    workers = f"train.num_workers={n}" if not t.elastic else \
        f"train.num_workers=[{t.min_workers}, {t.max_workers}] (at least {n})"
    for resource, (amount, have) in missing.items():
        per = "cpus_per_worker" if resource == "CPU" else "gpus_per_worker"
        data_note = f" plus {DATA_CPUS} for Ray Data's input pipeline" if resource == "CPU" else ""
        problems.append(
            f"{workers} x train.{per}={getattr(t, per):g} needs "
            f"{amount - (DATA_CPUS if resource == 'CPU' else 0):g} {resource}s{data_note}, but the cluster has "
            f"{have:g} in all; lower train.num_workers or train.{per}, or add nodes"
        )
    if problems:
        if why:
            problems.append(why)
        raise ClusterError("the cluster cannot hold this run:\n  - " + "\n  - ".join(problems))


class RunRecorder(Protocol):
    """What records a run while it trains (the orchestration layer passes MLflow's: `flotilla.track.Tracker`)."""

    def start(self, prepared: PreparedData, run_dir: str) -> None: ...

    def epoch_logger(self) -> Any: ...

    def fail(self, error: BaseException, use: ResourceUse) -> None: ...

    def stopped(self, use: ResourceUse) -> None: ...


def fit(spec: RunSpec, run_name: str, prepared: PreparedData, *, recorder: RunRecorder | None = None,
        in_trial: bool = False) -> TrainingOutcome:
    """Train run `run_name` of `spec` on `prepared` data and write its bundle under `train.storage_path`.

    Ray is running and the cluster was checked (`flotilla.pipeline.run_training` composes those
    steps). `recorder` hears of the run's start, its epochs and how it ended. `in_trial=True`
    inside a Ray Tune trial: every epoch is reported to Tune too, and a one-worker run trains in
    the trial's own process (`flotilla.train._in_trial`) instead of starting a worker group.
    """
    t = spec.train
    fs, storage_root = filesystem_for(t.storage_path, "train.storage_path")
    # What Ray Train gets: the URI as written, or the local path made absolute.
    storage = t.storage_path.rstrip("/") if "://" in t.storage_path else storage_root
    print(
        f"[{run_name}] data {prepared.source.description!r}: {prepared.train_rows} train / {prepared.val_rows} val "
        f"rows, fingerprint {prepared.fingerprint[:12]}",
        flush=True,
    )
    if prepared.profile:
        print(f"[{run_name}] columns: {describe_columns(prepared.profile)}", flush=True)
    # Build the model once here, on the meta device (no memory, no compute): a broken factory
    # fails now with its own message instead of on every worker after each restart.
    with torch.device("meta"):
        build_model(spec.model.model_dump(mode="json"), prepared.schema)
    # (A sweep's trial always trains: Tune learns its metrics from the epochs it reports.)
    finished = None if in_trial else _finished_bundle(fs, storage_root, run_name, t.epochs, prepared.fingerprint)
    _write_run_record(fs, storage_root, run_name, spec, prepared.fingerprint)
    if recorder is not None:
        recorder.start(prepared, f"{storage}/{run_name}")
    if finished is not None:
        # The same command again after the run finished (a driver that died while registering, a
        # script run twice): its bundle holds every epoch of this data, so no worker group starts.
        print(f"[{run_name}] finished already: its bundle holds all {t.epochs} epochs of this data; "
              "nothing to train", flush=True)
        return _outcome(storage, run_name, prepared, finished, None)
    config = WorkerConfig(
        spec=spec, data=prepared.schema, preprocessors=prepared.preprocessors, fingerprint=prepared.fingerprint,
        train_rows=prepared.train_rows, run_name=run_name,
        # Splits in the object store go whole to every rank: no streaming split and its coordinator
        # (one more Ray actor process a run, ~3 CPU-seconds), no Ray Data task an epoch (an elastic
        # run's workers may take every CPU of their nodes), and one order of batches at any number of
        # workers (an epoch resumes at its batch). Splits too big to cache stream in shards.
        whole_splits=isinstance(prepared.train, MaterializedDataset) and isinstance(prepared.val, MaterializedDataset),
        within_epoch=not in_trial,
    )
    epoch_logger = recorder.epoch_logger() if recorder is not None else None
    fit_started = time.monotonic()
    try:
        if in_trial and t.num_workers == 1:
            checkpoint = _fit_here(config, prepared, fs, f"{storage_root}/{run_name}", epoch_logger)
        else:
            # The controller hands each epoch to this process, which logs it as it comes.
            epochs_dir = f"{storage_root}/{run_name}/{EPOCHS_DIR}"
            callbacks = ([EpochRelay(fs, epochs_dir)] if epoch_logger else []) + \
                        ([TuneReportCallback()] if in_trial else [])
            watching = epoch_logger.watching(fs, epochs_dir) if epoch_logger else contextlib.nullcontext()
            with watching:
                checkpoint = _fit_with_ray_train(config, prepared, storage, callbacks)
    except BaseException as e:  # KeyboardInterrupt too: the recorder says the run did not finish
        use = run_resources(spec, time.monotonic() - fit_started)
        if in_trial and isinstance(e, SystemExit) and not e.code:
            # Tune stopped this trial (ASHA): its `report` ends the trial's training thread with
            # SystemExit(0). The recorder says KILLED, as the sweep's driver records it.
            print(f"[{run_name}] stopped by the sweep's scheduler; {use.describe()}", flush=True)
            if recorder is not None:
                recorder.stopped(use)
            raise
        error = _explain(e) if isinstance(e, ray.train.TrainingFailedError) else e
        if isinstance(error, Exception) and not isinstance(error, FlotillaError):
            error = TrainingError(f"training failed: {summarize(error)}")
        print(f"[{run_name}] {use.describe()}", flush=True)
        if recorder is not None:
            recorder.fail(error, use)
        if error is e:
            raise
        raise error from e

    # The bundle travelled inside the final checkpoint; give it a stable place in the run.
    bundle_fs_path = publish_bundle(fs, f"{storage_root}/{run_name}", checkpoint.filesystem,
                                    f"{checkpoint.path}/{BUNDLE_DIR}")
    bundle_metrics = read_bundle_metrics(fs, bundle_fs_path)
    use = run_resources(spec, time.monotonic() - fit_started, bundle_metrics.get("worker_nodes"),
                        bundle_metrics.get("segments"))
    for line in describe_events(bundle_metrics.get("events") or []):
        print(f"[{run_name}] {line}", flush=True)
    print(f"[{run_name}] {use.describe()}", flush=True)
    if epoch_logger is not None:
        # The epochs are logged from a thread of this process: give it a moment to finish.
        epoch_logger.flush(timeout_s=10)
    return _outcome(storage, run_name, prepared, bundle_metrics, use)


def _outcome(storage: str, run_name: str, prepared: PreparedData, bundle_metrics: dict[str, Any],
             use: ResourceUse | None) -> TrainingOutcome:
    """The finished run's outcome from its bundle's metrics. `use` is None when nothing trained now
    (the tracking run keeps the resources it logged before)."""
    return TrainingOutcome(
        run_name=run_name,
        run_dir=f"{storage}/{run_name}",
        task=prepared.schema.task,
        bundle_path=f"{storage}/{run_name}/{BUNDLE_DIR}",
        metrics=bundle_metrics["final"],
        history=bundle_metrics["history"],
        fingerprint=prepared.fingerprint,
        resources=use,
    )


def _whole_splits_config() -> ray.train.DataConfig:
    """Every rank reads all of both splits, in one order (each takes its own batches by position)."""
    ordered = ray.train.DataConfig.default_ingest_options()
    ordered.preserve_order = True
    return ray.train.DataConfig(datasets_to_split=[], execution_options={"train": ordered, "val": ordered})


def _fit_with_ray_train(config: WorkerConfig, prepared, storage: str, callbacks: list) -> ray.train.Checkpoint:
    """`TorchTrainer` over `train.num_workers` workers; the final checkpoint (the bundle is in it)."""
    t = config.spec.train
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config.to_ray(),
        scaling_config=ray.train.ScalingConfig(
            num_workers=t.num_workers,  # (min, max): Ray Train's elastic scaling policy
            elastic_resize_monitor_interval_s=t.resize_check_s,
            use_gpu=t.gpus_per_worker > 0,
            resources_per_worker=t.worker_resources(),
            placement_strategy=t.placement.upper(),
        ),
        run_config=ray.train.RunConfig(
            name=config.run_name,
            storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=t.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=t.checkpoints_to_keep),
            # Ray Train's own INFO lines (each report, each checkpoint) stay in its log files;
            # the console gets Flotilla's epoch lines and Ray Train's warnings.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            callbacks=callbacks,
        ),
        datasets={"train": prepared.train, "val": prepared.val},
        dataset_config=_whole_splits_config() if config.whole_splits else ray.train.DataConfig(),
    )
    with _elastic_restarts(t.elastic):
        result = trainer.fit()
    if result.return_value is not None:  # the loop stopped early and says why (a loss that is not a number)
        raise NotFiniteError(result.return_value)
    if result.checkpoint is None:
        raise TrainingError(f"run {config.run_name!r} finished without a checkpoint; nothing to bundle")
    return result.checkpoint


# An elastic run's worker group restarts at the size Ray Train's autoscaling coordinator sees room for.
# Its view of the nodes is refreshed every 20 s, and a run that lost a node restarts within seconds:
# it first asks for the old size, whose placement waits for the lost node until Ray Train's worker
# group start timeout (60 s by default) before it chooses again. Elastic runs wait 5 s instead (Ray
# Train hands the driver's value to its controller): the coordinator only offers nodes that exist,
# so a placement that can succeed does in well under a second, and a failed one is retried without
# counting against `train.max_failures`. The coordinator is also asked to look again as soon as a
# node joins or leaves, or a draining node nears its deadline (`flotilla.cluster.usable_nodes`), so
# the second choice sees the nodes as they are.
ELASTIC_START_TIMEOUT_S = 5
_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
# Ray Train's watcher asks Ray Core for drain notices every 5 s by default; every run's watcher asks
# every second instead (one small request to the GCS), so the ranks hear a notice sooner: a spot
# notice gives 30-120 s, a checkpoint of a large model takes a good part of that.
PREEMPTION_POLL_S = 1
_PREEMPTION_POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"


def _unless_set(values: dict[str, str]) -> dict[str, str]:
    """Ray Train's settings that its driver hands to its controller, those the user has not set."""
    return {k: v for k, v in values.items() if k not in os.environ}


@contextlib.contextmanager
def _elastic_restarts(elastic: bool):
    if not elastic:
        with environment(_unless_set({_PREEMPTION_POLL_ENV: str(PREEMPTION_POLL_S)})):
            yield
        return
    stop = threading.Event()

    def watch() -> None:
        seen = None
        while not stop.wait(1.0):
            try:
                # (a node that dies flips Alive; one that nears its drain deadline leaves the list)
                now = {(n["NodeID"], n["Alive"]) for n in usable_nodes()}
                if seen is not None and now != seen:
                    coordinator = ray.get_actor(*AUTOSCALING_COORDINATOR)
                    coordinator.get_reserved_resources.remote("flotilla-nodes-changed", recompute=True)
                seen = now
            except Exception:  # no coordinator yet, or the cluster busy: the next second asks again
                continue

    start_autoscaling_coordinator()
    thread = threading.Thread(target=watch, name="flotilla-elastic-nodes", daemon=True)
    with environment(_unless_set({_START_TIMEOUT_ENV: str(ELASTIC_START_TIMEOUT_S),
                                  _PREEMPTION_POLL_ENV: str(PREEMPTION_POLL_S)})):
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)


def _fit_here(config: WorkerConfig, prepared, fs: pafs.FileSystem, run_root: str, epoch_logger) -> ray.train.Checkpoint:
    """One worker in this process (a Tune trial's), reporting each epoch to MLflow and Tune."""

    def on_report(metrics: dict[str, Any]) -> None:
        if epoch_logger is not None:
            epoch_logger.record(metrics)
            # In MLflow before Tune hears of it: a scheduler that stops the trial on this report
            # ends its process, and an epoch still queued would be lost (a server that is away is
            # waited for only until MLflow's own retries give up, and at most 30 s).
            epoch_logger.flush(timeout_s=30)
        tune.report(metrics)

    session = InProcess({"train": prepared.train, "val": prepared.val}, fs, run_root,
                        config.spec.train.checkpoints_to_keep, on_report)
    return train_in_trial(config, session)


def new_run_name(spec: RunSpec) -> str:
    """The name a run gets when `train.run_name` is null: the spec's name and the time."""
    return f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def latest_run(spec: RunSpec) -> str | None:
    """The newest run of this spec under `train.storage_path` (named `<name>-<time>`, with its
    spec.yaml written), or None when there is none."""
    fs, root = filesystem_for(spec.train.storage_path, "train.storage_path")
    found = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    stamp = re.compile(re.escape(spec.name) + r"-\d{8}-\d{6}$")
    runs = sorted(i.base_name for i in found if i.type == pafs.FileType.Directory and stamp.match(i.base_name))
    runs = [r for r in runs if fs.get_file_info(f"{root}/{r}/spec.yaml").type == pafs.FileType.File]
    return runs[-1] if runs else None


def run_resources(spec: RunSpec, wall_time_s: float, worker_nodes: list[str] | None = None,
                  segments: list[dict[str, Any]] | None = None) -> ResourceUse:
    """What a run's reservation (its workers plus Ray Data's CPU) held for `wall_time_s`, priced by the
    spec or by the price labels of the nodes its workers ran on. `segments` (the bundle's: each
    attempt's number of workers and its span) take off the stretches when an elastic run ran with
    fewer than its most workers; setup, restarts and the rest of the run count at the full size."""
    t = spec.train
    workers = t.max_workers
    if segments and wall_time_s > 0:  # the full size for the whole run, less the stretches it ran smaller
        short = sum((t.max_workers - s["workers"]) * max(0.0, s["to"] - s["from"]) for s in segments)
        workers = max(0.0, t.max_workers - short / wall_time_s)
    return resource_use(
        wall_time_s,
        cpus=workers * t.cpus_per_worker + DATA_CPUS,
        gpus=workers * t.gpus_per_worker,
        prices=prices_for(spec.cost, worker_nodes),
    )


def describe_events(events: list[dict[str, Any]]) -> list[str]:
    """One line for each resize, restart and drain notice of a run (the bundle's `events`)."""
    lines = []
    for e in events:
        line = (f"{time.strftime('%H:%M:%S', time.localtime(e['at']))} {e['reason']}: {e['from_workers']} -> "
                f"{e['to_workers']} workers, resumed at step {e['resumed_step']}")
        if e.get("resumed_batch"):
            line += f" (batch {e['resumed_batch']} of its epoch)"
        if "steps_lost" in e:
            line += f", {e['steps_lost']} finished steps lost"
        line += f"; checkpoint {e['since_checkpoint_s']:.0f} s old"
        if "first_step_s" in e:
            line += f", training again {e['first_step_s']:.0f} s after the restart began"
        lines.append(line)
    return lines


def publish_bundle(fs: pafs.FileSystem, run_root: str, source_fs: pafs.FileSystem, source: str) -> str:
    """Copy the bundle at `source` to `<run_root>/bundle`, marked as being copied
    (`<run_root>/bundle.copying`, removed last) so that a copy cut short is never taken for a
    finished run's bundle; its path."""
    target, copying = f"{run_root}/{BUNDLE_DIR}", f"{run_root}/{BUNDLE_COPYING}"
    fs.create_dir(run_root, recursive=True)
    with fs.open_output_stream(copying) as f:
        f.write(b"the bundle beside this file is being copied; until this file is gone it is incomplete\n")
    if fs.get_file_info(target).type != pafs.FileType.NotFound:
        fs.delete_dir_contents(target)  # an earlier bundle of the run (it trained further): no file of it stays
    fs.create_dir(target, recursive=True)
    pafs.copy_files(source, target, source_filesystem=source_fs, destination_filesystem=fs)
    fs.delete_file(copying)
    return target


def find_bundle(fs: pafs.FileSystem, root: str, run_name: str) -> str:
    """The bundle of a finished run under `root` (a path on `fs`): `<run>/bundle`, or the one inside
    its final checkpoint when the run stopped between its last report and copying it out, or while
    copying it (`bundle.copying`)."""
    bundle = f"{root}/{run_name}/{BUNDLE_DIR}"
    copying = fs.get_file_info(f"{root}/{run_name}/{BUNDLE_COPYING}").type != pafs.FileType.NotFound
    if not copying and fs.get_file_info(bundle).type != pafs.FileType.NotFound:
        return bundle
    found = fs.get_file_info(pafs.FileSelector(f"{root}/{run_name}", allow_not_found=True))
    checkpoints = sorted(i.path for i in found if i.base_name.startswith(CHECKPOINT_PREFIX))
    return f"{checkpoints[-1]}/{BUNDLE_DIR}" if checkpoints else bundle


@contextlib.contextmanager
def local_copy(fs: pafs.FileSystem, path: str):
    """A local directory with the contents of `path`: itself when local, else a temporary copy."""
    if isinstance(fs, pafs.LocalFileSystem):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="flotilla-bundle-") as tmp:
        pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield Path(tmp)


def _finished_bundle(fs: pafs.FileSystem, root: str, run_name: str, epochs: int, fingerprint: str) -> dict | None:
    """The metrics of run `run_name`'s bundle when it is complete for `epochs` epochs of the data
    whose fingerprint is `fingerprint` (the one its record names), else None: train (or resume)."""
    try:
        if fs.get_file_info(f"{root}/{run_name}/{BUNDLE_COPYING}").type != pafs.FileType.NotFound:
            return None  # its copy was cut short: the run resumes from its final checkpoint and copies again
        with fs.open_input_stream(f"{root}/{run_name}/fingerprint.txt") as f:
            if f.read().decode().strip() != fingerprint:
                return None
        metrics = read_bundle_metrics(fs, f"{root}/{run_name}/{BUNDLE_DIR}")
        history = metrics["history"]
        complete = bool(history) and history[-1]["epoch"] == epochs and "final" in metrics
    except (OSError, ValueError, KeyError, TypeError):  # no run, no bundle yet, or one half copied
        return None
    return metrics if complete else None


def run_directory(spec: RunSpec, run_name: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of run `run_name`'s directory under `train.storage_path`."""
    fs, root = filesystem_for(spec.train.storage_path, "train.storage_path")
    return fs, f"{root}/{run_name}"


def _write_run_record(fs: pafs.FileSystem, root: str, run_name: str, spec: RunSpec, fingerprint: str) -> None:
    fs.create_dir(f"{root}/{run_name}", recursive=True)
    with fs.open_output_stream(f"{root}/{run_name}/spec.yaml") as f:
        f.write(spec_to_yaml(spec).encode())
    with fs.open_output_stream(f"{root}/{run_name}/fingerprint.txt") as f:
        f.write(f"{fingerprint}\n".encode())


def _explain(error: ray.train.TrainingFailedError) -> FlotillaError:
    """The workers' own exception, not Ray's wrapper: a FlotillaError as is, else a TrainingError."""
    failures = getattr(error, "worker_failures", None) or {}
    failures = [(rank, _root_cause(failures[rank])) for rank in sorted(failures)]
    for _, root in failures:  # a rank that says what went wrong, over a lower one that only saw the effect
        if isinstance(root, FlotillaError):
            return root
    for rank, root in failures:
        return TrainingError(f"training failed on rank {rank}: {summarize(root)}")
    root = _root_cause(error)
    if isinstance(root, FlotillaError):
        return root
    return TrainingError(f"training failed: {summarize(root)}")


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, FlotillaError):
            return exc
        nxt = getattr(exc, "cause", None) or exc.__cause__ or getattr(exc, "controller_failure", None)
        if not isinstance(nxt, BaseException):
            break
        exc = nxt
    return exc
