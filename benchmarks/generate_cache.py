"""Generation with the KV cache against the loop that recomputes the context for every token.

    python benchmarks/generate_cache.py                    # ~1 minute; run it alone
    python benchmarks/generate_cache.py --bundle runs/pycode-gpt-.../bundle

One bundle, one process, the same prompts and seeds: tokens/s for `--tokens` new tokens (default
256, twice `pycode_gpt.yaml`'s context of 128, so the window moves), the cached path
(`InferenceBundle.generate`) against `cache=False`, alternating, `--repeats` times each; the
texts must be equal. Without `--bundle`, the model of `configs/pycode_gpt.yaml` with random
weights: the speed does not depend on what the weights learned. Goal: >= 3x.

Then batched decoding: `--batch` requests of 64 tokens (each prompt and its tokens within the
context) decoded together (`generate_batch`, what a replica does with requests that arrive
together) against the same requests one after the other (cached); the texts must be equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

import torch  # noqa: E402

from flotilla.bundle import InferenceBundle, load_bundle  # noqa: E402
from flotilla.data import DataSchema  # noqa: E402
from flotilla.models import build_model  # noqa: E402
from flotilla.spec import load_spec  # noqa: E402


def spec_bundle(config: Path) -> InferenceBundle:
    """The spec's gpt with random weights, as a bundle."""
    spec = load_spec(config)
    model_spec = spec.model.model_dump(mode="json")
    schema = DataSchema(task="lm", vocab_size=256, context=spec.model.context, text_column="text")
    torch.manual_seed(0)
    model = build_model(model_spec, schema).eval()
    return InferenceBundle(path=config, model=model, model_spec=model_spec, schema=schema, feature_steps=[],
                           classes=None, metrics={})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="a gpt bundle directory (default: random weights)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "pycode_gpt.yaml")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="requests decoded together (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bundle = load_bundle(args.bundle) if args.bundle else spec_bundle(args.config)
    prompts = ["def main(", "import os\n", "class Node:\n    "]
    bundle.generate(prompts[0], max_tokens=8, seed=0)  # warm up both paths
    bundle.generate(prompts[0], max_tokens=8, seed=0, cache=False)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.repeats):
        texts = {}
        for cache in (False, True):
            start = time.perf_counter()
            texts[cache] = bundle.generate(prompts[i % len(prompts)], max_tokens=args.tokens, temperature=0.8,
                                           top_k=40, seed=i, cache=cache)
            rates[cache].append(args.tokens / (time.perf_counter() - start))
        assert texts[True] == texts[False], f"repeat {i}: the cached text differs from the uncached one"
    cached, uncached = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"model: {bundle.model_spec.get('layers')} layers, width {bundle.model_spec.get('width')}, context "
          f"{bundle.schema.context}; {args.tokens} new tokens, {args.repeats} repeats, {args.threads} threads")
    print("| loop | tokens/s (median) | ratio |")
    print("|---|---:|---:|")
    print(f"| recompute the context each token (`cache=False`) | {uncached:.0f} | 1.00x |")
    print(f"| KV cache (default) | {cached:.0f} | {cached / uncached:.2f}x |")
    print(f"texts equal in all {args.repeats} repeats; goal >= 3x: {'met' if cached / uncached >= 3 else 'NOT met'}")

    starts = ["def main(", "import os\n", "class Node:\n    ", "x = [", "for i in range(", "# a comment\n",
              "return {", "if __name__ =="]
    requests = [{"prompt": starts[i % len(starts)], "max_tokens": 64, "temperature": 0.8, "top_k": 40, "seed": i}
                for i in range(args.batch)]
    bundle.generate_batch(requests[:2])
    together, alone = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        one_by_one = [bundle.generate(**r) for r in requests]
        alone.append(64 * len(requests) / (time.perf_counter() - start))
        start = time.perf_counter()
        batched = bundle.generate_batch(requests)
        together.append(64 * len(requests) / (time.perf_counter() - start))
        assert batched == one_by_one, "a request decoded together wrote another text than alone"
    a, t = statistics.median(alone), statistics.median(together)
    print()
    print(f"| {args.batch} requests of 64 tokens | tokens/s (median) | ratio |")
    print("|---|---:|---:|")
    print(f"| one after the other (KV cache) | {a:.0f} | 1.00x |")
    print(f"| decoded together (`generate_batch`) | {t:.0f} | {t / a:.2f}x |")
    print(f"texts equal in all {args.repeats} repeats")


if __name__ == "__main__":
    main()
