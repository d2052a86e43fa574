"""The bare baseline for train_throughput.py: the same model and DeepSpeed config, no Ray.

Launched by the benchmark as `torchrun --nproc_per_node N benchmarks/_bare_deepspeed.py ARGS_JSON`;
rank 0 prints one JSON line with steady-state samples/s.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flotilla.spec import RunSpec  # noqa: E402
from flotilla.models import build_model  # noqa: E402
from flotilla.train import deepspeed_config  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    spec = RunSpec.model_validate(args["spec"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.train.seed)
    model = build_model(spec.model.model_dump(mode="json"), args["schema"])
    config = deepspeed_config(spec.train, "fp32", args["warmup"] + args["steps"], world, gpu=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    windows = torch.load(args["windows"], weights_only=True)[rank::world]
    b = spec.train.batch_size

    def step(i: int) -> None:
        batch = windows[(i * b) % (len(windows) - b):][:b]
        logits = engine(batch[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()

    for i in range(args["warmup"]):
        step(i)
    dist.barrier()
    start = time.perf_counter()
    for i in range(args["steps"]):
        step(i)
    dist.barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print("RESULT " + json.dumps({"samples_per_s": args["steps"] * b * world / elapsed}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
