"""A spec with a sweep trial's values applied."""

from __future__ import annotations

from typing import Any

from flotilla.spec._load import validate_spec
from flotilla.spec._paths import set_path
from flotilla.spec._sections import RunSpec


def trial_spec(base: RunSpec, values: dict[str, Any], **fixed: Any) -> RunSpec:
    """The base spec with a trial's sampled values (dotted paths) and `fixed` overrides applied."""
    raw = base.model_dump(mode="json", exclude={"tune"})
    for path, value in {**values, **fixed}.items():
        set_path(raw, path, value)
    return validate_spec(raw, "trial spec")
