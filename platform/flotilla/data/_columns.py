"""Tabular feature columns: what each one becomes, one pass of statistics, and Ray's preprocessors
fitted from those statistics.

Every feature column is numeric (numbers, booleans) or categorical (strings, or numbers the spec
names categorical). The steps, Ray Data preprocessors after the first:

    CastColumns         numeric → float64 (booleans 1/0), categorical → strings; a gap stays a gap
    SimpleImputer       numeric gaps ← the train split's mean (or median, or a constant)
    SimpleImputer       categorical gaps ← the category `MISSING` (or the most frequent value, or a constant)
    StandardScaler / MinMaxScaler   the numeric columns
    OneHotEncoder       categorical columns with few values (a value unseen in training: all zeros)
    OrdinalEncoder      + SimpleImputer: one number per value (unseen: -1)
    HashingVectorizer   hashed columns (unseen: the hash of the value)
    Concatenator        → one float32 `features` vector per row

Ray fits each step in a pass of its own over the data, and on a small cluster a pass costs
seconds of task start-up. Here one pass (`block_stats` on every block, `merge_stats` in the
driver) gathers what every step needs (counts, means, spreads, extremes, a median sketch, value
counts); each step then gets the stats its own `fit` would compute on the train split, with the
steps before it applied. The same pass counts both splits' rows, lists the label's classes and
builds the column profile that is logged with the run and kept in the bundle.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import pandas as pd
import pyarrow as pa

from flotilla.data._schema import FEATURES
from flotilla.data._transforms import Transform
from flotilla.errors import DataError

if TYPE_CHECKING:
    from ray.data.preprocessor import Preprocessor

MISSING = "missing"  # the category a missing categorical value becomes (by default)
UNSEEN_ORDINAL = -1.0  # an ordinal column's value never seen in training
MAX_DISTINCT = 100_000  # distinct values counted per categorical column; beyond it only `hash` encodes
SKETCH_POINTS = 512  # per block, the quantiles kept to estimate a median


@dataclass(frozen=True)
class Column:
    """One feature column's plan: its kind, how its gaps are filled, how it is encoded."""

    name: str
    kind: str  # numeric | categorical
    dtype: str  # the source's type, for the profile and messages
    impute: str  # numeric: mean | median | constant; categorical: category | most_frequent | constant
    fill_value: Any = None  # impute: constant
    encode: Optional[str] = None  # categorical: onehot | ordinal | hash; None: decided by the count of values


def _numeric_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t)


def _string_type(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t)
            or getattr(pa.types, "is_string_view", lambda _: False)(t))


def plan_columns(data, features: list[str], types: dict[str, pa.DataType], description: str) -> list[Column]:
    """The plan for each feature column from the spec's `data` section and the source's types; every
    problem at once, each naming the column and the fix."""
    problems = []
    for name in data.columns:
        if name not in features:
            problems.append(f"data.columns.{name}: {name!r} is not a feature column of {description!r}; "
                            f"feature columns: {', '.join(features)}")
    plan = []
    for name in features:
        t = types[name]
        override = data.columns.get(name)
        kind = override.kind if override is not None else "auto"
        if not (_numeric_type(t) or _string_type(t) or pa.types.is_null(t)):
            problems.append(f"feature column {name!r} is {t}; Flotilla takes numbers, booleans and strings: drop it "
                            "from data.features or convert it")
            continue
        if kind == "auto":
            kind = "categorical" if _string_type(t) else "numeric"
        elif kind == "numeric" and _string_type(t):
            problems.append(f"data.columns.{name}.kind=numeric, but {name!r} holds strings ({t}); leave it `auto` "
                            "(categorical) or convert the column to numbers")
            continue
        impute = override.impute if override is not None else None
        fill = override.fill_value if override is not None else None
        encode = override.encode if override is not None else None
        if kind == "numeric":
            impute = impute or data.impute
            if impute not in ("mean", "median", "constant"):
                problems.append(f"data.columns.{name}.impute={impute}: a numeric column takes mean, median or constant")
                continue
            if fill is None:
                fill = data.fill_value
            if impute == "constant" and not isinstance(fill, (int, float)):
                problems.append(f"data.columns.{name}.fill_value={fill!r}: numeric column {name!r} needs a number")
                continue
            if encode is not None:
                problems.append(f"data.columns.{name}.encode={encode}: only categorical columns are encoded; set "
                                f"`--set data.columns.{name}.kind=categorical` to encode it by value")
                continue
        else:
            impute = impute or "category"
            if impute not in ("category", "most_frequent", "constant"):
                problems.append(f"data.columns.{name}.impute={impute}: a categorical column takes category, "
                                "most_frequent or constant")
                continue
            fill = MISSING if fill is None else as_category(fill)
        plan.append(Column(name, kind, str(t), impute, float(fill) if kind == "numeric" else fill, encode))
    if problems:
        raise DataError("the data does not match the spec:\n  - " + "\n  - ".join(problems))
    return plan


