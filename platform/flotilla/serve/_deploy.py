"""From a run spec's `serve` section to a running Ray Serve application.

    plan = plan_deployment(spec)            # aliases → versions, once; checks the model kind
    endpoint = deploy(plan)                 # serve.run(...), in place when the app already runs
    endpoint.url                            # http://127.0.0.1:8000/v1/models/digits

Aliases in `serve.traffic` and `serve.shadow` are resolved against the registry here, in the
driver, so every replica serves exactly the versions printed at deploy time.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.models import Model

from flotilla.bundle import MODEL_JSON, choose_runtime, serving_app
from flotilla.errors import BundleError, ServeError, TrackingError
from flotilla.runtime import HAPROXY_ENV, ensure_ray, started_local_haproxy, started_local_ray
from flotilla.spec import RunSpec, ServeSpec
from flotilla.track import (CANDIDATE, CHAMPION, alias_version, model_file, registered_bundle_file, registered_variants,
                            registry_client, set_alias)
from flotilla.serve._replica_config import ReplicaConfig, ReplicaLimits, ShadowTarget
from flotilla.serve._chat import Chat, _not_an_adapter_for
from flotilla.serve._server import RUNTIME_HEADER, VERSION_HEADER, Classifier, Generator

APP_KINDS = {"classifier": Classifier, "generator": Generator, "chat": Chat}


@dataclass
class DeploymentPlan:
    model: str
    kind: str  # classifier | generator | chat
    tracking_uri: str
    serve: ServeSpec
    traffic: dict[str, float]  # version -> weight
    aliases: dict[str, list[str]]  # version -> the aliases it was named by
    shadow: ShadowTarget | None = None

    @property
    def route_prefix(self) -> str:
        return self.serve.route_prefix or f"/v1/models/{self.model}"

    def user_config(self) -> dict[str, Any]:
        """What a replica may change in place (no restart): the split, shadow and batching."""
        return ReplicaConfig(
            traffic=self.traffic, aliases=self.aliases, shadow=self.shadow,
            max_batch_size=self.serve.batching.max_batch_size,
            batch_wait_timeout_s=self.serve.batching.batch_wait_timeout_s,
            generate_wait_s=self.serve.batching.generate_wait_s,
        ).model_dump(mode="json")

    def describe(self) -> str:
        total = sum(self.traffic.values())
        parts = [
            f"v{v} ({', '.join(self.aliases.get(v, [])) or 'by number'}) {100 * w / total:g}%"
            for v, w in self.traffic.items()
        ]
        shadow = f"; shadow v{self.shadow.version} on {self.shadow.percent:g}% of requests" if self.shadow else ""
        return f"{self.model}: {', '.join(parts)}{shadow}"


@dataclass
class Endpoint:
    plan: DeploymentPlan
    url: str
    app_name: str
    notes: list[str] = field(default_factory=list)


def served_model(spec: RunSpec, model: str | None = None) -> str:
    """The registered model an endpoint serves: `model`, else serve.model, track.model_name, name."""
    return model or spec.serve.model or spec.track.model_name or spec.name


def plan_deployment(spec: RunSpec, model: str | None = None, tracking_uri: str | None = None) -> DeploymentPlan:
    """Resolve the spec's traffic targets against the registry and decide the app kind."""
    name = served_model(spec, model)
    client = registry_client(tracking_uri or spec.track.uri)
    uri = client.tracking_uri
    try:
        client.get_registered_model(name)
    except Exception:
        raise ServeError(
            f"no registered model {name!r} in {uri}; train one first (python pipelines/train.py --config ...) "
            f"or name another with --set serve.model=NAME"
        ) from None

    def resolve(target: str, where: str) -> str:
        if target.isdigit():
            try:
                client.get_model_version(name, target)
            except Exception:
                raise ServeError(f"{where}: {name} has no version {target}") from None
            return target
        version = alias_version(client, name, target)
        if version is None:
            raise ServeError(
                f"{where}: {name} has no version with alias `{target}`; set one with "
                f"python pipelines/promote.py --model {name} --version N --alias {target}"
            )
        return version

    traffic: dict[str, float] = {}
    aliases: dict[str, list[str]] = {}
    for target, weight in spec.serve.traffic.items():
        version = resolve(target, f"serve.traffic.{target}")
        traffic[version] = traffic.get(version, 0.0) + weight
        if not target.isdigit():
            aliases.setdefault(version, []).append(target)
    traffic = {v: w for v, w in traffic.items() if w > 0}
    if not traffic:
        raise ServeError(f"serve.traffic gives no version a positive weight: {spec.serve.traffic}")
    shadow = None
    if spec.serve.shadow is not None:
        version = resolve(spec.serve.shadow.target, "serve.shadow.target")
        if not spec.serve.shadow.target.isdigit():
            aliases.setdefault(version, []).append(spec.serve.shadow.target)
        shadow = ShadowTarget(version=version, percent=spec.serve.shadow.percent,
                              max_in_flight=spec.serve.shadow.max_in_flight)
    served = set(traffic) | ({shadow.version} if shadow else set())
    _check_runtime(client, name, served, spec.serve.runtime)
    kinds = {v: _version_kind(client, name, v) for v in served}
    if len(set(kinds.values())) > 1:
        raise ServeError(f"{name}: the versions to serve are of different kinds {kinds}; one endpoint serves one kind")
    if shadow is not None and "generator" in kinds.values():
        raise ServeError(f"serve.shadow: {name} is a gpt model, whose endpoint mirrors no requests (classifiers and "
                         "fine-tuned pretrained models do); `--set serve.shadow=null`")
    if spec.serve.adapters.max_per_replica:
        _check_adapters(client, name, served, kinds, spec.serve)
    return DeploymentPlan(name, next(iter(kinds.values())), uri, spec.serve, traffic, aliases, shadow)


