"""The serving replicas: one Ray Serve deployment per endpoint, FastAPI ingress, batched forwards.

A replica loads every version its traffic split (and shadow) names from the MLflow registry,
so choosing a version is a local decision: no second hop, exact weights, sticky callers stay
sticky on every replica. Changing the split or promoting a version is a `user_config` update,
applied in place by `reconfigure` (new versions load in a thread while the old split keeps
answering; the switch is one assignment), so no request in flight is dropped.

    Classifier   POST {prefix}/predict    {"instances": [[...], {...}]}
    Generator    POST {prefix}/generate   {"prompt": "def ", "max_tokens": 64, "stream": true}
    both         GET  {prefix}/           what is served: versions, aliases, split, shadow
                 GET  {prefix}/docs       OpenAPI docs
"""

# No `from __future__ import annotations` here: Serve's class-based FastAPI views need the
# route parameters' annotations (`request: Request`) as real types, not strings.
import asyncio
import collections
import json
import logging
import random
import threading
import time
from typing import Any, Awaitable, Callable

import numpy as np
import pandas as pd
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve

from flotilla.bundle import serving_app
from flotilla.redact import redact, redact_logger
from flotilla.data._columns import as_category, numeric_matrix
from flotilla.serve._replica_config import ReplicaConfig, ReplicaLimits, ShadowTarget
from flotilla.serve._routing import TrafficSplit
from flotilla.serve._schemas import (
    MAX_ERROR_BYTES,
    MAX_ERROR_MESSAGE,
    ErrorField,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    PredictRequest,
    PredictResponse,
    fields_summary,
    listed_fields,
    schema_of,
    shorten,
    validation_fields,
)
from flotilla.track import load_registered_bundle, registry_client

logger = logging.getLogger("ray.serve")
VERSION_HEADER = "X-Model-Version"
RUNTIME_HEADER = "X-Model-Runtime"
LATENCY_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
PARSE_ON_LOOP_BYTES = 16 * 1024  # larger bodies are parsed and validated in a thread
ROWS_ON_LOOP = 64  # more instances are checked against the model's columns in a thread


class ApiError(Exception):
    """An answer other than 200, with a body that says why."""

    def __init__(self, status: int, message: str, fields: list[ErrorField] | None = None, headers=None):
        message = shorten(message, MAX_ERROR_MESSAGE)
        super().__init__(message)
        self.status, self.message, self.fields, self.headers = status, message, listed_fields(fields or []), headers

    def response(self) -> Response:
        fields = list(self.fields)
        while True:  # under MAX_ERROR_BYTES, whatever characters the fields quote (the message alone fits)
            body = ErrorResponse(error=self.message, status=self.status, fields=fields).model_dump_json().encode()
            if len(body) <= MAX_ERROR_BYTES or not fields:
                return Response(body, status_code=self.status, headers=self.headers, media_type="application/json")
            fields.pop()


def _api(title: str, description: str,
         respond: Callable[[ApiError], Response] = ApiError.response) -> FastAPI:
    """An app whose every error, its own and the framework's (an unknown path 404, a wrong method
    405, an unexpected exception 500), is answered by `respond` in the app's one error shape."""
    api = FastAPI(title=title, description=description, version="1")

    @api.exception_handler(StarletteHTTPException)
    async def _framework(request: Request, exc: StarletteHTTPException) -> Response:
        message = {404: f"no route {request.url.path}; see /docs for this endpoint's routes",
                   405: f"{request.method} is not allowed on {request.url.path}; see /docs"}.get(exc.status_code,
                                                                                                 str(exc.detail))
        return respond(ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:  # a bug, not the client's fault
        logger.exception("unhandled error on %s", request.url.path)
        return respond(ApiError(500, f"internal error ({type(exc).__name__}); see the replica log"))

    return api


def _body_schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema_of(model)}}}}


_ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 413, 415, 422, 503, 504)}


def _error_event(status: int, message: str) -> str:
    """A server-sent event that ends a stream whose headers (200) are already sent."""
    return f"event: error\ndata: {json.dumps({'error': message, 'status': status})}\n\n"


