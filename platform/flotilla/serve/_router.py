"""One OpenAI base URL for every language model the cluster serves.

    GET  /v1/models              every model the chat applications answer for
    POST /v1/chat/completions    {"model": NAME, ...}: routed by `model`
    POST /v1/completions         {"model": NAME, ...}

    OpenAI(base_url="http://HOST:8000/v1", api_key="unused")

The router is a Serve application of its own (`openai`, at `/v1`; Serve sends a path to the
longest prefix that matches, so each model's own `/v1/models/NAME` stays with its app). It finds
the chat applications through Serve (`serve.status()`), asks each which models it answers for
(`Chat.served_models`), and forwards a request through the application's handle (`Chat.routed`):
the model's own validation, versions, canary split, sticky callers, batching, limits, metrics and
errors, streamed or whole. A model deployed after the router is found at its first request; an
unknown one gets OpenAI's 404 (`code: model_not_found`) naming the models there are.
"""

# No `from __future__ import annotations`: Serve's FastAPI views need real annotations (see _server).
import asyncio
import json
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from flotilla.redact import redact, redact_logger
from flotilla.serve._chat import openai_response
from flotilla.serve._openai import ChatCompletionRequest, CompletionRequest
from flotilla.serve._server import ApiError, _api, _body_schema, logger, read_limited

ROUTER_APP = "openai"
# Applications whose name starts so are not routed (`flotilla eval` serves a version for itself alone).
PRIVATE_APP_PREFIX = "flotilla-eval-"
ROUTE_PREFIX = "/v1"
CHAT_DEPLOYMENT = "chat"  # the ingress deployment of every chat application (`build_application`)
DIRECTORY_TTL_S = 5.0  # how long the router trusts what it found; an unknown model asks again at once
FRESH_AT_MOST_S = 1.0  # ...but not more often than this (made-up model names must not keep it asking)
ASK_TIMEOUT_S = 5.0  # an application that does not say what it serves within this keeps what it said last

router_api = _api("Flotilla OpenAI router", "One OpenAI-compatible base URL for every language model served here; "
                  "requests go to the model their `model` field names.", openai_response)


def _not_found(model: str, served: list[str]) -> ApiError:
    there = ", ".join(served) if served else "none (deploy one with `flotilla deploy`)"
    return ApiError(404, f"The model `{model}` does not exist here; models served: {there} (GET /v1/models)")