# --------------------------------------------------------------------------- raw values
def as_category(value: Any) -> str | None:
    """A categorical value as the string it is encoded by: integral floats lose their `.0` (an
    integer column with gaps is read as floats), booleans are `true`/`false`; a gap is None, and so
    is the empty string (what an empty CSV cell in a text column is read as)."""
    if value is None or value is pd.NA or value is pd.NaT or (isinstance(value, str) and value == ""):
        return None
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return None
        if float(value).is_integer():
            return str(int(value))
    if isinstance(value, np.integer):
        return str(int(value))
    return str(value)


def as_numbers(series: pd.Series) -> pd.Series:
    """A numeric column as float64: booleans 1/0, a gap (None, NA, NaN) NaN."""
    if series.dtype == object or pd.api.types.is_bool_dtype(series.dtype) or isinstance(series.dtype, pd.BooleanDtype):
        series = series.map(lambda v: float(v) if isinstance(v, (bool, np.bool_)) else v)
    return pd.to_numeric(series, errors="coerce").astype("float64")


def numeric_matrix(df: pd.DataFrame, columns: list[str]) -> np.ndarray:
    """`columns` of `df` as one float64 array (a gap NaN): in one step where every column holds
    numbers or booleans already (the usual case; per column, a batch of 256 columns took 5x
    longer than the model), through `as_numbers` column by column otherwise."""
    if not len(df):
        return np.empty((0, len(columns)))
    dtypes = df.dtypes
    if all(pd.api.types.is_numeric_dtype(dtypes[c]) for c in columns):  # (booleans included)
        return df[columns].to_numpy(dtype=np.float64, na_value=np.nan)
    return np.column_stack([as_numbers(df[c]).to_numpy() for c in columns])


class CastColumns(Transform):
    """Raw feature values as the steps after it expect them: numeric columns float64, categorical
    columns strings (`as_category`); a gap stays a gap for the imputers."""

    FIELDS = ("numeric", "categorical")

    def __init__(self, numeric: list[str], categorical: list[str]):
        self.numeric = list(numeric)
        self.categorical = list(categorical)

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        df = df.copy(deep=False)
        for name in self.numeric:
            df[name] = as_numbers(df[name])
        for name in self.categorical:
            # (built as a list: `Series.map` would turn each None into NaN, a float among strings,
            # which Arrow cannot hold in a string column)
            df[name] = pd.Series([as_category(v) for v in df[name]], index=df.index, dtype=object)
        return df


