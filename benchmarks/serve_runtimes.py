"""Serving by runtime: the same registered model served by torch, ONNX and int8 ONNX, one run.

    python benchmarks/serve_runtimes.py             # ~3 minutes on 2 cores; run it alone

The model of benchmarks/serve_throughput.py (a wide MLP on digits, one epoch), registered in a
temporary store; `flotilla export` builds and gates its variants; then, for each of
`serve.runtime` = torch, onnx, onnx-int8, one replica with one CPU behind the default ingress:
p50 / p99 of one-row requests at c=1, and rows/s of 32-row requests at c=8. Beside it, the
runtime's batched forward in this process (no HTTP) on 32 rows, with one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_throughput import _val_rows, drive, raw_forward  # noqa: E402

from flotilla.spec import load_spec  # noqa: E402

RUNTIMES = ("torch", "onnx", "onnx-int8")


async def drive_rows(url: str, rows: list, per_request: int, concurrency: int, seconds: float) -> float:
    """Rows/s with `concurrency` requests of `per_request` rows in flight."""
    batches = [rows[i:i + per_request] for i in range(0, len(rows) - per_request, per_request)]
    result = await drive(url, batches, concurrency, seconds, unwrap=True)
    return result["rps"] * per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="[4096,4096,4096]", help="MLP hidden sizes (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per point")
    args = parser.parse_args()

    import ray
    from ray import serve

    from flotilla.export import export_model
    from flotilla.serve import RUNTIME_HEADER, deploy, load_version, plan_deployment, running_ingress
    from flotilla.pipeline import run_training
    from tests.services import free_port

    results = {}
    with tempfile.TemporaryDirectory(prefix="flotilla-runtime-bench-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        overrides = [
            f"train.storage_path={tmp}", f"track.uri={uri}", "track.gate.require=[]", "train.epochs=1",
            f"model.hidden={args.hidden}", "train.num_workers=1", f"serve.port={free_port()}",
            "serve.replica.num_cpus=1", "serve.autoscaling.min_replicas=1", "serve.autoscaling.max_replicas=1",
        ]
        spec = load_spec(ROOT / "configs" / "digits.yaml", overrides)
        run_training(spec)
        exported = export_model("digits/1", tracking_uri=uri)
        print(exported.describe())
        rows, _ = _val_rows(spec)
        import torch

        torch.set_num_threads(1)  # as in a replica with one CPU (ONNX Runtime takes torch's count)
        for runtime in RUNTIMES:
            bundle = load_version("digits", "1", uri, runtime=runtime)
            items = raw_forward(bundle, rows, 32, args.seconds)
            endpoint = deploy(plan_deployment(load_spec(ROOT / "configs" / "digits.yaml",
                                                        [*overrides, f"serve.runtime={runtime}"])))
            url = endpoint.url + "/predict"
            ingress = running_ingress()
            import requests

            answered = requests.post(url, json={"instances": rows[:1]}, timeout=60).headers[RUNTIME_HEADER]
            assert answered == runtime, (runtime, answered)
            one = asyncio.run(drive(url, rows, 1, args.seconds))
            batched = asyncio.run(drive_rows(url, rows, 32, 8, args.seconds))
            results[runtime] = {"items": items, "one": one, "batched": batched, "gate": exported.records.get(runtime)}
            serve.delete(endpoint.app_name)
        serve.shutdown()
        ray.shutdown()

    lines = [
        f"Serving by runtime, {time.strftime('%Y-%m-%d')}, 2 cores; MLP {args.hidden} on digits (1 epoch); one "
        f"replica with one CPU, ingress {ingress} (the default's choice); {args.seconds:g} s per point",
        "",
        "| serve.runtime | gate | p50 / p99 ms, 1 row, c=1 | rows/s, 32-row requests, c=8 | batched forward, 32 rows, in-process (rows/s) |",
        "|---|---|---:|---:|---:|",
    ]
    for runtime, r in results.items():
        gate = "-" if runtime == "torch" else ("passed" if r["gate"]["passed"] else "failed")
        lines.append(f"| {runtime} | {gate} | {r['one']['p50_ms']:.1f} / {r['one']['p99_ms']:.1f} | {r['batched']:.0f} "
                     f"| {r['items']:.0f} |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # tests.services.free_port
    main()
