"""cluster.yaml and cluster.local.yaml: valid for Ray's autoscaler, and shaped as Flotilla expects.

No cluster, no network, no AWS credentials: Ray's own schema and its own config preparation
(the first steps of `ray up`), then the properties the platform relies on.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
# What `ray up` and the autoscaler run on a config; Ray exposes them nowhere public.
from ray.autoscaler._private.util import prepare_config, validate_config

from flotilla.cluster import PRICE_LABEL

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster.yaml"
LOCAL = ROOT / "cluster.local.yaml"
TOKEN_MOUNT = "~/.ray/auth_token"  # the path Ray's token loader reads by default, on each side


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def cluster() -> dict:
    return load(CLUSTER)


@pytest.fixture(scope="module")
def local() -> dict:
    return load(LOCAL)


def workers(config: dict) -> dict[str, dict]:
    return {name: t for name, t in config["available_node_types"].items() if name != config["head_node_type"]}


# ------------------------------------------------------------ Ray's own checks
@pytest.mark.parametrize("path", [CLUSTER, LOCAL], ids=lambda p: p.name)
def test_config_passes_rays_schema(path):
    validate_config(load(path))  # raises jsonschema.ValidationError / ValueError on a bad config


def test_cluster_yaml_survives_ray_ups_preparation(cluster):
    # prepare_config merges Ray's AWS defaults and each node type's limits, as `ray up` does before
    # it calls AWS; the result must still validate. (cluster.local.yaml cannot take this step
    # here: the fake provider's defaults file is not shipped in Ray's wheel.)
    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["worker_setup_commands"][: len(cluster["setup_commands"])] == cluster["setup_commands"]
    assert prepared["head_setup_commands"][-len(cluster["head_setup_commands"]):] == cluster["head_setup_commands"]


@pytest.mark.parametrize("where", ["top level", "node type"])
def test_a_misspelled_key_is_rejected(cluster, where):
    bad = copy.deepcopy(cluster)
    if where == "top level":
        bad["idle_timeout_minute"] = bad.pop("idle_timeout_minutes")
    else:
        bad["available_node_types"]["gpu_worker"]["max_worker"] = 2
    with pytest.raises(jsonschema.ValidationError, match="Additional properties are not allowed"):
        validate_config(bad)


# ------------------------------------------------------------- node types
def test_head_runs_no_training_work(cluster):
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["resources"]["CPU"] == 0 and not head["resources"].get("GPU")
    assert head.get("max_workers", 0) == 0


def test_a_cpu_and_a_gpu_worker_type_that_scale_from_zero(cluster):
    types = workers(cluster)
    cpu, gpu = types["cpu_worker"], types["gpu_worker"]
    assert cpu["resources"]["CPU"] > 0 and not cpu["resources"].get("GPU")
    assert gpu["resources"]["GPU"] > 0
    for name, t in types.items():
        assert t["min_workers"] == 0 and t["max_workers"] > 0, name  # idle clusters cost nothing
    assert sum(t["max_workers"] for t in types.values()) <= cluster["max_workers"]
    assert cluster["idle_timeout_minutes"] > 0


def test_a_spot_worker_type_beside_the_on_demand_one_priced_below_it(cluster):
    types = workers(cluster)
    spot, on_demand = types["cpu_spot_worker"], types["cpu_worker"]
    assert spot["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert "InstanceMarketOptions" not in on_demand["node_config"]
    assert spot["node_config"]["InstanceType"] == on_demand["node_config"]["InstanceType"]
    assert spot["resources"] == on_demand["resources"] and spot["labels"]["flotilla.io/market"] == "spot"
    assert 0 < float(spot["labels"][PRICE_LABEL]) < float(on_demand["labels"][PRICE_LABEL])


def test_every_node_type_launches_the_same_image(cluster):
    images = {t["node_config"]["ImageId"] for t in cluster["available_node_types"].values()}
    assert len(images) == 1, f"one Python on every node needs one AMI; found {sorted(images)}"


@pytest.mark.parametrize("path", [CLUSTER, LOCAL], ids=lambda p: p.name)
def test_every_worker_type_is_priced(path):
    for name, t in workers(load(path)).items():
        label = t.get("labels", {}).get(PRICE_LABEL)
        assert isinstance(label, str), f"{name}: no {PRICE_LABEL} label (a string)"
        assert float(label) > 0, f"{name}: {PRICE_LABEL}={label!r}"


def test_local_cluster_mirrors_the_cloud_one(cluster, local):
    assert local["head_node_type"] == "ray.head.default"
    assert local["available_node_types"]["ray.head.default"]["resources"]["CPU"] == 0
    assert workers(local).keys() == workers(cluster).keys()
    for name, t in workers(cluster).items():
        assert workers(local)[name]["labels"][PRICE_LABEL] == t["labels"][PRICE_LABEL], name
        assert bool(workers(local)[name]["resources"].get("GPU")) == bool(t["resources"].get("GPU")), name


# ------------------------------------------------------- security and setup
def test_the_token_reaches_every_node_but_is_not_in_the_file(cluster):
    assert cluster["file_mounts"].get(TOKEN_MOUNT) == TOKEN_MOUNT
    text = CLUSTER.read_text()
    assert not re.search(r"\b[0-9a-f]{32,}\b", text), "a token-like hex string is in cluster.yaml"
    assert "RAY_AUTH_TOKEN=" not in text
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cluster[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token" in c for c in starts), key


def test_dashboard_and_jobs_api_stay_on_the_heads_loopback(cluster):
    (start,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    assert "--head" in start and "--dashboard-host=127.0.0.1" in start
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in start  # where `ray up` puts the config
    assert "0.0.0.0" not in CLUSTER.read_text()


def test_setup_installs_the_pinned_dependencies(cluster):
    for remote, local in cluster["file_mounts"].items():
        if remote != TOKEN_MOUNT:
            assert (ROOT / local).is_file(), f"file_mounts: {local} is not in the repository"
    setup = "\n".join(cluster["setup_commands"])
    torch_pin = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                     if d.startswith("torch=="))
    assert setup.count(torch_pin) == 2, f"the CPU and the CUDA install of {torch_pin}, as pyproject.toml pins it"
    assert "--index-url https://download.pytorch.org/whl/cpu" in setup
    assert "-c ~/flotilla/requirements.lock" in setup and "pyproject.toml" in setup
    assert set(cluster["rsync_exclude"]) >= {".venv", "runs", "mlruns", ".git"}


def test_every_node_gets_the_clusters_tracking_server_and_storage(cluster):
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in cluster[key] if "ray start" in c]
        assert "MLFLOW_TRACKING_URI=http://" in start and ":5000" in start, key
        assert "FLOTILLA_STORAGE_PATH=s3://BUCKET/" in start, key
    (server,) = [c for c in cluster["head_start_ray_commands"] if "mlflow server" in c]
    assert "--host $(hostname -I | cut -d' ' -f1) --port 5000" in server  # the private address, not all interfaces
    assert "--artifacts-destination" in server and "--backend-store-uri sqlite:///" in server
    assert server.startswith("mkdir") and "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false nohup mlflow server" in server
    assert cluster["head_start_ray_commands"].index(server) < cluster["head_start_ray_commands"].index(
        next(c for c in cluster["head_start_ray_commands"] if "ray start" in c))
