"""ONNX variants of a bundle: export, int8 quantization, a parity gate, a speed measurement, and
publishing them to a registered version (the runtime that serves them is `flotilla.bundle`'s).

    records = build_variants(bundle, val_batches, spec.export)    # writes <bundle>/variants/
    fast = bundle.with_runtime("onnx-int8")                       # the same API, ONNX Runtime inside

A variant is `variants/<name>/model.onnx` in the bundle directory; `variants/variants.json`
records, per variant, whether it passed its gate, the numbers the gate compared, and the speed
measured on the exporting machine (also for `torch`), from which `serve.runtime: auto` picks.
The graph holds the model only: preprocessing stays the bundle's own, so every runtime sees the
same inputs. A language model's graph takes and returns the KV cache, so generation with ONNX
Runtime is incremental too (`gpt`: `tokens, past_keys, past_values -> logits, keys, values`; a
fine-tuned Hugging Face model also takes `attention_mask` and `position_ids`, so left-padded
prompts decode together). `onnx-int4` (language models) holds that graph's weights in 4 bits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import torch

from flotilla.bundle import ALLOW_ON_COMMAND_LINE, ONNX_FILE, VARIANTS_DIR, VARIANTS_JSON, OnnxModel, choose_runtime, load_bundle
from flotilla.data import TOKENS, ByteWindows, prepare_data
from flotilla.data._instruct import INPUT_IDS
from flotilla.errors import BundleError, TrackingError
from flotilla.metrics import primary_metric
from flotilla.redact import redact
from flotilla.runtime import ensure_ray
from flotilla.spec import load_spec
from flotilla.track import BundleEvaluator, LocalBundle, local_bundle, registered_variants


class _GPTGraph(torch.nn.Module):
    """`GPT.step_with` as a graph whose cache is tensors in and out."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens, past_keys, past_values):
        keys, values = [], []

        def extender(i: int):
            def extend(k, v):
                k, v = torch.cat([past_keys[i], k], dim=2), torch.cat([past_values[i], v], dim=2)
                keys.append(k)
                values.append(v)
                return k, v
            return extend

        logits = self.gpt.step_with(tokens, past_keys.shape[3], [extender(i) for i in range(len(self.gpt.blocks))])
        return logits, torch.stack(keys), torch.stack(values)


