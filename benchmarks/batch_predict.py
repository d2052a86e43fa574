"""Batch scoring: rows/s and peak memory of `flotilla predict` (Ray Data, an actor pool) against one
plain process running the same bundle over the same files with pandas, in one run.

    python benchmarks/batch_predict.py                 # ~8 minutes on 2 cores; run it alone
    python benchmarks/batch_predict.py --rows 1000000 --actors 2

The table is the suite's messy one (a string category with gaps, a boolean, numbers with gaps),
written as Parquet files, scored at each size in `--rows`; the model is trained on a sample of it
first (not timed). Flotilla pays a fixed start-up (its actors start and load torch and the bundle)
that a large table amortizes; the last line estimates it from the two sizes. The baseline
reads each file with pyarrow, scores it in batches with `bundle.predict` on one torch thread and
writes the predictions as Parquet. Peak memory: the baseline's own peak RSS; for Flotilla, the
largest sum of the RSS of the driver and every process of its Ray cluster, sampled every 0.2 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT))

from flotilla.runtime import ensure_ray  # noqa: E402
from tests.integration._helpers import messy_table, tables_spec  # noqa: E402

BASELINE = textwrap.dedent("""
    import json, resource, sys, time
    import pyarrow.parquet as pq, torch
    sys.path.insert(0, {platform!r})
    from flotilla.bundle import load_bundle
    torch.set_num_threads(1)
    bundle = load_bundle({bundle!r})
    columns = bundle.schema.feature_columns
    started, rows = time.perf_counter(), 0
    for i, path in enumerate({files!r}):
        df = pq.read_table(path).to_pandas()
        parts = []
        for start in range(0, len(df), {batch}):
            chunk = df.iloc[start:start + {batch}]
            out = bundle.predict(chunk[columns])
            parts.append({{"id": chunk["id"].to_numpy(), "prediction": out["predictions"]}})
            rows += len(chunk)
        import pandas as pd
        pd.concat([pd.DataFrame(p) for p in parts]).to_parquet({out!r} + f"/part-{{i}}.parquet")
    wall = time.perf_counter() - started
    print(json.dumps({{"rows": rows, "wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
""")


class PeakMemory:
    """The largest sum of RSS over this process and every descendant, sampled in a thread."""

    def __init__(self):
        import psutil

        self.me, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            total = 0
            for p in [self.me, *self.me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,8000000",
                        help="table sizes to score, comma-separated (each a multiple of --rows-per-file)")
    parser.add_argument("--rows-per-file", type=int, default=125_000)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4096)
    args = parser.parse_args()
    sizes = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-") as tmp:
        tmp = Path(tmp)
        ensure_ray(num_cpus=args.actors + 1, include_dashboard=False)
        from flotilla.predict import predict_table
        from flotilla.pipeline import run_training

        outcome = run_training(tables_spec(tmp, overrides=["track.enabled=false", "train.epochs=2"]))
        per_file = args.rows_per_file
        rows = []
        for i in range(max(sizes) // per_file):
            df = messy_table(int(per_file * 1.5), seed=100 + i).head(per_file).drop(columns=["answer"])
            df.insert(0, "id", range(i * per_file, (i + 1) * per_file))
            (tmp / f"rows-{i:03d}").mkdir()
            df.to_parquet(tmp / f"rows-{i:03d}" / "part.parquet")
        for size in sizes:
            data = tmp / f"table-{size}"  # the first size // per_file files, linked into a directory of its own
            data.mkdir()
            for i in range(size // per_file):
                (data / f"part-{i:03d}.parquet").symlink_to(tmp / f"rows-{i:03d}" / "part.parquet")
            files = sorted(str(f) for f in data.glob("*.parquet"))
            baseline_out = tmp / f"baseline-{size}"
            baseline_out.mkdir()
            script = BASELINE.format(platform=str(ROOT / "platform"), bundle=str(outcome.bundle_path), files=files,
                                     batch=args.batch_size, out=str(baseline_out))
            proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
            base = json.loads(proc.stdout.strip().splitlines()[-1])
            with PeakMemory() as memory:
                started = time.perf_counter()
                scored = predict_table(outcome.bundle_path, str(data), str(tmp / f"flotilla-{size}"), id_columns=["id"],
                                       actors=args.actors, batch_size=args.batch_size)
                wall = time.perf_counter() - started
            assert scored.predicted + scored.rejected == base["rows"], (scored, base)
            rows.append((size, len(files), base, scored.predicted / wall, wall, memory.peak))
        print(f"\nbatches of {args.batch_size}; {per_file:,} rows a Parquet file; the model: {outcome.bundle_path}")
        print("| rows | one process, pandas + the bundle (1 torch thread) | `flotilla predict`, "
              f"{args.actors} actors | ratio | peak memory: one process / Flotilla (driver + Ray) |")
        print("|---|---|---|---|---|")
        for size, nfiles, base, ours, wall, peak in rows:
            theirs = base["rows"] / base["wall_s"]
            print(f"| {size:,} ({nfiles} files) | {theirs:,.0f} rows/s ({base['wall_s']:.1f} s) | "
                  f"{ours:,.0f} rows/s ({wall:.1f} s) | {ours / theirs:.2f}x | "
                  f"{base['peak_rss_mb']:,.0f} MB / {peak / 2**20:,.0f} MB |")
        if len(rows) > 1:  # wall = start-up + rows / rate, from the two sizes furthest apart
            (n0, *_, w0, _), (n1, *_, w1, _) = rows[0], rows[-1]
            rate = (n1 - n0) / (w1 - w0)
            print(f"\nFlotilla's fixed cost (start-up: actors, torch, the bundle) ~{w0 - n0 / rate:.1f} s; "
                  f"after it, {rate:,.0f} rows/s")


if __name__ == "__main__":
    main()
