"""Sweep hyperparameters with Ray Tune; every trial is an ordinary Flotilla training run.

    python tune/sweep.py --config configs/digits_sweep.yaml --set tune.num_samples=16
    ray job submit --working-dir . -- python tune/sweep.py --config configs/digits_sweep.yaml

Running the same command again (same `tune.name`) resumes an interrupted sweep: finished trials
are kept, unfinished ones resume from their checkpoints. Exit codes: 0 done, 2 bad spec, input
or tracking URI, 1 failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from flotilla import FlotillaError, load_spec  # noqa: E402
from flotilla.errors import DataError, SpecError, TrackingError  # noqa: E402

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits_sweep.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="sweep spec YAML (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set tune.num_samples=16 (repeatable)")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.config, args.overrides)
        if spec.tune is None:
            raise SpecError([f"{args.config} has no `tune` section; see configs/digits_sweep.yaml"], args.config)
        from flotilla.tune import run_sweep

        outcome = run_sweep(spec)
    except FlotillaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (SpecError, DataError, TrackingError)) else 1
    print(outcome.table())
    if outcome.best is None:
        print(f"sweep {outcome.name}: no trial completed")
        return 1
    print(f"sweep {outcome.name}: best {outcome.best.run_name} {outcome.metric} {outcome.best.metric:.4f}")
    if outcome.parent_run_id:
        print(f"MLflow parent run {outcome.parent_run_id} at {outcome.tracking_uri}")
    if outcome.registration is not None:
        print(outcome.registration.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
