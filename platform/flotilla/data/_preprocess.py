"""Declarative preprocessing with Ray Data's preprocessors, saved as JSON.

Tabular rows: the steps `flotilla.data._columns` fits (gaps filled, numeric columns scaled,
categorical ones encoded), then the feature columns are concatenated into one float32 `features`
column (Ray's Concatenator). The label is encoded separately (Ray's LabelEncoder) because rows at
inference time have none. Text: `ByteWindows` cuts UTF-8 bytes into fixed-length context windows.

Ray's own `Preprocessor.serialize()` is cloudpickle; the inference bundle must not unpickle
anything, so `to_json` / `from_json` write each preprocessor's serializable fields and fitted
stats as plain JSON and rebuild it from a fixed list of known classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from ray.data.preprocessor import Preprocessor
from ray.data.preprocessors import (Concatenator, HashingVectorizer, LabelEncoder, MinMaxScaler, OneHotEncoder,
                                    OrdinalEncoder, SimpleImputer, StandardScaler)

from flotilla.data._schema import FEATURES, TOKENS, VOCAB_SIZE  # noqa: F401 (named here too)
from flotilla.errors import BundleError



class ByteWindows(Preprocessor):
    """Turn a text column into rows of `context + 1` byte ids, stride `context`.

    Documents in a batch are joined with a blank line before cutting, so short files still
    contribute; the remainder shorter than a window is dropped.
    """

    _is_fittable = False

    def __init__(self, text_column: str, context: int):
        super().__init__()
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


def apply_all(steps: list[Preprocessor], df: pd.DataFrame) -> pd.DataFrame:
    """Apply fitted preprocessors to a pandas batch, exactly as during training."""
    for step in steps:
        df = step.transform_batch(df)
    return df


# ------------------------------------------------------------ serving fast path
def array_transform(steps: list[Preprocessor], columns: list[str]):
    """The fitted tabular steps as one vectorized function: float64 rows (in `columns` order, NaN
    for a gap) → the float32 `features` matrix, or None when a step has no array form (a
    categorical column's encoder: those rows go through `apply_all`).

    Serving calls this per batch: Ray's `transform_batch` costs ~10-40 ms per call on 64
    columns whatever the batch size (per-column pandas/Arrow work), more than the model. The
    arithmetic is Ray's own, read from the same fitted stats — a gap filled with the imputer's
    value, then mean/std (ddof 0) or min/max, a spread below Ray's epsilon treated as 1, a missing
    stat giving NaN — and a unit test holds it equal to `transform_batch` on the same rows.
    """
    from ray.data.preprocessors.scaler import _EPSILON

    from flotilla.data._columns import CastColumns

    index = {c: i for i, c in enumerate(columns)}
    fill = np.full(len(columns), np.nan)
    shift = np.zeros(len(columns))
    scale = np.ones(len(columns))
    scaled = np.zeros(len(columns), dtype=bool)
    for step in steps[:-1]:
        if isinstance(step, CastColumns):
            if step.categorical or any(c not in index for c in step.numeric):
                return None
        elif isinstance(step, SimpleImputer) and list(step.output_columns) == list(step.columns):
            for col in step.columns:
                value = step.fill_value if step.strategy == "constant" else step.stats_.get(f"{step.strategy}({col})")
                # A gap is filled before scaling, once; a fill that is not a number has no array form.
                if col not in index or scaled[index[col]] or not np.isnan(fill[index[col]]) \
                        or not isinstance(value, (int, float)) or isinstance(value, bool):
                    return None
                fill[index[col]] = value
        elif isinstance(step, (StandardScaler, MinMaxScaler)) and list(step.output_columns) == list(step.columns):
            for col in step.columns:
                if col not in index:
                    return None
                if isinstance(step, StandardScaler):
                    lo, spread = step.stats_[f"mean({col})"], step.stats_[f"std({col})"]
                else:
                    lo, hi = step.stats_[f"min({col})"], step.stats_[f"max({col})"]
                    spread = None if lo is None or hi is None else hi - lo
                if lo is None or spread is None:
                    lo, spread = np.nan, np.nan
                elif spread < _EPSILON:
                    spread = 1
                # Steps on disjoint columns compose; the same column twice would not be one affine map.
                if scaled[index[col]]:
                    return None
                shift[index[col]], scale[index[col]], scaled[index[col]] = lo, spread, True
        else:
            return None
    last = steps[-1] if steps else None
    if not isinstance(last, Concatenator) or last.output_column_name != FEATURES or getattr(last, "flatten", False):
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
_KNOWN = {cls.__name__: cls for cls in (StandardScaler, MinMaxScaler, LabelEncoder, Concatenator, SimpleImputer,
                                         OneHotEncoder, OrdinalEncoder, HashingVectorizer)}


def to_json(step: Preprocessor) -> dict[str, Any]:
    from flotilla.data._columns import CastColumns

    if isinstance(step, ByteWindows):
        return {"type": "ByteWindows", "fields": {"text_column": step.text_column, "context": step.context}}
    if isinstance(step, CastColumns):
        return {"type": "CastColumns", "fields": {"numeric": step.numeric, "categorical": step.categorical}}
    name = type(step).__name__
    if name not in _KNOWN:
        raise TypeError(f"preprocessor {name} has no JSON form")
    return {
        "type": name,
        "version": step.get_version(),
        "fields": _encode(_fields(step)),
        "stats": _encode(dict(step._get_stats())),
    }


def _fields(step: Preprocessor) -> dict[str, Any]:
    fields = step._get_serializable_fields()
    if isinstance(step, HashingVectorizer):
        # A function; Flotilla uses Ray's default (split on spaces), which `from_json` restores.
        from ray.data.preprocessors.utils import simple_split_tokenizer

        if fields.pop("tokenization_fn") is not simple_split_tokenizer:
            raise TypeError("a HashingVectorizer with its own tokenization_fn has no JSON form")
    return fields


def from_json(entry: dict[str, Any]) -> Preprocessor:
    from flotilla.data._columns import CastColumns

    kind = entry.get("type")
    if kind == "ByteWindows":
        return ByteWindows(**entry["fields"])
    if kind == "CastColumns":
        return CastColumns(**entry["fields"])
    if kind not in _KNOWN:
        raise BundleError(f"unknown preprocessor type {kind!r} in bundle; known: ByteWindows, CastColumns, "
                          f"{', '.join(_KNOWN)}")
    cls = _KNOWN[kind]
    # The same steps Ray's own deserialize() takes, from JSON instead of cloudpickle.
    from ray.data.preprocessors.utils import StatComputationPlan

    step = cls.__new__(cls)
    step._stat_computation_plan = StatComputationPlan()
    fields = _decode(entry["fields"])
    if cls is HashingVectorizer:
        from ray.data.preprocessors.utils import simple_split_tokenizer

        fields["tokenization_fn"] = simple_split_tokenizer
    step._set_serializable_fields(fields=fields, version=entry.get("version", 1))
    step._set_stats(stats=_decode(entry.get("stats", {})))
    step._fitted = True
    return step


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
