"""The cluster a run lands on: room for its workers, its autoscaler, and what the run cost.

    missing, why = wait_for_room(need, bundles, timeout_s=600, may_wait=True)
    use = resource_use(wall_s, cpus=3, gpus=0, prices=prices_for(spec.cost, worker_node_ids))
    print(use.describe()); tracker.log_resources(use)

Node prices come from the spec (`cost.cpu_hour`, `cost.gpu_hour`) or, when the spec gives none,
from the label `flotilla.io/price-per-hour` that `cluster.yaml` puts on each node type: a node's
hourly price is split evenly over its GPUs (GPU nodes) or its CPUs (CPU-only nodes).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable

import ray

from flotilla.errors import ClusterError

PRICE_LABEL = "flotilla.io/price-per-hour"
# After asking the autoscaler for nodes: if it has launched nothing by then, it never will
# (every node type too small, max_workers reached, or no autoscaler at all).
_NOTHING_LAUNCHED_S = 30.0



# -------------------------------------------------------------------- capacity
def shortfall(need: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{resource: (needed, the cluster's total)} for each resource the cluster has too little of."""
    total = ray.cluster_resources()
    return {r: (amount, total.get(r, 0.0)) for r, amount in need.items() if amount > total.get(r, 0.0) + 1e-9}


def wait_for_room(need: dict[str, float], bundles: list[dict[str, float]], *, timeout_s: float, may_wait: bool,
                  label: str = "flotilla") -> tuple[dict[str, tuple[float, float]], str]:
    """Make room for `need` (the sum of `bundles`) on the cluster; return what is still missing
    and, when something is, why no node brought it ("" when there was no autoscaler to ask).

    On a running cluster (`may_wait`) a shortfall is a request to its autoscaler
    (`ray.autoscaler.sdk.request_resources`): wait until the nodes have joined, for at most
    `timeout_s`, and give up after ~30 s if the autoscaler launched nothing. A local cluster
    that this process started has no autoscaler, and the read-only one of a plain `ray start`
    cannot add nodes: their shortfall is returned at once.
    """
    missing = shortfall(need)
    if not missing or not may_wait or timeout_s <= 0:
        return missing, ""
    if _autoscaler_is_read_only():
        print(f"[{label}] the cluster has {_totals(missing)} and cannot grow: its autoscaler is Ray's read-only "
              "one", flush=True)
        return missing, ("the cluster cannot add nodes: it was started by `ray start` without "
                         "--autoscaling-config (`ray up cluster.yaml` starts one that can)")
    from ray.autoscaler.sdk import request_resources

    started = time.monotonic()
    wanted = ", ".join(f"{amount:g} {r}" for r, amount in need.items() if amount)
    print(f"[{label}] the cluster has {_totals(missing)}; asking its autoscaler for {wanted} "
          f"(waiting up to {timeout_s:.0f} s)", flush=True)
    request_resources(bundles=[{k: v for k, v in b.items() if v} for b in bundles])
    launched, why = False, ""
    try:
        while missing:
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                why = f"the nodes did not join within train.scale_up_timeout_s={timeout_s:g} s"
                break
            launched = launched or _autoscaler_launching()
            if not launched and elapsed > min(_NOTHING_LAUNCHED_S, timeout_s):
                why = (f"the cluster's autoscaler launched no node for it within {elapsed:.0f} s (a cluster "
                       "without one, every node type too small, or max_workers reached: see `ray status`)")
                break
            time.sleep(2.0)
            missing = shortfall(need)
    finally:
        # The request has done its work (or failed): withdraw it, so that nodes this run does not
        # use go idle and the autoscaler removes them after their idle timeout.
        request_resources(bundles=[])
    if not missing:
        print(f"[{label}] nodes joined after {time.monotonic() - started:.0f} s; the cluster now has "
              f"{_totals(need)}", flush=True)
    return missing, why


def _totals(resources: dict[str, Any]) -> str:
    total = ray.cluster_resources()
    return ", ".join(f"{total.get(r, 0.0):g} {r}" for r in resources)


