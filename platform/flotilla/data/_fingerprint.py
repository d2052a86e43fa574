"""A data fingerprint: a content hash of the input files plus the preprocessing spec.

It changes when any input byte changes or when the preprocessing changes, and does not
change when the same files move to another directory or bucket.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow.fs as pafs

_CHUNK = 1 << 20


def fingerprint(paths: list[str], filesystem: pafs.FileSystem, preprocessing: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(preprocessing, sort_keys=True).encode())
    for path in sorted(paths):
        file_digest = hashlib.sha256()
        with filesystem.open_input_stream(path) as stream:
            while chunk := stream.read(_CHUNK):
                file_digest.update(chunk)
        digest.update(file_digest.digest())
    return digest.hexdigest()
