"""The controller's half of `flotilla._epochs`: a Ray Train callback that writes each reported epoch
where the driver reads it. A module of its own because it subclasses Ray Train's callback, and Ray Train
is ~3 CPU-seconds to import in a process that only reads the epochs. Like `flotilla._epochs`, it imports
nothing heavier than Ray and pyarrow: Ray Train's controller imports it to run the callback.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pyarrow.fs as pafs
import ray.train

from flotilla._epochs import epoch_file


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
        final, partial = epoch_file(root, step), f"{root}/.epoch_{step:04d}.json.partial"
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
