"""Where Flotilla writes what it builds for itself (built-in samples, the built-in tiny model)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$FLOTILLA_CACHE or ~/.cache/flotilla."""
    return Path(os.environ.get("FLOTILLA_CACHE", Path.home() / ".cache" / "flotilla"))