def _autoscaler_report() -> dict:
    """The autoscaler's last status report (autoscaler v1's, in the GCS); {} when there is none."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    try:
        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        return json.loads(raw).get("autoscaler_report") or {} if raw else {}
    except Exception:  # no status to read: the caller's timeouts decide
        return {}


def _autoscaler_launching() -> bool:
    """True when the autoscaler reports nodes being launched or set up."""
    report = _autoscaler_report()
    return bool(report.get("pending_launches") or report.get("pending_nodes"))


# The read-only autoscaler (a head started without --autoscaling-config) has no node types of
# its own: it names each node's type after the node's id (ray.autoscaler's format_readonly_node_type).
_READ_ONLY_NODE_TYPE = re.compile(r"node_[0-9a-f]{40,}")


def _autoscaler_is_read_only() -> bool:
    """True when the cluster's autoscaler is Ray's read-only one, which never launches a node."""
    types = set((_autoscaler_report().get("node_type_mapping") or {}).values())
    return bool(types) and all(_READ_ONLY_NODE_TYPE.fullmatch(t) for t in types)


# ------------------------------------------------------------------- storage
# Ray unpacks a job's `--working-dir` here on every node and deletes it after the job.
_JOB_DIR_MARK = "/runtime_resources/working_dir_files/"
_STORAGE_FIX = {
    "train.storage_path": "`--set train.storage_path=s3://BUCKET/runs` or a directory mounted on every node "
                          "(or FLOTILLA_STORAGE_PATH in the environment of the cluster's `ray start`, as cluster.yaml sets it)",
    "track.uri": "a tracking server every node reaches: MLFLOW_TRACKING_URI in the environment of the cluster's "
                 "`ray start` (cluster.yaml starts one on the head) or `--set track.uri=http://HEAD:5000`",
}


# Ray's autoscaling coordinator (a detached actor, `(name, namespace)`) tells an elastic run's restarts,
# and Ray Data's autoscaling, which nodes have room. Its own view counts a draining node as a live
# one until the node is gone, while new placements there are refused: a run restarted at its drain
# deadline first asks for the old size and waits out a placement timeout. The view Flotilla gives
# it (`usable_nodes`) leaves out a node from DRAIN_MARGIN_S before its drain deadline (and one that
# drains without a deadline); until then a run trains on it, having checkpointed at the notice.
AUTOSCALING_COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")
DRAIN_MARGIN_S = 3.0


def _usable_nodes_view(margin_s: float):
    """`ray.nodes()` less the nodes that drain without a deadline or within `margin_s` of theirs. A
    function defined in here: cloudpickle sends it by value, so the coordinator's node needs no
    Flotilla installed."""

    def usable_nodes() -> list[dict]:
        import time as _time

        import ray as _ray

        nodes = _ray.nodes()
        try:  # the drains Ray Core knows of, {node id: deadline in ms, 0 for none}, read as Ray Train reads them
            draining = _ray._private.state.state.get_draining_nodes() or {}
        except Exception:
            return nodes
        soon_ms = (_time.time() + margin_s) * 1000
        return [n for n in nodes if n["NodeID"] not in draining
                or (draining[n["NodeID"]] and draining[n["NodeID"]] > soon_ms)]

    return usable_nodes


def usable_nodes() -> list[dict]:
    """The nodes (as `ray.nodes()` lists them) that a restart may be placed on now."""
    return _usable_nodes_view(DRAIN_MARGIN_S)()


def start_autoscaling_coordinator() -> bool:
    """Start Ray's autoscaling coordinator (Ray's own actor class, under Ray's name and options) with
    the `usable_nodes` view, unless it runs already: the first elastic run on a cluster starts it,
    before its data is prepared (Ray Data starts it otherwise), for every run after it. True when
    this call started it."""
    try:
        ray.get_actor(*AUTOSCALING_COORDINATOR)
        return False
    except ValueError:
        pass
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            _AutoscalingCoordinatorActor,
        )
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name, namespace = AUTOSCALING_COORDINATOR
        ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(_AutoscalingCoordinatorActor).options(
            name=name, namespace=namespace, get_if_exists=True, lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(get_cluster_nodes=_usable_nodes_view(DRAIN_MARGIN_S))
        return True
    except Exception:  # another Ray's coordinator: Ray starts its own, and a restart at a drain deadline
        return False   # waits out one placement timeout instead


def local_storage(storage_path: str, tracking_uri: str | None) -> dict[str, str]:
    """{field: local directory} for the storage a run writes that is a path on this node: the
    resolved `train.storage_path` unless it is a URI, and a SQLite tracking store's directory."""
    from pathlib import Path

    paths = {}
    if "://" not in storage_path:
        paths["train.storage_path"] = str(Path(storage_path).expanduser().resolve())
    if tracking_uri and tracking_uri.startswith("sqlite:///"):
        paths["track.uri"] = str(Path(tracking_uri.removeprefix("sqlite:///")).parent)
    return paths


