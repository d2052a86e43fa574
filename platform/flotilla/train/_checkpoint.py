"""Checkpoints that can be verified before they are loaded.

Every rank writes its DeepSpeed files (and its RNG state) into its own directory, then, last,
a manifest `manifest/rank{r}.json` listing each file with its size and SHA-256. Ray Train
merges the ranks' directories into one checkpoint in the run's storage. A checkpoint is
complete when every rank's manifest is there and every listed file matches; anything else
(a rank that died mid-write, a truncated upload) is torn and is never loaded: the newest
complete earlier checkpoint of the run is used instead, or the run stops and says so.

A manifest is signed (HMAC-SHA256) with a key that is not in the storage: the cluster's
`FLOTILLA_CHECKPOINT_KEY`, else one derived from its Ray token (RAY_AUTH_TOKEN, the token file
`ray start` reads), else, on one machine, a key of the user's own (`~/.flotilla/checkpoint_key`,
made on first use, mode 600). DeepSpeed deserializes its files with pickle, so whoever can write
the storage could otherwise make every worker run their code: a manifest that is unsigned or
signed with another key, or a file to be deserialized that no manifest lists, makes the
checkpoint untrusted, and it is never loaded.

A checkpoint resumes at any world size. At the size that wrote it, DeepSpeed loads its own files.
At another size, a checkpoint whose optimizer state is partitioned across the ranks (ZeRO-1/2/3,
and DeepSpeed's bf16 optimizer) is first converted to DeepSpeed's universal checkpoint (one file
per parameter and optimizer state, `deepspeed.checkpoint.ds_to_universal`) in a local directory,
which DeepSpeed then loads partitioned for the new size (`checkpoint.load_universal`). The
conversion happens only when the size changed, so a checkpoint costs nothing more to write.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import hmac
import io
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
from pydantic import BaseModel, Field, ValidationError
from ray.train import Checkpoint

from flotilla.bundle import file_sha256
from flotilla.errors import CheckpointError

MANIFEST_DIR = "manifest"
STATE_FILE = "state.json"
DS_TAG = "ds"
UNIVERSAL_TAG = "ds_universal"


STAGING_PREFIX = "flotilla-ckpt-"
KEY_ENV = "FLOTILLA_CHECKPOINT_KEY"
_KEY_PURPOSE = b"flotilla checkpoint manifests v1"  # the Ray token is never used as a key as it is


@functools.lru_cache(maxsize=None)
def signing_key() -> tuple[bytes, str]:
    """The key that signs and checks checkpoint manifests, and where it came from."""
    secret, source = os.environ.get(KEY_ENV, "").encode(), KEY_ENV
    if not secret:
        secret, source = _ray_token(), "the Ray token"
    if not secret:
        secret, source = _own_key(Path.home() / ".flotilla" / "checkpoint_key"), "~/.flotilla/checkpoint_key"
    return hmac.new(secret, _KEY_PURPOSE, hashlib.sha256).digest(), source


def _ray_token() -> bytes:
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return token.encode()
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), Path.home() / ".ray" / "auth_token"):
        if path and Path(path).is_file():
            return Path(path).read_bytes().strip()
    return b""


def _own_key(path: Path) -> bytes:
    """This user's key, made at `path` (mode 600) when there is none; processes racing to make it
    all read the one that won."""
    if not path.is_file():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-")  # mode 600
        try:
            os.write(fd, os.urandom(32).hex().encode())
            os.close(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    if path.stat().st_uid != os.getuid() or path.stat().st_mode & 0o077:
        raise CheckpointError(f"{path} is not private to this user (owner and mode 600); remove it, or set "
                              f"{KEY_ENV} to the cluster's checkpoint key")
    return path.read_bytes().strip()


def _signature(manifest: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(signing_key()[0], body.encode(), hashlib.sha256).hexdigest()


def _deserialized(rel: str) -> bool:
    """Whether loading a checkpoint unpickles the file at `rel`: DeepSpeed's files and the RNG state."""
    return rel.startswith(DS_TAG + "/") or rel.endswith((".pt", ".pth", ".bin", ".pkl"))


