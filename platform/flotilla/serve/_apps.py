"""`flotilla deploy-apps`: a Ray Serve config file deployed to a running cluster, with this
checkout as its applications' code.

    flotilla deploy-apps serve_apps/config.yaml --address http://HEAD:8265

Ray's `serve deploy` sends a config file as it is: the code its `import_path`s name must already be
on every node, or at a remote URI in the application's `runtime_env` (`working_dir: s3://...zip`).
This does for a Serve config what `ray job submit --working-dir .` does for a job: it uploads the
working directory (and Flotilla's package) to the cluster, names them in each application's
`runtime_env` (where the file gives none of its own), deploys the config through the same REST API
as `serve deploy`, and waits until every application runs. Every run rolls the applications: their
builders resolve aliases anew, so after `flotilla promote` the same command serves the new champion.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml

from flotilla.errors import ClusterError, ServeError
from flotilla.runtime import PACKAGE_DIR

DEFAULT_ADDRESS = "http://127.0.0.1:8265"


def deploy_apps(config_path: str | Path, *, address: str | None = None, working_dir: str | Path = ".",
                timeout_s: float = 300.0, say=print) -> dict[str, str]:
    """Deploy the Serve config at `config_path`; {application: its URL} once every one runs."""
    config = _read_config(Path(config_path))
    address = address or os.environ.get("RAY_DASHBOARD_ADDRESS") or DEFAULT_ADDRESS
    from ray.exceptions import AuthenticationError

    try:
        return _deploy(config, config_path, address, working_dir, timeout_s, say)
    except AuthenticationError as e:  # Ray's message says where the token goes
        raise ClusterError(f"the Ray dashboard at {address} refused the request: {e}") from None


def _deploy(config: dict, config_path, address: str, working_dir, timeout_s: float, say) -> dict[str, str]:
    client = _client(address)
    ship = os.environ.get("FLOTILLA_SHIP_PACKAGE", "1") != "0"
    deployed_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    uploaded: dict[str, dict] = {}
    for app in config["applications"]:
        runtime_env = dict(app.get("runtime_env") or {})
        runtime_env.setdefault("working_dir", str(Path(working_dir).resolve()))
        if ship:
            runtime_env.setdefault("py_modules", [PACKAGE_DIR])
        key = repr(sorted((k, v) for k, v in runtime_env.items() if k in ("working_dir", "py_modules")))
        if key not in uploaded:
            # Local paths become gcs:// packages in the cluster (skipped when already there), as
            # `ray job submit --working-dir .` uploads them: .gitignore'd files stay behind.
            packages = {k: runtime_env[k] for k in ("working_dir", "py_modules") if k in runtime_env}
            client._upload_working_dir_if_needed(packages)
            client._upload_py_modules_if_needed(packages)
            uploaded[key] = packages
        runtime_env.update(uploaded[key])
        # Serve rebuilds an app only when its import path, args or runtime_env change; this makes
        # every deploy a roll, so the builders resolve the apps' aliases anew (after a promote).
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), "FLOTILLA_DEPLOYED_AT": deployed_at}
        app["runtime_env"] = runtime_env
    names = [app["name"] for app in config["applications"]]
    say(f"deploying {', '.join(names)} from {config_path} to {address}")
    client.deploy_applications(config)
    return _wait_until_running(client, names, address, timeout_s, say)


def _read_config(path: Path) -> dict:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    if not path.is_file():
        raise ServeError(f"{path}: no such Serve config file (e.g. serve_apps/config.yaml)")
    try:
        config = yaml.safe_load(path.read_text())
        ServeDeploySchema.model_validate(config)
    except yaml.YAMLError as e:
        raise ServeError(f"{path} is not valid YAML: {e}") from None
    except ValidationError as e:
        problems = "\n".join(f"  - {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ServeError(f"{path} is not a Ray Serve config file (see serve_apps/config.yaml):\n{problems}") from None
    return config


def _client(address: str):
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    try:
        return ServeSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"cannot reach the Ray dashboard at {address} ({str(e).splitlines()[0]}); start the "
                           "cluster, or pass its dashboard with --address http://HEAD:8265 (or RAY_DASHBOARD_ADDRESS)"
                           ) from None


def _wait_until_running(client, names: list[str], address: str, timeout_s: float, say) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    while True:
        details = client.get_serve_details()
        apps = details.get("applications") or {}
        status = {name: (apps.get(name) or {}).get("status", "NOT_STARTED") for name in names}
        if status != last:
            say("  " + ", ".join(f"{name}: {state}" for name, state in status.items()))
            last = status
        failed = {n: apps[n].get("message", "") for n, s in status.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}
        if failed:
            raise ServeError("these applications failed to deploy:\n" + "\n".join(
                f"  - {n}: {m.strip()[-1500:]}" for n, m in failed.items()))
        if all(s == "RUNNING" for s in status.values()):
            return {n: _url(details, apps[n], address) for n in names}
        if time.monotonic() > deadline:
            raise ServeError(f"not running after {timeout_s:.0f} s: {', '.join(n for n, s in status.items() if s != 'RUNNING')}"
                             f"; see `serve status --address {address}`")
        time.sleep(2.0)


def _url(details: dict, app: dict, address: str) -> str:
    http = details.get("http_options") or {}
    host = http.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):  # listening everywhere: name the host the dashboard was reached at
        host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return f"http://{host}:{http.get('port', 8000)}{app.get('route_prefix') or '/'}"