class _HFGraph(torch.nn.Module):
    """A Hugging Face causal LM's forward pass as a graph whose cache is tensors in and out: keys and
    values stacked over the layers, `(layers, batch, kv heads, tokens, head width)`."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, attention_mask, position_ids, past_keys, past_values):
        from transformers import DynamicCache

        layers = past_keys.shape[0]
        cache = DynamicCache(config=self.hf.config)
        for i in range(layers):
            cache.update(past_keys[i], past_values[i], i)
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                      use_cache=True)
        grown = out.cache if hasattr(out, "cache") else out.past_key_values
        return (out.logits, torch.stack([grown.layers[i].keys for i in range(layers)]),
                torch.stack([grown.layers[i].values for i in range(layers)]))


def export_onnx(bundle, path: Path) -> None:
    """The bundle's torch model as an ONNX graph with a dynamic batch (and, for language models,
    dynamic new and cached token counts)."""
    from torch.export import Dim

    kind = bundle.model_spec.get("kind")
    model = bundle.model.eval()
    batch = Dim("batch", min=1, max=65536)
    if kind == "hf_causal_lm":
        if bundle.prefix is not None:
            raise BundleError("`flotilla export` builds ONNX variants of token-id models; a prompt-tuning version's "
                              "virtual tokens run in torch: serve it with `--set serve.runtime=torch`")
        config = model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_hidden_layers, 2, kv_heads, 3, width)
        model = _HFGraph(model).eval()
        args = (torch.ones(2, 4, dtype=torch.long), torch.ones(2, 7, dtype=torch.long),
                torch.arange(3, 7).expand(2, 4).clone(), torch.zeros(shape), torch.ones(shape))
        most = getattr(config, "max_position_embeddings", None) or 1 << 16
        new, past = Dim("tokens", min=1, max=most), Dim("past", min=0, max=most - 1)
        names = ["input_ids", "attention_mask", "position_ids", "past_keys", "past_values"]
        outputs = ["logits", "keys", "values"]
        dynamic = ({0: batch, 1: new}, {0: batch, 1: Dim("attended", min=1, max=most)}, {0: batch, 1: new},
                   {1: batch, 3: past}, {1: batch, 3: past})
    elif kind == "mlp":
        args = (torch.zeros(2, bundle.schema.num_features),)
        names, outputs, dynamic = ["features"], ["output"], ({0: batch},)
    elif kind == "gpt":
        model = _GPTGraph(model).eval()
        blocks = bundle.model.blocks
        heads = blocks[0].attn.heads
        shape = (len(blocks), 1, heads, 2, bundle.model.tok.embedding_dim // heads)
        # Two distinct tensors: the exporter merges inputs that are the same tensor.
        args = (torch.zeros(1, 3, dtype=torch.long), torch.zeros(shape), torch.ones(shape))
        context = bundle.schema.context
        new, past = Dim("tokens", min=1, max=context), Dim("past", min=0, max=context - 1)
        names, outputs = ["tokens", "past_keys", "past_values"], ["logits", "keys", "values"]
        dynamic = ({0: batch, 1: new}, {1: batch, 3: past}, {1: batch, 3: past})
    else:
        raise BundleError(f"`flotilla export` builds ONNX variants of `mlp`, `gpt` and `hf_causal_lm` models; this "
                          f"bundle's model is "
                          f"`{kind}`: serve it with `--set serve.runtime=torch`")
    with warnings.catch_warnings(), _quiet("torch.onnx", "torch.export", "onnxscript"):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), input_names=names, output_names=outputs, dynamic_shapes=dynamic,
                          dynamo=True, external_data=False, verbose=False, optimize=True)


def quantize_int8(source: Path, target: Path) -> None:
    """ONNX Runtime's dynamic quantization: int8 weights, activations quantized per batch as they come."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet("root", "onnxruntime"):  # its advice to pre-process first is a log line, not our doing
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


INT4_ACCURACY_LEVELS = {"fp32": 1, "int8": 4}  # `export.int4_compute` -> MatMulNBits' accuracy_level


def quantize_int4(source: Path, target: Path, block_size: int = 32, compute: str = "int8") -> None:
    """ONNX Runtime's 4-bit weight-only quantization: each matrix multiplication's weights (and the
    token embedding's) in blocks of `block_size` along the input, one scale per block, symmetric
    (`MatMulNBits`, `GatherBlockQuantized`). `compute`: `int8` multiplies with activations quantized
    per block on the fly (int8 dot products), `fp32` with the weights dequantized."""
    import onnx

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    # (Importing the quantizer configures the process's root logger at INFO: undone here.)
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    root.handlers[:], root.level = handlers, level
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True,
                                          accuracy_level=INT4_ACCURACY_LEVELS[compute],
                                          op_types_to_quantize=("MatMul", "Gather"))
    with _quiet("root", "onnxruntime"), warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore")  # (an all-zero block divides 0 by its zero scale, then is written as 0)
        quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), algo_config=config)
        quantizer.process()
        quantizer.model.save_model_to_file(str(target), use_external_data_format=False)


