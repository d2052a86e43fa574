"""The model registry: versions, the `candidate` and `champion` aliases, promotion and rollback.

Each promotion to `champion` is appended to the registered model's tag `flotilla.champion_history`
(comma-separated versions), so a rollback knows which version was champion before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from flotilla.errors import SpecError, TrackingError
from flotilla.track._reference import ModelReference, parse_model_reference
from flotilla.track._store import lost_insert_race, retry_lost_insert

CANDIDATE, CHAMPION = "candidate", "champion"
HISTORY_TAG = "flotilla.champion_history"


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


def set_alias(client: MlflowClient, name: str, alias: str, version: str) -> AliasChange:
    """Point `alias` at `version`; promotions to champion are remembered for rollback."""
    _check_version(client, name, version)
    before = alias_version(client, name, alias)
    # Two pipelines setting an alias of one model at once: the first write of it can fail on the other's insert.
    retry_lost_insert(lambda: client.set_registered_model_alias(name, alias, str(version)))
    if alias == CHAMPION and before != str(version):
        _record_promotion(client, name, before, str(version))
    return AliasChange(name, alias, before, str(version))


def _record_promotion(client: MlflowClient, name: str, before: str | None, version: str) -> None:
    """Append `version` to the champion history. MLflow has no compare-and-set: two gates promoting
    at once both read the tag and write it back, and the first write of a new tag can fail on
    the other's insert. So a failed write is retried, and the tag is read back until it ends with
    the version the `champion` alias points at now (whoever set it last)."""
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
    """Point `champion` back at the version that held it before the current one."""
    _check_model(client, name)
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
