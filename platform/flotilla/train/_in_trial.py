"""A one-worker run inside a Tune trial's own process: the same loop, without Ray Train's worker group.

`TorchTrainer` starts a controller, a worker group and Ray Data's split coordinators for every
run: seconds of fixed cost that a sweep of short trials pays per trial. A trial whose run has one
worker needs none of it: the trial's process (which Tune placed with the worker's CPUs and GPUs)
runs `flotilla.train._loop.train` itself, over the whole datasets, and keeps the run's
checkpoints where `TorchTrainer` would (`<storage>/<run>/checkpoint_epochNNNN_<attempt>`, the
same verified format), so resuming, `find_bundle` and the MLflow run work the same. A trial that
fails is restarted by Tune (`tune.trial_max_failures`) and resumes from the run's newest complete
checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs
import ray.data
import ray.train
import torch
import torch.distributed as dist

from flotilla.errors import NotFiniteError
from flotilla.train._loop import CHECKPOINT_PREFIX, train
from flotilla.train._worker_config import WorkerConfig


class InProcess:
    """The loop's `Session` for one worker in this process."""

    rank, world = 0, 1

    def __init__(self, datasets: dict[str, ray.data.Dataset], fs: pafs.FileSystem, run_root: str, keep: int,
                 on_report: Callable[[dict[str, Any]], None]):
        self.datasets, self.fs, self.run_root, self.keep, self.on_report = datasets, fs, run_root, keep, on_report
        # Tune hands a trial with a GPU exactly that GPU (CUDA_VISIBLE_DEVICES).
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.last: ray.train.Checkpoint | None = None

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        """The run's newest checkpoint by name (the loop verifies it and falls back to older ones)."""
        names = _checkpoint_names(self.fs, self.run_root)
        return ray.train.Checkpoint(f"{self.run_root}/{names[-1]}", filesystem=self.fs) if names else None

    def shard(self, name: str) -> ray.data.Dataset:
        return self.datasets[name]

    def preemption(self) -> None:
        return None  # (a trial's process hears of a drain through Tune, which retries the trial)

    def report(self, metrics: dict[str, Any], directory: str, name: str, confirm: bool = False) -> None:
        destination = f"{self.run_root}/{name}"
        self.fs.create_dir(destination, recursive=True)
        pafs.copy_files(directory, destination, destination_filesystem=self.fs)
        self.last = ray.train.Checkpoint(destination, filesystem=self.fs)
        for old in _checkpoint_names(self.fs, self.run_root)[: -self.keep]:
            self.fs.delete_dir(f"{self.run_root}/{old}")
        self.on_report(metrics)


def train_in_trial(config: WorkerConfig, session: InProcess) -> ray.train.Checkpoint:
    """Run the loop here; the final checkpoint (with the bundle in it)."""
    _process_group(session.device)
    stopped = train(config, session)
    if stopped is not None:
        raise NotFiniteError(stopped)
    if session.last is None:
        raise RuntimeError("the training loop reported no checkpoint")
    return session.last


def _process_group(device: torch.device) -> None:
    """A one-process torch.distributed group: DeepSpeed and the loop's collectives need one. It
    lives as long as the process (DeepSpeed keeps a handle on it)."""
    # What a launcher would set; DeepSpeed reads LOCAL_RANK.
    for name in ("RANK", "LOCAL_RANK"):
        os.environ[name] = "0"
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ[name] = "1"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def _checkpoint_names(fs: pafs.FileSystem, run_root: str) -> list[str]:
    found = fs.get_file_info(pafs.FileSelector(run_root, allow_not_found=True))
    return sorted(i.base_name for i in found if i.type == pafs.FileType.Directory and i.base_name.startswith(CHECKPOINT_PREFIX))
