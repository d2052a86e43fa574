"""Flotilla's own fitted transforms: what an inference bundle applies to raw rows.

Training fits Ray Data's preprocessors (StandardScaler, SimpleImputer, OneHotEncoder, ...) and
transforms its datasets with them; the bundle keeps each one's public settings and fitted
statistics as plain JSON (`flotilla.data._preprocess.to_json`). Loading a bundle builds the
classes here from that JSON: plain Python, NumPy and pandas, with no import of Ray, so a Ray
upgrade that changes its preprocessors' internals cannot make a registered model unloadable.

Each class is named after the Ray class whose fitted form it holds (the JSON's `type`), reads the
statistics under the same keys (`mean(x)`, `unique_values(city)`, ...) and its `transform_batch`
gives what Ray's `transform_batch` gives for a pandas batch of the kind Flotilla's steps pass on
(after `CastColumns`: numeric columns float64 with NaN gaps, categorical columns of strings or
None), Ray 2.60's arithmetic: the same columns, dtypes, gaps and unseen values. Unit tests hold
each one equal to Ray's on the same statistics, and a committed fixture holds the bundles
registered before these classes existed to the output Ray gave for them.

One deliberate difference: Ray's Concatenator assigns its output by index label, so a batch
whose index is not 0..n-1 gets NaN features; here it is assigned by position (the bundle passes
a 0..n-1 index anyway).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, ClassVar

import numpy as np
import pandas as pd

logger = logging.getLogger(__name__)

# Ray Data's scalers treat a spread (standard deviation, max - min) below this as 1, so a constant
# column scales to zeros instead of dividing by ~0. The value is the epsilon constant of Ray's
# ray/data/preprocessors/scaler.py (1e-8 in Ray 2.60); a unit test holds the two equal, so an
# upgrade that changes Ray's is noticed.
MIN_SPREAD = 1e-8


class Transform:
    """One preprocessing step: `transform_batch(df) -> df` on a pandas batch; `transform(ds)` on a Ray
    Dataset (training), as a map over pandas batches."""

    # the fields the JSON form holds, in the order it writes them; the constructor's arguments
    FIELDS: ClassVar[tuple[str, ...]] = ()

    def transform_batch(self, df: pd.DataFrame) -> pd.DataFrame:
        if not isinstance(df, pd.DataFrame):
            df = pd.DataFrame(df)
        return self._transform_pandas(df)

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        raise NotImplementedError

    def transform(self, ds):
        """A Ray Dataset transformed batch by batch (as Ray's preprocessors map their pandas transforms)."""
        return ds.map_batches(self._transform_pandas, batch_format="pandas", zero_copy_batch=True)

    def fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.FIELDS}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.fields().items())})"


class Fitted(Transform):
    """A step with fitted statistics, kept under Ray's keys (`mean(x)`, `unique_values(city)`, ...)."""

    def __init__(self, stats: dict[str, Any] | None = None):
        self.stats = dict(stats or {})

    def required_stats(self) -> list[str]:
        """The statistics `transform_batch` reads; a bundle that lacks one is refused when loaded."""
        return []


def _outputs(columns: list[str], output_columns: list[str] | None) -> list[str]:
    if output_columns and len(output_columns) != len(columns):
        raise ValueError("Invalid output_columns: Got len(columns) != len(output_columns). "
                         "The length of columns and output_columns must match.")
    return list(output_columns or columns)


def _cells(rows) -> np.ndarray:
    """One object cell per row, each holding that row's 1-D array (a column of vectors, as Ray's are)."""
    cells = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        cells[i] = row
    return cells


def _check_no_nulls(df: pd.DataFrame, columns: list[str]) -> None:
    """The encoders refuse gaps (they are filled before), as Ray's do, with Ray's message."""
    null_columns = [c for c in columns if df[c].isnull().to_numpy().any()]
    if null_columns:
        raise ValueError(f"Unable to transform columns {null_columns} because they contain null values. "
                         "Consider imputing missing values first.")


