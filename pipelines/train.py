"""Train one run: preprocess → train (Ray Train + DeepSpeed) → evaluate → bundle.

    python pipelines/train.py --config configs/digits.yaml --set train.lr=3e-4
    ray job submit --working-dir . -- python pipelines/train.py --config configs/digits.yaml

With no Ray cluster running it starts a local one; under `ray job submit` (or with
RAY_ADDRESS set) it uses that cluster. The run is recorded in MLflow (`track.uri`, default
./mlruns) and its bundle registered. Exit codes: 0 done, 2 bad spec, input or tracking URI, 1 failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The checkout runs as it is: platform/ holds the package (see ARCHITECTURE.md).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from flotilla import FlotillaError, load_spec, run_training  # noqa: E402
from flotilla.errors import DataError, SpecError, TrackingError  # noqa: E402

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per epoch is the log

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="run spec YAML (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set train.lr=3e-4 (repeatable)")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.config, args.overrides)  # validated before Ray starts
        outcome = run_training(spec)
    except FlotillaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (SpecError, DataError, TrackingError)) else 1
    m = outcome.metrics
    quality = next((f"{k} {m[k]:.4f}" for k in ("val_accuracy", "val_perplexity", "val_rmse") if k in m), "")
    print(f"run {outcome.run_name}: {quality} after {m['epoch']} epochs; bundle at {outcome.bundle_path}")
    if outcome.mlflow_run_id:
        browse = f"; browse: mlflow ui --backend-store-uri {outcome.tracking_uri}" if outcome.tracking_uri.startswith("sqlite") else ""
        print(f"MLflow run {outcome.mlflow_run_id} at {outcome.tracking_uri}{browse}")
    if outcome.registration is not None:
        print(outcome.registration.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