# --------------------------------------------------------------------------- one pass of statistics
def block_stats(train: pd.DataFrame, val: pd.DataFrame, columns: list[Column], label: str | None,
                classes: bool) -> dict[str, Any]:
    """What one block contributes: row counts, the training labels (`classes`), per column the
    numbers the steps are fitted from, and infinite values on either side."""
    out: dict[str, Any] = {"rows": len(train), "val_rows": len(val), "columns": {}}
    if label is not None:
        out["label_missing"] = int(train[label].isna().sum() + val[label].isna().sum())
        if classes:
            values = [v.item() if hasattr(v, "item") else v for v in train[label].dropna().unique()]
            out["labels"] = values
    for c in columns:
        if c.kind == "numeric":
            x = as_numbers(train[c.name]).to_numpy()
            missing = np.isnan(x)
            infinite = np.isinf(x)
            finite = x[~missing & ~infinite]
            v = as_numbers(val[c.name]).to_numpy() if len(val) else np.empty(0)
            stats = {"missing": int(missing.sum()), "infinite": int(infinite.sum()),
                     "val_infinite": int(np.isinf(v).sum()), "n": int(finite.size)}
            if finite.size:
                mean = float(finite.mean())
                stats.update(mean=mean, m2=float(((finite - mean) ** 2).sum()), min=float(finite.min()),
                             max=float(finite.max()))
                if c.impute == "median":
                    ordered = np.sort(finite)
                    points = ordered[np.linspace(0, ordered.size - 1, min(SKETCH_POINTS, ordered.size)).astype(int)]
                    stats["sketch"] = [points.tolist(), finite.size / points.size]
        else:
            values = train[c.name].map(as_category)
            missing = values.isna()
            counts = values[~missing].value_counts()
            stats = {"missing": int(missing.sum()), "n": int((~missing).sum()),
                     "counts": {str(k): int(n) for k, n in counts.head(MAX_DISTINCT + 1).items()},
                     "truncated": bool(len(counts) > MAX_DISTINCT)}
        out["columns"][c.name] = stats
    return out


def merge_stats(blocks: list[dict[str, Any]], columns: list[Column]) -> dict[str, Any]:
    """The blocks' statistics as one: counts summed, means and spreads merged (Chan et al.), value
    counts added, sketches pooled."""
    total: dict[str, Any] = {"rows": 0, "val_rows": 0, "label_missing": 0, "labels": set(), "columns": {}}
    for c in columns:
        total["columns"][c.name] = ({"missing": 0, "infinite": 0, "val_infinite": 0, "n": 0, "mean": 0.0, "m2": 0.0,
                                     "min": math.inf, "max": -math.inf, "sketch": []}
                                    if c.kind == "numeric" else {"missing": 0, "n": 0, "counts": Counter(),
                                                                  "truncated": False})
    for block in blocks:
        total["rows"] += block["rows"]
        total["val_rows"] += block["val_rows"]
        total["label_missing"] += block.get("label_missing", 0)
        total["labels"].update(_hashable(v) for v in block.get("labels", []))
        for c in columns:
            into, part = total["columns"][c.name], block["columns"][c.name]
            into["missing"] += part["missing"]
            if c.kind == "numeric":
                into["infinite"] += part["infinite"]
                into["val_infinite"] += part["val_infinite"]
                if part["n"]:
                    n = into["n"] + part["n"]
                    delta = part["mean"] - into["mean"]
                    into["m2"] += part["m2"] + delta * delta * into["n"] * part["n"] / n
                    into["mean"] += delta * part["n"] / n
                    into["n"] = n
                    into["min"], into["max"] = min(into["min"], part["min"]), max(into["max"], part["max"])
                    if "sketch" in part:
                        points, weight = part["sketch"]
                        into["sketch"].extend((p, weight) for p in points)
            else:
                into["n"] += part["n"]
                into["counts"].update(part["counts"])
                into["truncated"] = into["truncated"] or part["truncated"] or len(into["counts"]) > MAX_DISTINCT
    return total


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _median(sketch: list[tuple[float, float]]) -> float:
    points = sorted(sketch)
    weights = np.cumsum([w for _, w in points])
    return float(points[int(np.searchsorted(weights, weights[-1] / 2))][0])


# --------------------------------------------------------------------------- fitted steps
@dataclass
class FittedColumns:
    steps: list  # CastColumns, then Ray's fitted preprocessors
    num_features: int  # the width of the `features` vector
    categorical: list[str]
    profile: dict[str, dict[str, Any]]  # per column, for MLflow, the bundle and serving


