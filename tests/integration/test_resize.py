"""A checkpoint written by N ranks resumes on M: for every ZeRO stage, 2 ranks train and checkpoint,
1 rank resumes and trains on, then 2 ranks resume again. After each resume the fp32 weights and
both Adam moments (assembled whole across the ranks) equal those of the checkpoint's writers when
they saved it, within 1e-6, and so do the optimizer's and the engine's step counts.

Real DeepSpeed engines in gloo process groups built by the test (the ranks Ray Train would start),
writing and loading through `flotilla.train._checkpoint`; each rank writes its own directory,
merged afterwards as Ray Train merges them, and the merge is verified before it is loaded."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

# (ZeRO stage, precision): every stage in fp32, and bf16 where DeepSpeed partitions its fp32 copies.
CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")]
STEPS = 2  # optimizer steps per phase
WORLDS = [2, 1, 2]  # the world size of each phase


def _full_state(engine) -> dict[str, torch.Tensor]:
    """fp32 weights and Adam moments, whole, whatever the stage (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state = {}
    for name, p in engine.module.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            state[f"param/{name}"] = safe_get_full_fp32_param(p).float().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).float().cpu().clone()
        else:  # ZeRO-0 in fp32: the torch optimizer holds the module's own parameters
            state[f"param/{name}"] = p.detach().float().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"{key}/{name}"] = engine.optimizer.state[p][key].float().cpu().clone()
    return state


def _adam_steps(engine) -> set[float]:
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return {float(s["step"]) for s in base.state.values() if "step" in s}


def _phase(rank: int, world: int, port: int, root: str, phase: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import deepspeed
    import torch.distributed as dist

    from flotilla.spec import TrainSpec
    from flotilla.train import _checkpoint
    from flotilla.train._deepspeed_config import deepspeed_config
    from flotilla.train._loop import _skip_shared_memory_op

    _skip_shared_memory_op()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    report = {}
    for stage, precision in CASES:
        case = Path(root) / f"zero{stage}_{precision}"
        t = TrainSpec(num_workers=world, batch_size=4, zero_stage=stage, precision=precision, lr=0.05)
        previous = case / f"checkpoint{phase - 1}"
        universal = phase > 0 and _checkpoint.needs_universal(str(previous), world)
        config = deepspeed_config(t, precision, total_steps=100, world_size=world, gpu=False, load_universal=universal)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        result = {"universal": universal}
        if phase > 0:
            assert not _checkpoint.problems(str(previous))
            resumed = _checkpoint.load(engine, str(previous), rank, universal)
            saved = torch.load(case / f"expected{phase - 1}.pt", weights_only=True)
            now = _full_state(engine)
            result.update(
                worst=max(float((now[k] - saved[k]).abs().max()) for k in saved),
                adam_steps=sorted(_adam_steps(engine)), global_steps=int(engine.global_steps),
                written_by=resumed.written_by, converted=resumed.converted_s is not None,
            )
        generator = torch.Generator().manual_seed(100 * phase + rank)
        for _ in range(STEPS):
            x = torch.randn(4, 8, generator=generator)
            y = torch.randint(0, 5, (4,), generator=generator)
            out = engine(x.to(torch.bfloat16) if precision == "bf16" else x)
            engine.backward(torch.nn.functional.cross_entropy(out.float(), y))
            engine.step()
        # Each rank writes its own directory; the ranks' directories are merged into one checkpoint.
        mine = case / f"rank{rank}_of_phase{phase}"
        _checkpoint.save(engine, str(mine), rank, world, {"global_step": int(engine.global_steps)})
        expected = _full_state(engine)
        dist.barrier()
        if rank == 0:
            merged = case / f"checkpoint{phase}"
            for r in range(world):
                shutil.copytree(case / f"rank{r}_of_phase{phase}", merged, dirs_exist_ok=True)
            torch.save(expected, case / f"expected{phase}.pt")  # beside it: a checkpoint holds what its manifests list
        dist.barrier()
        report[f"zero{stage}_{precision}"] = result
    (Path(root) / f"phase{phase}_rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def phases(tmp_path_factory) -> list[dict[str, dict]]:
    root = tmp_path_factory.mktemp("resize")
    for phase, world in enumerate(WORLDS):
        mp.spawn(_phase, args=(world, _free_port(), str(root), phase), nprocs=world)
    return [{rank: json.loads((root / f"phase{p}_rank{rank}.json").read_text()) for rank in range(w)}
            for p, w in enumerate(WORLDS)]


@pytest.mark.parametrize("stage, precision", CASES, ids=[f"zero{s}-{p}" for s, p in CASES])
def test_a_checkpoint_resumes_at_another_world_size_with_the_same_weights_and_adam_moments(phases, stage, precision):
    for phase in (1, 2):
        for rank, report in phases[phase].items():
            got = report[f"zero{stage}_{precision}"]
            where = f"phase {phase} ({WORLDS[phase - 1]} -> {WORLDS[phase]} ranks), rank {rank}"
            assert got["written_by"] == WORLDS[phase - 1], where
            assert got["worst"] <= 1e-6, f"{where}: weights or Adam moments differ by {got['worst']:g}"
            # Adam's bias correction and the LR schedule go on from the steps already taken.
            assert got["adam_steps"] == [float(phase * STEPS)] and got["global_steps"] == phase * STEPS, where
            # Only a partitioned optimizer state goes through the universal conversion.
            assert got["converted"] == got["universal"] == (stage > 0 or precision != "fp32"), where
