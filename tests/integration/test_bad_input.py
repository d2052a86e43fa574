"""Bad input fails fast with a message that names the input and the fix."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from flotilla.pipeline import run_training
from flotilla.errors import ClusterError, DataError

from ._helpers import ROOT, digits_spec

pytestmark = pytest.mark.integration


def _fails_fast(spec, error, match):
    started = time.monotonic()
    with pytest.raises(error, match=match):
        run_training(spec)
    assert time.monotonic() - started < 60, "a bad input must fail fast, not after training"


def _csv(tmp_path, df, name="data.csv"):
    path = tmp_path / name
    df.to_csv(path, index=False)
    return path


def test_missing_file(ray_cluster, tmp_path):
    spec = digits_spec(tmp_path, f"data.source={tmp_path / 'nope.parquet'}")
    _fails_fast(spec, DataError, r"nope.parquet' does not exist; point `--set data.source=...`")


def test_unknown_label_column(ray_cluster, tmp_path):
    path = _csv(tmp_path, pd.DataFrame({"a": [1.0, 2.0], "b": [3.0, 4.0], "y": [0, 1]}))
    spec = digits_spec(tmp_path, f"data.source={path}", "data.label=label")
    _fails_fast(spec, DataError, r"data.label='label' is not in .*columns: a, b, y")


def test_infinite_values_and_a_misread_column_are_named_before_training(ray_cluster, tmp_path):
    df = pd.DataFrame({"a": [1.0, float("inf")] * 20, "city": ["x", "y"] * 20, "y": [0, 1] * 20})
    path = _csv(tmp_path, df)
    spec = digits_spec(tmp_path, f"data.source={path}", "data.label=y")
    _fails_fast(spec, DataError, r"feature column 'a' holds \d+ infinite value\(s\) in the train split and \d+ in the "
                r"validation split of .*data.csv'; replace them with numbers, or leave the cells empty")
    spec = digits_spec(tmp_path, f"data.source={path}", "data.label=y", "data.columns.city.kind=numeric")
    _fails_fast(spec, DataError, r"data.columns.city.kind=numeric, but 'city' holds strings")


def test_empty_dataset(ray_cluster, tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("a,b,y\n")
    spec = digits_spec(tmp_path, f"data.source={path}", "data.label=y")
    _fails_fast(spec, DataError, r"(empty|no rows)")


def test_more_workers_than_the_cluster_can_hold(ray_cluster, tmp_path):
    spec = digits_spec(tmp_path, "train.num_workers=8")
    _fails_fast(spec, ClusterError, r"train.num_workers=8 x train.cpus_per_worker=1 needs 8 CPUs .* has 3 in all")


def test_csv_source_trains_like_parquet(ray_cluster, tmp_path):
    """A directory of CSV files with a string label goes through the same path as the samples."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    labels = np.where(x[:, 0] + x[:, 1] > 0, "yes", "no")
    df = pd.DataFrame({"f0": x[:, 0], "f1": x[:, 1], "f2": x[:, 2], "answer": labels})
    (tmp_path / "csv").mkdir()
    _csv(tmp_path / "csv", df[:200], "part-0.csv")
    _csv(tmp_path / "csv", df[200:], "part-1.csv")
    spec = digits_spec(
        tmp_path, f"data.source={tmp_path / 'csv'}", "data.label=answer", "train.epochs=3", "train.batch_size=16",
        "train.zero_stage=0", "train.precision=fp32", "train.comm.sync_every=2",
    )
    from flotilla.bundle import load_bundle

    outcome = run_training(spec)
    assert outcome.metrics["val_accuracy"] > 0.85
    # ZeRO stage 0 (no partitioning) trains and its weights reproduce the engine's outputs.
    first, last = outcome.history[0], outcome.history[-1]
    assert last["train_loss"] < first["train_loss"] and last["zero_stage"] == 0
    # ...as local SGD on 2 workers: no gradients sent, the weights averaged every 2 steps (train.comm.sync_every)
    # and before they are evaluated and bundled (the bundle check above compares rank 0's engine).
    assert (last["gradient_dtype"], last["sync_every"], last["world_size"]) == ("not sent", 2, 2)
    bundle = load_bundle(outcome.bundle_path)
    assert bundle.metrics["bundle_check_max_abs_diff"] < 1e-5
    assert bundle.classes == ["no", "yes"]
    assert bundle.predict([{"f0": 2.0, "f1": 2.0, "f2": 0.0}])["predictions"] == ["yes"]


def test_entry_script_reports_spec_errors_before_ray_starts():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / "train.py"), "-c", "configs/digits.yaml", "--set", "trian.lr=1",
         "--set", "train.zero_stage=5"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "did you mean `train`?" in proc.stderr and "`train.zero_stage`" in proc.stderr
    assert "Traceback" not in proc.stderr and "ray" not in proc.stdout.lower()


def test_broken_model_factory_fails_before_training(ray_cluster, tmp_path):
    from flotilla.errors import ModelError

    spec = digits_spec(tmp_path, "model={kind: custom, factory: 'no_such_module:build'}")
    _fails_fast(spec, ModelError, r"model.factory 'no_such_module:build': cannot import 'no_such_module'")


def test_unreachable_tracking_server_fails_before_training(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    uri = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / "train.py"), "-c", str(ROOT / "configs" / "digits.yaml"),
         "--set", f"track.uri={uri}",
         "--set", f"train.storage_path={tmp_path / 'runs'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"track.uri '{uri}': cannot reach the MLflow tracking server" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists(), "nothing may start before the tracking store is known to work"
    assert time.monotonic() - started < 60
