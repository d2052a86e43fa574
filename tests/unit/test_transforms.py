"""Flotilla's fitted transforms (what a bundle applies) against Ray Data's preprocessors (what training
applies): the same statistics, the same batch, the same output, down to column names, dtypes,
gaps, unseen values and the type of each cell."""

import json

import numpy as np
import pandas as pd
import pytest
from ray.data import preprocessors as ray_pp

from flotilla.data import from_json, to_json
from flotilla.data import _transforms as own


def _fitted(step, stats=None):
    if stats is not None:
        step.stats_ = stats  # (Ray's public attribute; Flotilla's fit sets it the same way)
    return step


def _ours(ray_step):
    """Flotilla's transform for a fitted Ray preprocessor, through the JSON a bundle holds."""
    return from_json(json.loads(json.dumps(to_json(ray_step))))


def assert_same_frame(got: pd.DataFrame, expected: pd.DataFrame) -> None:
    assert list(got.columns) == list(expected.columns)
    assert [str(t) for t in got.dtypes] == [str(t) for t in expected.dtypes]
    assert len(got) == len(expected)
    for column in expected.columns:
        g, e = got[column].tolist(), expected[column].tolist()
        for a, b in zip(g, e):
            _assert_same_cell(a, b, column)


def _assert_same_cell(a, b, column):
    assert type(a) is type(b), (column, a, b)
    if isinstance(b, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, (column, a, b)
        np.testing.assert_array_equal(a, b)
    elif isinstance(b, list):
        assert len(a) == len(b), (column, a, b)
        for x, y in zip(a, b):
            _assert_same_cell(x, y, column)
    elif isinstance(b, float) and np.isnan(b):
        assert np.isnan(a), (column, a, b)
    else:
        assert a == b, (column, a, b)


def _both(ray_step, df: pd.DataFrame):
    ours = _ours(ray_step)
    assert type(ours).__module__ == own.__name__
    before = df.copy()
    got = ours.transform_batch(df)
    pd.testing.assert_frame_equal(df, before)  # the caller's batch is left as it was
    expected = ray_step.transform_batch(df.copy())
    assert_same_frame(got, expected)
    return got


NUMBERS = pd.DataFrame({"a": [1.0, np.nan, -3.5, 1e6], "b": [0.0, 2.0, np.nan, 2.0], "c": [5.0, 5.0, 5.0, 5.0],
                        "d": [np.nan, 1.0, 2.0, 3.0], "s": pd.Series(["x", None, "y", "x"], dtype=object)})


def test_min_spread_is_rays_scaler_epsilon():
    """Ray's scalers take a spread below their epsilon as 1; Flotilla's transforms must use the same
    number, or a constant column of an old bundle would scale differently after a Ray upgrade."""
    from ray.data.preprocessors.scaler import _EPSILON

    assert own.MIN_SPREAD == _EPSILON


def test_simple_hash_is_rays():
    from ray.data.preprocessors.utils import simple_hash

    for token in ["", "x", "street 7", "héllo", "missing", "12"]:
        for buckets in (2, 4, 32, 1000):
            assert own.simple_hash(token, buckets) == simple_hash(token, buckets)


SCALER_STATS = {
    "standard": {"mean(a)": 1.5, "std(a)": 2.0, "mean(b)": 2.0, "std(b)": 0.0,  # constant in training
                 "mean(c)": 5.0, "std(c)": 1e-12, "mean(d)": None, "std(d)": None},  # ~0 spread; no values seen
    "minmax": {"min(a)": -4.0, "max(a)": 16.0, "min(b)": 2.0, "max(b)": 2.0, "min(c)": 0.0, "max(c)": 5e-9,
               "min(d)": None, "max(d)": None},
}


@pytest.mark.parametrize("scaling", ["standard", "minmax"])
@pytest.mark.parametrize("output_columns", [None, ["a2", "b2", "c2", "d2"]])
def test_scalers_equal_rays(scaling, output_columns):
    cls = ray_pp.StandardScaler if scaling == "standard" else ray_pp.MinMaxScaler
    step = _fitted(cls(["a", "b", "c", "d"], output_columns=output_columns), SCALER_STATS[scaling])
    got = _both(step, NUMBERS)
    out = output_columns or ["a", "b", "c", "d"]
    assert got[out[1]].tolist()[:2] == [-2.0, 0.0]  # a spread below the epsilon is 1
    assert got[out[3]].isna().all()  # no statistics: NaN


@pytest.mark.parametrize("make, frame", [
    (lambda: ray_pp.SimpleImputer(["a", "b"], strategy="mean"), NUMBERS),
    (lambda: ray_pp.SimpleImputer(["a"], strategy="constant", fill_value=-1.0), NUMBERS),
    (lambda: ray_pp.SimpleImputer(["a"], strategy="constant", fill_value=0.0, output_columns=["a_filled"]), NUMBERS),
    (lambda: ray_pp.SimpleImputer(["s"], strategy="constant", fill_value="missing"), NUMBERS),
    (lambda: ray_pp.SimpleImputer(["s"], strategy="most_frequent"), NUMBERS),
    # a NaN (not None) among strings; a column the batch lacks is added, filled
    (lambda: ray_pp.SimpleImputer(["s", "absent"], strategy="constant", fill_value="missing"),
     pd.DataFrame({"s": pd.Series(["x", np.nan, None], dtype=object)})),
])
def test_simple_imputer_equals_rays(make, frame):
    step = make()
    stats = {"mean(a)": 0.25, "mean(b)": 4.0, "most_frequent(s)": "x"}
    if step.strategy != "constant":
        _fitted(step, {k: v for k, v in stats.items() if k.split("(")[1][:-1] in step.columns})
    got = _both(step, frame)
    assert not got[step.output_columns].isna().to_numpy().any()


def test_simple_imputer_without_a_fill_value_is_refused_as_rays_is():
    step = _fitted(ray_pp.SimpleImputer(["a"], strategy="mean"), {"mean(a)": None})
    for transform in (step, _ours(step)):
        with pytest.raises(ValueError, match="Column a has no fill value"):
            transform.transform_batch(NUMBERS.copy())


CITIES = pd.DataFrame({"city": pd.Series(["Rome", "Berlin", "Tokyo", "missing", "Rome", ""], dtype=object),
                       "color": pd.Series(["red", "red", "blue", "green", "pink", "blue"], dtype=object),
                       "x": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})
CITY_STATS = {  # indices as Flotilla fits them (sorted), and one column where they are not in sorted order
    "unique_values(city)": {"Berlin": 0, "Paris": 1, "Rome": 2, "missing": 3},
    "unique_values(color)": {"red": 0, "green": 1, "blue": 2},
}


@pytest.mark.parametrize("output_columns", [None, ["city_1h", "color_1h"]])
def test_one_hot_encoder_equals_rays_unseen_values_all_zeros(output_columns):
    step = _fitted(ray_pp.OneHotEncoder(["city", "color"], output_columns=output_columns), CITY_STATS)
    got = _both(step, CITIES)
    city = np.stack(got[(output_columns or ["city"])[0]].to_numpy())
    assert city.dtype == np.uint8 and city.shape == (6, 4)
    assert city[2].tolist() == [0, 0, 0, 0] and city[5].tolist() == [0, 0, 0, 0]  # Tokyo, "": never seen
    assert city[3].tolist() == [0, 0, 0, 1]


@pytest.mark.parametrize("rows", [slice(None), [0, 1, 3, 4]])  # with values never seen / all seen
def test_ordinal_encoder_equals_rays(rows):
    step = _fitted(ray_pp.OrdinalEncoder(["city", "color"], encode_lists=False), CITY_STATS)
    got = _both(step, CITIES.iloc[rows].reset_index(drop=True))
    if rows == [0, 1, 3, 4]:
        assert got["city"].dtype == np.int64 and got["city"].tolist() == [2, 0, 3, 2]
    else:
        assert got["city"].dtype == np.float64 and np.isnan(got["city"][2])


@pytest.mark.parametrize("cls", [ray_pp.OneHotEncoder, ray_pp.OrdinalEncoder])
def test_encoders_refuse_gaps_as_rays_do(cls):
    step = _fitted(cls(["city"]), {"unique_values(city)": CITY_STATS["unique_values(city)"]})
    batch = pd.DataFrame({"city": pd.Series(["Rome", None], dtype=object)})
    for transform in (step, _ours(step)):
        with pytest.raises(ValueError, match=r"Unable to transform columns \['city'\] because they contain null"):
            transform.transform_batch(batch.copy())


@pytest.mark.parametrize("labels, stats", [
    ([9, 3, 7, 3], {3: 0, 7: 1, 9: 2}),
    ([9, 3, 5], {3: 0, 7: 1, 9: 2}),  # a label never seen: NaN
    (["yes", "no", "no"], {"no": 0, "yes": 1}),
])
def test_label_encoder_equals_rays(labels, stats):
    step = _fitted(ray_pp.LabelEncoder("y"), {"unique_values(y)": stats})
    frame = pd.DataFrame({"y": pd.Series(labels, dtype=object if isinstance(labels[0], str) else None),
                          "x": 1.0})
    _both(step, frame)
    ours = _ours(step)
    assert ours.classes == sorted(stats, key=stats.get)
    assert ours.decode(range(len(stats))) == ours.classes


@pytest.mark.parametrize("texts", [
    ["street 7", "a  b", "", "x x x", "héllo wörld"],
    ["street 7", None, "x", np.nan],  # a gap: None (and the other rows' counts become floats, as in Ray)
])
def test_hashing_vectorizer_equals_rays(texts):
    step = ray_pp.HashingVectorizer(["t"], num_features=4)
    got = _both(step, pd.DataFrame({"t": pd.Series(texts, dtype=object), "u": pd.Series(texts, dtype=object)}))
    assert all(sum(row) == len(text.split(" ")) for row, text in zip(got["t"], texts) if isinstance(text, str))
    _both(ray_pp.HashingVectorizer(["t", "u"], num_features=3, output_columns=["t3", "u3"]),
          pd.DataFrame({"t": pd.Series(texts, dtype=object), "u": pd.Series(texts[::-1], dtype=object)}))


def test_hashing_vectorizer_with_its_own_tokenizer_has_no_json_form():
    with pytest.raises(TypeError, match="own tokenization_fn"):
        to_json(ray_pp.HashingVectorizer(["t"], num_features=4, tokenization_fn=lambda s: list(s)))


def _encoded_batch() -> pd.DataFrame:
    """A batch as the concatenator sees it in a tabular bundle: scaled numbers, one-hot vectors,
    ordinal codes (with -1 for an unseen value), hash counts."""
    onehot = _fitted(ray_pp.OneHotEncoder(["city"]), {"unique_values(city)": CITY_STATS["unique_values(city)"]})
    ordinal = _fitted(ray_pp.OrdinalEncoder(["color"], encode_lists=False),
                      {"unique_values(color)": CITY_STATS["unique_values(color)"]})
    batch = CITIES.assign(street=pd.Series(["a b", "c", "", "a", "d d", "b"], dtype=object))
    batch = onehot.transform_batch(batch)
    batch = ordinal.transform_batch(batch)
    batch = ray_pp.SimpleImputer(["color"], strategy="constant", fill_value=-1.0).transform_batch(batch)
    return ray_pp.HashingVectorizer(["street"], num_features=4).transform_batch(batch)


@pytest.mark.parametrize("kwargs", [
    {"columns": ["x", "city", "color", "street"], "dtype": np.float32, "flatten": True},  # a tabular bundle's
    {"columns": ["street", "x", "city"], "dtype": None, "flatten": True},
    {"columns": ["color", "x"], "dtype": np.float32, "flatten": False},  # a numeric table's
    {"columns": ["x", "color"], "dtype": None, "flatten": False, "output_column_name": "concat"},
])
def test_concatenator_equals_rays(kwargs):
    step = ray_pp.Concatenator(**{"output_column_name": "features", **kwargs})
    got = _both(step, _encoded_batch())
    assert list(got.columns)[-1] == kwargs.get("output_column_name", "features")
    assert not set(kwargs["columns"]) & set(got.columns)


def test_concatenator_missing_columns_raise_if_asked():
    step = ray_pp.Concatenator(["x", "nope"], output_column_name="features", raise_if_missing=True)
    for transform in (step, _ours(step)):
        with pytest.raises(ValueError, match="Missing columns"):
            transform.transform_batch(CITIES.copy())


def test_our_transforms_write_the_json_they_were_read_from():
    """A bundle's transforms write the same entries (`to_json` of Flotilla's own classes)."""
    steps = [_fitted(ray_pp.StandardScaler(["a", "b", "c", "d"]), SCALER_STATS["standard"]),
             _fitted(ray_pp.SimpleImputer(["s"], strategy="most_frequent"), {"most_frequent(s)": "x"}),
             _fitted(ray_pp.OneHotEncoder(["city", "color"]), CITY_STATS),
             _fitted(ray_pp.OrdinalEncoder(["city"], encode_lists=False), CITY_STATS),
             _fitted(ray_pp.LabelEncoder("y"), {"unique_values(y)": {3: 0, 7: 1}}),
             ray_pp.HashingVectorizer(["t"], num_features=4),
             ray_pp.Concatenator(["x", "city"], output_column_name="features", dtype=np.float32, flatten=True)]
    for step in steps:
        entry = json.loads(json.dumps(to_json(step)))
        assert json.loads(json.dumps(to_json(from_json(entry)))) == entry
