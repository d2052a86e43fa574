"""Checkpoint verification reads only the manifests: any malformed or escaping manifest makes the
checkpoint torn (a reason, never an exception), before DeepSpeed deserialises anything."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from pydantic import ValidationError

from flotilla.train._checkpoint import MANIFEST_DIR, _Manifest, _signature, _write_manifest, problems, signing_key


def _checkpoint(root: Path, world_size: int = 2) -> Path:
    for rank in range(world_size):
        (root / "ds").mkdir(parents=True, exist_ok=True)
        (root / "ds" / f"shard_{rank}.pt").write_bytes(bytes([rank]) * 100)
    for rank in range(world_size):
        _write_manifest(str(root), rank, world_size, {"global_step": 7})
    return root


def _rewrite(root: Path, rank: int, change, sign: bool = True) -> None:
    """Change a rank's manifest, signed again with the key (what a writer holding it could do), so
    that the checks behind the signature's are what is tested; `sign=False`: as anyone else."""
    path = root / MANIFEST_DIR / f"rank{rank}.json"
    manifest = change(json.loads(path.read_text()))
    if sign and isinstance(manifest, dict):
        try:
            manifest["signature"] = _signature(_Manifest.model_validate(manifest).model_dump(mode="json"))
        except ValidationError:  # malformed: refused before its signature is read
            pass
    path.write_text(json.dumps(manifest))


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


def test_a_checkpoint_not_signed_with_the_clusters_key_is_never_loaded(tmp_path, monkeypatch):
    """Whoever can write the storage but does not hold the key cannot make a worker unpickle their
    files: a manifest changed without the key, one without a signature, one signed with another
    cluster's key, and a file to be deserialized that no manifest lists are all refused."""
    root = _checkpoint(tmp_path / "ckpt")
    (root / "ds" / "shard_1.pt").write_bytes(b"planted" * 10)
    entry = {"size": 70, "sha256": hashlib.sha256(b"planted" * 10).hexdigest()}
    _rewrite(root, 1, lambda m: {**m, "files": {**m["files"], "ds/shard_1.pt": entry}}, sign=False)
    assert ("rank1.json is signed with another key (not written by this cluster, whose checkpoint key is "
            "FLOTILLA_CHECKPOINT_KEY): untrusted") in problems(str(root))
    _rewrite(root, 1, lambda m: {k: v for k, v in m.items() if k != "signature"}, sign=False)
    assert any(p.startswith("rank1.json is unsigned") for p in problems(str(root)))

    root = _checkpoint(tmp_path / "other")
    monkeypatch.setenv("FLOTILLA_CHECKPOINT_KEY", "another cluster")
    signing_key.cache_clear()
    try:
        assert all("signed with another key" in p for p in problems(str(root))[:2])
    finally:
        monkeypatch.undo()
        signing_key.cache_clear()
    assert problems(str(root)) == []
    (root / "ds" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"planted")
    (root / "extra.pkl").write_bytes(b"planted")
    assert problems(str(root)) == ["ds/zero_pp_rank_2_mp_rank_00_optim_states.pt, extra.pkl are in no manifest: "
                                   "untrusted"]


def test_without_a_configured_key_one_of_the_users_own_is_made_private_once(tmp_path, monkeypatch):
    """On one machine with no FLOTILLA_CHECKPOINT_KEY and no Ray token, processes share a key made
    once in the user's home, mode 600; the Ray token, where there is one, is used before it."""
    import os
    import stat

    for name in ("FLOTILLA_CHECKPOINT_KEY", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    signing_key.cache_clear()
    try:
        key, source = signing_key()
        path = tmp_path / ".flotilla" / "checkpoint_key"
        assert source == "~/.flotilla/checkpoint_key" and stat.S_IMODE(path.stat().st_mode) == 0o600
        signing_key.cache_clear()
        assert signing_key()[0] == key  # the same key again, read from the file
        os.chmod(path, 0o644)
        signing_key.cache_clear()
        with pytest.raises(Exception, match="not private to this user"):
            signing_key()
        monkeypatch.setenv("RAY_AUTH_TOKEN", "the cluster's token")
        signing_key.cache_clear()
        token_key, source = signing_key()
        assert source == "the Ray token" and token_key not in (key, b"the cluster's token")
    finally:
        monkeypatch.undo()
        signing_key.cache_clear()
