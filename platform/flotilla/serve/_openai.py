"""OpenAI-compatible bodies for `/v1/completions` and `/v1/chat/completions`, their SSE stream,
and errors in the shape OpenAI clients read.

A stock `openai` client sends only the parameters its caller passed (plus `stream`), so every
parameter of OpenAI's API is known here: the ones this server implements (model, prompt or
messages, max_tokens / max_completion_tokens, temperature, top_p, n, stop, seed, logit_bias,
stream, stream_options, user, metadata; `logprobs` and `top_logprobs`, and the completions'
`echo`), and the others, accepted while they ask for the default
behaviour (`presence_penalty: 0`, `tools: []`, `best_of: 1`, ...) and refused with a 422
naming the field otherwise, so no request is silently answered differently than it asked.
A key OpenAI does not define is refused as unknown, as in every Flotilla schema.

Streams are server-sent events: `data: {chunk JSON}\n\n` per piece, then `data: [DONE]\n\n`.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal, Optional, Union

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from flotilla.serve._schemas import (
    INT64_MAX,
    MAX_ERROR_MESSAGE,
    MAX_LISTED_ERRORS,
    MIN_TEMPERATURE,
    fields_summary,
    shorten,
    validation_fields,
)

Number = Annotated[float, AllowInfNan(False)]
MAX_STOPS = 4  # OpenAI's limit
# Each decoded piece is checked against every stop string, holding back text that could begin
# one: the work per piece grows with the stops' length, so a stop string has a length limit.
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300  # token ids in `logit_bias` (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (and vLLM's default); its legacy completions stopped at 5
SSE_DONE = b"data: [DONE]\n\n"

# OpenAI parameters this server does not implement, and the values that mean "not used".
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # about tools, of which there are none
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
}
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: Optional[bool] = Field(None, description="Send a last chunk with the token counts (`usage`).")
    include_obfuscation: Optional[bool] = Field(None, description="Accepted; no padding is added to chunks.")


class _Request(_Body):
    """What both endpoints share."""

    model: str = Field(..., description="The served model's name (the registered model); checked by the server.")
    max_tokens: Optional[Annotated[int, Strict()]] = Field(
        None, ge=0, description="Most tokens to generate; null: the deployment's limit. 0 only with `echo` "
        "(completions): the prompt's log-probabilities alone.")
    temperature: Optional[Number] = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature: 0 is greedy, "
                                          f"else {MIN_TEMPERATURE} to 2.")
    top_p: Optional[Number] = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: the smallest set of tokens "
                                    "whose probabilities add up to top_p (at least the most likely one).")
    n: Optional[Annotated[int, Strict()]] = Field(1, description="Choices to generate; only 1 is supported.")
    stop: Union[str, list[str], None] = Field(None, description=f"Up to {MAX_STOPS} strings of at most "
                                              f"{MAX_STOP_CHARS} characters that end the text (not included in it).")
    seed: Optional[Annotated[int, Strict()]] = Field(None, ge=0, le=INT64_MAX, description="Seed of the sampler "
                                                     "(0 to 2^63-1): the same seed and input give the same text.")
    logit_bias: Optional[dict[str, Number]] = Field(
        None, description=f"Up to {MAX_LOGIT_BIAS} token ids (as strings, e.g. \"13\") mapped to a bias from -100 "
        "to 100 added to their logits before sampling: -100 bans a token, 100 all but forces it.")
    stream: Optional[bool] = Field(False, description="Send the text as server-sent events as it is generated.")
    stream_options: Optional[StreamOptions] = Field(None, description="With `stream`: `include_usage`.")
    # Accepted, not implemented: each must keep its default (see _DEFAULT_ONLY).
    frequency_penalty: Any = Field(None, description="Not implemented: leave out, or 0.")
    presence_penalty: Any = Field(None, description="Not implemented: leave out, or 0.")
    # Accepted and ignored.
    user: Any = Field(None, description="Ignored.")
    metadata: Any = Field(None, description="Ignored.")
    store: Any = Field(None, description="Ignored.")
    service_tier: Any = Field(None, description="Ignored.")
    safety_identifier: Any = Field(None, description="Ignored.")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported; leave `n` out, or send one request per choice")
        return 1

    @field_validator("temperature")
    @classmethod
    def _not_vanishing(cls, value: float | None) -> float | None:
        # Logits divided by a temperature near 0 overflow to infinity and sampling breaks down.
        if value is not None and 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"use 0 for greedy decoding, or a temperature of at least {MIN_TEMPERATURE}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"`stop` is a non-empty string or a list of at most {MAX_STOPS} of them")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters; got one of "
                             f"{max(map(len, stops))}")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids; got {len(value)}")
        for key, bias in (value or {}).items():
            if not re.fullmatch(r"[0-9]{1,9}", key):
                raise ValueError(f"keys are token ids, such as \"13\"; got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"token {key}: a bias is from -100 to 100; got {bias:g}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _defaults_only(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            for key in (k for k in raw if k in _DEFAULT_ONLY):
                if raw[key] not in _DEFAULT_ONLY[key]:
                    raise ValueError(f"`{key}` is not supported by this server; leave it out")
        return raw

    @model_validator(mode="after")
    def _options_need_a_stream(self) -> "_Request":
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` is only allowed with `stream: true`")
        if self.stream and self.top_logprobs_asked is not None:
            raise ValueError("log-probabilities come with whole answers only: send `stream: false`, or leave "
                             "`logprobs` out")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many likeliest tokens to list at each position, when log-probabilities are asked for."""
        return None

    @property
    def token_biases(self) -> dict[int, float] | None:
        """`logit_bias` with token ids as numbers; None when there is none."""
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """`POST /v1/completions`: continue a prompt."""

    prompt: Union[str, list[str], list[Annotated[int, Strict()]], list[list[Annotated[int, Strict()]]]] = Field(
        ..., description="The text to continue, a list holding one text, token ids, or a list holding one list "
        "of token ids (what lm-evaluation-harness sends).")
    logprobs: Optional[Annotated[int, Strict()]] = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Return each token's log-probability under the model "
        f"(before temperature and biases) and, at each position, the `logprobs` likeliest tokens' (0 to "
        f"{MAX_TOP_LOGPROBS}); null: none.")
    echo: Optional[bool] = Field(
        False, description="Return the prompt before the completion, in `text` and in `logprobs` (the first "
        "token has none); with `max_tokens: 0`, the prompt alone: how a harness scores a text's likelihood.")
    best_of: Any = Field(None, description="Not implemented: leave out, or 1.")
    suffix: Any = Field(None, description="Not implemented: leave out.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("one prompt per request: send a string (or a list of one); lm-evaluation-harness: "
                                 "`batch_size=1`")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    @model_validator(mode="after")
    def _nothing_to_say(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("`max_tokens: 0` generates nothing; it is for `echo: true` (the prompt's log-probabilities)")
        if self.echo and self.stream:
            raise ValueError("`echo` comes with whole answers only: send `stream: false`")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class ContentPart(_Body):
    type: Literal["text"] = Field(..., description="Only text parts (images and audio are not supported).")
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        ..., description="Who speaks; `developer` is rendered as `system` (tool messages are not supported).")
    content: Union[str, list[ContentPart], None] = Field(..., description="The text, or a list of text parts.")
    name: Optional[str] = Field(None, description="Ignored (chat templates have no place for it).")
    # What an assistant message echoed back from an earlier response carries.
    refusal: Optional[str] = Field(None, description="Ignored.")
    tool_calls: Optional[list[Any]] = Field(None, description="Not supported: leave out or empty.")
    function_call: Optional[Any] = Field(None, description="Not supported: leave out.")
    audio: Optional[Any] = Field(None, description="Not supported: leave out.")
    annotations: Optional[list[Any]] = Field(None, description="Ignored.")

    @model_validator(mode="after")
    def _text_only(self) -> "ChatMessage":
        if self.tool_calls or self.function_call or self.audio:
            raise ValueError("tool calls and audio are not supported; send text messages")
        if self.content is None and self.role != "assistant":
            raise ValueError("`content` is required")
        return self

    def as_template_message(self) -> dict[str, str]:
        """{role, content} as chat templates take it."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`: the assistant's next message in a conversation."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_tokens: Optional[Annotated[int, Strict()]] = Field(
        None, ge=1, description="Most tokens to generate; null: the deployment's limit.")
    max_completion_tokens: Optional[Annotated[int, Strict()]] = Field(
        None, ge=1, description="The newer name of `max_tokens` (what current clients send).")
    logprobs: Optional[bool] = Field(
        False, description="Return each generated token's log-probability under the model (before temperature and "
        "biases) in `choices[0].logprobs.content`.")
    top_logprobs: Optional[Annotated[int, Strict()]] = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description=f"With `logprobs: true`: also the likeliest tokens at each "
        f"position, 0 to {MAX_TOP_LOGPROBS}.")
    tools: Any = Field(None, description="Not implemented: leave out, or empty.")
    tool_choice: Any = Field(None, description="Not implemented: leave out, or `none`.")
    parallel_tool_calls: Any = Field(None, description="Accepted (there are no tools).")
    functions: Any = Field(None, description="Not implemented: leave out.")
    function_call: Any = Field(None, description="Not implemented: leave out, or `none`.")
    response_format: Any = Field(None, description="Only `{\"type\": \"text\"}`.")
    modalities: Any = Field(None, description="Only `[\"text\"]`.")
    audio: Any = Field(None, description="Not implemented: leave out.")
    prediction: Any = Field(None, description="Not implemented: leave out.")
    reasoning_effort: Any = Field(None, description="Not implemented: leave out.")
    verbosity: Any = Field(None, description="Not implemented: leave out.")
    web_search_options: Any = Field(None, description="Not implemented: leave out.")
    prompt_cache_key: Any = Field(None, description="Ignored.")
    prompt_cache_retention: Any = Field(None, description="Ignored.")
    prompt_cache_options: Any = Field(None, description="Ignored.")
    moderation: Any = Field(None, description="Ignored.")

    @model_validator(mode="after")
    def _one_token_limit(self) -> "ChatCompletionRequest":
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError("`max_tokens` and `max_completion_tokens` differ; send one of them")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]


# ------------------------------------------------------------------ responses
FinishReason = Literal["stop", "length"]


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Body):
    """OpenAI's legacy completions log-probabilities: per token of the text (the prompt's first with
    `echo`), its text, its log-probability (null for the prompt's first token), the likeliest tokens
    there, and where it starts in `text`."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int = 0
    text: str
    finish_reason: Optional[FinishReason] = Field(None, description="`stop` (eos or a stop string) or `length`; "
                                                  "null in stream chunks before the last.")
    logprobs: Optional[CompletionLogprobs] = None


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class AssistantMessage(_Body):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Body):
    content: Optional[list[TokenLogprob]] = None
    refusal: None = None


