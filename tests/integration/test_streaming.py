"""Batches stream: a dataset several times the object store still trains (under ZeRO-1, whose
consolidated weights the bundle check compares with the engine), and `flotilla predict` scores all
of it with the model it trained."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ._helpers import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OBJECT_STORE_BYTES = 75 * 1024**2  # the smallest object store Ray starts with
ROWS, FEATURES, FILES = 160_000, 256, 8  # 160k x 256 float32 = 164 MB, 2.1x the object store


def _write_dataset(directory) -> int:
    rng = np.random.default_rng(0)
    per_file = ROWS // FILES
    for i in range(FILES):
        x = rng.standard_normal((per_file, FEATURES), dtype=np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
        table = pa.table({**{f"f{j}": x[:, j] for j in range(FEATURES)}, "y": y})
        pq.write_table(table, directory / f"part-{i:02d}.parquet", compression="none")
    return sum(f.stat().st_size for f in directory.glob("*.parquet"))


def test_dataset_twice_the_object_store_trains(tmp_path):
    data = tmp_path / "big"
    data.mkdir()
    size = _write_dataset(data)
    assert size > 2 * OBJECT_STORE_BYTES
    # A Ray of its own (capped object store), in a process of its own.
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / 'platform')!r})
        from flotilla import load_spec
        from flotilla.bundle import load_bundle
        from flotilla.pipeline import run_training
        from flotilla.runtime import ensure_ray
        ensure_ray(num_cpus=3, object_store_memory={OBJECT_STORE_BYTES}, include_dashboard=False, address="local")
        spec = load_spec({str(ROOT / 'configs' / 'digits.yaml')!r}, [
            "data.source={data}", "data.label=y", "data.scaling=none", "data.val_fraction=0.02",
            "model.hidden=[16]", "train.epochs=1", "train.batch_size=1024", "train.zero_stage=1",
            "train.precision=fp32", "train.comm.compression=bf16", "train.storage_path={tmp_path / 'runs'}", "train.run_name=big",
            "track.enabled=false",
        ])
        outcome = run_training(spec)
        check = load_bundle(outcome.bundle_path).metrics["bundle_check_max_abs_diff"]
        print("RESULT", json.dumps({{**outcome.metrics, "bundle_check_max_abs_diff": check}}))
        from flotilla.predict import predict_table
        scored = predict_table(outcome.bundle_path, {str(data)!r}, {str(tmp_path / 'scored')!r})
        print("SCORED", json.dumps({{"predicted": scored.predicted, "rejected": scored.rejected}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert metrics["val_accuracy"] > 0.75  # the label is the sign of f0: well above chance (0.5) in one epoch
    # ZeRO-1 (optimizer state partitioned across ranks) consolidates fp32 weights that reproduce the
    # engine's outputs (tests/integration/test_train.py lists where each stage is checked).
    assert metrics["zero_stage"] == 1 and metrics["precision"] == "fp32"
    assert metrics["gradient_dtype"] == "bfloat16"  # sent in bf16 between the 2 workers (train.comm.compression)
    assert metrics["bundle_check_max_abs_diff"] < 1e-5
    assert "OutOfMemory" not in proc.stderr and "ObjectStoreFull" not in proc.stderr
    scored = json.loads(proc.stdout.split("SCORED ", 1)[1].splitlines()[0])
    assert scored == {"predicted": ROWS, "rejected": 0}
    predictions = pq.read_table(tmp_path / "scored" / "predictions", columns=["prediction"]).column(0).to_numpy()
    labels = np.concatenate([pq.read_table(f, columns=["y"]).column(0).to_numpy() for f in sorted(data.glob("*.parquet"))])
    assert len(predictions) == ROWS and set(np.unique(predictions)) <= {0, 1}
    assert abs(predictions.mean() - labels.mean()) < 0.1  # the classes in about the data's proportions
