"""Checkpoint verification reads only the manifests: any malformed or escaping manifest makes the
checkpoint torn (a reason, never an exception), before DeepSpeed deserialises anything."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from flotilla.train._checkpoint import MANIFEST_DIR, _write_manifest, problems


def _checkpoint(root: Path, world_size: int = 2) -> Path:
    for rank in range(world_size):
        (root / "ds").mkdir(parents=True, exist_ok=True)
        (root / "ds" / f"shard_{rank}.pt").write_bytes(bytes([rank]) * 100)
    for rank in range(world_size):
        _write_manifest(str(root), rank, world_size, {"global_step": 7})
    return root


def _rewrite(root: Path, rank: int, change) -> None:
    path = root / MANIFEST_DIR / f"rank{rank}.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps(change(manifest)))


def test_a_complete_checkpoint_has_no_problems(tmp_path):
    assert problems(str(_checkpoint(tmp_path))) == []


def _outside_file(root: Path) -> tuple[str, dict]:
    """A file next to the checkpoint, listed with its true size and checksum."""
    data = b"not part of the checkpoint"
    (root.parent / "outside.bin").write_bytes(data)
    return "../outside.bin", {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("change, reason", [
    (lambda m: [m], r"rank0.json is malformed \(the document: Input should be an object"),
    (lambda m: {k: v for k, v in m.items() if k != "files"}, r"rank0.json is malformed \(files: Field required"),
    (lambda m: {**m, "world_size": "two"}, r"rank0.json is malformed \(world_size: Input should be a valid integer"),
    (lambda m: {**m, "files": {"ds/shard_0.pt": {"size": -1, "sha256": "0" * 64}}}, r"files.ds/shard_0.pt.size"),
    (lambda m: {**m, "files": {"ds/shard_0.pt": {"size": 100}}}, r"files.ds/shard_0.pt.sha256: Field required"),
    (lambda m: {**m, "rank": 1}, r"rank0.json describes rank 1"),
    (lambda m: {**m, "world_size": 3}, r"disagree on the world size \(2, 3\)"),
    (lambda m: {**m, "files": {"/etc/hostname": {"size": 1, "sha256": "0" * 64}}}, r"'/etc/hostname' is outside"),
])
def test_a_malformed_manifest_makes_the_checkpoint_torn_not_a_crash(tmp_path, change, reason):
    root = _checkpoint(tmp_path / "ckpt")
    _rewrite(root, 0, change)
    found = problems(str(root))
    assert any(re.search(reason, p) for p in found), found


def test_a_manifest_path_outside_the_checkpoint_is_never_read(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    rel, entry = _outside_file(root)
    _rewrite(root, 1, lambda m: {**m, "files": {**m["files"], rel: entry}})
    assert problems(str(root)) == ["rank 1: '../outside.bin' is outside the checkpoint"]
    # ...and through a link inside the checkpoint that points out of it.
    (root / "ds" / "link.bin").symlink_to(root.parent / "outside.bin")
    _rewrite(root, 1, lambda m: {**m, "files": {"ds/link.bin": entry}})
    assert problems(str(root)) == ["rank 1: 'ds/link.bin' is outside the checkpoint"]


def test_a_missing_rank_or_a_changed_file_is_named(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    (root / "ds" / "shard_1.pt").write_bytes(b"\0" * 100)
    (root / MANIFEST_DIR / "rank0.json").unlink()
    assert problems(str(root)) == ["rank 1: ds/shard_1.pt does not match its checksum",
                                   "manifests of rank(s) 0 are missing"]


def test_a_killed_workers_staging_directory_is_removed_by_the_next_one_on_its_host(tmp_path):
    """Checkpoints are written to a local directory before Ray Train copies them to storage; a
    worker killed meanwhile leaves it behind. The next staging on the host removes those of dead
    processes of this host, never a live process's or another host's."""
    import os
    import subprocess
    import sys

    from flotilla.train._checkpoint import STAGING_PREFIX, staging_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    with staging_dir(str(tmp_path)) as first:
        name = Path(first).name
        assert name.startswith(STAGING_PREFIX) and f"-{os.getpid()}-" in name
        stem = name[:name.rindex(f"-{os.getpid()}-")]  # flotilla-ckpt-HOST
        left = [tmp_path / f"{stem}-{dead_pid}-abc", tmp_path / f"{stem}-{os.getpid()}-live",
                tmp_path / f"{STAGING_PREFIX}otherhost-{dead_pid}-abc"]
        for d in left:
            (d / "ds").mkdir(parents=True)
            (d / "ds" / "shard.pt").write_bytes(b"x" * 1000)
        with staging_dir(str(tmp_path)) as second:
            assert Path(second).exists() and Path(first).exists()
            assert [d.exists() for d in left] == [False, True, True]
    assert not Path(first).exists()
