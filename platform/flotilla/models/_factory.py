"""Building a model from the spec: the built-in kinds, or a user factory `package.module:function`.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from torch import nn

from flotilla.errors import ModelError
from flotilla.models._gpt import build_gpt
from flotilla.models._hf import build_hf_causal_lm
from flotilla.models._mlp import build_mlp


_BUILTIN = {"mlp": build_mlp, "gpt": build_gpt, "hf_causal_lm": build_hf_causal_lm}


def build_model(model_spec: dict[str, Any], schema) -> nn.Module:
    """The model `model_spec` describes, for data described by `schema` (a `DataSchema`, or its dict)."""
    if hasattr(schema, "as_dict"):
        schema = schema.as_dict()  # factories take plain dicts: their documented interface
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


def _import_from_here(module_name: str):
    """`module_name`, also from the working directory: `python -m` and `ray job submit --working-dir`
    put it on the path, the `flotilla` command (an installed script) does not."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module_name.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # after the installed packages: a local file never shadows one
        return importlib.import_module(module_name)


def load_factory(path: str):
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ModelError(f"model.factory {path!r} must look like `package.module:function`")
    try:
        module = _import_from_here(module_name)
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
