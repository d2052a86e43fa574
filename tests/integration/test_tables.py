"""Tables as people have them: string categories, booleans and gaps train and predict from the raw
rows; a run whose loss stops being a number fails at once and registers nothing."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from flotilla.bundle import load_bundle
from flotilla.errors import NotFiniteError
from flotilla.pipeline import run_training

from ._helpers import accuracy, messy_table, mlflow_runs, store_uri, tables_spec

pytestmark = pytest.mark.integration


def _by_hand(df: pd.DataFrame, x2_mean: float) -> pd.DataFrame:
    """What a user would do before Flotilla took such tables: one-hot columns for the city (and its
    gaps), the boolean as 0/1, the gaps in x2 filled with the training mean."""
    out = pd.DataFrame({"member": df["member"].astype(float), "x1": df["x1"], "x2": df["x2"].fillna(x2_mean)})
    for city in ["Berlin", "Oslo", "Paris", "Rome"]:
        out[f"city_{city}"] = (df["city"] == city).astype(float)
    out["city_missing"] = df["city"].isna().astype(float)
    if "answer" in df:
        out["answer"] = df["answer"]
    return out


def test_a_table_with_categories_and_gaps_trains_as_well_as_the_same_table_cleaned_by_hand(tables_champion,
                                                                                             tmp_path):
    outcome = tables_champion.outcome
    bundle = load_bundle(outcome.bundle_path)
    profile = bundle.profile
    assert profile["city"]["encode"] == "onehot"
    assert profile["city"]["values"] == ["Berlin", "Oslo", "Paris", "Rome", "missing"]
    assert profile["member"]["dtype"] == "bool" and profile["x2"]["missing_share"] == pytest.approx(0.15, abs=0.03)
    assert profile["x1"]["missing_share"] == 0 and profile["x1"]["min"] < -2 < 2 < profile["x1"]["max"]
    # The profile went to MLflow with the run too.
    client, runs = mlflow_runs(store_uri(tables_champion.store), "tables")
    path = client.download_artifacts(outcome.mlflow_run_id, "data_profile.json", str(tmp_path))
    assert json.loads(open(path).read()) == profile

    train = messy_table(3000, seed=0)
    cleaned = tmp_path / "cleaned.csv"
    x2_mean = train["x2"].mean()
    _by_hand(train, x2_mean).to_csv(cleaned, index=False)
    by_hand = run_training(tables_spec(tmp_path, source=cleaned, overrides=["track.enabled=false"]))

    test = messy_table(2000, seed=1)
    raw = bundle.predict(test.drop(columns=["answer"]))["predictions"]
    clean = load_bundle(by_hand.bundle_path).predict(_by_hand(test.drop(columns=["answer"]), x2_mean))["predictions"]
    ours, theirs = accuracy(raw, test["answer"].to_numpy()), accuracy(clean, test["answer"].to_numpy())
    print(f"accuracy on 2000 new rows: raw table {ours:.4f}, cleaned by hand {theirs:.4f}")
    assert ours > 0.9 and abs(ours - theirs) <= 0.01

    # Rows at inference may hold what training never saw: a new city, gaps everywhere.
    odd = pd.DataFrame({"city": ["Tokyo", None], "member": [None, True], "x1": [None, 0.5], "x2": [1.0, None]})
    out = bundle.predict(odd)
    assert len(out["predictions"]) == 2 and np.isfinite(out["probabilities"]).all()

    # `export.after_training`: the run built its ONNX variants, gated and registered with the version.
    tags = client.get_model_version("tables", outcome.registration.version).tags
    assert tags["flotilla.runtime.onnx"].startswith("passed: val_accuracy"), tags
    assert outcome.exported.records["onnx"]["max_difference"] < 1e-4
    # The same raw rows, categories and gaps included, through ONNX Runtime (preprocessing is the bundle's).
    from flotilla.track import load_registered_bundle

    onnx = load_registered_bundle(client, "tables", outcome.registration.version, runtime="onnx")
    assert onnx.runtime == "onnx"
    assert np.abs(np.asarray(onnx.predict(odd)["probabilities"]) - np.asarray(out["probabilities"])).max() < 1e-4
    assert onnx.predict(test.drop(columns=["answer"]))["predictions"] == raw


def test_a_diverging_run_stops_at_the_first_loss_that_is_not_a_number_and_registers_nothing(ray_cluster, tmp_path):
    spec = tables_spec(tmp_path, overrides=["train.lr=1e30", "train.grad_clip=0", "train.epochs=3"])
    with pytest.raises(NotFiniteError) as e:
        run_training(spec)
    message = str(e.value)
    print(message)
    assert "train_loss became nan at epoch 1, step" in message or "train_loss became inf at epoch 1, step" in message
    assert "lower train.lr (now 1e+30), or clip gradients (`--set train.grad_clip=1.0`)" in message
    assert "registered nothing" in message
    client, runs = mlflow_runs(store_uri(tmp_path), "tables")
    assert [r.info.status for r in runs] == ["FAILED"]
    assert "became" in runs[0].data.tags["flotilla.error"]
    assert client.search_model_versions("name = 'tables'") == []


def test_flotilla_predict_scores_a_file_and_sets_aside_the_rows_it_cannot(tables_champion, tmp_path, capsys):
    """`flotilla predict` on a CSV of new rows, two of them unscorable (an empty cell or `n/a` would
    be a gap, which the imputer fills): the rest are predicted as
    the bundle predicts them, the two are written aside with the reason, and the job is an MLflow
    run linked to the model version."""
    import pyarrow.parquet as pq

    from flotilla.cli import main

    rows = messy_table(300, seed=3).drop(columns=["answer"])
    rows.insert(0, "id", range(len(rows)))
    rows["x1"] = rows["x1"].astype(object)
    rows.loc[10, "x1"] = "twelve"  # the column is then read as text; its numbers still score
    rows.loc[20, "x1"] = "inf"
    rows.to_csv(tmp_path / "new.csv", index=False)
    uri = store_uri(tables_champion.store)
    code = main(["predict", "--model", "tables@champion", "--tracking-uri", uri, "--input", str(tmp_path / "new.csv"),
                 "--output", str(tmp_path / "scored"), "--id", "id"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert f"scored {len(rows) - 2} rows with tables@champion (v1)" in printed and "2 rejected" in printed

    scored = pq.read_table(tmp_path / "scored" / "predictions").to_pandas().sort_values("id")
    good = rows.drop(index=[10, 20])
    assert scored["id"].tolist() == good["id"].tolist()
    expected = load_bundle(tables_champion.outcome.bundle_path).predict(good.drop(columns=["id"]))
    assert scored["prediction"].tolist() == expected["predictions"]
    np.testing.assert_allclose(scored[["probability_no", "probability_yes"]].to_numpy(),
                               expected["probabilities"], rtol=1e-5)
    rejected = pq.read_table(tmp_path / "scored" / "rejected").to_pandas().sort_values("id")
    assert rejected["id"].tolist() == ["10", "20"]
    assert rejected["reason"].tolist() == ["column 'x1': 'twelve' is not a number", "column 'x1': 'inf' is infinite"]

    client, runs = mlflow_runs(uri, "tables")
    batch = [r for r in runs if r.data.tags.get("flotilla.kind") == "batch_prediction"]
    assert len(batch) == 1 and batch[0].data.tags["flotilla.model_version"] == "1"
    assert batch[0].data.metrics["rows_predicted"] == len(rows) - 2 and batch[0].data.metrics["rows_rejected"] == 2
