"""Passwords in URIs are masked wherever Flotilla writes them."""

from __future__ import annotations

import io

import pytest

from flotilla.redact import _RedactingStream, redact
from flotilla.spec import load_spec, spec_to_yaml
from flotilla.track import flatten


@pytest.mark.parametrize("text, expected", [
    ("postgresql://mlflow:pw@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
    ("http://user:p%40ss@127.0.0.1:5000/api", "http://user:***@127.0.0.1:5000/api"),
    ("s3://AKIAEXAMPLE:wJal/rXUtn+FEMI@bucket/runs", "s3://AKIAEXAMPLE:***@bucket/runs"),
    ("at http://a:b@h and 'postgresql+psycopg://c:d@e/f'", "at http://a:***@h and 'postgresql+psycopg://c:***@e/f'"),
    ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ("http://127.0.0.1:5000/#/experiments/1", "http://127.0.0.1:5000/#/experiments/1"),
    ("s3://bucket/runs", "s3://bucket/runs"),
])
def test_the_password_of_a_uri_is_masked_and_nothing_else_changes(text, expected):
    assert redact(text) == expected


def test_the_spec_as_printed_stored_and_logged_as_params_has_no_password():
    spec = load_spec(None, ["track.uri=postgresql://mlflow:hunter2@db/mlflow", "train.storage_path=s3://K:S3CR3T@b/runs"])
    assert spec.track.uri.endswith("hunter2@db/mlflow")  # the run itself uses the real URI
    text = spec_to_yaml(spec) + repr(flatten(spec.model_dump(mode="json")))
    assert "hunter2" not in text and "S3CR3T" not in text
    assert "postgresql://mlflow:***@db/mlflow" in text and "s3://K:***@b/runs" in text


def test_a_redacting_stream_masks_a_uri_written_in_pieces():
    out = io.StringIO()
    stream = _RedactingStream(out)
    stream.write("MLflow run at http://u:")
    stream.write("topsecret@127.0.0.1:5000\nepoch 1/3")
    stream.flush()
    assert out.getvalue() == "MLflow run at http://u:***@127.0.0.1:5000\nepoch 1/3"