class ChatChoice(_Body):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionResponse(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Body):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(_Body):
    index: int = 0
    delta: ChatDelta
    finish_reason: Optional[FinishReason] = None
    logprobs: None = None


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


def new_id(kind: Literal["cmpl", "chatcmpl"]) -> tuple[str, int]:
    """A response id and its creation time (Unix seconds), as OpenAI forms them."""
    return f"{kind}-{uuid.uuid4().hex}", int(time.time())


def sse(chunk: BaseModel) -> bytes:
    """One server-sent event holding `chunk` as JSON (no null `usage` before the last chunk)."""
    return b"data: " + chunk.model_dump_json(exclude_none=False).encode() + b"\n\n"


def chat_stream(model: str, pieces: Iterable[str], finish: Iterable[FinishReason] | None = None,
                usage: Callable[[], Usage] | None = None) -> Iterator[bytes]:
    """The events of a streamed chat completion: the role, each text piece, the finish reason (the
    one value `finish` yields once `pieces` is exhausted, `stop` by default), the usage chunk when
    asked for (`usage()`, called after the last piece), then [DONE]."""
    cid, created = new_id("chatcmpl")

    def chunk(delta: ChatDelta, reason: FinishReason | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=cid, created=created, model=model,
                                       choices=[ChatChunkChoice(delta=delta, finish_reason=reason)]))

    yield chunk(ChatDelta(role="assistant", content=""))
    for piece in pieces:
        if piece:
            yield chunk(ChatDelta(content=piece))
    yield chunk(ChatDelta(), next(iter(finish or ()), "stop"))
    if usage is not None:
        yield sse(ChatCompletionChunk(id=cid, created=created, model=model, choices=[], usage=usage()))
    yield SSE_DONE


