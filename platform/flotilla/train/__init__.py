"""Training: Ray Train `TorchTrainer` workers running DeepSpeed ZeRO, from a run spec.

    outcome = run_training(spec)       # starts a local Ray if none is running
    outcome.bundle_path, outcome.metrics, outcome.history
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import ray
import torch
import ray.train
from ray.train.torch import TorchTrainer

import flotilla
from flotilla.cluster import HAPROXY_ENV, ResourceUse, environment, prices_for, resource_use, wait_for_room
from flotilla.config import RunSpec, spec_to_yaml
from flotilla.data import filesystem_for, prepare_data
from flotilla.errors import ClusterError, FlotillaError, TrainingError
from flotilla.models import build_model
from flotilla.track import open_tracker
from flotilla.train._checkpoint import problems as checkpoint_problems
from flotilla.train._deepspeed_config import deepspeed_config, optimizer_steps
from flotilla.train._loop import BUNDLE_DIR, consolidated_fp32_state_dict, format_epoch, train_loop_per_worker
from flotilla.train._precision import cpu_has_native_bf16, measured_peak_flops, resolve_precision

__all__ = [
    "DATA_CPUS",
    "TrainingOutcome",
    "check_cluster_fits",
    "checkpoint_problems",
    "consolidated_fp32_state_dict",
    "cpu_has_native_bf16",
    "deepspeed_config",
    "ensure_ray",
    "format_epoch",
    "local_copy",
    "measured_peak_flops",
    "optimizer_steps",
    "resolve_precision",
    "run_resources",
    "run_training",
    "started_local_ray",
    "train_loop_per_worker",
]

PACKAGE_DIR = str(Path(flotilla.__file__).resolve().parent)


@dataclass
class TrainingOutcome:
    run_name: str
    run_dir: str  # storage_path/run_name (a local path or a URI)
    bundle_path: str
    metrics: dict[str, Any]  # the last epoch's
    history: list[dict[str, Any]] = field(default_factory=list)
    fingerprint: str = ""
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    registration: Any = None  # flotilla.track.Registration when the bundle was registered
    resources: ResourceUse | None = None  # what the workers held while training, and its cost


# Ray Data's read and transform tasks need a CPU slot of their own while the workers hold
# theirs; with none left the input pipeline never starts and training waits forever.
DATA_CPUS = 1


def ensure_ray(spec: RunSpec | None = None, *, ingress: str | None = None, **init_kwargs) -> None:
    """Connect to the cluster in RAY_ADDRESS (or the job's), or start a local one.

    A local cluster gets enough logical CPUs for the workers plus Ray Data's tasks (they
    share the machine's cores), and Serve's HAProxy ingress when `ingress` (default: the spec's
    `serve.ingress`) says `haproxy`. `platform/flotilla` travels to every worker as a runtime_env
    py_module, so a cluster runs the checkout as it is, without installing Flotilla on its nodes.
    """
    if not ray.is_initialized():
        _init_ray(spec, ingress or (spec.serve.ingress if spec is not None else "proxy"), init_kwargs)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


_STARTED_LOCAL = False


def started_local_ray() -> bool:
    """True when this process started its own local Ray (it ends with the process)."""
    return _STARTED_LOCAL and ray.is_initialized()


def _init_ray(spec: RunSpec | None, ingress: str, init_kwargs: dict) -> None:
    global _STARTED_LOCAL
    _STARTED_LOCAL = init_kwargs.get("address") == "local" or (
        "address" not in init_kwargs and not _cluster_address()
    )
    if spec is not None and "address" not in init_kwargs and not _cluster_address():
        needed = spec.train.num_workers * spec.train.cpus_per_worker + DATA_CPUS
        init_kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, math.ceil(needed)))
        init_kwargs.setdefault("num_gpus", _local_gpus())
    # The local cluster will serve this spec's endpoint: Serve's processes read it when they start.
    env = HAPROXY_ENV if ingress == "haproxy" and _STARTED_LOCAL else {}
    # FLOTILLA_SHIP_PACKAGE=0: every node imports flotilla from its own install instead. The
    # local fake cluster needs it: its nodes share one runtime_resources directory, and each
    # node that unpacks a shipped package deletes the copy the others are running from.
    ship = os.environ.get("FLOTILLA_SHIP_PACKAGE", "1") != "0"
    with environment(env):  # Ray's processes keep it; this process gets its own back
        ray.init(runtime_env={"py_modules": [PACKAGE_DIR]} if ship else None, **init_kwargs)


def check_cluster_fits(spec: RunSpec) -> None:
    """Fail fast when the workers can never be placed, instead of pending forever.

    On a running cluster a shortfall first goes to its autoscaler, which has
    `train.scale_up_timeout_s` to add the nodes (see `flotilla.cluster.wait_for_room`).
    """
    t = spec.train
    worker = {"CPU": t.cpus_per_worker, "GPU": t.gpus_per_worker}
    need = {"CPU": t.num_workers * t.cpus_per_worker + DATA_CPUS, "GPU": t.num_workers * t.gpus_per_worker}
    missing, why = wait_for_room(need, [worker] * t.num_workers + [{"CPU": DATA_CPUS}],
                            timeout_s=t.scale_up_timeout_s, may_wait=not started_local_ray(),
                            label=t.run_name or spec.name)
    problems = []
    for resource, (amount, have) in missing.items():
        per = "cpus_per_worker" if resource == "CPU" else "gpus_per_worker"
        data_note = f" plus {DATA_CPUS} for Ray Data's input pipeline" if resource == "CPU" else ""
        problems.append(
            f"train.num_workers={t.num_workers} x train.{per}={getattr(t, per):g} needs "
            f"{amount - (DATA_CPUS if resource == 'CPU' else 0):g} {resource}s{data_note}, but the cluster has "
            f"{have:g} in all; lower train.num_workers or train.{per}, or add nodes"
        )
    if problems:
        if why:
            problems.append(why)
        raise ClusterError("the cluster cannot hold this run:\n  - " + "\n  - ".join(problems))


def run_training(spec: RunSpec, *, callbacks: list | tuple = (), tracking_tags: dict[str, str] | None = None) -> TrainingOutcome:
    """Preprocess, train, evaluate, bundle and (with `track.enabled`) record and register one run.

    `callbacks` are extra Ray Train `UserCallback`s (a Tune trial passes Tune's report callback);
    `tracking_tags` are set on the run's MLflow run (a sweep links trials to its parent run).
    """
    started = time.monotonic()
    t = spec.train
    run_name = t.run_name or f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    fs, storage_root = filesystem_for(t.storage_path, "train.storage_path")
    # What Ray Train gets: the URI as written, or the local path made absolute.
    storage = t.storage_path.rstrip("/") if "://" in t.storage_path else storage_root
    tracker = open_tracker(spec, run_name, tracking_tags)  # checks the tracking URI before Ray starts
    ensure_ray(spec)
    check_cluster_fits(spec)

    prepared = prepare_data(spec)
    print(
        f"[{run_name}] data {prepared.source.description!r}: {prepared.train_rows} train / {prepared.val_rows} val "
        f"rows, fingerprint {prepared.fingerprint[:12]}",
        flush=True,
    )
    # Build the model once here, on the meta device (no memory, no compute): a broken factory
    # fails now with its own message instead of on every worker after each restart.
    with torch.device("meta"):
        build_model(spec.model.model_dump(mode="json"), prepared.schema)
    _write_run_record(fs, storage_root, run_name, spec, prepared.fingerprint)
    if tracker is not None:
        tracker.start(prepared, f"{storage}/{run_name}")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "spec": spec.model_dump(mode="json"),
            "schema": prepared.schema,
            "preprocessors": prepared.preprocessors,
            "fingerprint": prepared.fingerprint,
            "train_rows": prepared.train_rows,
            "run_name": run_name,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=t.num_workers,
            use_gpu=t.gpus_per_worker > 0,
            resources_per_worker={"CPU": t.cpus_per_worker, **({"GPU": t.gpus_per_worker} if t.gpus_per_worker else {})},
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=t.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=t.checkpoints_to_keep),
            callbacks=([tracker.callback()] if tracker is not None else []) + list(callbacks),
        ),
        datasets={"train": prepared.train, "val": prepared.val},
    )
    fit_started = time.monotonic()
    try:
        result = trainer.fit()
        if result.checkpoint is None:
            raise TrainingError(f"run {run_name!r} finished without a checkpoint; nothing to bundle")
    except BaseException as e:  # KeyboardInterrupt too: the MLflow run says it did not finish
        error = _explain(e) if isinstance(e, ray.train.TrainingFailedError) else e
        use = run_resources(spec, time.monotonic() - fit_started)
        print(f"[{run_name}] {use.describe()}", flush=True)
        if tracker is not None:
            tracker.fail(error, use)
        if error is e:
            raise
        raise error from e

    # The bundle travelled inside the final checkpoint; give it a stable place in the run.
    bundle_fs_path = f"{storage_root}/{run_name}/{BUNDLE_DIR}"
    fs.create_dir(bundle_fs_path, recursive=True)
    pafs.copy_files(
        f"{result.checkpoint.path}/{BUNDLE_DIR}",
        bundle_fs_path,
        source_filesystem=result.checkpoint.filesystem,
        destination_filesystem=fs,
    )
    with fs.open_input_stream(f"{bundle_fs_path}/metrics.json") as f:
        bundle_metrics = json.loads(f.read())
    use = run_resources(spec, time.monotonic() - fit_started, bundle_metrics.get("worker_nodes"))
    print(f"[{run_name}] {use.describe()}", flush=True)
    outcome = TrainingOutcome(
        run_name=run_name,
        run_dir=f"{storage}/{run_name}",
        bundle_path=f"{storage}/{run_name}/{BUNDLE_DIR}",
        metrics=bundle_metrics["final"],
        history=bundle_metrics["history"],
        fingerprint=prepared.fingerprint,
        resources=use,
    )
    if tracker is not None:
        outcome.mlflow_run_id, outcome.tracking_uri = tracker.run_id, tracker.uri
        with local_copy(fs, bundle_fs_path) as local_bundle:
            outcome.registration = tracker.finish(outcome, prepared, time.monotonic() - started, local_bundle)
    return outcome


def run_resources(spec: RunSpec, wall_time_s: float, worker_nodes: list[str] | None = None) -> ResourceUse:
    """What a run's reservation (its workers plus Ray Data's CPU) held for `wall_time_s`, priced by the
    spec or by the price labels of the nodes its workers ran on."""
    t = spec.train
    return resource_use(
        wall_time_s,
        cpus=t.num_workers * t.cpus_per_worker + DATA_CPUS,
        gpus=t.num_workers * t.gpus_per_worker,
        prices=prices_for(spec.cost, worker_nodes),
    )


@contextlib.contextmanager
def local_copy(fs: pafs.FileSystem, path: str):
    """A local directory with the contents of `path`: itself when local, else a temporary copy."""
    if isinstance(fs, pafs.LocalFileSystem):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="flotilla-bundle-") as tmp:
        pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield Path(tmp)


def _cluster_address() -> str | None:
    """The cluster `ray.init()` would join: RAY_ADDRESS, a `ray job submit` job's, or one that
    `ray start` left on this machine. None means `ray.init()` starts a local cluster."""
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return os.environ.get("RAY_ADDRESS", "job")
    from ray._private.services import canonicalize_bootstrap_address  # the lookup ray.init() does

    try:
        return canonicalize_bootstrap_address(None)
    except Exception:  # a stale address file: ray.init() will say so itself
        return None


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _write_run_record(fs: pafs.FileSystem, root: str, run_name: str, spec: RunSpec, fingerprint: str) -> None:
    fs.create_dir(f"{root}/{run_name}", recursive=True)
    with fs.open_output_stream(f"{root}/{run_name}/spec.yaml") as f:
        f.write(spec_to_yaml(spec).encode())
    with fs.open_output_stream(f"{root}/{run_name}/fingerprint.txt") as f:
        f.write(f"{fingerprint}\n".encode())


def _explain(error: ray.train.TrainingFailedError) -> FlotillaError:
    """The workers' own exception, not Ray's wrapper: a FlotillaError as is, else a TrainingError."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank, failure in sorted(failures.items()):
        root = _root_cause(failure)
        if isinstance(root, FlotillaError):
            return root
        return TrainingError(f"training failed on rank {rank}: {type(root).__name__}: {_last_line(root)}")
    root = _root_cause(error)
    if isinstance(root, FlotillaError):
        return root
    return TrainingError(f"training failed: {type(root).__name__}: {_last_line(root)}")


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


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
