"""A shared MLflow tracking server on PostgreSQL, and two pipelines registering at once; a server that dies.

The test starts PostgreSQL and `mlflow server` on 127.0.0.1, runs two `pipelines/train.py`
processes against them at the same time (both on the session's local Ray), and stops both
servers. Each pipeline must get its own model version, a complete metric history and no
"database is locked" on its output. One reaches the server with a password in its tracking URI,
which must appear nowhere Flotilla writes. And a server that dies mid-run and comes back: the
training does not wait for it, and its metrics reach the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from flotilla import load_spec
from flotilla.train import run_training
from tests.services import free_port, mlflow_server, mlflow_server_process, postgres_server

from ._helpers import ROOT, digits_val_rows, metric_steps, mlflow_runs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SECRET = "s3cr3t-pw"


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    artifacts = tmp_path_factory.mktemp("mlflow-artifacts")
    with postgres_server() as database, mlflow_server(database, artifacts) as url:
        yield url


def test_two_pipelines_register_concurrently_on_a_postgres_backed_server(ray_cluster, tracking_server, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": address}
    procs = []
    # The first pipeline reaches the server with credentials in its URI (the server ignores them).
    uris = [tracking_server.replace("http://", f"http://flotilla:{SECRET}@", 1), tracking_server]
    for i in range(2):
        cmd = [
            sys.executable, str(ROOT / "pipelines" / "train.py"), "--config", str(ROOT / "configs" / "digits.yaml"),
            "--set", f"track.uri={uris[i]}", "--set", "track.experiment=shared",
            "--set", "track.model_name=digits-shared", "--set", f"train.storage_path={tmp_path / 'runs'}",
            # Half a CPU per worker: both pipelines (worker + Ray Data's CPU each) fit the 3-CPU cluster
            # at once, so they really run concurrently instead of one waiting for the other's CPUs.
            "--set", f"train.run_name=concurrent-{i}", "--set", "train.num_workers=1", "--set", "train.epochs=3",
            "--set", "train.cpus_per_worker=0.5",
            "--set", "track.gate.require=[]",
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path))
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=900)
            outputs.append(out)
    finally:  # a failed or hung pipeline must not outlive the test and hold the cluster's CPUs
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    for out in outputs:
        assert "database is locked" not in out.lower()
        assert "registered digits-shared v" in out

    client, runs = mlflow_runs(tracking_server, "shared")
    assert sorted(r.info.run_name for r in runs) == ["concurrent-0", "concurrent-1"]
    versions = client.search_model_versions("name = 'digits-shared'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert {v.run_id for v in versions} == {r.info.run_id for r in runs}
    for run in runs:
        assert run.info.status == "FINISHED"
        for key in ("train_loss", "val_accuracy"):
            assert metric_steps(client, run.info.run_id, key) == [1, 2, 3]
        assert "training_curves.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
    # The registry on the server serves the model: predictions through pyfunc, artifacts proxied.
    mlflow.set_tracking_uri(tracking_server)
    model = mlflow.pyfunc.load_model("models:/digits-shared@candidate")
    # The password was used, never written: not in either pipeline's output, any MLflow param, tag
    # or artifact of the runs (spec.yaml included), the runs' storage, or the Ray cluster's logs.
    assert "at http://flotilla:***@127.0.0.1:" in outputs[0], outputs[0][-3000:]
    assert not [out for out in outputs if SECRET in out]
    for run in runs:
        assert SECRET not in json.dumps([run.data.params, run.data.tags])
        files = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, dst_path=str(tmp_path / run.info.run_id)))
        assert "spec.yaml" in {f.name for f in files.rglob("*")}
        assert not [f for f in files.rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]
    assert not [f for f in (tmp_path / "runs").rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]
    logs = Path(ray_cluster._private.worker._global_node.get_session_dir_path()) / "logs"
    assert not [f for f in logs.rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]
    rows, labels = digits_val_rows(load_spec(ROOT / "configs" / "digits.yaml"))
    assert (model.predict(rows.head(50))["prediction"].to_numpy() == labels[:50]).mean() > 0.8


def test_training_goes_on_while_its_mlflow_server_is_down(ray_cluster, tmp_path):
    """The server is SIGKILLed after epoch 2 and started again (same store, same port) once three
    more epochs have trained: no epoch waited for it, and every epoch's metrics reached the run once."""
    port, epochs = free_port(), 8
    backend, artifacts = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts"
    run_dir = tmp_path / "runs" / "outage"
    spec = load_spec(ROOT / "configs" / "digits.yaml", [
        f"train.storage_path={tmp_path / 'runs'}", f"track.uri=http://127.0.0.1:{port}", "train.run_name=outage",
        f"train.epochs={epochs}", "track.gate.require=[]",
    ])

    result: dict = {}

    def train():
        try:
            result["outcome"] = run_training(spec)
        except BaseException as e:  # noqa: BLE001 -- handed to the test's thread
            result["error"] = e

    def reached(epoch: int, timeout_s: float) -> None:
        """Wait until a checkpoint of `epoch` or later exists (a run keeps its last two)."""
        deadline = time.monotonic() + timeout_s
        while not any(int(c.name[len("checkpoint_epoch"):][:4]) >= epoch for c in run_dir.glob("checkpoint_epoch*")):
            assert training.is_alive(), result
            assert time.monotonic() < deadline, f"no checkpoint of epoch {epoch} after {timeout_s:.0f}s"
            time.sleep(0.1)

    training = threading.Thread(target=train, daemon=True)  # a daemon: a failed check never waits for it
    with mlflow_server_process(backend, artifacts, port=port, workers=1) as (url, server):
        training.start()
        reached(2, 300)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    # Three epochs with nobody to log them to. (Before, the first one's report waited on MLflow's
    # retries for minutes, and the workers stopped at the next epoch: this failed here.)
    reached(5, 60)
    with mlflow_server_process(backend, artifacts, port=port, workers=1) as (url, _):
        training.join(timeout=600)
        assert "outcome" in result, result
        outcome = result["outcome"]
        client = MlflowClient(url)
        run = client.get_run(outcome.mlflow_run_id)
        history = [client.get_metric_history(run.info.run_id, key) for key in ("train_loss", "val_accuracy")]
    ended = [m["ended_at"] for m in outcome.history]
    gaps = [round(b - a, 1) for a, b in zip(ended, ended[1:])]
    print(f"seconds between the ends of consecutive epochs (server down after epoch 2 until epoch 5): {gaps}")
    assert max(gaps) < 5, gaps  # ~1 s an epoch here; minutes when a report waited on the server
    assert run.info.status == "FINISHED" and outcome.registration.version == "1"
    for points in history:  # one point per epoch, stamped when the epoch ended
        assert sorted(p.step for p in points) == list(range(1, epochs + 1)), points
        assert sorted(p.timestamp for p in points) == [int(t * 1000) for t in ended]
