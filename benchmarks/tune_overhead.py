"""Sweep overhead: how long a trial takes to reach its first training step, and what share of a
sweep's wall time its trials spend in training steps.

    python benchmarks/tune_overhead.py --trials 4        # ~4 minutes on 2 cores; run it alone

One sweep of N identical short trials (digits MLP, one Ray Train worker each, tracking off, FIFO).
From each trial's own report stream (Tune's result.json: report time and the trial's elapsed time)
and its first-step time (the `first_step_at` metric the training loop reports):

- start-up: seconds from the trial's start to its first finished training step (worker group,
  process group, DeepSpeed engine, dataset shards); goal: median <= 3 s;
- training share: the trials' time in training epochs (`epoch_time_s`, summed) over the sweep's
  wall time x its trial slots.

Both figures come from one run and do not depend on a baseline absorbing one-time costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from flotilla.runtime import DATA_CPUS, ensure_ray  # noqa: E402
from flotilla.spec import load_spec  # noqa: E402
from flotilla.pipeline import run_sweep  # noqa: E402
from flotilla.tune import concurrent_slots  # noqa: E402


def trial_reports(sweep_dir: Path) -> dict[str, list[dict]]:
    """Each trial's reports, in order, from Tune's result.json files."""
    return {f.parent.name: [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            for f in sorted(sweep_dir.glob("*/result.json"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-") as storage:
        spec = load_spec(ROOT / "configs" / "digits_sweep.yaml", [
            f"train.storage_path={storage}", "track.enabled=false", f"train.epochs={args.epochs}",
            "tune.name=overhead", "tune.scheduler=fifo", f"tune.num_samples={args.trials}",
            "tune.space={train.seed: {choice: [0]}}",
        ])
        ensure_ray(spec.model_copy(update={"tune": None}))  # dashboard on: Ray Train's PG cleaner needs it
        import ray

        slots = concurrent_slots(spec, ray.cluster_resources(), DATA_CPUS)
        started = time.perf_counter()
        outcome = run_sweep(spec)
        wall = time.perf_counter() - started
        assert all(t.status == "completed" for t in outcome.trials), outcome.table()
        reports = trial_reports(Path(storage) / "overhead")
    startups, training = [], 0.0
    for trial, rows in reports.items():
        first = rows[0]
        trial_start = first["timestamp"] - first["time_total_s"]
        startups.append(first["first_step_at"] - trial_start)
        training += sum(r["epoch_time_s"] for r in rows)
    share = training / (wall * slots)
    cpus = int(ray.cluster_resources().get("CPU", 0))
    print(f"\nSweep overhead, {time.strftime('%Y-%m-%d')}, local Ray with {cpus} CPUs, {slots} trial slot(s); "
          f"{args.trials} trials of the digits MLP, 1 worker each, {args.epochs} epochs per trial; "
          f"sweep wall time {wall:.1f} s\n")
    print("| measurement | value |\n|---|---|")
    print(f"| start-up: trial start to first training step, median (min-max) | {statistics.median(startups):.1f} s "
          f"({min(startups):.1f}-{max(startups):.1f}) |")
    print(f"| training share: time in training epochs / (sweep wall time x {slots} slot(s)) | {share:.1%} |")
    print(f"\nGoal: median start-up <= 3 s: {'met' if statistics.median(startups) <= 3 else 'not met'}.")
    ray.shutdown()


if __name__ == "__main__":
    main()