@contextlib.contextmanager
def _quiet(*loggers: str):
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in loggers]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def build_variants(bundle, batches: Iterable[pd.DataFrame], export, label_column: str | None,
                   text_column: str | None) -> dict[str, dict[str, Any]]:
    """Build `export.variants` of `bundle` into its directory, gate each against the torch model on
    `batches` (the run's raw validation rows), measure every runtime's speed here, and record all
    of it in `variants/variants.json`. A variant that fails its gate stays on disk, recorded with
    the reason, and is never chosen to serve."""
    out = Path(bundle.path) / VARIANTS_DIR
    with tempfile.TemporaryDirectory(prefix="flotilla-export-") as tmp:
        built: dict[str, Path] = {}
        fp32 = Path(tmp) / "onnx.onnx"
        export_onnx(bundle, fp32)
        if "onnx" in export.variants:
            built["onnx"] = fp32
        if "onnx-int8" in export.variants:
            quantize_int8(fp32, Path(tmp) / "int8.onnx")
            built["onnx-int8"] = Path(tmp) / "int8.onnx"
        if "onnx-int4" in export.variants and bundle.task == "lm":  # (weights in 4 bits: language models)
            quantize_int4(fp32, Path(tmp) / "int4.onnx", export.int4_block_size, export.int4_compute)
            built["onnx-int4"] = Path(tmp) / "int4.onnx"
        if out.exists():
            shutil.rmtree(out)
        for name, file in built.items():
            (out / name).mkdir(parents=True)
            shutil.move(str(file), out / name / ONNX_FILE)
    variants = {name: bundle.with_runtime(name, check=False) for name in built}
    records = _gate(bundle, variants, batches, export, label_column, text_column)
    records["torch"] = {"speed": measure_speed(bundle)}
    for name, variant in variants.items():
        records[name]["speed"] = measure_speed(variant)
        records[name]["file"] = f"{VARIANTS_DIR}/{name}/{ONNX_FILE}"
        records[name]["bytes"] = (out / name / ONNX_FILE).stat().st_size
    (out / VARIANTS_JSON).write_text(json.dumps(records, indent=1))
    return records


def _gate(bundle, variants: dict, batches: Iterable[pd.DataFrame], export, label_column, text_column
          ) -> dict[str, dict[str, Any]]:
    evaluators = {name: BundleEvaluator(b, label_column, text_column) for name, b in [("torch", bundle), *variants.items()]}
    largest = dict.fromkeys(variants, 0.0)
    for batch in batches:
        for evaluator in evaluators.values():
            evaluator.add(batch)
        reference = _outputs(bundle, batch, label_column, text_column)
        if reference is None:
            continue
        for name, variant in variants.items():
            largest[name] = max(largest[name], float(np.max(np.abs(_outputs(variant, batch, label_column, text_column)
                                                                    - reference), initial=0.0)))
    task = bundle.task
    metric = primary_metric(task)
    base = evaluators["torch"].value()
    records = {}
    for name in variants:
        value = evaluators[name].value()
        if task == "classification":
            drop = base - value
            passed = drop <= export.max_accuracy_drop
            rule = f"accuracy drop {drop * 100:.2f} points (at most {export.max_accuracy_drop * 100:g})"
        else:
            rise = value / base - 1 if base else float("inf")
            passed = rise <= export.max_relative_increase
            rule = f"{metric.name} {rise * 100:+.2f} % (at most +{export.max_relative_increase * 100:g} %)"
        passed = passed and bool(np.isfinite(value))
        what = "largest probability difference" if task != "regression" else "largest prediction difference"
        on = f"{evaluators[name].count} validation tokens" if task == "lm" else f"{evaluators[name].rows} validation rows"
        reason = f"{metric.name} {value:{metric.fmt}} vs torch's {base:{metric.fmt}} on {on}: {rule}; {what} {largest[name]:.2g}"
        records[name] = {"passed": passed, "reason": reason, metric.name: value, f"torch_{metric.name}": base,
                         "max_difference": largest[name], "rows": evaluators[name].rows}
    return records


@torch.inference_mode()
def _outputs(bundle, batch: pd.DataFrame, label_column, text_column) -> np.ndarray | None:
    """What the runtimes must agree on: class probabilities, predictions, or (language models) the
    next-token probabilities of the batch's first windows."""
    if INPUT_IDS in batch.columns:  # a pretrained model's token windows (a preference pair's chosen one)
        inputs = torch.as_tensor(np.stack(batch[INPUT_IDS].head(8).to_numpy()))
        inputs = inputs[:, 0] if inputs.dim() == 3 else inputs
        return torch.softmax(bundle.logits(inputs).float(), dim=-1).numpy()
    if bundle.task == "lm":
        windows = ByteWindows(text_column, bundle.schema.context)._transform_pandas(batch.head(8))[TOKENS]
        if len(windows) == 0:
            return None
        tokens = torch.as_tensor(np.stack(windows.to_numpy()))[:, :-1]
        return torch.softmax(bundle.model(tokens).float(), dim=-1).numpy()
    out = bundle.predict_arrays(batch.drop(columns=[label_column]))
    return out["probabilities"] if "probabilities" in out else out["predictions"].astype(np.float64)


