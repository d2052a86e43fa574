"""Batch scoring with Ray Data: a registered model (or a bundle) over a whole Parquet/CSV table.

    outcome = predict_table("digits@champion", "s3://bucket/new-rows/", "out/", id_columns=["id"])
    flotilla predict --model digits@champion --input new-rows.csv --output out/ --id id

Ray Data reads the input and streams it through a pool of actors, each of which loads the bundle
once and scores whole batches with the bundle's own preprocessors (`flotilla.bundle`); the
predictions (and, for a classifier, each class's probability) are written as Parquet under
`OUTPUT/predictions/`, next to any id columns named. A row that cannot be scored (a numeric column
holding text, an infinite value, an answer that is not a finite number) does not stop the job: the
actor writes it under `OUTPUT/rejected/` with the reason. The counts are printed and, for a
registered model, logged as an MLflow run linked to the model version. A `custom` model's factory
is code: it runs only when `factories` (`--allow-factory`) names it, wherever the model came from.
"""

from __future__ import annotations

import io
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from flotilla.bundle import ALLOW_ON_COMMAND_LINE, BUNDLE_FILES, load_bundle
from flotilla.data import filesystem_for, resolve_source
from flotilla.data._columns import as_numbers, numeric_matrix
from flotilla.errors import DataError
from flotilla.metrics import format_duration
from flotilla.redact import redact
from flotilla.runtime import ensure_ray

if TYPE_CHECKING:
    from flotilla.track import LocalBundle

PREDICTIONS, REJECTED = "predictions", "rejected"


@dataclass
class PredictOutcome:
    model: str  # what was asked for: NAME@ALIAS, NAME/VERSION or a bundle path
    version: str | None  # the registered version that scored, if any
    output: str
    predicted: int
    rejected: int
    wall_time_s: float
    mlflow_run_id: str | None = None

    def describe(self) -> str:
        rate = self.predicted / self.wall_time_s if self.wall_time_s else 0.0
        where = f"{self.model}" + (f" (v{self.version})" if self.version and f"/{self.version}" not in self.model else "")
        return (f"scored {self.predicted} rows with {where} in {self.wall_time_s:.1f} s ({rate:.0f} rows/s); "
                f"{self.rejected} rejected; written to {self.output}/{PREDICTIONS}"
                + (f" and {self.output}/{REJECTED}" if self.rejected else ""))


# ------------------------------------------------------------------------------ the model
def resolve_model(reference: str, tracking_uri: str | None = None) -> tuple[dict[str, bytes], LocalBundle]:
    """The bundle's files for `reference` (NAME@ALIAS, NAME/VERSION, models:/..., or a bundle or run
    directory), and where they came from (the registered name, version and client; None for a directory)."""
    # Function-local: the scoring actors unpickle this module, and MLflow (~1.5 CPU-s to import) stays out of them.
    from flotilla.track import local_bundle

    with local_bundle(reference, tracking_uri, "flotilla predict") as found:
        return {f: (found.path / f).read_bytes() for f in BUNDLE_FILES}, found