def _is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def load_version(model: str, version: str, tracking_uri: str, factories: tuple[str, ...] = (), runtime: str = "torch"):
    """The inference bundle of registered `model` version `version`, from its bundle files only:
    no code that the registry holds runs in a replica, and a custom model's factory only when
    `factories` (`serve.allow_factories`) lists it (`flotilla.track.load_registered_bundle`); its
    model run by `runtime` (`serve.runtime`)."""
    return load_registered_bundle(registry_client(tracking_uri, check=False), model, version, factories, runtime)


class _ModelServer:
    """What both endpoints share: loading versions, routing, limits, metrics, health."""

    task_kind: str = ""  # "classifier" | "generator" | "chat" (`flotilla.bundle.serving_app`)
    batch_wait_setting = "batch_wait_timeout_s"  # the ReplicaConfig field bounding a batch's wait

    def __init__(self, model: str, tracking_uri: str, limits: dict[str, Any]):
        import torch

        self.model_name, self.tracking_uri = model, tracking_uri
        self.limits = ReplicaLimits.model_validate(limits)
        torch.set_num_threads(self.limits.num_cpus)  # one replica per reserved core; more threads only contend
        self.device = "cuda" if self.limits.num_gpus and torch.cuda.is_available() else "cpu"
        self.bundles: dict[str, Any] = {}
        self.split: TrafficSplit | None = None
        self.aliases: dict[str, list[str]] = {}
        self.shadow: ShadowTarget | None = None
        self.max_batch = 32
        self._pending: collections.deque = collections.deque()  # (requests, future) waiting for the model
        self._runner: asyncio.Task | None = None
        self._mirrors: set[asyncio.Task] = set()  # shadow forwards in flight (held: the loop keeps weak refs)
        # Serve warns when max_batch_size x max_concurrent_batches exceeds max_ongoing_requests; here
        # the concurrent "batches" are groups queued for one merged forward pass, so the sum is no limit.
        logging.getLogger("ray.serve").addFilter(lambda record: "max_concurrent_batches" not in record.getMessage())
        redact_logger(logging.getLogger("ray.serve"))  # a URI's secrets never reach the replica's log
        self._init_metrics()

    def _init_metrics(self) -> None:
        from ray.serve.metrics import Counter, Histogram

        tags = ("model", "version")
        self.m_requests = Counter("flotilla_requests", "Requests answered, by version and HTTP status.", tags + ("status",))
        self.m_latency = Histogram("flotilla_request_latency_ms", "Request latency in the replica (ms).", LATENCY_MS, tags)
        self.m_forward = Histogram("flotilla_forward_latency_ms", "Model forward pass latency (ms).", LATENCY_MS, tags)
        self.m_batch = Histogram("flotilla_batch_size", "Requests per batched forward pass.", BATCH_SIZES, tags)
        self.m_shadow = Counter("flotilla_shadow_requests", "Requests chosen for mirroring to the shadow version, by "
                                "outcome: agree yes/no, error, or dropped (the replica was busy).", tags + ("agree",))
        self.m_shadow_latency = Histogram("flotilla_shadow_latency_ms", "Shadow forward latency (ms).", LATENCY_MS, tags)
        self.m_tokens = Counter("flotilla_generated_tokens", "Tokens (bytes) generated, by version.", tags)
        self.m_outside = Counter("flotilla_out_of_profile_values", "Feature values outside the train split's profile "
                                 "(below_min, above_max, unseen_category), by column: answered, and counted here.",
                                 tags + ("column", "reason"))

    # ------------------------------------------------------------------ versions
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Load the versions a new split names (off the event loop), warm them up, then switch. A
        failure reaches `serve status` and the logs with the secrets of any URI it quotes masked."""
        try:
            await self._reconfigure(user_config)
        except Exception as e:
            raise RuntimeError(redact(f"{type(e).__name__}: {e}")) from None

    async def _reconfigure(self, user_config: dict[str, Any]) -> None:
        config = ReplicaConfig.model_validate(user_config)
        wanted = set(config.traffic) | ({config.shadow.version} if config.shadow else set())
        bundles = dict(self.bundles)
        for version in sorted(wanted - set(bundles)):
            bundles[version] = await asyncio.to_thread(self._load_and_warm, version, config)
        split = TrafficSplit(config.traffic)
        self._forward.set_max_batch_size(config.max_batch_size)
        self._forward.set_batch_wait_timeout_s(getattr(config, self.batch_wait_setting))
        self.max_batch = config.max_batch_size
        self.bundles = {v: b for v, b in bundles.items() if v in wanted}
        self.split, self.aliases, self.shadow = split, config.aliases, config.shadow
        logger.info("serving %s: split %s, shadow %s", self.model_name, split.percents(), self.shadow)

    def _load_and_warm(self, version: str, config: ReplicaConfig):
        runtime = self.limits.runtime
        if runtime == "auto" and self.device != "cpu":
            runtime = "torch"  # the ONNX variants run on the CPU
        bundle = load_version(self.model_name, version, self.tracking_uri, self.limits.allow_factories,
                              runtime).to(self.device)
        kind = serving_app(bundle.model_spec, bundle.task)
        if kind != self.task_kind:
            raise RuntimeError(f"{self.model_name} v{version} is a {bundle.task} model; serve it with the {kind} app")
        self.warm_up(bundle, config.max_batch_size)
        return bundle

    def check_health(self) -> None:
        """Serve calls this periodically: every loaded version must still answer a forward pass."""
        for version, bundle in list(self.bundles.items()):
            try:
                self.warm_up(bundle, 1)
            except Exception as e:
                raise RuntimeError(redact(f"{self.model_name} v{version} can no longer answer: {type(e).__name__}: "
                                          f"{e}")) from None

    def warm_up(self, bundle, rows: int) -> None:
        raise NotImplementedError

    async def _forward(self, items: list[tuple[str, Any, Any]]) -> list[Any]:
        """Each subclass's batched model call (`@serve.batch`): (version, bundle, request) -> answer."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shadow
    def mirror(self, run: Callable[[str, Any], Awaitable[Any]], agreement: Callable[[Any], float],
               busy: bool = False) -> None:
        """Shadow mode: with `serve.shadow.percent` chance, the answered request again on the shadow
        version (`run(version, bundle)`), in the background; how far its answer agrees with the
        primary's (`agreement`, 1.0 = the same) is counted and logged, never returned. A mirror only
        starts with fewer than `max_in_flight` running and the replica not `busy`; otherwise it is
        counted as dropped: under load the shadow thins out instead of doubling the replica's work."""
        shadow = self.shadow
        if shadow is None or shadow.version not in self.bundles or random.random() * 100 >= shadow.percent:
            return
        if len(self._mirrors) >= shadow.max_in_flight or busy:
            self.m_shadow.inc(tags={"model": self.model_name, "version": shadow.version, "agree": "dropped"})
            return
        task = asyncio.get_running_loop().create_task(self._mirror(shadow.version, run, agreement))
        self._mirrors.add(task)
        task.add_done_callback(self._mirrors.discard)

    async def _mirror(self, version: str, run, agreement) -> None:
        tags = {"model": self.model_name, "version": version}
        start = time.perf_counter()
        try:
            answer = await run(version, self.bundles[version])
            if isinstance(answer, Exception):  # a batched forward's answer for this request alone
                raise answer
        except Exception as e:  # a shadow failure must never reach a caller
            logger.warning("shadow v%s failed: %s: %s", version, type(e).__name__, e)
            self.m_shadow.inc(tags={**tags, "agree": "error"})
            return
        ms = (time.perf_counter() - start) * 1000
        agree = agreement(answer)
        self.m_shadow.inc(tags={**tags, "agree": "yes" if agree == 1 else "no"})
        self.m_shadow_latency.observe(ms, tags=tags)
        logger.info("shadow v%s: answered in %.1f ms, agreement %.3f with the primary", version, ms, agree)

    # ------------------------------------------------------------------ requests
    def info(self) -> dict[str, Any]:
        assert self.split is not None
        return {
            "model": self.model_name,
            "kind": self.task_kind,
            "traffic": self.split.percents(),
            "aliases": self.aliases,
            "shadow": self.shadow.model_dump() if self.shadow else None,
            "versions": sorted(self.bundles, key=int),
            "runtimes": {v: b.runtime for v, b in sorted(self.bundles.items())},
        }

    @staticmethod
    def headers(version: str, bundle) -> dict[str, str]:
        """Which version answered, and what ran its model."""
        return {VERSION_HEADER: version, RUNTIME_HEADER: bundle.runtime}

    def choose(self, request: Request) -> str:
        caller = request.headers.get(self.limits.sticky_header)
        return self.split.pick(caller)

    async def read_body(self, request: Request, schema):
        """The request's JSON body validated against `schema`: a missing or wrong type (415) or a
        size (413) is refused before parsing, JSON too deep or malformed gets 400, what fails the
        schema 422. A large body is parsed and validated in a thread, off the replica's event loop."""
        kind = request.headers.get("content-type")
        if kind is None or not _is_json(kind):
            sent = "untyped (no Content-Type header)" if kind is None else kind.split(";")[0].strip() or "untyped"
            raise ApiError(415, f"request body is {sent}; send JSON with the header "
                                "`Content-Type: application/json`")
        raw = await read_limited(request, self.limits.max_body_bytes)
        if len(raw) > PARSE_ON_LOOP_BYTES:
            return await asyncio.to_thread(self._parse, raw, schema)
        return self._parse(raw, schema)

    def _parse(self, raw: bytes, schema):
        try:
            obj = json.loads(raw)
        except RecursionError:  # the parser recurses per level; the schemas allow 3 ({"instances": [[...]]})
            raise ApiError(400, f"request body nests arrays or objects too deeply; send a JSON object like "
                                f"{self.example}") from None
        except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of thousands of digits
            raise ApiError(400, f"request body is not valid JSON: {e}; send a JSON object like {self.example}") from None
        try:
            return schema.model_validate(obj)
        except ValidationError as e:
            fields = validation_fields(e)
            raise ApiError(422, f"invalid request: {fields_summary(fields)}", fields) from None

    async def answer(self, request: Request, handler) -> Response:
        """Run `handler`, turning client errors into their status and recording metrics either way."""
        start = time.perf_counter()
        version = "none"
        try:
            version, response = await handler()
            status = response.status_code
        except ApiError as e:
            response, status = self.error_response(e), e.status
        except Exception:  # a server fault: counted, then answered 500 by the app's handler
            self.m_requests.inc(tags={"model": self.model_name, "version": version, "status": "500"})
            raise
        tags = {"model": self.model_name, "version": version}
        self.m_requests.inc(tags={**tags, "status": str(status)})
        self.m_latency.observe((time.perf_counter() - start) * 1000, tags=tags)
        return response

    def error_response(self, error: ApiError) -> Response:
        """The answer to a refused request (an app may speak another API's error shape)."""
        return error.response()

    async def with_timeout(self, awaitable, what: str):
        timeout = self.limits.request_timeout_s
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            raise ApiError(504, f"{what} took longer than {timeout:g} s (serve.request_timeout_s); retry later") from None


