"""Move a registered model's alias: promote a version, or roll `champion` back.

    python pipelines/promote.py --model digits --version 3                 # v3 becomes champion
    python pipelines/promote.py --model digits --version 4 --alias candidate
    python pipelines/promote.py --model digits --rollback                  # champion back to the one before
    python pipelines/promote.py --config configs/digits.yaml --rollback    # model name and store from a spec

The tracking store is `--tracking-uri`, else the spec's `track.uri`, else $MLFLOW_TRACKING_URI,
else ./mlruns/mlflow.db. Exit codes: 0 done, 2 bad arguments or unknown model/version, 1 other.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from flotilla import FlotillaError, load_spec  # noqa: E402
from flotilla.errors import SpecError, TrackingError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="registered model name (default: the spec's track.model_name or name)")
    parser.add_argument("--config", help="run spec whose track section names the model and the store")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (overrides the spec)")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--version", help="version to point the alias at")
    action.add_argument("--rollback", action="store_true", help="point champion back at the previous champion")
    parser.add_argument("--alias", default="champion", help="alias to move with --version (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        from mlflow import MlflowClient

        from flotilla.track import check_tracking_uri, resolve_tracking_uri, rollback_champion, set_alias

        spec = load_spec(args.config) if args.config else None
        name = args.model or (spec and (spec.track.model_name or spec.name))
        if not name:
            raise TrackingError("name the model: --model NAME, or --config SPEC.yaml")
        uri, _ = resolve_tracking_uri(args.tracking_uri or (spec.track.uri if spec else None))
        check_tracking_uri(uri)
        client = MlflowClient(uri)
        if args.rollback:
            change = rollback_champion(client, name)
            print(change.describe("rolled back"))
        else:
            change = set_alias(client, name, args.alias, args.version)
            print(change.describe("promoted"))
    except FlotillaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (SpecError, TrackingError)) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
