"""The DeepSpeed config generated from the spec's `train` section."""

from __future__ import annotations

import math
from typing import Any

from flotilla.errors import TrainingError
from flotilla.spec import TrainSpec


def optimizer_steps(train_rows: int, world_size: int, t: TrainSpec, whole: bool = True) -> tuple[int, int]:
    """(micro-batches per epoch per rank, optimizer steps per epoch).

    `whole`: every rank reads the whole split and takes every world-th of its batches (as many as
    every rank has, `flotilla.train._loop.rank_batches`). Otherwise Ray Train splits it into equal
    shards (`streaming_split(equal=True)`) of `train_rows // world_size` rows.
    """
    if whole:
        micro = max(1, rank_share(train_rows, world_size, t))
    else:
        micro = max(1, math.ceil((train_rows // world_size) / t.batch_size))
    return micro, max(1, math.ceil(micro / t.accumulation(world_size)))


def rank_share(train_rows: int, world_size: int, t: TrainSpec, skip: int = 0) -> int:
    """Micro-batches each rank takes of an epoch's `ceil(train_rows / batch_size)` batches from batch
    `skip` on, when every rank reads the whole split: as many as every rank has, and with
    `train.global_batch_size` whole optimizer steps only, so that every number of workers takes the
    same steps of the same batches."""
    share = (math.ceil(train_rows / t.batch_size) - skip) // world_size
    if t.global_batch_size is not None:
        share -= share % t.accumulation(world_size)
    return share


def deepspeed_config(t: TrainSpec, precision: str, total_steps: int, world_size: int, gpu: bool,
                     load_universal: bool = False, local_world: int = 1) -> dict[str, Any]:
    """`load_universal`: the engine will resume from a universal checkpoint (a checkpoint written at
    another world size, converted; `flotilla.train._checkpoint`). `local_world`: the ranks on this
    rank's node (ZeRO++'s hierarchical partitioning keeps a copy of the weights within each node)."""
    problem = t.accumulation_problem(world_size)
    if problem:  # a run resumed on a number of workers that its global batch does not divide into
        raise TrainingError(problem)
    accumulation = t.accumulation(world_size)
    # DeepSpeed's WarmupCosineLR refuses 0 warmup steps; one step of warmup is the least it takes.
    warmup = max(1, int(t.warmup_fraction * total_steps))
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage in (1, 2, 3) and t.offload_optimizer == "cpu" and gpu:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if t.zero_stage == 3:
        if t.offload_params == "cpu" and gpu:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        # Gather the full fp16/bf16 weights on save so `save_16bit_model` works too.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        if t.comm.compression == "int8" and gpu:
            # ZeRO++: weights all-gathered in int8 (qwZ), gradients reduce-scattered in int4/int8 (qgZ), and
            # a secondary copy of the weights partitioned within the node so that the backward pass's
            # all-gathers stay on the node's own links (hpZ).
            zero["zero_quantized_weights"] = True
            zero["zero_quantized_gradients"] = True
            if 1 < local_world < world_size and world_size % local_world == 0:
                zero["zero_hpz_partition_size"] = local_world
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": t.batch_size * accumulation * world_size,
        "gradient_clipping": t.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": list(t.betas),
                "eps": 1e-8,
                "weight_decay": t.weight_decay,
                # torch's AdamW: DeepSpeed's fused/CPU Adam kernels need a JIT build per
                # device; torch's runs everywhere (DeepSpeed still shards its state).
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(1, total_steps),
                "warmup_num_steps": warmup,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": t.min_lr_ratio,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        # loss_scale 0 = dynamic loss scaling.
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "checkpoint": {"load_universal": load_universal},
        "steps_per_print": 10**9,  # Flotilla prints its own per-epoch line
        "wall_clock_breakdown": False,
    }
    if t.comm.deepspeed_dtype is not None:
        config["communication_data_type"] = t.comm.deepspeed_dtype
    return config
