"""Where a run's storage and tracking store live, and what a cluster refuses (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.cluster import check_storage_reaches_every_node, local_storage
from flotilla.data import resolve_source
from flotilla.errors import ClusterError, DataError
from flotilla.spec import load_spec


def test_local_storage_names_the_local_directories_a_run_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert local_storage("runs", f"sqlite:///{tmp_path}/db/mlflow.db") == {
        "train.storage_path": str(tmp_path / "runs"), "track.uri": str(tmp_path / "db")}
    assert local_storage("s3://bucket/runs", "http://10.0.0.1:5000") == {}


def test_storage_inside_a_jobs_working_dir_is_refused_with_the_fix():
    job_dir = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_abc"
    with pytest.raises(ClusterError) as e:
        check_storage_reaches_every_node({"train.storage_path": f"{job_dir}/runs", "track.uri": job_dir})
    text = str(e.value)
    assert f"train.storage_path resolves to {job_dir}/runs, inside this job's unpacked --working-dir" in text
    assert f"track.uri resolves to {job_dir}, inside this job's unpacked --working-dir" in text
    assert "--set train.storage_path=s3://BUCKET/runs" in text and "MLFLOW_TRACKING_URI" in text


def test_the_cluster_sets_the_default_storage_path(monkeypatch):
    monkeypatch.delenv("FLOTILLA_STORAGE_PATH", raising=False)
    assert load_spec(None, []).train.storage_path == "runs"
    monkeypatch.setenv("FLOTILLA_STORAGE_PATH", "s3://bucket/flotilla/runs")
    assert load_spec(None, []).train.storage_path == "s3://bucket/flotilla/runs"
    assert load_spec(None, ["train.storage_path=/mnt/shared/runs"]).train.storage_path == "/mnt/shared/runs"


def test_a_submitted_job_says_where_it_looked_for_a_missing_table(tmp_path, monkeypatch):
    missing = str(tmp_path / "absent.csv")
    with pytest.raises(DataError) as plain:
        resolve_source(missing)
    assert "driver" not in str(plain.value)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what Ray sets for a submitted job's driver
    with pytest.raises(DataError) as submitted:
        resolve_source(missing)
    assert "the cluster node that runs this job's driver" in str(submitted.value)
    assert "inside --working-dir" in str(submitted.value)
