"""The base of every spec section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    """Unknown keys are errors (a typo never passes silently); assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