def measure_speed(bundle, seconds: float = 1.0) -> dict[str, Any]:
    """This machine's speed for `bundle`: rows/s of 32-row batches and the median one-row latency
    (tables), or tokens/s of a 64-token greedy generation (language models); `per_s` is the one
    number `serve.runtime: auto` ranks by."""
    if bundle.task == "lm":
        generate = _greedy_tokens(bundle)
        generate(4)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            count = generate(64)
            runs.append(count / (time.perf_counter() - start))
        return {"per_s": statistics.median(runs), "unit": "tokens/s (64-token generation)"}
    batch, one = bundle.example_rows(32), bundle.example_rows(1)
    bundle.predict_arrays(batch)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds / 2:
        bundle.predict_arrays(batch)
        count += 32
    rate = count / (time.perf_counter() - start)
    latencies, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds / 2:
        t = time.perf_counter()
        bundle.predict_arrays(one)
        latencies.append((time.perf_counter() - t) * 1000)
    return {"per_s": rate, "unit": "rows/s (32-row batches)", "p50_ms_one_row": statistics.median(latencies)}


def _greedy_tokens(bundle):
    """A greedy generation of n tokens after "def " that counts what it made (a fine-tuned model's
    end of text is banned, so that it runs the n tokens)."""
    if hasattr(bundle, "generate_ids"):
        ids, ban = bundle.encode("def "), {token: -100.0 for token in bundle.stop_ids()}
        return lambda n: sum(1 for _ in bundle.generate_ids(ids, max_tokens=n, temperature=0.0, logit_bias=ban))

    def generate(n: int) -> int:
        bundle.generate("def ", max_tokens=n, temperature=0.0)
        return n
    return generate


# --------------------------------------------------------------------- registered versions
class ExportOutcome:
    def __init__(self, model: str, version: str | None, bundle_dir: Path, records: dict[str, dict[str, Any]]):
        self.model, self.version, self.bundle_dir, self.records = model, version, bundle_dir, records

    def describe(self) -> str:
        where = f"{self.model} v{self.version}" if self.version else str(self.bundle_dir)
        lines = [f"variants of {where}:"]
        for name, r in self.records.items():
            speed = r.get("speed", {})
            rate = f"{speed.get('per_s', 0):,.0f} {speed.get('unit', '')}"
            if name == "torch":
                lines.append(f"  torch       {rate}")
            else:
                lines.append(f"  {name:<11} {rate}; gate {'passed' if r['passed'] else 'FAILED'}: {r['reason']}")
        lines.append(f"serve.runtime=auto serves {choose_runtime(self.records, 'auto', where)}")
        return "\n".join(lines)


