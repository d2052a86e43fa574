"""Sweep overhead: N identical short trials against the ideal N x (one trial) / slots.

    python benchmarks/tune_overhead.py --trials 4        # ~6 minutes on 2 cores; run it alone

Both sides are measured in this run, on the same local Ray: first a sweep of one trial (its wall
time, Tune start-up included, is "one trial"), then a sweep of N trials of the same spec (every
trial samples the same single value). ratio = wall(N) / (N x wall(1) / slots); 1.0 is no overhead
beyond running the trials, the goal is <= 1.10. Tracking is off so the ratio is Tune's alone.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

os.environ.setdefault("RAY_DEDUP_LOGS", "1")

from flotilla.spec import load_spec  # noqa: E402
from flotilla.runtime import DATA_CPUS, ensure_ray  # noqa: E402
from flotilla.tune import concurrent_slots, run_sweep  # noqa: E402


def sweep_wall(storage: str, name: str, trials: int, epochs: int) -> float:
    spec = load_spec(ROOT / "configs" / "digits_sweep.yaml", [
        f"train.storage_path={storage}", "track.enabled=false", f"train.epochs={epochs}", f"tune.name={name}",
        "tune.scheduler=fifo", f"tune.num_samples={trials}", "tune.space={train.seed: {choice: [0]}}",
    ])
    started = time.perf_counter()
    outcome = run_sweep(spec)
    wall = time.perf_counter() - started
    assert all(t.status == "completed" for t in outcome.trials), outcome.table()
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    spec = load_spec(ROOT / "configs" / "digits_sweep.yaml")
    ensure_ray(spec.model_copy(update={"tune": None}))  # dashboard on: Ray Train's PG cleaner needs it
    import ray

    slots = concurrent_slots(spec, ray.cluster_resources(), DATA_CPUS)
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-") as storage:
        one = sweep_wall(storage, "one", 1, args.epochs)
        many = sweep_wall(storage, "many", args.trials, args.epochs)
    ideal = args.trials * one / slots
    ratio = many / ideal
    cpus = int(ray.cluster_resources().get("CPU", 0))
    print(f"\nSweep overhead, {time.strftime('%Y-%m-%d')}, local Ray with {cpus} CPUs, {slots} trial slot(s); "
          f"digits MLP, 1 worker per trial, {args.epochs} epochs per trial\n")
    print("| measurement | seconds |\n|---|---|")
    print(f"| one trial (a sweep of 1, start-up included) | {one:.1f} |")
    print(f"| {args.trials} identical trials | {many:.1f} |")
    print(f"| ideal: {args.trials} x one trial / {slots} slot(s) | {ideal:.1f} |")
    print(f"\n**ratio = {ratio:.2f}** (goal <= 1.10){'' if math.isfinite(ratio) else ' (not measured)'}")
    ray.shutdown()


if __name__ == "__main__":
    main()
