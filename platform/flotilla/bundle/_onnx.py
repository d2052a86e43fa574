"""ONNX variants inside a bundle: where `flotilla export` writes them, the records of their gates,
which runtime serves, and the ONNX Runtime model that runs in a bundle in place of the torch one.

A variant is `variants/<name>/model.onnx` in the bundle directory; `variants/variants.json`
records, per variant, whether it passed its gate, the numbers the gate compared, and the speed
measured on the exporting machine (also for `torch`), from which `serve.runtime: auto` picks.
A language model's graph takes and returns the KV cache, so generation with ONNX Runtime is
incremental too: a `gpt` graph `tokens, past_keys, past_values -> logits, keys, values`; a
fine-tuned Hugging Face model's `input_ids, attention_mask, position_ids, past_keys, past_values
-> logits, keys, values` (left-padded batches decode together, as in torch). `onnx-int4` is that
graph with its weights in 4 bits (ONNX Runtime's `MatMulNBits` and `GatherBlockQuantized`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from flotilla.errors import BundleError

VARIANTS_DIR, VARIANTS_JSON, ONNX_FILE = "variants", "variants.json", "model.onnx"
RUNTIMES = ("torch", "onnx", "onnx-int8", "onnx-int4")


def read_variants(bundle_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The variants recorded in a bundle directory ({} when none were built)."""
    path = Path(bundle_dir) / VARIANTS_DIR / VARIANTS_JSON
    return json.loads(path.read_text()) if path.is_file() else {}


def choose_runtime(records: dict[str, dict[str, Any]], wanted: str, what: str) -> str:
    """The runtime to serve: `wanted` if it is torch or a variant that passed its gate; for `auto`,
    the fastest of torch and the variants that passed (torch when nothing was measured)."""
    if wanted == "torch":
        return "torch"
    if wanted != "auto":
        record = records.get(wanted)
        if record is None:
            raise BundleError(f"{what} has no {wanted} variant; build it with `flotilla export --model ...`, "
                              f"or serve it with `--set serve.runtime=torch`")
        if not record.get("passed"):
            raise BundleError(f"{what}: its {wanted} variant failed its gate ({record.get('reason')}); "
                              f"it is never served: `--set serve.runtime=torch` or another variant")
        return wanted
    usable = {name: r for name, r in records.items() if name == "torch" or r.get("passed")}
    speeds = {name: r.get("speed", {}).get("per_s") for name, r in usable.items()}
    speeds = {name: v for name, v in speeds.items() if v}
    return max(speeds, key=speeds.get) if len(speeds) > 1 else "torch"


def onnx_session(path: str | Path, threads: int | None = None):
    """An ONNX Runtime session on the CPU with as many threads as torch uses in this process."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # Idle threads sleep instead of spinning: a spinning pool takes the cores from the torch
    # work around each call (preprocessing, softmax) and from the other replicas.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxCache:
    """The KV cache of an ONNX language model's graph: its tensors go in and come back grown."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        self.keys, self.values = keys, values

    @property
    def length(self) -> int:
        return self.keys.shape[3]


class _OnnxSession:
    """What both ONNX models share: a session on the CPU that stands where a torch module stood."""

    session: Any
    _cache_shape: tuple[int, int, int]  # a language model's: layers, heads (of keys and values), head width

    def eval(self):
        return self

    def parameters(self):
        return iter(())

    def to(self, device):
        if torch.device(device).type != "cpu":
            raise BundleError("ONNX variants run on the CPU (onnxruntime's CPU provider); serve a GPU replica with "
                              "`--set serve.runtime=torch`")
        return self

    def new_cache(self, batch: int = 1) -> OnnxCache:
        layers, heads, width = self._cache_shape
        empty = np.zeros((layers, batch, heads, 0, width), np.float32)
        return OnnxCache(empty, empty.copy())


class OnnxModel(_OnnxSession):
    """An ONNX Runtime session in a bundle's place of the torch model: called with the model's input
    tensor, it returns the output tensor; a `gpt` graph also runs `step` with its cache, as
    `GPT.step` does. It uses as many threads as torch does in this process."""

    def __init__(self, path: str | Path, threads: int | None = None):
        self.session = onnx_session(path, threads)
        self.names = [i.name for i in self.session.get_inputs()]
        self.language = self.names[0] == "tokens"
        if self.language:
            shape = self.session.get_inputs()[1].shape  # [layers, batch, heads, past, head width]
            self._cache_shape = (shape[0], shape[2], shape[4])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.language:
            return self.step(x, self.new_cache(x.shape[0]))
        return torch.from_numpy(self.session.run(None, {self.names[0]: x.numpy().astype(np.float32, copy=False)})[0])

    def step(self, tokens: torch.Tensor, cache: OnnxCache) -> torch.Tensor:
        logits, cache.keys, cache.values = self.session.run(None, {
            "tokens": tokens.numpy().astype(np.int64, copy=False), "past_keys": cache.keys, "past_values": cache.values})
        return torch.from_numpy(logits)


class OnnxCausalLM(_OnnxSession):
    """An ONNX Runtime session in place of a Hugging Face causal LM inside an `HFBundle`: called as
    the torch model is (`input_ids`, and `attention_mask`, `position_ids`, `cache` where a batch or
    a decode step has them), it returns the logits and the grown cache (`OnnxCache`). The model's
    `config` and `generation_config` come along, read from the bundle."""

    device = torch.device("cpu")

    def __init__(self, path: str | Path, config, generation_config, threads: int | None = None):
        self.session = onnx_session(path, threads)
        self.config, self.generation_config = config, generation_config
        shape = self.session.get_inputs()[3].shape  # past_keys: [layers, batch, kv heads, past, head width]
        self._cache_shape = (shape[0], shape[2], shape[4])

    def get_output_embeddings(self):
        return None

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache: OnnxCache | None = None, inputs_embeds=None,
                 use_cache: bool = True) -> SimpleNamespace:
        if input_ids is None or inputs_embeds is not None:
            raise BundleError("an ONNX variant takes token ids; prompt tuning's virtual tokens run in torch "
                              "(`--set serve.runtime=torch`)")
        rows, new = input_ids.shape
        cache = cache if cache is not None else self.new_cache(rows)
        past = cache.length
        if attention_mask is None:
            attention_mask = torch.ones(rows, past + new, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(past, past + new).expand(rows, new)
        logits, keys, values = self.session.run(None, {
            "input_ids": _int64(input_ids), "attention_mask": _int64(attention_mask),
            "position_ids": _int64(position_ids), "past_keys": cache.keys, "past_values": cache.values})
        return SimpleNamespace(logits=torch.from_numpy(logits), cache=OnnxCache(keys, values))


def _int64(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.cpu().numpy().astype(np.int64, copy=False))
