"""The inference bundle of a fine-tuned Hugging Face causal LM (`model.kind: hf_causal_lm`).

Two forms. A whole model, which `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load as it is, offline (full and frozen-layer fine-tunes, and
LoRA with `model.lora.merge: true`):
    model.safetensors          the weights, LoRA merged into the base (sharded with an index
                               past `max_shard_size`, as transformers does)
    config.json, generation_config.json
    tokenizer.json, tokenizer_config.json, chat_template.jinja (whichever the tokenizer has)
    adapter/                   LoRA only: the adapter alone as well
    model.json, metrics.json   the model spec and data schema; final metrics and history
Or, for LoRA by default, the adapter and a pinned reference to its base, megabytes instead of the
base's gigabytes (`model.json`'s `base`: the base's directory, and the SHA-256 of its weights and
config, checked when it loads):
    adapter/                   adapter_model.safetensors, adapter_config.json (peft's own files)
    generation_config.json, the tokenizer's files, model.json, metrics.json

Nothing is pickled: weights are safetensors, the rest JSON or text. Loading runs no code from
the bundle (`trust_remote_code` is never passed): a model whose config asks for its own code is
refused.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from flotilla.bundle._onnx import ONNX_FILE, VARIANTS_DIR, OnnxCausalLM, choose_runtime, read_variants
from flotilla.bundle._sampling import logit_bias_tensors, sample_next
from flotilla.bundle._torch import GENERATE_DEFAULTS
from flotilla.data import DataSchema
from flotilla.errors import BundleError

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = f"{ADAPTER_DIR}/adapter_model.safetensors"
MODEL_JSON, METRICS_JSON = "model.json", "metrics.json"
HF_FILES = ("config.json", "generation_config.json", MODEL_JSON, METRICS_JSON)
ADAPTER_FILES = ("generation_config.json", MODEL_JSON, METRICS_JSON, f"{ADAPTER_DIR}/adapter_config.json", ADAPTER_WEIGHTS)


def write_hf_bundle(directory: str | Path, model, model_spec: dict[str, Any], schema: dict[str, Any] | None = None,
                    metrics: dict[str, Any] | None = None, max_shard_size: str = "5GB") -> Path:
    """Write `model` (an `HFCausalLM` holding the consolidated weights, on one process) as a bundle.

    For LoRA the model is consumed: its adapters are saved, then merged into its base weights in
    place. Build it from the consolidated state dict on rank 0 (as the loop's bundle check does)."""
    # Function-local: they import transformers and peft, which loading a torch bundle never needs.
    from flotilla.data._instruct import load_tokenizer
    from flotilla.models._hf import merge_into_base

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"model": model_spec, "schema": schema}
    if model.is_adapter:
        model.hf.save_pretrained(out / ADAPTER_DIR)  # safetensors is peft's default
    # Prompt tuning has nothing to merge: its virtual tokens go before every input.
    adapter_only = model.is_adapter and not (model.is_lora and (model_spec.get("lora") or {}).get("merge", False))
    if adapter_only:
        meta["base"] = pin_base(model_spec)
        merged = model.base
    else:
        merged = merge_into_base(model)
    tokenizer = load_tokenizer(model_spec["pretrained"], model_spec.get("revision"),
                               bool(model_spec.get("trust_remote_code")))
    generation = merged.generation_config
    # Generation stops at the tokenizer's eos (a chat template's end of turn) and pads with its pad token.
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if adapter_only:
        generation.save_pretrained(out)
    else:
        # (transformers 5 writes safetensors only; 4.x took `safe_serialization=True` for the same.)
        merged.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    (out / MODEL_JSON).write_text(json.dumps(meta, indent=1))
    (out / METRICS_JSON).write_text(json.dumps(metrics or {}, indent=1, default=float))
    return out


