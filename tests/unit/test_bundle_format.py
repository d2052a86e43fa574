"""The bundle's preprocessors.json from before Flotilla had its own transforms (tests/fixtures/
preprocessors_v1, written by that code with Ray's classes) loads with today's code and gives the
output Ray gave for it; loading and applying it needs no part of Ray's preprocessors."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from flotilla.data import FEATURES, TOKENS, apply_all, array_transform, from_json, to_json
from flotilla.data import _transforms as own

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "preprocessors_v1"
TABLES = ["tabular_standard", "tabular_minmax", "numeric"]


def _load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _frame(record: dict) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(record["values"][c], dtype=t)
                         for c, t in zip(record["columns"], record["dtypes"])})


def _plain(value):
    """A cell as the fixture records it (NaN as None, arrays as lists)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and np.isnan(value):
        return None
    return value


def _kind(value) -> str:
    return f"ndarray[{value.dtype}]" if isinstance(value, np.ndarray) else type(value).__name__


def _assert_close(got, expected, where: str) -> None:
    if isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_close(g, e, f"{where}[{i}]")
    elif isinstance(expected, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)), (where, got, expected)
        assert abs(got - expected) <= 1e-6 * max(1.0, abs(expected)), (where, got, expected)
    else:
        assert got == expected and type(got) is type(expected), (where, got, expected)


