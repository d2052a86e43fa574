"""The inference bundle: the contract between training and serving.

A bundle is a directory with
    model.safetensors     consolidated fp32 weights (also from ZeRO-3 shards)
    model.json            the model spec and the data schema (task, columns, classes, vocab)
    preprocessors.json    the preprocessors fitted on the train split, as JSON, and (tables) the
                          profile of each feature column in the train split
    metrics.json          final metrics and the per-epoch history

    bundle = load_bundle("runs/digits-20261129-101500/bundle")
    bundle.predict([{"pixel_0": 0.0, ...}])   # -> {"predictions": [...], "probabilities": [...]}
    bundle.generate("def main(", max_tokens=64, seed=0)   # gpt bundles

Nothing is unpickled: weights come from safetensors, everything else from JSON.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator

import numpy as np
import pandas as pd
import torch
from pydantic import TypeAdapter, ValidationError
from safetensors.torch import load_file, save_file

from flotilla.bundle._onnx import ONNX_FILE, VARIANTS_DIR, OnnxModel, choose_runtime, read_variants
from flotilla.bundle._sampling import sample_token
from flotilla.data import FEATURES, ByteWindows, DataSchema, apply_all, array_transform, from_json
from flotilla.data._columns import numeric_matrix
from flotilla.errors import BundleError
from flotilla.models import GPT, build_model
from flotilla.spec import CustomModelSpec, ModelSpec

WEIGHTS, MODEL_JSON, PREPROCESSORS_JSON, METRICS_JSON = (
    "model.safetensors",
    "model.json",
    "preprocessors.json",
    "metrics.json",
)
BUNDLE_FILES = (WEIGHTS, MODEL_JSON, PREPROCESSORS_JSON, METRICS_JSON)
# How a user allows a custom model's factory, by the loader's caller (`{factory}`: the factory).
ALLOW_IN_SERVE = "--set \"serve.allow_factories=['{factory}']\""
ALLOW_ON_COMMAND_LINE = "--allow-factory {factory}"
GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 1.0, "top_k": 0, "seed": -1}


_MODEL_SPEC = TypeAdapter(ModelSpec)


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_bundle(directory: str | Path, state_dict: dict[str, torch.Tensor], model_spec: dict, schema: DataSchema,
                 preprocessors: dict, metrics: dict) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float32).contiguous().cpu() for k, v in state_dict.items()}, out / WEIGHTS)
    (out / MODEL_JSON).write_text(json.dumps({"model": model_spec, "schema": schema.as_dict()}, indent=1))
    (out / PREPROCESSORS_JSON).write_text(json.dumps(preprocessors, indent=1))
    (out / METRICS_JSON).write_text(json.dumps(metrics, indent=1, default=float))
    return out


@dataclass
class InferenceBundle:
    path: Path
    model: torch.nn.Module
    model_spec: dict[str, Any]
    schema: DataSchema
    feature_steps: list
    classes: list | None
    metrics: dict[str, Any]
    # Tables: per feature column, its kind, range or values in the train split (None in bundles
    # written before profiles existed).
    profile: dict[str, dict[str, Any]] | None = None
    runtime: str = "torch"  # what runs the model: torch, or an ONNX variant (`with_runtime`)

    def __post_init__(self):
        columns = self.schema.feature_columns
        self._array_transform = array_transform(self.feature_steps, columns) if columns else None

    @property
    def categorical(self) -> list[str]:
        """The feature columns whose raw values are categories (strings)."""
        return list(self.schema.categorical_columns or [])

    def example_rows(self, n: int) -> pd.DataFrame | np.ndarray:
        """`n` rows this bundle accepts (for warming up): zeros, or gaps in categorical columns."""
        columns = self.schema.feature_columns
        if not self.categorical:
            return np.zeros((n, len(columns)))
        return pd.DataFrame({c: [None if c in self.categorical else 0.0] * n for c in columns})

    @property
    def task(self) -> str:
        return self.schema.task

    @property
    def device(self) -> torch.device:
        weight = next(iter(self.model.parameters()), None)
        return weight.device if weight is not None else torch.device("cpu")

    @property
    def variants(self) -> dict[str, dict[str, Any]]:
        """The ONNX variants `flotilla export` built in this bundle and what their gates found."""
        return read_variants(self.path) if self.path is not None else {}

    def with_runtime(self, runtime: str, check: bool = True) -> "InferenceBundle":
        """This bundle with its model run by `runtime`: `torch` (itself), `onnx`, `onnx-int8` or `onnx-int4` (its
        variant, through ONNX Runtime), or `auto` (the fastest that passed its gate). A variant that
        is missing or failed its gate is refused unless `check` is off (the gate itself runs it)."""
        name = choose_runtime(self.variants, runtime, str(self.path)) if check else runtime
        if name == self.runtime:
            return self
        if name == "torch":
            raise BundleError("this bundle runs an ONNX variant; load the bundle again for its torch model")
        model = OnnxModel(Path(self.path) / VARIANTS_DIR / name / ONNX_FILE)
        return replace(self, model=model, runtime=name)

    def to(self, device: str | torch.device) -> "InferenceBundle":
        """Move the model (serving on a GPU); inputs follow it."""
        self.model.to(device)
        return self

    def transform(self, rows: pd.DataFrame | list[dict[str, Any]] | np.ndarray) -> torch.Tensor:
        """Raw rows → the model's input tensor, with the preprocessors fitted at training time.

        `rows` may be an array already in `schema.feature_columns` order (serving): floats with NaN
        for a gap, or objects where columns are categorical.
        """
        if self.task == "lm":
            raise BundleError("this is a language-model bundle; use generate() or score()")
        columns = self.schema.feature_columns
        if isinstance(rows, np.ndarray) and self._array_transform is None and rows.dtype == object:
            rows = pd.DataFrame(rows, columns=columns) if rows.ndim == 2 and rows.shape[1] == len(columns) else rows
        if isinstance(rows, np.ndarray):
            if rows.ndim != 2 or rows.shape[1] != len(columns):
                raise BundleError(f"rows of shape {rows.shape}; this model needs (n, {len(columns)})")
            array = rows.astype("float64", copy=False)
        else:
            df = pd.DataFrame(rows) if not isinstance(rows, pd.DataFrame) else rows
            missing = [c for c in columns if c not in df.columns]
            if missing:
                raise BundleError(
                    f"rows lack feature column(s) {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}; "
                    f"this model needs {len(columns)} columns: {', '.join(columns[:10])}{' ...' if len(columns) > 10 else ''}"
                )
            if self._array_transform is None:  # categorical columns: Ray's steps on the raw values
                # (a fresh 0..n-1 index: some of Ray's steps assign whole columns by position)
                features = apply_all(self.feature_steps, df[columns].reset_index(drop=True))[FEATURES]
                return torch.as_tensor(np.stack(features.to_numpy()), dtype=torch.float32)
            array = numeric_matrix(df, columns)
        if self._array_transform is not None:
            return torch.from_numpy(np.ascontiguousarray(self._array_transform(array), dtype=np.float32))
        features = apply_all(self.feature_steps, pd.DataFrame(array, columns=columns))[FEATURES]
        return torch.as_tensor(np.stack(features.to_numpy()), dtype=torch.float32)

    def predict(self, rows: pd.DataFrame | list[dict[str, Any]] | np.ndarray) -> dict[str, list]:
        return {k: v.tolist() for k, v in self.predict_arrays(rows).items()}

    @torch.no_grad()
    def predict_arrays(self, rows: pd.DataFrame | list[dict[str, Any]] | np.ndarray) -> dict[str, np.ndarray]:
        """`predict` as arrays (batch scoring writes them to Arrow as they are): `predictions` (n,)
        and, for a classifier, `probabilities` (n, classes) as float32."""
        x = self.transform(rows).to(self.device)
        out = self.model(x)
        if self.task == "classification":
            probs = torch.softmax(out.float(), dim=-1).cpu().numpy()
            return {"predictions": np.asarray(self.classes)[probs.argmax(axis=-1)], "probabilities": probs}
        return {"predictions": out.squeeze(-1).float().cpu().numpy()}

    def next_logits(self, cache: bool = True) -> Callable[[list[int]], torch.Tensor]:
        """A function from the token ids so far (a list that grows by one between calls) to the
        logits of the next token, as fp32 on the CPU.

        The model sees the ids from a start that stays put until the window would exceed
        `context`, then moves so that the last three quarters of the context stay. `cache=True`
        keeps every layer's keys and values of the window (`GPT.step`), so a call costs one
        token's forward pass, and a full window is recomputed only when the start moves (the
        positions are learned and absolute: a kept token's keys change with its position);
        `cache=False` recomputes the window at every call: the same logits, for models without
        `step` and as the reference the cached path is tested against."""
        model, context = self.model, self.schema.context
        keep = max(1, context * 3 // 4)
        state: dict[str, Any] = {"start": 0, "cache": None}
        cached = cache and hasattr(model, "step")

        def logits_of(ids: list[int]) -> torch.Tensor:
            n = len(ids)
            if n - state["start"] > context:
                state["start"], state["cache"] = n - keep, None
            start = state["start"]
            if not cached:
                return model(torch.tensor([ids[start:]], device=self.device))[0, -1].float().cpu()
            if state["cache"] is None:
                state["cache"] = model.new_cache()
            kv = state["cache"]
            return model.step(torch.tensor([ids[start + kv.length:]], device=self.device), kv)[0, -1].float().cpu()

        return logits_of

    @torch.inference_mode()
    def generate_stream(self, prompt: str, max_tokens: int = 64, temperature: float = 1.0,
                        top_k: int | None = None, seed: int | None = None, cache: bool = True) -> Iterator[str]:
        """Yield decoded text pieces as bytes are sampled (a piece ends on a UTF-8 boundary).
        `cache=False` recomputes the context for every token (see `next_logits`): the same text."""
        if self.task != "lm":
            raise BundleError("generate() needs a language-model (gpt) bundle; use predict()")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        logits_of = self.next_logits(cache)
        ids = ByteWindows.encode(prompt) or [ord("\n")]

        def tokens() -> Iterator[int]:
            for _ in range(max_tokens):
                ids.append(sample_token(logits_of(ids), temperature, top_k, generator))
                yield ids[-1]

        yield from _pieces(tokens())

    def batchable(self, requests: list[dict[str, Any]]) -> bool:
        """Whether `generate_batch` decodes these requests together (see there)."""
        if len(requests) < 2 or not isinstance(self.model, GPT):
            return False
        longest = max(len(ByteWindows.encode(r["prompt"]) or [0]) for r in requests)
        steps = max(int(r.get("max_tokens", GENERATE_DEFAULTS["max_tokens"])) for r in requests)
        return longest + steps - 1 <= self.schema.context

    @torch.inference_mode()
    def generate_batch(self, requests: list[dict[str, Any]], stops: list[threading.Event] | None = None) -> list[str]:
        """Several generations decoded together, one forward pass per token for all of them, each
        the text `generate(**request)` writes alone (a request: `prompt` and `generate`'s keyword
        arguments). The prompts are left-padded (`GPT.step` with `pads`). Where that does not
        apply, one after the other: a model that cannot pad (an ONNX variant), or a prompt plus
        its new tokens that would not fit the context together (the window would move).

        A request whose event in `stops` is set ends after its current token, with the text so
        far; when every one has, no more forward passes run."""
        if self.task != "lm":
            raise BundleError("generate() needs a language-model (gpt) bundle; use predict()")
        stops = stops or [threading.Event() for _ in requests]
        encoded = [ByteWindows.encode(r["prompt"]) or [ord("\n")] for r in requests]
        longest = max(map(len, encoded))
        steps = max(int(r.get("max_tokens", GENERATE_DEFAULTS["max_tokens"])) for r in requests)
        if not self.batchable(requests):
            texts = []
            for request, stop in zip(requests, stops):
                pieces = []
                for piece in self.generate_stream(**request):
                    pieces.append(piece)
                    if stop.is_set():
                        break
                texts.append("".join(pieces))
            return texts
        pads = torch.tensor([longest - len(ids) for ids in encoded], device=self.device)
        tokens = torch.tensor([[0] * (longest - len(ids)) + ids for ids in encoded], device=self.device)
        cache = self.model.new_cache(batch=len(requests))
        samplers = [(int(r.get("max_tokens", GENERATE_DEFAULTS["max_tokens"])), float(r.get("temperature", 1.0)),
                     r.get("top_k"), torch.Generator().manual_seed(r["seed"]) if r.get("seed") is not None else None)
                    for r in requests]
        out: list[list[int]] = [[] for _ in requests]
        logits = self.model.step(tokens, cache, pads)[:, -1].float().cpu()
        for step in range(steps):
            for i, (n, temperature, top_k, generator) in enumerate(samplers):
                if step < n and not (step and stops[i].is_set()):
                    out[i].append(sample_token(logits[i], temperature, top_k, generator))
            if all(stop.is_set() for stop in stops):
                break
            if step + 1 < steps:  # a row that is done repeats its last token; its logits go unread
                last = torch.tensor([[ids[-1] if ids else 0] for ids in out], device=self.device)
                logits = self.model.step(last, cache, pads)[:, -1].float().cpu()
        return ["".join(_pieces(ids)) for ids in out]

    def generate(self, prompt: str, **kwargs) -> str:
        return "".join(self.generate_stream(prompt, **kwargs))

    def predict_frame(self, frame: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """A DataFrame in, a DataFrame out (the MLflow pyfunc contract).

        Classification: columns `prediction` and `probabilities`; regression: `prediction`;
        language models: a `prompt` column in, `text` out, with `params` max_tokens,
        temperature, top_k (0: off) and seed (-1: random).
        """
        if self.task == "lm":
            if "prompt" not in frame.columns:
                raise BundleError(f"a language-model bundle needs a `prompt` column; got {', '.join(map(str, frame.columns))}")
            p = {**GENERATE_DEFAULTS, **(params or {})}
            settings = dict(max_tokens=int(p["max_tokens"]), temperature=float(p["temperature"]),
                            top_k=int(p["top_k"]) or None, seed=None if int(p["seed"]) < 0 else int(p["seed"]))
            # the rows decode together where they can, each as it would alone
            return pd.DataFrame({"text": self.generate_batch([{"prompt": str(x), **settings} for x in frame["prompt"]])})
        out = self.predict(frame)
        result = pd.DataFrame({"prediction": out["predictions"]})
        if "probabilities" in out:
            result["probabilities"] = out["probabilities"]
        return result


def _pieces(tokens: Iterable[int]) -> Iterator[str]:
    """Byte tokens as text pieces, each ending on a UTF-8 boundary (U+FFFD for bytes that never form one)."""
    pending = b""
    for token in tokens:
        pending += bytes([token])
        try:
            piece = pending.decode("utf-8")
        except UnicodeDecodeError:
            if len(pending) < 4:
                continue
            piece = pending.decode("utf-8", errors="replace")
        pending = b""
        yield piece
    if pending:
        yield pending.decode("utf-8", errors="replace")


def read_bundle_metrics(fs, path: str) -> dict[str, Any]:
    """The bundle's metrics (`final`, `history`, ...) at `path` on a pyarrow filesystem `fs`,
    without loading the model."""
    with fs.open_input_stream(f"{path}/{METRICS_JSON}") as f:
        return json.loads(f.read())


def load_torch_bundle(path: str | Path, *, factories: Collection[str] = (),
                      allow_with: str = ALLOW_IN_SERVE) -> InferenceBundle:
    """The bundle in directory `path`. Its `model.json` is validated with the spec's own model
    sections; a `custom` model imports and runs its factory, so `factories` lists the ones this
    caller allows (`package.module:function`; default none, wherever the bundle came from): the
    run that wrote it allows its own spec's, serving `serve.allow_factories`, `flotilla predict`
    and `export` their `--allow-factory`. `allow_with` says how the caller's user allows one
    (`{factory}` stands for it) in the refusal."""
    root = Path(path)
    missing = [name for name in BUNDLE_FILES if not (root / name).is_file()]
    if missing:
        raise BundleError(f"{root} is not a complete inference bundle: missing {', '.join(missing)}")
    meta = json.loads((root / MODEL_JSON).read_text())
    try:
        schema = DataSchema.model_validate(meta.get("schema"))
    except ValidationError as e:
        raise BundleError(f"{root / MODEL_JSON} has no valid data schema: {e.errors()[0]['msg']}") from None
    try:
        model_spec = _MODEL_SPEC.validate_python(meta.get("model"))
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(["model", *map(str, error["loc"])])
        raise BundleError(f"{root / MODEL_JSON} has no valid model: {where}: {error['msg']}") from None
    if isinstance(model_spec, CustomModelSpec) and model_spec.factory not in factories:
        raise BundleError(
            f"{root / MODEL_JSON} builds its model with the factory {model_spec.factory!r}, code that loading it "
            f"would run; a custom model loads only where its factory is allowed: "
            + allow_with.format(factory=model_spec.factory)
        )
    preprocessors = json.loads((root / PREPROCESSORS_JSON).read_text())
    model = build_model(model_spec.model_dump(mode="json"), schema)
    state = load_file(root / WEIGHTS)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise BundleError(f"{root / WEIGHTS} does not match the model in {MODEL_JSON}: {e}") from None
    model.eval()
    label = preprocessors.get("label")
    classes = schema.classes
    return InferenceBundle(
        path=root,
        model=model,
        model_spec=model_spec.model_dump(mode="json"),
        schema=schema,
        feature_steps=[from_json(e) for e in preprocessors.get("features", [])],
        classes=classes if label is not None else None,
        metrics=json.loads((root / METRICS_JSON).read_text()),
        profile=preprocessors.get("profile"),
    )