def _check_scalars(series: pd.Series, what: str) -> None:
    if series.dtype == object and any(isinstance(v, (list, tuple, np.ndarray)) for v in series):
        raise ValueError(f"{what} in a bundle encodes one value per cell; column {series.name!r} holds lists")


# --------------------------------------------------------------------------- scalers
class _Scaler(Fitted):
    FIELDS = ("columns", "output_columns")

    def __init__(self, columns: list[str], output_columns: list[str] | None = None,
                 stats: dict[str, Any] | None = None):
        super().__init__(stats)
        self.columns = list(columns)
        self.output_columns = _outputs(self.columns, output_columns)

    def affine(self, column: str) -> tuple[float, float] | None:
        """`(shift, scale)`: the column becomes (x - shift) / scale; None where the fit saw no values."""
        raise NotImplementedError

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        out = df.copy(deep=False)
        scaled = {}
        for column, output in zip(self.columns, self.output_columns):  # (all read before any is written)
            values = df[column]
            fit = self.affine(column)
            if fit is None:
                scaled[output] = pd.Series(np.full(len(df), np.nan), index=df.index)
            else:
                shift, scale = fit
                scaled[output] = (values - shift) / scale
        for output, values in scaled.items():
            out[output] = values
        return out


class StandardScaler(_Scaler):
    """Ray's StandardScaler, fitted: (x - mean) / std (ddof 0), a std below `MIN_SPREAD` taken as 1,
    NaN for a column the fit saw no values of."""

    def required_stats(self) -> list[str]:
        return [k for c in self.columns for k in (f"mean({c})", f"std({c})")]

    def affine(self, column: str) -> tuple[float, float] | None:
        mean, std = self.stats[f"mean({column})"], self.stats[f"std({column})"]
        if mean is None or std is None:
            return None
        return mean, (1 if std < MIN_SPREAD else std)


class MinMaxScaler(_Scaler):
    """Ray's MinMaxScaler, fitted: (x - min) / (max - min), a range below `MIN_SPREAD` taken as 1,
    NaN for a column the fit saw no values of."""

    def required_stats(self) -> list[str]:
        return [k for c in self.columns for k in (f"min({c})", f"max({c})")]

    def affine(self, column: str) -> tuple[float, float] | None:
        low, high = self.stats[f"min({column})"], self.stats[f"max({column})"]
        if low is None or high is None:
            return None
        spread = high - low
        return low, (1 if spread < MIN_SPREAD else spread)


# --------------------------------------------------------------------------- gaps
class SimpleImputer(Fitted):
    """Ray's SimpleImputer, fitted: a column's gaps (None, NaN) ← its mean or most frequent value in
    the train split, or a constant. A column the batch lacks is added, filled."""

    FIELDS = ("columns", "output_columns", "strategy", "fill_value")
    STRATEGIES = ("mean", "most_frequent", "constant")

    def __init__(self, columns: list[str], strategy: str = "mean", fill_value: Any = None,
                 output_columns: list[str] | None = None, stats: dict[str, Any] | None = None):
        super().__init__(stats)
        if strategy not in self.STRATEGIES:
            raise ValueError(f"Strategy {strategy} is not supported. Supported values are: {list(self.STRATEGIES)}")
        if strategy == "constant" and fill_value is None:
            raise ValueError('`fill_value` must be set when using "constant" strategy.')
        self.columns = list(columns)
        self.strategy = strategy
        self.fill_value = fill_value
        self.output_columns = _outputs(self.columns, output_columns)

    def required_stats(self) -> list[str]:
        return [] if self.strategy == "constant" else [f"{self.strategy}({c})" for c in self.columns]

    def value(self, column: str) -> Any:
        """What fills `column`'s gaps."""
        return self.fill_value if self.strategy == "constant" else self.stats[f"{self.strategy}({column})"]

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        out = df.copy(deep=False)
        for column, output in zip(self.columns, self.output_columns):
            value = self.value(column)
            if value is None:
                raise ValueError(f"Column {column} has no fill value. Check the data used to fit the SimpleImputer.")
            if column not in out.columns:
                out[output] = value
                continue
            values = out[column]
            if isinstance(values.dtype, pd.CategoricalDtype):
                values = values.cat.add_categories([value])
            out[output] = values.fillna(value)
        return out


