"""What `flotilla validate` can check beyond the spec's form: the local paths it names exist.

    problems, notes = check_local_paths(spec)

`data.source` and `model.pretrained` may be local paths, remote URIs, hub ids or built-in names.
A local path that does not exist is a problem, found here in a fraction of a second instead of
after Ray has started; a remote one is noted as not checked. Nothing heavy is imported (no Ray,
no torch, no pyarrow).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from flotilla.spec._sections import HFCausalLMSpec, RunSpec

# The built-in names, which are not paths. The same as flotilla.data.BUILTIN_SOURCES and
# flotilla.models._hf_tiny.BUILTIN_MODELS (a test keeps them equal; importing those here would
# import Ray and torch).
BUILTIN_SOURCES = ("digits", "pycode", "arith", "arith-pairs")
BUILTIN_MODELS = ("tiny-llama",)
_GLOB_CHARS = set("*?[")


def check_local_paths(spec: RunSpec) -> tuple[list[str], list[str]]:
    """(problems, notes): a local `data.source` or `model.pretrained` that is not there is a problem;
    what cannot be checked from here (a remote URI, a hub id) is a note."""
    problems: list[str] = []
    notes: list[str] = []
    _check_source(spec.data.source, problems, notes)
    if isinstance(spec.model, HFCausalLMSpec):
        _check_pretrained(spec.model.pretrained, problems, notes)
    return problems, notes


def _check_source(source: str, problems: list[str], notes: list[str]) -> None:
    if source in BUILTIN_SOURCES:
        return
    path = _local(source)
    if path is None:
        notes.append(f"`data.source` {source!r} is remote (the job reads it where it runs)")
        return
    shown = _shown(source, path)
    if _GLOB_CHARS & set(str(path)):
        if not glob.glob(str(path), recursive=True):
            problems.append(f"`data.source`: {shown} matches no files; check the pattern, or use a built-in sample "
                            f"({', '.join(BUILTIN_SOURCES)})")
    elif not path.exists():
        problems.append(f"`data.source`: {shown} does not exist; point `--set data.source=...` at a Parquet/CSV/JSON "
                        f"Lines file, a directory of them, or a glob, or use a built-in sample ({', '.join(BUILTIN_SOURCES)})")


def _check_pretrained(pretrained: str, problems: list[str], notes: list[str]) -> None:
    if pretrained in BUILTIN_MODELS:
        return
    path = _local(pretrained)
    if path is None:
        notes.append(f"`model.pretrained` {pretrained!r} is remote")
        return
    looks_local = pretrained.startswith(("/", "./", "../", "~", "file://")) or path.exists()  # as models/_hf.py decides
    shown = _shown(pretrained, path)
    if not looks_local:
        notes.append(f"`model.pretrained` {pretrained!r} is a Hugging Face hub id (no directory of that name here); "
                     "the workers download it or find it in their cache")
    elif not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        problems.append(f"`model.pretrained`: {shown} {what}; point `--set model.pretrained=...` at a directory "
                        "written by save_pretrained, or give a Hugging Face hub id")
    elif not (path / "config.json").is_file():
        problems.append(f"`model.pretrained`: {shown} has no config.json, so it is not a model save_pretrained wrote")


def pretrained_made_absolute(spec: RunSpec) -> RunSpec:
    """`spec` with a relative `model.pretrained` that is a directory here made absolute: the training
    workers run in directories of their own (Ray's), where a relative path names nothing. A hub id
    or built-in name is left as it is."""
    m = spec.model
    if not isinstance(m, HFCausalLMSpec) or m.pretrained in BUILTIN_MODELS or "://" in m.pretrained:
        return spec
    path = Path(os.path.expanduser(m.pretrained))
    if path.is_absolute() or not path.is_dir():
        return spec
    return spec.model_copy(update={"model": m.model_copy(update={"pretrained": str(path.resolve())})})


def _shown(written: str, path: Path) -> str:
    """The value as written, and where it was looked for when that differs."""
    absolute = str(path.absolute())
    return f"{written!r}" + (f" (looked for {absolute})" if absolute != written else "")


def _local(location: str) -> Path | None:
    """The local path `location` names (`~` expanded), or None for a remote URI such as `s3://b/p`."""
    if location.startswith("file://"):
        return Path(location.removeprefix("file://")).expanduser()
    if "://" in location:
        return None
    return Path(os.path.expanduser(location))
