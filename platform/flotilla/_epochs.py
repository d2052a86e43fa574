"""Each epoch's metrics on their way from Ray Train's controller to the driver, through the run's storage.

    callbacks=[EpochRelay(fs, directory)]        # in Ray Train's controller (flotilla._epoch_relay)
    for metrics in read_new(fs, directory, seen): ...   # in the driver: the epochs not seen yet

The driver owns the MLflow run and logs what this relays (flotilla.track.EpochMetricsLogger). The
controller only writes files where the run keeps its checkpoints (storage every node reaches), so
it loads neither MLflow nor its database driver: a few CPU-seconds less on every run. This module
imports nothing heavier than pyarrow: `flotilla.track` reads the epochs with it, and every process
that loads track (a Serve replica, `flotilla eval`) would otherwise import Ray Train for nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow.fs as pafs

EPOCHS_DIR = "epoch_metrics"
_NAME = re.compile(r"epoch_(\d{4,})\.json$")


def epoch_file(directory: str, step: int) -> str:
    """Where the epoch `step`'s metrics are written (`EpochRelay`) and read (`read_new`)."""
    return f"{directory}/epoch_{step:04d}.json"


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