# --------------------------------------------------------------------------- categories
class _Categories(Fitted):
    """An encoder of categorical columns by the values seen in training: `unique_values(col)`, a map
    from each value to its index."""

    def required_stats(self) -> list[str]:
        return [f"unique_values({c})" for c in self.columns]

    def values_of(self, column: str) -> dict:
        return self.stats[f"unique_values({column})"]


class OneHotEncoder(_Categories):
    """Ray's OneHotEncoder, fitted: each value → a uint8 vector with a 1 at the value's place among
    the training values in sorted order (Ray's Arrow transform orders them so); a value not seen in
    training → all zeros; a gap → an error (gaps are filled before)."""

    FIELDS = ("columns", "output_columns", "max_categories")

    def __init__(self, columns: list[str], max_categories: dict[str, int] | None = None,
                 output_columns: list[str] | None = None, stats: dict[str, Any] | None = None):
        super().__init__(stats)
        self.columns = list(columns)
        self.max_categories = dict(max_categories or {})  # (a setting of the fit; the values are in the stats)
        self.output_columns = _outputs(self.columns, output_columns)

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        _check_no_nulls(df, self.columns)
        out = df.copy(deep=False)
        encoded = {}
        for column, output in zip(self.columns, self.output_columns):
            _check_scalars(df[column], "OneHotEncoder")
            keys = sorted(self.values_of(column))
            place = {k: i for i, k in enumerate(keys)}
            codes = np.fromiter((place.get(v, -1) for v in df[column]), dtype=np.int64, count=len(df))
            one_hot = np.zeros((len(df), len(keys)), dtype=np.uint8)
            seen = np.nonzero(codes != -1)[0]
            one_hot[seen, codes[seen]] = 1
            encoded[output] = _cells(one_hot)
        for output, cells in encoded.items():
            out[output] = cells
        return out


class OrdinalEncoder(_Categories):
    """Ray's OrdinalEncoder, fitted: each value → its index among the training values (int64); a value
    not seen in training → NaN (the column is then float64; Flotilla fills it with -1 after); a gap
    → an error (gaps are filled before)."""

    FIELDS = ("columns", "output_columns", "encode_lists")

    def __init__(self, columns: list[str], encode_lists: bool = True, output_columns: list[str] | None = None,
                 stats: dict[str, Any] | None = None):
        super().__init__(stats)
        self.columns = list(columns)
        self.encode_lists = encode_lists  # (how Ray encodes list cells; Flotilla's cells are single values)
        self.output_columns = _outputs(self.columns, output_columns)

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        _check_no_nulls(df, self.columns)
        out = df.copy(deep=False)
        encoded = {}
        for column, output in zip(self.columns, self.output_columns):
            _check_scalars(df[column], "OrdinalEncoder")
            mapping = self.values_of(column)
            codes = [mapping.get(v) for v in df[column]]
            if any(c is None for c in codes):
                encoded[output] = np.array([np.nan if c is None else c for c in codes], dtype=np.float64)
            else:
                encoded[output] = np.array(codes, dtype=np.int64)
        for output, codes in encoded.items():
            out[output] = codes
        return out


class LabelEncoder(_Categories):
    """Ray's LabelEncoder, fitted: each label → its class index (int64); a label not seen in training
    → NaN; a gap → an error. `decode` maps class indices back to labels."""

    FIELDS = ("label_column", "output_column")

    def __init__(self, label_column: str, output_column: str | None = None, stats: dict[str, Any] | None = None):
        super().__init__(stats)
        self.label_column = label_column
        self.output_column = output_column or label_column
        self.columns = [label_column]

    @property
    def classes(self) -> list:
        """The labels, in class-index order."""
        return [label for label, _ in sorted(self.values_of(self.label_column).items(), key=lambda kv: kv[1])]

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        _check_no_nulls(df, [self.label_column])
        out = df.copy(deep=False)
        out[self.output_column] = df[self.label_column].map(self.values_of(self.label_column))
        return out

    def decode(self, indices) -> list:
        inverse = {i: label for label, i in self.values_of(self.label_column).items()}
        return [inverse.get(int(i)) for i in indices]


