"""A boolean is never a number in a spec.

YAML 1.1 (PyYAML: spec files and `--set` values) reads yes/no, on/off and true/false as booleans,
and pydantic takes `True` for an int or a float (as 1): `--set train.epochs=yes` would train one
epoch. `boolean_problems` finds every such value in a raw spec, the field named as `--set` writes
it; `validate_spec` reports them with pydantic's own problems.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel

BOOL_WORDS = "yes/no, on/off, true/false"


def boolean_problems(raw: Any, model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per boolean in `raw` where `model` wants a number (recursing into sections)."""
    if not isinstance(raw, dict):
        return []
    problems = []
    for key, value in raw.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue  # an unknown key: pydantic says so
        where = f"{prefix}{key}"
        if _bool_for_number(field.annotation, value):
            problems.append(f"`{where}`: a number is needed, not a boolean (YAML reads {BOOL_WORDS} as booleans; "
                            f"got {value!r})")
            continue
        problems += _nested(field.annotation, value, where)
    return problems


def _nested(annotation: Any, value: Any, where: str) -> list[str]:
    """The problems inside a section, or inside a mapping of sections (`data.columns`)."""
    sections = [m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    if sections and isinstance(value, dict):
        kind = value.get("kind", "mlp")  # a discriminated union (`model`): the member its `kind` names
        chosen = next((s for s in sections if len(sections) == 1 or s.model_fields.get("kind") is not None
                       and s.model_fields["kind"].default == kind), None)
        return boolean_problems(value, chosen, f"{where}.") if chosen else []
    for member in _members(annotation):
        args = typing.get_args(member)
        if typing.get_origin(member) is dict and isinstance(value, dict) and len(args) == 2:
            inner = [s for s in _members(args[1]) if isinstance(s, type) and issubclass(s, BaseModel)]
            if inner:
                return [p for k, v in value.items() for p in boolean_problems(v, inner[0], f"{where}.{k}.")]
    return []


def _bool_for_number(annotation: Any, value: Any) -> bool:
    """Whether `value` is, or holds, a boolean where `annotation` wants a number and takes no boolean."""
    members = _members(annotation)
    if isinstance(value, bool):
        return any(_is_number(m) for m in members) and not any(_takes_bool(m) for m in members)
    for member in members:
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin in (list, tuple) and isinstance(value, (list, tuple)):
            fixed = origin is tuple and Ellipsis not in args and len(args) == len(value)
            items = args if fixed else [args[0] if args else Any] * len(value)
            if any(_bool_for_number(a, v) for a, v in zip(items, value)):
                return True
        if origin is dict and isinstance(value, dict) and len(args) == 2:
            if any(_bool_for_number(args[1], v) for v in value.values()):
                return True
    return False


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a type: Optional and Union flattened, Annotated unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _is_number(member: Any) -> bool:
    if typing.get_origin(member) is Literal:
        return any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in typing.get_args(member))
    return member in (int, float)


def _takes_bool(member: Any) -> bool:
    if typing.get_origin(member) is Literal:
        return any(isinstance(a, bool) for a in typing.get_args(member))
    return member is bool or member is Any or member is object
