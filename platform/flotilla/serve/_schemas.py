"""Request and response bodies of the serving API, and how their validation errors read.

Every schema forbids unknown fields; numbers must be finite JSON numbers (no NaN or Infinity).
A feature value is a finite number, a string (a category), a boolean or null (a missing value,
which the model's imputer fills). What depends on the model (which columns take strings or
booleans, the feature count) and on the deployment (instances per request, tokens per
generation) is checked by the server, with the same error shape:
`{"error": "...", "status": 422, "fields": [{"field": "instances[2]", "message": "..."}]}`.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import (AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Strict, Tag,
                      ValidationError, WithJsonSchema, field_validator)

Number = Annotated[float, Strict(), AllowInfNan(False)]
MAX_CATEGORY_CHARS = 1000  # a categorical value longer than this is no category


def _feature_value(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("NaN and Infinity are not allowed: a feature value is a finite number, or null when missing")
        return value
    if isinstance(value, str):
        if len(value) > MAX_CATEGORY_CHARS:
            raise ValueError(f"a string value is at most {MAX_CATEGORY_CHARS} characters")
        return value
    raise ValueError("a feature value is a finite number, a string, a boolean or null (missing)")


Value = Annotated[
    Any,
    BeforeValidator(_feature_value),
    WithJsonSchema({"anyOf": [{"type": "number"}, {"type": "string", "maxLength": MAX_CATEGORY_CHARS},
                              {"type": "boolean"}, {"type": "null"}]}),
]
INT64_MAX = 2**63 - 1  # what a seed or a count may be: torch takes 64-bit integers
MIN_TEMPERATURE = 0.01
# An error answer stays small whatever the request: a body of many bad rows lists the first
# MAX_LISTED_ERRORS problems (and counts the rest), each path and message cut to MAX_ERROR_TEXT
# characters, so it cannot be turned into an answer many times the size of the request.
MAX_LISTED_ERRORS = 20
MAX_ERROR_TEXT = 200
MAX_ERROR_MESSAGE = 2000
MAX_ERROR_BYTES = 16 * 1024  # an error answer's body at most


def _instance_form(value: Any) -> str | None:
    return "row" if isinstance(value, list) else "record" if isinstance(value, dict) else None


Instance = Annotated[
    Union[Annotated[list[Value], Tag("row")], Annotated[dict[str, Value], Tag("record")]],
    Discriminator(
        _instance_form,
        custom_error_type="instance_form",
        custom_error_message="an instance is a list of feature values or an object of feature name -> value",
    ),
]
_TAGS = {"row", "record"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PredictRequest(_Body):
    """Rows to predict: each a list of feature values in the model's column order, or an object by column name.
    A value is a number, a string for a categorical column, a boolean for a boolean one, or null when missing."""

    instances: list[Instance] = Field(..., min_length=1, description="The rows to predict (at least one).")


class PredictResponse(_Body):
    model: str = Field(..., description="Registered model name.")
    version: str = Field(..., description="The model version that answered.")
    predictions: list[Any] = Field(..., description="One prediction per instance: a class label or a number.")
    probabilities: Optional[list[list[float]]] = Field(
        None, description="Classification: per instance, the probability of each class in `classes` order."
    )
    classes: Optional[list[Any]] = Field(None, description="Classification: the class labels.")


class GenerateRequest(_Body):
    """Text generation from a prompt, byte by byte."""

    prompt: Annotated[str, Strict()] = Field(..., max_length=100_000, description="The text to continue.")
    max_tokens: Annotated[int, Strict()] = Field(64, ge=1, description="Tokens (bytes) to generate.")
    temperature: Number = Field(
        1.0, ge=0.0, le=10.0, description=f"Sampling temperature: 0 is greedy, else {MIN_TEMPERATURE} to 10."
    )
    top_k: Annotated[int, Strict()] = Field(
        0, ge=0, le=INT64_MAX, description="Sample among the k likeliest tokens; 0 is off."
    )
    seed: Optional[Annotated[int, Strict()]] = Field(
        None, ge=0, le=INT64_MAX, description="Seed of the sampler: the same seed and prompt give the same text."
    )
    stream: Annotated[bool, Strict()] = Field(
        False, description="Stream tokens as server-sent events (`data: {\"text\": ...}`) as they are produced."
    )

    @field_validator("temperature")
    @classmethod
    def _not_vanishing(cls, value: float) -> float:
        # Logits divided by a temperature near 0 overflow to infinity and sampling breaks down.
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"use 0 for greedy decoding, or a temperature of at least {MIN_TEMPERATURE}")
        return value


class GenerateResponse(_Body):
    model: str = Field(..., description="Registered model name.")
    version: str = Field(..., description="The model version that answered.")
    text: str = Field(..., description="The generated continuation (without the prompt).")


class ErrorField(_Body):
    field: str
    message: str


class ErrorResponse(_Body):
    error: str = Field(..., description="What went wrong and how to fix it.")
    status: int = Field(..., description="The HTTP status code.")
    fields: list[ErrorField] = Field(default_factory=list, description="Per-field problems, for 422.")


def field_path(loc: tuple) -> str:
    """`("instances", 2, "row", 0)` → `instances[2][0]` (union tags dropped)."""
    out = ""
    for part in loc:
        if part in _TAGS:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(body)"


def validation_fields(error: ValidationError) -> list[ErrorField]:
    fields = []
    for err in error.errors(include_url=False):
        path = field_path(err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field; remove it"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            msg = str(err["ctx"]["error"])  # without pydantic's "Value error, " prefix
        fields.append(ErrorField(field=path, message=msg))
    return fields


def shorten(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """`text`, cut to `limit` characters (with how many more there were)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def listed_fields(fields: list[ErrorField]) -> list[ErrorField]:
    """The problems an error answer lists: at most MAX_LISTED_ERRORS, each shortened, and one
    entry `(more)` saying how many were left out."""
    listed = [ErrorField(field=shorten(f.field), message=shorten(f.message)) for f in fields[:MAX_LISTED_ERRORS]]
    if len(fields) > MAX_LISTED_ERRORS:
        listed.append(ErrorField(field="(more)", message=f"{len(fields) - MAX_LISTED_ERRORS} more problems not "
                                 "listed; fix these first"))
    return listed


def fields_summary(fields: list[ErrorField], count: int = 5) -> str:
    """The first few problems on one line, as error messages begin."""
    summary = "; ".join(f"{shorten(f.field)}: {shorten(f.message)}" for f in fields[:count])
    return summary + (f"; and {len(fields) - count} more" if len(fields) > count else "")


def schema_of(model: type[BaseModel]) -> dict:
    """The request body as an OpenAPI schema (for `/docs`, and what a fuzzer generates bodies
    from): self-contained, its nested definitions under its own `$defs`."""
    return model.model_json_schema()
