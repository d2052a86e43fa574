"""Batch scoring's actor, without Ray: rows it can score are predicted, the others written aside with the reason."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from ray.data.preprocessors import LabelEncoder

from flotilla.bundle import BUNDLE_FILES, write_bundle
from flotilla.data import DataSchema, to_json
from flotilla.errors import SpecError
from flotilla.models import build_model
from flotilla.predict import _Scorer, resolve_model
from tests.unit.test_columns import TYPES, _fit, _table
from flotilla.spec import DataSpec

COLUMNS = list(TYPES)


def _bundle_files(tmp_path) -> dict[str, bytes]:
    """A bundle of an untrained MLP over the test table's columns (weights are not the point here)."""
    import torch

    _, fitted = _fit(_table(), DataSpec(source="table.csv", onehot_max=4))
    schema = DataSchema(task="classification", feature_columns=COLUMNS, label_column="y",
                        num_features=fitted.num_features, classes=["no", "yes"], num_classes=2,
                        categorical_columns=fitted.categorical)
    spec = {"kind": "mlp", "hidden": [8], "dropout": 0.0, "activation": "relu"}
    torch.manual_seed(0)
    model = build_model(spec, schema)
    label = LabelEncoder("y")
    label.stats_ = {"unique_values(y)": {"no": 0, "yes": 1}}
    directory = tmp_path / "bundle"
    write_bundle(directory, model.state_dict(), spec, schema,
                 {"features": [to_json(s) for s in fitted.steps], "label": to_json(label), "profile": fitted.profile},
                 {"final": {}})
    return {name: (directory / name).read_bytes() for name in BUNDLE_FILES}


@pytest.mark.parametrize("backend", ["numpy", "pyarrow"])  # Ray Data hands Arrow-backed columns
def test_the_scorer_predicts_what_it_can_and_writes_the_rest_aside_with_the_reason(tmp_path, backend):
    scorer = _Scorer(_bundle_files(tmp_path), COLUMNS, ["id"], str(tmp_path / "out"), factories=[])
    batch = _table(20, seed=3)
    batch.insert(0, "id", range(20))
    batch["income"] = batch["income"].astype(str)  # a CSV column with one bad cell is read as text
    batch.loc[4, "income"] = "n/a"
    batch.loc[9, "income"] = "nan"  # a gap, not bad text
    batch.loc[7, "age"] = np.inf
    if backend == "pyarrow":
        batch = batch.convert_dtypes(dtype_backend="pyarrow")
    out = scorer(batch.copy())
    assert out["id"].tolist() == [i for i in range(20) if i not in (4, 7)]
    assert set(out["prediction"]) <= {"no", "yes"}
    np.testing.assert_allclose(out["probability_no"] + out["probability_yes"], 1.0, rtol=1e-5)
    rejected = pq.read_table(tmp_path / "out" / "rejected").to_pandas().sort_values("id")
    assert rejected["id"].tolist() == ["4", "7"]
    assert rejected["reason"].tolist() == ["column 'income': 'n/a' is not a number", "column 'age': inf is infinite"]
    assert json.loads(rejected["row"].iloc[0])["city"] == batch.loc[4, "city"]


def test_a_model_reference_is_a_name_and_alias_a_name_and_version_or_a_bundle(tmp_path):
    files = _bundle_files(tmp_path)
    assert resolve_model(str(tmp_path / "bundle"))[0] == files
    with pytest.raises(SpecError, match=r"give NAME@ALIAS \(digits@champion\), NAME/VERSION"):
        resolve_model("digits")


def test_scoring_progress_counts_the_rows_written_and_says_when_the_rest_will_be(tmp_path):
    import pyarrow as pa
    import pyarrow.fs as pafs

    from flotilla.predict import PREDICTIONS, REJECTED, ScoringProgress

    (tmp_path / PREDICTIONS).mkdir()
    pq.write_table(pa.table({"prediction": list(range(300))}), tmp_path / PREDICTIONS / "a.parquet")
    pq.write_table(pa.table({"prediction": list(range(100))}), tmp_path / PREDICTIONS / "b.parquet")
    (tmp_path / PREDICTIONS / "c.parquet").write_bytes(b"PAR1 half written")  # no footer yet: counts 0
    (tmp_path / REJECTED).mkdir()
    pq.write_table(pa.table({"reason": ["x"] * 100}), tmp_path / REJECTED / "r.parquet")
    progress = ScoringProgress(pafs.LocalFileSystem(), str(tmp_path), total=1000, every_s=0)
    line = progress.line()
    assert line.startswith("scored 500 of 1000 rows (50%), ") and " rows/s, ETA " in line, line
    assert ScoringProgress(pafs.LocalFileSystem(), str(tmp_path), total=None).line().startswith("scored 500 rows, ")