def completion_stream(model: str, pieces: Iterable[str], finish: Iterable[FinishReason] | None = None,
                      usage: Callable[[], Usage] | None = None) -> Iterator[bytes]:
    """The events of a streamed completion, as `chat_stream` (a completion chunk is a `text_completion`)."""
    cid, created = new_id("cmpl")
    for piece in pieces:
        if piece:
            yield sse(CompletionResponse(id=cid, created=created, model=model, choices=[CompletionChoice(text=piece)]))
    yield sse(CompletionResponse(id=cid, created=created, model=model,
                                 choices=[CompletionChoice(text="", finish_reason=next(iter(finish or ()), "stop"))]))
    if usage is not None:
        yield sse(CompletionResponse(id=cid, created=created, model=model, choices=[], usage=usage()))
    yield SSE_DONE


# ------------------------------------------------------------------ errors
class OpenAIErrorDetail(_Body):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIError(_Body):
    """`{"error": {"message", "type", "param", "code"}}`: what OpenAI clients read an error from
    (the `openai` package raises `UnprocessableEntityError` for a 422 and shows `message`)."""

    error: OpenAIErrorDetail


def openai_error(error: ValidationError | str, status: int = 422) -> tuple[int, dict[str, Any]]:
    """The status and body for a refused request: each field's problem, the first field as `param`
    (OpenAI's types: `invalid_request_error` for what the caller can fix, `server_error` from 500 on)."""
    if isinstance(error, str):
        detail = OpenAIErrorDetail(message=shorten(error, MAX_ERROR_MESSAGE), type="invalid_request_error" if status < 500 else "server_error")
        return status, OpenAIError(error=detail).model_dump()

    fields = validation_fields(error)
    message = fields_summary(fields, MAX_LISTED_ERRORS)
    param = shorten(fields[0].field) if fields and fields[0].field != "(body)" else None
    detail = OpenAIErrorDetail(message=message, type="invalid_request_error", param=param, code="invalid_value")
    return status, OpenAIError(error=detail).model_dump()