def staging_dir(root: str | None = None) -> tempfile.TemporaryDirectory:
    """A directory to write this epoch's checkpoint in before Ray Train copies it to the run's
    storage, named for this host and process. A worker killed meanwhile leaves its own behind (as
    large as the model's checkpoint): those of this host's processes that no longer exist are
    removed first. (Another host's, in a temporary directory that hosts share, are left alone:
    their processes cannot be seen from here.)"""
    root = root or tempfile.gettempdir()
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())
    mine = re.compile(rf"{re.escape(STAGING_PREFIX + host)}-(\d+)-")
    for stale in Path(root).glob(f"{STAGING_PREFIX}{host}-*"):
        match = mine.match(stale.name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{host}-{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def save(engine, directory: str, rank: int, world_size: int, state: dict[str, Any]) -> None:
    """Write this rank's part of a checkpoint into `directory` (collective: all ranks call it)."""
    engine.save_checkpoint(directory, tag=DS_TAG)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, os.path.join(directory, f"rng_rank{rank}.pt"))
    if rank == 0:
        _write_json(Path(directory) / STATE_FILE, state)
    _write_manifest(directory, rank, world_size, state)


def written_world_size(directory: str) -> int:
    """How many ranks wrote the (verified) checkpoint in `directory`."""
    return _Manifest.model_validate_json((Path(directory) / MANIFEST_DIR / "rank0.json").read_bytes()).world_size


def needs_universal(directory: str, world_size: int) -> bool:
    """Whether resuming the checkpoint in `directory` on `world_size` ranks goes through DeepSpeed's
    universal checkpoint: the size changed and the optimizer state was partitioned (one
    `*optim_states.pt` file per rank; ZeRO-0 in fp32 keeps it whole in the model's file)."""
    return written_world_size(directory) != world_size and any((Path(directory) / DS_TAG).glob("*optim_states.pt"))


@dataclass
class Resumed:
    state: dict[str, Any]  # the checkpoint's STATE_FILE: epoch, global_step, history
    written_by: int  # the world size that wrote it
    converted_s: float | None  # seconds spent converting it to the universal form (None: loaded as written)


def load(engine, directory: str, rank: int, universal: bool) -> Resumed:
    """Restore model, optimizer, step, LR schedule position and RNG from a verified checkpoint directory.

    `universal`: `needs_universal(directory, world_size)`, for which the engine was built with
    `checkpoint.load_universal` (`flotilla.train._deepspeed_config`)."""
    # The LR schedule is not restored but recomputed from the current spec at the restored
    # step: a resumed run that asks for more epochs then decays over the new total.
    written_by, converted_s = written_world_size(directory), None
    with contextlib.ExitStack() as stack:
        load_dir, tag = directory, DS_TAG
        if universal:
            started = time.perf_counter()
            load_dir = stack.enter_context(staging_dir())
            tag = UNIVERSAL_TAG
            _to_universal(os.path.join(directory, DS_TAG), os.path.join(load_dir, tag))
            converted_s = time.perf_counter() - started
        load_path, _ = engine.load_checkpoint(load_dir, tag=tag, load_lr_scheduler_states=False)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint under {directory!r}")
    state = json.loads((Path(directory) / STATE_FILE).read_text())
    if engine.lr_scheduler is not None and state["global_step"] > 0:
        engine.lr_scheduler.step(state["global_step"] - 1)
    rng_file = Path(directory) / f"rng_rank{rank}.pt"
    if rng_file.exists():  # absent when the world grew since the checkpoint
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return Resumed(state, written_by, converted_s)


def _to_universal(source: str, target: str) -> None:
    """DeepSpeed's own conversion of the checkpoint in `source` into a universal one in `target`, in
    this process (no worker pool), its progress output kept out of the run's log. The checkpoints
    Flotilla writes lack the version record Megatron-DeepSpeed adds; the conversion adds it."""
    # (here, not at the top: DeepSpeed's import is heavy and only a resize needs its converter)
    from deepspeed.checkpoint.ds_to_universal import main as convert

    args = argparse.Namespace(input_folder=source, output_folder=target, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            convert(args)
    except Exception as e:
        tail = captured.getvalue().strip().splitlines()[-3:]
        raise CheckpointError(f"could not convert the checkpoint in {source} to resume it at another world size: "
                              f"{type(e).__name__}: {e}" + (f" ({' / '.join(tail)})" if tail else "")) from e


class _FileEntry(BaseModel):
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class _Manifest(BaseModel):
    """One rank's `manifest/rank{r}.json`: the files it wrote, relative to the checkpoint."""

    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    global_step: int = Field(ge=0)
    files: dict[str, _FileEntry]
    signature: str | None = None  # HMAC-SHA256 of the rest, with `signing_key()`


def _outside(root: Path, rel: str) -> bool:
    """A manifest path that is absolute, climbs out with `..`, or resolves (through a link) outside `root`."""
    if not rel or rel.startswith("/") or ".." in Path(rel).parts:
        return True
    return not (root / rel).resolve().is_relative_to(root.resolve())


def problems(directory: str) -> list[str]:
    """Why the checkpoint in `directory` is incomplete; an empty list means it is complete.

    Only the manifests are parsed (JSON, validated field by field); a manifest that is malformed,
    unsigned or signed with another key, names a path outside the checkpoint or disagrees with the
    files, or a file to be deserialized that no manifest lists, makes the checkpoint torn.
    Nothing is deserialised before this says the checkpoint is complete."""
    root = Path(directory)
    manifests = sorted((root / MANIFEST_DIR).glob("rank*.json"))
    if not manifests:
        return ["no rank manifests (the write never finished)"]
    found: list[str] = []
    ranks: set[int] = set()
    world_sizes: set[int] = set()
    listed: set[str] = set()
    for manifest_file in manifests:
        try:
            manifest = _Manifest.model_validate_json(manifest_file.read_bytes())
        except OSError:
            found.append(f"{manifest_file.name} is unreadable")
            continue
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "the document"
            found.append(f"{manifest_file.name} is malformed ({where}: {error['msg']})")
            continue
        if manifest_file.name != f"rank{manifest.rank}.json":
            found.append(f"{manifest_file.name} describes rank {manifest.rank}")
            continue
        if manifest.signature is None or not hmac.compare_digest(
                manifest.signature, _signature(manifest.model_dump(mode="json"))):
            found.append(f"{manifest_file.name} is {'unsigned' if manifest.signature is None else 'signed with another key'}"
                         f" (not written by this cluster, whose checkpoint key is {signing_key()[1]}): untrusted")
            continue
        listed.update(manifest.files)
        ranks.add(manifest.rank)
        world_sizes.add(manifest.world_size)
        for rel, meta in manifest.files.items():
            path = root / rel
            if _outside(root, rel):
                found.append(f"rank {manifest.rank}: {rel!r} is outside the checkpoint")
            elif not path.is_file():
                found.append(f"rank {manifest.rank}: {rel} is missing")
            elif path.stat().st_size != meta.size:
                found.append(f"rank {manifest.rank}: {rel} has {path.stat().st_size} bytes, expected {meta.size}")
            elif file_sha256(path) != meta.sha256:
                found.append(f"rank {manifest.rank}: {rel} does not match its checksum")
    if not found:
        unlisted = sorted(rel for path in root.rglob("*") if path.is_file()
                          for rel in [path.relative_to(root).as_posix()] if _deserialized(rel) and rel not in listed)
        if unlisted:
            found.append(f"{', '.join(unlisted[:3])} {'is' if len(unlisted) == 1 else 'are'} in no manifest: untrusted")
    if len(world_sizes) > 1:
        found.append(f"the manifests disagree on the world size ({', '.join(map(str, sorted(world_sizes)))})")
    elif world_sizes:
        missing = sorted(set(range(world_sizes.pop())) - ranks)
        if missing:
            found.append(f"manifests of rank(s) {', '.join(map(str, missing))} are missing")
    return found


def choose(latest: Checkpoint) -> tuple[Checkpoint, str | None]:
    """The newest complete checkpoint, starting from Ray's latest; and a note if it was not the latest."""
    with latest.as_directory() as directory:
        torn = problems(directory)
    if not torn:
        return latest, None
    fs: pafs.FileSystem = latest.filesystem
    parent = latest.path.rstrip("/").rpartition("/")[0]
    candidates = []
    for info in fs.get_file_info(pafs.FileSelector(parent, recursive=False)):
        if info.type != pafs.FileType.Directory or info.path.rstrip("/") == latest.path.rstrip("/"):
            continue
        try:
            with fs.open_input_stream(f"{info.path}/{STATE_FILE}") as f:
                step = json.loads(f.read())["global_step"]
        except (OSError, ValueError, KeyError):
            continue
        candidates.append((step, info.path))
    for _, path in sorted(candidates, reverse=True):
        candidate = Checkpoint(path=path, filesystem=fs)
        with candidate.as_directory() as directory:
            if not problems(directory):
                note = f"checkpoint {latest.path} is torn ({'; '.join(torn[:3])}); resuming from {path} instead"
                return candidate, note
    raise CheckpointError(
        f"checkpoint {latest.path} is torn ({'; '.join(torn[:3])}) and the run has no complete earlier "
        f"checkpoint under {parent}; start a new run (`--set train.run_name=<new name>`) or restore the files"
    )


def _write_manifest(directory: str, rank: int, world_size: int, state: dict[str, Any]) -> None:
    root = Path(directory)
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(MANIFEST_DIR + "/"):
            files[rel] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    manifest = {"rank": rank, "world_size": world_size, "global_step": state["global_step"], "files": files}
    manifest["signature"] = _signature(_Manifest.model_validate(manifest).model_dump(mode="json"))
    _write_json(root / MANIFEST_DIR / f"rank{rank}.json", manifest)


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
