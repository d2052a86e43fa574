"""Preprocessing steps and their JSON form in the inference bundle.

Tabular rows: the steps `flotilla.data._columns` fits (gaps filled, numeric columns scaled,
categorical ones encoded), then the feature columns are concatenated into one float32 `features`
column. The label is encoded separately because rows at inference time have none. Text:
`ByteWindows` cuts UTF-8 bytes into fixed-length context windows.

Training fits Ray Data's preprocessors and transforms its datasets with them. The bundle keeps
each fitted step as plain JSON (`to_json`: its type, settings and fitted statistics, read from
the preprocessor's public attributes), and loading a bundle rebuilds Flotilla's own transforms
from it (`from_json`, `flotilla.data._transforms`): no pickle, and no Ray internals, so a Ray
upgrade cannot make a registered model unloadable. The JSON layout is the one bundles have had
from the start (`type`, `version`, `fields`, `stats`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from flotilla.data import _transforms as own
from flotilla.data._columns import CastColumns
from flotilla.data._schema import FEATURES, TOKENS, VOCAB_SIZE  # noqa: F401 (named here too)
from flotilla.data._transforms import Transform
from flotilla.errors import BundleError


class ByteWindows(Transform):
    """Turn a text column into rows of `context + 1` byte ids, stride `context`.

    Documents in a batch are joined with a blank line before cutting, so short files still
    contribute; the remainder shorter than a window is dropped.
    """

    FIELDS = ("text_column", "context")

    def __init__(self, text_column: str, context: int):
        self.text_column = text_column
        self.context = context

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        data = np.frombuffer("\n\n".join(df[self.text_column].astype(str)).encode("utf-8"), dtype=np.uint8)
        width = self.context + 1
        n = max(0, (len(data) - 1) // self.context)
        if n == 0 or len(data) < width:
            return pd.DataFrame({TOKENS: pd.Series([], dtype=object)})
        starts = np.arange(n) * self.context
        starts = starts[starts + width <= len(data)]
        windows = np.stack([data[s : s + width] for s in starts]).astype(np.int64)
        return pd.DataFrame({TOKENS: list(windows)})

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")



def apply_all(steps: list, df: pd.DataFrame) -> pd.DataFrame:
    """Apply fitted steps to a pandas batch, in order: a bundle's (Flotilla's transforms), or the
    Ray preprocessors training fitted (the same arithmetic; the tests compare the two)."""
    for step in steps:
        df = step.transform_batch(df)
    return df


# ------------------------------------------------------------ serving fast path
def array_transform(steps: list, columns: list[str]):
    """The fitted tabular steps as one vectorized function: float64 rows (in `columns` order, NaN
    for a gap) → the float32 `features` matrix, or None when a step has no array form (a
    categorical column's encoder: those rows go through `apply_all`).

    Serving calls this per batch: applying the steps one by one costs per-column pandas work on
    every call whatever the batch size, more than the model. The arithmetic is the steps' own,
    from the same fitted stats — a gap filled with the imputer's value, then mean/std (ddof 0) or
    min/max, a spread below `MIN_SPREAD` treated as 1, a missing stat giving NaN — and a unit test
    holds it equal to `transform_batch` on the same rows. `steps` may be Ray's fitted
    preprocessors too (training's): they are read through their JSON form.
    """
    steps = [as_transform(s) for s in steps]
    index = {c: i for i, c in enumerate(columns)}
    fill = np.full(len(columns), np.nan)
    shift = np.zeros(len(columns))
    scale = np.ones(len(columns))
    scaled = np.zeros(len(columns), dtype=bool)
    for step in steps[:-1]:
        if isinstance(step, CastColumns):
            if step.categorical or any(c not in index for c in step.numeric):
                return None
        elif isinstance(step, own.SimpleImputer) and step.output_columns == step.columns:
            for col in step.columns:
                value = step.value(col)
                # A gap is filled before scaling, once; a fill that is not a number has no array form.
                if col not in index or scaled[index[col]] or not np.isnan(fill[index[col]]) \
                        or not own.is_number(value):
                    return None
                fill[index[col]] = value
        elif isinstance(step, (own.StandardScaler, own.MinMaxScaler)) and step.output_columns == step.columns:
            for col in step.columns:
                # Steps on disjoint columns compose; the same column twice would not be one affine map.
                if col not in index or scaled[index[col]]:
                    return None
                fit = step.affine(col)
                lo, spread = fit if fit is not None else (np.nan, np.nan)
                shift[index[col]], scale[index[col]], scaled[index[col]] = lo, spread, True
        else:
            return None
    last = steps[-1] if steps else None
    if not isinstance(last, own.Concatenator) or last.output_column_name != FEATURES or last.flatten:
        return None
    if any(c not in index for c in last.columns):
        return None
    order = np.asarray([index[c] for c in last.columns])
    dtype = last.dtype or np.float64
    gaps = ~np.isnan(fill)

    def transform(rows: np.ndarray) -> np.ndarray:
        if gaps.any():
            rows = np.where(np.isnan(rows) & gaps, fill, rows)
        return ((rows - shift) / scale)[:, order].astype(dtype, copy=False)

    return transform


# -------------------------------------------------------------------- JSON form
FORMAT_VERSION = 1  # of each entry's fields and stats; every bundle so far has 1

# Per type, the settings the JSON holds, in the order it writes them; each is the public attribute
# of that name on Ray's fitted preprocessor and an argument of Flotilla's transform of that type.
_FIELDS = {name: cls.FIELDS for name, cls in own.KNOWN.items()}


def to_json(step) -> dict[str, Any]:
    """A fitted step as JSON: Flotilla's own (ByteWindows, CastColumns, the bundle's transforms) or
    one of Ray's preprocessors that training fitted, read through its public attributes (its
    settings, and `stats_`, what its fit computed)."""
    if isinstance(step, ByteWindows):
        return {"type": "ByteWindows", "fields": {"text_column": step.text_column, "context": step.context}}
    if isinstance(step, CastColumns):
        return {"type": "CastColumns", "fields": {"numeric": step.numeric, "categorical": step.categorical}}
    name = type(step).__name__
    if name not in own.KNOWN:
        raise TypeError(f"preprocessor {name} has no JSON form")
    if isinstance(step, Transform):  # one of Flotilla's, e.g. from a bundle
        fields, stats = step.fields(), getattr(step, "stats", {})
    else:
        fields, stats = {k: getattr(step, k) for k in _FIELDS[name]}, step.stats_
        if name == "HashingVectorizer":
            _check_default_tokenizer(step.tokenization_fn)
    return {"type": name, "version": FORMAT_VERSION, "fields": _encode(fields), "stats": _encode(dict(stats))}


def _check_default_tokenizer(fn) -> None:
    # Flotilla hashes with Ray's default tokenizer (split on spaces), which its own transform does;
    # any other function has no JSON form.
    name, module = getattr(fn, "__name__", None), getattr(fn, "__module__", None) or ""
    if name != "simple_split_tokenizer" or not module.startswith("ray."):
        raise TypeError("a HashingVectorizer with its own tokenization_fn has no JSON form")


def from_json(entry: dict[str, Any]) -> Transform:
    """A bundle's JSON entry as Flotilla's transform of that type; no Ray needed."""
    kind = entry.get("type")
    if kind == "ByteWindows":
        return ByteWindows(**entry["fields"])
    if kind == "CastColumns":
        return CastColumns(**entry["fields"])
    if kind not in own.KNOWN:
        raise BundleError(f"unknown preprocessor type {kind!r} in bundle; known: ByteWindows, CastColumns, "
                          f"{', '.join(own.KNOWN)}")
    version = entry.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise BundleError(f"preprocessor {kind} in bundle has version {version}; this Flotilla reads version "
                          f"{FORMAT_VERSION}")
    cls = own.KNOWN[kind]
    fields = _decode(entry.get("fields", {}))
    # Bundles written through Ray's own field lists also hold its bookkeeping (`_`-prefixed: whether
    # it was fitted); the statistics say that here.
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    unknown = sorted(set(fields) - set(cls.FIELDS))
    if unknown:
        raise BundleError(f"preprocessor {kind} in bundle has unknown field(s) {', '.join(unknown)}; "
                          f"known: {', '.join(cls.FIELDS)}")
    stats = _decode(entry.get("stats", {}))
    try:
        step = cls(**fields, stats=stats) if issubclass(cls, own.Fitted) else cls(**fields)
    except (TypeError, ValueError) as e:
        raise BundleError(f"preprocessor {kind} in bundle cannot be rebuilt: {e}") from None
    if isinstance(step, own.Fitted):
        lacking = [k for k in step.required_stats() if k not in step.stats]
        if lacking:
            raise BundleError(f"preprocessor {kind} in bundle lacks the fitted statistic(s) {', '.join(lacking)}")
    return step


def as_transform(step) -> Transform:
    """Flotilla's transform for `step`: itself, or a Ray preprocessor read through its JSON form."""
    return step if isinstance(step, Transform) else from_json(to_json(step))


def _encode(value: Any) -> Any:
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _encode(v) for k, v in value.items()}
        return {"__pairs__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return {"__dtype__": np.dtype(value).name}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} in preprocessor JSON")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__pairs__" in value:
            return {_decode_key(k): _decode(v) for k, v in value["__pairs__"]}
        if "__dtype__" in value:
            return np.dtype(value["__dtype__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _decode_key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
