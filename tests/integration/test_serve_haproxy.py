"""Serve's HAProxy ingress (`serve.ingress: haproxy`): the replicas answer HTTP themselves and the
HAProxy that ships with Ray balances them on `serve.port`.

Serve reads the setting when its processes start, so this module needs a Ray of its own: it
shuts the session's cluster down, lets `deploy` start a local one from a spec that asks for
HAProxy (the path `flotilla deploy` and `flotilla train` take) to serve the session's digits model,
and shuts that one down at the end (the next module's `ray_cluster` starts the usual one again).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import requests

from flotilla.bundle import load_bundle
from flotilla.runtime import HAPROXY_ENV
from tests.integration._helpers import digits_spec, digits_val_rows
from tests.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def haproxy_endpoint(digits_champion, tmp_path_factory):
    import ray

    from flotilla.serve import deploy, plan_deployment
    from flotilla.runtime import started_local_ray

    if ray.is_initialized():
        ray.shutdown()
    haproxies: list[psutil.Process] = []
    store = tmp_path_factory.mktemp("haproxy")
    digits_champion.store_copy(store)  # the session's digits v1 (champion)
    outcome = digits_champion.outcome
    port = free_port()
    spec = digits_spec(
        store, f"serve.port={port}", "serve.ingress=haproxy", "serve.replica.num_cpus=0.5",
        "serve.autoscaling.min_replicas=2", "serve.autoscaling.max_replicas=2", "serve.health_check_period_s=2",
        "serve.max_instances=64",
    )
    try:
        # No Ray is running: deploy starts the local cluster, with HAProxy ingress for this spec
        # (the path `flotilla deploy` takes; `flotilla train` starts it the same way).
        endpoint = deploy(plan_deployment(spec))
        assert started_local_ray()
        assert not HAPROXY_ENV.keys() & os.environ.keys()  # Ray's processes got them, this one kept its own
        haproxies = [p for p in psutil.process_iter(["name", "cmdline"])
                     if p.info["name"] == "haproxy" and "haproxy-serve" in " ".join(p.info["cmdline"] or [])]
        yield {"spec": spec, "outcome": outcome, "endpoint": endpoint, "port": port, "haproxies": haproxies}
    finally:
        # The whole local cluster goes, HAProxy with it (serve.shutdown() first would wait out
        # direct ingress's 30 s drain for replicas no request can reach any more).
        if ray.is_initialized():
            ray.shutdown()
    # HAProxy is a child of Serve's HAProxyManager actor, outside Ray's own process tree: make sure
    # it went with the cluster (it holds serve.port and, on all interfaces, its stats port).
    _, alive = psutil.wait_procs(haproxies, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"HAProxy outlived the cluster: {[p.pid for p in alive]}"


def _listening(port_filter) -> dict[int, str]:
    return {c.laddr.port: c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and port_filter(c.laddr.port)}


def test_haproxy_answers_like_the_bundle_and_every_replica_listens_on_localhost(haproxy_endpoint):
    from flotilla.serve import VERSION_HEADER, running_ingress

    assert running_ingress() == "haproxy"
    assert haproxy_endpoint["haproxies"], "no HAProxy process found"
    endpoint, spec = haproxy_endpoint["endpoint"], haproxy_endpoint["spec"]
    assert endpoint.url.startswith(f"http://127.0.0.1:{haproxy_endpoint['port']}/")
    rows, _ = digits_val_rows(spec)
    rows = rows.iloc[:40]
    r = requests.post(endpoint.url + "/predict", json={"instances": rows.to_numpy().tolist()}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers[VERSION_HEADER] == "1"
    expected = load_bundle(haproxy_endpoint["outcome"].bundle_path).predict(rows)
    assert r.json()["predictions"] == list(expected["predictions"])
    np.testing.assert_allclose(r.json()["probabilities"], expected["probabilities"], atol=1e-5)

    # HAProxy on serve.port and each of the 2 replicas on a port of its own, all on 127.0.0.1.
    assert _listening(lambda p: p == haproxy_endpoint["port"]) == {haproxy_endpoint["port"]: "127.0.0.1"}
    replica_ports = _listening(lambda p: 30000 <= p < 31000)  # Serve's direct-ingress port range
    assert len(replica_ports) == 2 and set(replica_ports.values()) == {"127.0.0.1"}, replica_ports


def test_haproxy_passes_client_errors_through_and_holds_under_load(haproxy_endpoint):
    url = haproxy_endpoint["endpoint"].url + "/predict"
    r = requests.post(url, json={"instances": [[0.0] * 63]}, timeout=30)
    assert r.status_code == 422 and "instances[0]" in r.json()["error"]
    r = requests.post(url, data=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    unknown = requests.post(url.replace("/digits", "/nope"), json={"instances": [[0.0] * 64]}, timeout=30)
    assert unknown.status_code == 404, (unknown.status_code, unknown.text)

    rows, _ = digits_val_rows(haproxy_endpoint["spec"])
    bodies = [{"instances": [row]} for row in rows.to_numpy().tolist()[:300]]
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda b: requests.post(url, json=b, timeout=60).status_code, bodies))
    assert statuses == [200] * len(bodies)
