"""Preparing a run's data: read, check the columns, split, fit the preprocessors on train, transform."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import ray.data
from ray.data.context import ShuffleStrategy

from flotilla.spec import GPTSpec, HFCausalLMSpec, RunSpec
from flotilla.data._fingerprint import fingerprint
from flotilla.data._instruct import PREFERENCE_COLUMNS, TokenWindows, detect_format, load_tokenizer
from flotilla.data._schema import DataSchema
from flotilla.data._columns import Column, block_stats, fit_columns, merge_stats, plan_columns, stats_row
from flotilla.data._preprocess import VOCAB_SIZE, ByteWindows, to_json
from flotilla.data._sources import ResolvedSource, resolve_source
from flotilla.errors import ClusterError, DataError, summarize



@dataclass
class PreparedData:
    train: ray.data.Dataset
    val: ray.data.Dataset
    schema: DataSchema  # what the model factory and the bundle need to know about the data
    preprocessors: dict[str, Any]  # JSON form: {"features": [...], "label": {...} | None}
    fingerprint: str
    train_rows: int
    val_rows: int
    source: ResolvedSource = field(repr=False)
    # The validation rows as read (selected columns, no preprocessing): what a served model
    # would be sent, for comparing bundles on the same rows. Lazy; read again when iterated.
    val_raw: ray.data.Dataset | None = field(default=None, repr=False)
    # Tables: per feature column, what the train split holds (type, gaps, values, range) and how it
    # is encoded; logged with the run, kept in the bundle, and what serving compares requests with.
    profile: dict[str, dict[str, Any]] | None = field(default=None, repr=False)


def split_rows(df: pd.DataFrame, seed: int, val_fraction: float, keep: str) -> pd.DataFrame:
    """Keep the `train` or `val` rows of a batch; a row's side depends only on its content and the seed."""
    if df.empty:
        return df
    hashes = pd.util.hash_pandas_object(df, index=False).to_numpy(dtype=np.uint64)
    # Mix the seed in (pandas ignores hash_key for numeric columns): xor, then one round
    # of a multiply-xorshift finalizer so each seed gives an unrelated partition.
    with np.errstate(over="ignore"):
        mixed = (hashes ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF)) * np.uint64(0x9E3779B97F4A7C15)
    mixed ^= mixed >> np.uint64(31)
    is_val = (mixed % np.uint64(1_000_000)) < np.uint64(int(val_fraction * 1_000_000))
    return df[is_val if keep == "val" else ~is_val].reset_index(drop=True)


