import json

import numpy as np
import pandas as pd
import pyarrow.fs as pafs
import pytest

from flotilla.data import ByteWindows, apply_all, fingerprint, from_json, split_rows, to_json
from flotilla.errors import BundleError


def _scaling_steps(columns: list[str], scaling: str):
    """A scaler (unfitted) and the concatenator, as the tabular steps end."""
    from ray.data.preprocessors import Concatenator, MinMaxScaler, StandardScaler

    steps = [StandardScaler(columns)] if scaling == "standard" else [MinMaxScaler(columns)] if scaling == "minmax" else []
    return steps + [Concatenator(columns=columns, output_column_name="features", dtype=np.float32)]


def _fitted_steps(df: pd.DataFrame, scaling: str):
    """Fit the way Ray's StandardScaler/MinMaxScaler do, without a cluster: set their stats."""
    steps = _scaling_steps(["a", "b"], scaling)
    if scaling == "standard":
        steps[0].stats_ = {f"mean({c})": df[c].mean() for c in "ab"} | {f"std({c})": df[c].std(ddof=0) for c in "ab"}
    else:
        steps[0].stats_ = {f"min({c})": df[c].min() for c in "ab"} | {f"max({c})": df[c].max() for c in "ab"}
    return steps


@pytest.mark.parametrize("scaling", ["standard", "minmax"])
def test_json_round_trip_transforms_identically(scaling):
    df = pd.DataFrame({"a": [1.0, 2.0, 3.0, 10.0], "b": [0.5, 0.5, 0.7, 0.1]})
    steps = _fitted_steps(df, scaling)
    text = json.dumps([to_json(s) for s in steps])  # must be plain JSON
    restored = [from_json(e) for e in json.loads(text)]
    rows = pd.DataFrame({"a": [4.0, -1.0], "b": [0.2, 0.9]})
    expected = np.stack(apply_all(steps, rows.copy())["features"].to_numpy())
    got = np.stack(apply_all(restored, rows.copy())["features"].to_numpy())
    np.testing.assert_array_equal(expected, got)
    assert got.dtype == np.float32
    if scaling == "standard":
        np.testing.assert_allclose(got[0, 0], (4.0 - 4.0) / df["a"].std(ddof=0), atol=1e-6)


def test_label_encoder_keeps_non_string_keys_through_json():
    from ray.data.preprocessors import LabelEncoder

    enc = LabelEncoder(label_column="y")
    enc.stats_ = {"unique_values(y)": {3: 0, 7: 1, 9: 2}}
    restored = from_json(json.loads(json.dumps(to_json(enc))))
    assert restored.stats == enc.stats_
    out = restored.transform_batch(pd.DataFrame({"y": [9, 3]}))
    assert out["y"].tolist() == [2, 0]
    assert restored.classes == [3, 7, 9] and restored.decode([2, 0]) == [9, 3]


def test_unknown_preprocessor_type_is_refused():
    with pytest.raises(BundleError, match="unknown preprocessor type 'Evil'"):
        from_json({"type": "Evil", "fields": {}})


@pytest.mark.parametrize("entry, message", [
    ({"type": "StandardScaler", "version": 2, "fields": {"columns": ["a"]}, "stats": {}}, "has version 2"),
    ({"type": "StandardScaler", "version": 1, "fields": {"columns": ["a"], "evil": 1}, "stats": {}},
     "unknown field"),
    ({"type": "StandardScaler", "version": 1, "fields": {"columns": ["a"]}, "stats": {"mean(a)": 0.0}},
     r"lacks the fitted statistic\(s\) std\(a\)"),
    ({"type": "SimpleImputer", "version": 1, "fields": {"columns": ["a"], "strategy": "median"}, "stats": {}},
     "cannot be rebuilt: Strategy median is not supported"),
])
def test_a_bundle_entry_that_cannot_be_applied_is_refused_when_loaded(entry, message):
    with pytest.raises(BundleError, match=message):
        from_json(entry)


