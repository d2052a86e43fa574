"""Serving throughput and latency: the same model three ways, measured in one run.

    python benchmarks/serve_throughput.py            # ~8 minutes on 2 cores; run it alone

(a) the Flotilla endpoint as it deploys by default (Ray Serve, dynamic batching, one replica with
    one CPU; `serve.ingress: auto`, which on the local Ray it starts is Serve's HAProxy ingress),
    and (a') the same behind Serve's Python proxy (`serve.ingress: proxy`, on a Ray started for it);
(b) plain FastAPI + uvicorn calling the model once per request (benchmarks/_plain_fastapi.py);
(c) the model's raw batched forward in-process (no HTTP), batches of `--batch`;
and, as a bound, (b)'s server answering the same requests without the model (HTTP alone).
All three use one torch thread. The model is a wide MLP on the digits sample, trained for one
epoch and registered in a temporary MLflow store; (a) loads it from the registry, (b) and (c)
from the same bundle. A load generator (aiohttp, 127.0.0.1) keeps `c` requests of one row
in flight for `--seconds` at c = 1, 8, 32 and records every latency; then requests of `--batch`
rows at c = 8. Each point is measured in `--rounds` turns, (a) and (b) alternating (then (a') and
(b) again), so that this noisy machine's ups and downs fall on both.
Goals: (a) >= 1.5 x (b) in throughput at c=32; (a) p50 at c=1 within 3 ms of (b);
(a) with requests of `--batch` rows >= 0.7 x (c) in rows/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import numpy as np  # noqa: E402

from flotilla.spec import load_spec  # noqa: E402

CONCURRENCY = (1, 8, 32)


async def drive(url: str, rows: list, concurrency: int, seconds: float, warmup_s: float = 2.0,
                unwrap: bool = False) -> dict:
    """Keep `concurrency` requests in flight; return req/s and latency percentiles (ms). A request
    carries one of `rows`, or with `unwrap` one item of `rows` that is itself a list of rows."""
    import aiohttp

    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        measure_from, stop_at = start + warmup_s, start + warmup_s + seconds

        async def client(i: int):
            nonlocal errors
            k = i
            while True:
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                body = {"instances": rows[k % len(rows)] if unwrap else [rows[k % len(rows)]]}
                k += concurrency
                async with session.post(url, json=body) as r:
                    await r.read()
                    ok = r.status == 200
                t1 = time.perf_counter()
                if t0 >= measure_from:
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return _summary(latencies, seconds, errors)


def _summary(latencies: list[float], seconds: float, errors: int) -> dict:
    lat = np.asarray(latencies) * 1000
    return {
        "rps": len(lat) / seconds,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        "errors": errors,
        "latencies_s": latencies,
    }


def measure(urls: list[str], rows: list, seconds: float, batch: int, rounds: int) -> list[dict]:
    """For each of `urls`: one-row requests at each of CONCURRENCY, then requests of `batch` rows at
    c=8 ("batched", its rps in rows/s). Each point is measured in `rounds` turns of seconds/rounds,
    the servers taking turns, so that the machine's ups and downs fall on all of them alike."""
    batches = [rows[i:i + batch] for i in range(0, len(rows) - batch + 1, batch)]
    points = [(c, rows, c, False) for c in CONCURRENCY] + [("batched", batches, 8, True)]
    out: list[dict] = [{} for _ in urls]
    for key, items, c, unwrap in points:
        parts: list[list[dict]] = [[] for _ in urls]
        for _ in range(rounds):
            for i, url in enumerate(urls):
                parts[i].append(asyncio.run(drive(url, items, c, seconds / rounds, unwrap=unwrap)))
        for i in range(len(urls)):
            merged = _summary([x for p in parts[i] for x in p["latencies_s"]], seconds, sum(p["errors"] for p in parts[i]))
            out[i][key] = {**merged, "rows_per_s": merged["rps"] * batch} if unwrap else merged
    for result in out:
        for point in result.values():
            point.pop("latencies_s")
    return out


def raw_forward(bundle, rows: list, batch: int, seconds: float) -> float:
    """(c): items/s of the model's batched forward on preprocessed rows, in this process."""
    import pandas as pd
    import torch

    torch.set_num_threads(1)
    x = bundle.transform(pd.DataFrame(np.asarray(rows[:batch]), columns=bundle.schema.feature_columns))
    with torch.no_grad():
        for _ in range(3):
            bundle.model(x)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            bundle.model(x)
            n += len(x)
    return n / (time.perf_counter() - start)


