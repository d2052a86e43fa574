"""Credentials in URIs never leave a Flotilla process in full.

    redact("postgresql://mlflow:pw@db:5432/mlflow")   # -> "postgresql://mlflow:***@db:5432/mlflow"
    redact_output()                                    # the same for everything this process prints

A tracking or storage URI may carry a password (`postgresql://user:pw@host/db`,
`http://user:pw@mlflow:5000`, `s3://KEY:SECRET@bucket/...`). Every line Flotilla prints, every
MLflow param, tag and text artifact (the run's `spec.yaml` included) goes through `redact`; the
entry points also wrap the process's stdout and stderr, so what other libraries print (MLflow's
"View run at ...", a traceback quoting the URI) is redacted too.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import TextIO

MASK = "***"
# scheme://user:secret@  (the secret: whatever stands between the first ':' and the '@', slashes
# included, as cloud keys have them; a path with an '@' after a port is masked too, which is safe)
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/?#@\s'\"]*):(?P<secret>[^@\s'\"]+)@")


def redact(text: str) -> str:
    """`text` with the password of every `scheme://user:password@` in it replaced by `***`."""
    return _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text) if "://" in text else text


class _RedactingStream:
    """A text stream that redacts what is written to it, line by line, and passes the rest through."""

    def __init__(self, inner: TextIO):
        self._inner = inner
        self._partial = ""

    def write(self, text: str) -> int:
        text = self._partial + text
        complete, _, self._partial = text.rpartition("\n")  # a URI is never split over lines
        if complete or _:
            self._inner.write(redact(complete + _))
        if len(self._partial) > 65536 or (self._partial and "://" not in self._partial):
            self._inner.write(redact(self._partial))
            self._partial = ""
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._inner.write(redact(self._partial))
            self._partial = ""
        self._inner.flush()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def redact_output() -> None:
    """Redact everything this process writes to stdout and stderr from now on, including through
    logging handlers that already hold the original streams. Safe to call twice."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, _RedactingStream):
            continue
        wrapped = _RedactingStream(stream)
        setattr(sys, name, wrapped)
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for handler in getattr(logger, "handlers", []):
                if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
                    handler.setStream(wrapped)
