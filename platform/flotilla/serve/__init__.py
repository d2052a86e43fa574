"""Serving with Ray Serve: registered models as autoscaling HTTP endpoints.

    plan = plan_deployment(spec)      # the spec's `serve` section; aliases resolved to versions once
    endpoint = deploy(plan)           # POST {endpoint.url}/predict  or  {endpoint.url}/generate
    build_application(plan)           # the Serve application, for `serve run` / `serve deploy` builders
    deploy_apps("serve_apps/config.yaml", address="http://HEAD:8265")  # a Serve config, with this checkout
    openai_router()                   # /v1: one OpenAI base URL for every language model, routed by `model`
"""

from flotilla.serve._apps import deploy_apps
from flotilla.serve._builder import AppArgs, build_app
from flotilla.serve._deploy import (
    DeploymentPlan,
    Endpoint,
    build_application,
    delete_endpoint,
    deploy,
    plan_deployment,
    promote_candidate,
    query_endpoint,
    running_ingress,
    sample_request,
    served_model,
)
from flotilla.serve._router import PRIVATE_APP_PREFIX, ROUTER_APP, OpenAIRouter, openai_router
from flotilla.serve._routing import TrafficSplit, sticky_point
from flotilla.serve._schemas import GenerateRequest, PredictRequest
from flotilla.spec import traffic_override
from flotilla.serve._server import RUNTIME_HEADER, VERSION_HEADER, Classifier, Generator, load_version

__all__ = [
    "PRIVATE_APP_PREFIX",
    "RUNTIME_HEADER",
    "VERSION_HEADER",
    "AppArgs",
    "build_app",
    "Classifier",
    "DeploymentPlan",
    "Endpoint",
    "GenerateRequest",
    "Generator",
    "PredictRequest",
    "TrafficSplit",
    "OpenAIRouter",
    "ROUTER_APP",
    "build_application",
    "delete_endpoint",
    "deploy",
    "deploy_apps",
    "load_version",
    "openai_router",
    "plan_deployment",
    "promote_candidate",
    "query_endpoint",
    "running_ingress",
    "sample_request",
    "served_model",
    "sticky_point",
    "traffic_override",
]