@dataclass
class HFBundle:
    """A fine-tuned pretrained language model, loaded: what the registry, the gate and MLflow's pyfunc
    use, as they use `flotilla.bundle.InferenceBundle` (task `lm`: `predict_frame`, `generate`)."""

    path: Path
    model: torch.nn.Module  # a transformers PreTrainedModel, in eval mode (or an `OnnxCausalLM`: its ONNX variant)
    tokenizer: Any
    model_spec: dict[str, Any]
    metrics: dict[str, Any]
    schema: Any = None  # flotilla.data.DataSchema (task `lm`, its token windows)
    adapter: str | None = None  # on a shared base (`AdapterSet`): the adapter this bundle generates with
    prefix: torch.Tensor | None = None  # prompt tuning: the virtual tokens' embeddings, before every input
    lock: Any = None  # on a shared base: held around each forward pass (peft's per-batch adapter hooks)
    runtime: str = "torch"  # or the ONNX variant that runs the model (`with_runtime`)

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def task(self) -> str:
        return "lm"

    @property
    def device(self) -> torch.device:
        device = getattr(self.model, "device", None)
        return torch.device(device) if device is not None else next(self.model.parameters()).device

    @property
    def logit_count(self) -> int:
        """Logits per position: the model's vocabulary (which may exceed the tokenizer's)."""
        out = self.model.get_output_embeddings()
        return out.weight.shape[0] if out is not None else self.model.config.vocab_size

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt or a `logit_bias` may name: the tokenizer's that the model has logits for."""
        return min(len(self.tokenizer), self.logit_count)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence (prompt and generated text) the model was built for, when its config says
        (less prompt tuning's virtual tokens, which come first)."""
        most = getattr(self.model.config, "max_position_embeddings", None)
        return most - len(self.prefix) if most is not None and self.prefix is not None else most

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits for each position of `input_ids` (after prompt tuning's virtual tokens)."""
        if self.prefix is None:
            return self.model(input_ids=input_ids).logits
        return self.model(inputs_embeds=self._prefixed(input_ids)).logits[:, len(self.prefix):]

    def _prefixed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of prompt tuning's virtual tokens, then of `input_ids`, for each row."""
        return torch.cat([self.prefix.expand(input_ids.shape[0], -1, -1).to(self.device),
                          self.model.get_input_embeddings()(input_ids)], dim=1)

    def _first(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None, adapters=None):
        """The first forward pass of a generation: the prompt, after prompt tuning's virtual tokens
        (they take the first positions of every row, the left padding after them is masked); and the
        attention mask to extend from then on."""
        if self.prefix is None:
            extra = {} if attention_mask is None else {"attention_mask": attention_mask, "position_ids": position_ids}
            return self._forward(adapters, input_ids=input_ids, use_cache=True, **extra), attention_mask
        n = len(self.prefix)
        mask = torch.ones(input_ids.shape[0], n + input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        if attention_mask is not None:
            mask[:, n:] = attention_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return self._forward(adapters, inputs_embeds=self._prefixed(input_ids), attention_mask=mask,
                             position_ids=positions, use_cache=True), mask

    def to(self, device: str | torch.device) -> "HFBundle":
        self.model.to(device)
        return self

    def with_runtime(self, runtime: str, check: bool = True) -> "HFBundle":
        """This bundle with its model run by `runtime`: `torch` (itself), an ONNX variant `flotilla
        export` built (`onnx`, `onnx-int8`, `onnx-int4`), or `auto` (the fastest that passed its gate).
        A variant that is missing or failed its gate is refused unless `check` is off (the gate itself
        runs it). The torch model is let go: a 4-bit replica holds only its 4-bit weights."""
        name = choose_runtime(read_variants(self.path), runtime, str(self.path)) if check else runtime
        if name == self.runtime:
            return self
        if name == "torch":
            raise BundleError("this bundle runs an ONNX variant; load the bundle again for its torch model")
        if self.prefix is not None or self.lock is not None:
            raise BundleError(f"serve.runtime {name!r}: prompt tuning and adapters on one base run in torch; "
                              "`--set serve.runtime=torch`")
        model = OnnxCausalLM(Path(self.path) / VARIANTS_DIR / name / ONNX_FILE, self.model.config,
                             self.model.generation_config)
        return replace(self, model=model, runtime=name)

    def stop_ids(self) -> set[int]:
        """Tokens that end a generation: the generation config's eos (one or a list) and the tokenizer's."""
        eos = self.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt token ids: a plain prompt as the tokenizer encodes it (as training encoded `plain`
        prompts), or a user turn rendered with the chat template and the assistant's turn opened."""
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def _forward(self, adapters: list[str | None] | None = None, **inputs):
        """One forward pass; on a shared base each row with its own adapter (peft's mixed batches:
        `adapter_names`, `__base__` for none), one pass at a time."""
        if self.lock is None:
            return self.model(**inputs)
        rows = (inputs["input_ids"] if "input_ids" in inputs else inputs["inputs_embeds"]).shape[0]
        names = [a or "__base__" for a in adapters or [self.adapter] * rows]
        with self.lock:
            return self.model(**inputs, adapter_names=names)

    @torch.inference_mode()
    def generate_ids(self, ids: list[int], max_tokens: int = 64, temperature: float = 1.0, top_k: int | None = None,
                     seed: int | None = None, top_p: float = 1.0,
                     logit_bias: dict[int, float] | None = None, ended_by: list[int] | None = None) -> Iterator[int]:
        """Yield sampled token ids after `ids` (keys and values cached: one token's forward per step),
        until an end-of-text token (not yielded; appended to `ended_by` when given) or `max_tokens`.
        `top_p` < 1 samples from the smallest set of tokens whose probabilities add up to it (nucleus
        sampling); `logit_bias` (token id -> bias) is added to the logits first, as OpenAI's parameter
        of that name is (-100 bans a token)."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        stops, device, bias = self.stop_ids(), self.device, logit_bias_tensors(logit_bias)
        out, _ = self._first(torch.tensor([ids], device=device))
        for _ in range(max_tokens):
            token = sample_next(out.logits[0, -1].float().cpu(), temperature, top_k, top_p, generator, bias)
            if token in stops:
                if ended_by is not None:
                    ended_by.append(token)
                return
            yield token
            out = self._forward(input_ids=torch.tensor([[token]], device=device), cache=out.cache, use_cache=True)

    @torch.inference_mode()
    def generate_ids_batch(self, prompts: list[list[int]], settings: list[dict[str, Any]],
                           ended: list[Any] | None = None, on_token: Callable[[int, int], bool] | None = None,
                           on_end: Callable[[int], None] | None = None,
                           on_error: Callable[[int, Exception], None] | None = None,
                           ended_by: list[int | None] | None = None) -> list[list[int]]:
        """Several prompts decoded together, one forward pass per token for all of them: each row
        the token ids `generate_ids(prompt, **its settings)` yields alone (`max_tokens`,
        `temperature`, `top_p`, `seed`, `logit_bias`; on a shared base, `adapter`: each row's own,
        in one pass). The prompts are left-padded, masked, and
        each row's positions start at its first real token. A row ends at an end-of-text token,
        after its `max_tokens`, once its event in `ended` (a `threading.Event`) is set, or after a
        token for which `on_token(row, token)` answers true (a stop string has appeared); then
        `on_end(row)` is called, once. When every row has ended, no more forward passes run.
        A row whose own settings fail (its seed, its sampling) ends alone: `on_error(row, error)`
        is told (without one, the first such error is raised once the other rows are done).
        `ended_by[row]` is set to the end-of-text token that ended a row, where one did."""
        device, stops = self.device, self.stop_ids()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        longest = max(map(len, prompts))
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        tokens = torch.tensor([[pad] * (longest - len(p)) + list(p) for p in prompts], device=device)
        out_ids: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        errors: list[Exception] = []

        def end(row: int) -> None:
            if not done[row]:
                done[row] = True
                if on_end is not None:
                    on_end(row)

        def fail(row: int, error: Exception) -> None:
            if on_error is None:
                errors.append(error)
            else:
                on_error(row, error)
            end(row)

        def sampler(row: int, s: dict[str, Any]):
            try:
                return (torch.Generator().manual_seed(s["seed"]) if s.get("seed") is not None else None,
                        logit_bias_tensors(s.get("logit_bias")))
            except Exception as e:  # a seed torch cannot take, a bias it cannot hold: this row's own
                fail(row, e)
                return None, None

        generators, biases = zip(*(sampler(i, s) for i, s in enumerate(settings)))

        adapters = [s.get("adapter") or self.adapter for s in settings] if self.lock is not None else None
        out, mask = self._first(tokens, mask, positions, adapters)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        for step in range(max(int(s["max_tokens"]) for s in settings)):
            logits = out.logits[:, -1].float().cpu()
            for i, s in enumerate(settings):
                if done[i] or step >= int(s["max_tokens"]) or (ended is not None and ended[i].is_set()):
                    end(i)
                    continue
                try:
                    token = sample_next(logits[i], float(s.get("temperature", 1.0)), None,
                                        float(s.get("top_p", 1.0)), generators[i], biases[i])
                except Exception as e:  # this row's sampling (its temperature, bias): the others go on
                    fail(i, e)
                    continue
                if token in stops:
                    if ended_by is not None:
                        ended_by[i] = token
                    end(i)
                    continue
                out_ids[i].append(token)
                if (on_token is not None and on_token(i, token)) or len(out_ids[i]) >= int(s["max_tokens"]):
                    end(i)
            if all(done):
                break
            # A row that has ended repeats its last token; its logits go unread.
            last = torch.tensor([[ids[-1] if ids else pad] for ids in out_ids], device=device)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self._forward(adapters, input_ids=last, attention_mask=mask, position_ids=positions, cache=out.cache,
                                use_cache=True)
        for row in range(len(prompts)):  # (rows that asked for no tokens at all)
            end(row)
        if errors:
            raise errors[0]
        return out_ids

    @torch.inference_mode()
    def score(self, ids: list[int], top: int = 0) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
        """The log-probability of each token of `ids` after the tokens before it (len(ids) - 1 of them:
        the first has none), under the model's own distribution (no temperature, no bias), in one
        forward pass; and with `top` > 0, at each of those positions the `top` likeliest tokens and
        their log-probabilities. What OpenAI's `logprobs` and `echo` report."""
        inputs = torch.tensor([ids], device=self.device)
        if self.prefix is None:
            logits = self._forward(input_ids=inputs).logits[0]
        else:
            logits = self._forward(inputs_embeds=self._prefixed(inputs)).logits[0, len(self.prefix):]
        targets = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
        chosen: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        for start in range(0, len(ids) - 1, 256):  # (positions x vocabulary in fp32, a slice at a time)
            logp = logits[start:min(start + 256, len(ids) - 1)].float().log_softmax(-1)
            chosen += logp.gather(1, targets[start:start + len(logp), None])[:, 0].tolist()
            if top:
                best = logp[:, :self.vocab_size].topk(min(top, self.vocab_size), dim=-1)
                tops += [list(zip(i.tolist(), v.tolist())) for v, i in zip(best.values.cpu(), best.indices.cpu())]
        return chosen, (tops if top else None)

    def generate_stream(self, prompt: str, max_tokens: int = 64, temperature: float = 1.0, top_k: int | None = None,
                        seed: int | None = None, chat: bool = False) -> Iterator[str]:
        """Yield the text as it is generated; a piece never ends inside a character (a byte-level
        token can hold part of one: the decoded text then ends in U+FFFD until the rest arrives)."""
        yield from self.text_pieces(self.generate_ids(self.encode(prompt, chat), max_tokens, temperature, top_k, seed))

    def text_pieces(self, tokens: Iterator[int]) -> Iterator[str]:
        """The text of `tokens` as it grows, in pieces that never end inside a character."""
        text = TextDecoder(self.tokenizer)
        for token in tokens:
            piece = text.add(token)
            if piece:
                yield piece
        if rest := text.rest():
            yield rest

    def generate(self, prompt: str, **kwargs) -> str:
        return "".join(self.generate_stream(prompt, **kwargs))

    def predict_frame(self, frame, params: dict[str, Any] | None = None):
        """MLflow's pyfunc contract, as for `gpt` bundles: a `prompt` column in, `text` out; `params`
        max_tokens, temperature, top_k (0: off), seed (-1: random)."""
        import pandas as pd


        if "prompt" not in frame.columns:
            raise BundleError(f"a language-model bundle needs a `prompt` column; got {', '.join(map(str, frame.columns))}")
        p = {**GENERATE_DEFAULTS, **(params or {})}
        settings = dict(max_tokens=int(p["max_tokens"]), temperature=float(p["temperature"]),
                        top_k=int(p["top_k"]) or None, seed=None if int(p["seed"]) < 0 else int(p["seed"]))
        return pd.DataFrame({"text": [self.generate(str(x), **settings) for x in frame["prompt"]]})


class TextDecoder:
    """The text of a growing token sequence, a piece per token, as the tokenizer decodes the whole
    sequence. Each step decodes the few tokens since the last piece, with those of the piece before
    for context (a tokenizer may write a token's leading space only after another token), so a
    token costs the same at the end of a long text as at its start; a byte-level token can hold
    part of a character: its piece waits until the character is complete (the text then no longer
    ends in U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens = tokenizer, []
        self.start = self.done = 0  # tokens[start:done] were decoded as the last piece's context

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """The text `token` completes ("" while a character is incomplete)."""
        self.tokens.append(token)
        return self._piece(final=False)

    def rest(self) -> str:
        """What is held back at the end (an incomplete character, as U+FFFD)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        context = self._decode(self.tokens[self.start:self.done])
        text = self._decode(self.tokens[self.start:])
        if len(text) <= len(context) or (text.endswith("\ufffd") and not final):
            return ""
        self.start, self.done = self.done, len(self.tokens)
        return text[len(context):]


# ------------------------------------------------------------------ the base of an adapter
def base_sha256(directory: str | Path) -> str:
    """The SHA-256 that pins a pretrained model's directory: of its config.json and each weights
    file (`*.safetensors`, by name), which is what an adapter was trained on top of. Each file is
    read once per process while its size and modification time stay the same (a base of gigabytes
    is checked at every load of an adapter on it)."""
    import hashlib

    root = Path(directory)
    files = sorted(root.glob("*.safetensors")) + [root / "config.json"]
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        digest.update(f"{f.name}:{_file_sha256(str(f.resolve()), stat.st_size, stat.st_mtime_ns)}\n".encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    from flotilla.bundle._torch import file_sha256

    return file_sha256(path)


def base_directory(model_spec: dict[str, Any]) -> Path | None:
    """Where `model.pretrained` is on this machine: a local directory, a built-in model's (built
    here if it is not yet), or a hub model's snapshot in this machine's cache; None if nowhere."""
    from flotilla.models._hf_tiny import resolve_pretrained

    source = str(model_spec.get("pretrained") or "")
    local = Path(os.path.expanduser(resolve_pretrained(source))) if source else None
    if local is not None and (local / "config.json").is_file():
        return local.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, revision=model_spec.get("revision"), local_files_only=True))
    except Exception:  # not a hub id, or not in this machine's cache
        return None


def pin_base(model_spec: dict[str, Any]) -> dict[str, Any]:
    """What an adapter bundle records of its base: the spec's name for it, where it was, its hash."""
    where = base_directory(model_spec)
    if where is None:
        raise BundleError(f"model.pretrained {model_spec.get('pretrained')!r} is not on this machine, so the adapter "
                          "cannot be pinned to it; `--set model.lora.merge=true` writes a whole model instead")
    return {"pretrained": model_spec.get("pretrained"), "revision": model_spec.get("revision"), "path": str(where),
            "sha256": base_sha256(where)}


def find_base(root: Path, base: dict[str, Any]) -> Path:
    """The base an adapter bundle names, as it was when the adapter was trained: its recorded
    directory, else where `pretrained` is on this machine; refused unless the hash matches."""
    seen = []
    for where in (Path(base["path"]), base_directory(base)):
        if where is None or where in [w for w, _ in seen] or not (where / "config.json").is_file():
            continue
        digest = base_sha256(where)
        if digest == base["sha256"]:
            return where
        seen.append((where, digest))
    found = "; ".join(f"{w} has SHA-256 {d[:12]}" for w, d in seen) or "it is not on this machine"
    raise BundleError(
        f"{root} is a LoRA adapter for the base model {base['pretrained']!r} at {base['path']} (SHA-256 "
        f"{base['sha256'][:12]}), which must be loaded with it: {found}. Put that model at {base['path']} on every "
        "node that loads this version (storage every node sees), or train with `--set model.lora.merge=true` to "
        "register a whole model")


def lineage_tags(path: str | Path) -> dict[str, str]:
    """What a registered version says of its form: the bundle's bytes, and for an adapter its base
    (`flotilla.base`, `flotilla.base_sha256`) and the adapter's own bytes."""
    root = Path(path)
    tags = {"flotilla.bundle_bytes": str(sum(f.stat().st_size for f in root.rglob("*") if f.is_file()))}
    if is_adapter_bundle(root):
        base = json.loads((root / MODEL_JSON).read_text())["base"]
        tags.update({"flotilla.form": "adapter", "flotilla.adapter": "prompt" if is_prompt_tuning(root) else "lora",
                     "flotilla.base": f"{base['pretrained']} ({base['path']})",
                     "flotilla.base_sha256": base["sha256"],
                     "flotilla.adapter_bytes": str(sum(f.stat().st_size for f in (root / ADAPTER_DIR).rglob("*")
                                                      if f.is_file()))})
    return tags


def is_adapter_bundle(path: str | Path) -> bool:
    """Whether the bundle at `path` holds a LoRA adapter and a reference to its base (no base weights)."""
    try:
        return "base" in json.loads((Path(path) / MODEL_JSON).read_text())
    except (OSError, ValueError):
        return False


class AdapterSet:
    """One base model on one device and the LoRA adapters loaded onto it (unmerged), each served as
    an `HFBundle` of its own that shares the base's weights: requests for different adapters decode
    together in one forward pass per token, each row through its own adapter (peft's mixed-adapter
    batches). Adapters are added and dropped while others generate; forward passes and changes take
    turns on one lock (peft applies a batch's adapters through hooks on the shared layers)."""

    def __init__(self, first: str | Path, name: str, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        import threading

        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        root = Path(first)
        meta = self._adapter_meta(root)
        self.base = meta["base"]
        where = find_base(root, self.base)
        _refuse_own_code(where)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, local_files_only=True,
                                                     trust_remote_code=False, use_safetensors=True).to(device)
        self.model = PeftModel.from_pretrained(model, root / ADAPTER_DIR, adapter_name=name, is_trainable=False).eval()
        self.lock = threading.RLock()  # the model's: each forward pass, each adapter loaded or deleted
        self._books = threading.Lock()  # what is held and leaving: short, never around a forward pass
        self.names = {name}
        self._in_use: dict[str, int] = {}
        self._dropping: set[str] = set()
        self.first = self._view(root, name, meta)

    @staticmethod
    def _adapter_meta(root: Path) -> dict[str, Any]:
        if is_prompt_tuning(root):
            raise BundleError(f"{root} is prompt tuning's virtual tokens, which a replica serves one version at a time; "
                              "adapters on one base (`serve.adapters.max_per_replica`) are LoRA adapters")
        if not is_adapter_bundle(root):
            raise BundleError(f"{root} holds a whole model, not a LoRA adapter on a pinned base; a replica that serves "
                              "adapters on one base (`serve.adapters.max_per_replica`) loads adapter versions only "
                              "(trained with `model.lora.merge: false`, the default)")
        missing = [name for name in ADAPTER_FILES if not (root / name).is_file()]
        if missing:
            raise BundleError(f"{root} is not a complete adapter bundle: missing {', '.join(missing)}")
        return json.loads((root / MODEL_JSON).read_text())

    def _view(self, root: Path, name: str, meta: dict[str, Any]) -> HFBundle:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True, trust_remote_code=False)
        schema = DataSchema.model_validate(meta["schema"]) if meta.get("schema") else None
        return HFBundle(path=root, model=self.model, tokenizer=tokenizer, model_spec=meta.get("model", {}),
                        metrics=json.loads((root / METRICS_JSON).read_text()), schema=schema, adapter=name,
                        lock=self.lock)

    def add(self, path: str | Path, name: str) -> HFBundle:
        """The adapter bundle at `path` loaded onto the base as `name` (its files are read now)."""
        root = Path(path)
        meta = self._adapter_meta(root)
        if meta["base"]["sha256"] != self.base["sha256"]:
            raise BundleError(f"{root} is an adapter for the base {meta['base']['pretrained']!r} (SHA-256 "
                              f"{meta['base']['sha256'][:12]}); this replica holds {self.base['pretrained']!r} "
                              f"(SHA-256 {self.base['sha256'][:12]})")
        with self.lock:
            self.model.load_adapter(root / ADAPTER_DIR, adapter_name=name, is_trainable=False)
        with self._books:
            self.names.add(name)
        return self._view(root, name, meta)

    def hold(self, name: str) -> bool:
        """Keep adapter `name` loaded until as many `release`s (a request that generates with it);
        False when it is gone or leaving (evicted meanwhile: load it again). Never waits for a
        forward pass (callers are on an event loop)."""
        with self._books:
            if name not in self.names or name in self._dropping:
                return False
            self._in_use[name] = self._in_use.get(name, 0) + 1
            return True

    def release(self, name: str) -> None:
        with self._books:
            self._in_use[name] -= 1
            if not self._in_use[name]:
                del self._in_use[name]
        self._delete_unused()

    def drop(self, name: str) -> None:
        """Unload adapter `name`: at once, or when the last request holding it lets go."""
        with self._books:
            self._dropping.add(name)
        self._delete_unused()

    def _delete_unused(self) -> None:
        """Delete the leaving adapters no one holds, in a thread of its own: deleting waits for the
        forward pass in progress (peft keeps at least one adapter on the model)."""
        with self._books:
            ready = [n for n in self._dropping if n not in self._in_use and n in self.names]
            ready = ready[: max(0, len(self.names) - 1)]
            for n in ready:
                self._dropping.discard(n)
                self.names.discard(n)
        if ready:
            import threading

            def delete() -> None:
                with self.lock:
                    for n in ready:
                        self.model.delete_adapter(n)

            threading.Thread(target=delete, name="flotilla-adapter-drop", daemon=True).start()

    def adapter_bytes(self) -> int:
        """Bytes of the adapters' weights held now."""
        return sum(p.numel() * p.element_size() for n, p in self.model.named_parameters() if "lora_" in n)


def _refuse_own_code(weights: Path) -> None:
    config = json.loads((weights / "config.json").read_text())
    if config.get("auto_map"):
        raise BundleError(f"{weights / 'config.json'} names code of its own (auto_map: {sorted(config['auto_map'])}); "
                          "serving loads only architectures installed with transformers")


def load_hf_bundle(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> HFBundle:
    """The bundle at `path`: the model in `dtype` on `device` (an adapter merged into its base, which
    is found and checked against its hash), its tokenizer, spec and metrics."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(path)
    adapter = is_adapter_bundle(root)
    missing = [name for name in (ADAPTER_FILES if adapter else HF_FILES) if not (root / name).is_file()]
    if not adapter and not any(root.glob("*.safetensors")):
        missing.append("model.safetensors")
    if missing:
        raise BundleError(f"{root} is not a complete language-model bundle: missing {', '.join(missing)}")
    meta = json.loads((root / MODEL_JSON).read_text())
    weights = find_base(root, meta["base"]) if adapter else root
    _refuse_own_code(weights)
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype, local_files_only=True, trust_remote_code=False,
                                                 use_safetensors=True)
    prefix = None
    if adapter:
        from peft import PeftModel

        peft = PeftModel.from_pretrained(model, root / ADAPTER_DIR, is_trainable=False)
        if is_prompt_tuning(root):  # the virtual tokens' embeddings, before every input (`HFBundle.prefix`)
            with torch.no_grad():
                prefix = peft.get_prompt(batch_size=1)[0].detach().to(dtype).to(device)
            model = peft.get_base_model()
        else:
            model = peft.merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True, trust_remote_code=False)
    schema = DataSchema.model_validate(meta["schema"]) if meta.get("schema") else None
    return HFBundle(path=root, model=model.to(device).eval(), tokenizer=tokenizer, model_spec=meta.get("model", {}),
                    metrics=json.loads((root / METRICS_JSON).read_text()), schema=schema, prefix=prefix)


def is_prompt_tuning(path: str | Path) -> bool:
    """Whether the adapter in the bundle at `path` is prompt tuning's virtual tokens (not LoRA)."""
    try:
        config = json.loads((Path(path) / ADAPTER_DIR / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("peft_type") == "PROMPT_TUNING"


def is_hf_bundle(path: str | Path) -> bool:
    """Whether the bundle at `path` holds a pretrained model (`hf_causal_lm`), read from its model.json."""
    try:
        meta = json.loads((Path(path) / MODEL_JSON).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta.get("model"), dict) and meta["model"].get("kind") == "hf_causal_lm"


def weights_file(path: str | Path) -> Path:
    """The file whose hash names the weights: model.safetensors, or the index of its shards; an
    adapter bundle's adapter."""
    root = Path(path)
    if is_adapter_bundle(root):
        return root / ADAPTER_WEIGHTS
    single = root / "model.safetensors"
    return single if single.is_file() else root / "model.safetensors.index.json"
