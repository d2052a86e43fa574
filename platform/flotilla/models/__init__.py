"""Models: built-in `mlp` and `gpt`, or a user factory `package.module:function`.

    model = build_model(spec.model.model_dump(), schema)

The factory is called as `factory(model_spec: dict, schema: dict)` and must return a
`torch.nn.Module`; `schema` describes the data (task, feature count, classes, vocab).
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from flotilla.errors import ModelError
from flotilla.models._gpt import GPT, build_gpt, flops_per_token
from flotilla.models._mlp import MLP, build_mlp

__all__ = ["GPT", "MLP", "build_model", "flops_per_token", "load_factory"]

_BUILTIN = {"mlp": build_mlp, "gpt": build_gpt}


def build_model(model_spec: dict[str, Any], schema: dict[str, Any]) -> nn.Module:
    kind = model_spec["kind"]
    factory = _BUILTIN.get(kind) or load_factory(model_spec["factory"])
    try:
        model = factory(model_spec, schema)
    except ModelError:
        raise
    except Exception as e:
        where = model_spec.get("factory", kind)
        raise ModelError(f"model factory {where!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model factory {model_spec.get('factory', kind)!r} returned {type(model).__name__}, "
            "not a torch.nn.Module; return the model instance"
        )
    return model


def load_factory(path: str):
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ModelError(f"model.factory {path!r} must look like `package.module:function`")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelError(
            f"model.factory {path!r}: cannot import {module_name!r} ({e}); run from the directory "
            "that holds it (with `ray job submit`, pass `--working-dir .`)"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        available = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ModelError(
            f"model.factory {path!r}: {module_name!r} has no callable {attr!r}; it has: {', '.join(available) or 'nothing callable'}"
        )
    return factory
