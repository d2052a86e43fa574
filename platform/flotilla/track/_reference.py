"""One way to name a model, on every command that takes one (`--model`):

    digits@champion            NAME@ALIAS: the version an alias of a registered model points at
    digits/3                   NAME/VERSION: a version by number
    models:/digits@champion    MLflow's own model URIs, the same two forms
    models:/digits/3
    runs/digits-20261130-101500/bundle     the path of a bundle (or run) directory
    digits                     NAME alone, where a command takes a registered model by name (deploy, promote)

An existing local path is always a path (as it was for `predict` and `export`); anything else is a
registered model. Parsing needs no MLflow: the registry is asked only when a version is resolved
(`resolve_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flotilla.errors import SpecError

MODELS_URI = "models:/"
FORMS = ["NAME@ALIAS (digits@champion)", "NAME/VERSION (digits/3)", "models:/NAME@ALIAS", "models:/NAME/VERSION"]


@dataclass(frozen=True)
class ModelReference:
    """What `--model` named: a registered model (with an alias or a version, or neither) or a path."""

    text: str  # as written
    name: str | None = None  # the registered model; None for a path
    alias: str | None = None
    version: str | None = None
    path: Path | None = None  # a bundle or run directory (or another existing local path)

    @property
    def registered(self) -> bool:
        return self.path is None

    @property
    def target(self) -> str | None:
        """The alias or the version (as `serve.traffic` keys them); None for a bare name or a path."""
        return self.alias or self.version

    def __str__(self) -> str:
        if self.path is not None:
            return self.text
        return f"{self.name}@{self.alias}" if self.alias else f"{self.name}/{self.version}" if self.version else self.name


def parse_model_reference(reference: str | ModelReference, *, name_alone: bool = False, paths: bool = True,
                          command: str = "--model") -> ModelReference:
    """Parse `--model` as every command writes it (see the module docstring).

    `name_alone`: a bare NAME is a registered model (deploy, promote take one); `paths`: an existing
    local path is a bundle (predict, export). Raises `SpecError` naming the forms when it is none of them.
    """
    if isinstance(reference, ModelReference):
        return reference
    text = reference.strip()
    allowed = FORMS + ["NAME"] * name_alone + ["the path of a bundle directory"] * paths
    forms = ", ".join(allowed[:-1]) + " or " + allowed[-1]

    def bad(why: str) -> SpecError:
        return SpecError([f"--model {reference!r}: {why}; give {forms}"], command)

    if not text:
        raise bad("empty")
    if text.startswith(MODELS_URI):
        registered = _registered(text[len(MODELS_URI):], text, name_alone=False)
        if registered is None:
            raise bad("a models:/ URI names a registered model with an alias or a version")
        return registered
    if paths and Path(text).expanduser().exists():
        return ModelReference(text, path=Path(text).expanduser())
    registered = _registered(text, text, name_alone)
    if registered is not None:
        return registered
    if paths and (text.startswith((".", "~", "/")) or "/" in text):
        raise bad(f"no such file or directory {str(Path(text).expanduser().resolve())!r}")
    raise bad("not a model reference")


def _registered(text: str, original: str, name_alone: bool) -> ModelReference | None:
    if "@" in text:
        name, _, alias = text.partition("@")
        if name and alias and "/" not in alias and "@" not in alias:
            return ModelReference(original, name=name, alias=alias)
        return None
    name, _, version = text.rpartition("/")
    if name and version.isdigit():
        return ModelReference(original, name=name, version=version)
    if name_alone and text and "/" not in text:
        return ModelReference(original, name=text)
    return None