def fit_columns(columns: list[Column], stats: dict[str, Any], data, description: str) -> FittedColumns:
    """Ray's preprocessors for `columns`, fitted from the merged statistics of the train split."""
    # (imported here: a bundle's transforms are in this package too, and loading one needs no Ray)
    from ray.data.preprocessors import (Concatenator, HashingVectorizer, MinMaxScaler, OneHotEncoder, OrdinalEncoder,
                                        SimpleImputer, StandardScaler)

    rows = stats["rows"]
    numeric = [c for c in columns if c.kind == "numeric"]
    categorical = [c for c in columns if c.kind == "categorical"]
    problems, profile = [], {}
    fills: dict[str, float] = {}
    for c in numeric:
        s = stats["columns"][c.name]
        if s["infinite"] or s["val_infinite"]:
            problems.append(f"feature column {c.name!r} holds {s['infinite']} infinite value(s) in the train split and "
                            f"{s['val_infinite']} in the validation split of {description!r}; replace them with "
                            "numbers, or leave the cells empty for data.impute to fill")
            continue
        if c.impute != "constant" and s["n"] == 0:
            problems.append(f"feature column {c.name!r} has no values in the train split of {description!r}, so "
                            f"there is no {c.impute} to fill its gaps with; drop it from data.features or set "
                            f"`--set data.columns.{c.name}.impute=constant`")
            continue
        fills[c.name] = (c.fill_value if c.impute == "constant" else s["mean"] if c.impute == "mean"
                         else _median(s["sketch"]))
    encodings: dict[str, str] = {}
    for c in categorical:
        s = stats["columns"][c.name]
        counts = s["counts"]
        if s["missing"] and c.impute == "most_frequent" and not counts:
            problems.append(f"feature column {c.name!r} has no values in the train split of {description!r}; "
                            f"set `--set data.columns.{c.name}.impute=category`")
            continue
        gap_is_new = s["missing"] and c.impute != "most_frequent" and c.fill_value not in counts
        distinct = len(counts) + (1 if gap_is_new else 0)
        encode = c.encode or ("onehot" if distinct <= data.onehot_max and not s["truncated"] else data.high_cardinality)
        if encode in ("onehot", "ordinal") and s["truncated"]:
            problems.append(f"feature column {c.name!r} has more than {MAX_DISTINCT} distinct values; {encode} needs "
                            f"them all: `--set data.columns.{c.name}.encode=hash`")
            continue
        encodings[c.name] = encode
    if problems:
        raise DataError("the data cannot be preprocessed as the spec says:\n  - " + "\n  - ".join(problems))

    steps: list = [CastColumns([c.name for c in numeric], [c.name for c in categorical])]
    # numeric gaps, then scaling of the filled columns
    by_mean = [c.name for c in numeric if c.impute == "mean"]
    if by_mean:
        steps.append(_with_stats(SimpleImputer(by_mean, strategy="mean"), {f"mean({n})": fills[n] for n in by_mean}))
    for c in numeric:
        if c.impute != "mean":  # median and constant: the value is known now; a constant imputer per column
            steps.append(SimpleImputer([c.name], strategy="constant", fill_value=fills[c.name]))
    moments = {}
    for c in numeric:
        s = stats["columns"][c.name]
        fill, gaps = fills[c.name], s["missing"]
        n = s["n"] + gaps
        mean = (s["n"] * s["mean"] + gaps * fill) / n if n else 0.0
        m2 = s["m2"] + s["n"] * (s["mean"] - mean) ** 2 + gaps * (fill - mean) ** 2 if n else 0.0
        low = min(s["min"], fill) if gaps else s["min"]
        high = max(s["max"], fill) if gaps else s["max"]
        moments[c.name] = (mean, math.sqrt(m2 / n) if n else 0.0, low, high)
        profile[c.name] = {"kind": "numeric", "dtype": c.dtype, "missing_share": gaps / rows if rows else 0.0,
                           "min": None if s["n"] == 0 else s["min"], "max": None if s["n"] == 0 else s["max"],
                           "mean": None if s["n"] == 0 else s["mean"], "impute": c.impute, "fill_value": fill}
    names = [c.name for c in numeric]
    if names and data.scaling == "standard":
        steps.append(_with_stats(StandardScaler(names), {
            k: v for n in names for k, v in ((f"mean({n})", moments[n][0]), (f"std({n})", moments[n][1]))}))
    elif names and data.scaling == "minmax":
        steps.append(_with_stats(MinMaxScaler(names), {
            k: v for n in names for k, v in ((f"min({n})", moments[n][2]), (f"max({n})", moments[n][3]))}))

    # categorical gaps, then the encodings
    width = len(numeric)
    for impute in ("category", "constant"):
        group = [c for c in categorical if c.impute == impute]
        for fill in sorted({c.fill_value for c in group}):
            steps.append(SimpleImputer([c.name for c in group if c.fill_value == fill], strategy="constant",
                                       fill_value=fill))
    frequent = [c for c in categorical if c.impute == "most_frequent"]
    if frequent:
        steps.append(_with_stats(SimpleImputer([c.name for c in frequent], strategy="most_frequent"),
                                 {f"most_frequent({c.name})": _most_frequent(stats["columns"][c.name]["counts"])
                                  for c in frequent}))
    values: dict[str, list[str]] = {}
    for c in categorical:
        s = stats["columns"][c.name]
        counts = Counter(s["counts"])
        if s["missing"]:
            counts[c.fill_value if c.impute != "most_frequent" else _most_frequent(s["counts"])] += s["missing"]
        values[c.name] = sorted(counts)
        profile[c.name] = {"kind": "categorical", "dtype": c.dtype, "missing_share": s["missing"] / rows if rows else 0.0,
                           "cardinality": len(s["counts"]) if not s["truncated"] else f">{MAX_DISTINCT}",
                           "encode": encodings[c.name], "impute": c.impute, "fill_value": c.fill_value,
                           "top": [[v, n] for v, n in counts.most_common(10)]}
        if encodings[c.name] != "hash":
            profile[c.name]["values"] = values[c.name]
    onehot = [c.name for c in categorical if encodings[c.name] == "onehot"]
    if onehot:
        steps.append(_with_stats(OneHotEncoder(onehot), {f"unique_values({n})": _index(values[n]) for n in onehot}))
        width += sum(len(values[n]) for n in onehot)
    ordinal = [c.name for c in categorical if encodings[c.name] == "ordinal"]
    if ordinal:
        steps.append(_with_stats(OrdinalEncoder(ordinal, encode_lists=False),
                                 {f"unique_values({n})": _index(values[n]) for n in ordinal}))
        steps.append(SimpleImputer(ordinal, strategy="constant", fill_value=UNSEEN_ORDINAL))
        width += len(ordinal)
    hashed = [c.name for c in categorical if encodings[c.name] == "hash"]
    if hashed:
        steps.append(HashingVectorizer(hashed, num_features=data.hash_buckets))
        width += data.hash_buckets * len(hashed)
    steps.append(Concatenator(columns=[c.name for c in columns], output_column_name=FEATURES, dtype=np.float32,
                              flatten=bool(categorical)))
    return FittedColumns(steps, width, [c.name for c in categorical], profile)


