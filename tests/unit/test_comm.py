"""`flotilla.train._comm` between real processes (4 ranks over Gloo on this machine): local SGD's
hierarchical averaging where ranks share a node, and the int8 hook's error. (Training with each
option: tests/integration/test_comm.py.)"""

from __future__ import annotations

import json
import socket
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flotilla.spec._sections import CommSpec
from flotilla.train._comm import Comm, _Bucket, _int8_hook


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(weight: float) -> types.SimpleNamespace:
    """What `Comm` reads of a DeepSpeed engine at ZeRO stage 0: the module and the all-reduce switch."""
    module = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(weight)
    return types.SimpleNamespace(module=module, enable_backward_allreduce=True, zero_optimization_stage=lambda: 0,
                                 is_gradient_accumulation_boundary=lambda: True)


def _averaging(rank: int, world: int, port: int, nodes: list[str], out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        engine = _engine(float(rank))
        comm = Comm(engine, CommSpec(sync_every=3), world, nodes, warmup_steps=0)
        seen = []
        for _ in range(3):
            comm.after_step()
            seen.append(engine.module.weight[0, 0].item())
        (out / f"{rank}.json").write_text(json.dumps([seen, engine.enable_backward_allreduce, comm.metrics()]))
    finally:
        dist.destroy_process_group()


def _int8(rank: int, world: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 10))
        model(torch.randn(8, 64)).sum().backward()
        params = list(model.parameters())
        exact = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(exact)
        exact /= world
        bucket = _Bucket(params)
        bucket.write_back(_int8_hook(dist.group.WORLD, bucket).wait())
        sent = torch.cat([p.grad.reshape(-1) for p in params])
        (out / f"{rank}.json").write_text(json.dumps(((sent - exact).abs().max() / exact.abs().max()).item()))
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, out: Path, *args) -> dict:
    """Each rank's result (written to `out`; the processes are spawned, never forked: this process
    may hold a Ray connection, which a fork would share)."""
    mp.spawn(fn, args=(world, _free_port(), *args, out), nprocs=world)
    return {int(f.stem): json.loads(f.read_text()) for f in out.glob("*.json")}


@pytest.mark.parametrize("nodes, within, across", [
    # Two nodes of two ranks: averaged within the node at steps 1 and 2, across all four at step 3.
    (["a", "a", "b", "b"], {0: 0.5, 1: 0.5, 2: 2.5, 3: 2.5}, 1.5),
    # One rank per node (or nodes of unequal size): nothing between the periods, all four at step 3.
    (["a", "b", "c", "d"], {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}, 1.5),
])
def test_local_sgd_averages_within_a_node_each_step_and_across_nodes_every_n(tmp_path, nodes, within, across):
    result = _spawn(_averaging, 4, tmp_path, nodes)
    assert sorted(result) == [0, 1, 2, 3]
    for rank, (seen, allreduce, metrics) in result.items():
        assert seen == pytest.approx([within[rank], within[rank], across]), rank
        assert allreduce is False  # DeepSpeed's gradient all-reduce is off under local SGD
        assert metrics == {"gradient_dtype": "not sent", "sync_every": 3}


def test_int8_gradients_arrive_within_a_percent_or_two_of_the_exact_mean(tmp_path):
    errors = _spawn(_int8, 2, tmp_path)
    assert len(errors) == 2 and all(0 < e < 0.02 for e in errors.values()), errors
