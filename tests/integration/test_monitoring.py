"""Monitoring: a real Prometheus, configured from ops/prometheus.yml, scrapes the local Ray cluster
while the session's champion run trains and a Serve endpoint works; Flotilla's metrics come back
through its HTTP API, and every query of ops/grafana/flotilla.json is valid against it."""

from __future__ import annotations

import json
import re
import time

import pytest
import requests

from tests.integration._helpers import ROOT, digits_val_rows
from tests.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def query(url: str, expr: str) -> list[dict]:
    body = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def wait_for_value(url: str, expr: str, timeout_s: float = 60) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        result = query(url, expr)
        if result:
            return float(result[0]["value"][1])
        assert time.monotonic() < deadline, f"Prometheus returned nothing for {expr} within {timeout_s:.0f}s"
        time.sleep(1)


@pytest.fixture(scope="module", autouse=True)
def _prometheus_stops_after_this_module(prometheus):
    """The session's Prometheus has served its purpose once these tests ran (tests/conftest.py)."""
    yield
    prometheus.stop()


@pytest.fixture(scope="module")
def trained(prometheus, digits_champion):
    # The session's champion run (tests/conftest.py), trained while `prometheus` scraped the cluster.
    return digits_champion.spec, digits_champion.outcome


def test_training_metrics_reach_prometheus(prometheus, trained):
    spec, outcome = trained
    run = f'run="{outcome.run_name}"'
    # Per-rank throughput, summed over ranks: positive and of the order the run itself reported.
    throughput = wait_for_value(prometheus.url, f"max_over_time((sum by (run) (ray_flotilla_train_samples_per_s{{{run}}}))[1h:1s])")
    best_epoch = max(m["samples_per_s"] for m in outcome.history)
    assert 0 < throughput < 3 * best_epoch, (throughput, best_epoch)
    # Samples counted by the ranks: at least one exported epoch, never more than the run processed.
    samples = wait_for_value(prometheus.url, f"max_over_time((sum by (run) (ray_flotilla_train_samples_total{{{run}}}))[1h:1s])")
    assert 0 < samples <= spec.train.epochs * 1445, samples  # 1445 train rows per epoch
    loss = wait_for_value(prometheus.url, f"min_over_time((avg by (run) (ray_flotilla_train_loss{{{run}}}))[1h:1s])")
    assert 0 < loss < 2.5, loss  # cross-entropy over 10 classes starts near ln(10) = 2.3 and falls
    steps = wait_for_value(prometheus.url, f"max_over_time((sum by (run) (ray_flotilla_train_step_seconds_count{{{run}}}))[1h:1s])")
    assert steps > 0
    ranks = query(prometheus.url, f"count by (run) (last_over_time(ray_flotilla_train_loss{{{run}}}[1h]))")
    assert float(ranks[0]["value"][1]) == spec.train.num_workers


def test_serving_metrics_reach_prometheus(prometheus, trained):
    from ray import serve

    from flotilla.serve import deploy, plan_deployment

    spec, _ = trained
    port = free_port()
    served = spec.model_copy(update={"serve": spec.serve.model_copy(update={
        "port": port, "replica": spec.serve.replica.model_copy(update={"num_cpus": 0.5})})})
    try:
        app = deploy(plan_deployment(served))
        rows, _ = digits_val_rows(spec)
        for i in range(12):
            r = requests.post(app.url + "/predict", json={"instances": rows.iloc[i:i + 2].to_numpy().tolist()}, timeout=60)
            assert r.status_code == 200, r.text
        assert requests.post(app.url + "/predict", json={"instances": []}, timeout=60).status_code == 422
        ok = 'model="digits", version="1", status="200"'
        assert wait_for_value(prometheus.url, f"sum(ray_flotilla_requests_total{{{ok}}}) >= 12") >= 12
        assert wait_for_value(prometheus.url, 'sum(ray_flotilla_requests_total{model="digits", status="422"})') >= 1
        assert wait_for_value(prometheus.url, 'sum(ray_flotilla_forward_latency_ms_count{model="digits"})') >= 1
        assert wait_for_value(prometheus.url, "sum(ray_serve_deployment_replica_healthy)") >= 1
        check_dashboard_queries(prometheus.url)
    finally:
        serve.shutdown()


def check_dashboard_queries(url: str) -> None:
    """Every panel's query parses and runs; the training and serving panels show this session's data."""
    dashboard = json.loads((ROOT / "ops" / "grafana" / "flotilla.json").read_text())
    queries = [
        (panel["title"], re.sub(r"\$(run|model)\b", ".*", target["expr"]))
        for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    assert len(queries) > 20
    with_data: set[str] = set()
    # A rate() needs two scrapes of a series that may be seconds old; Ray's node and autoscaler
    # metrics come from other exporters than Flotilla's and may start later.
    deadline = time.monotonic() + 60
    wanted = {"Throughput (samples/s)", "Loss", "Step time p50 / p99", "Requests per second",
              "Request latency p50 / p99", "Batch size", "Replicas"}
    cluster = {"CPU per node", "Memory per node", "Nodes by type", "Cluster CPUs and GPUs"}

    def complete() -> bool:
        return wanted <= with_data and bool(cluster & with_data)

    while True:
        for title, expr in queries:
            if query(url, f"last_over_time(({expr})[1h:5s])"):  # raises on a query Prometheus rejects
                with_data.add(title)
        if complete() or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert complete(), (f"panels without data: {sorted((wanted | cluster) - with_data)}; "
                        f"with data: {sorted(with_data)}")
