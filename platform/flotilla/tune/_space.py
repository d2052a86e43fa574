"""The sweep's search space (YAML) as Ray Tune domains, and trial specs from sampled values."""

from __future__ import annotations

import math
from typing import Any

from ray import tune

from flotilla.spec import RunSpec, TuneSpec, trial_spec

RESOURCE_PATHS = ("train.num_workers", "train.cpus_per_worker", "train.gpus_per_worker")


def tune_domains(t: TuneSpec) -> dict[str, Any]:
    """`{"train.lr": {"loguniform": [a, b]}}` -> `{"train.lr": tune.loguniform(a, b)}`."""
    domains = {}
    for path, dim in t.space.items():
        kind, arg = next(iter(dim.items()))
        if kind == "loguniform":
            domains[path] = tune.loguniform(*arg)
        elif kind == "uniform":
            domains[path] = tune.uniform(*arg)
        elif kind == "randint":
            domains[path] = tune.randint(arg[0], arg[1] + 1)  # Ray's upper end is exclusive; ours is not
        elif kind == "grid" or (kind == "choice" and t.search == "grid"):
            domains[path] = tune.grid_search(list(arg))
        else:
            domains[path] = tune.choice(list(arg))
    return domains


def largest_trial(base: RunSpec) -> RunSpec:
    """The spec of the hungriest trial the space allows (most workers, CPUs and GPUs per worker)."""
    values = {}
    for path in RESOURCE_PATHS:
        dim = base.tune.space.get(path)
        if dim:
            kind, arg = next(iter(dim.items()))
            values[path] = max(arg)
    return trial_spec(base, values)


def concurrent_slots(base: RunSpec, cluster: dict[str, float], data_cpus: int) -> int:
    """How many of the largest trials fit at once beside Ray Data's CPU."""
    t = largest_trial(base).train
    slots = math.floor((cluster.get("CPU", 0) - data_cpus) / (t.num_workers * t.cpus_per_worker))
    if t.gpus_per_worker:
        slots = min(slots, math.floor(cluster.get("GPU", 0) / (t.num_workers * t.gpus_per_worker)))
    return max(1, slots)


def trial_resources(spec: RunSpec) -> dict[str, float]:
    """What a trial's own process reserves. A one-worker run trains in it, so it holds the worker's
    CPUs and GPUs; a larger run's process only drives its TorchTrainer, whose workers reserve them.
    (A CPU share there would leave Ray Data's one-CPU tasks without a whole free CPU, so it asks
    for memory only: Ray refuses an empty request.)"""
    t = spec.train
    if t.num_workers == 1:
        return t.worker_resources()
    return {"CPU": 0, "memory": 256 * 1024**2}