def _check_adapters(client, name: str, versions: set[str], kinds: dict[str, str], s: ServeSpec) -> None:
    """Many adapters on one base: language-model versions registered as adapters, run by torch."""
    where = "serve.adapters.max_per_replica"
    if set(kinds.values()) != {"chat"}:
        raise ServeError(f"{where}: {name} is a {next(iter(kinds.values()))} model; adapters on one base are for "
                         "fine-tuned language models (`model.kind: hf_causal_lm`)")
    if s.runtime != "torch":
        raise ServeError(f"{where}: adapters on one base run in torch; `--set serve.runtime=torch`")
    refused = {v: why for v in sorted(versions, key=int)
               if (why := _not_an_adapter_for(client.get_model_version(name, v).tags, None))}
    if refused:
        raise ServeError(f"{where}: " + "; ".join(f"{name} v{v}: {why}" for v, why in refused.items()) +
                         "; serve it with `--set serve.adapters.max_per_replica=0` (LoRA versions trained with "
                         "`model.lora.merge: false` are adapters)")


def _check_runtime(client, name: str, versions: set[str], runtime: str) -> None:
    """Before anything is deployed: each version holds the variant `serve.runtime` names, and it
    passed its gate, as its variant records say (the replica checks again when it loads the files)."""
    if runtime in ("torch", "auto"):
        return
    for version in sorted(versions, key=int):
        try:
            choose_runtime(registered_variants(client, name, version), runtime, f"{name} v{version}")
        except BundleError as e:
            raise ServeError(f"serve.runtime={runtime}: {e}") from None


def _version_kind(client, name: str, version: str) -> str:
    """Which app serves registered `name` version `version`: `flotilla.bundle.serving_app` of the
    model.json in its bundle (read alone, without the weights)."""
    with tempfile.TemporaryDirectory(prefix="flotilla-kind-") as tmp:
        found = registered_bundle_file(client, name, version, MODEL_JSON, Path(tmp))
        if found is None:
            raise TrackingError(f"{name} v{version}: no Flotilla bundle with a {MODEL_JSON} in its MLflow model")
        meta = json.loads(found.read_text())
    return serving_app(meta.get("model") or {}, (meta.get("schema") or {}).get("task", ""))


def build_application(plan: DeploymentPlan):
    """The Ray Serve application for a plan (what `serve run` / `serve deploy` builders return)."""
    s = plan.serve
    a = s.autoscaling
    deployment = APP_KINDS[plan.kind].options(
        name=f"{plan.kind}",
        ray_actor_options={"num_cpus": s.replica.num_cpus, "num_gpus": s.replica.num_gpus},
        autoscaling_config={
            "min_replicas": a.min_replicas,
            "initial_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s,
        },
        max_ongoing_requests=s.max_ongoing_requests,
        max_queued_requests=s.max_queued_requests,
        graceful_shutdown_timeout_s=s.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=min(2.0, max(0.1, s.graceful_shutdown_timeout_s / 10)),
        health_check_period_s=s.health_check_period_s,
        health_check_timeout_s=s.health_check_timeout_s,
        user_config=plan.user_config(),
    )
    return deployment.bind(plan.model, plan.tracking_uri, ReplicaLimits.from_spec(s).model_dump(mode="json"))