def test_byte_windows_cut_fixed_length_windows():
    step = ByteWindows("text", context=8)
    out = step.transform_batch(pd.DataFrame({"text": ["abcdefghijklmnopqrstuvwxyz", "0123456789"]}))
    windows = np.stack(out["tokens"].to_numpy())
    assert windows.shape[1] == 9
    joined = "abcdefghijklmnopqrstuvwxyz\n\n0123456789".encode()
    assert bytes(windows[0].astype(np.uint8)) == joined[:9]
    assert bytes(windows[1].astype(np.uint8)) == joined[8:17]  # stride = context: targets overlap inputs by one
    assert ByteWindows.decode(ByteWindows.encode("héllo")) == "héllo"


def test_split_is_deterministic_disjoint_and_seeded():
    df = pd.DataFrame({"x": np.arange(2000, dtype=float), "y": np.arange(2000) % 3})
    train = split_rows(df, seed=0, val_fraction=0.2, keep="train")
    val = split_rows(df, seed=0, val_fraction=0.2, keep="val")
    assert len(train) + len(val) == 2000
    assert set(train.x).isdisjoint(val.x)
    assert 0.16 < len(val) / 2000 < 0.24
    # The same rows in another order and batching land on the same side.
    shuffled = df.sample(frac=1.0, random_state=1)
    halves = [split_rows(part, 0, 0.2, "val") for part in (shuffled[:700], shuffled[700:])]
    assert set(pd.concat(halves).x) == set(val.x)
    assert set(split_rows(df, 1, 0.2, "val").x) != set(val.x)


def test_fingerprint_changes_with_content_or_spec_not_location(tmp_path):
    fs = pafs.LocalFileSystem()
    a = tmp_path / "a.csv"
    a.write_text("x,y\n1,2\n")
    moved = tmp_path / "sub" / "a.csv"
    moved.parent.mkdir()
    moved.write_text("x,y\n1,2\n")
    spec = {"scaling": "standard"}
    base = fingerprint([str(a)], fs, spec)
    assert fingerprint([str(moved)], fs, spec) == base
    assert fingerprint([str(a)], fs, {"scaling": "minmax"}) != base
    a.write_text("x,y\n1,3\n")
    assert fingerprint([str(a)], fs, spec) != base


@pytest.mark.parametrize("scaler", ["standard", "minmax", "none"])
def test_the_array_fast_path_equals_rays_transform_batch(scaler):
    """Serving transforms arrays with `array_transform`; it must match Ray's own transform exactly."""
    from flotilla.data import FEATURES, apply_all, array_transform

    columns = ["a", "b", "c", "d"]
    steps = _scaling_steps(columns, scaler)
    if scaler == "standard":
        steps[0].stats_ = {"mean(a)": 1.5, "std(a)": 2.0, "mean(b)": -3.0, "std(b)": 0.0,  # constant column
                           "mean(c)": 0.0, "std(c)": 1e-12, "mean(d)": None, "std(d)": None}  # no values seen
    elif scaler == "minmax":
        steps[0].stats_ = {"min(a)": 0.0, "max(a)": 16.0, "min(b)": 2.0, "max(b)": 2.0,
                           "min(c)": -1.0, "max(c)": 3.0, "min(d)": None, "max(d)": None}
    rows = np.random.default_rng(0).normal(size=(7, 4)) * 5
    fast = array_transform(steps, columns)
    assert fast is not None
    expected = np.stack(apply_all(steps, pd.DataFrame(rows, columns=columns))[FEATURES].to_numpy())
    got = fast(rows)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, equal_nan=True)
    # columns given in another order than the concatenator's are mapped, not mixed up
    reordered = array_transform(steps, columns[::-1])
    np.testing.assert_allclose(reordered(rows[:, ::-1]), expected, rtol=1e-6, equal_nan=True)
