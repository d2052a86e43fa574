"""A shared MLflow tracking server on PostgreSQL, and two pipelines registering at once.

The test starts PostgreSQL and `mlflow server` on 127.0.0.1, runs two `pipelines/train.py`
processes against them at the same time (both on the session's local Ray), and stops both
servers. Each pipeline must get its own model version, a complete metric history and no
"database is locked" on its output.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest

from flotilla import load_spec
from tests.services import mlflow_server, postgres_server

from ._helpers import ROOT, digits_val_rows, metric_steps, mlflow_runs

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    artifacts = tmp_path_factory.mktemp("mlflow-artifacts")
    with postgres_server() as database, mlflow_server(database, artifacts) as url:
        yield url


def test_two_pipelines_register_concurrently_on_a_postgres_backed_server(ray_cluster, tracking_server, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": address}
    procs = []
    for i in range(2):
        cmd = [
            sys.executable, str(ROOT / "pipelines" / "train.py"), "--config", str(ROOT / "configs" / "digits.yaml"),
            "--set", f"track.uri={tracking_server}", "--set", "track.experiment=shared",
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
    rows, labels = digits_val_rows(load_spec(ROOT / "configs" / "digits.yaml"))
    assert (model.predict(rows.head(50))["prediction"].to_numpy() == labels[:50]).mean() > 0.8
