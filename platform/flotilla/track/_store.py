"""Where tracking data lives: resolve the MLflow URI and check it works before training starts."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, TypeVar
from urllib.parse import urlparse

from flotilla.errors import TrackingError, summarize

# The embedded default is MLflow's own (`sqlite:///mlflow.db` in the working directory), so that a
# plain `mlflow ui` started there shows the runs; artifacts go to `mlruns/` beside the database.
DEFAULT_DB = "mlflow.db"
ARTIFACTS_DIR = "mlruns"


def resolve_tracking_uri(uri: str | None) -> tuple[str, str | None]:
    """(tracking URI, artifact location for new experiments or None for the store's own default).

    `track.uri`, else $MLFLOW_TRACKING_URI, else `sqlite:///mlflow.db` in the working directory
    (made absolute: Ray workers and Tune trials run in other directories). A SQLite store keeps
    its artifacts in `mlruns/` beside the database file.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path.cwd() / DEFAULT_DB).resolve()}"
    if urlparse(uri).scheme == "sqlite":
        db = Path(uri.removeprefix("sqlite:///"))
        return uri, (db.parent / ARTIFACTS_DIR).resolve().as_uri()
    return uri, None


def check_tracking_uri(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming the URI, when the store cannot be reached or is not an MLflow store."""
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        import requests

        try:
            reply = requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
        except requests.RequestException as e:
            raise TrackingError(
                f"track.uri {uri!r}: cannot reach the MLflow tracking server ({type(e).__name__}); "
                "start it (`mlflow server --host 127.0.0.1 --port ...`) or fix `--set track.uri=...`"
            ) from None
        if reply.status_code != 200:
            raise TrackingError(
                f"track.uri {uri!r} answered {reply.status_code} on /health; is it an MLflow tracking server?"
            )
    elif scheme == "sqlite":
        db = Path(uri.removeprefix("sqlite:///"))
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"track.uri {uri!r}: cannot create {db.parent}: {e.strerror}") from None
    elif scheme in ("", "file"):
        raise TrackingError(
            f"track.uri {uri!r}: MLflow's plain file store is deprecated; use a database such as "
            f"`sqlite:///{Path(uri.removeprefix('file://') or '.').resolve()}/mlflow.db` or a tracking server URL"
        )
    with _quick_http():
        from mlflow import MlflowClient

        try:
            MlflowClient(uri).search_experiments(max_results=1)
        except Exception as e:  # MLflow raises many types: unknown scheme, driver missing, auth
            raise TrackingError(f"track.uri {uri!r} is not a usable MLflow store: {summarize(e)}") from None


class _quick_http:
    """MLflow retries HTTP calls for minutes by default; a startup check should answer in seconds."""

    VARS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}

    def __enter__(self):
        self.before = {k: os.environ.get(k) for k in self.VARS}
        os.environ.update(self.VARS)

    def __exit__(self, *exc):
        for k, v in self.before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def registry_client(uri: str | None, check: bool = True):
    """The one way Flotilla makes an `MlflowClient`: on the store `uri` resolves to (see
    `resolve_tracking_uri`), checked first unless `check` is off (the caller checked it). Nothing
    process-wide is set (no `mlflow.set_tracking_uri`): each client names its store."""
    from mlflow import MlflowClient

    resolved, _ = resolve_tracking_uri(uri)
    if check:
        check_tracking_uri(resolved)
    return MlflowClient(resolved)


def lost_insert_race(error: Exception) -> bool:
    """Whether an MLflow call failed because a concurrent writer inserted the same row first
    (PostgreSQL's or SQLite's unique key): a retry then finds the row and updates it."""
    return any(k in str(error) for k in ("UniqueViolation", "duplicate key", "UNIQUE constraint"))


T = TypeVar("T")


def retry_lost_insert(call: Callable[[], T]) -> T:
    """`call()`, retried (3 times at most, a little later each time) while it fails because a
    concurrent writer inserted the same row first: once that insert has committed, a retry finds
    the row and updates or links it."""
    from mlflow.exceptions import MlflowException

    for attempt in range(4):
        try:
            return call()
        except MlflowException as e:
            if attempt == 3 or not lost_insert_race(e):
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")
