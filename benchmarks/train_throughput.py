"""Training throughput: Flotilla (Ray Train + DeepSpeed) against bare baselines, in one run.

    python benchmarks/train_throughput.py            # ~10 minutes on 2 cores; run it alone

Three ways, same GPT, same DeepSpeed config (ZeRO-2, fp32), same byte windows:
  (a) Flotilla: `run_training`, 2 Ray Train workers, data streamed by Ray Data
  (a') the same with `precision: auto`, what users get: bf16 on CPUs with native bf16 units
       (AMX, AVX512-BF16), else fp32 (then (a) is that row); its MFU is against that dtype's peak
  (b) bare DeepSpeed under `torchrun`, 2 processes, windows in memory, no Ray
  (a'') Flotilla with `train.num_workers: auto`: 2 workers x 1 thread or 1 worker x 2 threads, as its
       probe finds faster (the same samples per step either way)
  (c) a bare single-process torch loop (AdamW) with the same total threads (2)
Steady-state samples/s exclude start-up (reported on its own row); MFU is 6·N·tokens/s
(plus attention, PaLM appendix B) over an fp32 matmul peak measured here, in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flotilla.spec import load_spec  # noqa: E402
from flotilla.data import ByteWindows, VOCAB_SIZE, resolve_source  # noqa: E402
from flotilla.models import build_model, flops_per_token  # noqa: E402
from flotilla.train import measured_peak_flops, resolve_precision  # noqa: E402
from flotilla.train._layout import workers_by_threads  # noqa: E402

SPEC = [
    "name=bench-gpt", "data.source=pycode", "data.max_bytes=150000", "data.val_fraction=0.2",
    "model.kind=gpt", "model.layers=4", "model.heads=4", "model.width=256", "model.context=128",
    "train.num_workers=2", "train.cpus_per_worker=1", "train.epochs=3", "train.batch_size=8",
    "train.zero_stage=2", "train.precision=fp32", "train.warmup_fraction=0.0",
]


def windows_of(spec) -> torch.Tensor:
    text = pq.read_table(resolve_source("pycode", max_bytes=spec.data.max_bytes).paths[0]).to_pandas()
    out = ByteWindows("text", spec.model.context).transform_batch(text[["text"]])
    return torch.stack([torch.as_tensor(w) for w in out["tokens"]])


def single_process(spec, schema, windows, warmup: int, steps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(spec.model.model_dump(mode="json"), schema)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr)
    b = spec.train.batch_size * spec.train.num_workers  # the same global batch

    def step(i):
        batch = windows[(i * b) % (len(windows) - b):][:b]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
        opt.step()

    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    return steps * b / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps for the bare baselines")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    spec = load_spec(None, SPEC)
    schema = {"task": "lm", "vocab_size": VOCAB_SIZE, "context": spec.model.context, "text_column": "text"}
    model = build_model(spec.model.model_dump(mode="json"), schema)
    n_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(spec.model.model_dump(), n_params)
    tokens_per_sample = spec.model.context
    torch.set_num_threads(2)
    peak = measured_peak_flops("cpu", "fp32")
    windows = windows_of(spec)
    print(f"model: GPT {n_params / 1e6:.2f}M params, T={spec.model.context}; fp32 peak (2 threads) "
          f"{peak / 1e9:.0f} GFLOP/s; {len(windows)} windows", flush=True)

    results = {}
    results["c"] = single_process(spec, schema, windows, args.warmup, args.steps, threads=2)
    print(f"(c) single process: {results['c']:.1f} samples/s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "windows.pt"
        torch.save(windows, path)
        payload = json.dumps({"spec": spec.model_dump(mode="json"), "schema": schema, "windows": str(path),
                              "warmup": args.warmup, "steps": args.steps})
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2",
             str(ROOT / "benchmarks" / "_bare_deepspeed.py"), payload],
            capture_output=True, text=True, env=env, timeout=1200,
        )
        bare_wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"bare DeepSpeed run failed:\n{proc.stderr[-3000:]}")
    results["b"] = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])["samples_per_s"]
    print(f"(b) bare DeepSpeed (torchrun, 2 ranks): {results['b']:.1f} samples/s", flush=True)

    from flotilla.pipeline import run_training

    with tempfile.TemporaryDirectory() as tmp:
        spec_a = load_spec(None, SPEC + [f"train.storage_path={tmp}"])
        started = time.perf_counter()
        outcome = run_training(spec_a)
        flotilla_wall = time.perf_counter() - started
        steady = outcome.history[1:]  # epoch 1 includes the workers' first batches
        results["a"] = sum(m["samples_per_s"] for m in steady) / len(steady)
        startup = flotilla_wall - sum(m["epoch_time_s"] for m in outcome.history)
        print(f"(a) Flotilla (Ray Train, 2 workers): {results['a']:.1f} samples/s", flush=True)

        auto = resolve_precision("auto", torch.device("cpu"))
        if auto != "fp32":
            spec_auto = load_spec(None, SPEC + [f"train.storage_path={tmp}", "train.precision=auto",
                                                "train.run_name=bench-auto"])
            steady_auto = run_training(spec_auto).history[1:]
            results["a_auto"] = sum(m["samples_per_s"] for m in steady_auto) / len(steady_auto)
            print(f"(a') Flotilla, precision auto = {auto}: {results['a_auto']:.1f} samples/s", flush=True)
        else:
            results["a_auto"] = results["a"]
        spec_layout = load_spec(None, SPEC + [f"train.storage_path={tmp}", "train.num_workers=auto",
                                              "train.run_name=bench-layout"])
        steady_layout = run_training(spec_layout).history[1:]
        results["a_layout"] = sum(m["samples_per_s"] for m in steady_layout) / len(steady_layout)
        chosen = steady_layout[-1]["world_size"]
        layout = workers_by_threads(chosen, 2 // chosen)
        print(f"(a'') Flotilla, num_workers auto ({layout}): {results['a_layout']:.1f} samples/s", flush=True)
    auto_peak = measured_peak_flops("cpu", auto)

    def mfu(samples_per_s: float, against: float = peak) -> float:
        return fpt * samples_per_s * tokens_per_sample / against

    rows = [
        ("(a) Flotilla: Ray Train + DeepSpeed ZeRO-2, 2 workers", results["a"]),
        ("(b) bare DeepSpeed ZeRO-2 under torchrun, 2 ranks", results["b"]),
        ("(c) bare torch loop, 1 process x 2 threads", results["c"]),
    ]
    lines = [
        f"Training throughput, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs "
        f"({_cpu_name()}); GPT {n_params / 1e6:.1f}M params, T={spec.model.context}, fp32, "
        f"global batch {spec.train.batch_size * 2}",
        "",
        "| setup | samples/s | tokens/s | MFU (fp32 peak) |",
        "|---|---|---|---|",
    ]
    for name, value in rows:
        lines.append(f"| {name} | {value:.1f} | {value * tokens_per_sample:.0f} | {mfu(value):.1%} |")
    same = " (auto resolves to fp32 on this CPU: the run of (a))" if auto == "fp32" else ""
    lines.append(f"| (a') Flotilla, `precision: auto` = {auto}{same} | {results['a_auto']:.1f} | "
                 f"{results['a_auto'] * tokens_per_sample:.0f} | {mfu(results['a_auto'], auto_peak):.1%} "
                 f"of the {auto} peak |")
    lines.append(f"| (a'') Flotilla, `num_workers: auto` (chose {layout}) | {results['a_layout']:.1f} | "
                 f"{results['a_layout'] * tokens_per_sample:.0f} | {mfu(results['a_layout']):.1%} |")
    lines += [
        f"| Flotilla start-up + validation + checkpoints (not in the rates above) | {startup:.0f} s | | |",
        f"| bare DeepSpeed process start-up + run, wall | {bare_wall:.0f} s | | |",
        "",
        f"**a/b = {results['a'] / results['b']:.2f}** (goal ≥ 0.97), a/c = {results['a'] / results['c']:.2f}, "
        f"**a''/c = {results['a_layout'] / results['c']:.2f}** (goal ≥ 0.95); "
        f"measured fp32 matmul peak {peak / 1e9:.0f} GFLOP/s on 2 threads"
        + (f", {auto} peak {auto_peak / 1e9:.0f} GFLOP/s." if auto != "fp32" else "."),
    ]
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "startup_s": startup, "peak": peak, "table": table}))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    main()
