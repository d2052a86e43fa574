"""A language model by runtime: torch, its ONNX graph and its 4-bit weights (`onnx-int4`), one run.

    python benchmarks/lm_runtimes.py                         # ~100M parameters, ~6 minutes on 2 cores; run it alone
    python benchmarks/lm_runtimes.py --hidden 256 --layers 2 --steps 10   # a quick look

A Llama of random weights built locally (`flotilla.models._hf_tiny`, nothing downloaded; ~100M
parameters by default), trained here for `--steps` steps of AdamW on Python source (the standard
library's, which every Python has) so that its perplexity means something, and written as a
Flotilla bundle. `flotilla.export.build_variants` builds the variants, gates each (perplexity on
held-out windows of other modules' source, within `export.max_relative_increase` of torch's) and
times them, as `flotilla export` does. Reported per runtime: the bytes of its weights against
torch's fp32 safetensors (goal for onnx-int4: <= 0.3x), greedy tokens/s of one stream and of
`--streams` streams decoded together (one forward pass per token for all of them, as a replica
decodes requests that arrive together), each against torch, and held-out perplexity.
"""

from __future__ import annotations

import argparse
import inspect
import importlib
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from flotilla.bundle import load_hf_bundle, write_hf_bundle  # noqa: E402
from flotilla.data._instruct import INPUT_IDS, LABELS  # noqa: E402
from flotilla.export import build_variants  # noqa: E402
from flotilla.models._hf import build_hf_causal_lm  # noqa: E402
from flotilla.models._hf_tiny import build_tiny_llama  # noqa: E402
from flotilla.spec._sections import ExportSpec  # noqa: E402

TRAIN_MODULES = ("argparse", "typing", "inspect", "collections", "functools", "logging", "subprocess", "threading")
HELD_OUT_MODULES = ("pathlib", "dataclasses", "enum", "tempfile")
PROMPTS = ["def main(", "import os\n", "class Config:", "for i in range(", "    return ", "with open(",
           "if __name__ ==", "from typing import"]


def windows(tokenizer, modules: tuple[str, ...], context: int) -> np.ndarray:
    """The modules' source as token windows of `context` + 1 (inputs and their shifted targets)."""
    stream: list[int] = []
    for name in modules:
        stream += tokenizer(inspect.getsource(importlib.import_module(name)))["input_ids"]
    count = (len(stream) - 1) // context
    return np.array([stream[i * context:i * context + context + 1] for i in range(count)], dtype=np.int64)


def train(model, data: np.ndarray, steps: int, batch: int) -> list[float]:
    hf = model.hf
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.0)
    rng = np.random.default_rng(0)
    losses = []
    for step in range(steps):
        rows = torch.as_tensor(data[rng.choice(len(data), batch, replace=False)])
        loss = hf(input_ids=rows[:, :-1], labels=rows[:, :-1].clone()).loss  # (transformers shifts the labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps}: loss {loss:.3f}", flush=True)
    hf.eval()
    return losses


