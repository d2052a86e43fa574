"""Tabular columns: the plan from the spec, the one pass of statistics, the fitted Ray preprocessors."""

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from flotilla.data import FEATURES, apply_all, array_transform, from_json, to_json
from flotilla.data._columns import as_numbers, block_stats, fit_columns, merge_stats, numeric_matrix, plan_columns
from flotilla.errors import DataError
from flotilla.spec import DataSpec

TYPES = {"age": pa.float64(), "income": pa.int64(), "member": pa.bool_(), "city": pa.string(),
         "street": pa.string()}


def _table(n: int = 400, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({
        "age": rng.normal(40, 12, n),
        "income": rng.integers(10, 100, n).astype(float),
        "member": rng.random(n) < 0.3,
        "city": rng.choice(["Berlin", "Paris", "Rome"], n).astype(object),
        "street": [f"street {i}" for i in rng.integers(0, 300, n)],
    })
    df.loc[rng.random(n) < 0.1, "age"] = np.nan
    df.loc[rng.random(n) < 0.1, "city"] = None
    return df


def _fit(df: pd.DataFrame, data: DataSpec, blocks: int = 3, types=TYPES):
    columns = plan_columns(data, list(types), types, "table.csv")
    parts = [df.iloc[i::blocks] for i in range(blocks)]
    stats = merge_stats([json.loads(json.dumps(block_stats(p, p.iloc[:0], columns, None, False), default=float)) for p in parts],
                        columns)
    return columns, fit_columns(columns, stats, data, "table.csv")


def test_defaults_impute_scale_and_encode_each_column_by_its_type():
    df = _table()
    _, fitted = _fit(df, DataSpec(source="table.csv", onehot_max=4))
    assert fitted.categorical == ["city", "street"]
    # city: Berlin, Paris, Rome + the `missing` category, one-hot; street (~300 values): 32 hash buckets
    assert fitted.profile["city"]["encode"] == "onehot" and fitted.profile["city"]["values"] == [
        "Berlin", "Paris", "Rome", "missing"]
    assert fitted.profile["street"]["encode"] == "hash"
    assert fitted.num_features == 3 + 4 + 32
    features = np.stack(apply_all(fitted.steps, df.copy())[FEATURES].to_numpy())
    assert features.shape == (len(df), fitted.num_features) and features.dtype == np.float32
    assert np.isfinite(features).all()
    # The numeric columns come out as Ray's StandardScaler would scale the mean-imputed column.
    age = df["age"].fillna(df["age"].mean())
    np.testing.assert_allclose(features[:, 0], (age - age.mean()) / age.std(ddof=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(features[:, 2], (df["member"] - df["member"].mean()) / df["member"].std(ddof=0),
                               rtol=1e-5)
    # one-hot: a missing city is the `missing` category
    onehot = features[:, 3:7]
    assert (onehot.sum(axis=1) == 1).all()
    assert (onehot[df["city"].isna().to_numpy(), 3] == 1).all()
    profile = fitted.profile["age"]
    assert profile["missing_share"] == pytest.approx(df["age"].isna().mean())
    assert profile["min"] == pytest.approx(df["age"].min()) and profile["mean"] == pytest.approx(df["age"].mean())


def test_unseen_values_and_gaps_at_inference_have_a_defined_encoding():
    df = _table()
    data = DataSpec(source="table.csv", onehot_max=4, columns={"street": {"encode": "ordinal"}})
    _, fitted = _fit(df, data)
    rows = pd.DataFrame({"age": [None, 30.0, 1.0], "income": [50, None, 1], "member": [None, True, False],
                         "city": ["Tokyo", None, ""], "street": ["nowhere", "street 7", "street 7"]})
    features = np.stack(apply_all(fitted.steps, rows)[FEATURES].to_numpy())
    assert np.isfinite(features).all()
    assert features[0, 3:7].tolist() == [0, 0, 0, 0]  # a city never seen: all zeros
    assert features[1, 3:7].tolist() == [0, 0, 0, 1]  # no city: the `missing` category
    assert features[2, 3:7].tolist() == [0, 0, 0, 1]  # an empty string (an empty CSV cell) is missing too
    assert features[0, 7] == -1  # a street never seen: ordinal -1
    assert features[1, 7] == fitted.profile["street"]["values"].index("street 7")


def test_json_round_trip_of_every_step_transforms_identically():
    df = _table()
    data = DataSpec(source="table.csv", onehot_max=4, impute="median",
                    columns={"income": {"impute": "constant", "fill_value": -1}, "city": {"impute": "most_frequent"}})
    _, fitted = _fit(df, data)
    restored = [from_json(e) for e in json.loads(json.dumps([to_json(s) for s in fitted.steps]))]
    expected = np.stack(apply_all(fitted.steps, df.copy())[FEATURES].to_numpy())
    np.testing.assert_array_equal(np.stack(apply_all(restored, df.copy())[FEATURES].to_numpy()), expected)


def test_median_and_merged_moments_match_the_whole_column():
    df = _table(2000)
    _, fitted = _fit(df, DataSpec(source="table.csv", impute="median"), blocks=7)
    assert fitted.profile["age"]["fill_value"] == pytest.approx(df["age"].median(), abs=0.5)
    assert fitted.profile["age"]["mean"] == pytest.approx(df["age"].mean(), rel=1e-12)


def test_numeric_tables_keep_the_array_fast_path_with_gaps_filled():
    types = {"a": pa.float64(), "b": pa.int64(), "c": pa.float64()}
    rng = np.random.default_rng(1)
    df = pd.DataFrame({"a": rng.normal(size=50), "b": rng.integers(0, 9, 50).astype(float), "c": rng.normal(size=50)})
    df.loc[::7, "a"] = np.nan
    for scaling, impute in [("standard", "mean"), ("minmax", "median"), ("none", "constant")]:
        _, fitted = _fit(df, DataSpec(source="t.csv", scaling=scaling, impute=impute, fill_value=3.0), types=types)
        fast = array_transform(fitted.steps, list(types))
        assert fast is not None
        rows = np.array([[np.nan, 2.0, 0.5], [1.0, np.nan, -2.0]])
        expected = np.stack(apply_all(fitted.steps, pd.DataFrame(rows, columns=list(types)))[FEATURES].to_numpy())
        np.testing.assert_allclose(fast(rows), expected, rtol=1e-6)
    _, fitted = _fit(_table(), DataSpec(source="table.csv"))
    assert array_transform(fitted.steps, list(TYPES)) is None  # categorical columns: the pandas path


def test_the_plan_names_each_problem_and_its_fix():
    types = dict(TYPES, when=pa.timestamp("s"))
    data = DataSpec(source="t.csv", columns={"nope": {"kind": "numeric"}, "city": {"kind": "numeric"},
                                             "age": {"encode": "onehot"}, "income": {"impute": "category"}})
    with pytest.raises(DataError) as e:
        plan_columns(data, list(types), types, "t.csv")
    text = str(e.value)
    assert "data.columns.nope: 'nope' is not a feature column" in text
    assert "feature column 'when' is timestamp[s]" in text
    assert "data.columns.city.kind=numeric, but 'city' holds strings" in text
    assert "data.columns.age.encode=onehot: only categorical columns are encoded" in text
    assert "data.columns.income.impute=category: a numeric column takes mean, median or constant" in text


def test_infinite_values_and_empty_columns_are_refused_before_training():
    df = _table()
    df.loc[3, "income"] = np.inf
    df["age"] = np.nan
    with pytest.raises(DataError) as e:
        _fit(df, DataSpec(source="table.csv"))
    assert "feature column 'income' holds 1 infinite value(s) in the train split" in str(e.value)
    assert "feature column 'age' has no values in the train split" in str(e.value)


def test_cast_columns_hands_arrow_a_string_column_with_nulls_for_the_gaps():
    """Ray Data converts each batch to Arrow between steps: a NaN among the strings would make it
    fall back to pickled objects, which the one-hot encoder cannot read."""
    from flotilla.data import CastColumns

    out = CastColumns(["x"], ["city"])._transform_pandas(pd.DataFrame({"x": [1, None, True, "2"],
                                                                       "city": ["a", "", None, 3.0]}))
    assert out["city"].tolist() == ["a", None, None, "3"]
    assert pa.Table.from_pandas(out).schema.field("city").type == pa.string()
    np.testing.assert_array_equal(out["x"].to_numpy(), [1.0, np.nan, 1.0, 2.0])


def test_numeric_matrix_reads_every_kind_of_column_as_as_numbers_does():
    df = pd.DataFrame({
        "f": [1.5, np.nan, -np.inf], "i": [1, 2, 3], "b": [True, False, True],
        "n": pd.array([1, None, 3], dtype="Int64"), "a": pd.array([0.5, None, 2.0], dtype="float64[pyarrow]"),
        "t": ["4", None, "x"],
    })
    by_column = np.column_stack([as_numbers(df[c]).to_numpy() for c in df.columns])
    for columns in (["f", "i", "b", "n", "a"], list(df.columns)):  # all numbers at once; with a text column
        np.testing.assert_array_equal(numeric_matrix(df, columns), by_column[:, [list(df.columns).index(c) for c in columns]])
    assert numeric_matrix(df.head(0), ["f", "t"]).shape == (0, 2)