@serve.deployment(name="router", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(router_api)
class OpenAIRouter:
    def __init__(self, max_body_bytes: int = 1_000_000):
        redact_logger(logging.getLogger("ray.serve"))  # a URI's secrets never reach the router's log
        self.max_body_bytes = max_body_bytes
        self._models: dict[str, tuple[str, bool]] = {}  # model id -> its application, and whether multiplexed
        self._found_at = -1e9
        self._handles: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ the directory
    async def directory(self, fresh: bool = False) -> dict[str, tuple[str, bool]]:
        """Which application serves each model: found anew when `fresh` (at most once a second) or
        older than DIRECTORY_TTL_S. While one request finds it, the others use what was found last."""
        age = time.monotonic() - self._found_at
        if age < (FRESH_AT_MOST_S if fresh else DIRECTORY_TTL_S) or (self._lock.locked() and self._models and not fresh):
            return self._models
        async with self._lock:
            if time.monotonic() - self._found_at >= FRESH_AT_MOST_S:
                self._models = await self._find()
                self._found_at = time.monotonic()
            return self._models

    async def _find(self) -> dict[str, tuple[str, bool]]:
        status = await asyncio.to_thread(serve.status)
        apps = sorted(name for name, app in status.applications.items()
                      if name != ROUTER_APP and not name.startswith(PRIVATE_APP_PREFIX) and CHAT_DEPLOYMENT in app.deployments
                      and app.status in ("RUNNING", "DEPLOYING", "UNHEALTHY"))  # (an update in place still answers)

        async def ask(name: str) -> list[tuple[bool, str, str]]:
            try:
                handle = await self._handle(name)
                models = await asyncio.wait_for(handle.served_models.remote(), ASK_TIMEOUT_S)
                return [(m["multiplexed"], name, m["id"]) for m in models]
            except Exception as e:  # starting, busy or going away: what it served last, asked again next time
                logger.warning("router: application %s did not say what it serves (%s)", name,
                               redact(f"{type(e).__name__}: {e}")[:500])
                return [(multiplexed, name, model) for model, (app, multiplexed) in self._models.items() if app == name]

        listed = [entry for entries in await asyncio.gather(*(ask(name) for name in apps)) for entry in entries]
        found: dict[str, tuple[str, bool]] = {}
        for multiplexed, app, model in sorted(listed):  # an app's own model wins over another's adapter of it
            if model in found:
                if not multiplexed:
                    logger.warning("router: %s is served by %s and %s; routing to %s", model, found[model][0], app,
                                   found[model][0])
                continue
            found[model] = (app, multiplexed)
        return found

    async def _handle(self, app: str):
        if app not in self._handles:
            self._handles[app] = await asyncio.to_thread(serve.get_app_handle, app)
        return self._handles[app]

    # ------------------------------------------------------------------ routes
    @router_api.get("/models", summary="Every model served here, as OpenAI lists models")
    async def models(self) -> dict[str, Any]:
        served = await self.directory(fresh=True)
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "flotilla"}
                                           for m in sorted(served)]}

    @router_api.get("/models/{model}", summary="One model served here")
    async def model(self, model: str) -> Response:
        served = await self.directory(fresh=True)
        if model not in served:
            return self._error(_not_found(model, sorted(served)))
        return JSONResponse({"id": model, "object": "model", "created": 0, "owned_by": "flotilla"})

    @router_api.post("/chat/completions", summary="Routed to the model the body names (OpenAI chat completions)",
                     openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self._route(request, "/v1/chat/completions")

    @router_api.post("/completions", summary="Routed to the model the body names (OpenAI completions)",
                     openapi_extra=_body_schema(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self._route(request, "/v1/completions")

    # ------------------------------------------------------------------ forwarding
    @staticmethod
    def _error(error: ApiError) -> Response:
        response = openai_response(error)
        if error.status == 404:
            body = json.loads(response.body)
            body["error"].update(param="model", code="model_not_found")
            return JSONResponse(body, status_code=404)
        return response

    async def _route(self, request: Request, path: str) -> Response:
        try:
            raw = await read_limited(request, self.max_body_bytes)
            model = self._model_of(raw)
            name = model.split("@", 1)[0].split("/", 1)[0]  # NAME@ALIAS and NAME/VERSION go where NAME does
            served = await self.directory()
            if name not in served:
                served = await self.directory(fresh=True)
            if name not in served:
                raise _not_found(model, sorted(served))
        except ApiError as e:
            return self._error(e)
        app, multiplexed = served[name]
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        try:
            handle = (await self._handle(app)).options(stream=True)
            if multiplexed or name != model:  # to a replica that holds the adapter, where one does
                handle = handle.options(multiplexed_model_id=model)
            parts = handle.routed.remote(path, raw, headers)
            head = await parts.__anext__()
        except (BackPressureError, DeploymentUnavailableError, RayActorError) as e:  # gone or full: retry
            logger.warning("router: %s (serving %s) is not answering: %s", app, model, redact(str(e))[:500])
            self._handles.pop(app, None)
            self._found_at = -1e9
            return self._error(ApiError(503, f"the application serving `{model}` is not answering ({type(e).__name__}); "
                                             "retry shortly", headers={"Retry-After": "1"}))
        except Exception as e:  # a fault of the application's: as its own route would answer it
            logger.error("router: %s (serving %s) failed a request: %s", app, model, redact(str(e))[:2000])
            return self._error(ApiError(500, f"the application serving `{model}` failed ({type(e).__name__}); see its "
                                             "replica's log"))
        if head["stream"]:
            async def rest():
                async for part in parts:
                    yield part
            return StreamingResponse(rest(), status_code=head["status"], headers=head["headers"],
                                     media_type=head["media_type"])
        body = b"".join([part async for part in parts])
        return Response(body, status_code=head["status"], headers=head["headers"], media_type=head["media_type"])

    @staticmethod
    def _model_of(raw: bytes) -> str:
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError(400, "request body nests arrays or objects too deeply") from None
        except ValueError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}; send a JSON object with a `model`") from None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            raise ApiError(400, "invalid request: model: name the model to answer (one of GET /v1/models)")
        return model


def openai_router(max_body_bytes: int = 1_000_000):
    """The router application (what `serve run`/`serve deploy` builders return)."""
    return OpenAIRouter.bind(max_body_bytes)


__all__ = ["OpenAIRouter", "ROUTER_APP", "ROUTE_PREFIX", "openai_router"]
