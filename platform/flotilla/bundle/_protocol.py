"""What every loaded bundle offers, whichever loader built it (`load_bundle`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

import pandas as pd


@runtime_checkable
class Bundle(Protocol):
    """The contract between training and serving, as serving, scoring and the gate use it.

    `InferenceBundle` (Flotilla's own models, run by torch or an ONNX variant) and `HFBundle`
    (a fine-tuned Hugging Face causal LM) both satisfy it; callers that need more than this
    (chat templates, batched token decoding) check for the concrete class once, where they
    choose what to build."""

    path: Path | None
    metrics: dict[str, Any]
    model_spec: dict[str, Any]
    runtime: str

    @property
    def task(self) -> str: ...

    def predict_frame(self, frame: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame: ...

    def generate(self, prompt: str, **settings: Any) -> str: ...

    def generate_stream(self, prompt: str, **settings: Any) -> Iterator[str]: ...
