"""The package's import layering (pyproject.toml's [tool.importlinter] contracts), checked by import-linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_imports_run_one_way_and_have_no_cycles():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout or "broken" not in done.stdout.split("Contracts:")[-1], done.stdout[-2000:]



def test_a_serve_replica_loads_no_training_stack():
    """What a Serve replica's code (`flotilla.serve`, which reads models through `flotilla.track`)
    imports, in a fresh interpreter: torch, never Ray Train or DeepSpeed (Ray Train ~3 CPU-seconds in
    every replica). A Ray Data worker's `flotilla.data` loads no torch either (test_bundle_format.py)."""
    probe = "import sys, flotilla.serve; print(sorted(m for m in ('ray.train', 'deepspeed', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['torch']"