class _Scorer:
    """One actor of the pool: loads the bundle once (its files, put in the object store once by the
    driver; Ray Data hands the reference over as is), then scores batches; rows it cannot score go
    to the rejected output."""

    def __init__(self, files, columns: list[str], id_columns: list[str], output: str, factories: list[str]):
        import ray
        import torch

        if isinstance(files, ray.ObjectRef):
            files = ray.get(files)

        torch.set_num_threads(1)  # one actor per reserved CPU
        self._dir = _bundle_dir(files, "flotilla-scorer-")
        self.bundle = load_bundle(self._dir.name, factories=factories, allow_with=ALLOW_ON_COMMAND_LINE)
        self.columns, self.id_columns = columns, id_columns
        self.categorical = set(self.bundle.categorical)
        self.fs, self.root = pafs.FileSystem.from_uri(output) if "://" in output else (pafs.LocalFileSystem(),
                                                                                        str(Path(output).resolve()))
        self.name = uuid.uuid4().hex[:8]
        self.parts = 0

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        reasons = pd.Series([None] * len(batch), index=batch.index, dtype=object)
        numeric = [c for c in self.columns if c not in self.categorical]
        # Columns of numbers already (the usual case): only infinities to find, all at once.
        dtypes = batch.dtypes
        plain = [c for c in numeric if pd.api.types.is_numeric_dtype(dtypes[c])]
        if plain:
            infinite = np.isinf(numeric_matrix(batch, plain))
            for j in np.flatnonzero(infinite.any(axis=0)):
                self._reject(reasons, batch[plain[j]], infinite[:, j], "is infinite")
        for column in (c for c in numeric if c not in plain):  # text: each value must read as a number
            values = batch[column]
            numbers = as_numbers(values).to_numpy()
            present = values.notna().to_numpy(dtype=bool, na_value=False)
            self._reject(reasons, values, present & np.isnan(numbers) & ~_says_nan(values), "is not a number")
            self._reject(reasons, values, np.isinf(numbers), "is infinite")
        good = batch[reasons.isna()]
        out = self._score(good, reasons)
        rejected = batch[reasons.notna()]
        if len(rejected):
            self._write_rejected(rejected, reasons[reasons.notna()])
        return out

    @staticmethod
    def _reject(reasons: pd.Series, values: pd.Series, mask: np.ndarray, why: str) -> None:
        """Give the rows in `mask` (not rejected yet) the reason `why`, naming the column's value."""
        mask = pd.Series(mask, index=reasons.index) & reasons.isna()
        if mask.any():
            reasons[mask] = [f"column {values.name!r}: {v!r} {why}" for v in values[mask]]

    def _score(self, rows: pd.DataFrame, reasons: pd.Series) -> pd.DataFrame:
        result = rows[self.id_columns].reset_index(drop=True) if self.id_columns else pd.DataFrame(index=range(len(rows)))
        if not len(rows):
            result["prediction"] = pd.Series([], dtype=object)
            return result
        answer = self.bundle.predict_arrays(rows[self.columns])
        predictions = answer["predictions"]
        result["prediction"] = predictions
        if "probabilities" in answer:
            probabilities = answer["probabilities"]
            for i, label in enumerate(self.bundle.classes):
                result[f"probability_{label}"] = probabilities[:, i]
            finite = np.isfinite(probabilities).all(axis=1)
        else:
            finite = np.isfinite(predictions)
        if not finite.all():  # values far outside what the model saw overflow it: no answer for them
            bad = rows.index[~finite]
            reasons[bad] = "the model's output is not a finite number"
            self._write_rejected(rows.loc[bad], reasons[bad])
            result = result[finite].reset_index(drop=True)
        return result

    def _write_rejected(self, rows: pd.DataFrame, reasons: pd.Series) -> None:
        table = pa.table({
            **{c: rows[c].astype(str).tolist() for c in self.id_columns},
            "row": [json.dumps(r, default=str) for r in rows[self.columns].to_dict("records")],
            "reason": reasons.tolist(),
        })
        self.parts += 1
        sink = io.BytesIO()
        pq.write_table(table, sink)
        self.fs.create_dir(f"{self.root}/{REJECTED}", recursive=True)
        with self.fs.open_output_stream(f"{self.root}/{REJECTED}/part-{self.name}-{self.parts:05d}.parquet") as f:
            f.write(sink.getvalue())


def _says_nan(values: pd.Series) -> np.ndarray:
    """Which values are NaN themselves (a float NaN, or the text `nan`): a gap, not bad text."""
    return values.map(lambda v: (isinstance(v, float) and v != v) or (isinstance(v, str) and v.strip().lower() == "nan"),
                      na_action="ignore").to_numpy(dtype=bool, na_value=False)


# ------------------------------------------------------------------------------ the job
def predict_table(model: str, source: str, output: str, *, id_columns: list[str] = (), tracking_uri: str | None = None,
                  actors: int | None = None, batch_size: int = 4096, fmt: str = "auto",
                  progress_every_s: float = 10.0, factories: Collection[str] = ()) -> PredictOutcome:
    """Score every row of `source` with `model`; see the module docstring. Every `progress_every_s`
    seconds a line says how many rows are done and when the rest will be (0: no such lines).
    `factories`: the `custom` model factories the model may run (`--allow-factory`)."""
    import ray
    import ray.data

    started = time.monotonic()
    files, origin = resolve_model(model, tracking_uri)
    with _bundle_dir(files, "flotilla-predict-") as here:
        bundle = load_bundle(here, factories=factories, allow_with=ALLOW_ON_COMMAND_LINE)
    if bundle.task == "lm":
        raise DataError(f"--model {model!r} is a language model; batch scoring takes tabular models")
    columns = list(bundle.schema.feature_columns)
    found = resolve_source(source, fmt)
    schema = pads.dataset(found.paths, filesystem=found.filesystem, format=found.format).schema
    missing = [c for c in [*columns, *id_columns] if c not in schema.names]
    if missing:
        raise DataError(f"--input {found.description!r} lacks column(s) {', '.join(missing)} that "
                        f"{'the model needs' if set(missing) & set(columns) else '--id names'}; its columns: "
                        f"{', '.join(schema.names)}")
    fs, root = filesystem_for(output, "--output")
    for part in (PREDICTIONS, REJECTED):
        if fs.get_file_info(f"{root}/{part}").type != pafs.FileType.NotFound:
            raise DataError(f"--output {output!r} already holds {part}/; give a new directory (nothing is overwritten)")
    ensure_ray()
    cpus = int(ray.cluster_resources().get("CPU", 1))
    size = actors or max(1, cpus - 1)  # one CPU stays free for Ray Data's reads
    ds = _read(found, [*id_columns, *columns], blocks=max(4 * size, min(len(found.paths), 200)))
    scored = ds.map_batches(
        _Scorer, batch_format="pandas", batch_size=batch_size, num_cpus=1,
        fn_constructor_kwargs={"files": ray.put(files), "columns": columns, "id_columns": list(id_columns),
                               "output": output, "factories": list(factories)},
        compute=ray.data.ActorPoolStrategy(size=size),  # all at once: each takes seconds to load torch
    )
    total = pads.dataset(found.paths, filesystem=found.filesystem, format=found.format).count_rows() \
        if found.format == "parquet" else None  # from the files' metadata; other formats would need a read
    with ScoringProgress(fs, root, total, every_s=progress_every_s):
        scored.write_parquet(f"{output.rstrip('/')}/{PREDICTIONS}" if "://" in output else f"{root}/{PREDICTIONS}",
                             filesystem=None if "://" in output else fs)
    outcome = PredictOutcome(model, origin.version, output, _rows(fs, f"{root}/{PREDICTIONS}"),
                             _rows(fs, f"{root}/{REJECTED}"), time.monotonic() - started)
    if origin.client is not None:
        outcome.mlflow_run_id = _log_run(origin, model, found.description, outcome)
    return outcome


