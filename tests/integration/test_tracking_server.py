"""A shared MLflow tracking server on PostgreSQL, two pipelines registering at once, and the server dying.

The test starts PostgreSQL and `mlflow server` on 127.0.0.1, runs two `pipelines/train.py`
processes against them at the same time (both on the session's local Ray), and stops both
servers. Each pipeline must get its own model version, a complete metric history and no
"database is locked" on its output. One reaches the server with a password in its tracking URI,
which must appear nowhere Flotilla writes. The server is killed mid-run and started again: the
training does not wait for it, and its metrics reach the runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from flotilla import load_spec
from flotilla.track import champion_history
from tests.services import free_port, mlflow_server_process, postgres_server

from ._helpers import ROOT, digits_val_rows, metric_steps, mlflow_runs, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SECRET = "s3cr3t-pw"


class _Server:
    """`mlflow server` on PostgreSQL that a test can kill and start again on the same port."""

    def __init__(self, database: str, artifacts: Path, stack: contextlib.ExitStack):
        self.database, self.artifacts, self.stack = database, artifacts, stack
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        _, self.proc = self.stack.enter_context(mlflow_server_process(self.database, self.artifacts, port=self.port))

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    artifacts = tmp_path_factory.mktemp("mlflow-artifacts")
    with postgres_server() as database, contextlib.ExitStack() as stack:
        server = _Server(database, artifacts, stack)
        server.start()
        yield server


def _epochs_done(run_dir: Path) -> int:
    """The newest epoch a run has a checkpoint of (it keeps its last two)."""
    return max((int(c.name[len("checkpoint_epoch"):][:4]) for c in run_dir.glob("checkpoint_epoch*")), default=0)


def test_two_pipelines_register_concurrently_on_a_postgres_backed_server(ray_cluster, tracking_server, tmp_path):
    """...and the server is SIGKILLed once both have trained 2 epochs, and started again (same
    database, same port) once both have trained 5 of 8: no epoch waited for it, and every epoch's
    metrics reached the runs once."""
    address = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": address}
    procs, epochs = [], 8
    url = tracking_server.url
    # The first pipeline reaches the server with credentials in its URI (the server ignores them).
    uris = [url.replace("http://", f"http://flotilla:{SECRET}@", 1), url]
    for i in range(2):
        cmd = [
            sys.executable, str(ROOT / "pipelines" / "train.py"), "--config", str(ROOT / "configs" / "digits.yaml"),
            "--set", f"track.uri={uris[i]}", "--set", "track.experiment=shared",
            "--set", "track.model_name=digits-shared", "--set", f"train.storage_path={tmp_path / 'runs'}",
            # Half a CPU per worker: both pipelines (worker + Ray Data's CPU each) fit the 3-CPU cluster
            # at once, so they really run concurrently instead of one waiting for the other's CPUs.
            "--set", f"train.run_name=concurrent-{i}", "--set", "train.num_workers=1", "--set", f"train.epochs={epochs}",
            "--set", "train.cpus_per_worker=0.5",
            "--set", "track.gate.require=[]",
        ]
        with open(tmp_path / f"pipeline-{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path))
    run_dirs = [tmp_path / "runs" / f"concurrent-{i}" for i in range(2)]

    def both_reached(epoch: int) -> None:
        deadline = time.monotonic() + 300
        while min(map(_epochs_done, run_dirs)) < epoch:
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, [_epochs_done(d) for d in run_dirs]
            time.sleep(0.1)

    try:
        both_reached(2)
        # Logged while the runs train (the driver reads what Ray Train's controller hands over):
        # the first epoch of each is in MLflow before either run ends.
        def first_epochs_logged() -> bool:
            client, runs = mlflow_runs(url, "shared")
            return len(runs) == 2 and all(1 in metric_steps(client, r.info.run_id) for r in runs)

        wait_for(first_epochs_logged, 60, "epoch 1 of both runs in MLflow while they train")
        assert all(p.poll() is None for p in procs), "a run ended before its live metrics were checked"
        tracking_server.kill()
        down = time.time()
        # The slower run trains three epochs or more with nobody to log them to (the faster one what
        # it has left): none waited for the server. (Before, the first one's report waited on
        # MLflow's retries for minutes, and the workers stopped at the next epoch: this never came.)
        both_reached(5)
        up = time.time()
        tracking_server.start()
        for proc in procs:
            proc.wait(timeout=900)
    finally:  # a failed or hung pipeline must not outlive the test and hold the cluster's CPUs
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    outputs = [(tmp_path / f"pipeline-{i}.log").read_text() for i in range(2)]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    for run_dir in run_dirs:  # (information: Ray Train's checkpoints trail the epochs by a second or two)
        history = json.loads((run_dir / "bundle" / "metrics.json").read_text())["history"]
        print(f"{run_dir.name}: epochs that ended while the server was down: "
              f"{[m['epoch'] for m in history if down < m['ended_at'] < up]}")
    for out in outputs:
        assert "database is locked" not in out.lower()
        assert "registered digits-shared v" in out

    client, runs = mlflow_runs(url, "shared")
    assert sorted(r.info.run_name for r in runs) == ["concurrent-0", "concurrent-1"]
    versions = client.search_model_versions("name = 'digits-shared'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert {v.run_id for v in versions} == {r.info.run_id for r in runs}
    # Both gates ran at once (the server's return released both): one champion, and the history
    # a rollback reads ends with it. (The first time, both inserted the history tag and one failed.)
    champion = str(client.get_model_version_by_alias("digits-shared", "champion").version)
    assert champion_history(client, "digits-shared")[-1] == champion
    # The gates took turns (the promotion lock): whichever decided second compared itself with the
    # champion the first left, so the champion is the better of the two on the same validation rows
    # (ties go to the first), and the other one failed its gate or was no worse.
    scores = {v.version: float(v.tags["flotilla.gate.candidate_val_accuracy"]) for v in versions}
    assert scores[champion] >= max(scores.values()), (scores, champion)
    assert [m.name for m in client.search_registered_models()] == ["digits-shared"]  # no lock left behind
    for run in runs:
        assert run.info.status == "FINISHED"
        for key in ("train_loss", "val_accuracy"):
            assert metric_steps(client, run.info.run_id, key) == list(range(1, epochs + 1))
        assert "training_curves.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
    # The registry on the server serves the model: predictions through pyfunc, artifacts proxied.
    mlflow.set_tracking_uri(url)
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



def test_promotions_and_a_rollback_at_once_against_the_server_lose_none(tracking_server, tmp_path):
    """Promotions from eight clients at once and a rollback among them, through the PostgreSQL-backed
    server: each change of champion is whole (the promotion lock), the history lists every change in
    the order the alias took them, and the rollback lands on the champion before the last change."""
    import threading

    from mlflow import MlflowClient

    from flotilla.track import CHAMPION, alias_version, promotion_lock, rollback_champion, set_alias

    client = MlflowClient(tracking_server.url)
    client.create_registered_model("racing")
    run = client.create_run(client.create_experiment("racing"))  # the versions' source (a server takes no local path)
    for _ in range(4):
        version = client.create_model_version("racing", source=run.info.artifact_uri, run_id=run.info.run_id).version
        client.set_model_version_tag("racing", version, "flotilla.gate", "passed")
    order: list[str] = []
    errors: list[Exception] = []

    def promote(version: str) -> None:
        try:
            with promotion_lock(MlflowClient(tracking_server.url), "racing"):
                set_alias(client, "racing", CHAMPION, version, locked=True)
                order.append(version)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=promote, args=(str(1 + i % 4),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    changes = [v for i, v in enumerate(order) if i == 0 or v != order[i - 1]]
    assert champion_history(client, "racing") == changes and alias_version(client, "racing", CHAMPION) == order[-1]
    current, newer = order[-1], "1" if order[-1] != "1" else "2"
    rolled = threading.Thread(target=lambda: rollback_champion(MlflowClient(tracking_server.url), "racing"))
    late = threading.Thread(target=promote, args=(newer,))
    rolled.start(), late.start()
    rolled.join(timeout=300), late.join(timeout=300)
    assert not errors, errors
    # Either order is whole: the late promotion came after the rollback (champion: the late one),
    # or the rollback undid it (champion: the one before it). Never the version before `current`
    # with the late promotion lost.
    history = champion_history(client, "racing")
    assert alias_version(client, "racing", CHAMPION) == history[-1] in (newer, current), (history, current, newer)
    assert "racing" in [m.name for m in client.search_registered_models()]
    assert not [m.name for m in client.search_registered_models() if "lock" in m.name]
