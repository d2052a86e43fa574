"""The model registry: versions, the `candidate` and `champion` aliases, promotion and rollback.

Each promotion to `champion` is appended to the registered model's tag `flotilla.champion_history`
(comma-separated versions), so a rollback knows which version was champion before.

MLflow has no compare-and-set, so every change of `champion` (a gate's promotion, `flotilla
promote`, a rollback) holds the model's promotion lock (`promotion_lock`): a registered model
named `<model>.flotilla-promotion-lock` that exists while one process reads and changes the
champion. Creating a registered model is atomic in every MLflow store (its name is a unique key),
so two gates that pass at once take turns, and the second compares itself with the champion the
first left; a rollback never erases a promotion that landed in between.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from flotilla.errors import SpecError, TrackingError
from flotilla.track._reference import ModelReference, parse_model_reference
from flotilla.track._store import lost_insert_race, retry_lost_insert

CANDIDATE, CHAMPION = "candidate", "champion"
HISTORY_TAG = "flotilla.champion_history"
GATE_TAG = "flotilla.gate"  # "passed" or "failed", on every version a Flotilla run registered
LOCK_SUFFIX = ".flotilla-promotion-lock"
LOCK_OWNER_TAG, LOCK_EXPIRES_TAG = "flotilla.lock_owner", "flotilla.lock_expires"
LOCK_LEASE_S = 300.0  # a lock older than this was left by a process that died holding it
LOCK_WAIT_S = 600.0


@contextlib.contextmanager
def promotion_lock(client: MlflowClient, name: str, wait_s: float = LOCK_WAIT_S,
                   lease_s: float = LOCK_LEASE_S) -> Iterator[None]:
    """Hold `name`'s promotion lock while the block runs (see the module's docstring): wait for
    another holder up to `wait_s`, and take over a lock whose lease has run out."""
    lock = name + LOCK_SUFFIX
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.create_registered_model(lock, tags={LOCK_OWNER_TAG: owner,
                                                       LOCK_EXPIRES_TAG: f"{time.time() + lease_s:.3f}"},
                                           description=f"Held while {owner} changes {name}'s champion; Flotilla "
                                           "removes it. One older than its expiry is taken over.")
            break
        except MlflowException as e:
            # RESOURCE_DOES_NOT_EXIST: MLflow's SQL store answers a duplicate name by reading the
            # existing model, which its holder released in between; the lock is free, try again.
            if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST") and not lost_insert_race(e):
                raise
        _take_over_if_expired(client, lock)
        if time.monotonic() > deadline:
            raise TrackingError(f"{name}: another process has held the promotion lock (registered model {lock!r}) "
                                f"for over {wait_s:g} s; if none is promoting, delete that registered model")
        time.sleep(random.uniform(0.02, 0.2))
    try:
        yield
    finally:
        with contextlib.suppress(MlflowException):
            if client.get_registered_model(lock).tags.get(LOCK_OWNER_TAG) == owner:
                client.delete_registered_model(lock)


def _take_over_if_expired(client: MlflowClient, lock: str) -> None:
    """Remove `lock` if its lease has run out: renamed first (one process wins the rename), then
    checked to be the expired one (not a fresh lock taken meanwhile, which is given back)."""
    try:
        held = client.get_registered_model(lock)
    except MlflowException:
        return  # released meanwhile
    if float(held.tags.get(LOCK_EXPIRES_TAG, "inf")) > time.time():
        return
    expired = f"{lock}.expired-{uuid.uuid4().hex}"
    try:
        client.rename_registered_model(lock, expired)
    except MlflowException:
        return  # another process took it over first
    if client.get_registered_model(expired).tags.get(LOCK_OWNER_TAG) != held.tags.get(LOCK_OWNER_TAG):
        with contextlib.suppress(MlflowException):
            client.rename_registered_model(expired, lock)  # a fresh lock: its holder's again
        return
    client.delete_registered_model(expired)


@dataclass
class AliasChange:
    model: str
    alias: str
    before: str | None  # version, or None when the alias was unset
    after: str

    def describe(self, verb: str = "promoted") -> str:
        was = f"v{self.before}" if self.before else "unset"
        if self.before == self.after:
            return f"{self.model}@{self.alias} stays v{self.after} (no change)"
        return f"{self.model}@{self.alias}: {was} -> v{self.after} ({verb})"


def resolve_reference(client: MlflowClient, reference: str | ModelReference, command: str) -> tuple[str, str]:
    """`--model NAME@ALIAS` or `NAME/VERSION` (`models:/...` too) as (name, version), the version checked to exist."""
    ref = parse_model_reference(reference, paths=False, command=command)
    name, alias, version = ref.name, ref.alias, ref.version
    if ref.target is None:
        raise SpecError([f"--model {ref.text!r}: name the version, NAME@ALIAS (digits@champion) or NAME/VERSION "
                         "(digits/3)"], command)
    try:
        if alias is not None:
            version = str(client.get_model_version_by_alias(name, alias).version)
        client.get_model_version(name, version)
    except MlflowException as e:
        raise TrackingError(f"--model {ref.text!r}: {e.message} (store {client.tracking_uri})") from None
    return name, version


def ensure_registered_model(client: MlflowClient, name: str) -> None:
    try:
        client.create_registered_model(name, description="Registered by Flotilla.")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def champion_history(client: MlflowClient, name: str) -> list[str]:
    tag = client.get_registered_model(name).tags.get(HISTORY_TAG, "")
    return [v for v in tag.split(",") if v]


def set_alias(client: MlflowClient, name: str, alias: str, version: str, force: bool = False,
              locked: bool = False) -> AliasChange:
    """Point `alias` at `version`; promotions to champion are remembered for rollback, happen under
    the promotion lock (`locked`: the caller holds it already), and take only a version that passed
    its gate (`force`: any version)."""
    _check_version(client, name, version)
    if alias != CHAMPION:
        before = alias_version(client, name, alias)
        # Two pipelines setting an alias of one model at once: the first write can fail on the other's insert.
        retry_lost_insert(lambda: client.set_registered_model_alias(name, alias, str(version)))
        return AliasChange(name, alias, before, str(version))
    if not force:
        gate = client.get_model_version(name, str(version)).tags.get(GATE_TAG)
        if gate != "passed":
            why = ("failed its gate" if gate == "failed" else
                   "waits for its harness scores (gate pending: `flotilla eval` measures them and promotes it if its "
                   "rules hold)" if gate == "pending" else "has no gate record (not registered by a Flotilla run)")
            raise TrackingError(f"{name} v{version} {why}; champion stays v{alias_version(client, name, CHAMPION)}. "
                                "Promote it anyway with `flotilla promote --force`")
    with contextlib.nullcontext() if locked else promotion_lock(client, name):
        before = alias_version(client, name, alias)
        retry_lost_insert(lambda: client.set_registered_model_alias(name, alias, str(version)))
        if before != str(version):
            _record_promotion(client, name, before, str(version))
    return AliasChange(name, alias, before, str(version))


def _record_promotion(client: MlflowClient, name: str, before: str | None, version: str) -> None:
    """Append `version` to the champion history (under the promotion lock; a champion set outside
    Flotilla, without it, is appended too). The first write of a new tag can fail on a concurrent
    insert: a failed write is retried, and the tag is read back until it ends with the version the
    `champion` alias points at now."""
    for attempt in range(8):
        history = champion_history(client, name)
        if before and before not in history[-1:] and version not in history[-1:]:
            history.append(before)  # a champion set outside Flotilla
        if version not in history[-1:]:
            history.append(version)
        current = alias_version(client, name, CHAMPION)
        if current and current not in history[-1:]:
            history.append(current)  # promoted by another pipeline after us
        try:
            client.set_registered_model_tag(name, HISTORY_TAG, ",".join(history[-100:]))
        except MlflowException as e:
            if not lost_insert_race(e):
                raise
        else:
            written = champion_history(client, name)
            if written and written[-1] == alias_version(client, name, CHAMPION):
                return
        time.sleep(0.1 * (attempt + 1))
    raise TrackingError(f"{name}: the champion history tag {HISTORY_TAG} kept changing under concurrent promotions; "
                        f"it is {client.get_registered_model(name).tags.get(HISTORY_TAG)!r}, champion "
                        f"v{alias_version(client, name, CHAMPION)}")


def rollback_champion(client: MlflowClient, name: str) -> AliasChange:
    """Point `champion` back at the version that held it before the current one (under the
    promotion lock: a promotion that lands meanwhile is rolled back or kept whole, never erased)."""
    _check_model(client, name)
    with promotion_lock(client, name):
        return _rollback(client, name)


def _rollback(client: MlflowClient, name: str) -> AliasChange:
    current = alias_version(client, name, CHAMPION)
    history = champion_history(client, name)
    while history and history[-1] == current:
        history.pop()
    if current is None or not history:
        raise TrackingError(
            f"{name}: no earlier champion to roll back to (champion is {f'v{current}' if current else 'unset'}, "
            f"history {client.get_registered_model(name).tags.get(HISTORY_TAG) or 'empty'}); "
            f"promote a version instead: pipelines/promote.py --model {name} --version N"
        )
    previous = history[-1]
    client.set_registered_model_alias(name, CHAMPION, previous)
    client.set_registered_model_tag(name, HISTORY_TAG, ",".join(history))
    return AliasChange(name, CHAMPION, current, previous)


def _check_model(client: MlflowClient, name: str) -> None:
    try:
        client.get_registered_model(name)
    except MlflowException:
        names = sorted(m.name for m in client.search_registered_models(max_results=50))
        raise TrackingError(
            f"no registered model {name!r}; registered models: {', '.join(names) or 'none'}"
        ) from None


def _check_version(client: MlflowClient, name: str, version: str) -> None:
    _check_model(client, name)
    try:
        client.get_model_version(name, str(version))
    except MlflowException:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        raise TrackingError(
            f"{name} has no version {version!r}; versions: {', '.join(map(str, versions)) or 'none'}"
        ) from None
