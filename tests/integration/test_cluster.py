"""`ray job submit` against a cluster started with `ray start --head` (started and stopped here)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.services import free_ports

from ._helpers import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIN = Path(sys.executable).parent


START_ATTEMPTS = 3  # `ray start` gives its raylet a fixed 30 s to register, which a busy 2-core machine can exceed


@pytest.fixture(scope="module")
def head_node(tmp_path_factory):
    """A one-node cluster from `ray start --head --block`, in a temp dir of its own so no other
    test's `ray.init()` finds it; stopped by signalling exactly the processes it started."""
    temp_dir = Path("/tmp") / f"flotilla-ray-{os.getpid()}"  # short: unix socket paths are limited
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    for name in ("MLFLOW_TRACKING_URI", "FLOTILLA_STORAGE_PATH"):  # a cluster with nothing set: a plain `ray start`
        env.pop(name, None)
    logs = tmp_path_factory.mktemp("head")
    for attempt in range(1, START_ATTEMPTS + 1):
        proc, address, log = _start_head(temp_dir, env, logs / f"ray_start-{attempt}.log")
        try:
            if _ready(proc, address, env, log, last=attempt == START_ATTEMPTS):
                break
        except BaseException:
            _stop(proc, temp_dir, log)
            raise
        # "The current node timed out during startup ... the GCS has become overloaded": Ray's own
        # clock, not this cluster's fault. What the attempt started is stopped and the head starts again.
        print(f"ray start --head timed out during startup (attempt {attempt}); starting it again", flush=True)
        _stop(proc, temp_dir, log)
    try:
        yield address, env
    finally:
        _stop(proc, temp_dir, log)


def _start_head(temp_dir: Path, env: dict, log_path: Path):
    # Every fixed port of its own: the session's local Ray already holds the defaults
    # (the dashboard agent's 52365 among them), and a second agent on it never registers.
    names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "ray-client-server-port", "node-manager-port", "object-manager-port")
    gcs_port, dashboard_port, *free = free_ports(2 + len(names))
    ports = [f"--{name}={port}" for name, port in zip(names, free)]
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=3", f"--port={gcs_port}",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
         "--include-dashboard=true", f"--temp-dir={temp_dir}", "--disable-usage-stats", *ports],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    return proc, f"http://127.0.0.1:{dashboard_port}", log


def _ready(proc: subprocess.Popen, address: str, env: dict, log, last: bool) -> bool:
    """True once a job runs on the head (the job server answers before the node's agent, which runs
    the jobs, has registered); False if `ray start` gave up on its own startup clock and may be tried
    again; any other failure fails the test."""
    deadline = time.monotonic() + 180
    while True:
        ready = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", address, "--", "python", "-c", "print('ready')"],
            env=env, capture_output=True, text=True, timeout=120,
        )
        if ready.returncode == 0:
            return True
        if proc.poll() is not None:
            said = Path(log.name).read_text()
            if "timed out during startup" in said and not last:
                return False
            pytest.fail(f"ray start exited: {said[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the head node never ran a job: {ready.stderr[-2000:]}")
        time.sleep(2)


def _stop(proc: subprocess.Popen, temp_dir: Path, log) -> None:
    group = proc.pid  # start_new_session: the group id is the leader's pid
    proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes
    try:  # ...taking ~30 s when left to itself; what is left after 10 s is killed below
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)
    killed = []
    for p in psutil.process_iter(["cmdline"]):  # anything of this cluster still alive
        if p.info["cmdline"] and any(str(temp_dir) in part for part in p.info["cmdline"]):
            p.kill()
            killed.append(p)
    psutil.wait_procs(killed, timeout=15)
    log.close()
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_submitted_job_refuses_storage_that_ray_deletes_after_it(head_node):
    # With nothing set on the cluster, `runs/` and `sqlite:///mlflow.db` resolve inside the job's
    # unpacked --working-dir, which Ray deletes after the job: refused before training, with the fix.
    # (The whole lifecycle of submitted jobs, on hosts that share only the network and the
    # storage, is test_hosts.py's.)
    address, env = head_node
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
         "python", "pipelines/train.py", "--config", "configs/digits.yaml"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    out = submit.stdout + submit.stderr
    assert submit.returncode != 0, out[-3000:]
    assert re.search(r"train.storage_path resolves to \S+/runtime_resources/working_dir_files/\S+/runs, inside this "
                     r"job's unpacked --working-dir, which Ray deletes when the job ends", out), out[-3000:]
    assert "track.uri resolves to" in out and "MLFLOW_TRACKING_URI in the environment of the cluster's `ray start`" in out
    assert "epoch 1/" not in out and "Traceback" not in out


def test_a_run_too_big_for_a_cluster_without_autoscaling_fails_with_the_shortfall(head_node, tmp_path):
    # `ray start --head` runs Ray's read-only autoscaler, which never launches a node: the run says
    # so and exits at once instead of pending forever (or until its scale-up timeout).
    address, env = head_node
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
         "python", "pipelines/train.py", "--config", "configs/digits.yaml", "--set", "train.num_workers=4",
         "--set", "train.scale_up_timeout_s=600", "--set", "track.enabled=false",
         "--set", f"train.storage_path={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    out = submit.stdout + submit.stderr
    assert submit.returncode != 0, out[-3000:]
    assert "the cluster has 3 CPU and cannot grow: its autoscaler is Ray's read-only one" in out, out[-3000:]
    assert "train.num_workers=4 x train.cpus_per_worker=1 needs 4 CPUs plus 1 for Ray Data's input pipeline, " \
           "but the cluster has 3 in all" in out, out[-3000:]
    assert "the cluster cannot add nodes: it was started by `ray start` without --autoscaling-config" in out, \
        out[-3000:]
    assert "asking its autoscaler" not in out, out[-3000:]
