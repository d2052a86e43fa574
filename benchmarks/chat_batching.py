"""Streams of the chat endpoint decoded together, against one thread per stream (what a replica
did before) and against one stream after the other.

    python benchmarks/chat_batching.py                 # ~1 minute; run it alone
    python benchmarks/chat_batching.py --streams 16 --threads 2

One process, a Llama of random weights built locally (`flotilla.models._hf_tiny`, wider and deeper
than the tests' tiny one; nothing downloaded), `--streams` chat requests of `--tokens` new tokens
each (the end of turn banned with `logit_bias`, so every stream runs to its max_tokens), with their
own seeds and sampling settings. Each setup reads every stream's pieces as the endpoint does; the
texts must be equal in all three. torch uses `--threads` threads, as a replica uses its
`serve.replica.num_cpus`. Goal: together >= 2x one thread per stream at 8 streams.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

import torch  # noqa: E402

from flotilla.bundle import HFBundle  # noqa: E402
from flotilla.models._hf_tiny import build_tiny_llama  # noqa: E402
from flotilla.serve._chat import _Generation, stream_together  # noqa: E402


def build_bundle(directory: str, hidden: int, layers: int) -> HFBundle:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_llama(directory, layers=layers, hidden=hidden, heads=8, kv_heads=4, intermediate=hidden * 3,
                            max_positions=4096)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return HFBundle(path=path, model=model, tokenizer=AutoTokenizer.from_pretrained(path), model_spec={}, metrics={})


def requests_for(bundle: HFBundle, streams: int, tokens: int) -> list[_Generation]:
    eos = bundle.tokenizer.eos_token_id
    questions = ["What is 12 plus 7?", "Hi", "Tell me a story", "def main():", "Write a poem about the sea"]
    return [_Generation(bundle, bundle.encode(questions[i % len(questions)] + " " * (i // len(questions)), chat=True),
                        tokens, None, temperature=0.0 if i % 3 == 0 else 0.9, top_p=1.0 if i % 2 else 0.9, seed=i,
                        logit_bias={eos: -100.0}) for i in range(streams)]


def read_all(generations: list[_Generation]) -> list[str]:
    """Every stream's pieces, each read in a thread of its own (as the endpoint's streams are)."""
    texts = [""] * len(generations)

    def read(i: int) -> None:
        texts[i] = "".join(generations[i].pieces())

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(generations))]
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    return texts


def together(bundle: HFBundle, generations: list[_Generation]) -> list[str]:
    for g in generations:
        g.feed = queue.SimpleQueue()
    decoding = threading.Thread(target=stream_together, args=(bundle, generations))
    decoding.start()
    texts = read_all(generations)
    decoding.join()
    return texts


def thread_each(bundle: HFBundle, generations: list[_Generation]) -> list[str]:
    return read_all(generations)  # no feed: each reader's generation decodes alone (`generate_ids`)


def one_after_another(bundle: HFBundle, generations: list[_Generation]) -> list[str]:
    return ["".join(g.pieces()) for g in generations]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a replica's num_cpus)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bundle = build_bundle(tempfile.mkdtemp(prefix="chat-batching-"), args.hidden, args.layers)
    params = sum(p.numel() for p in bundle.model.parameters())
    setups = {"(a) decoded together (`stream_together`)": together,
              "(b) one thread per stream (`generate_ids` each)": thread_each,
              "(c) one stream after the other": one_after_another}
    one_after_another(bundle, requests_for(bundle, 2, 8))  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in setups}
    reference = None
    for _ in range(args.repeats):
        for name, run in setups.items():  # alternating, so drift hits all three alike
            generations = requests_for(bundle, args.streams, args.tokens)
            start = time.perf_counter()
            texts = run(bundle, generations)
            seconds[name].append(time.perf_counter() - start)
            assert all(g.completion_tokens == args.tokens for g in generations), name
            reference = reference or texts
            assert texts == reference, f"{name}: a text differs from the other setups'"
    total = args.streams * args.tokens
    rate = {name: total / statistics.median(s) for name, s in seconds.items()}
    print(f"\nChat streams decoded together, {date.today()}, {args.threads} torch thread(s); Llama {params / 1e6:.1f}M "
          f"params, {args.streams} streams x {args.tokens} tokens, median of {args.repeats}\n")
    print("| setup | tokens/s | vs (b) |\n|---|---|---|")
    b = rate["(b) one thread per stream (`generate_ids` each)"]
    for name, r in rate.items():
        print(f"| {name} | {r:.0f} | {r / b:.2f}x |")
    a = rate["(a) decoded together (`stream_together`)"]
    print(f"\n**a/b = {a / b:.2f}** (goal >= 2 at 8 streams); the texts were equal in every setup and repeat.")


if __name__ == "__main__":
    main()
