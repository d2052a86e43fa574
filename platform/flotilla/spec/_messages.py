"""Pydantic's errors as lines a user can act on: the field as `--set` writes it, the value, the fix."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel


def describe(err: dict[str, Any], root: type[BaseModel]) -> str:
    """One line for one pydantic error: the field as `--set` writes it, the bad value, the fix."""
    path, model_cls = _resolve_loc(err["loc"], root)
    dotted = ".".join(path) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = sorted(model_cls.model_fields) if model_cls else []
        close = difflib.get_close_matches(path[-1], allowed, n=1, cutoff=0.5)
        hint = f"; did you mean `{'.'.join(path[:-1] + [close[0]])}`?" if close else ""
        return f"`{dotted}`: unknown key{hint or '.'} Allowed keys here: {', '.join(allowed)}"
    if kind == "union_tag_invalid":
        return f"`{dotted}.kind`: {err['input'].get('kind')!r} is not a model kind; allowed: mlp, gpt, custom"
    if kind == "union_tag_not_found":
        return f"`{dotted}.kind` is missing; allowed: mlp, gpt, custom"
    value = err.get("input")
    shown = "" if kind == "missing" or isinstance(value, dict) else f" (got {value!r})"
    msg = err["msg"].removeprefix("Value error, ")
    if not path and kind == "value_error":  # a cross-field rule: its message names the fields
        return msg
    return f"`{dotted}`: {msg}{shown}"


def _resolve_loc(loc: tuple, root: type[BaseModel]) -> tuple[list[str], type[BaseModel] | None]:
    """Turn a pydantic error location into the `--set` path and the model that owns its last key."""
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
    return path, owner


def _flatten(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Annotated:
        return _flatten(args[0])
    if args and typing.get_origin(annotation) in (Union, types.UnionType):
        return [m for a in args for m in _flatten(a)]
    return [annotation]


def divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), -d))  # ties: more heads