# ------------------------------------------------------------------------ classifier
# Serve serializes a deployment class when it is decorated, so everything its methods use is
# defined above this line.
def _check_finite(out: dict[str, list]) -> None:
    """422 naming the rows whose prediction is not a finite number: values the model overflows on
    (1e308, an integer of 25 digits) are valid JSON numbers, but no answer for them is."""
    bad: set[int] = set()
    for values in out.values():
        try:
            array = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):  # class labels that are not numbers
            continue
        if array.ndim:
            bad.update(np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).all(axis=1)).tolist())
    if bad:
        rows = sorted(bad)
        fields = [ErrorField(field=f"instances[{i}]", message="the model's output for this row is not a finite number; "
                             "its values are far outside the data it was trained on") for i in rows[:20]]
        raise ApiError(422, f"instances {', '.join(map(str, rows[:5]))}{' ...' if len(rows) > 5 else ''}: the model's "
                       "output is not a finite number; their values are far outside the data it was trained on", fields)


def _by_version(items: list[tuple], key: Callable[[tuple], Any] = lambda item: item[0]) -> dict[Any, list[int]]:
    """The positions of a batch's items (version first), by version (or by `key` of each item)."""
    groups: dict[Any, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return groups


async def read_limited(request: Request, limit: int) -> bytes:
    """A request's body, refused with 413 past `limit` bytes: by its declared length before reading,
    and as it arrives (a chunked body declares none)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; this endpoint accepts at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over {limit} bytes; this endpoint accepts at most {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _settle(done: asyncio.Future, result: Any = None, exception: Exception | None = None) -> None:
    if not done.done():
        done.set_result(result) if exception is None else done.set_exception(exception)


def bundle_columns(bundle) -> set[str]:
    cached = getattr(bundle, "_column_set", None)
    if cached is None:
        cached = set(bundle.schema.feature_columns)
        bundle._column_set = cached
    return cached


class _Columns:
    """What a version's feature columns accept, and the train split's range and values to flag
    requests by (`flotilla_out_of_profile_values`)."""

    def __init__(self, bundle):
        columns = bundle.schema.feature_columns
        profile = bundle.profile or {}
        categorical = set(bundle.categorical)
        self.names = columns
        self.kinds = ["categorical" if c in categorical else
                      "boolean" if profile.get(c, {}).get("dtype") == "bool" else "numeric" for c in columns]
        self.numeric_only = not categorical
        self.numeric = [i for i, k in enumerate(self.kinds) if k != "categorical"]
        lows = [profile.get(columns[i], {}).get("min") for i in self.numeric]
        highs = [profile.get(columns[i], {}).get("max") for i in self.numeric]
        self.low = np.array([-np.inf if v is None else v for v in lows], dtype=np.float64)
        self.high = np.array([np.inf if v is None else v for v in highs], dtype=np.float64)
        self.values = {c: set(profile[c]["values"]) for c in categorical if "values" in profile.get(c, {})}

    def problems(self, row: list) -> list[tuple[int, str]]:
        """(column index, message) for each value the column cannot take."""
        if self.numeric_only and all(type(v) is float or type(v) is int for v in row):
            return []
        found = []
        for j, (value, kind) in enumerate(zip(row, self.kinds)):
            if value is None or kind == "categorical":
                continue
            if isinstance(value, str) or (isinstance(value, bool) and kind != "boolean"):
                what = "a string" if isinstance(value, str) else "a boolean"
                found.append((j, f"column {self.names[j]!r} is numeric; send a number (or null when missing), "
                                 f"not {what}"))
        return found

    def outside(self, rows) -> dict[tuple[str, str], int]:
        """Counts of values outside the train split's profile: (column, reason) → values."""
        counts: dict[tuple[str, str], int] = {}
        if isinstance(rows, np.ndarray):
            numbers = rows[:, self.numeric]
        else:
            numbers = numeric_matrix(rows, [self.names[i] for i in self.numeric])
            for name, seen in self.values.items():
                values = rows[name].map(as_category)
                unseen = int((values.notna() & ~values.isin(seen)).sum())
                if unseen:
                    counts[(name, "unseen_category")] = unseen
        with np.errstate(invalid="ignore"):
            for reason, hits in (("below_min", numbers < self.low), ("above_max", numbers > self.high)):
                for j in np.flatnonzero(hits.any(axis=0)):
                    counts[(self.names[self.numeric[j]], reason)] = int(hits[:, j].sum())
        return counts


def bundle_kinds(bundle) -> _Columns:
    cached = getattr(bundle, "_kinds", None)
    if cached is None:
        cached = _Columns(bundle)
        bundle._kinds = cached
    return cached


classifier_api = _api("Flotilla classifier", "Predictions from a registered tabular model.")


@serve.deployment
@serve.ingress(classifier_api)
class Classifier(_ModelServer):
    task_kind = "classifier"
    example = '{"instances": [[0.0, 1.5, ...]]}'

    def warm_up(self, bundle, rows: int) -> None:
        bundle.predict(bundle.example_rows(rows))

    @classifier_api.get("/", summary="What this endpoint serves")
    def describe(self) -> dict[str, Any]:
        return self.info()

    @classifier_api.post("/predict", response_model=PredictResponse, responses=_ERRORS,
                         openapi_extra=_body_schema(PredictRequest), summary="Predict rows")
    async def predict(self, request: Request) -> Response:
        async def handle():
            body = await self.read_body(request, PredictRequest)
            version = self.choose(request)
            bundle = self.bundles[version]
            rows = (self.rows(body.instances, bundle) if len(body.instances) <= ROWS_ON_LOOP
                    else await asyncio.to_thread(self.rows, body.instances, bundle))
            self._flag_outside(version, bundle, rows)
            out = await self.with_timeout(asyncio.shield(self._forward((version, bundle, rows))), "prediction")
            if isinstance(out, Exception):  # its own rows failed; its batch-mates have their answers
                raise out
            _check_finite(out)
            payload = {"model": self.model_name, "version": version, **out}
            if bundle.classes is not None:
                payload["classes"] = bundle.classes
            primary = out["predictions"]
            self.mirror(lambda v, b: self._forward((v, b, rows)),
                        lambda shadow: sum(a == b for a, b in zip(shadow["predictions"], primary)) / max(1, len(primary)),
                        busy=bool(self._pending))
            return version, JSONResponse(payload, headers=self.headers(version, bundle))

        return await self.answer(request, handle)

    def rows(self, instances: list, bundle) -> np.ndarray | pd.DataFrame:
        """Instances → a float64 array in the model's column order (NaN for a missing value), or a
        frame of raw values where columns are categorical; or 422 naming what is wrong."""
        columns = bundle.schema.feature_columns
        kinds = bundle_kinds(bundle)
        limit = self.limits.max_instances
        if len(instances) > limit:
            raise ApiError(422, f"instances: {len(instances)} rows; at most {limit} per request (serve.max_instances)",
                           [ErrorField(field="instances", message=f"at most {limit} rows per request")])
        table = []
        fields = []
        for i, inst in enumerate(instances):
            if isinstance(inst, dict):
                missing = [c for c in columns if c not in inst]
                unknown = [k for k in inst if k not in bundle_columns(bundle)]
                if missing or unknown:
                    parts = ([f"missing {len(missing)} feature(s): {', '.join(missing[:5])}"] if missing else []) + (
                        [f"unknown feature(s): {', '.join(unknown[:5])}"] if unknown else [])
                    fields.append(ErrorField(field=f"instances[{i}]", message="; ".join(parts)))
                    continue
                row = [inst[c] for c in columns]
            elif len(inst) != len(columns):
                fields.append(ErrorField(field=f"instances[{i}]",
                                         message=f"{len(inst)} feature values; this model takes {len(columns)}"))
                continue
            else:
                row = inst
            for j, message in kinds.problems(row):
                where = f".{columns[j]}" if isinstance(inst, dict) else f"[{j}]"
                fields.append(ErrorField(field=f"instances[{i}]{where}", message=message))
            table.append(row)
        if fields:
            raise ApiError(422, f"invalid request: {fields_summary(fields)}", fields)
        if kinds.numeric_only:
            return np.array(table, dtype=np.float64)  # null → NaN, filled by the model's imputer
        return pd.DataFrame(table, columns=columns, dtype=object)

    def _flag_outside(self, version: str, bundle, rows) -> None:
        """Count values outside what the version was trained on (a range, a set of categories):
        served as usual, and visible as `flotilla_out_of_profile_values` by column and reason."""
        if bundle.profile is None:
            return
        for (column, reason), count in bundle_kinds(bundle).outside(rows).items():
            self.m_outside.inc(count, tags={"model": self.model_name, "version": version, "column": column,
                                            "reason": reason})

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002, max_concurrent_batches=64)
    async def _forward(self, items: list[tuple[str, Any, np.ndarray]]) -> list[dict[str, list] | Exception]:
        """`@serve.batch` groups the requests that arrive together; groups waiting for the model merge.
        Should a merged forward fail, each request runs again alone, and one whose rows fail gets
        its exception as its answer: a request never fails its batch-mates.

        Serve closes a batch `batch_wait_timeout_s` after its first request whether or not the
        model is free, so under load it produces many small batches that then queue for the
        model. Here they queue in `_pending`, and whenever the model becomes free it runs one
        forward pass over everything waiting (up to `max_batch_size` requests): full batches
        under load, and no added latency when quiet.
        """
        done = asyncio.get_running_loop().create_future()
        self._pending.append((items, done))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run_pending())
        return await done

    async def _run_pending(self) -> None:
        while self._pending:
            groups, count = [], 0
            while self._pending and (not groups or count + len(self._pending[0][0]) <= self.max_batch):
                group = self._pending.popleft()
                groups.append(group)
                count += len(group[0])
            merged = [item for items, _ in groups for item in items]
            try:
                results = await self._forward_versions(merged)
            except Exception as e:
                if len(merged) == 1:
                    _settle(groups[0][1], exception=e)
                    continue
                # One request's rows may be what failed: each request again alone, so its batch-mates
                # get their answers and only the failing one its error (returned, not raised).
                for items, done in groups:
                    answers: list[Any] = []
                    for item in items:
                        try:
                            answers += await self._forward_versions([item])
                        except Exception as alone:
                            answers.append(alone)
                    _settle(done, answers)
                continue
            offset = 0
            for items, done in groups:
                _settle(done, results[offset:offset + len(items)])
                offset += len(items)

    async def _forward_versions(self, items: list[tuple[str, Any, np.ndarray]]) -> list[dict[str, list]]:
        results: list[dict[str, list] | None] = [None] * len(items)
        for version, idx in _by_version(items).items():
            bundle = items[idx[0]][1]
            parts = [items[i][2] for i in idx]
            rows = np.concatenate(parts) if isinstance(parts[0], np.ndarray) else pd.concat(parts, ignore_index=True)
            start = time.perf_counter()
            out = await asyncio.to_thread(bundle.predict, rows)
            tags = {"model": self.model_name, "version": version}
            self.m_forward.observe((time.perf_counter() - start) * 1000, tags=tags)
            self.m_batch.observe(len(idx), tags=tags)
            offset = 0
            for i in idx:
                n = len(items[i][2])
                results[i] = {key: values[offset:offset + n] for key, values in out.items()}
                offset += n
        return results


