"""What a model, the training loop and the bundle know about the data: one validated type.

It travels from the driver to every worker (inside `WorkerConfig`) and into the bundle's
model.json, and is validated wherever it is read back. Model factories receive it as a plain dict
(`as_dict()`), their documented interface.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, model_validator

FEATURES = "features"  # the concatenated feature column that reaches the model
TOKENS = "tokens"  # int64 windows of context + 1 bytes (inputs and shifted targets)
VOCAB_SIZE = 256  # byte-level tokens


class DataSchema(BaseModel):
    """The data of one run: its task, and the columns, classes or vocabulary that task needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: Literal["classification", "regression", "lm"]
    # tabular tasks
    feature_columns: Optional[list[str]] = None
    label_column: Optional[str] = None
    num_features: Optional[int] = None  # the width of the encoded feature vector the model takes
    categorical_columns: Optional[list[str]] = None  # feature columns whose raw values are strings
    classes: Optional[list[Any]] = None  # classification: the label values, index = class id
    num_classes: Optional[int] = None
    # language models
    vocab_size: Optional[int] = None
    context: Optional[int] = None
    text_column: Optional[str] = None  # byte-level `gpt`: the text column
    # pretrained models (`hf_causal_lm`): rows become `input_ids` and shifted `labels` (a loss mask)
    tokenizer: Optional[str] = None  # `model.pretrained`: where the tokenizer loads from
    row_format: Optional[Literal["prompt_response", "messages", "text", "preference"]] = None

    @model_validator(mode="after")
    def _fields_of_the_task(self) -> "DataSchema":
        needed = {
            "classification": ("feature_columns", "label_column", "num_features", "classes", "num_classes"),
            "regression": ("feature_columns", "label_column", "num_features"),
            "lm": ("vocab_size", "context") + (("row_format",) if self.tokenizer else ("text_column",)),
        }[self.task]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.task} schema needs {', '.join(missing)}")
        return self

    @property
    def masked(self) -> bool:
        """Token windows with a loss mask (a pretrained model's `input_ids` and `labels`), not byte windows."""
        return self.tokenizer is not None

    @property
    def pairs(self) -> bool:
        """Preference pairs: `input_ids` and `labels` of (rows, 2, context), the chosen answer first."""
        return self.row_format == "preference"

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: what model factories receive and model.json holds."""
        return self.model_dump(mode="json", exclude_none=True)
