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
    # A password holding '@' (and '/'), a token standing alone as the user, signatures in a query.
    ("postgresql://u:p@ss@db/mlflow", "postgresql://u:***@db/mlflow"),
    ("s3://K:wJal/r@X@bucket/runs", "s3://K:***@bucket/runs"),
    ("http://ghp_T0KEN@host/repo.git", "http://***@host/repo.git"),
    ("https://acct.blob.core.windows.net/c/d.parquet?sv=2022-11-02&sr=b&sig=AbC%2Bd%3D&se=2027-01-01",
     "https://acct.blob.core.windows.net/c/d.parquet?sv=2022-11-02&sr=b&sig=***&se=2027-01-01"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=f00d&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"),
    ("gs://b/x?token=abc#frag", "gs://b/x?token=***#frag"),
    ('{"uri": "s3://AKIAXXX:SECRETKEY@bucket/data/"}', '{"uri": "s3://AKIAXXX:***@bucket/data/"}'),
    # What is no secret stays.
    ("s3://bucket/path@v2/x", "s3://bucket/path@v2/x"),
    ("mail ada@example.com", "mail ada@example.com"),
    ("train.lr=0.01 and --set key=value", "train.lr=0.01 and --set key=value"),
])
def test_the_secrets_of_a_uri_are_masked_and_nothing_else_changes(text, expected):
    assert redact(text) == expected
    assert redact(expected) == expected  # redacting twice changes nothing more


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


def test_a_flotilla_error_never_carries_a_secret_of_the_uri_it_names():
    """Exceptions reach logs, `serve status` and MLflow tags: their messages are redacted where
    they are built, and stay so across a pickle (Ray sends them between processes)."""
    import pickle

    from flotilla.errors import DataError, SpecError

    error = DataError("data.source s3://AKIAXXX:SECRETKEY@bucket/data/ has no Parquet or CSV files")
    again = pickle.loads(pickle.dumps(error))
    spec_error = SpecError(["track.uri postgresql://u:p@ss@db/x is unreachable"])
    for e in (error, again, spec_error, pickle.loads(pickle.dumps(spec_error))):
        assert "SECRETKEY" not in str(e) and "p@ss" not in str(e) and "***" in str(e)


def test_a_log_record_and_its_traceback_are_redacted_before_any_handler_writes_them():
    import logging

    from flotilla.redact import redact_logger

    out = io.StringIO()
    logger = logging.getLogger("flotilla-test-redact")
    logger.propagate = False
    logger.addHandler(logging.StreamHandler(out))
    redact_logger(logger)
    redact_logger(logger)  # twice: one filter
    try:
        raise RuntimeError("cannot reach http://admin:hunter2@mlflow:5000")
    except RuntimeError:
        logger.exception("loading %s failed", "s3://K:S3CR3T@bucket/model")
    text = out.getvalue()
    assert "hunter2" not in text and "S3CR3T" not in text
    assert "s3://K:***@bucket/model" in text and "http://admin:***@mlflow:5000" in text
    assert len(logger.filters) == 1


def test_the_dataset_input_of_a_run_keeps_no_credentials(tmp_path):
    """A run's dataset input (source and name), in a real MLflow store, names the data without the
    credentials its URI carried."""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from flotilla.track import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = load_spec(None, [f"track.uri={uri}", f"train.storage_path={tmp_path}/runs"])
    tracker = Tracker(spec, "creds")
    experiment = tracker.client.create_experiment("creds")
    tracker.run_id = tracker.client.create_run(experiment).info.run_id
    source = "s3://AKIAXXX:SECRETKEY@bucket/data/?sig=SASSIG"
    prepared = SimpleNamespace(source=SimpleNamespace(description=source, paths=[source]), fingerprint="f" * 64)
    tracker._log_input(prepared)
    run = MlflowClient(uri).get_run(tracker.run_id)
    stored = repr([(d.dataset.name, d.dataset.source, d.dataset.source_type) for d in run.inputs.dataset_inputs])
    assert "AKIAXXX:***@bucket" in stored and "SECRETKEY" not in stored and "SASSIG" not in stored, stored