def _with_stats(step: Preprocessor, stats: dict[str, Any]) -> Preprocessor:
    """`step` fitted: the statistics its own `fit` would compute, set as its public `stats_` (Ray
    takes a preprocessor with statistics as fitted)."""
    step.stats_ = dict(stats)
    return step


def _index(values: list[str]) -> dict[str, int]:
    return {v: i for i, v in enumerate(values)}


def _most_frequent(counts: Counter | dict) -> str:
    return min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]


def describe_columns(profile: dict[str, dict[str, Any]]) -> str:
    """One line on how the feature columns were read: `12 numeric (2 with gaps, filled by mean),
    city one-hot 4, street hash 32`."""
    numeric = [p for p in profile.values() if p["kind"] == "numeric"]
    parts = []
    if numeric:
        gaps = [p for p in numeric if p["missing_share"]]
        how = sorted({p["impute"] for p in gaps})
        parts.append(f"{len(numeric)} numeric" + (f" ({len(gaps)} with gaps, filled by {'/'.join(how)})" if gaps else ""))
    for name, p in profile.items():
        if p["kind"] == "categorical":
            size = len(p.get("values", [])) if p["encode"] != "hash" else None
            parts.append(f"{name} {p['encode']}" + (f" {size}" if p["encode"] == "onehot" else "")
                         + (f" ({p['missing_share']:.0%} missing)" if p["missing_share"] else ""))
    return ", ".join(parts)


def stats_row(stats: dict[str, Any]) -> pd.DataFrame:
    """One block's statistics as the one-row frame Ray Data carries back to the driver."""
    return pd.DataFrame({"stats": [json.dumps(stats, default=_plain)]})


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in block statistics")