def check_storage_reaches_every_node(paths: dict[str, str]) -> list[str]:
    """Refuse local directories that would lose work on this cluster, naming the field and the fix;
    return notes on what could not be checked.

    `paths` maps a spec field (`train.storage_path`, `track.uri`) to the local directory it
    resolves to. Refused: a directory inside this job's unpacked `--working-dir` (Ray deletes it
    when the job ends, on any cluster), and, on a cluster of more than one node, a directory that
    not every node sees (a checkpoint written there cannot be resumed on another node, a model
    registered there cannot be loaded by a replica elsewhere). Visibility is tested, not guessed:
    a marker file written here is looked for by a zero-CPU task pinned to each alive node. A node
    that says it cannot see the directory fails the check; one that does not answer in time, or
    leaves the cluster meanwhile (an autoscaler at work, a spot node taken back), is noted and does
    not: nodes in flux are normal, and a node that cannot run a probe cannot run a worker either.
    """

    problems = []
    for field, directory in paths.items():
        if _JOB_DIR_MARK in directory + "/":
            problems.append(f"{field} resolves to {directory}, inside this job's unpacked --working-dir, which Ray "
                            f"deletes when the job ends; use {_STORAGE_FIX[field]}")
    nodes = [n for n in ray.nodes() if n.get("Alive")] if paths and not problems else []
    notes = []
    if len(nodes) > 1:
        blind_by_field, silent = _nodes_not_seeing(paths, nodes)
        for field, blind in blind_by_field.items():
            problems.append(
                f"{field} resolves to {paths[field]}, a directory of this node only: node(s) {', '.join(blind)} of "
                f"this {len(nodes)}-node cluster cannot see it (checkpoints and registered models must be "
                f"readable from every node); use {_STORAGE_FIX[field]}")
        if silent:
            notes.append(f"storage check: node(s) {', '.join(silent)} did not answer (joining or leaving the "
                         "cluster); not counted")
    if problems:
        raise ClusterError("storage this cluster would lose work in:\n  - " + "\n  - ".join(problems))
    return notes


def _sees(markers: list[str]) -> list[bool]:
    import os

    return [os.path.exists(m) for m in markers]


def _nodes_not_seeing(paths: dict[str, str], nodes: list[dict],
                      timeout_s: float = 120.0) -> tuple[dict[str, list[str]], list[str]]:
    """({field: addresses of the nodes on which a marker file written here into its directory is
    absent}, for the fields some node cannot see; the addresses of the nodes that did not answer).
    One zero-CPU probe per node checks every marker; a probe that fails (a node that joined a moment
    ago may not start a worker yet) is tried again every 2 s while its node is alive. A node that
    left, or has not answered within `timeout_s`, is one that did not answer."""
    import time
    import uuid
    from pathlib import Path

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    markers = {field: Path(directory) / f".flotilla-visible-{uuid.uuid4().hex}" for field, directory in paths.items()}
    try:
        for marker in markers.values():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("")
        probe = ray.remote(num_cpus=0, max_retries=0)(_sees)
        names = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes}
        if len(set(names.values())) < len(names):  # several nodes on one address (one machine): say which
            names = {node: f"{address} ({node[:8]})" for node, address in names.items()}
        seen: dict[str, list[bool]] = {}
        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending and time.monotonic() < deadline:
            refs = {node: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                [str(m) for m in markers.values()]) for node in pending}
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=max(1.0, deadline - time.monotonic()))
            for node, ref in refs.items():
                try:
                    seen[node] = ray.get(ref, timeout=0)
                    pending.discard(node)
                except ray.exceptions.GetTimeoutError:  # still not run when the time was up
                    pass
                except Exception:  # tried again below, while there is time and its node is alive
                    pass
            if pending:
                pending &= {n["NodeID"] for n in ray.nodes() if n.get("Alive")}  # those that left answer no more
                if pending and time.monotonic() < deadline:
                    time.sleep(2.0)
        blind: dict[str, list[str]] = {}
        for node in sorted(seen, key=names.get):
            for field, ok in zip(markers, seen[node]):
                if not ok:
                    blind.setdefault(field, []).append(names[node])
        return blind, sorted(names[node] for node in names if node not in seen)
    finally:
        for marker in markers.values():
            marker.unlink(missing_ok=True)