def tokens_per_s(bundle, streams: int, tokens: int, repeats: int) -> float:
    """Greedy tokens/s of `streams` prompts decoded together (end of text banned: each makes `tokens`)."""
    prompts = [bundle.encode(PROMPTS[i % len(PROMPTS)]) for i in range(streams)]
    ban = {t: -100.0 for t in bundle.stop_ids()}
    settings = [dict(max_tokens=tokens, temperature=0.0, logit_bias=ban)] * streams
    bundle.generate_ids_batch(prompts, [dict(s, max_tokens=2) for s in settings])  # warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        out = bundle.generate_ids_batch(prompts, settings)
        best = max(best, sum(map(len, out)) / (time.perf_counter() - start))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="training steps before exporting (default %(default)s)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=64, help="held-out windows the gates score (default %(default)s)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-lm-runtimes-") as tmp:
        base = build_tiny_llama(Path(tmp) / "base", layers=args.layers, hidden=args.hidden, heads=8, kv_heads=4,
                                intermediate=args.hidden * 3, max_positions=4096)
        spec = {"kind": "hf_causal_lm", "pretrained": str(base), "adaptation": "full"}
        model = build_hf_causal_lm(spec)
        parameters = sum(p.numel() for p in model.hf.parameters())
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
        data, held_out = (windows(tokenizer, m, args.context) for m in (TRAIN_MODULES, HELD_OUT_MODULES))
        held_out = held_out[np.random.default_rng(1).permutation(len(held_out))[:args.held_out]]
        print(f"Llama of {parameters / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers); "
              f"{len(data)} training windows, {len(held_out)} held out", flush=True)
        start = time.perf_counter()
        losses = train(model, data, args.steps, args.batch)
        trained_s = time.perf_counter() - start
        schema = {"task": "lm", "vocab_size": len(tokenizer), "context": args.context, "row_format": "text",
                  "tokenizer": str(base)}
        bundle_dir = write_hf_bundle(Path(tmp) / "bundle", model, spec, schema, {})
        del model
        bundle = load_hf_bundle(bundle_dir)
        labels = held_out[:, 1:]
        rows = pd.DataFrame({INPUT_IDS: list(held_out[:, :-1]), LABELS: list(labels)})
        batches = [rows.iloc[i:i + 16] for i in range(0, len(rows), 16)]
        start = time.perf_counter()
        records = build_variants(bundle, batches, ExportSpec(variants=["onnx", "onnx-int4"]), None, None)
        exported_s = time.perf_counter() - start
        torch_bytes = sum(f.stat().st_size for f in bundle_dir.glob("*.safetensors"))
        results = {}
        for runtime in ("torch", "onnx", "onnx-int4"):
            b = bundle if runtime == "torch" else bundle.with_runtime(runtime)
            one = tokens_per_s(b, 1, args.tokens * 2, args.repeats)
            many = tokens_per_s(b, args.streams, args.tokens, args.repeats)
            results[runtime] = {"one": one, "many": many, "bytes": records.get(runtime, {}).get("bytes", torch_bytes)}
            print(f"{runtime}: {one:.1f} tokens/s one stream, {many:.1f} with {args.streams}", flush=True)
        for name, r in records.items():
            if name != "torch":
                print(f"{name}: gate {'passed' if r['passed'] else 'FAILED'}: {r['reason']}")

    ppl = {name: r.get("val_perplexity") for name, r in records.items() if name != "torch"}
    ppl["torch"] = records["onnx"]["torch_val_perplexity"]
    int4 = results["onnx-int4"]
    lines = [
        f"Language model by runtime, {date.today()}, {args.threads} threads; Llama of {parameters / 1e6:.1f}M "
        f"parameters (hidden {args.hidden}, {args.layers} layers), trained {args.steps} steps here ({trained_s:.0f} s, "
        f"loss {losses[0]:.2f} -> {losses[-1]:.2f}); export, gates and timing {exported_s:.0f} s; greedy decoding, "
        f"best of {args.repeats}",
        "",
        f"| runtime | gate | weights (MB) | x torch | tokens/s, 1 stream | x torch | tokens/s, {args.streams} streams "
        "| x torch | held-out perplexity |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for runtime, r in results.items():
        t = results["torch"]
        gate = "-" if runtime == "torch" else ("passed" if records[runtime]["passed"] else "failed")
        lines.append(f"| {runtime} | {gate} | {r['bytes'] / 1e6:.1f} | {r['bytes'] / t['bytes']:.2f} | {r['one']:.1f} "
                     f"| {r['one'] / t['one']:.2f} | {r['many']:.1f} | {r['many'] / t['many']:.2f} | {ppl[runtime]:.3f} |")
    print("\n" + "\n".join(lines))
    size_ok = int4["bytes"] <= 0.3 * results["torch"]["bytes"]
    print(f"\nonnx-int4 weights {int4['bytes'] / results['torch']['bytes']:.2f}x fp32 (goal <= 0.3: "
          f"{'met' if size_ok else 'NOT met'}); gate {'passed' if records['onnx-int4']['passed'] else 'FAILED'}")
    return 0 if size_ok and records["onnx-int4"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
