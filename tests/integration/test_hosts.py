"""A cluster of hosts that share nothing but a network and a storage directory (ops/local_hosts.py):
a head with CPU 0, two worker hosts without the project's source, and a client host that submits.

Each host is a network namespace and a mount namespace of its own; the module builds them, runs
Ray on them and removes them. Skipped, with the kernel's reason, where namespaces cannot be made.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location("local_hosts", ROOT / "ops" / "local_hosts.py")
local_hosts = sys.modules.setdefault("local_hosts", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(local_hosts)

PREFIX = f"flt{os.getpid() % 100000}"


def _links() -> list[str]:
    return sorted(subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout.split("\n"))


@pytest.fixture(scope="module")
def hosts():
    reason = local_hosts.can_make_hosts()
    if reason:
        pytest.skip(f"cannot build hosts on this machine: {reason}")
    before = _links()
    made = local_hosts.Hosts(PREFIX, workers=2, worker_cpus=2)
    made.up()
    made.links_before = before
    try:
        yield made
    finally:
        made.down()


def test_hosts_share_only_the_network_and_the_storage(hosts):
    # Nothing was added to this machine's own interfaces, addresses or routes.
    assert _links() == hosts.links_before
    own = subprocess.run(["ip", "addr"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    assert local_hosts.SUBNET not in own
    # ...while the client host reaches the head over the private link.
    probe = hosts.run("client", ["python", "-c", f"import socket; socket.create_connection(({hosts.head_address!r}, "
                                                 f"{local_hosts.DASHBOARD_PORT}), timeout=5); print('reached')"])
    assert probe.stdout.strip() == "reached", probe.stderr
    # Worker hosts have the installed environment but not the project's source.
    listing = hosts.run("worker1", ["ls", "-A", str(ROOT / "platform")])
    assert listing.returncode == 0 and listing.stdout == ""
    imported = hosts.run("worker1", ["python", "-c", "import flotilla"])
    assert "No module named 'flotilla'" in imported.stderr, imported.stderr
    assert hosts.run("client", ["python", "-c", "import flotilla"]).returncode == 0
    # Each host has a Ray session directory of its own, invisible to the others.
    for h in ("head", "worker1"):
        hosts.run(h, ["touch", f"/tmp/ray/{PREFIX}-{h}"], check=True)
    assert hosts.run("head", ["ls", "/tmp/ray"]).stdout.split().count(f"{PREFIX}-head") == 1
    assert f"{PREFIX}-worker1" not in hosts.run("head", ["ls", "/tmp/ray"]).stdout
    assert not Path(f"/tmp/ray/{PREFIX}-head").exists() and not Path(f"/tmp/ray/{PREFIX}-worker1").exists()
    # Worker1's raylet writes its logs there, not into the head's session directory.
    raylets = {h: hosts.run(h, ["sh", "-c", "ls /tmp/ray/session_latest/logs | grep -c '^raylet'"]).stdout.strip()
               for h in ("head", "worker1", "client")}
    assert raylets["head"] != "0" and raylets["worker1"] != "0" and raylets["client"] in ("", "0"), raylets
    # The shared directory is the same on every host.
    hosts.run("worker2", ["sh", "-c", f"echo from-worker2 > {hosts.shared}/hello"], check=True)
    assert hosts.run("client", ["cat", f"{hosts.shared}/hello"]).stdout.strip() == "from-worker2"


def test_a_job_from_the_client_host_trains_on_both_worker_hosts(hosts):
    runs = f"{hosts.shared}/runs"
    submit = hosts.run("client", [
        "ray", "job", "submit", "--address", hosts.jobs_address, "--working-dir", ".", "--",
        "python", "pipelines/train.py", "--config", "configs/digits.yaml", "--set", f"train.storage_path={runs}",
        "--set", "train.run_name=across", "--set", "train.epochs=2", "--set", "train.placement=spread",
        "--set", "track.enabled=false",
    ], timeout=600)
    out = submit.stdout + submit.stderr
    assert submit.returncode == 0, out[-4000:]
    assert "run across: val_accuracy" in out
    # One rank on each worker host (the head has no CPUs), checkpoints and bundle in shared storage.
    ranks = set(re.findall(r"RayTrainWorker pid=\d+, ip=([\d.]+)", out))
    assert ranks == {hosts["worker1"].address, hosts["worker2"].address}, ranks
    run_dir = Path(runs) / "across"
    assert (run_dir / "bundle" / "model.safetensors").is_file()
    assert len(list(run_dir.glob("checkpoint_epoch000*"))) == 2


def test_down_leaves_nothing_behind(hosts):
    holders = [h.holder_pid for h in hosts.hosts]
    hosts.down()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert PREFIX not in names
    assert not any(Path(f"/proc/{pid}").exists() for pid in holders)
    assert not Path(hosts.shared).exists() and not hosts.state_file.exists() and not hosts.hosts_file.exists()
    alive = subprocess.run(["pgrep", "-f", f"{hosts.head_address}:"], capture_output=True, text=True).stdout.split()
    assert alive == [], f"processes of the hosts still running: {alive}"
