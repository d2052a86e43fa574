"""From a model reference to a bundle directory on this machine: the one way every command does it.

A reference is a registered version (`NAME@ALIAS`, `NAME/VERSION`, MLflow's `models:/NAME@ALIAS`
and `models:/NAME/VERSION`; `parse_model_reference` reads them) or a bundle directory (a run's
directory holding `bundle/` will do). A registered version's model directory is downloaded whole,
as MLflow's own loader fetches it (a subdirectory alone is not found as one through every
artifact server, e.g. an MLflow server proxying a local store), and only the bundle inside it,
where its MLmodel file says, is read.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator

import yaml
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.exceptions import MlflowException

from flotilla.bundle import VARIANTS_DIR, VARIANTS_JSON, Bundle, find_bundle, load_bundle
from flotilla.errors import BundleError, TrackingError
from flotilla.track._reference import parse_model_reference
from flotilla.track._registry import resolve_reference
from flotilla.track._store import registry_client


@dataclass
class LocalBundle:
    """A bundle directory on this machine, and the registered version it came from (None for a path)."""

    path: Path
    name: str | None = None
    version: str | None = None
    client: MlflowClient | None = None
    model_dir: Path | None = None  # the downloaded model directory the bundle lies in

    @property
    def relative(self) -> str:
        """Where the bundle lies inside its model directory (`bundle`, as logged)."""
        return self.path.relative_to(self.model_dir.resolve()).as_posix() if self.model_dir else ""


@contextlib.contextmanager
def local_bundle(reference: str, tracking_uri: str | None = None, command: str = "--model") -> Iterator[LocalBundle]:
    """The bundle `reference` names (`parse_model_reference`), as a local directory for the duration
    of the `with` block."""
    ref = parse_model_reference(reference, command=command)
    if ref.path is not None:
        yield LocalBundle(find_bundle(ref.path, "--model"))
        return
    client = registry_client(tracking_uri)
    name, version = resolve_reference(client, ref, command)
    with tempfile.TemporaryDirectory(prefix="flotilla-bundle-") as tmp:
        model = download_model(client, name, version, Path(tmp))
        yield LocalBundle(bundle_in_model(model, f"{name} v{version}"), name, version, client, model)


def download_model(client: MlflowClient, name: str, version: str, dst: Path) -> Path:
    """Registered `name` version `version`'s whole model directory, downloaded under `dst`."""
    try:
        location = client.get_model_version_download_uri(name, version)
        return Path(download_artifacts(artifact_uri=location, dst_path=str(dst), tracking_uri=client.tracking_uri))
    except MlflowException as e:
        raise TrackingError(f"{name} v{version}: {e.message} (store {client.tracking_uri})") from None


def bundle_in_model(model: Path, what: str) -> Path:
    """Where the pyfunc model in `model` keeps its bundle (the artifact logged as `bundle`): the path
    its MLmodel file names, read as YAML and kept inside the model directory."""
    try:
        meta = yaml.safe_load((model / "MLmodel").read_text())
        relative = meta["flavors"]["python_function"]["artifacts"]["bundle"]["path"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise TrackingError(f"{what} is not a Flotilla model: its MLmodel names no `bundle` artifact ({e})") from None
    path = (model / relative).resolve()
    if not path.is_relative_to(model.resolve()):
        raise TrackingError(f"{what}: its MLmodel puts the bundle outside the model ({relative!r})")
    return path


def model_file(client: MlflowClient, name: str, version: str, relative: str, dst: Path) -> Path | None:
    """One file of a registered version's model directory (`MLmodel`, `input_example.json`, ...),
    downloaded alone under `dst` (`relative` empty: the whole directory); None when there is none."""
    location = client.get_model_version_download_uri(name, version).rstrip("/")
    try:
        return Path(download_artifacts(artifact_uri=f"{location}/{relative}" if relative else location, dst_path=str(dst),
                                       tracking_uri=client.tracking_uri))
    except (MlflowException, OSError):
        return None


def registered_bundle_file(client: MlflowClient, name: str, version: str, relative: str, dst: Path) -> Path | None:
    """One file of a registered version's bundle (`model.json`, `variants/variants.json`), downloaded
    alone under `dst`, the bundle's place read from the model's MLmodel; None when there is none."""
    mlmodel = model_file(client, name, version, "MLmodel", dst)
    if mlmodel is None:
        return None
    bundle = bundle_in_model(mlmodel.parent, f"{name} v{version}").relative_to(mlmodel.parent.resolve())
    return model_file(client, name, version, f"{bundle.as_posix()}/{relative}", dst / "bundle")


def registered_variants(client: MlflowClient, name: str, version: str) -> dict[str, dict[str, Any]]:
    """The variant records (`variants/variants.json`) of a registered version's bundle, read without
    downloading its weights: what `flotilla export` built and what each gate found ({} when none)."""
    with tempfile.TemporaryDirectory(prefix="flotilla-variants-") as tmp:
        records = registered_bundle_file(client, name, version, f"{VARIANTS_DIR}/{VARIANTS_JSON}", Path(tmp))
        return json.loads(records.read_text()) if records is not None else {}


def load_registered_bundle(client: MlflowClient, name: str, version: str, factories: Collection[str] = (),
                           runtime: str = "torch") -> Bundle:
    """Registered `name` version `version` as an inference bundle (`flotilla.bundle.load_bundle`):
    its model directory is downloaded and only its bundle (safetensors weights, JSON config and
    preprocessors, where the MLmodel file says) is read, by the Flotilla installed here. Nothing the
    version carries is imported or run, unlike
    `mlflow.pyfunc.load_model`, which executes the model's own code: anyone who can write to the
    registry could have replaced that code. A `custom` model's factory is imported only when
    `factories` lists it (`serve.allow_factories`). `runtime` picks what runs the model: torch, or
    an ONNX variant the version holds (`InferenceBundle.with_runtime`)."""
    with tempfile.TemporaryDirectory(prefix="flotilla-bundle-") as tmp:
        model = download_model(client, name, version, Path(tmp))
        bundle = load_bundle(bundle_in_model(model, f"{name} v{version}"), factories=factories)  # read into memory
        try:
            return bundle.with_runtime(runtime)
        except BundleError as e:
            raise TrackingError(f"{name} v{version}: {e}") from None
