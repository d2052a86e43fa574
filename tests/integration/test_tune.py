"""Sweeps on a local Ray: ASHA early stopping, parent/child MLflow runs, and a killed sweep
driver resumed by running the same command again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flotilla.spec import load_spec
from flotilla.track import CANDIDATE
from flotilla.train import checkpoint_problems
from flotilla.pipeline import run_sweep

from ._helpers import ROOT, metric_steps, mlflow_runs, own_ray_processes, store_uri

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SWEEP = ROOT / "configs" / "digits_sweep.yaml"


def _children(client, runs, sweep: str):
    return [r for r in runs if r.data.tags.get("flotilla.sweep") == sweep and r.data.tags.get("flotilla.role") != "sweep"]


def test_asha_sweep_stops_weak_trials_and_registers_the_best(ray_cluster, tmp_path):
    # One trial at a time keeps ASHA's decisions independent of which trial reports first.
    spec = load_spec(SWEEP, [f"train.storage_path={tmp_path}", f"track.uri={store_uri(tmp_path)}", "train.epochs=3",
                             "tune.max_concurrent_trials=1"])
    outcome = run_sweep(spec)
    print(outcome.table())
    assert len(outcome.trials) == 4
    statuses = [t.status for t in outcome.trials]
    assert "early-stopped" in statuses and "completed" in statuses, statuses
    assert all(t.epochs < 3 for t in outcome.trials if t.status == "early-stopped")
    best = outcome.best
    done = [t for t in outcome.trials if t.status == "completed"]
    assert best.metric == max(t.metric for t in done)

    client, runs = mlflow_runs(outcome.tracking_uri)
    (parent,) = [r for r in runs if r.data.tags.get("flotilla.role") == "sweep"]
    children = _children(client, runs, outcome.name)
    assert len(children) == 4
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    by_name = {c.info.run_name: c for c in children}
    for trial in outcome.trials:
        child = by_name[trial.run_name]
        assert child.data.tags["flotilla.stop_reason"] == trial.status
        assert metric_steps(client, child.info.run_id, "val_accuracy") == list(range(1, trial.epochs + 1))
        assert child.data.params["train.lr"] == json.dumps(trial.values["train.lr"])
        assert child.info.status == {"completed": "FINISHED", "early-stopped": "KILLED"}[trial.status]
    # The best trial's metric is its child run's final metric.
    assert by_name[best.run_name].data.metrics["val_accuracy"] == pytest.approx(best.metric)
    assert parent.data.tags["flotilla.best_trial"] == best.run_name
    assert {"sweep.png", "trials.txt", "sweep.yaml"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    # Resources: each trial held 3 CPUs for its whole time, one trial at a time. Every trial is
    # counted (the early-stopped ones too), and each is longer than its training run's `fit()`.
    pm = parent.data.metrics
    assert pm["gpu_hours"] == 0 and "estimated_cost" not in pm  # no prices in the spec, no labelled nodes
    assert 0 < pm["cpu_hours"] <= 3 * pm["resource_wall_time_s"] / 3600
    finished = [by_name[t.run_name].data.metrics["cpu_hours"] for t in done]
    assert pm["cpu_hours"] > sum(finished)
    assert outcome.resources.cpu_hours == pytest.approx(pm["cpu_hours"])
    # The best trial's bundle is the registered candidate, linked to its child run.
    version = client.get_model_version("digits", outcome.registration.version)
    assert CANDIDATE in version.aliases and version.run_id == by_name[best.run_name].info.run_id


def test_killed_sweep_driver_resumes_without_rerunning_or_duplicating(ray_cluster, tmp_path):
    long_trial = 24
    uri = store_uri(tmp_path)
    cmd = [
        sys.executable, str(ROOT / "tune" / "sweep.py"), "--config", str(SWEEP),
        "--set", f"train.storage_path={tmp_path}", "--set", f"track.uri={uri}", "--set", "tune.name=restorable",
        # A short trial, then a long one (0.2-0.3 s an epoch, in the finished trial's process): the
        # driver is killed once the first has finished and the second has checkpointed an epoch.
        # The long one must outlast the lag of Tune's experiment state (synced each second).
        "--set", "tune.scheduler=fifo", "--set", "tune.num_samples=1", "--set", "tune.max_concurrent_trials=1",
        "--set", f"tune.space={{train.epochs: {{grid: [2, {long_trial}]}}}}",
    ]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address, "TUNE_GLOBAL_CHECKPOINT_S": "1"}
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    runs_dir = tmp_path / "restorable-runs"
    finished = second_run = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and first.poll() is None:
            # Kill once Tune has recorded the first trial as finished and the second trial has a
            # complete checkpoint: one finished trial, one to resume. (Any epoch's: a run keeps its
            # last two, so epoch 1's is gone half a second after it is written.)
            states = list((tmp_path / "restorable").glob("experiment_state-*.json"))
            if states and "TERMINATED" in states[0].read_text():
                resumable = [run for run in runs_dir.glob("*") if not (run / "bundle").exists()
                             and any(_complete(c) for c in run.glob("checkpoint_epoch*"))]
                bundles = list(runs_dir.glob("*/bundle"))
                if bundles and resumable:
                    finished, second_run = bundles[0].parent, resumable[0]
                    break
            time.sleep(0.2)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        log.close()
    assert finished is not None, "the sweep ended before it could be killed between its trials:\n" + (
        tmp_path / "first.log").read_text()[-3000:]
    killed_at = time.time()
    finished_mtime = (finished / "bundle" / "metrics.json").stat().st_mtime
    # The dead driver's trial actors and training workers go with it.
    deadline = time.monotonic() + 120
    while (own_ray_processes("ray::_trial") or own_ray_processes("ray::RayTrainWorker")) and time.monotonic() < deadline:
        time.sleep(0.5)

    second = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming the sweep" in second.stdout + second.stderr
    table = [line.split() for line in second.stdout.splitlines() if line.startswith("restorable-")]
    assert len(table) == 2 and all(row[-1] == "completed" for row in table), second.stdout[-2000:]

    # The finished trial was not run again; the interrupted one resumed from its checkpoint.
    assert (finished / "bundle" / "metrics.json").stat().st_mtime == finished_mtime < killed_at
    history = json.loads((second_run / "bundle" / "metrics.json").read_text())["history"]
    assert [m["epoch"] for m in history] == list(range(1, long_trial + 1))
    assert any("resumed_from_step" in m for m in history), history

    client, runs = mlflow_runs(uri)
    assert len([r for r in runs if r.data.tags.get("flotilla.role") == "sweep"]) == 1
    children = _children(client, runs, "restorable")
    assert sorted(c.info.run_name for c in children) == sorted({finished.name, second_run.name})
    for child in children:
        assert child.info.status == "FINISHED"
        epochs = {finished.name: 2, second_run.name: long_trial}[child.info.run_name]
        assert metric_steps(client, child.info.run_id) == list(range(1, epochs + 1))


def _complete(checkpoint: Path) -> bool:
    try:
        return not checkpoint_problems(str(checkpoint))
    except OSError:  # deleted while being read: the run moved on to a newer one
        return False


def test_an_erroring_trial_is_retried_and_reported_without_killing_the_sweep(ray_cluster, tmp_path):
    missing = tmp_path / "missing.parquet"
    spec = load_spec(SWEEP, [
        f"train.storage_path={tmp_path}", f"track.uri={store_uri(tmp_path)}", "train.epochs=1", "tune.name=flaky",
        "tune.scheduler=fifo", "tune.num_samples=1", "tune.max_concurrent_trials=1", "tune.trial_max_failures=1",
        f"tune.space={{data.source: {{grid: [digits, '{missing}']}}}}", "track.gate.require=[]",
    ])
    outcome = run_sweep(spec)
    by_source = {t.values["data.source"]: t for t in outcome.trials}
    assert by_source["digits"].status == "completed"
    failed = by_source[str(missing)]
    assert failed.status == "errored" and "does not exist" in failed.error, failed.error
    assert outcome.best is by_source["digits"] and outcome.registration is not None
    client, runs = mlflow_runs(outcome.tracking_uri)
    (parent,) = [r for r in runs if r.data.tags.get("flotilla.role") == "sweep"]
    assert parent.data.tags["flotilla.trials_errored"] == "1" and parent.data.tags["flotilla.trials_completed"] == "1"
    # The failed trial has its child run too (it failed before training opened one), saying why.
    (child,) = [r for r in runs if r.info.run_name == failed.run_name]
    assert child.info.status == "FAILED" and child.data.tags["flotilla.stop_reason"].startswith("errored: ")
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id


def test_a_sweep_whose_largest_trial_cannot_fit_is_refused_up_front(ray_cluster, tmp_path):
    from flotilla.errors import ClusterError

    spec = load_spec(SWEEP, [f"train.storage_path={tmp_path}", f"track.uri={store_uri(tmp_path)}",
                             "tune.space={train.num_workers: {choice: [1, 8]}}"])
    started = time.monotonic()
    with pytest.raises(ClusterError, match=r"train.num_workers=8 x train.cpus_per_worker=1 needs 8 CPUs"):
        run_sweep(spec)
    assert time.monotonic() - started < 60
    assert not (tmp_path / "digits-sweep").exists(), "no trial may start"
