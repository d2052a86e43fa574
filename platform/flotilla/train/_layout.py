"""`train.num_workers: auto`: how a run lays its workers out, chosen by measuring both ways.

On one CPU node of N cores a run can be N workers of one thread each (data parallel: every step
all-reduces the gradients between processes) or one worker of N threads (torch's intra-op
threads; no all-reduce, but small matrices split across threads gain less than N). Which is faster
depends on the model, the batch and the CPU: on a 2-core EPYC the GPT benchmark's 2 x 1 reached
0.75 of 1 x 2, and a LoRA fine-tune decides it the other way round on a CPU with AMX. So the run
measures. A short probe on the cluster's own node builds the model, takes a real batch of the
train split and times a few optimizer steps both ways: N Ray actors of 1 CPU joined by a Gloo
group (forward, backward, one all-reduce of the trainable gradients, AdamW step), then one of them
alone with N threads and the whole batch. Each side does the same samples per optimizer step, so
the choice does not change what the run optimizes: one worker takes `batch_size x N` rows a step.

With GPUs `auto` is one worker per GPU (`train.gpus_per_worker` each); nothing to measure.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import ray

from flotilla.errors import ClusterError
from flotilla.runtime import DATA_CPUS, started_local_ray
from flotilla.spec import RunSpec
from flotilla.train._loop import _batch_dtypes

LAYOUT_FILE = "layout.json"  # in the run's directory: a resumed run keeps the layout it chose
# One layout must beat the other by this much to win; within it, one worker (fewer processes, no
# all-reduce to wait on, one copy of the model in memory).
MARGIN = 0.05
PROBE_SECONDS = 1.5  # timed steps per layout, about (at least PROBE_MIN_STEPS, at most PROBE_MAX_STEPS)
PROBE_MIN_STEPS, PROBE_MAX_STEPS = 3, 12


@dataclass
class Layout:
    """The workers a run was given and why."""

    num_workers: int
    threads: int  # per worker (its cpus_per_worker)
    batch_size: int  # per worker per step
    how: str  # "measured", "one core", "gpus", "resumed"
    samples_per_s: dict[str, float]  # what the probe measured: {"2x1": ..., "1x2": ...}
    probe_s: float = 0.0

    def describe(self) -> str:
        chosen = f"{workers_by_threads(self.num_workers, self.threads)}, batch {self.batch_size} per worker"
        if self.how == "gpus":
            return f"train.num_workers auto: {chosen} (one worker per GPU)"
        if self.how == "one core":
            return (f"train.num_workers auto: {chosen} (the node has one CPU for training beside the data "
                    "pipeline's: nothing to choose)")
        if self.how == "resumed":
            return f"train.num_workers auto: {chosen}, as the run chose before it stopped"
        rates = ", ".join(f"{k} {v:.1f} samples/s" for k, v in self.samples_per_s.items())
        return f"train.num_workers auto: {chosen} (measured in {self.probe_s:.0f} s: {rates})"

    def tags(self) -> dict[str, str]:
        return {"flotilla.layout": f"{self.num_workers}x{self.threads}",
                "flotilla.layout_auto": json.dumps({"how": self.how, **{k: round(v, 2) for k, v in self.samples_per_s.items()}})}


def workers_by_threads(workers: int, threads: int) -> str:
    """`2 workers x 1 thread`, `1 worker x 2 threads`."""
    return f"{workers} worker{'s' if workers > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"


def choose_layout(spec: RunSpec, prepared, run_dir: tuple[pafs.FileSystem, str] | None = None,
                  label: str = "flotilla") -> tuple[RunSpec, Layout | None]:
    """`spec` with `train.num_workers: auto` made a number (and `cpus_per_worker`, `batch_size`
    to match), and the layout; a spec with a number is returned as it is, with None.

    `run_dir`: the run's directory; a run that resumes there keeps the layout it chose at its start
    (its checkpoints' batches are counted in that micro-batch)."""
    t = spec.train
    if t.num_workers != "auto":
        return spec, None
    layout = _recorded(run_dir)
    if layout is None:
        if t.gpus_per_worker:
            gpus = ray.cluster_resources().get("GPU", 0.0)
            n = max(1, math.floor(gpus / t.gpus_per_worker + 1e-9))
            layout = Layout(n, 1, t.batch_size, "gpus", {})
        else:
            layout = _measure(spec, prepared, _node_cpus(label))
    print(f"[{label}] {layout.describe()}", flush=True)
    if run_dir is not None:
        fs, path = run_dir
        fs.create_dir(path, recursive=True)
        with fs.open_output_stream(f"{path}/{LAYOUT_FILE}") as f:
            f.write(json.dumps(asdict(layout)).encode())
    return with_layout(spec, layout), layout


def with_layout(spec: RunSpec, layout: Layout) -> RunSpec:
    """`spec` with the layout's workers, threads and micro-batch (validated again: a
    `global_batch_size` must still split into whole micro-batches)."""
    raw = spec.model_dump(mode="json")
    raw["train"].update(num_workers=layout.num_workers, cpus_per_worker=layout.threads, batch_size=layout.batch_size)
    return type(spec).model_validate(raw)


def _recorded(run_dir: tuple[pafs.FileSystem, str] | None) -> Layout | None:
    if run_dir is None:
        return None
    fs, path = run_dir
    try:
        with fs.open_input_stream(f"{path}/{LAYOUT_FILE}") as f:
            saved = json.loads(f.read().decode())
        layout = Layout(**saved)
    except (OSError, ValueError, TypeError):
        return None
    layout.how = "resumed"
    return layout


def _node_cpus(label: str) -> int:
    """The cores a run may use on the cluster's one CPU node: its CPUs less the data pipeline's."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    if len(nodes) != 1:
        raise ClusterError(
            f"train.num_workers: auto chooses the workers of one CPU node, and this cluster has {len(nodes)} nodes "
            "with CPUs; give a number (e.g. one worker per node, `train.cpus_per_worker` = the CPUs of a node)")
    cpus = nodes[0]["Resources"]["CPU"]
    if started_local_ray():  # started for this run with os.cpu_count() + the data pipeline's CPU
        cpus = min(cpus - DATA_CPUS, os.cpu_count() or 1)
    else:
        cpus -= DATA_CPUS
    return max(1, int(cpus))


def _measure(spec: RunSpec, prepared, n: int) -> Layout:
    t = spec.train
    if n == 1:
        return Layout(1, 1, t.batch_size, "one core", {})
    started = time.monotonic()
    rows = t.batch_size * n
    batch = prepared.train.take_batch(rows, batch_format="numpy")
    batch = {k: np.stack(v) if v.dtype == object else v for k, v in batch.items() if k in _batch_dtypes(prepared.schema)}
    got = len(next(iter(batch.values())))
    if got < rows:  # a small train split: repeat its rows
        batch = {k: np.resize(v, (rows, *v.shape[1:])) for k, v in batch.items()}
    probe = ray.remote(num_cpus=1, max_restarts=0)(_Probe)
    probes = [probe.remote(spec.model_dump(mode="json"), prepared.schema.model_dump(mode="json"), batch)
              for _ in range(n)]
    try:
        address = ray.get(probes[0].address.remote())
        ray.get([p.join.remote(address, rank, n) for rank, p in enumerate(probes)])
        shares = [{k: v[rank * t.batch_size:(rank + 1) * t.batch_size] for k, v in batch.items()} for rank in range(n)]
        # Two untimed steps each way (allocation, first-call costs), which also size the timed part.
        first = max(ray.get([p.steps.remote(share, 1, 2, True) for p, share in zip(probes, shares)]))
        whole = ray.get(probes[0].steps.remote(batch, n, 2, False))
        count = max(PROBE_MIN_STEPS, min(PROBE_MAX_STEPS, math.ceil(PROBE_SECONDS / max(first, 1e-3) * 2)))
        apart = max(ray.get([p.steps.remote(share, 1, count, True) for p, share in zip(probes, shares)]))
        count = max(PROBE_MIN_STEPS, min(PROBE_MAX_STEPS, math.ceil(PROBE_SECONDS / max(whole, 1e-3) * 2)))
        together = ray.get(probes[0].steps.remote(batch, n, count, False))
    finally:
        for p in probes:
            ray.kill(p)
    rates = {f"{n}x1": rows / apart, f"1x{n}": rows / together}
    spread = rates[f"{n}x1"] > rates[f"1x{n}"] * (1 + MARGIN)
    return Layout(n if spread else 1, 1 if spread else n, t.batch_size if spread else rows, "measured", rates,
                  time.monotonic() - started)


class _Probe:
    """One process of the probe: the run's model, an AdamW step, and a Gloo group with the others."""

    def __init__(self, spec: dict[str, Any], schema: dict[str, Any], batch: dict[str, np.ndarray]) -> None:
        import torch

        from flotilla.data import DataSchema
        from flotilla.train._precision import resolve_precision, torch_dtype

        self.spec = RunSpec.model_validate(spec)
        self.schema = DataSchema.model_validate(schema)
        self.dtypes = _batch_dtypes(self.schema)
        self.dtype = torch_dtype(resolve_precision(self.spec.train.precision, torch.device("cpu")))
        torch.manual_seed(self.spec.train.seed)
        model_spec = self.spec.model.model_dump(mode="json")
        if model_spec["kind"] == "hf_causal_lm":
            from flotilla.models._hf import build_hf_causal_lm

            self.model = build_hf_causal_lm(model_spec, self.schema, dtype=self.dtype)
        else:
            from flotilla.models import build_model

            self.model = build_model(model_spec, self.schema).to(self.dtype)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.spec.train.lr)

    def address(self) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"

    def join(self, address: str, rank: int, world: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world)
        self.world = world

    def steps(self, batch: dict[str, np.ndarray], threads: int, count: int, reduce: bool) -> float:
        """Seconds per optimizer step over `count` steps on `batch` with `threads` threads;
        `reduce`: all-reduce the gradients with the others each step (as DeepSpeed does)."""
        import torch
        import torch.distributed as dist

        from flotilla.train._loop import _loss, _split

        torch.set_num_threads(threads)
        tensors = {k: torch.as_tensor(np.array(batch[k]), dtype=d) for k, d in self.dtypes.items()}
        inputs, targets = _split(tensors, self.schema, self.dtype)
        if reduce:
            dist.barrier()
        started = time.perf_counter()
        for _ in range(count):
            loss = _loss(self.model(inputs), targets, self.schema, "mean")
            loss.backward()
            if reduce:
                flat = torch.cat([p.grad.reshape(-1) for p in self.params])
                dist.all_reduce(flat)
                flat /= self.world
                offset = 0
                for p in self.params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        return (time.perf_counter() - started) / count
