"""The OpenAI-compatible endpoint of a fine-tuned pretrained model (`model.kind: hf_causal_lm`).

    POST {prefix}/v1/chat/completions   {"model": NAME, "messages": [{"role": "user", "content": "..."}]}
    POST {prefix}/v1/completions        {"model": NAME, "prompt": "..."}
    GET  {prefix}/v1/models             the served model, as OpenAI lists models
    GET  {prefix}/                      what is served: versions, aliases, split

A stock OpenAI client works with `base_url="http://HOST:PORT{prefix}/v1"`. Both generate with or
without `stream` (server-sent events, `data: [DONE]` last), honour `max_tokens` (capped by
`serve.max_new_tokens` and the model's context), `temperature`, `top_p`, `seed`, `stop` and
`logit_bias`, and answer errors in OpenAI's shape (`{"error": {"message", "type", "param",
"code"}}`). Versions, canary splits, sticky callers, limits, deadlines and metrics are those of
every Flotilla endpoint (`flotilla.serve._server`); a request whose client goes away, streamed or
not, stops generating at the next token.
Requests that arrive together decode together: whole-text ones (`Chat._forward`) and streams
(`Chat._stream_together`), each kind in batches of its own.
"""

# No `from __future__ import annotations`: Serve's FastAPI views need real annotations (see _server).
import asyncio
import contextvars
import itertools
import json
import queue
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from mlflow.exceptions import MlflowException
from ray import serve
from starlette.datastructures import Headers

from flotilla.bundle import AdapterSet, TextDecoder
from flotilla.errors import BundleError, SpecError, TrackingError
from flotilla.redact import redact
from flotilla.serve._logprobs import chat_logprobs, completion_logprobs, decoded_text
from flotilla.serve._openai import (
    AssistantMessage,
    ChatChoice,
    ChatLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    chat_stream,
    completion_stream,
    new_id,
    openai_error,
)
from flotilla.serve._replica_config import ReplicaConfig
from flotilla.serve._schemas import ErrorField
from flotilla.serve._server import (RUNTIME_HEADER, VERSION_HEADER, ApiError, _api, _body_schema, _by_version,
                                    _ModelServer, logger)
from flotilla.track import (CHAMPION, alias_version, bundle_in_model, download_model, parse_model_reference,
                            registry_client, resolve_reference)

MODEL_HEADER = "X-Model-Name"  # which registered model answered (an adapter's, on a replica that holds several)
LISTED_TTL_S = 5.0  # how long a replica trusts its list of the registry's adapters for its base



def openai_response(error: ApiError) -> Response:
    """An error in OpenAI's shape, which its clients read (`param`: the first field named)."""
    status, body = openai_error(error.message, error.status)
    if error.fields:
        body["error"]["param"] = error.fields[0].field
    return JSONResponse(body, status_code=status, headers=error.headers)


chat_api = _api("Flotilla chat", "OpenAI-compatible completions from a fine-tuned pretrained language model.",
                openai_response)


