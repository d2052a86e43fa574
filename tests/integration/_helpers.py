"""Helpers shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from flotilla.config import RunSpec, load_spec
from flotilla.data import resolve_source, split_rows

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "configs" / "digits.yaml"


def digits_spec(storage: Path, *overrides: str) -> RunSpec:
    """The default config with its runs under `storage`; short unless told otherwise."""
    return load_spec(DIGITS, [f"train.storage_path={storage}", *overrides])


def digits_val_rows(spec: RunSpec):
    """The validation rows of the digits sample, exactly as the pipeline splits them."""
    df = pq.read_table(resolve_source("digits").paths[0]).to_pandas()
    val = split_rows(df, spec.data.split_seed, spec.data.val_fraction, "val")
    return val.drop(columns=["target"]), val["target"].to_numpy()


def accuracy(predictions, labels) -> float:
    return float(np.mean(np.asarray(predictions) == labels))
