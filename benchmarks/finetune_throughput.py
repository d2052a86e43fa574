"""Fine-tuning throughput: a LoRA fine-tune through Flotilla against a bare transformers + peft loop, in one run.

    python benchmarks/finetune_throughput.py         # ~5 minutes on 2 cores; run it alone

The same small Llama (random weights, built here: nothing is downloaded), the same LoRA adapters
(rank 8 on the attention projections), the same packed 128-token windows of Python source, the
same global batch and the same precision (`train.precision: auto`: bf16 on CPUs with bf16 units,
else fp32), two ways:
  (a) Flotilla: `run_training`, 2 Ray Train workers under DeepSpeed ZeRO-2, data streamed by Ray Data
  (a') the same with `train.num_workers: auto` (2 workers x 1 thread or 1 worker x 2 threads, as its
       probe finds faster; the same samples per step either way)
  (b) a bare single-process loop: transformers + peft, AdamW on the adapters, the same threads (2)
Steady-state tokens/s (epoch 1 and start-up excluded); MFU is the model FLOPs of LoRA training
(4·N per token: no weight gradients for the frozen base) over a matmul peak of the dtype in use,
measured here, in this run. Goal: a/b >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flotilla.data import resolve_source  # noqa: E402
from flotilla.data._instruct import IGNORE, INPUT_IDS, LABELS, TokenWindows  # noqa: E402
from flotilla.models import flops_per_token  # noqa: E402
from flotilla.models._hf import build_hf_causal_lm  # noqa: E402
from flotilla.models._hf_tiny import build_tiny_llama  # noqa: E402
from flotilla.spec import load_spec  # noqa: E402
from flotilla.train import measured_peak_flops, resolve_precision  # noqa: E402
from flotilla.train._layout import workers_by_threads  # noqa: E402
from flotilla.train._precision import torch_dtype  # noqa: E402

CONTEXT, BATCH, WORKERS = 128, 8, 2  # micro-batch per worker; the bare loop takes BATCH * WORKERS


def spec_overrides(pretrained: str, storage: str) -> list[str]:
    return [
        "name=bench-lora", "data.source=pycode", "data.max_bytes=120000", "data.text_column=text",
        "data.val_fraction=0.1", "model.kind=hf_causal_lm", f"model.pretrained={pretrained}", "model.adaptation=lora",
        f"model.context={CONTEXT}", "model.lora.dropout=0.0", f"train.num_workers={WORKERS}", "train.cpus_per_worker=1",
        "train.epochs=3", f"train.batch_size={BATCH}", "train.zero_stage=2", "train.precision=auto",
        "train.warmup_fraction=0.0", f"train.storage_path={storage}", "track.enabled=false",
    ]


def bare_loop(spec, windows: dict[str, np.ndarray], dtype: torch.dtype, warmup: int, steps: int) -> float:
    """Tokens/s of plain transformers + peft training on one process with 2 threads."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = build_hf_causal_lm(spec.model.model_dump(mode="json"), None, dtype=dtype).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.train.lr)
    inputs, labels = torch.as_tensor(windows[INPUT_IDS]), torch.as_tensor(windows[LABELS])
    b = BATCH * WORKERS

    def step(i: int) -> None:
        at = (i * b) % (len(inputs) - b)
        logits = model(inputs[at:at + b])
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels[at:at + b].flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], spec.train.grad_clip)
        opt.step()

    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    return steps * b * CONTEXT / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps of the bare loop")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        pretrained = str(build_tiny_llama(Path(tmp) / "model", layers=4, hidden=256, heads=4, kv_heads=2,
                                          intermediate=688, max_positions=256))
        spec = load_spec(None, spec_overrides(pretrained, f"{tmp}/runs"))
        precision = resolve_precision("auto", torch.device("cpu"))
        dtype = torch_dtype(precision)
        model_spec = spec.model.model_dump(mode="json")
        n_params = sum(p.numel() for p in build_hf_causal_lm(model_spec, None).parameters())
        fpt = flops_per_token(model_spec, n_params)
        torch.set_num_threads(2)
        peak = measured_peak_flops("cpu", precision)
        text = pq.read_table(resolve_source("pycode", max_bytes=spec.data.max_bytes).paths[0]).to_pandas()
        windows = TokenWindows(pretrained, CONTEXT, "text")(text[["text"]])
        print(f"model: Llama {n_params / 1e6:.2f}M params, LoRA rank {spec.model.lora.rank}, T={CONTEXT}, "
              f"{precision}; {precision} matmul peak (2 threads) {peak / 1e9:.0f} GFLOP/s; "
              f"{len(windows[INPUT_IDS])} windows", flush=True)

        results = {"b": bare_loop(spec, windows, dtype, args.warmup, args.steps)}
        print(f"(b) bare transformers + peft, 1 process x 2 threads: {results['b']:.0f} tokens/s", flush=True)

        from flotilla.pipeline import run_training

        started = time.perf_counter()
        outcome = run_training(spec)
        wall = time.perf_counter() - started
        steady = outcome.history[1:]  # epoch 1 includes the workers' first batches
        results["a"] = sum(m["tokens_per_s"] for m in steady) / len(steady)
        startup = wall - sum(m["epoch_time_s"] for m in outcome.history)
        print(f"(a) Flotilla (Ray Train + DeepSpeed ZeRO-2, 2 workers): {results['a']:.0f} tokens/s", flush=True)
        layout_spec = load_spec(None, [o for o in spec_overrides(pretrained, f"{tmp}/runs") if "_worker" not in o and
                                       not o.startswith("train.num_workers")] + ["train.num_workers=auto",
                                                                                 "train.run_name=bench-layout"])
        steady = run_training(layout_spec).history[1:]
        results["a_layout"] = sum(m["tokens_per_s"] for m in steady) / len(steady)
        chosen = steady[-1]["world_size"]
        layout = workers_by_threads(chosen, WORKERS // chosen)
        print(f"(a') Flotilla, num_workers auto ({layout}): {results['a_layout']:.0f} tokens/s", flush=True)

    def mfu(tokens_per_s: float) -> float:
        return fpt * tokens_per_s / peak

    lines = [
        f"LoRA fine-tuning throughput, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; Llama "
        f"{n_params / 1e6:.1f}M params (LoRA rank {spec.model.lora.rank}, attention projections), T={CONTEXT}, "
        f"{precision}, global batch {BATCH * WORKERS}",
        "",
        f"| setup | tokens/s | MFU ({precision} peak) |",
        "|---|---|---|",
        f"| (a) Flotilla: Ray Train + DeepSpeed ZeRO-2, 2 workers x 1 thread | {results['a']:.0f} | "
        f"{mfu(results['a']):.1%} |",
        f"| (a') Flotilla, `num_workers: auto` (chose {layout}) | {results['a_layout']:.0f} | "
        f"{mfu(results['a_layout']):.1%} |",
        f"| (b) bare transformers + peft loop, 1 process x 2 threads | {results['b']:.0f} | {mfu(results['b']):.1%} |",
        f"| Flotilla start-up + validation + checkpoints (not in the rate above) | {startup:.0f} s | |",
        "",
        f"**a/b = {results['a'] / results['b']:.2f}** (goal >= 0.9), **a'/b = {results['a_layout'] / results['b']:.2f}** "
        f"(goal >= 1.0); measured {precision} matmul peak "
        f"{peak / 1e9:.0f} GFLOP/s on 2 threads; model FLOPs 4·N per token (LoRA: no weight gradients for the base).",
    ]
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "startup_s": startup, "peak": peak, "table": table}))


if __name__ == "__main__":
    main()
