"""What the driver hands every training worker: one validated type (Ray passes it as a dict)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flotilla.data import DataSchema
from flotilla.spec import RunSpec


class WorkerConfig(BaseModel):
    """`train_loop_config` of a run: the spec, the data it was prepared into, and the run's name."""

    model_config = ConfigDict(extra="forbid")

    spec: RunSpec
    data: DataSchema
    preprocessors: dict[str, Any]  # JSON form, copied into the bundle as is
    fingerprint: str
    train_rows: int = Field(gt=0)
    run_name: str
    # Every rank gets the whole validation split (materialized, so reading it costs no tasks) and
    # scores every world-th batch of it, instead of a shard of a streaming split.
    whole_val: bool = False

    def to_ray(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