@pytest.mark.parametrize("name", TABLES)
def test_a_v1_bundle_loads_and_each_step_gives_rays_output(name):
    case = _load(name)
    steps = [from_json(e) for e in case["preprocessors"]["features"]]
    assert [type(s).__name__ for s in steps] == [e["type"] for e in case["preprocessors"]["features"]]
    assert all(isinstance(s, own.Transform) for s in steps)  # Flotilla's own, not Ray's
    df = _frame(case["input"])
    # each step's record holds the columns it changed; the others are as the steps before left them
    values, kinds = dict(case["input"]["values"]), dict(case["input"]["kinds"])
    for i, (step, expected) in enumerate(zip(steps, case["steps"])):
        df = step.transform_batch(df)
        values.update(expected["values"])
        kinds.update(expected["kinds"])
        where = f"{name} step {i} ({type(step).__name__})"
        assert list(df.columns) == expected["columns"], where
        assert [str(t) for t in df.dtypes] == expected["dtypes"], where
        for column in expected["columns"]:
            _assert_close([_plain(v) for v in df[column]], values[column], f"{where} column {column}")
            assert sorted({_kind(v) for v in df[column]}) == kinds[column], f"{where} column {column}"
    features = np.stack(df[FEATURES].to_numpy())
    assert features.dtype == np.float32
    np.testing.assert_allclose(features, np.array(case["features"], dtype=np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", TABLES)
def test_a_v1_bundle_label_encoder_loads_and_encodes_as_ray_did(name):
    case = _load(name)
    label = from_json(case["preprocessors"]["label"])
    assert isinstance(label, own.LabelEncoder)
    column = case["fit"]["label"]
    out = label.transform_batch(pd.DataFrame({column: case["label"]["values"]}))
    encoded = case["label"]["encoded"]
    assert [str(t) for t in out.dtypes] == encoded["dtypes"]
    assert out[column].tolist() == encoded["values"][column]
    assert label.decode(out[column]) == case["label"]["values"]


def test_the_numeric_v1_bundle_keeps_the_array_fast_path():
    case = _load("numeric")
    steps = [from_json(e) for e in case["preprocessors"]["features"]]
    fast = array_transform(steps, case["input"]["columns"])
    assert fast is not None
    rows = _frame(case["input"]).to_numpy(dtype=np.float64)
    np.testing.assert_allclose(fast(rows), np.array(case["features"], dtype=np.float32), rtol=1e-6, atol=1e-6)
    for name in ("tabular_standard", "tabular_minmax"):  # categorical columns: the pandas path
        case = _load(name)
        assert array_transform([from_json(e) for e in case["preprocessors"]["features"]],
                               case["input"]["columns"]) is None


def test_a_v1_text_bundle_cuts_the_same_windows():
    case = _load("text")
    (step,) = [from_json(e) for e in case["preprocessors"]["features"]]
    windows = step.transform_batch(_frame(case["input"]))
    assert [_plain(w) for w in windows[TOKENS]] == case["steps"][0]["values"][TOKENS]
    assert to_json(step) == case["preprocessors"]["features"][0]


def _without_ray_bookkeeping(entries):
    """The v1 entries less Ray's own `_fitted` flag among the fields, which Flotilla no longer writes
    (nor needs: the statistics are there or not)."""
    if isinstance(entries, list):
        return [_without_ray_bookkeeping(e) for e in entries]
    return {**entries, "fields": {k: v for k, v in entries["fields"].items() if k != "_fitted"}}


@pytest.mark.parametrize("name", TABLES)
def test_to_json_still_writes_the_v1_layout(name):
    """Fitting the fixture's train rows again (as `prepare_data` does, no cluster) writes the JSON
    the fixture holds; and Flotilla's transforms, loaded from it, write it back unchanged."""
    from ray.data.preprocessors import LabelEncoder

    from flotilla.data._columns import block_stats, fit_columns, merge_stats, plan_columns
    from flotilla.data._prepare import _sort_key
    from flotilla.spec import DataSpec

    case = _load(name)
    fit = case["fit"]
    train = _frame(fit["train"])
    types = {c: pa.type_for_alias(t) for c, t in fit["types"].items()}
    data = DataSpec(source="table.csv", **fit["data"])
    columns = plan_columns(data, list(types), types, "table.csv")
    stats = merge_stats([json.loads(json.dumps(block_stats(p, p.iloc[:0], columns, fit["label"], True), default=float))
                         for p in (train.iloc[0::2], train.iloc[1::2])], columns)
    fitted = fit_columns(columns, stats, data, "table.csv")
    label = LabelEncoder(label_column=fit["label"])
    classes = sorted(stats["labels"], key=_sort_key)
    label.stats_ = {f"unique_values({fit['label']})": {v: i for i, v in enumerate(classes)}}
    written = json.loads(json.dumps({"features": [to_json(s) for s in fitted.steps], "label": to_json(label),
                                     "profile": fitted.profile}))
    expected = case["preprocessors"]
    assert written["profile"] == expected["profile"]
    assert written["features"] == _without_ray_bookkeeping(expected["features"])
    assert written["label"] == _without_ray_bookkeeping(expected["label"])
    loaded = [from_json(e) for e in expected["features"]] + [from_json(expected["label"])]
    assert [json.loads(json.dumps(to_json(s))) for s in loaded] == written["features"] + [written["label"]]


def test_a_v1_bundle_serves_the_recorded_features(tmp_path):
    """The bundle itself (load_bundle, as serving and batch scoring load it) on the fixture's files."""
    from flotilla.bundle import load_bundle, write_bundle
    from flotilla.data import DataSchema
    from flotilla.models import build_model

    for name in ("tabular_standard", "numeric"):
        case = _load(name)
        features = np.array(case["features"], dtype=np.float32)
        categorical = case["preprocessors"]["features"][0]["fields"]["categorical"]
        schema = DataSchema(task="classification", feature_columns=case["input"]["columns"],
                            label_column=case["fit"]["label"], num_features=features.shape[1], classes=[0, 1, 2],
                            num_classes=3, categorical_columns=categorical or None)
        spec = {"kind": "mlp", "hidden": [4], "dropout": 0.0, "activation": "relu"}
        directory = write_bundle(tmp_path / name, build_model(spec, schema).state_dict(), spec, schema,
                                 case["preprocessors"], {"final": {}})
        bundle = load_bundle(directory)
        rows = _frame(case["input"])
        np.testing.assert_allclose(bundle.transform(rows).numpy(), features, rtol=1e-6, atol=1e-6)
        if not categorical:
            np.testing.assert_allclose(bundle.transform(rows.to_numpy(dtype=np.float64)).numpy(), features,
                                       rtol=1e-6, atol=1e-6)
        assert len(bundle.predict(rows)["predictions"]) == len(rows)


def test_loading_and_applying_a_bundle_imports_nothing_of_rays_preprocessors():
    """In a fresh interpreter: every fixture entry loaded and applied, and Ray's preprocessor classes
    (and the private names of their module) never imported; nor torch, which the Ray Data workers
    that apply these transforms to a run's data have no use for."""
    script = f"""
import json, sys
from pathlib import Path
import pandas as pd
from flotilla.data import apply_all, array_transform, from_json
for path in sorted(Path({str(FIXTURES)!r}).glob("*.json")):
    case = json.loads(path.read_text())
    steps = [from_json(e) for e in case["preprocessors"]["features"]]
    record = case["input"]
    df = pd.DataFrame({{c: pd.Series(record["values"][c], dtype=t)
                       for c, t in zip(record["columns"], record["dtypes"])}})
    apply_all(steps, df)
    array_transform(steps, record["columns"])
    if case["preprocessors"]["label"]:
        label = from_json(case["preprocessors"]["label"])
        label.transform_batch(pd.DataFrame({{label.label_column: case["label"]["values"]}}))
loaded = sorted(m for m in sys.modules if m.startswith("ray.data.preprocessors") or m == "torch")
print(json.dumps(loaded))
"""
    env = {"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


PRIVATE = re.compile(r"\b(_get_stats|_get_serializable_fields|_set_serializable_fields|_set_stats|"
                     r"_stat_computation_plan|_fitted|_EPSILON)\b|from ray\.data\.preprocessors\S* import .*\b_\w+")


def test_flotilla_uses_no_private_name_of_rays_preprocessors():
    """Ray's preprocessors' private names (how they store and restore their state) change between Ray
    releases; Flotilla's code reads only their public attributes."""
    uses = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in sorted((ROOT / "platform" / "flotilla").rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert uses == []
