"""Loading a spec: YAML, `--set a.b=c` overrides (the value parsed as YAML), validation.

    spec = load_spec("configs/digits.yaml", overrides=["train.lr=3e-4", "model.hidden=[256,128]"])

Validation happens here, before Ray starts, and reports every problem at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flotilla.errors import SpecError
from flotilla.redact import redact
from flotilla.spec._messages import describe
from flotilla.spec._numbers import boolean_problems
from flotilla.spec._paths import set_path
from flotilla.spec._sections import RunSpec
from flotilla.spec._tune import SPACE_KINDS

SPACE_PREFIX = "tune.space."


def load_spec(path: str | Path | None = None, overrides: list[str] | None = None) -> RunSpec:
    """Load a YAML run spec, apply `a.b=c` overrides, validate, and return it.

    Raises `SpecError` listing every problem at once.
    """
    source = str(path) if path else "built-in default spec"
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise SpecError([f"config file {str(p)!r} does not exist; specs there: {_nearby_specs(p)}"], source)
        try:
            raw = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise SpecError([f"not valid YAML: {e}"], source) from None
        if raw is None or raw == {}:  # not a spec: running the built-in defaults instead would surprise
            raise SpecError([f"the file is empty; a run spec names at least its data and model: start from one "
                             f"in configs/, e.g. configs/digits.yaml ({shipped_specs()})"], source)
        if not isinstance(raw, dict):
            raise SpecError([f"the top level must be a mapping of sections, got {type(raw).__name__}"], source)
    problems = []
    for item in overrides or []:
        try:
            apply_override(raw, item)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise SpecError(problems, source)
    return validate_spec(raw, source)


def validate_spec(raw: dict[str, Any], source: str = "run spec") -> RunSpec:
    problems = boolean_problems(raw, RunSpec)  # pydantic would take them as 1 and 0
    try:
        spec = RunSpec.model_validate(raw)
    except ValidationError as e:
        problems += [line for err in e.errors() for line in describe(err, RunSpec).splitlines()]
    if problems:
        raise SpecError(problems, source)
    return spec


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `--set a.b.c=value` override in place; the value is parsed as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} must look like `section.field=value`, e.g. `train.lr=3e-4`")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    set_path(raw, _override_path(key.strip(), parsed), parsed if not _space_kind(key) else {_space_kind(key): parsed},
             f"override {item!r}")


def _override_path(key: str, value: Any) -> list[str]:
    """The keys `--set KEY=...` walks: `a.b.c`, except that a search-space entry is one key, a dotted
    spec path (`tune.space.train.lr` is `tune` → `space` → `train.lr`), and its kind may follow it
    (`tune.space.train.lr.loguniform=[1e-4, 1e-2]`)."""
    if key.startswith(SPACE_PREFIX) and key != SPACE_PREFIX:
        entry = key[len(SPACE_PREFIX):]
        if _space_kind(key):
            entry = entry.rpartition(".")[0]
        return ["tune", "space", entry]
    return key.split(".")


def _space_kind(key: str) -> str | None:
    """`loguniform` for `tune.space.train.lr.loguniform`: the override sets that entry to one kind."""
    if not key.startswith(SPACE_PREFIX):
        return None
    head, _, last = key[len(SPACE_PREFIX):].rpartition(".")
    return last if head and last in SPACE_KINDS else None


def spec_to_yaml(spec: RunSpec) -> str:
    """The resolved spec as YAML, with passwords in URIs masked: it is printed and stored with the run."""

    return redact(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))


def shipped_specs() -> str:
    """Where the example specs are, for messages: `configs/` here, else the checkout's."""
    here = Path("configs")
    folder = here if here.is_dir() else Path(__file__).resolve().parents[3] / "configs"
    found = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
    if not found:
        return "see configs/ in the Flotilla checkout"
    return f"see {'configs' if folder == here else folder}/: {', '.join(found)}"


def _nearby_specs(missing: Path) -> str:
    """The YAML files in the folder the missing one was looked for in, for the error message."""
    found = sorted(missing.parent.glob("*.yaml")) if missing.parent.is_dir() else []
    return ", ".join(str(c) for c in found) or "no YAML files"


def traffic_override(split: str) -> str:
    """`champion=90,candidate=10` → the `--set` override `serve.traffic={'champion': 90, ...}`."""
    pairs = [p.partition("=") for p in split.split(",") if p.strip()]
    if not pairs or any(not sep for _, sep, _ in pairs):
        raise SpecError([f"traffic {split!r}: each part is TARGET=WEIGHT, e.g. champion=90,candidate=10"], "traffic split")
    return "serve.traffic={" + ", ".join(f"{k.strip()!r}: {w.strip()}" for k, _, w in pairs) + "}"