def export_model(reference: str, tracking_uri: str | None = None, config: str | None = None,
                 overrides: list[str] = (), *, spec=None, prepared=None, factories: Iterable[str] = ()) -> ExportOutcome:
    """Build, gate and measure the ONNX variants of a registered version (NAME@ALIAS, NAME/VERSION)
    or of a bundle directory. A registered version's variants join it: its model's artifacts gain
    the bundle's `variants/` directory, and the version a `flotilla.runtime.<name>` tag per
    variant (passed or failed, and why). The validation rows come from the spec the version was
    trained with (its run's `spec.yaml`; a bundle directory: its run's, or `config`); the end of a
    training run passes its own `spec` and `prepared` data.

    A spec read back (the run's `spec.yaml`) is data: it allows no `custom` model factory and its
    `model.trust_remote_code` is not honoured. `factories` (`--allow-factory`) and a spec the
    caller gives (`config`, or `spec` from the training run) allow what they name."""

    with tempfile.TemporaryDirectory(prefix="flotilla-export-") as tmp, \
            local_bundle(reference, tracking_uri, "flotilla export") as found:
        if found.client is None:
            spec_file = config or (None if spec is not None else _run_spec_file(found.path))
        else:
            version = found.client.get_model_version(found.name, found.version)
            if _model_id(version) is None:
                raise TrackingError(f"{found.name} v{found.version} has no logged model to add variants to "
                                    f"(source {version.source})")
            spec_file = config or version_spec_file(found, version.run_id, Path(tmp))
        allowed = set(factories)
        if spec is not None or config:
            spec = spec if spec is not None else load_spec(config, list(overrides))
            allowed |= spec.allowed_factories()
        else:
            spec = recorded_spec(spec_file, list(overrides))
        bundle = load_bundle(found.path, factories=allowed, allow_with=ALLOW_ON_COMMAND_LINE)
        if prepared is None:
            ensure_ray(spec)
            prepared = prepare_data(spec)
        schema = prepared.schema
        # A pretrained model's rows are scored as this run's token windows (`input_ids`, `labels`).
        rows_of = prepared.val if schema.masked else prepared.val_raw
        batches = rows_of.iter_batches(batch_size=256 if schema.masked else 2048, batch_format="pandas")
        records = build_variants(bundle, batches, spec.export, schema.label_column, schema.text_column)
        if found.client is None:
            return ExportOutcome(reference, None, found.path, records)
        _publish(found.client, found.name, found.version, found.path, found.relative, records)
        return ExportOutcome(found.name, found.version, found.path, records)


def judge_variant_scores(found: LocalBundle, runtime: str, scores: dict[str, tuple[float, float, bool]],
                         max_drop: float) -> dict[str, Any]:
    """The second half of a language model's variant gate, from `flotilla eval --runtime`: each
    task's score of the variant against torch's on the same tasks (`scores`: metric -> (variant,
    torch, higher is better)). The variant fails when any is worse by more than `max_drop`; its
    record (variants.json of the version's model) and its `flotilla.runtime.<variant>` tag say so,
    and serving refuses a failed variant as one that failed its parity check. Judged
    again, the latest scores decide (the parity verdict stays)."""
    from mlflow.entities import Metric

    client, name, version = found.client, found.name, found.version
    records = registered_variants(client, name, version)
    record = records.get(runtime)
    if record is None:
        raise BundleError(f"{name} v{version} has no {runtime} variant to judge; build it with "
                          f"`flotilla export --model {name}/{version}`")
    record.setdefault("parity_passed", record["passed"])
    record.setdefault("parity_reason", record["reason"])
    worse = {k: (t - v if higher else v - t) for k, (v, t, higher) in scores.items()}
    ok = all(drop <= max_drop for drop in worse.values())
    said = ", ".join(f"{k.removeprefix('eval.')} {v:.4f} vs torch's {t:.4f}" for k, (v, t, _) in sorted(scores.items()))
    record["eval"] = {k: {"variant": v, "torch": t} for k, (v, t, _) in scores.items()}
    record["eval_passed"] = ok
    record["passed"] = bool(record["parity_passed"] and ok)
    record["reason"] = (f"{record['parity_reason']}; eval {'within' if ok else 'FAILED'}: {said} "
                        f"(at most {max_drop:g} worse)")
    registered = client.get_model_version(name, version)
    with tempfile.TemporaryDirectory(prefix="flotilla-variants-") as tmp:  # the records alone, not the graphs again
        (Path(tmp) / VARIANTS_JSON).write_text(json.dumps(records, indent=1))
        client.log_model_artifacts(_model_id(registered), tmp, artifact_path=f"{found.relative}/{VARIANTS_DIR}")
    client.set_model_version_tag(name, version, f"flotilla.runtime.{runtime}", _variant_tag(runtime, record))
    client.set_model_version_tag(name, version, "flotilla.runtime.auto", choose_runtime(records, "auto", name))
    client.log_batch(registered.run_id, metrics=[Metric(f"variant.{runtime}.gate_passed", float(record["passed"]),
                                                   int(time.time() * 1000), 0)])
    return record


