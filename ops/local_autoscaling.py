"""Autoscaling on one machine: cluster.local.yaml's head, a training job, worker nodes that come and go.

    make cluster-local                     # or: .venv/bin/python ops/local_autoscaling.py
    python ops/local_autoscaling.py --keep # leave the cluster running afterwards (stop it with `ray stop`)

1. starts a head with no CPUs under Ray's fake multinode provider (RAY_FAKE_CLUSTER=1), with a
   real autoscaler reading cluster.local.yaml;
2. submits `pipelines/train.py` with `ray job submit`; the run needs 3 CPUs the head does not
   have, asks the autoscaler for them and waits for the worker nodes to join;
3. reports the worker nodes while the job runs, then waits for the autoscaler to remove them once
   idle (cluster.local.yaml: idle_timeout_minutes 0.5);
4. stops everything it started (unless --keep).

Exit code 0 only when nodes were added, the job succeeded and the idle nodes were removed.
Extra arguments after `--` go to pipelines/train.py (e.g. `-- --set train.epochs=5`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TAG = "[local-cluster]"


START_ATTEMPTS = 3  # `ray start --head` timed out on its own startup clock: started again (LocalCluster.start)


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports (each socket stays bound until all are picked, so none repeats)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def say(message: str) -> None:
    print(f"{TAG} {message}", flush=True)


class LocalCluster:
    """A fake-multinode head started with `ray start --head --block`, stopped by signalling exactly
    the processes it started (its own temp dir and GCS port name them), never with `ray stop`."""

    def __init__(self, config: Path, temp_dir: Path, gcs_port: int, dashboard_port: int, log: Path):
        self.temp_dir, self.gcs_port, self.dashboard_port = temp_dir, gcs_port, dashboard_port
        self.address = f"http://127.0.0.1:{dashboard_port}"
        self.env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
                    "RAY_FAKE_CLUSTER": "1"}
        self.env.pop("RAY_ADDRESS", None)
        os.environ["RAY_AUTH_MODE"] = "token"  # this process asks the head's APIs too
        spec = yaml.safe_load(config.read_text())
        # The fake provider starts worker nodes against provider.gcs_address: this head's port.
        spec["provider"]["gcs_address"] = f"127.0.0.1:{gcs_port}"
        self.idle_timeout_s = float(spec.get("idle_timeout_minutes", 5)) * 60
        temp_dir.mkdir(parents=True, exist_ok=True)
        self.config = temp_dir / "cluster.local.yaml"
        self.config.write_text(yaml.safe_dump(spec, sort_keys=False))
        self.log = open(log, "w")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180) -> None:
        for attempt in range(1, START_ATTEMPTS + 1):
            if self._start_once(timeout_s, last=attempt == START_ATTEMPTS):
                say(f"head up: GCS 127.0.0.1:{self.gcs_port}, dashboard and jobs API {self.address}, 0 CPUs")
                return
            # "The current node timed out during startup ... the GCS has become overloaded": `ray start`
            # gives its raylet a fixed 30 s to register, which a busy 2-core machine can exceed. What the
            # attempt started is stopped, and the head starts again.
            say(f"ray start --head timed out during startup (attempt {attempt}); starting it again")
            self._kill_leftovers()

    def _start_once(self, timeout_s: float, last: bool) -> bool:
        """True once the head is up; False when `ray start` gave up on its own startup clock and may be
        tried again; any other failure raises."""
        # Ports of its own throughout: another local Ray may hold the defaults.
        names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
                 "runtime-env-agent-port", "ray-client-server-port", "node-manager-port", "object-manager-port")
        taken = {self.gcs_port, self.dashboard_port}
        free = [port for port in _free_ports(len(names) + 2) if port not in taken]
        ports = [f"--{name}={port}" for name, port in zip(names, free)]
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=0", f"--port={self.gcs_port}",
             f"--autoscaling-config={self.config}", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={self.dashboard_port}", "--include-dashboard=true", f"--temp-dir={self.temp_dir}",
             "--disable-usage-stats", *ports],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + timeout_s
        while True:  # up means the jobs API answers (asked from here: a `ray job list` costs ~1.5 CPU-s)
            try:
                JobSubmissionClient(self.address).list_jobs()
                return True
            except Exception as e:  # not up yet
                problem = str(e)
            if self.proc.poll() is not None:
                self.log.flush()
                tail = "".join(Path(self.log.name).read_text().splitlines(keepends=True)[-30:])
                if "timed out during startup" in tail and not last:
                    return False
                raise RuntimeError(f"ray start exited with {self.proc.returncode}; the end of {self.log.name}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the head did not come up in {timeout_s:.0f} s: {problem[-1000:]}")
            time.sleep(2)

    def workers(self) -> dict[str, int] | None:
        """Alive worker nodes by type (from their resources: GPU → gpu_worker); None when the head
        does not answer. Asked of the head's state API from this process, every few seconds: a
        `ray list nodes` each time would cost ~1.5 CPU-seconds."""
        from ray.util.state import list_nodes

        try:
            nodes = list_nodes(address=self.address, limit=1000, raise_on_missing_output=False)
        except Exception:
            return None
        counts: dict[str, int] = {}
        for node in nodes:
            if node.state != "ALIVE" or node.is_head_node:
                continue
            kind = "gpu_worker" if (node.resources_total or {}).get("GPU") else "cpu_worker"
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes
            try:  # ...taking ~30 s when left to itself; what is left after 5 s is killed below
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._kill_leftovers()
        self.log.close()

    def _kill_leftovers(self) -> None:
        # Worker nodes were started by the autoscaler, not by `ray start`: find them by name.
        marks = (str(self.temp_dir), f"127.0.0.1:{self.gcs_port}")
        me = {os.getpid(), os.getppid()}  # this script's own command line may name the temp dir
        killed = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.pid not in me and p.info["cmdline"] and any(m in part for part in p.info["cmdline"] for m in marks):
                    p.kill()
                    killed.append(p)
            except psutil.Error:
                pass
        psutil.wait_procs(killed, timeout=15)  # gone, not merely signalled, when this returns


def _describe(counts: dict[str, int] | None) -> str:
    if counts is None:
        return "unknown (the head did not answer)"
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "cluster.local.yaml"), help="fake multinode cluster config")
    parser.add_argument("--temp-dir", default=None, help="Ray's temp dir for this cluster (default: a new one in /tmp)")
    parser.add_argument("--gcs-port", type=int, default=None, help="default: a free port")
    parser.add_argument("--dashboard-port", type=int, default=None, help="default: a free port")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    parser.add_argument("train_args", nargs="*", help="extra arguments for pipelines/train.py (after --)")
    args = parser.parse_args(argv)

    # Short: unix socket paths under the temp dir are limited to ~100 characters.
    temp_dir = Path(args.temp_dir or tempfile.mkdtemp(prefix="flotilla-fake-", dir="/tmp"))
    gcs_port, dashboard_port = _free_ports(2)
    cluster = LocalCluster(Path(args.config), temp_dir, args.gcs_port or gcs_port,
                           args.dashboard_port or dashboard_port, temp_dir / "ray_start.log")
    seen: dict[str, int] = {}
    ok = False
    try:
        cluster.start()
        # The fake nodes share this machine's one runtime_resources directory, so the job runs
        # the checkout in place (no --working-dir) and nodes import flotilla from the venv.
        job = [str(BIN / "ray"), "job", "submit", "--address", cluster.address,
               "--runtime-env-json", json.dumps({"env_vars": {"FLOTILLA_SHIP_PACKAGE": "0"}}), "--",
               sys.executable, str(ROOT / "pipelines" / "train.py"), "--config", str(ROOT / "configs" / "digits.yaml"),
               "--set", "train.epochs=3", "--set", f"train.storage_path={ROOT / 'runs'}",
               "--set", f"track.uri=sqlite:///{ROOT / 'mlruns' / 'mlflow.db'}", *args.train_args]
        say("submitting: " + " ".join(job[job.index("--") + 1:]))
        submit = subprocess.Popen(job, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []

        def relay() -> None:  # the job's own lines, without Ray's repeated autoscaler events
            for line in submit.stdout:
                lines.append(line)
                if "(autoscaler" not in line:
                    sys.stdout.write(line)
                    sys.stdout.flush()

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        last = None
        while submit.poll() is None:
            counts = cluster.workers()
            if counts is None:
                time.sleep(2)
                continue
            for kind, n in counts.items():
                seen[kind] = max(seen.get(kind, 0), n)
            if counts != last:
                say(f"worker nodes: {_describe(counts)}")
                last = counts
            time.sleep(2)
        reader.join(timeout=10)
        if submit.returncode != 0:
            say(f"the job failed (exit {submit.returncode})")
            return 1
        say(f"the job succeeded; worker nodes seen at most: {_describe(seen)}")
        if not seen:
            say("the autoscaler added no worker node")
            return 1

        started = time.monotonic()
        deadline = started + cluster.idle_timeout_s + 180
        say(f"waiting for the autoscaler to remove idle workers (idle timeout {cluster.idle_timeout_s:.0f} s)")
        while (counts := cluster.workers()) != {}:
            if counts is not None and counts != last:
                say(f"worker nodes: {_describe(counts)}")
                last = counts
            if time.monotonic() > deadline:
                say(f"idle workers still there after {time.monotonic() - started:.0f} s: {_describe(last)}")
                return 1
            time.sleep(3)
        say(f"idle workers removed after {time.monotonic() - started:.0f} s; worker nodes: none")
        ok = True
        return 0
    finally:
        if args.keep:
            say(f"left running: RAY_AUTH_MODE=token ray status --address 127.0.0.1:{cluster.gcs_port}; "
                f"stop the head's processes with `ray stop` (temp dir {temp_dir})")
        else:
            cluster.stop()
            if ok and not args.temp_dir:
                shutil.rmtree(temp_dir, ignore_errors=True)
            say("cluster stopped" + ("" if ok else f"; its logs are in {temp_dir}/session_latest/logs"))


if __name__ == "__main__":
    sys.exit(main())
