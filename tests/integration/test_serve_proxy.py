"""Serve's Python proxy (`serve.ingress: proxy`): what a cluster started without HAProxy ingress
runs. The rest of the serving tests run on the default, which on the local Ray Flotilla starts is
HAProxy ingress.

Serve reads the choice when its processes start, so this module needs a Ray of its own: it shuts
the session's cluster down (and checks that its HAProxy went with it), lets `deploy` start a
local one from a spec that asks for the proxy (the path `flotilla deploy` and `flotilla train`
take) to serve the session's digits model, and shuts that one down at the end (the next module's
`ray_cluster` starts the usual one again).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import requests

from flotilla.bundle import load_bundle
from tests.integration._helpers import digits_spec, digits_val_rows, haproxy_processes
from tests.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def proxy_endpoint(digits_champion, tmp_path_factory):
    import ray

    from flotilla.serve import deploy, plan_deployment
    from flotilla.runtime import started_local_ray

    if ray.is_initialized():
        ray.shutdown()
    # HAProxy is a child of Serve's HAProxyManager actor, outside Ray's own process tree: it goes
    # with the cluster (it holds serve.port).
    _, alive = psutil.wait_procs(haproxy_processes(), timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"HAProxy outlived the cluster: {[p.pid for p in alive]}"
    store = tmp_path_factory.mktemp("proxy")
    digits_champion.store_copy(store)  # the session's digits v1 (champion)
    port = free_port()
    spec = digits_spec(
        store, f"serve.port={port}", "serve.ingress=proxy", "serve.replica.num_cpus=0.5",
        "serve.autoscaling.min_replicas=2", "serve.autoscaling.max_replicas=2", "serve.health_check_period_s=2",
        "serve.max_instances=64",
    )
    try:
        # No Ray is running: deploy starts the local cluster, without HAProxy for this spec.
        endpoint = deploy(plan_deployment(spec))
        assert started_local_ray()
        yield {"spec": spec, "outcome": digits_champion.outcome, "endpoint": endpoint, "port": port}
    finally:
        if ray.is_initialized():
            ray.shutdown()


def _listening(port_filter) -> dict[int, str]:
    return {c.laddr.port: c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and port_filter(c.laddr.port)}


def test_the_proxy_answers_like_the_bundle_on_localhost_and_holds_under_load(proxy_endpoint):
    from flotilla.serve import VERSION_HEADER, running_ingress

    assert running_ingress() == "proxy" and not haproxy_processes()
    endpoint, spec = proxy_endpoint["endpoint"], proxy_endpoint["spec"]
    assert endpoint.url.startswith(f"http://127.0.0.1:{proxy_endpoint['port']}/")
    rows, _ = digits_val_rows(spec)
    r = requests.post(endpoint.url + "/predict", json={"instances": rows.iloc[:40].to_numpy().tolist()}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers[VERSION_HEADER] == "1"
    expected = load_bundle(proxy_endpoint["outcome"].bundle_path).predict(rows.iloc[:40])
    assert r.json()["predictions"] == list(expected["predictions"])
    np.testing.assert_allclose(r.json()["probabilities"], expected["probabilities"], atol=1e-5)
    assert _listening(lambda p: p == proxy_endpoint["port"]) == {proxy_endpoint["port"]: "127.0.0.1"}

    url = endpoint.url + "/predict"
    r = requests.post(url, json={"instances": [[0.0] * 63]}, timeout=30)
    assert r.status_code == 422 and "instances[0]" in r.json()["error"]
    r = requests.post(url, data=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    unknown = requests.post(url.replace("/digits", "/nope"), json={"instances": [[0.0] * 64]}, timeout=30)
    assert unknown.status_code == 404, (unknown.status_code, unknown.text)
    bodies = [{"instances": [row]} for row in rows.to_numpy().tolist()[:300]]
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda b: requests.post(url, json=b, timeout=60).status_code, bodies))
    assert statuses == [200] * len(bodies)


def test_asking_for_haproxy_on_a_cluster_started_without_it_says_how_to_start_it(proxy_endpoint):
    from flotilla.errors import ServeError
    from flotilla.serve import deploy, plan_deployment

    spec = proxy_endpoint["spec"]
    started = time.monotonic()
    with pytest.raises(ServeError, match=r"serve.ingress=haproxy.*RAY_SERVE_ENABLE_HA_PROXY=1.*serve.ingress=proxy"):
        deploy(plan_deployment(spec.model_copy(update={"serve": spec.serve.model_copy(update={"ingress": "haproxy"})})))
    assert time.monotonic() - started < 30  # Serve was running: its ingress is known, no long wait
    # `auto` takes the cluster as it is: the same endpoint, redeployed, still answers.
    endpoint = deploy(plan_deployment(spec.model_copy(update={"serve": spec.serve.model_copy(update={"ingress": "auto"})})))
    rows, _ = digits_val_rows(spec)
    r = requests.post(endpoint.url + "/predict", json={"instances": rows.iloc[:1].to_numpy().tolist()}, timeout=60)
    assert r.status_code == 200, r.text