def deploy(plan: DeploymentPlan, app_name: str | None = None) -> Endpoint:
    """Start Serve if needed (on `serve.host:serve.port`) and run the app; in place if it runs already.

    A running app with the same name is updated: a new split is a `user_config` change that the
    replicas apply without restarting, and requests in flight finish on the old split.
    """
    import ray.util
    from ray import serve

    s = plan.serve
    ensure_ray(ingress=s.ingress)  # a running cluster must have been started with its ingress
    notes = []
    was_running = _proxy_address() is not None  # then its ingress actors are up already
    _start_serve({"host": s.host, "port": s.port, "request_timeout_s": s.request_timeout_s})
    # `auto` expects HAProxy where this process started the cluster with it (ensure_ray did, where it can run).
    expect_haproxy = s.ingress == "haproxy" or (s.ingress == "auto" and started_local_haproxy())
    running = running_ingress(expect_haproxy=expect_haproxy, timeout_s=5.0 if was_running else 30.0)
    if running == "proxy" and s.ingress == "haproxy":
        how = ("this process started Ray before the deployment asked for HAProxy; start Ray with them set"
               if started_local_ray() else "start the cluster with them set (see cluster.yaml)")
        raise ServeError(
            "serve.ingress=haproxy, but this Ray cluster's Serve runs its Python proxy: HAProxy ingress needs "
            f"{' '.join(f'{k}={v}' for k, v in HAPROXY_ENV.items())} in the environment of every Ray node "
            f"when Ray starts; {how}, or deploy with --set serve.ingress=proxy"
        )
    if running == "haproxy" and s.ingress == "proxy":
        notes.append("this cluster's Serve runs HAProxy ingress (it was started with RAY_SERVE_ENABLE_HA_PROXY=1); "
                     "serve.ingress=proxy applies to clusters started without it")
    actual = _proxy_address()
    if actual is not None and actual != (s.host, s.port):
        notes.append(f"Serve was already running on {actual[0]}:{actual[1]}; serve.host/serve.port apply at its next start")
    host, port = actual or (s.host, s.port)
    name = app_name or plan.model
    serve.run(build_application(plan), name=name, route_prefix=plan.route_prefix, blocking=False)
    # All interfaces: show this node's cluster address (127.0.0.1 on a laptop's local Ray).
    shown = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::") else host
    if plan.kind == "chat" and s.openai_router:
        notes += _ensure_router(s, f"http://{shown}:{port}")
    return Endpoint(plan, f"http://{shown}:{port}{plan.route_prefix}", name, notes)


def _ensure_router(s: ServeSpec, base: str) -> list[str]:
    """The OpenAI router at /v1 (`flotilla.serve._router`), started unless it runs: it finds the
    chat apps itself, so a model deployed later needs nothing from it."""
    from ray import serve

    from flotilla.serve._router import ROUTE_PREFIX, ROUTER_APP, openai_router

    running = serve.status().applications.get(ROUTER_APP)
    if running is not None and running.status in ("RUNNING", "DEPLOYING"):
        return []
    try:
        serve.run(openai_router(s.max_body_bytes), name=ROUTER_APP, route_prefix=ROUTE_PREFIX, blocking=False)
    except Exception as e:  # e.g. another application already serves /v1
        return [f"the OpenAI router was not started at {ROUTE_PREFIX}: {str(e).splitlines()[0]} "
                "(`--set serve.openai_router=false` to not ask for it)"]
    return [f"every language model here also answers at one OpenAI base URL: {base}{ROUTE_PREFIX} "
            "(the request's `model` chooses)"]


def _start_serve(http_options: dict[str, Any], attempts: int = 3) -> None:
    """`serve.start`, riding out a proxy that Serve's controller replaced while it started.

    The controller kills an ingress actor that is not ready within its own timeout (a loaded
    machine) and starts another; `serve.start`, which waits on the first one's readiness, then
    raises `ActorDiedError` although Serve is up and its next proxy is on the way. Asked again, it
    finds the running controller; `running_ingress` then waits for the ingress itself."""
    import ray.exceptions
    from ray import serve

    for attempt in range(attempts):
        try:
            serve.start(http_options=http_options)
            return
        except ray.exceptions.ActorDiedError as e:
            if attempt + 1 == attempts:
                raise ServeError(f"Serve's HTTP ingress died {attempts} times while starting: {e}; "
                                 "see the Serve logs under the Ray session's logs/serve/") from e