def _read(found, columns: list[str], blocks: int):
    """The input as a Ray dataset of at least `blocks` blocks, so that every actor of the pool gets
    work (Ray Data's default packs files into blocks of up to 128 MiB: a few million rows of a
    narrow table are one block, which one actor scores while the others wait).

    Parquet goes through Ray Data's first (V1) reader, which plans its read tasks on the driver and
    splits them to `blocks`; the default (V2) reader lists files on an actor pool of its own (~4 s
    to start on 2 cores) and packs them into as few blocks."""
    import ray.data

    context = ray.data.DataContext.get_current()
    reader = ray.data.read_parquet if found.format == "parquet" else ray.data.read_csv
    v2, context.use_datasource_v2 = context.use_datasource_v2, False
    try:  # (a dataset takes a copy of the context when it is created)
        ds = reader(found.paths, filesystem=found.filesystem, override_num_blocks=blocks)
    finally:
        context.use_datasource_v2 = v2
    return ds.select_columns(list(dict.fromkeys(columns)))


def _rows(fs: pafs.FileSystem, directory: str) -> int:
    """The rows of the Parquet files in `directory` (0 when there is none); a file still being
    written, whose footer is not there yet, counts 0."""
    if fs.get_file_info(directory).type == pafs.FileType.NotFound:
        return 0
    files = [i.path for i in fs.get_file_info(pafs.FileSelector(directory)) if i.path.endswith(".parquet")]
    rows = 0
    for f in files:
        try:
            rows += pq.ParquetFile(fs.open_input_file(f)).metadata.num_rows
        except (OSError, pa.ArrowInvalid):
            pass
    return rows


class ScoringProgress:
    """While a scoring job writes, a line every `every_s` seconds: the rows scored and rejected so
    far (read from the files written), the rate, and, with the input's row count known, the share
    done and the time left."""

    def __init__(self, fs: pafs.FileSystem, root: str, total: int | None, every_s: float = 10.0):
        self.fs, self.root, self.total, self.every_s = fs, root, total, every_s
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scoring-progress", daemon=True)

    def line(self) -> str:
        done = _rows(self.fs, f"{self.root}/{PREDICTIONS}") + _rows(self.fs, f"{self.root}/{REJECTED}")
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = done / elapsed
        text = f"scored {done}" + (f" of {self.total} rows ({done / self.total:.0%})" if self.total else " rows")
        text += f", {rate:.0f} rows/s"
        if self.total and rate > 0 and done < self.total:
            text += f", ETA {format_duration((self.total - done) / rate)}"
        return text

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            print(self.line(), flush=True)

    def __enter__(self) -> "ScoringProgress":
        if self.every_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _bundle_dir(files: dict[str, bytes], prefix: str):
    """A temporary directory holding the bundle's files (removed when the returned object is)."""
    import tempfile

    directory = tempfile.TemporaryDirectory(prefix=prefix)
    for name, data in files.items():
        Path(directory.name, name).write_bytes(data)
    return directory


def _log_run(origin: LocalBundle, model: str, source: str, outcome: PredictOutcome) -> str:
    """A batch-scoring run in the experiment of the run that trained the version, linked to it."""
    from mlflow.entities import Metric, RunTag

    client, name, version = origin.client, origin.name, origin.version
    trained = client.get_run(client.get_model_version(name, version).run_id)
    run = client.create_run(trained.info.experiment_id, run_name=f"predict-{name}-v{version}-{time.strftime('%Y%m%d-%H%M%S')}",
                            tags={"flotilla.kind": "batch_prediction", "flotilla.model": name,
                                  "flotilla.model_version": version, "flotilla.model_ref": model,
                                  "flotilla.input": redact(source)[:5000], "flotilla.output": redact(outcome.output)[:5000],
                                  "flotilla.trained_by_run": trained.info.run_id})
    now = int(time.time() * 1000)
    rate = outcome.predicted / outcome.wall_time_s if outcome.wall_time_s else 0.0
    client.log_batch(run.info.run_id, metrics=[
        Metric("rows_predicted", outcome.predicted, now, 0), Metric("rows_rejected", outcome.rejected, now, 0),
        Metric("wall_time_s", outcome.wall_time_s, now, 0), Metric("rows_per_s", rate if math.isfinite(rate) else 0, now, 0),
    ], tags=[RunTag("mlflow.note.content", redact(outcome.describe()))])
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id
