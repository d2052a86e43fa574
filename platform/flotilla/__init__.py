"""Flotilla: an ML platform on one Ray cluster.

    from flotilla import load_spec, run_training, load_bundle
    outcome = run_training(load_spec("configs/digits.yaml"))
    load_bundle(outcome.bundle_path).predict(rows)
"""

__version__ = "0.1.0"

from flotilla.config import RunSpec, load_spec  # noqa: E402
from flotilla.errors import FlotillaError  # noqa: E402


def run_training(spec):
    """Preprocess, train, evaluate and bundle one run; see `flotilla.train.run_training`."""
    from flotilla.train import run_training as _run

    return _run(spec)


def load_bundle(path):
    """Load an inference bundle; see `flotilla.bundle.load_bundle`."""
    from flotilla.bundle import load_bundle as _load

    return _load(path)


__all__ = ["FlotillaError", "RunSpec", "load_bundle", "load_spec", "run_training", "__version__"]
