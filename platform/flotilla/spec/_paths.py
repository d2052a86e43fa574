"""Dotted paths into a raw (YAML) spec: `train.lr` is `raw["train"]["lr"]`."""

from __future__ import annotations

from typing import Any


def set_path(raw: dict[str, Any], dotted: str | list[str], value: Any, what: str = "") -> None:
    """Set `raw["a"]["b"]["c"] = value` for `a.b.c` (or the keys `["a", "b", "c"]`), creating sections as needed."""
    node = raw
    parts = dotted.split(".") if isinstance(dotted, str) else dotted
    dotted = ".".join(parts)
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{what or dotted}: `{part}` is a value, not a section")
        node = child
    node[parts[-1]] = value

