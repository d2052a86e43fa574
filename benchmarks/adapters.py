"""Many LoRA adapters on one base (`serve.adapters.max_per_replica`): the memory they take, and
tokens/s with requests spread over them against all requests on one.

    python benchmarks/adapters.py                  # ~30 s; run it alone
    python benchmarks/adapters.py --adapters 8 --streams 16 --tokens 48 --hidden 512 --layers 8  # ~25M parameters

One process, a Llama of random weights built locally (~100M parameters by default;
`flotilla.models._hf_tiny`, nothing downloaded), `--adapters` LoRA adapters of rank 8 on its attention projections, each with random
updates and written as Flotilla adapter bundles, loaded onto the base as a serving replica does
(`flotilla.bundle.AdapterSet`). Memory: the bytes of the replica's tensors against the base's plus
each adapter's, and the process's resident memory before and after loading the adapters. Speed:
`--streams` chat streams of `--tokens` new tokens decoded together (`stream_together`, as a replica
decodes streams that arrive together), first all on one adapter, then spread round-robin over all
of them (one forward pass per token, each row through its own adapter). Goals: memory <= base +
N x adapter + 10 %; spread >= 0.8x one adapter.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

import psutil  # noqa: E402
import torch  # noqa: E402

from flotilla.bundle import AdapterSet, write_hf_bundle  # noqa: E402
from flotilla.models._hf import build_hf_causal_lm  # noqa: E402
from flotilla.models._hf_tiny import build_tiny_llama  # noqa: E402
from flotilla.serve._chat import _Generation, stream_together  # noqa: E402

SCHEMA = {"task": "lm", "vocab_size": 512, "context": 64, "row_format": "messages"}


def adapter_bundles(base: str, out: Path, count: int) -> list[Path]:
    spec = {"kind": "hf_causal_lm", "pretrained": base, "adaptation": "lora",
            "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": None, "merge": False}}
    bundles = []
    for i in range(count):
        torch.manual_seed(i)
        model = build_hf_causal_lm(spec)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        bundles.append(write_hf_bundle(out / f"adapter{i}", model, spec, {**SCHEMA, "tokenizer": base}, {}))
    return bundles


def tensor_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def decode(views, streams: int, tokens: int) -> tuple[float, list[str]]:
    """Tokens/s of `streams` streams decoded together, stream i on views[i % len(views)]."""
    eos = views[0].tokenizer.eos_token_id
    questions = ["What is 12 plus 7?", "Hi", "Tell me a story", "def main():", "Write a poem about the sea"]
    generations = [_Generation(views[i % len(views)], views[0].encode(questions[i % len(questions)], chat=True),
                               tokens, None, temperature=0.9, seed=i, logit_bias={eos: -100.0}) for i in range(streams)]
    for g in generations:
        g.feed = queue.SimpleQueue()
    texts = [""] * streams

    def read(i: int) -> None:
        texts[i] = "".join(generations[i].pieces())

    readers = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for r in readers:
        r.start()
    stream_together(views[0], generations)
    for r in readers:
        r.join()
    seconds = time.perf_counter() - start
    return sum(g.completion_tokens for g in generations) / seconds, texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-adapters-") as tmp:
        base = build_tiny_llama(Path(tmp) / "base", layers=args.layers, hidden=args.hidden, heads=8, kv_heads=4,
                                intermediate=args.hidden * 3, max_positions=4096)
        bundles = adapter_bundles(str(base), Path(tmp), args.adapters)
        process = psutil.Process()
        adapters = AdapterSet(bundles[0], "adapter0")
        base_bytes = tensor_bytes(adapters.model.get_base_model()) - adapters.adapter_bytes()
        one_adapter = adapters.adapter_bytes()
        rss_one = process.memory_info().rss
        views = [adapters.first] + [adapters.add(b, f"adapter{i}") for i, b in enumerate(bundles[1:], start=1)]
        rss_all = process.memory_info().rss
        held = tensor_bytes(adapters.model.get_base_model())
        bound = base_bytes + args.adapters * one_adapter
        print(f"base {base_bytes / 1e6:.1f} MB of tensors, an adapter {one_adapter / 1e6:.2f} MB; {args.adapters} "
              f"adapters on it: {held / 1e6:.1f} MB of tensors, {held / bound:.3f}x base + {args.adapters} x adapter "
              f"(goal <= 1.1); resident memory +{(rss_all - rss_one) / 1e6:.1f} MB for the other "
              f"{args.adapters - 1} adapters", flush=True)
        decode(views, 2, 4)  # warm-up
        one, spread = [], []
        for _ in range(args.repeats):  # interleaved: the machine's drift falls on both alike
            one.append(decode(views[:1], args.streams, args.tokens)[0])
            spread.append(decode(views, args.streams, args.tokens)[0])
        best_one, best_spread = max(one), max(spread)
        print(f"{args.streams} streams x {args.tokens} tokens, {args.threads} threads: all on one adapter "
              f"{best_one:.1f} tokens/s, spread over {args.adapters} {best_spread:.1f} tokens/s: "
              f"{best_spread / best_one:.2f}x (goal >= 0.8); runs {[round(x, 1) for x in one]} / "
              f"{[round(x, 1) for x in spread]}", flush=True)
        print(f"{date.today()}: hidden {args.hidden}, {args.layers} layers; memory {held / bound:.3f}x; "
              f"spread/one {best_spread / best_one:.2f}")
    return 0 if held <= 1.1 * bound and best_spread >= 0.8 * best_one else 1


if __name__ == "__main__":
    sys.exit(main())