class _Generation:
    """One request's generation, run token by token in a worker thread: text pieces with `stop`
    strings cut off (text that could begin one is held back until it cannot), and afterwards the
    finish reason and the token counts. Setting `cancel` ends it after the current token."""

    def __init__(self, bundle, ids: list[int], max_tokens: int, stops, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, logit_bias: dict[int, float] | None = None):
        self.bundle, self.ids, self.max_tokens, self.stops = bundle, ids, max_tokens, list(stops or [])
        self.settings = dict(temperature=temperature, top_p=top_p, seed=seed, logit_bias=logit_bias)
        self.cancel = threading.Event()
        self.completion_tokens, self.finish, self.text = 0, "stop", ""
        self.done = False  # the text is complete (not cut short by a timeout or a client gone)
        self.decoded: list[int] | None = None  # its tokens, when decoded together with others (Chat._forward)
        self.error: Exception | None = None  # why its own row failed, when decoded together with others
        self.feed: queue.SimpleQueue | None = None  # its tokens as a batch of streams decodes them, then None
        self.token_wait_s: float | None = None  # how long to wait for the feed's next token
        self.tokens: list[int] = []  # the tokens generated, as the text took them
        self.ended_by: list[int] = []  # the end-of-text token that ended it, where one did
        self.cut = False  # a stop string ended the text

    def _tokens(self) -> Iterator[int]:
        if self.error is not None:
            raise self.error
        if self.decoded is not None:
            source = self.decoded
        elif self.feed is not None:
            source = self._fed()
        else:
            source = self.bundle.generate_ids(self.ids, self.max_tokens, **self.settings, ended_by=self.ended_by)
        for token in source:
            if self.cancel.is_set():
                return
            self.completion_tokens += 1
            self.tokens.append(token)
            yield token
        if self.completion_tokens == self.max_tokens:
            self.finish = "length"

    def _fed(self) -> Iterator[int]:
        while True:
            try:
                item = self.feed.get(timeout=self.token_wait_s)
            except queue.Empty:
                raise TimeoutError(f"no token within {self.token_wait_s:g} s") from None
            if item is None:
                return
            if isinstance(item, BaseException):  # the batch's decoding failed
                raise item
            yield item

    def pieces(self) -> Iterator[str]:
        held = ""
        for piece in self.bundle.text_pieces(self._tokens()):
            held += piece
            cut = min((i for i in (held.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:  # a stop string: the text ends before it
                self.cancel.set()
                self.finish, self.cut = "stop", True
                if held[:cut]:
                    self.text += held[:cut]
                    yield held[:cut]
                self.done = True
                return
            keep = _held_back(held, self.stops)
            if len(held) > keep:
                self.text += held[:len(held) - keep]
                yield held[:len(held) - keep]
                held = held[len(held) - keep:]
        if held:
            self.text += held
            yield held
        self.done = not self.cancel.is_set()

    def stop_seen(self) -> Callable[[int], bool]:
        """A check to feed this generation's tokens one by one while they are decoded together with
        others: true once its text holds a stop string (the row can end there; `pieces` then cuts
        the text as it does alone)."""

        if not self.stops:
            return lambda token: False
        decoder, longest, text = TextDecoder(self.bundle.tokenizer), max(map(len, self.stops)), ""

        def seen(token: int) -> bool:
            nonlocal text
            piece = decoder.add(token)
            text = text[-longest:] + piece  # a stop string ends in the new piece, or it was seen before
            return bool(piece) and any(stop in text for stop in self.stops)

        return seen

    def again(self, bundle) -> "_Generation":
        """The same request for another version (shadow mode)."""
        return _Generation(bundle, self.ids, self.max_tokens, self.stops, **self.settings)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.ids), completion_tokens=self.completion_tokens,
                     total_tokens=len(self.ids) + self.completion_tokens)


def _held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could begin a stop string (the longest such end)."""
    keep = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), keep, -1):  # longest first: the first match is it
            if text.endswith(stop[:k]):
                keep = k
                break
    return keep


def _fields(field: str, message: str):

    return [ErrorField(field=field, message=message)]


def _decode_batch(bundle, generations: list[_Generation], on_token, on_end=None, on_error=None) -> list[list[int]]:
    """`HFBundle.generate_ids_batch` for these generations: their prompts and settings, each row
    ended by its `cancel` too; a row that fails alone is told to `on_error` (by default kept as its
    generation's `error`), its batch-mates go on."""

    def keep(row: int, error: Exception) -> None:
        generations[row].error = error

    ended_by: list[int | None] = [None] * len(generations)
    try:
        return bundle.generate_ids_batch([g.ids for g in generations],
                                         [{"max_tokens": g.max_tokens, **g.settings, "adapter": g.bundle.adapter}
                                          for g in generations],
                                         [g.cancel for g in generations], on_token, on_end, on_error or keep, ended_by)
    finally:
        for g, token in zip(generations, ended_by):
            if token is not None:
                g.ended_by.append(token)


def decode_together(bundle, generations: list[_Generation]) -> list[str]:
    """The texts of several generations of one bundle, decoded together
    (`HFBundle.generate_ids_batch`): each the text it gets alone; a row ends once its stop string
    has appeared, or when its `cancel` is set. A row that failed alone is its exception, returned."""
    seen = [g.stop_seen() for g in generations]
    decoded = _decode_batch(bundle, generations, lambda row, token: seen[row](token))
    for g, tokens in zip(generations, decoded):
        g.decoded = tokens
    return [_text_or_error(g) for g in generations]


def _text_or_error(generation: _Generation) -> str | Exception:
    try:
        return "".join(generation.pieces())
    except Exception as e:
        return e


def stream_together(bundle, generations: list[_Generation]) -> None:
    """Streams of one bundle decoded together: each token goes into its generation's `feed` as soon
    as it is decoded, a None when its row has ended (at its stop string too); a row that fails
    alone gets its error in its feed, and the error goes in every feed still open if the decoding
    itself fails."""
    open_rows = set(range(len(generations)))

    def on_end(row: int) -> None:
        open_rows.discard(row)
        generations[row].feed.put(None)

    try:
        seen = [g.stop_seen() for g in generations]

        def on_token(row: int, token: int) -> bool:
            generations[row].feed.put(token)
            return seen[row](token)

        if len(generations) == 1:  # alone: the tokens `generate_ids` gives, as whole-text requests alone get
            g = generations[0]
            for token in bundle.generate_ids(g.ids, g.max_tokens, **g.settings):
                if g.cancel.is_set() or on_token(0, token):
                    break
            on_end(0)
        else:
            _decode_batch(bundle, generations, on_token, on_end,
                          lambda row, error: generations[row].feed.put(
                              RuntimeError(f"decoding failed: {type(error).__name__}: {error}")))
    except BaseException as e:
        for row in sorted(open_rows):  # each stream its own error (one exception raised in many threads tangles)
            generations[row].feed.put(RuntimeError(f"decoding the batch failed: {type(e).__name__}: {e}"))
        raise


class _Forwarded:
    """What the handlers read of a request (`headers`, `stream()`), for one the router forwards."""

    def __init__(self, body: bytes, headers: list[tuple[str, str]]):
        self.headers = Headers(raw=[(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers])
        self._body = body

    async def stream(self):
        yield self._body


def _finish(generation: _Generation) -> Iterator[str]:
    """The finish reason, read once the pieces are exhausted (the streams call `next` on it then)."""
    yield generation.finish


def _by_model(items: list[tuple[str, Any, "_Generation"]]) -> dict[int, list[int]]:
    """The positions of a batch's items by the model they run on: a version's own, or the base that
    a replica's adapters share (those decode together, each row with its adapter)."""
    return _by_version(items, key=lambda item: id(item[1].model))


def _not_an_adapter_for(tags: dict[str, str], base_sha256: str | None) -> str:
    """Why a registered version (its tags) cannot go onto a replica's base of `base_sha256`; "" if it can."""
    if tags.get("flotilla.form") != "adapter":
        return "it holds a whole model, not a LoRA adapter on a pinned base"
    if tags.get("flotilla.adapter") == "prompt":
        return "it is prompt tuning, which a replica serves one version at a time"
    if base_sha256 is not None and tags.get("flotilla.base_sha256") != base_sha256:
        return (f"it is an adapter for the base {tags.get('flotilla.base', '?').split(' (')[0]} (SHA-256 "
                f"{tags.get('flotilla.base_sha256', '?')[:12]}); this replica holds another (SHA-256 {base_sha256[:12]})")
    return ""


class _LoadedAdapter:
    """An adapter `Chat.get_adapter` loaded for a model id: its bundle (on the replica's base) and
    version. Serve's multiplexing calls `__del__` when it evicts it; the adapter then leaves the
    base once no batch decodes with it."""

    def __init__(self, model_id: str, name: str, version: str, bundle, adapters: AdapterSet, loaded: dict):
        self.model_id, self.name, self.version, self.bundle = model_id, name, version, bundle
        self._adapters, self._loaded, self._dropped = adapters, loaded, False
        self.switching = threading.Lock()
        loaded[model_id] = self

    def __del__(self):
        if not self._dropped:
            self._dropped = True
            self._loaded.pop(self.model_id, None)
            self._adapters.drop(self.bundle.adapter)


# Serve serializes the deployment class when it is decorated: everything its methods use is above.
@serve.deployment
@serve.ingress(chat_api)
class Chat(_ModelServer):
    task_kind = "chat"
    batch_wait_setting = "generate_wait_s"
    example = '{"model": "NAME", "messages": [{"role": "user", "content": "What is 2 plus 3?"}]}'

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._streaming: set[asyncio.Task] = set()  # batches of streams being decoded (held: the loop keeps weak refs)
        # Threads of their own for decoding streams: the default pool's threads wait for the tokens.
        self._decoders = ThreadPoolExecutor(max_workers=64, thread_name_prefix="flotilla-streams")
        # With serve.adapters.max_per_replica: the versions and the other models' adapters on one base.
        self.adapters: AdapterSet | None = None
        self._opening = threading.Lock()
        self._loads = itertools.count()
        self._loaded: dict[str, _LoadedAdapter] = {}  # model id -> adapter, as Serve's multiplexing holds them
        self._listed: tuple[float, list[str]] = (-1e9, [])
        self._resolved: dict[str, tuple[float, tuple[str, str]]] = {}  # model id -> when, (name, version)
        if self.limits.max_adapters:
            async def get_adapter(model_id: str) -> _LoadedAdapter:
                return await asyncio.to_thread(self._load_adapter, model_id)

            # Serve's model multiplexing: at most K loaded, least recently used evicted, and requests
            # (`multiplexed_model_id`, which the OpenAI router sets) sent to a replica that holds theirs.
            self.get_adapter = serve.multiplexed(max_num_models_per_replica=self.limits.max_adapters)(get_adapter)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        before = dict(self.bundles)
        await super().reconfigure(user_config)
        if self.adapters is not None:  # versions the new split no longer serves leave the base
            for version, bundle in before.items():
                if self.bundles.get(version) is not bundle:
                    self.adapters.drop(bundle.adapter)
        config = ReplicaConfig.model_validate(user_config)
        self._stream_together.set_max_batch_size(config.max_batch_size)
        self._stream_together.set_batch_wait_timeout_s(config.generate_wait_s)

    def warm_up(self, bundle, rows: int) -> None:
        list(bundle.generate_ids(bundle.encode("Hi"), max_tokens=1, temperature=0.0))

    # ------------------------------------------------------------------ adapters on one base
    def _load_and_warm(self, version: str, config: ReplicaConfig):
        if not self.limits.max_adapters:
            return super()._load_and_warm(version, config)
        bundle = self._onto_base(self.model_name, version)
        self.warm_up(bundle, config.max_batch_size)
        return bundle

    def _onto_base(self, name: str, version: str):
        """Registered `name` version `version`, an adapter, loaded onto this replica's base (the first
        one loaded brings the base)."""
        client = registry_client(self.tracking_uri, check=False)
        key = f"a{next(self._loads)}"  # a load's own name (an evicted copy may still decode; no dots for torch)
        with tempfile.TemporaryDirectory(prefix="flotilla-adapter-") as tmp:
            root = bundle_in_model(download_model(client, name, version, Path(tmp)), f"{name} v{version}")
            with self._opening:
                if self.adapters is None:
                    self.adapters = AdapterSet(root, key, device=self.device)
                    return self.adapters.first
            return self.adapters.add(root, key)

    def _resolve(self, model_id: str) -> tuple[str, str]:
        """A request's `model` as (name, version): `NAME` (its champion), `NAME@ALIAS` or `NAME/VERSION`
        of the registry, checked to be a LoRA adapter for this replica's base before anything loads
        (a wrong one must not evict a loaded adapter). Aliases are asked again after LISTED_TTL_S."""
        found = self._resolved.get(model_id)
        if found is not None and time.monotonic() - found[0] < LISTED_TTL_S:
            return found[1]
        client = registry_client(self.tracking_uri, check=False)
        text = model_id if ("@" in model_id or "/" in model_id) else f"{model_id}@champion"
        try:
            name, version = resolve_reference(client, parse_model_reference(text, paths=False, command="model"), "model")
            tags = client.get_model_version(name, version).tags
        except (SpecError, TrackingError, MlflowException) as e:
            logger.info("model %r: %s", model_id, redact(str(e)))
            raise ApiError(404, f"The model `{model_id}` does not exist here: no registered model, alias or version "
                                f"of that name (a model is NAME, NAME@ALIAS or NAME/VERSION)") from None
        why = _not_an_adapter_for(tags, self.adapters.base["sha256"] if self.adapters else None)
        if why:
            raise ApiError(422, f"The model `{model_id}` ({name} v{version}) cannot be served by {self.model_name}'s "
                                f"replicas: {why}")
        if len(self._resolved) > 10_000:  # (ids are the callers'; keep what is remembered bounded)
            self._resolved.clear()
        self._resolved[model_id] = (time.monotonic(), (name, version))
        return name, version

    def _load_adapter(self, model_id: str) -> _LoadedAdapter:
        """What `get_adapter` loads for a request's `model` (resolved by `_resolve`)."""
        name, version = self._resolve(model_id)
        try:
            bundle = self._onto_base(name, version)
        except BundleError as e:
            raise ApiError(422, f"The model `{model_id}` cannot be served by {self.model_name}'s replicas: "
                                f"{redact(str(e))}") from None
        self.warm_up(bundle, 1)
        return _LoadedAdapter(model_id, name, version, bundle, self.adapters, self._loaded)

    def _switch(self, loaded: _LoadedAdapter, version: str) -> None:
        """`loaded`'s model id now names `version` (an alias moved: a promotion): load it, let the
        old one leave once unused."""
        with loaded.switching:
            if loaded.version == version:
                return
            bundle = self._onto_base(loaded.name, version)
            self.warm_up(bundle, 1)
            old, loaded.bundle, loaded.version = loaded.bundle, bundle, version
            self.adapters.drop(old.adapter)

    async def _same_base(self) -> list[str]:
        """Registered models with a version trained on this replica's base (`flotilla.base_sha256`),
        asked again every LISTED_TTL_S: an adapter registered after the deploy is listed too."""
        at, names = self._listed
        if self.adapters is None or time.monotonic() - at < LISTED_TTL_S:
            return names

        sha = self.adapters.base["sha256"]

        def ask() -> list[str]:  # models whose champion this replica can serve
            client = registry_client(self.tracking_uri, check=False)
            versions = client.search_model_versions(f"tags.`flotilla.base_sha256` = '{sha}'", max_results=10_000)
            served = []
            for name in sorted({v.name for v in versions}):
                champion = alias_version(client, name, CHAMPION)
                if champion is not None and not _not_an_adapter_for(client.get_model_version(name, champion).tags, sha):
                    served.append(name)
            return served

        try:
            names = await asyncio.to_thread(ask)
        except Exception as e:  # the registry is unreachable: what was listed last, asked again later
            logger.warning("listing the adapters for this base failed: %s", redact(str(e)))
            return names
        self._listed = (time.monotonic(), names)
        return names

    def error_response(self, error: ApiError) -> Response:
        return openai_response(error)

    async def served_models(self) -> list[dict[str, Any]]:
        """The `model` names this app answers for (the OpenAI router's directory, `_router`): its
        own, and with adapters on one base every registered model trained on that base
        (`multiplexed`: the router sends those to a replica that holds the adapter)."""
        own = [{"id": self.model_name, "multiplexed": False}]
        if not self.limits.max_adapters:
            return own
        return own + [{"id": name, "multiplexed": True} for name in await self._same_base() if name != self.model_name]

    async def routed(self, path: str, body: bytes, headers: list[tuple[str, str]]):
        """A request the OpenAI router (`flotilla.serve._router`) forwards through this app's handle,
        answered exactly as on the app's own route: first the response's status and headers, then
        its body, in pieces as a stream's events are produced."""
        request = _Forwarded(body, headers)
        handler = {"/v1/chat/completions": self.chat_completions, "/v1/completions": self.completions}[path]
        response = await handler(request)
        streaming = isinstance(response, StreamingResponse)
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        yield {"status": response.status_code, "headers": headers, "media_type": response.media_type,
               "stream": streaming}
        if streaming:
            async for part in response.body_iterator:
                yield part.encode() if isinstance(part, str) else part
        else:
            yield bytes(response.body)

    @chat_api.get("/", summary="What this endpoint serves (also OpenAI's model object: at the default prefix this "
                  "is `GET /v1/models/NAME`)")
    def describe(self) -> dict[str, Any]:
        # Serve routes by the longest prefix, so the OpenAI router's GET /v1/models/NAME lands here.
        about = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "flotilla", **self.info()}
        if self.limits.max_adapters:
            about["adapters"] = {"max_per_replica": self.limits.max_adapters,
                                 "base": {k: self.adapters.base[k] for k in ("pretrained", "sha256")}
                                 if self.adapters else None,
                                 "loaded": sorted(self._loaded)}  # (this replica's)
        return about

    @chat_api.get("/v1/models", summary="The served model, as OpenAI lists models")
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "flotilla"}]}

    @chat_api.post("/v1/chat/completions", summary="The assistant's next message (OpenAI chat completions)",
                   openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self.answer(request, lambda: self._complete(request, ChatCompletionRequest, chat=True))

    @chat_api.post("/v1/completions", summary="Continue a prompt (OpenAI completions)",
                   openapi_extra=_body_schema(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self.answer(request, lambda: self._complete(request, CompletionRequest, chat=False))

    async def _complete(self, request: Request, schema, chat: bool):
        body = await self.read_body(request, schema)
        held = None
        if body.model == self.model_name:
            version = self.choose(request)
            bundle = self.bundles[version]
            headers = self.headers(version, bundle)
            if bundle.adapter is not None and self.adapters.hold(bundle.adapter):  # (a new split drops it after)
                held = bundle.adapter
        elif self.limits.max_adapters:  # another registered model's adapter, on this replica's base
            name, version = await asyncio.to_thread(self._resolve, body.model)  # (refused before anything loads)
            for _ in range(3):
                loaded = await self.get_adapter(body.model)
                if loaded.version != version:  # its alias moved since it was loaded
                    await asyncio.to_thread(self._switch, loaded, version)
                if self.adapters.hold(loaded.bundle.adapter):  # (until this request's generation is gone)
                    break
            else:  # evicted each time before it could be used: as many other adapters as requests
                raise ApiError(503, f"{self.model_name}'s replica is switching adapters faster than it can use them "
                                    "(serve.adapters.max_per_replica); retry", headers={"Retry-After": "1"})
            held = loaded.bundle.adapter
            version, bundle = f"{loaded.name}/{loaded.version}", loaded.bundle
            headers = {VERSION_HEADER: loaded.version, RUNTIME_HEADER: bundle.runtime, MODEL_HEADER: loaded.name}
        else:
            raise ApiError(404, f"model {body.model!r} is not served here; this endpoint serves {self.model_name!r}")
        try:
            ids = self._prompt_ids(bundle, body, chat)
            max_tokens = self._token_limit(bundle, body, len(ids))
            generation = _Generation(bundle, ids, max_tokens, body.stop,
                                     temperature=body.temperature if body.temperature is not None else 1.0,
                                     top_p=body.top_p if body.top_p is not None else 1.0, seed=body.seed,
                                     logit_bias=self._biases(bundle, body))
        except BaseException:
            if held is not None:
                self.adapters.release(held)
            raise
        if held is not None:  # the adapter stays loaded while anything still holds this generation
            weakref.finalize(generation, self.adapters.release, held)
        if body.stream:
            generation.feed = queue.SimpleQueue()  # decoded with the streams that arrive with it (`_send`)
            stream = chat_stream if chat else completion_stream
            events = stream(body.model, generation.pieces(), _finish(generation),
                            generation.usage if body.include_usage else None)
            return version, StreamingResponse(self._send(events, generation, version), media_type="text/event-stream",
                                              headers=headers)
        text = await self.with_timeout(self._whole(generation, version), "generation")
        rid, created = new_id("chatcmpl" if chat else "cmpl")
        top, echo = body.top_logprobs_asked, not chat and body.echo
        scored, g = None, generation
        if top is not None and chat:  # one scoring pass over the prompt and the answer
            scored = ChatLogprobs(content=await asyncio.to_thread(chat_logprobs, bundle, g.ids, g.tokens, text, top, g.cut))
        elif top is not None:
            scored, text = await asyncio.to_thread(completion_logprobs, bundle, g.ids, g.tokens, g.ended_by, text, top,
                                                   echo, g.cut)
        elif echo:
            text = decoded_text(bundle, g.ids) + text
        if chat:
            answer = ChatCompletionResponse(id=rid, created=created, model=body.model, usage=generation.usage(),
                                            choices=[ChatChoice(message=AssistantMessage(content=text),
                                                                finish_reason=generation.finish, logprobs=scored)])
        else:
            answer = CompletionResponse(id=rid, created=created, model=body.model, usage=generation.usage(),
                                        choices=[CompletionChoice(text=text, finish_reason=generation.finish,
                                                                  logprobs=scored)])
        return version, JSONResponse(answer.model_dump(), headers=headers)

    def _prompt_ids(self, bundle, body, chat: bool) -> list[int]:
        if chat:
            if not bundle.tokenizer.chat_template:
                raise ApiError(422, f"{self.model_name}'s tokenizer has no chat template; use /v1/completions")
            text = bundle.tokenizer.apply_chat_template(body.template_messages(), tokenize=False,
                                                        add_generation_prompt=True)
            return bundle.tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = bundle.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(422, f"invalid request: prompt: token ids must be in [0, {vocab})")
            return list(prompt)
        text = prompt[0] if isinstance(prompt, list) else prompt
        return bundle.encode(text) or [bundle.tokenizer.eos_token_id]

    def _biases(self, bundle, body) -> dict[int, float] | None:
        biases, vocab = body.token_biases, bundle.vocab_size
        outside = sorted(t for t in biases or () if t >= vocab)
        if outside:
            raise ApiError(422, f"invalid request: logit_bias: token {outside[0]} is not in this model's vocabulary "
                                f"(ids 0 to {vocab - 1})", _fields("logit_bias", f"token ids below {vocab}"))
        return biases

    def _token_limit(self, bundle, body, prompt_tokens: int) -> int:
        cap = self.limits.max_new_tokens
        chat = isinstance(body, ChatCompletionRequest)
        asked = body.token_limit if chat else body.max_tokens
        field = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
        if asked is not None and asked > cap:
            raise ApiError(422, f"invalid request: {field}: {asked} is above this endpoint's limit of {cap} "
                                "(serve.max_new_tokens)", _fields(field, f"at most {cap}"))
        limit = cap if asked is None else asked
        most = self.limits.max_prompt_tokens
        if prompt_tokens > most:
            raise ApiError(422, f"invalid request: the prompt is {prompt_tokens} tokens; this endpoint takes at most "
                                f"{most} (serve.max_prompt_tokens)",
                           _fields("messages" if chat else "prompt", f"at most {most} tokens"))
        room = bundle.max_positions
        if room is not None and prompt_tokens + limit > room:
            if prompt_tokens >= room:
                raise ApiError(422, f"invalid request: the prompt is {prompt_tokens} tokens; the model reads at most "
                                    f"{room}", _fields("messages" if chat else "prompt",
                                                       f"at most {room} tokens"))
            if asked is not None:
                raise ApiError(422, f"invalid request: {field}: the prompt ({prompt_tokens} tokens) and {asked} more "
                                    f"exceed the model's context of {room} tokens; ask for at most {room - prompt_tokens}",
                               _fields(field, f"at most {room - prompt_tokens}"))
            limit = room - prompt_tokens
        return limit

    async def _whole(self, generation: _Generation, version: str) -> str:
        """The whole text, decoded together with the requests that arrived with it (`_forward`); a
        timeout (504) or a client that goes away ends its generation after the current token."""
        start = time.perf_counter()
        try:
            text = await self._unsplit(self._forward((version, generation.bundle, generation)))
            if isinstance(text, Exception):  # its own row failed; its batch-mates have their texts
                logger.error("generation of %s v%s failed", self.model_name, version, exc_info=text)
                raise ApiError(500, f"generation failed ({type(text).__name__}); see the replica log")
            return text
        finally:
            generation.cancel.set()
            self._observe(version, generation, start)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005, max_concurrent_batches=64)
    async def _forward(self, items: list[tuple[str, Any, _Generation]]) -> list[str | Exception]:
        """`@serve.batch` groups the whole-text requests that arrive together
        (`serve.batching.generate_wait_s`); each group of one version decodes in one forward pass per
        token (`HFBundle.generate_ids_batch`) in a thread of its own, so a request that arrives while
        others generate starts at once. Each request gets the text it gets alone: its own sampling
        and seed, its decoding ended by its own stop strings. Streams batch apart (`_stream_together`)."""
        results: list[str | Exception] = [""] * len(items)
        for idx in _by_model(items).values():
            bundle, generations = items[idx[0]][1], [items[i][2] for i in idx]
            if len(generations) > 1:
                texts = await asyncio.to_thread(decode_together, bundle, generations)
            else:
                texts = [await asyncio.to_thread(_text_or_error, generations[0])]
            self._observe_batch([items[i][0] for i in idx])
            for i, text in zip(idx, texts):
                results[i] = text
        return results

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005, max_concurrent_batches=64)
    async def _stream_together(self, items: list[tuple[str, Any, _Generation]]) -> list[None]:
        """`@serve.batch` groups the streams that arrive together (`serve.batching.generate_wait_s`);
        each group of one version decodes in one forward pass per token in a thread of its own
        (`stream_together`), each token sent on to its stream as soon as it is decoded. Returns
        when every row has ended."""
        groups = []
        for idx in _by_model(items).values():
            groups.append((items[idx[0]][0], items[idx[0]][1], [items[i][2] for i in idx]))
            self._observe_batch([items[i][0] for i in idx])

        loop = asyncio.get_running_loop()
        outcomes = await asyncio.gather(*(loop.run_in_executor(self._decoders, stream_together, bundle, generations)
                                          for _, bundle, generations in groups), return_exceptions=True)
        for (version, _, _), outcome in zip(groups, outcomes):
            if isinstance(outcome, BaseException):  # each of its streams ends with an error event
                logger.error("decoding streams of %s v%s failed", self.model_name, version, exc_info=outcome)
        return [None] * len(items)

    def _batch_context(self) -> contextvars.Context | None:
        """Where a request joins a batch. `@serve.batch` splits a batch by the requests' multiplexed
        model id (the adapter the router asked for), so on a replica of adapters on one base the
        request joins from a context of its own, without that id: adapters of one base decode together
        (each row with its own; `_by_model`). Elsewhere: the request's own context."""
        return contextvars.Context() if self.limits.max_adapters else None

    async def _unsplit(self, batched: Awaitable):
        """Await a `@serve.batch` call from `_batch_context` (cancelling this cancels it)."""
        context = self._batch_context()
        if context is None:
            return await batched
        return await asyncio.get_running_loop().create_task(batched, context=context)

    def _observe_batch(self, versions: list[str]) -> None:
        """A batch's size, by its version (`mixed` for adapters of several decoded together)."""
        label = versions[0] if len(set(versions)) == 1 else "mixed"
        self.m_batch.observe(len(versions), tags={"model": self.model_name, "version": label})

    def _start_stream(self, version: str, generation: _Generation) -> None:
        """Join the batch of streams that arrive together; should it fail before decoding (no None
        or error in the feed then), the stream gets the error instead of waiting for tokens."""
        generation.token_wait_s = self.limits.request_timeout_s

        def done(task: asyncio.Task) -> None:
            self._streaming.discard(task)
            failed = task.cancelled() or task.exception() is not None
            if failed:
                generation.feed.put(RuntimeError("the batch of streams failed before decoding; see the replica log"))

        task = asyncio.get_running_loop().create_task(self._stream_together((version, generation.bundle, generation)),
                                                      context=self._batch_context())
        self._streaming.add(task)
        task.add_done_callback(done)

    async def _send(self, events: Iterator[bytes], generation: _Generation, version: str):
        """The stream's events, each produced in a thread as its tokens arrive from the batch it
        joins here (`_stream_together`). Past `serve.request_timeout_s` the stream ends with an
        OpenAI-shaped error event; a client that goes away stops the generation."""
        start = time.perf_counter()
        timeout = self.limits.request_timeout_s
        _, body = openai_error(f"generation took longer than {timeout:g} s (serve.request_timeout_s); "
                               "ask for fewer max_tokens", 504)
        late = f"data: {json.dumps(body)}\n\n".encode()
        try:
            if generation.feed is not None:
                self._start_stream(version, generation)
            while True:
                if time.perf_counter() - start > timeout:
                    yield late
                    return
                event = await asyncio.to_thread(next, events, None)
                if event is None:
                    return
                yield event
        except TimeoutError:  # no token came within the deadline
            yield late
        except Exception as e:  # the headers are sent: the stream itself says what went wrong
            logger.exception("stream of %s v%s failed", self.model_name, version)
            _, body = openai_error(f"generation failed ({type(e).__name__}); see the replica log", 500)
            yield f"data: {json.dumps(body)}\n\n".encode()
        finally:
            generation.cancel.set()
            self._observe(version, generation, start)

    def _observe(self, version: str, generation: _Generation, start: float) -> None:
        tags = {"model": self.model_name, "version": version}
        self.m_forward.observe((time.perf_counter() - start) * 1000, tags=tags)
        if generation.completion_tokens:
            self.m_tokens.inc(generation.completion_tokens, tags=tags)
        if generation.done and version in self.bundles:  # (not another model's adapter)
            self.mirror(lambda _, bundle: asyncio.to_thread(lambda: "".join(generation.again(bundle).pieces())),
                        lambda text: float(text == generation.text))
