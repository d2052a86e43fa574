"""A run's bundle is copied out of its final checkpoint to `<run>/bundle`; a copy cut short (the
driver killed, the disk full) is never taken for a finished run's bundle."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from flotilla.bundle import BUNDLE_COPYING, find_bundle
from flotilla.errors import BundleError
from flotilla.train._run import _finished_bundle, find_bundle as run_bundle, publish_bundle


def _bundle(directory, epochs: int, weights: bytes) -> None:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "model.json").write_text(json.dumps({"model": {"kind": "mlp"}}))
    (directory / "preprocessors.json").write_text("{}")
    (directory / "metrics.json").write_text(json.dumps({"history": [{"epoch": e} for e in range(1, epochs + 1)],
                                                        "final": {"val_accuracy": 0.9}}))


def test_a_bundle_copy_cut_short_is_never_a_finished_run(tmp_path):
    fs = pafs.LocalFileSystem()
    run = tmp_path / "runs" / "digits"
    checkpoint = run / "checkpoint_epoch0005_0" / "bundle"
    _bundle(checkpoint, 5, b"new weights")
    (run / "fingerprint.txt").write_text("f00d\n")
    # An earlier bundle of the run (3 epochs), then the copy of the new one is cut short: the
    # marker stays and one file of the old bundle is already replaced.
    _bundle(run / "bundle", 3, b"old weights")
    (run / BUNDLE_COPYING).write_text("copying")
    (run / "bundle" / "metrics.json").write_text((checkpoint / "metrics.json").read_text())
    assert _finished_bundle(fs, str(tmp_path / "runs"), "digits", 5, "f00d") is None  # trains (resumes) again
    assert run_bundle(fs, str(tmp_path / "runs"), "digits") == f"{run}/checkpoint_epoch0005_0/bundle"
    with pytest.raises(BundleError, match="run the training command again"):
        find_bundle(run)
    # The copy done again: every file is the new bundle's, none of the old one is left, and the run is finished.
    (run / "bundle" / "stale.bin").write_bytes(b"from the old bundle")
    assert publish_bundle(fs, str(run), fs, str(checkpoint)) == f"{run}/bundle"
    assert not (run / BUNDLE_COPYING).exists() and not (run / "bundle" / "stale.bin").exists()
    assert (run / "bundle" / "model.safetensors").read_bytes() == b"new weights"
    assert _finished_bundle(fs, str(tmp_path / "runs"), "digits", 5, "f00d")["final"] == {"val_accuracy": 0.9}
    assert run_bundle(fs, str(tmp_path / "runs"), "digits") == f"{run}/bundle"
    assert find_bundle(run) == run / "bundle"
