"""Real services for tests: a PostgreSQL server, an MLflow tracking server backed by it, and Prometheus.

Each is started on 127.0.0.1 with a free port and a temporary directory, and stopped — with
exactly what was started — when the `with` block ends, whatever happened inside it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (each socket stays bound until all are picked, so none repeats)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _pg_binary(name: str) -> str | None:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    return found


def _ensure_postgres_installed() -> None:
    if not (_pg_binary("initdb") and _pg_binary("pg_ctl")):
        raise RuntimeError("PostgreSQL's initdb/pg_ctl are not installed; `make test` installs them "
                           "(ops/install_test_services.sh), or install Debian's `postgresql` package")


@contextlib.contextmanager
def postgres_server(database: str = "mlflow"):
    """Yield a SQLAlchemy URI `postgresql://postgres@127.0.0.1:PORT/<database>` to a fresh server."""
    _ensure_postgres_installed()
    # initdb refuses to run as root: run the server as the `postgres` user in a directory it owns.
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="flotilla-pg-"))
    data = root / "data"
    port = free_port()
    started = False
    try:
        if as_postgres:
            shutil.chown(root, "postgres", "postgres")
        run = lambda *cmd: subprocess.run([*as_postgres, *cmd], check=True, capture_output=True, text=True, timeout=120)  # noqa: E731
        run(_pg_binary("initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        # -F: no fsync (a test database); -k: the socket lives in our directory, not /var/run.
        run(_pg_binary("pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60",
            "-o", f"-F -k {root} -h 127.0.0.1 -p {port}", "start")
        started = True
        run(_pg_binary("psql") or "psql", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-q",
            "-c", f"CREATE DATABASE {database}")
        yield f"postgresql://postgres@127.0.0.1:{port}/{database}"
    finally:
        if started:
            subprocess.run([*as_postgres, _pg_binary("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                           capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


# As cluster.yaml starts it: without MLflow's server-side job runners (Flotilla uses none), whose
# consumer processes cost ~30 CPU-seconds each time a server starts.
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@contextlib.contextmanager
def mlflow_server_process(backend_store_uri: str, artifacts: Path, timeout_s: float = 180, port: int | None = None):
    """Yield the URL of an `mlflow server` on 127.0.0.1 with the given stores, and its process (the
    leader of its own session: a test that kills the server mid-run signals the group). A `port`
    given starts it where one ran before."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = artifacts.parent / f"mlflow-server-{port}-{time.monotonic_ns()}.log"
    with _running([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                   "--backend-store-uri", backend_store_uri, "--artifacts-destination", str(artifacts),
                   "--workers", "2"],
                  f"{url}/health", log, "mlflow server", timeout_s, env=MLFLOW_SERVER_ENV) as proc:
        yield url, proc


@contextlib.contextmanager
def _running(command: list[str], ready_url: str, log_path: Path, name: str, timeout_s: float,
             env: dict[str, str] | None = None):
    """Run `command` in a session of its own until the block ends; enter once `ready_url` answers 200."""
    log = open(log_path, "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=None if env is None else {**os.environ, **env})
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {Path(log_path).read_text()[-2000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(ready_url, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer {ready_url} within {timeout_s:.0f}s: "
                                   f"{Path(log_path).read_text()[-2000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def _ensure_prometheus_installed() -> str:
    found = shutil.which("prometheus")
    if not found:
        raise RuntimeError("`prometheus` is not installed; `make test` installs it (ops/install_test_services.sh), "
                           "or install Debian's `prometheus` package")
    return found


@contextlib.contextmanager
def prometheus_server(config: dict, timeout_s: float = 120):
    """Yield the URL of a Prometheus server on 127.0.0.1 running `config` (a parsed prometheus.yml)."""
    import yaml

    binary = _ensure_prometheus_installed()
    root = Path(tempfile.mkdtemp(prefix="flotilla-prom-"))
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        with _running([binary, f"--config.file={root / 'prometheus.yml'}", f"--web.listen-address=127.0.0.1:{port}",
                       f"--storage.tsdb.path={root / 'data'}"], f"{url}/-/ready", root / "log", "prometheus", timeout_s):
            yield url
    finally:
        shutil.rmtree(root, ignore_errors=True)
