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
    # Both splits are materialized: every rank reads each whole (reading costs no Ray Data task) and
    # takes every world-th batch of one order that does not depend on the number of workers, so an
    # epoch resumes at the batch it reached, at any size, using no row twice. Otherwise each rank
    # streams its shard of a split, and an epoch interrupted resumes from its start.
    whole_splits: bool = False
    # Checkpoints within an epoch (`train.checkpoint_every_s`, drain notices); off in a sweep's trials,
    # whose scheduler counts every report as an epoch.
    within_epoch: bool = True

    def to_ray(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
