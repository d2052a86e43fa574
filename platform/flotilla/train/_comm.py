"""The workers' gradients and weights between them, where Flotilla rather than DeepSpeed moves them
(`train.comm`, ZeRO stage 0 in fp32):

- `compression: powersgd`: PyTorch's DDP communication hook (`ddp_comm_hooks.powerSGD_hook`, low-rank
  factors with error feedback) on DeepSpeed's gradients, once per optimizer step;
- `compression: int8`: the scheme of PyTorch's per-channel quantization hook (a scale per 512 values,
  the 8-bit values all-gathered, dequantized and averaged on each rank) as a hook of the same form.
  PyTorch's own `quantization_perchannel_hook` indexes the all-gather's result as NCCL returns it (one
  stacked tensor), so it fails on Gloo's list of tensors, and it quantizes channel by channel in a
  Python loop; `_int8_hook` is vectorized, symmetric (no zero point) and uses `dist.all_gather`;
- `sync_every: N`: local SGD, the weights averaged with PyTorch's `model_averaging.utils` every N
  optimizer steps (within a node every step and across nodes every N where nodes hold several ranks);
- `sync_every: auto`: the first steps all-reduce the gradients (PyTorch's plain all-reduce hook) and
  time it against the rest of the step; N follows from the two, then as above.

With any of them DeepSpeed's own gradient all-reduce is off (`engine.enable_backward_allreduce`) and
`Comm` takes its place between `engine.backward` and `engine.step`. Otherwise (the defaults,
`compression: bf16 | fp16`, every ZeRO stage) DeepSpeed moves everything and `Comm` does nothing.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.model_averaging import utils

# `sync_every: auto`: optimizer steps left untimed (first allocations, first connections), then timed.
AUTO_SKIP_STEPS = 2
AUTO_TIMED_STEPS = 5
# The largest share of a step that synchronization may take, and the longest period chosen.
AUTO_COMM_SHARE = 0.2
AUTO_MAX_EVERY = 64
# `compression: int8`: values per quantization scale (as PyTorch's per-channel hook's `bucket_size`).
INT8_CHANNEL = 512


class _Bucket:
    """All of the model's gradients as one flat buffer, with `torch.distributed.GradBucket`'s interface
    (`index`, `buffer`, `set_buffer`, `gradients`, `parameters`, `is_last`): what DDP hands its
    communication hooks, here one bucket per optimizer step."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self._params = params
        self._buffer = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view into the buffer (hooks write results through them)."""
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return True

    def write_back(self, reduced: torch.Tensor) -> None:
        offset = 0
        for p in self._params:
            part = reduced[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = part.to(p.dtype).clone()
            else:
                p.grad.copy_(part)
            offset += p.numel()


def _int8_hook(group, bucket) -> torch.futures.Future:
    """Each rank's gradients in int8 with a scale per `INT8_CHANNEL` values (symmetric: the channel's
    largest magnitude is 127), all-gathered, dequantized and averaged: a quarter of fp32's bytes."""
    flat = bucket.buffer()
    channels = F.pad(flat, (0, -flat.numel() % INT8_CHANNEL)).view(-1, INT8_CHANNEL)
    scale = channels.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(flat.dtype).tiny) / 127
    values = torch.round(channels / scale).to(torch.int8)
    world = dist.get_world_size(group)
    all_values = [torch.empty_like(values) for _ in range(world)]
    all_scales = [torch.empty_like(scale) for _ in range(world)]
    dist.all_gather(all_scales, scale, group=group)
    dist.all_gather(all_values, values, group=group)
    mean = sum(v.to(flat.dtype) * s for v, s in zip(all_values, all_scales)) / world
    done = torch.futures.Future()
    done.set_result(mean.view(-1)[:flat.numel()])
    return done


