"""Flotilla: an ML platform on one Ray cluster.

    from flotilla import load_spec
    from flotilla.pipeline import run_training
    from flotilla.bundle import load_bundle

    outcome = run_training(load_spec("configs/digits.yaml"))
    load_bundle(outcome.bundle_path).predict(rows)

Importing `flotilla` itself stays light (no torch, no Ray): the `flotilla` command answers
`--help` and checks specs in a fraction of a second.
"""

__version__ = "0.1.0"

from flotilla.errors import FlotillaError  # noqa: E402
from flotilla.spec import RunSpec, load_spec  # noqa: E402

__all__ = ["FlotillaError", "RunSpec", "load_spec", "__version__"]
