"""One entry for every bundle on disk: which format a directory holds, and loading it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Collection

from flotilla.bundle._hf import is_hf_bundle, load_hf_bundle
from flotilla.bundle._protocol import Bundle
from flotilla.bundle._torch import ALLOW_IN_SERVE, BUNDLE_FILES, MODEL_JSON, load_torch_bundle
from flotilla.errors import BundleError

# Beside a run's `bundle/` while training copies it there (removed last): the bundle is incomplete.
BUNDLE_COPYING = "bundle.copying"


def bundle_kind(path: str | Path) -> str | None:
    """`hf` (a fine-tuned pretrained language model), `torch` (Flotilla's own model) or None when
    `path` is no bundle directory: the one check of "is this a bundle"."""
    root = Path(path)
    if is_hf_bundle(root):
        return "hf"
    try:
        meta = json.loads((root / MODEL_JSON).read_text())
    except (OSError, ValueError):
        return None
    return "torch" if isinstance(meta, dict) and "model" in meta else None


def find_bundle(path: str | Path, what: str = "--model") -> Path:
    """The bundle directory at `path`, or in its `bundle/` (a run directory); a clear error otherwise."""
    root = Path(path).expanduser().resolve()
    if (root / BUNDLE_COPYING).exists():
        raise BundleError(f"{what} {str(path)!r}: the run's bundle is being copied out of its final checkpoint, or its "
                          "copy was cut short; run the training command again (it finishes the copy), or give "
                          "NAME@ALIAS or NAME/VERSION")
    for candidate in (root / "bundle", root):
        if bundle_kind(candidate) is not None:
            return candidate
    missing = [f for f in BUNDLE_FILES if not (root / f).is_file()]
    raise BundleError(f"{what} {str(path)!r} is a directory but not a bundle (missing {', '.join(missing)}); give "
                      "a run's bundle directory, NAME@ALIAS or NAME/VERSION")


def load_bundle(path: str | Path, *, factories: Collection[str] = (), allow_with: str = ALLOW_IN_SERVE) -> Bundle:
    """The bundle in directory `path`, loaded by its format's loader. `factories` lists the `custom`
    model factories this caller allows to run (default none; see `load_torch_bundle`)."""
    root = Path(path)
    if is_hf_bundle(root):  # a fine-tuned pretrained model: its own format (safetensors + JSON, no code)
        return load_hf_bundle(root)
    return load_torch_bundle(root, factories=factories, allow_with=allow_with)


def serving_app(model_spec: dict, task: str) -> str:
    """Which app serves a bundle, from its model.json (`model` and `schema.task`): `chat` (a
    fine-tuned pretrained model), `generator` (another language model: gpt) or `classifier`.
    The deploy reads it from the registered version's model.json, the replica from the bundle it loads."""
    if model_spec.get("kind") == "hf_causal_lm":
        return "chat"
    return "generator" if task == "lm" else "classifier"