def simple_hash(value: Any, num_features: int) -> int:
    """A value's bucket: SHA-256 of its string form, modulo `num_features` (Ray's `simple_hash`, in
    ray/data/preprocessors/utils.py; a unit test holds the two equal)."""
    return int(hashlib.sha256(str(value).encode()).hexdigest(), 16) % num_features


class HashingVectorizer(Transform):
    """Ray's HashingVectorizer with its default tokenizer (split on single spaces): each text → a list
    of `num_features` token counts by bucket; a gap → None."""

    FIELDS = ("columns", "num_features", "output_columns")

    def __init__(self, columns: list[str], num_features: int, output_columns: list[str] | None = None):
        self.columns = list(columns)
        self.num_features = int(num_features)
        self.output_columns = _outputs(self.columns, output_columns)

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        out = df.copy(deep=False)
        buckets: dict[str, int] = {}
        for column, output in zip(self.columns, self.output_columns):
            texts = df[column]
            missing = texts.isna().to_numpy()
            counts = np.zeros((len(df), self.num_features), dtype=np.int64)
            for row, text in enumerate(texts):
                if missing[row]:
                    continue
                for token in text.split(" "):
                    bucket = buckets.get(token)
                    if bucket is None:
                        bucket = buckets[token] = simple_hash(token, self.num_features)
                    counts[row, bucket] += 1
            # Ray builds the rows from a frame of counts, which is float64 (NaN) where a text is missing.
            rows = (counts.astype(np.float64) if missing.any() else counts).tolist()
            out[output] = [None if gap else r for r, gap in zip(rows, missing)]
        return out


# --------------------------------------------------------------------------- the feature vector
class Concatenator(Transform):
    """Ray's Concatenator: `columns` (in that order) → one column of 1-D arrays, cast to `dtype`; with
    `flatten`, cells that are vectors (one-hot, hash counts) are laid out in place. The concatenated
    columns are dropped; the output column comes last."""

    FIELDS = ("columns", "output_column_name", "dtype", "raise_if_missing", "flatten")

    def __init__(self, columns: list[str], output_column_name: str = "concat_out", dtype: Any = None,
                 raise_if_missing: bool = False, flatten: bool = False):
        self.columns = list(columns)
        self.output_column_name = output_column_name
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.raise_if_missing = bool(raise_if_missing)
        self.flatten = bool(flatten)

    def _transform_pandas(self, df: pd.DataFrame) -> pd.DataFrame:
        missing = set(self.columns) - set(df)
        if missing:
            message = f"Missing columns specified in '{self.columns}': {missing}"
            if self.raise_if_missing:
                raise ValueError(message)
            logger.warning(message)
        if self.flatten:
            stacked = np.column_stack([df[c].to_numpy() for c in self.columns])
            rows = [np.concatenate([np.atleast_1d(cell) if self.dtype is None
                                    else np.atleast_1d(cell).astype(self.dtype) for cell in row]) for row in stacked]
        else:
            rows = list(np.column_stack([df[c].to_numpy(dtype=self.dtype) for c in self.columns]))
        out = df.drop(columns=self.columns)
        out[self.output_column_name] = _cells(rows)
        return out


KNOWN: dict[str, type[Transform]] = {cls.__name__: cls for cls in (
    StandardScaler, MinMaxScaler, LabelEncoder, Concatenator, SimpleImputer, OneHotEncoder, OrdinalEncoder,
    HashingVectorizer)}


def is_number(value: Any) -> bool:
    """A fill value the array fast path can use: a number, not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