def running_ingress(expect_haproxy: bool = False, timeout_s: float = 30.0) -> str | None:
    """`haproxy` or `proxy`: what answers HTTP for this cluster's Serve (None if it cannot be told).

    Serve's controller starts its ingress actors shortly after `serve.start()`: HAProxy ingress
    runs an `HAProxyManager` per node (besides a fallback `ProxyActor` on the head, which does not
    count), the Python proxy only `ProxyActor`s. When HAProxy is expected, its manager gets
    `timeout_s` to appear. Asks the cluster this process is connected to.
    """
    import time

    import ray
    from ray.util.state import list_actors

    address = ray.get_runtime_context().gcs_address
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actors = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=10_000, raise_on_missing_output=False)
        except Exception:  # no state API (no dashboard): nothing to check against
            return None
        kinds = {a.class_name for a in actors
                 if not (a.class_name == "ProxyActor" and "fallback" in (getattr(a, "name", None) or ""))}
        if "HAProxyManager" in kinds:
            return "haproxy"
        if "ProxyActor" in kinds and (not expect_haproxy or time.monotonic() > deadline):
            return "proxy"
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)


def _proxy_address() -> tuple[str, int] | None:
    try:
        from ray.serve.context import _get_global_client

        config = _get_global_client().http_config
        return config.host, int(config.port)
    except Exception:
        return None


def sample_request(plan: DeploymentPlan) -> tuple[str, dict[str, Any]]:
    """A request the served model accepts: the logged input example (classifier) or a prompt."""
    if plan.kind == "generator":
        return "/generate", {"prompt": "def ", "max_tokens": 48, "temperature": 0.8, "top_k": 20, "seed": 0}
    if plan.kind == "chat":
        return "/v1/chat/completions", {"model": plan.model, "messages": [{"role": "user", "content": "What is 2 plus 3?"}],
                                        "max_tokens": 16, "temperature": 0}
    client = registry_client(plan.tracking_uri, check=False)
    version = next(iter(plan.traffic))
    with tempfile.TemporaryDirectory() as tmp:
        path = model_file(client, plan.model, version, "", Path(tmp))
        example = Model.load(str(path)).load_input_example(str(path))
    return "/predict", {"instances": example.astype("float64").to_numpy().tolist()}


def promote_candidate(spec: RunSpec, model: str | None = None, tracking_uri: str | None = None):
    """Point `champion` at the `candidate` version of the served model (an `AliasChange`)."""
    name = served_model(spec, model)
    client = registry_client(tracking_uri or spec.track.uri, check=False)
    version = alias_version(client, name, CANDIDATE)
    if version is None:
        raise ServeError(f"{name} has no `candidate` version to promote")
    return set_alias(client, name, CHAMPION, version)


def delete_endpoint(spec: RunSpec, model: str | None = None) -> str:
    """Remove the served model's Serve application; returns its name."""
    from ray import serve

    ensure_ray()
    name = served_model(spec, model)
    serve.delete(name)
    return name


def query_endpoint(endpoint: Endpoint) -> tuple[bool, list[str]]:
    """Send the sample request over HTTP; (answered 200, the lines that say what came back)."""
    import requests

    path, body = sample_request(endpoint.plan)
    response = requests.post(endpoint.url + path, json=body, timeout=60)
    lines = [f"POST {endpoint.url}{path} -> {response.status_code} from v{response.headers.get(VERSION_HEADER)} "
             f"({response.headers.get(RUNTIME_HEADER)})"]
    if response.status_code != 200:
        return False, lines + [response.text]
    answer = response.json()
    if "text" in answer:
        lines.append(f"prompt {body['prompt']!r} -> {answer['text']!r}")
    elif "choices" in answer:
        lines.append(f"{body['messages'][-1]['content']!r} -> {answer['choices'][0]['message']['content']!r}")
    else:
        probs = [max(p) for p in answer.get("probabilities") or []]
        shown = ", ".join(f"{pred} (p={p:.2f})" for pred, p in zip(answer["predictions"], probs)) or json.dumps(answer["predictions"])
        lines.append(f"{len(body['instances'])} rows -> predictions {shown}")
    return True, lines
