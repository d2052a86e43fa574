"""Credentials in URIs never leave a Flotilla process in full.

    redact("postgresql://mlflow:pw@db:5432/mlflow")   # -> "postgresql://mlflow:***@db:5432/mlflow"
    redact("https://tok@host/x?sv=1&sig=abc")          # -> "https://***@host/x?sv=1&sig=***"
    redact_output()                                    # the same for everything this process prints

A tracking or storage URI may carry a secret: a password (`postgresql://user:pw@host/db`, one
with an `@` in it too, `s3://KEY:SECRET/with/slashes@bucket/...`), a token standing alone as the
user (`https://TOKEN@host/...`), or a signature in its query string (an Azure SAS `sig=`, S3's
`X-Amz-Signature=`, a `token=`). Every line Flotilla prints, every message of its exceptions
(`flotilla.errors`), every MLflow param, tag, dataset input and text artifact (the run's
`spec.yaml` included) goes through `redact`; the entry points also wrap the process's stdout and
stderr, and serving replicas filter their log records, so what other libraries print (MLflow's
"View run at ...", a traceback quoting the URI) is redacted too.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import TextIO

MASK = "***"
# scheme://user:secret@host: the secret runs from the first ':' to the '@' that the host follows,
# the first '@' with no other before the next '/' (a password may hold '@' and, as cloud keys do,
# '/'; a path with an '@' after the host is left alone, or masked too, which is safe).
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/?#@\s'\"]*):(?P<secret>[^\s'\"]*?)"
                       r"@(?=[^@/?#\s'\"]*(?:[/?#\s'\"]|$))")
# scheme://token@host: a user with no password is a token (a PAT, an API key).
_TOKEN_USER = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<token>[^:/?#@\s'\"]+)@")
# ?...&sig=...: query parameters that are signatures, tokens or keys.
_QUERY_SECRET = re.compile(r"(?P<head>[?&](?:sig|signature|x-amz-signature|x-amz-security-token|x-amz-credential|"
                           r"x-goog-signature|x-goog-credential|token|access_token|auth|api_key|apikey|key|"
                           r"password|secret|client_secret)=)(?P<value>[^&#\s'\"]+)", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every secret a URI in it carries replaced by `***`: the password of
    `scheme://user:password@`, the token of `scheme://token@`, and query parameters such as
    `sig=`, `token=` or `X-Amz-Signature=`."""
    if "://" in text:
        text = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
        text = _TOKEN_USER.sub(lambda m: f"{m['head']}{MASK}@", text)
    if "=" in text:
        text = _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}", text)
    return text


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


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record's message and traceback before any handler
    formats it (serving replicas put it on Serve's logger and handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


def redact_logger(logger: logging.Logger) -> None:
    """Redact what `logger` logs, and what its handlers write (records of child loggers too).
    Safe to call twice."""
    for target in (logger, *logger.handlers):
        if not any(isinstance(f, RedactingFilter) for f in target.filters):
            target.addFilter(RedactingFilter())