# ------------------------------------------------------------------------ cost
@dataclass
class Prices:
    cpu_hour: float | None  # per CPU-hour
    gpu_hour: float | None  # per GPU-hour
    currency: str
    source: str  # "the spec's cost section" | "node labels" | ""

    @property
    def known(self) -> bool:
        return self.cpu_hour is not None or self.gpu_hour is not None


@dataclass
class ResourceUse:
    """What one run or sweep held, for how long, and (with prices) what that cost."""

    wall_time_s: float
    cpu_hours: float
    gpu_hours: float
    cost: float | None = None
    currency: str = "USD"
    price_source: str = ""

    def __add__(self, other: "ResourceUse") -> "ResourceUse":
        cost = None if self.cost is None and other.cost is None else (self.cost or 0.0) + (other.cost or 0.0)
        return ResourceUse(self.wall_time_s + other.wall_time_s, self.cpu_hours + other.cpu_hours,
                           self.gpu_hours + other.gpu_hours, cost, self.currency, self.price_source or other.price_source)

    def describe(self) -> str:
        text = (f"resources: {self.cpu_hours:.4f} CPU-hours, {self.gpu_hours:.4f} GPU-hours "
                f"over {self.wall_time_s:.1f} s")
        if self.cost is None:
            return text + "; no prices given (set cost.cpu_hour / cost.gpu_hour, or label the nodes in cluster.yaml)"
        return text + f"; estimated cost {self.cost:.4f} {self.currency} (prices from {self.price_source})"

    def metrics(self) -> dict[str, float]:
        """The numbers as MLflow metrics."""
        m = {"resource_wall_time_s": self.wall_time_s, "cpu_hours": self.cpu_hours, "gpu_hours": self.gpu_hours}
        if self.cost is not None:
            m["estimated_cost"] = self.cost
        return m


def node_prices(node_ids: Iterable[str] | None = None) -> tuple[float | None, float | None]:
    """(per CPU-hour, per GPU-hour) from the price labels of the given nodes (all alive nodes when
    None), averaged over the nodes that carry one; None where no such node has a label."""
    wanted = set(node_ids) if node_ids is not None else None
    cpu_rates, gpu_rates = [], []
    for node in ray.nodes():
        if not node.get("Alive") or (wanted is not None and node["NodeID"] not in wanted):
            continue
        label = (node.get("Labels") or {}).get(PRICE_LABEL)
        try:
            price = float(label) if label is not None else math.nan
        except ValueError:
            price = math.nan
        if not math.isfinite(price) or price < 0:
            continue
        resources = node.get("Resources") or {}
        if resources.get("GPU"):
            gpu_rates.append(price / resources["GPU"])
        elif resources.get("CPU"):
            cpu_rates.append(price / resources["CPU"])
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return mean(cpu_rates), mean(gpu_rates)


def prices_for(cost_spec, node_ids: Iterable[str] | None = None) -> Prices:
    """The spec's prices when it gives any, else the nodes' price labels."""
    if cost_spec.cpu_hour is not None or cost_spec.gpu_hour is not None:
        return Prices(cost_spec.cpu_hour, cost_spec.gpu_hour, cost_spec.currency, "the spec's cost section")
    cpu, gpu = node_prices(node_ids) if ray.is_initialized() else (None, None)
    if node_ids is not None and cpu is None and gpu is None and ray.is_initialized():
        cpu, gpu = node_prices(None)  # the workers' nodes are gone (scaled down): the cluster's prices
    source = f"node labels ({PRICE_LABEL})" if cpu is not None or gpu is not None else ""
    return Prices(cpu, gpu, cost_spec.currency, source)


def resource_use(wall_time_s: float, cpus: float, gpus: float, prices: Prices) -> ResourceUse:
    """`cpus` CPUs and `gpus` GPUs held for `wall_time_s` seconds, priced where prices are known.

    GPU nodes are priced per GPU (their CPUs come with them); CPUs are priced per CPU-hour.
    """
    hours = wall_time_s / 3600.0
    use = ResourceUse(wall_time_s, cpus * hours, gpus * hours, currency=prices.currency, price_source=prices.source)
    if prices.known:
        use.cost = use.gpu_hours * (prices.gpu_hour or 0.0)
        # A node label prices a GPU node per GPU, its CPUs included; the spec prices each resource.
        if not (gpus and prices.gpu_hour is not None and prices.source.startswith("node labels")):
            use.cost += use.cpu_hours * (prices.cpu_hour or 0.0)
    return use
