"""Build DeepSpeed's shared-memory collective op for this .venv once, at install time (`make install`).

DeepSpeed compiles it on first use (about 80 s on 2 cores) under a lock file in
~/.cache/torch_extensions; a worker killed during that build leaves the lock behind and every later
worker waits on it forever. Built here, serially, no training run ever compiles it. A lock older
than 10 minutes is a dead build's and is removed first.
"""

from __future__ import annotations

import time
from pathlib import Path


def main() -> None:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        print("DeepSpeed: no shared-memory op for this accelerator; nothing to build")
        return
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(builder.name, verbose=False)) / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > 600:
        print(f"removing a dead build's lock: {lock}")
        lock.unlink(missing_ok=True)
    started = time.monotonic()
    builder.load(verbose=False)
    print(f"DeepSpeed {builder.absolute_name()} ready ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
