"""The inference bundle of a fine-tuned Hugging Face causal LM (`model.kind: hf_causal_lm`).

A directory that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load
as it is, offline, plus Flotilla's own JSON:
    model.safetensors          the weights, LoRA merged into the base (sharded with an index
                               past `max_shard_size`, as transformers does)
    config.json, generation_config.json
    tokenizer.json, tokenizer_config.json, chat_template.jinja (whichever the tokenizer has)
    adapter/                   LoRA runs only: the adapter alone, small (adapter_model.safetensors,
                               adapter_config.json), for those who load it onto their own base
    model.json, metrics.json   the model spec and data schema; final metrics and history

Nothing is pickled: weights are safetensors, the rest JSON or text. Loading runs no code from
the bundle (`trust_remote_code` is never passed): a model whose config asks for its own code is
refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flotilla.errors import BundleError

ADAPTER_DIR = "adapter"
MODEL_JSON, METRICS_JSON = "model.json", "metrics.json"
HF_FILES = ("config.json", "generation_config.json", MODEL_JSON, METRICS_JSON)


def write_hf_bundle(directory: str | Path, model, model_spec: dict[str, Any], schema: dict[str, Any] | None = None,
                    metrics: dict[str, Any] | None = None, max_shard_size: str = "5GB") -> Path:
    """Write `model` (an `HFCausalLM` holding the consolidated weights, on one process) as a bundle.

    For LoRA the model is consumed: its adapters are saved, then merged into its base weights in
    place. Build it from the consolidated state dict on rank 0 (as the loop's bundle check does)."""
    from flotilla.data._instruct import load_tokenizer
    from flotilla.models._hf import merge_into_base

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if model.is_lora:
        model.hf.save_pretrained(out / ADAPTER_DIR)  # safetensors is peft's default
    merged = merge_into_base(model)
    tokenizer = load_tokenizer(model_spec["pretrained"], model_spec.get("revision"),
                               bool(model_spec.get("trust_remote_code")))
    generation = merged.generation_config
    # Generation stops at the tokenizer's eos (a chat template's end of turn) and pads with its pad token.
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # (transformers 5 writes safetensors only; 4.x took `safe_serialization=True` for the same.)
    merged.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    (out / MODEL_JSON).write_text(json.dumps({"model": model_spec, "schema": schema}, indent=1))
    (out / METRICS_JSON).write_text(json.dumps(metrics or {}, indent=1, default=float))
    return out


@dataclass
class HFBundle:
    path: Path
    model: torch.nn.Module  # a transformers PreTrainedModel, in eval mode
    tokenizer: Any
    model_spec: dict[str, Any]
    metrics: dict[str, Any]

    @property
    def generation_config(self):
        return self.model.generation_config


def load_hf_bundle(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> HFBundle:
    """The bundle at `path`: the merged model in `dtype` on `device`, its tokenizer, spec and metrics."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(path)
    missing = [name for name in HF_FILES if not (root / name).is_file()]
    if not any(root.glob("*.safetensors")):
        missing.append("model.safetensors")
    if missing:
        raise BundleError(f"{root} is not a complete language-model bundle: missing {', '.join(missing)}")
    config = json.loads((root / "config.json").read_text())
    if config.get("auto_map"):
        raise BundleError(f"{root / 'config.json'} names code of its own (auto_map: {sorted(config['auto_map'])}); "
                          "serving loads only architectures installed with transformers")
    model = AutoModelForCausalLM.from_pretrained(root, dtype=dtype, local_files_only=True, trust_remote_code=False,
                                                 use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True, trust_remote_code=False)
    meta = json.loads((root / MODEL_JSON).read_text())
    return HFBundle(path=root, model=model.to(device).eval(), tokenizer=tokenizer, model_spec=meta.get("model", {}),
                    metrics=json.loads((root / METRICS_JSON).read_text()))
