"""Each epoch's metrics on their way from Ray Train's controller to the driver, through the run's storage.

    callbacks=[EpochRelay(fs, directory)]        # in Ray Train's controller: one small JSON file per epoch
    for metrics in read_new(fs, directory, seen): ...   # in the driver: the epochs not seen yet

The driver owns the MLflow run and logs what this relays (flotilla.track.EpochMetricsLogger). The
controller only writes files where the run keeps its checkpoints (storage every node reaches), so
it loads neither MLflow nor its database driver: a few CPU-seconds less on every run. This module
imports nothing heavier than Ray and pyarrow, since the controller imports it to run the callback.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import pyarrow.fs as pafs
import ray.train

EPOCHS_DIR = "epoch_metrics"
_NAME = re.compile(r"epoch_(\d{4,})\.json$")


class EpochRelay(ray.train.UserCallback):
    """Writes each reported epoch (rank 0's metrics; they are reduced across ranks) to
    `<directory>/epoch_NNNN.json`, `directory` a path on `fs` (the driver's own filesystem object,
    pickled to the controller). A write that fails is said and skipped: the driver fills in every
    epoch at the end of the run."""

    def __init__(self, fs: pafs.FileSystem, directory: str):
        self.fs, self.directory = fs, directory

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not metrics or metrics[0].get("within_epoch"):  # (a checkpoint within an epoch: no epoch to log)
            return
        step = int(metrics[0].get("epoch", 0))
        fs, root = self.fs, self.directory
        final, partial = f"{root}/epoch_{step:04d}.json", f"{root}/.epoch_{step:04d}.json.partial"
        try:
            fs.create_dir(root, recursive=True)
            with fs.open_output_stream(partial) as f:
                f.write(json.dumps(metrics[0], default=str).encode())
            fs.move(partial, final)  # the driver never reads half a file
        except Exception as e:  # storage trouble (full?): the epoch reaches MLflow at the end instead
            with contextlib.suppress(Exception):
                fs.delete_file(partial)
            print(f"WARNING: could not hand epoch {step}'s metrics to the driver ({type(e).__name__}: {e}); "
                  "they are logged when the run ends", flush=True)


def read_new(fs: pafs.FileSystem, directory: str, seen: set[int]) -> list[dict[str, Any]]:
    """The metrics of the epochs under `directory` (a path on `fs`) whose step is not in `seen`,
    oldest first; their steps are added to `seen`."""
    found = fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    new = []
    for info in sorted(found, key=lambda i: i.base_name):
        match = _NAME.match(info.base_name)
        if not match or int(match.group(1)) in seen:
            continue
        with fs.open_input_stream(info.path) as f:
            new.append(json.loads(f.read()))
        seen.add(int(match.group(1)))
    return new
