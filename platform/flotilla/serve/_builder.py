"""Application builders behind `serve run serve_apps.<kind>:app key=value ...` and `serve deploy`.

    serve run serve_apps.classifier:app model=digits alias=champion --route-prefix /v1/models/digits
    serve run serve_apps.generator:app config=configs/pycode_gpt.yaml version=3

Arguments: `config` (a run spec; its `serve` section) or `model` (then the built-in defaults), `alias` or
`version` (one target, all traffic), `traffic` (`champion=90,candidate=10`), `tracking_uri`, `set`
(spec overrides).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from flotilla.errors import ServeError
from flotilla.serve._deploy import build_application, plan_deployment
from flotilla.spec import load_spec, traffic_override

ROOT = Path(__file__).resolve().parents[3]


class AppArgs(BaseModel):
    """What `serve run ... key=value` and a config file's `args:` may say."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = Field(None, description="Run spec whose `serve` section configures the endpoint.")
    model: str | None = Field(None, description="Registered model; default from the spec.")
    alias: str | None = Field(None, description="Serve this alias with all traffic (default: the spec's traffic).")
    version: str | None = Field(None, description="Serve this version with all traffic.")
    traffic: str | None = Field(None, description="A split such as `champion=90,candidate=10`.")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI; default from the spec (whose default "
                                     "is MLFLOW_TRACKING_URI in the environment of the node that builds the app).")
    set: list[str] = Field([], description="Spec overrides, as `--set` takes them: ['serve.replica.num_cpus=2'].")


def build_app(args: dict, kind: str):
    parsed = AppArgs.model_validate(args or {})
    overrides = list(parsed.set)
    chosen = [x for x in (parsed.alias, parsed.version, parsed.traffic) if x]
    if len(chosen) > 1:
        raise ServeError("give one of alias=, version= or traffic=")
    if parsed.alias or parsed.version:
        overrides.append(f"serve.traffic={{{(parsed.alias or parsed.version)!r}: 100}}")
    elif parsed.traffic:
        overrides.append(traffic_override(parsed.traffic))
    if not parsed.config and not parsed.model:
        raise ServeError(f"serve_apps.{kind}:app needs model=NAME (a registered model) or config=SPEC.yaml")
    # Without a spec, the built-in defaults configure the endpoint (`flotilla config`, section serve).
    spec = load_spec(_config_path(parsed.config) if parsed.config else None, overrides)
    plan = plan_deployment(spec, model=parsed.model, tracking_uri=parsed.tracking_uri)
    if plan.kind != kind:
        raise ServeError(f"{plan.model} is served by serve_apps.{plan.kind}:app, not serve_apps.{kind}:app")
    return build_application(plan)


def _config_path(config: str) -> Path:
    """A relative path from the working directory, else from the checkout (Serve builds apps elsewhere)."""
    path = Path(config)
    if path.is_absolute() or path.exists():
        return path
    return ROOT / path if (ROOT / path).exists() else path
