"""Pydantic's errors as lines a user can act on: the field as `--set` writes it, the value, the fix."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel


# Names people write for a field, from other tools (Hugging Face, Lightning, ...): `learning_rate` is `lr`.
# A suggestion is made only where the field exists; other typos go to difflib.
SYNONYMS = {
    "learning_rate": "lr", "lr_rate": "lr", "num_epochs": "epochs", "max_epochs": "epochs", "n_epochs": "epochs",
    "workers": "num_workers", "num_gpus": "gpus_per_worker", "gpus": "gpus_per_worker", "cpus": "cpus_per_worker",
    "gradient_accumulation_steps": "grad_accum", "max_grad_norm": "grad_clip", "gradient_clipping": "grad_clip",
    "hidden_sizes": "hidden", "hidden_layers": "hidden", "n_layers": "layers", "num_layers": "layers",
    "n_heads": "heads", "num_heads": "heads", "num_attention_heads": "heads", "d_model": "width",
    "hidden_size": "width", "block_size": "context", "context_length": "context", "seq_len": "context",
    "max_seq_length": "context", "warmup_ratio": "warmup_fraction", "warmup": "warmup_fraction",
    "model_name_or_path": "pretrained", "base_model": "pretrained", "lora_r": "rank", "r": "rank",
    "lora_alpha": "alpha", "lora_dropout": "dropout", "n_trials": "num_samples", "trials": "num_samples",
    "samples": "num_samples", "micro_batch_size": "batch_size", "per_device_train_batch_size": "batch_size",
}


def describe(err: dict[str, Any], root: type[BaseModel]) -> str:
    """One line for one pydantic error: the field as `--set` writes it, the bad value, the fix.
    (A rule that found several problems gives one line each.)"""
    path, model_cls, union = _resolve_loc(err["loc"], root)
    dotted = ".".join(path) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = sorted(model_cls.model_fields) if model_cls else []
        close = [SYNONYMS[path[-1]]] if SYNONYMS.get(path[-1]) in allowed else \
            difflib.get_close_matches(path[-1], allowed, n=1, cutoff=0.5)
        hint = f"; did you mean `{'.'.join(path[:-1] + [close[0]])}`?" if close else ""
        return f"`{dotted}`: unknown key{hint or '.'} Allowed keys here: {', '.join(allowed)}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        kinds = ", ".join(m.model_fields["kind"].default for m in union or [] if "kind" in m.model_fields)
        if kind == "union_tag_not_found":
            return f"`{dotted}.kind` is missing; allowed: {kinds}"
        return f"`{dotted}.kind`: {err['input'].get('kind')!r} is not a model kind; allowed: {kinds}"
    value = err.get("input")
    shown = "" if kind == "missing" or isinstance(value, dict) else f" (got {value!r})"
    if isinstance(value, bool) and kind in ("string_type", "literal_error"):
        shown += "; YAML reads yes/no, on/off, true/false as booleans: quote such a word to keep it a string"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error" and (not path or "\n" in msg):  # a rule's problems, each naming its fields
        return "\n".join(line if not path or line.startswith("`") else f"`{dotted}`: {line}" for line in msg.splitlines())
    return f"`{dotted}`: {msg}{shown}"


def _resolve_loc(loc: tuple, root: type[BaseModel]) -> tuple[list[str], type[BaseModel] | None, list | None]:
    """Turn a pydantic error location into the `--set` path, the model that owns its last key, and
    the members of the union it ends on (the model kinds, for `model`)."""
    path: list[str] = []
    cls: Any = root
    owner: type[BaseModel] | None = root
    pending_union: list[type[BaseModel]] | None = None
    for part in loc:
        if pending_union is not None:
            chosen = next((m for m in pending_union if m.model_fields["kind"].default == part), None)
            pending_union = None
            if chosen is not None:  # a discriminator tag, not a key
                cls = owner = chosen
                continue
        path.append(str(part))
        if isinstance(cls, type) and issubclass(cls, BaseModel) and part in cls.model_fields:
            owner = cls
            annotation = cls.model_fields[part].annotation
            members = [a for a in _flatten(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(members) > 1:
                pending_union, cls = members, None
            elif members:
                cls = members[0]
            else:
                cls = None
        elif isinstance(cls, type) and issubclass(cls, BaseModel):
            owner = cls
            cls = None
    return path, owner, pending_union


def _flatten(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Annotated:
        return _flatten(args[0])
    if args and typing.get_origin(annotation) in (Union, types.UnionType):
        return [m for a in args for m in _flatten(a)]
    return [annotation]


def divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), -d))  # ties: more heads
