"""What an elastic run's restarts are offered: a cluster of two nodes (a head and a worker node, Ray's
own `cluster_utils` in a process of its own), the worker node drained with `ray drain-node` as a
spot notice is. Until its deadline is near the node is offered (the run trains on it and commits
a checkpoint at the notice); from `flotilla.cluster.DRAIN_MARGIN_S` (3 s) before it, it is not,
and the autoscaling coordinator an elastic run starts (Ray's own actor) then reserves the run's
workers on the other node only."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.services import free_ports

from ._helpers import ROOT

pytestmark = [pytest.mark.integration]


def test_a_draining_node_is_offered_until_its_deadline_is_near_and_not_after(tmp_path):
    gcs, *agents = free_ports(7)  # each node's agent, metrics and runtime-env ports
    script = textwrap.dedent(f"""
        import json, os, subprocess, sys, time
        sys.path.insert(0, {str(ROOT / 'platform')!r})
        import ray
        from ray.cluster_utils import Cluster
        from flotilla import cluster as flotilla_cluster

        # Ports of its own (the session's local Ray may hold Ray's defaults).
        names = ("dashboard_agent_listen_port", "metrics_export_port", "runtime_env_agent_port")
        ports = lambda some: dict(zip(names, some))
        cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1, "include_dashboard": False,
                                                                "gcs_server_port": {gcs}, **ports({agents[:3]})}})
        worker = cluster.add_node(num_cpus=2, **ports({agents[3:]}))
        try:
            ray.init(address=cluster.address)
            cluster.wait_for_nodes()
            drained = worker.node_id
            out = {{}}
            view = lambda margin: sorted(n["NodeID"] == drained for n in flotilla_cluster._usable_nodes_view(margin)())
            out["before"] = view(2.0)
            # A node with nothing running leaves at once when drained; this one runs an actor (a rank).
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
            rank = ray.remote(num_cpus=1)(type("Rank", (), {{"ready": lambda self: True}})).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(drained, soft=False)).remote()
            ray.get(rank.ready.remote())
            done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node", "--address",
                                   cluster.address, "--node-id", drained, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                                   "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds", "30"],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
            deadline = time.monotonic() + 30
            while drained not in ray._private.state.state.get_draining_nodes() and time.monotonic() < deadline:
                time.sleep(0.1)
            out["far"] = view(2.0)     # 30 s left: still offered
            out["near"] = view(40.0)   # within the margin: left out
            # The coordinator an elastic run starts reserves by that view (here with a margin past the
            # deadline: Ray's own coordinator would reserve on the draining node too).
            flotilla_cluster.DRAIN_MARGIN_S = 40.0
            assert flotilla_cluster.start_autoscaling_coordinator()
            coordinator = ray.get_actor(*flotilla_cluster.AUTOSCALING_COORDINATOR)
            ray.get(coordinator.request_resources.remote("probe", [{{"CPU": 1}}] * 3, expire_after_s=60))
            reserved = ray.get(coordinator.get_reserved_resources.remote("probe", recompute=True))
            out["reserved_near"] = sorted(n == drained for n in reserved)
            print("VIEW", json.dumps(out))
        finally:
            ray.shutdown()
            cluster.shutdown()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and "VIEW " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    view = json.loads(proc.stdout.split("VIEW ", 1)[1].splitlines()[0])
    assert view["before"] == [False, True]
    assert view["far"] == [False, True]  # the run trains on a draining node until its deadline nears
    assert view["near"] == [False]       # then its restarts are placed on the others only
    assert view["reserved_near"] == [False], view
