"""What a serving replica is given: its fixed limits (constructor) and what may change in place
(Serve's `user_config`: the split, the shadow, batching). Both cross from the deploying driver to
the replica as plain dicts and are validated when the replica reads them."""

from __future__ import annotations

import math
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShadowTarget(_Strict):
    """The version that receives mirrored requests, and on what share of them."""

    version: str
    percent: float = Field(gt=0, le=100)
    max_in_flight: int = Field(2, ge=1)  # mirrored forwards at once; more are dropped


class ReplicaConfig(_Strict):
    """Serve's `user_config`: a change is applied by the running replicas without a restart."""

    traffic: dict[str, float]  # version -> weight
    aliases: dict[str, list[str]] = Field(default_factory=dict)  # version -> the aliases it was named by
    shadow: Optional[ShadowTarget] = None
    max_batch_size: int = Field(ge=1)
    batch_wait_timeout_s: float = Field(ge=0)
    generate_wait_s: float = Field(0.005, ge=0)


class ReplicaLimits(_Strict):
    """The per-request bounds and resources a replica is constructed with."""

    max_body_bytes: int = Field(gt=0)
    max_instances: int = Field(ge=1)
    max_new_tokens: int = Field(ge=1)
    max_prompt_tokens: int = Field(8192, ge=1)
    request_timeout_s: float = Field(gt=0)
    sticky_header: str
    num_cpus: int = Field(ge=1)  # torch threads
    num_gpus: float = Field(ge=0)
    allow_factories: tuple[str, ...] = ()  # custom model factories a version may import
    runtime: str = "torch"  # serve.runtime: torch, onnx, onnx-int8, onnx-int4 or auto
    max_adapters: int = Field(0, ge=0)  # serve.adapters.max_per_replica: 0, whole models; K, adapters on one base

    @classmethod
    def from_spec(cls, s) -> "ReplicaLimits":
        """From the spec's `serve` section (a `flotilla.spec.ServeSpec`)."""
        return cls(
            max_body_bytes=s.max_body_bytes, max_instances=s.max_instances, max_new_tokens=s.max_new_tokens,
            max_prompt_tokens=s.max_prompt_tokens,
            request_timeout_s=s.request_timeout_s, sticky_header=s.sticky_header,
            num_cpus=max(1, math.floor(s.replica.num_cpus)) if s.replica.num_cpus else 1,
            num_gpus=s.replica.num_gpus, allow_factories=tuple(s.allow_factories), runtime=s.runtime,
            max_adapters=s.adapters.max_per_replica,
        )