# ------------------------------------------------------------------------- generator
generator_api = _api("Flotilla generator", "Text generation from a registered gpt model.")


@serve.deployment
@serve.ingress(generator_api)
class Generator(_ModelServer):
    task_kind = "generator"
    batch_wait_setting = "generate_wait_s"
    example = '{"prompt": "def ", "max_tokens": 32}'

    def warm_up(self, bundle, rows: int) -> None:
        bundle.generate("def ", max_tokens=2, temperature=0.0)

    @generator_api.get("/", summary="What this endpoint serves")
    def describe(self) -> dict[str, Any]:
        return self.info()

    @generator_api.post("/generate", response_model=GenerateResponse, responses=_ERRORS,
                        openapi_extra=_body_schema(GenerateRequest), summary="Generate text")
    async def generate(self, request: Request) -> Response:
        async def handle():
            body = await self.read_body(request, GenerateRequest)
            cap = self.limits.max_new_tokens
            if body.max_tokens > cap:
                raise ApiError(422, f"invalid request: max_tokens: {body.max_tokens} is above this endpoint's "
                               f"limit of {cap} (serve.max_new_tokens)",
                               [ErrorField(field="max_tokens", message=f"at most {cap}")])
            version = self.choose(request)
            bundle = self.bundles[version]
            kwargs = dict(max_tokens=body.max_tokens, temperature=body.temperature, top_k=body.top_k or None,
                          seed=body.seed)
            headers = self.headers(version, bundle)
            if body.stream:
                return version, StreamingResponse(self._events(bundle, version, body.prompt, kwargs),
                                                  media_type="text/event-stream", headers=headers)
            text = await self.with_timeout(self._generate(bundle, version, body.prompt, kwargs), "generation")
            return version, JSONResponse({"model": self.model_name, "version": version, "text": text}, headers=headers)

        return await self.answer(request, handle)

    async def _generate(self, bundle, version: str, prompt: str, kwargs: dict) -> str:
        """The whole text, decoded together with the requests that arrived with it (`_forward`);
        its generation stops after the current token once this request is over: answered, timed
        out (504) or cancelled because its client went away."""
        stop = threading.Event()
        try:
            text = await self._forward((version, bundle, ({"prompt": prompt, **kwargs}, stop)))
            if isinstance(text, Exception):  # its own generation failed; its batch-mates have their texts
                raise text
            return text
        finally:
            stop.set()

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002, max_concurrent_batches=64)
    async def _forward(self, items: list[tuple[str, Any, tuple[dict, threading.Event]]]) -> list[str]:
        """`@serve.batch` groups the requests that arrive together, and each group of one version
        decodes in one pass per token (`InferenceBundle.generate_batch`) in a thread of its own: a
        request that arrives while others generate starts at once instead of waiting for them.
        Requests that cannot decode together (`batchable`) run side by side, a thread each; should a
        batch fail, each of its requests runs again alone, and one that fails gets its exception as
        its answer."""
        results: list[str | Exception] = [""] * len(items)
        for version, idx in _by_version(items).items():
            bundle = items[idx[0]][1]
            requests, stops = [items[i][2][0] for i in idx], [items[i][2][1] for i in idx]
            start = time.perf_counter()

            async def alone(request: dict, stop: threading.Event) -> str | Exception:
                try:
                    return (await asyncio.to_thread(bundle.generate_batch, [request], [stop]))[0]
                except Exception as e:  # this request's own failure: answered to it alone
                    return e

            texts = None
            if bundle.batchable(requests) and len(requests) > 1:
                try:
                    texts = await asyncio.to_thread(bundle.generate_batch, requests, stops)
                except Exception:  # one request may be what failed: each again alone
                    logger.exception("a batch of %d generations failed; each runs again alone", len(requests))
            if texts is None:  # each in a thread of its own, as they would run alone
                texts = await asyncio.gather(*(alone(r, s) for r, s in zip(requests, stops)))
            tags = {"model": self.model_name, "version": version}
            self.m_forward.observe((time.perf_counter() - start) * 1000, tags=tags)
            self.m_batch.observe(len(idx), tags=tags)
            self._count_tokens(version, sum(len(t) for t in texts if isinstance(t, str)))
            for i, text in zip(idx, texts):
                results[i] = text
        return results

    def _count_tokens(self, version: str, count: int) -> None:
        if count:  # Ray's counters take only positive increments
            self.m_tokens.inc(count, tags={"model": self.model_name, "version": version})

    async def _events(self, bundle, version: str, prompt: str, kwargs: dict):
        """Server-sent events: one `data: {"text": piece}` per decoded piece, then `data: [DONE]`.

        A piece is generated only when the previous one was sent, so a client that goes away stops
        the generation. A stream past `serve.request_timeout_s`, or whose generation fails, ends
        with one `event: error` (`data: {"error": ..., "status": ...}`) instead of `[DONE]`."""
        pieces = bundle.generate_stream(prompt, **kwargs)
        start = time.perf_counter()
        timeout = self.limits.request_timeout_s
        tags = {"model": self.model_name, "version": version}
        count = 0
        try:
            while True:
                if time.perf_counter() - start > timeout:
                    yield _error_event(504, f"generation took longer than {timeout:g} s (serve.request_timeout_s); "
                                            f"ask for fewer max_tokens")
                    return
                piece = await asyncio.to_thread(next, pieces, None)
                if piece is None:
                    break
                count += 1
                yield f"data: {json.dumps({'text': piece})}\n\n"
        except Exception as e:  # the headers are sent: the stream itself says what went wrong
            logger.exception("stream of %s v%s failed", self.model_name, version)
            yield _error_event(500, f"generation failed ({type(e).__name__}); see the replica log")
            return
        finally:
            self._count_tokens(version, count)
        self.m_forward.observe((time.perf_counter() - start) * 1000, tags=tags)
        yield "data: [DONE]\n\n"