def recorded_spec(path: str, overrides: list[str]):
    """The spec a version was trained with, read back from its run, as data: its
    `model.trust_remote_code` is turned off (whoever can write the run's artifacts would choose the
    code it runs) unless the user's own `--set` turns it on."""
    spec = load_spec(path, overrides)
    if getattr(spec.model, "trust_remote_code", False) and \
            not any(o.split("=", 1)[0].strip() == "model.trust_remote_code" for o in overrides):
        print(f"note: {redact(path)} sets model.trust_remote_code; a spec read back from a run is not trusted to run "
              "code, so it is off here (--set model.trust_remote_code=true turns it on, after reading that code)",
              file=sys.stderr, flush=True)
        spec = load_spec(path, [*overrides, "model.trust_remote_code=false"])
    return spec


def version_spec_file(found: LocalBundle, run_id: str, tmp: Path) -> str:
    """The spec the version's run trained with (its `spec.yaml` artifact), downloaded into `tmp`."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    try:
        return download_artifacts(run_id=run_id, artifact_path="spec.yaml", dst_path=str(tmp / "run"),
                                  tracking_uri=found.client.tracking_uri)
    except MlflowException as e:
        raise TrackingError(f"{found.name} v{found.version}: its run's spec.yaml: {e.message} "
                            f"(store {found.client.tracking_uri})") from None


def _model_id(version) -> str | None:
    """The logged model a version was registered from (MLflow 3 names it in the source)."""
    source = version.source or ""
    return version.model_id or (source.removeprefix("models:/") if source.startswith("models:/m-") else None)


def _run_spec_file(bundle_dir: Path) -> str:
    """The spec its run recorded beside its checkpoints (`<run>/spec.yaml`)."""
    for candidate in (bundle_dir.parent / "spec.yaml", bundle_dir.parent.parent / "spec.yaml"):
        if candidate.is_file():
            return str(candidate)
    raise BundleError(f"{bundle_dir}: no spec.yaml of its run beside it to read the validation rows from; "
                      "name the spec it was trained with: --config SPEC.yaml")


def _publish(client, name: str, version: str, bundle_dir: Path, relative: str,
             records: dict[str, dict[str, Any]]) -> None:
    """The variants into the version's model; their verdicts into its tags and its run's metrics."""
    from mlflow.entities import Metric

    found = client.get_model_version(name, version)
    client.log_model_artifacts(_model_id(found), str(bundle_dir / VARIANTS_DIR), artifact_path=f"{relative}/{VARIANTS_DIR}")
    now = int(time.time() * 1000)
    metrics = []
    for variant, r in records.items():
        if variant != "torch":
            metrics += [Metric(f"variant.{variant}.max_difference", r["max_difference"], now, 0),
                        Metric(f"variant.{variant}.gate_passed", float(r["passed"]), now, 0)]
        client.set_model_version_tag(name, version, f"flotilla.runtime.{variant}", _variant_tag(variant, r))
        if r.get("speed", {}).get("per_s"):
            metrics.append(Metric(f"variant.{variant}.per_s", r["speed"]["per_s"], now, 0))
    client.set_model_version_tag(name, version, "flotilla.runtime.auto", choose_runtime(records, "auto", name))
    client.log_batch(found.run_id, metrics=metrics)


def _variant_tag(variant: str, record: dict[str, Any]) -> str:
    """A variant's `flotilla.runtime.<variant>` tag: its verdict and why, and its measured speed."""
    speed = record.get("speed", {})
    rate = f"{speed.get('per_s', 0):.0f} {speed.get('unit', '')}"
    tag = f"measured: {rate}" if variant == "torch" else \
        f"{'passed' if record['passed'] else 'failed'}: {record['reason']}; {rate}"
    return redact(tag)[:5000]
