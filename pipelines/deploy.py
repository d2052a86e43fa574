"""Deploy a registered model as an HTTP endpoint with Ray Serve, from a run spec's `serve` section.

    python pipelines/deploy.py --config configs/digits.yaml                  # champion, until Ctrl-C
    python pipelines/deploy.py --config configs/digits.yaml --query          # deploy, query once, exit
    python pipelines/deploy.py --config configs/digits.yaml --split champion=90,candidate=10
    python pipelines/deploy.py --config configs/digits.yaml --promote        # candidate -> champion, in place
    ray job submit --working-dir . -- python pipelines/deploy.py --config configs/digits.yaml

Against a running cluster (RAY_ADDRESS, `ray start`, `ray job submit`) the endpoint keeps running
after this script exits, and a second call with the same model updates it in place: requests in
flight finish. With no cluster, a local one is started and lives as long as this script
(`--query` deploys, sends one real request, prints the answer and stops).
Exit codes: 0 done, 2 bad spec, unknown model/alias or tracking URI, 1 other failures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from flotilla import FlotillaError, load_spec  # noqa: E402
from flotilla.errors import ServeError, SpecError, TrackingError  # noqa: E402

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="run spec YAML (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set serve.port=8100 (repeatable)")
    parser.add_argument("--model", help="registered model (default: serve.model, track.model_name, name)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: the spec's track.uri)")
    parser.add_argument("--split", metavar="TARGET=W,...",
                        help="traffic split by alias or version, e.g. champion=90,candidate=10 (sets serve.traffic)")
    parser.add_argument("--promote", action="store_true",
                        help="point `champion` at the `candidate` version and send it all traffic, in place")
    parser.add_argument("--query", action="store_true", help="send one sample request, print the answer, exit")
    parser.add_argument("--delete", action="store_true", help="remove the endpoint")
    args = parser.parse_args(argv)
    try:
        from flotilla.serve import deploy, plan_deployment, traffic_override

        overrides = list(args.overrides)
        if args.split:
            overrides.append(traffic_override(args.split))
        if args.promote:
            overrides.append("serve.traffic={champion: 100}")
        spec = load_spec(args.config, overrides)  # validated before Ray starts
        if args.delete:
            return delete(spec, args.model)
        if args.promote:
            print(promote_candidate(spec, args.model, args.tracking_uri))
        plan = plan_deployment(spec, model=args.model, tracking_uri=args.tracking_uri)
        print(f"deploying {plan.describe()}")
        endpoint = deploy(plan)
    except FlotillaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (SpecError, TrackingError, ServeError)) else 1
    for note in endpoint.notes:
        print(f"note: {note}")
    print(f"serving {endpoint.plan.kind} {plan.model} at {endpoint.url}  (docs: {endpoint.url}/docs)")
    if args.query:
        return query(endpoint)
    from flotilla.train import started_local_ray

    if started_local_ray():
        print("no Ray cluster was running, so this one lives as long as this script: Ctrl-C stops it")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def promote_candidate(spec, model: str | None, tracking_uri: str | None) -> str:
    from mlflow import MlflowClient

    from flotilla.track import CANDIDATE, CHAMPION, alias_version, resolve_tracking_uri, set_alias

    from flotilla.serve import served_model

    name = served_model(spec, model)
    uri, _ = resolve_tracking_uri(tracking_uri or spec.track.uri)
    client = MlflowClient(uri)
    version = alias_version(client, name, CANDIDATE)
    if version is None:
        raise ServeError(f"{name} has no `candidate` version to promote")
    return set_alias(client, name, CHAMPION, version).describe("promoted")


def delete(spec, model: str | None) -> int:
    from ray import serve

    from flotilla.train import ensure_ray

    from flotilla.serve import served_model

    ensure_ray()
    name = served_model(spec, model)
    serve.delete(name)
    print(f"deleted the endpoint {name}")
    return 0


def query(endpoint) -> int:
    import requests

    from flotilla.serve import VERSION_HEADER, sample_request

    path, body = sample_request(endpoint.plan)
    response = requests.post(endpoint.url + path, json=body, timeout=60)
    print(f"POST {endpoint.url}{path} -> {response.status_code} from v{response.headers.get(VERSION_HEADER)}")
    if response.status_code != 200:
        print(response.text, file=sys.stderr)
        return 1
    answer = response.json()
    if "text" in answer:
        print(f"prompt {body['prompt']!r} -> {answer['text']!r}")
    else:
        probs = [max(p) for p in answer.get("probabilities") or []]
        shown = ", ".join(f"{pred} (p={p:.2f})" for pred, p in zip(answer["predictions"], probs)) or json.dumps(answer["predictions"])
        print(f"{len(body['instances'])} rows -> predictions {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
