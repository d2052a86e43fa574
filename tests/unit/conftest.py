"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def registry(tmp_path):
    """A real SQLite-backed registry (its MlflowClient) with model `m` at versions 1..4 (sources are empty dirs)."""
    from mlflow import MlflowClient

    from flotilla.track import check_tracking_uri

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    check_tracking_uri(uri)
    client = MlflowClient(uri)
    client.create_registered_model("m")
    (tmp_path / "src").mkdir()
    for _ in range(4):
        version = client.create_model_version("m", source=str(tmp_path / "src")).version
        client.set_model_version_tag("m", version, "flotilla.gate", "passed")  # as a Flotilla run's gate
    return client