def prepare_data(spec: RunSpec) -> PreparedData:
    wait_for_data_cpu()
    d = spec.data
    pretrained = isinstance(spec.model, HFCausalLMSpec)
    text = isinstance(spec.model, GPTSpec) or pretrained
    source = resolve_source(d.source, d.format, d.max_bytes)
    preprocessing = d.model_dump(mode="json", exclude={"source"})
    if text:
        preprocessing["context"] = spec.model.context
    if pretrained:  # the tokenizer and how prompts are rendered decide the tokens
        m = spec.model
        preprocessing.update(pretrained=m.pretrained, revision=m.revision, prompt_format=m.prompt_format)
    fp = fingerprint(source.paths, source.filesystem, preprocessing)

    input_bytes = sum(info.size or 0 for info in source.filesystem.get_file_info(source.paths))
    cache = _should_cache(d.cache, input_bytes, text)
    ds = _read(source, in_driver=cache and input_bytes <= _DRIVER_READ_BYTES)
    # The one shuffle a run does is a preprocessor's fit, a global aggregate: Ray's sort-based
    # strategy runs it as tasks on the workers already up; the hash-based default starts an
    # aggregator actor per partition for every fit (seconds each on a small machine).
    ds.context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    columns, types = _schema(ds, source)
    row_format = None
    if pretrained:
        if d.text_column != "text" and d.text_column in columns and "text" not in columns:
            ds, columns = ds.rename_columns({d.text_column: "text"}), [("text" if c == d.text_column else c) for c in columns]
        row_format = detect_format(columns)
        _check_objective(spec, row_format, source.description, columns)
        keep = {"messages": ["messages"], "prompt_response": ["prompt", "response"], "text": ["text"],
                "preference": list(PREFERENCE_COLUMNS)}[row_format]
        ds = ds.select_columns(keep)
        if row_format in ("messages", "preference"):
            # lists of {role, content}: as JSON text, which rows can be hashed by (the split)
            ds = ds.map_batches(_turns_as_json, batch_format="pandas", fn_kwargs={"columns": keep})
    elif text:
        if d.text_column not in columns:
            raise DataError(
                f"data.text_column {d.text_column!r} is not a column of {source.description!r}; "
                f"columns: {', '.join(columns)}; set `--set data.text_column=...`"
            )
        ds = ds.select_columns([d.text_column])
    else:
        features, label = _check_tabular_columns(spec, source, columns, types)
        ds = ds.select_columns(features + [label])
    if cache:
        # Read once into the object store: the fits, the transforms and the bundle's evaluation
        # then each start from blocks in memory instead of reading and splitting the source again.
        ds = ds.materialize()

    def side(keep: str) -> ray.data.Dataset:
        return ds.map_batches(
            split_rows,
            batch_format="pandas",
            fn_kwargs={"seed": d.split_seed, "val_fraction": d.val_fraction, "keep": keep},
        )

    train, val = side("train"), side("val")
    val_raw = val
    profile: dict[str, Any] | None = None
    if pretrained:
        m = spec.model
        tokenizer = load_tokenizer(m.pretrained, m.revision, m.trust_remote_code)
        steps = [_PretrainedWindows(TokenWindows(m.pretrained, m.context, row_format, revision=m.revision,
                                                 trust_remote_code=m.trust_remote_code, chat=m.prompt_format))]
        label_step = None
        schema = DataSchema(task="lm", vocab_size=len(tokenizer), context=m.context, tokenizer=m.pretrained,
                            row_format=row_format)
    elif text:
        steps = [ByteWindows(d.text_column, spec.model.context)]
        label_step = None
        schema = DataSchema(task="lm", vocab_size=VOCAB_SIZE, context=spec.model.context, text_column=d.text_column)
    else:
        task = _task(d.task, types[label])
        columns = plan_columns(d, features, types, source.description)
        stats = _one_pass(ds, columns, label, task == "classification", d.split_seed, d.val_fraction)
        if stats["label_missing"]:
            raise DataError(f"label column {label!r} of {source.description!r} has {stats['label_missing']} missing "
                            "value(s); drop or fill those rows before training")
        fitted = fit_columns(columns, stats, d, source.description)
        steps, profile = fitted.steps, fitted.profile
        train_rows, val_rows = stats["rows"], stats["val_rows"]
        fields: dict[str, Any] = {"task": task, "feature_columns": features, "label_column": label,
                                  "num_features": fitted.num_features,
                                  "categorical_columns": fitted.categorical or None}
        label_step = None
        if task == "classification":
            values = sorted(stats["labels"], key=_sort_key)
            from ray.data.preprocessors import LabelEncoder

            label_step = LabelEncoder(label_column=label)
            label_step.stats_ = {f"unique_values({label})": {v: i for i, v in enumerate(values)}}
            fields["classes"] = [_plain(v) for v in values]
            fields["num_classes"] = len(values)
        schema = DataSchema(**fields)

    def transform(ds_side: ray.data.Dataset) -> ray.data.Dataset:
        for step in steps:
            ds_side = step.transform(ds_side)
        if label_step is not None:
            ds_side = label_step.transform(ds_side)
        return ds_side

    train, val = transform(train), transform(val)
    if cache and pretrained and d.cache == "auto":
        # Token windows are padded to the context: a short chat row becomes context x 16 bytes.
        cache = _windows_fit(ds.count(), input_bytes, spec.model.context, row_format)
    if cache:
        # Preprocessed once into the object store (not the driver): epochs then cost only
        # the training, not a re-read and re-transform on the same cores.
        train, val = train.materialize(), val.materialize()
    if text:  # (for tables, the pass of statistics counted both sides' rows)
        train_rows, val_rows = train.count(), val.count()
    unit = "context windows" if text else "rows"
    if train_rows == 0:
        raise DataError(
            f"data.source {source.description!r} gives no training {unit}"
            + ("; the text is shorter than one context window" if text else "; the dataset is empty")
        )
    if val_rows == 0:
        raise DataError(
            f"the validation split of {source.description!r} is empty ({train_rows} train {unit}); "
            f"raise `--set data.val_fraction=...` (now {d.val_fraction}) or add data"
        )
    return PreparedData(
        train=train,
        val=val,
        schema=schema,
        preprocessors={
            "features": [] if pretrained else [to_json(s) for s in steps],
            "label": to_json(label_step) if label_step is not None else None,
            **({"profile": profile} if profile is not None else {}),
        },
        fingerprint=fp,
        train_rows=train_rows,
        val_rows=val_rows,
        source=source,
        val_raw=val_raw,
        profile=profile,
    )