def wait_http(url: str, timeout_s: float = 120) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up in {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="[4096,4096,4096]", help="MLP hidden sizes (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point")
    parser.add_argument("--batch", type=int, default=32, help="max batch size of (a) and the batch of (c)")
    parser.add_argument("--rounds", type=int, default=4, help="turns each point is measured in, servers alternating")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_throughput.json"))
    args = parser.parse_args()

    import ray

    from flotilla.serve import deploy, load_version, plan_deployment
    from flotilla.pipeline import run_training
    from tests.services import free_port

    with tempfile.TemporaryDirectory(prefix="flotilla-serve-bench-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        spec = load_spec(ROOT / "configs" / "digits.yaml", [
            f"train.storage_path={tmp}", f"track.uri={uri}", "track.gate.require=[]", "train.epochs=1",
            f"model.hidden={args.hidden}", "train.num_workers=1",
            f"serve.port={free_port()}", "serve.replica.num_cpus=1", "serve.autoscaling.min_replicas=1",
            "serve.autoscaling.max_replicas=1", f"serve.batching.max_batch_size={args.batch}",
        ])
        outcome = run_training(spec)
        rows, _ = _val_rows(spec)
        plan = plan_deployment(spec)
        bundle = load_version(plan.model, next(iter(plan.traffic)), plan.tracking_uri)
        params = sum(p.numel() for p in bundle.model.parameters())

        items_c = raw_forward(bundle, rows, args.batch, args.seconds)
        single_c = _single_forward_ms(bundle, rows)

        port = free_port()
        plain = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "_plain_fastapi.py"), str(outcome.bundle_path),
                                  str(port)], env={**os.environ, "OMP_NUM_THREADS": "1"})
        from ray import serve

        from flotilla.serve import running_ingress

        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            http_floor = asyncio.run(drive(f"http://127.0.0.1:{port}/noop", rows, 32, args.seconds))["rps"]
            # (a) as deployed by default (the local Ray that `deploy` starts has Serve's HAProxy
            # ingress), taking turns with (b).
            endpoint = deploy(plan)
            ingress = running_ingress()
            a, b = measure([endpoint.url + "/predict", f"http://127.0.0.1:{port}/predict"], rows, args.seconds,
                           args.batch, args.rounds)
            serve.shutdown()
            ray.shutdown()
            # (a') the same endpoint behind Serve's Python proxy (a Ray started with it), with (b) again.
            proxy_spec = spec.model_copy(update={"serve": spec.serve.model_copy(update={"ingress": "proxy"})})
            endpoint = deploy(plan_deployment(proxy_spec))
            a_proxy, b_again = measure([endpoint.url + "/predict", f"http://127.0.0.1:{port}/predict"], rows,
                                       args.seconds, args.batch, args.rounds)
            serve.shutdown()
            ray.shutdown()
        finally:
            plain.terminate()
            plain.wait(timeout=30)

    report(args, params, single_c, items_c, ingress, a, a_proxy, b, b_again, http_floor)


def _val_rows(spec):
    import pyarrow.parquet as pq

    from flotilla.data import resolve_source, split_rows

    df = pq.read_table(resolve_source("digits").paths[0]).to_pandas()
    val = split_rows(df, spec.data.split_seed, spec.data.val_fraction, "val")
    return val.drop(columns=["target"]).to_numpy().tolist(), val["target"].to_numpy()


def _single_forward_ms(bundle, rows) -> float:
    import pandas as pd
    import torch

    x = bundle.transform(pd.DataFrame(np.asarray(rows[:1]), columns=bundle.schema.feature_columns))
    with torch.no_grad():
        for _ in range(3):
            bundle.model(x)
        start = time.perf_counter()
        for _ in range(50):
            bundle.model(x)
    return (time.perf_counter() - start) / 50 * 1000


def report(args, params: int, single_ms: float, items_c: float, ingress: str | None, a: dict, a_proxy: dict,
           b: dict, b_again: dict, http_floor: float) -> None:
    """(a) and (a') are each compared with the (b) measured in turns with it: b and b' below."""
    lines = [
        f"Serving, {time.strftime('%Y-%m-%d')}, 2 cores, one torch thread everywhere; MLP {args.hidden} on digits "
        f"({params / 1e6:.1f}M parameters; forward of 1 row {single_ms:.1f} ms, of {args.batch} rows "
        f"{args.batch / items_c * 1000:.1f} ms); one replica with one CPU. "
        f"(a) is the default deployment (`serve.ingress: auto`: {ingress} on the local Ray it starts)",
        "",
        "| requests | (a) Flotilla, default | (b) FastAPI | a / b | (a') Flotilla, proxy | (b') FastAPI | a' / b' "
        "| p50 / p99 ms: (a) | (b) | (a') | (b') |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def rate(m: dict) -> float:
        return m.get("rows_per_s", m["rps"])

    for key in (*CONCURRENCY, "batched"):
        label = f"1 row, c={key} (req/s)" if key != "batched" else f"{args.batch} rows, c=8 (rows/s)"
        ms = [m[key] for m in (a, b, a_proxy, b_again)]
        lines.append(
            f"| {label} | {rate(ms[0]):.0f} | {rate(ms[1]):.0f} | {rate(ms[0]) / rate(ms[1]):.2f} | {rate(ms[2]):.0f} "
            f"| {rate(ms[3]):.0f} | {rate(ms[2]) / rate(ms[3]):.2f} | "
            + " | ".join(f"{m['p50_ms']:.1f} / {m['p99_ms']:.1f}" for m in ms) + " |"
        )
    lines += [
        "",
        f"(c) raw batched forward, {args.batch} rows a call: {items_c:.0f} rows/s. HTTP alone (the same FastAPI + "
        f"uvicorn answering one-row requests without the model, c=32): {http_floor:.0f} req/s, i.e. "
        f"{1000 / http_floor:.2f} ms a request. Each point: {args.seconds:g} s in {args.rounds} turns, a and b "
        "alternating.",
        "",
    ]
    for name, m, base in (("(a) the default", a, b), ("(a') serve.ingress=proxy", a_proxy, b_again)):
        lines.append(
            f"Goals for {name}: a/b at c=32 = {m[32]['rps'] / base[32]['rps']:.2f} (>= 1.5); p50 at c=1: a - b = "
            f"{m[1]['p50_ms'] - base[1]['p50_ms']:+.1f} ms (<= 3); {args.batch}-row requests: a/c = "
            f"{m['batched']['rows_per_s'] / items_c:.2f} (>= 0.7); "
            f"errors {sum(r['errors'] for r in m.values())} (b: {sum(r['errors'] for r in base.values())})."
        )
    print("\n" + "\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ingress": ingress, "a": a, "a_proxy": a_proxy, "b": b, "b_again": b_again,
                                          "c_rows_per_s": items_c, "http_floor_rps": http_floor, "params": params,
                                          "single_forward_ms": single_ms, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # tests.services.free_port
    main()
