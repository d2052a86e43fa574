"""Data: read Parquet/CSV with Ray Data, split, fit preprocessors on train, stream batches.

    prepared = prepare_data(spec)          # needs a running Ray (ray.init)
    prepared.train, prepared.val           # lazy ray.data.Dataset objects, transformed
    prepared.schema, prepared.preprocessors, prepared.fingerprint

Nothing here collects rows on the driver: the split, the statistics the preprocessors are
fitted from (one pass, per block) and the transforms all run as Ray Data tasks.
"""

from flotilla.data._columns import (CastColumns, Column, FittedColumns, as_category, describe_columns, fit_columns,
                                    plan_columns)
from flotilla.data._fingerprint import fingerprint
from flotilla.data._prepare import PreparedData, prepare_data, resolve_task, split_rows, wait_for_data_cpu
from flotilla.data._preprocess import (
    FEATURES,
    TOKENS,
    VOCAB_SIZE,
    ByteWindows,
    apply_all,
    array_transform,
    from_json,
    to_json,
)
from flotilla.data._schema import DataSchema
from flotilla._cache import cache_dir
from flotilla.data._sources import BUILTIN_SOURCES, filesystem_for, resolve_source

__all__ = [
    "BUILTIN_SOURCES",
    "ByteWindows",
    "CastColumns",
    "Column",
    "FittedColumns",
    "DataSchema",
    "FEATURES",
    "PreparedData",
    "TOKENS",
    "VOCAB_SIZE",
    "apply_all",
    "array_transform",
    "as_category",
    "cache_dir",
    "describe_columns",
    "filesystem_for",
    "fit_columns",
    "fingerprint",
    "from_json",
    "plan_columns",
    "prepare_data",
    "resolve_source",
    "resolve_task",
    "split_rows",
    "to_json",
    "wait_for_data_cpu",
]