class _PretrainedWindows:
    """The tokenizing step of a pretrained model's data, as a preprocessing step (`transform(ds)`):
    each batch of rows becomes `input_ids` and shifted `labels` (`flotilla.data._instruct`). Text is
    packed per batch, so batches are large: few windows are left part empty."""

    def __init__(self, windows: TokenWindows):
        self.windows = windows

    def transform(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        return ds.map_batches(self.windows, batch_format="pandas", batch_size=4096)


def _check_objective(spec: RunSpec, row_format: str, where: str, columns: list[str]) -> None:
    """Preference pairs are what `train.objective: dpo` learns from, and only it."""
    dpo = spec.train.objective == "dpo"
    if dpo and row_format != "preference":
        raise DataError(f"`train.objective: dpo` learns from preference pairs, and {where!r} has columns "
                        f"{', '.join(columns)}: it needs `prompt`, `chosen` and `rejected` (an answer preferred to "
                        "another), or `--set train.objective=sft` to learn its rows as they are")
    if not dpo and row_format == "preference":
        raise DataError(f"{where!r} holds preference pairs (`prompt`, `chosen`, `rejected`): `--set train.objective=dpo` "
                        "learns from them; to fine-tune on the chosen answers alone, give them as `prompt`/`response`")


def _turns_as_json(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    def as_json(cell: Any, name: str) -> str:
        if isinstance(cell, str):
            return cell
        if cell is None or (isinstance(cell, float) and np.isnan(cell)):
            raise DataError(f"a `{name}` cell is empty; every row needs its {name}")
        if not isinstance(cell, (list, tuple, np.ndarray)):  # a number in a CSV column: its text
            return str(cell)
        return json.dumps([{k: (str(v) if v is not None else None) for k, v in dict(m).items()} for m in cell])

    return df.assign(**{name: df[name].map(lambda cell, n=name: as_json(cell, n)) for name in columns})


def _one_pass(ds: ray.data.Dataset, columns: list[Column], label: str, classes: bool, seed: int,
              val_fraction: float) -> dict[str, Any]:
    """Everything the preprocessors are fitted from, in one pass over the whole source (a source
    too big to cache is read once here): each block splits itself as `split_rows` does and returns
    its statistics as one JSON string (`flotilla.data._columns`); the driver merges them. (Fitting
    Ray's preprocessors one by one is a pass each, and Ray's label fit collects dicts keyed by
    label, which Arrow cannot hold for integer labels.)"""
    per_block = ds.map_batches(_stats_of_block, batch_format="pandas", batch_size=None,
                               fn_kwargs={"columns": columns, "label": label, "classes": classes, "seed": seed,
                                          "val_fraction": val_fraction}).take_all()
    return merge_stats([json.loads(row["stats"]) for row in per_block], columns)


def _stats_of_block(df: pd.DataFrame, columns: list[Column], label: str, classes: bool, seed: int,
                    val_fraction: float) -> pd.DataFrame:
    train = split_rows(df, seed, val_fraction, "train")
    val = split_rows(df, seed, val_fraction, "val")
    return stats_row(block_stats(train, val, columns, label, classes))


def _sort_key(value: Any) -> tuple:
    return (value is None, str(type(value)), value if value is not None else 0)


def resolve_task(spec: RunSpec) -> str:
    """The task a run of `spec` has: `lm` for text models, `data.task` when set, else what `auto`
    decides from the label column's type, read from the source's schema (no Ray, no rows read)."""
    d = spec.data
    if isinstance(spec.model, (GPTSpec, HFCausalLMSpec)):
        return "lm"
    if d.task != "auto":
        return d.task
    source = resolve_source(d.source, d.format, d.max_bytes)
    try:
        schema = pads.dataset(source.paths, filesystem=source.filesystem, format=source.format).schema
    except Exception as e:
        raise DataError(f"cannot read {source.description!r} as {source.format}: {summarize(e)}") from None
    if d.label is None or d.label not in schema.names:
        raise DataError(
            f"label column data.label={d.label!r} is not in {source.description!r}; "
            f"columns: {', '.join(schema.names)}; set `--set data.label=<column>`"
        )
    return _task("auto", schema.field(d.label).type)


def wait_for_data_cpu(timeout_s: float = 120.0) -> None:
    """Ray Data's tasks each need a whole free CPU; without one they wait forever. Wait a while
    (a stopped run's workers release theirs within seconds), then say what holds them."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < 1.0:
        if time.monotonic() > deadline:
            total = ray.cluster_resources().get("CPU", 0.0)
            free = ray.available_resources().get("CPU", 0.0)
            raise ClusterError(
                f"Ray Data needs one free CPU to read and preprocess, but only {free:g} of {total:g} have been free "
                f"for {timeout_s:.0f}s; other runs on the cluster hold the rest (see `ray status`). Placement groups "
                "of stopped training runs are released by Ray Train's cleaner, which needs the Ray dashboard."
            )
        time.sleep(0.5)


# Cached size over input size: the source as read (decompressed) plus the preprocessed splits;
# byte windows hold one int64 per input byte, tabular rows become float32 features from
# (usually) compressed Parquet.
_EXPANSION = {True: 9.0, False: 6.0}


# Cached sources up to this size are read by the driver itself and handed to Ray Data as one
# Arrow table: Ray Data's first read in a process costs ~10 s of task start-up on 2 cores, far
# more than reading a few megabytes.
_DRIVER_READ_BYTES = 64 * 1024**2


def _should_cache(policy: str, input_bytes: int, text: bool) -> bool:
    if policy != "auto":
        return policy == "always"
    store = ray.cluster_resources().get("object_store_memory", 0)
    return input_bytes * _EXPANSION[text] < 0.25 * store


# A token window holds `input_ids` and `labels`, one int64 each per position.
_WINDOW_BYTES_PER_TOKEN = 16


def windows_bytes(rows: int, input_bytes: int, context: int, row_format: str) -> int:
    """What the token windows of a pretrained model's data take, estimated: one window of `context`
    positions per prompt/response or chat row, two per preference pair; packed text at most one token
    per input byte."""
    if row_format == "text":
        return input_bytes * _WINDOW_BYTES_PER_TOKEN
    return rows * context * _WINDOW_BYTES_PER_TOKEN * (2 if row_format == "preference" else 1)


def _windows_fit(rows: int, input_bytes: int, context: int, row_format: str) -> bool:
    store = ray.cluster_resources().get("object_store_memory", 0)
    return windows_bytes(rows, input_bytes, context, row_format) + 2 * input_bytes < 0.25 * store


def _read(source: ResolvedSource, in_driver: bool = False) -> ray.data.Dataset:
    try:
        if in_driver:
            table = pads.dataset(source.paths, filesystem=source.filesystem, format=source.format).to_table()
            if table.num_rows:  # no rows: Ray Data's reader says so the way the checks expect
                return ray.data.from_arrow(table)
        reader = {"parquet": ray.data.read_parquet, "csv": ray.data.read_csv, "json": ray.data.read_json}[source.format]
        return reader(source.paths, filesystem=source.filesystem)
    except Exception as e:  # Ray wraps pyarrow's parse errors in many types
        raise DataError(f"cannot read {source.description!r} as {source.format}: {summarize(e)}") from None


def _schema(ds: ray.data.Dataset, source: ResolvedSource) -> tuple[list[str], dict[str, pa.DataType]]:
    try:
        schema = ds.schema()
    except Exception as e:
        raise DataError(f"cannot read {source.description!r} as {source.format}: {summarize(e)}") from None
    if schema is None:
        raise DataError(f"data.source {source.description!r} has no rows and no columns; the dataset is empty")
    return list(schema.names), dict(zip(schema.names, schema.types))


def _check_tabular_columns(spec: RunSpec, source, columns, types) -> tuple[list[str], str]:
    d = spec.data
    problems = []
    if d.label is None or d.label not in columns:
        problems.append(
            f"label column data.label={d.label!r} is not in {source.description!r}; "
            f"columns: {', '.join(columns)}; set `--set data.label=<column>`"
        )
    features = d.features if d.features is not None else [c for c in columns if c != d.label]
    missing = [f for f in features if f not in columns]
    if missing:
        problems.append(
            f"feature column(s) {', '.join(map(repr, missing))} from data.features are not in "
            f"{source.description!r}; columns: {', '.join(columns)}"
        )
    if not features:
        problems.append(f"{source.description!r} has no feature columns besides the label {d.label!r}")
    if problems:
        raise DataError("the data does not match the spec:\n  - " + "\n  - ".join(problems))
    return list(features), d.label


def _task(requested: str, label_type: pa.DataType) -> str:
    if requested != "auto":
        return requested
    return "regression" if pa.types.is_floating(label_type) or pa.types.is_decimal(label_type) else "classification"


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