class Comm:
    """What one rank does about synchronization around each optimizer step: `after_backward` (gradients,
    at an accumulation boundary), `after_step` (weights), `same_weights` (before evaluation and
    checkpoints), and what the epoch records (`metrics`)."""

    def __init__(self, engine, spec, world: int, nodes: list[str], warmup_steps: int):
        """`spec`: `train.comm`; `nodes`: each rank's node ID; `warmup_steps`: the learning-rate warmup's
        optimizer steps (PowerSGD starts after them)."""
        self.engine, self.spec, self.world, self.nodes = engine, spec, world, nodes
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.hook, self.state, self.every, self._since = None, None, 0, 0
        self.local_group = None  # local SGD across nodes: the ranks of this rank's node
        self.timing: dict[str, float] | None = None  # `auto`'s measurement, once made
        self._timed: list[tuple[float, float]] = []  # `auto`: (step wall time, all-reduce time) per step
        self._steps, self._step_comm, self._last_step = 0, 0.0, None
        # (At ZeRO stage 3 on GPUs, `int8` is ZeRO++ in DeepSpeed's config: DeepSpeed moves everything.)
        self.hooked = spec.hooked and engine.zero_optimization_stage() == 0 and world > 1
        if world <= 1 or not (self.hooked or spec.local_sgd):
            return
        engine.enable_backward_allreduce = False
        if spec.compression == "int8":
            self.hook, self.state = _int8_hook, dist.group.WORLD
        elif spec.compression == "powersgd":
            # Plain all-reduce for the warmup's steps (at least 2: PowerSGD's error feedback starts from a
            # settled gradient); then rank-r factors of each matrix, the error carried into the next step.
            self.hook = powerSGD_hook.powerSGD_hook
            self.state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=spec.powersgd_rank,
                start_powerSGD_iter=max(2, warmup_steps), min_compression_rate=2, use_error_feedback=True,
                warm_start=True, random_seed=0)
        elif spec.sync_every == "auto":
            self.hook, self.state = default_hooks.allreduce_hook, dist.group.WORLD  # timed, until N is chosen
        else:
            self._average_every(spec.sync_every)

    @property
    def measuring(self) -> bool:
        return self.spec.sync_every == "auto" and self.world > 1 and self.timing is None

    def after_backward(self) -> None:
        """Reduce the gradients with the hook (an optimizer step's last micro-batch only)."""
        if self.hook is None or not self.engine.is_gradient_accumulation_boundary():
            return
        began = time.perf_counter()
        bucket = _Bucket(self.params)
        bucket.write_back(self.hook(self.state, bucket).wait())
        self._step_comm = time.perf_counter() - began

    def after_step(self) -> str | None:
        """After each optimizer step: average the weights when due; under `auto`, time the step and
        choose N once enough steps are timed (then: what was measured and chosen, to print). Collective
        where it averages or chooses."""
        now = time.perf_counter()
        if self.measuring:
            self._steps += 1
            if self._last_step is not None and self._steps > AUTO_SKIP_STEPS:
                self._timed.append((now - self._last_step, self._step_comm))
            self._last_step = now
            if len(self._timed) >= AUTO_TIMED_STEPS:
                self._choose()
                return f"train.comm.sync_every auto: {self.metrics()['sync_auto']}"
            return None
        if self.every:
            self._since += 1
            if self._since % self.every == 0:
                utils.average_parameters(iter(self.params), dist.group.WORLD)
            elif self.local_group is not None:
                utils.average_parameters(iter(self.params), self.local_group)
        return None

    def same_weights(self) -> None:
        """Every rank's weights averaged now, under local SGD (one all-reduce); nothing otherwise."""
        if self.every:
            utils.average_parameters(iter(self.params), dist.group.WORLD)

    def metrics(self) -> dict[str, Any]:
        """What the epoch records: what the gradients travelled in, the period of averaging, and under
        `auto` the measurement the period came from."""
        if self.every:
            sent = "not sent"
        elif self.hooked:
            sent = self.spec.compression
        elif self.spec.compression == "int8" and self.world > 1:
            sent = "int8 (ZeRO++)"
        else:
            sent = str(self.engine.communication_data_type).removeprefix("torch.")
        out: dict[str, Any] = {"gradient_dtype": sent, "sync_every": self.every or 1}
        if self.timing is not None:
            out.update(self.timing)
            period = f"every {self.every} steps" if self.every else "every step"
            out["sync_auto"] = (f"all-reduce {self.timing['sync_allreduce_ms']:.1f} ms per step, the rest of the step "
                                f"{self.timing['sync_compute_ms']:.1f} ms: {period}")
        return out

    def _choose(self) -> None:
        """N from the median timed step (the slowest rank's): communication at most `AUTO_COMM_SHARE` of a
        step, i.e. allreduce / N <= share x (compute + allreduce / N)."""
        comm = statistics.median(c for _, c in self._timed)
        compute = statistics.median(max(w - c, 1e-6) for w, c in self._timed)
        measured = torch.tensor([comm, compute], dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        comm, compute = measured.tolist()
        every = math.ceil(comm * (1 - AUTO_COMM_SHARE) / (AUTO_COMM_SHARE * compute) - 1e-9)
        every = max(1, min(AUTO_MAX_EVERY, every))
        self.timing = {"sync_allreduce_ms": comm * 1000, "sync_compute_ms": compute * 1000}
        self.hook = None
        if every == 1:  # communication already fits: DeepSpeed's own all-reduce, every step
            self.engine.enable_backward_allreduce = True
        else:  # the weights are the same on every rank here: each step so far all-reduced its gradients
            self._average_every(every)

    def _average_every(self, every: int) -> None:
        """Local SGD: the weights averaged across all ranks every N optimizer steps and, where every node
        holds the same number (> 1) of consecutive ranks, within the node at the steps between (PyTorch's
        hierarchical scheme; the averaging is `model_averaging.utils.average_parameters`. Its averager
        classes are not used: they skip parameters without a gradient, and DeepSpeed's step leaves none)."""
        self.every, self._since = every, 0
        local = self.nodes.count(self.nodes[0])
        blocks = [self.nodes[i:i + local] for i in range(0, self.world, local)]
        # every node one whole block of `local` consecutive ranks
        whole = all(b == [b[0]] * local for b in blocks) and len({b[0] for b in blocks}) == len(blocks)
        if 1 < local < self.world and whole:
            self.local_group, _ = dist.new_subgroups(group_size=local)
