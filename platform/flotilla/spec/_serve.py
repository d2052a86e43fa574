"""The `serve` section: the HTTP endpoint, its replicas, autoscaling, batching and traffic."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from flotilla.spec._base import _Section


# ---------------------------------------------------------------------------- serve
# A traffic target: a registry alias (`champion`) or a version number (`3`).
TARGET = re.compile(r"^(?:[0-9]+|[A-Za-z_][A-Za-z0-9_-]*)$")


class AutoscalingSpec(_Section):
    """Ray Serve autoscaling of the model's replicas, on requests in flight per replica."""

    min_replicas: int = Field(1, ge=1, description="Replicas kept when idle.")
    max_replicas: int = Field(2, ge=1, description="Replicas at most under load.")
    target_ongoing_requests: float = Field(
        16, gt=0, description="Requests in flight per replica the autoscaler aims for (batching wants several)."
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="Load must stay high this long before adding a replica.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Load must stay low this long before removing one.")
    look_back_period_s: float = Field(
        30.0, gt=0, description="Window over which load is averaged (Serve's default). Serve collects load every "
        "10 s, so a window of 10 s or less makes it warn; shorter windows react faster but noisier.",
    )

    @model_validator(mode="after")
    def _min_below_max(self) -> "AutoscalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"`serve.autoscaling.min_replicas` ({self.min_replicas}) is above `serve.autoscaling.max_replicas` ({self.max_replicas}); "
                f"`--set serve.autoscaling.max_replicas={self.min_replicas}`"
            )
        return self


class BatchingSpec(_Section):
    """Dynamic batching (`@serve.batch`): concurrent requests share one forward pass."""

    max_batch_size: int = Field(32, ge=1, description="Requests per forward pass at most.")
    batch_wait_timeout_s: float = Field(
        0.0,
        ge=0,
        description="How long a group of requests waits for more before it queues for the model. 0 adds no "
        "latency: requests that arrive while the model is busy merge into its next forward pass anyway.",
    )
    generate_wait_s: float = Field(
        0.005,
        ge=0,
        description="Generators and chat endpoints: how long a whole-text request waits for others to decode with "
        "(one forward pass per token for all of them). A generation takes far longer; a request that comes later "
        "starts a batch of its own at once instead of waiting for a running one.",
    )


class ReplicaSpec(_Section):
    """Resources of one serving replica."""

    num_cpus: float = Field(1, ge=0, description="CPUs reserved per replica; also its torch thread count (at least 1).")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica; > 0 serves on CUDA.")


class AdaptersSpec(_Section):
    """Many LoRA adapters on one replica of a language model (Ray Serve's model multiplexing)."""

    max_per_replica: int = Field(
        0, ge=0, description="0: each served version loads as a whole model (its adapter merged into its base). "
        "K > 0: a replica holds its version's base once, unmerged, and besides the versions it serves, up to K "
        "adapters of other registered models trained on the same base (the same SHA-256), loaded from the registry "
        "on a request's first use and dropped least recently used; requests name them by `model` (`NAME` for its "
        "champion, `NAME@ALIAS`, `NAME/VERSION`), through the OpenAI router's `/v1` too, which sends each to a "
        "replica that holds its adapter. Requests for different adapters that arrive together decode together. "
        "Needs adapter versions (`model.lora.merge: false`).")


class ShadowSpec(_Section):
    """Mirror a share of traffic to another version; only the primary's answer is returned."""

    target: str = Field(..., description="Alias or version that receives the mirrored requests, e.g. `candidate`.")
    percent: float = Field(100, gt=0, le=100, description="Share of requests mirrored, in percent.")
    max_in_flight: int = Field(
        2, ge=1, description="Mirrored forward passes running at once per replica. A request is not mirrored "
        "(counted as `dropped`) while that many run or while requests wait for the model: the shadow "
        "only uses a replica's idle time and never doubles its load.")

    @field_validator("target")
    @classmethod
    def _target_form(cls, v: str) -> str:
        if not TARGET.match(v):
            raise ValueError(f"{v!r} is neither a version number nor an alias name")
        return v


class ServeSpec(_Section):
    """Ray Serve: the HTTP endpoint for the registered model (`pipelines/deploy.py`)."""

    model: Optional[str] = Field(None, description="Registered model to serve; null uses `track.model_name`, then `name`.")
    traffic: dict[str, float] = Field(
        {"champion": 100},
        description="Traffic split: alias or version -> weight, e.g. `{champion: 90, candidate: 10}`. Aliases are "
        "resolved to versions once, at deploy time.",
    )
    shadow: Optional[ShadowSpec] = Field(None, description="Mirror requests to a candidate (shadow mode).")
    sticky_header: str = Field(
        "X-User-Id", description="Requests carrying this header always reach the same version (stable hash of its value)."
    )
    host: str = Field("127.0.0.1", description="Address Serve's HTTP ingress binds; 0.0.0.0 exposes it beyond this machine.")
    port: int = Field(8000, gt=0, lt=65536, description="Port of Serve's HTTP ingress.")
    ingress: Literal["auto", "proxy", "haproxy"] = Field(
        "auto",
        description="How HTTP reaches the replicas. `haproxy`: Ray Serve's HAProxy ingress: each replica answers HTTP "
        "itself on a port of its own and HAProxy (shipped with Ray) balances them on `serve.port`; 2.2-2.8x the "
        "requests/s of `proxy` on 2 cores. The whole Ray cluster must start with it (Flotilla does for a local "
        "cluster it starts, with HAProxy's stats and metrics ports on 127.0.0.1 and a 3 s drain; see docs/how-to/ingress.md). "
        "`proxy`: Ray Serve's Python proxy forwards each request to a replica. `auto`: `haproxy` on a local "
        "cluster Flotilla starts, else whichever the cluster runs.",
    )
    route_prefix: Optional[str] = Field(
        None, description="URL prefix of the endpoint; null uses `/v1/models/<model>`."
    )
    openai_router: bool = Field(
        True, description="With a language model: also serve one OpenAI-compatible base URL for every language "
        "model of the cluster at `/v1` (`/v1/models`, `/v1/chat/completions`, `/v1/completions`, routed by the "
        "request's `model`), beside the model's own prefix. Started once; models deployed later join it.")
    adapters: AdaptersSpec = Field(default_factory=AdaptersSpec, description="Many adapters on one replica.")
    runtime: Literal["torch", "onnx", "onnx-int8", "onnx-int4", "auto"] = Field(
        "torch",
        description="What runs the model in a replica: `torch`, or a variant `flotilla export` built and gated "
        "(`onnx`, `onnx-int8`, and for language models `onnx-int4`); a version without that variant, or whose variant failed its gate, is refused. "
        "`auto`: the fastest of torch and the variants that passed, as measured when they were exported (torch "
        "for a version without variants, and on a GPU replica). The `X-Model-Runtime` header says which answered.",
    )
    replica: ReplicaSpec = Field(default_factory=ReplicaSpec, description="Resources per replica.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, description="Replica autoscaling.")
    batching: BatchingSpec = Field(default_factory=BatchingSpec, description="Dynamic batching.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests one replica works on at once (must be at least `batching.max_batch_size`)."
    )
    max_queued_requests: int = Field(
        256, ge=1, description="Requests waiting for a replica at most; past it the endpoint answers 503."
    )
    request_timeout_s: float = Field(30.0, gt=0, description="A request that takes longer gets 504 (or 408 from the proxy).")
    max_body_bytes: int = Field(1_000_000, gt=0, description="Larger request bodies get 413.")
    max_instances: int = Field(256, ge=1, description="Instances per prediction request at most (422 past it).")
    max_new_tokens: int = Field(512, ge=1, description="Upper bound on a generation request's `max_tokens`.")
    max_prompt_tokens: int = Field(
        8192, ge=1, description="Prompt tokens per language-model request at most (422 past it); the model's own "
        "context, where its config gives one, may allow fewer.")
    allow_factories: list[str] = Field(
        [], description="`custom` model factories (`package.module:function`) that a replica may import to load "
        "a registered version; a version whose bundle names any other is refused. Nothing else a version holds runs.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve asks each replica to run a forward pass.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="A health check slower than this fails.")
    graceful_shutdown_timeout_s: float = Field(
        20.0, ge=0, description="On scale-down or redeploy, in-flight requests get this long to finish."
    )

    @field_validator("traffic")
    @classmethod
    def _traffic_form(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k in v if not TARGET.match(str(k))]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: a traffic key is a version number or an alias name")
        if not v or any(w < 0 for w in v.values()) or sum(v.values()) <= 0:
            raise ValueError(f"weights must be >= 0 with a positive sum, e.g. {{champion: 90, candidate: 10}} (got {v})")
        return {str(k): float(w) for k, w in v.items()}

    @field_validator("route_prefix")
    @classmethod
    def _prefix_form(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not v.startswith("/") or (len(v) > 1 and v.endswith("/"))):
            raise ValueError(f"{v!r}: a route prefix starts with `/` and does not end with one, e.g. `/v1/models/digits`")
        return v

    @model_validator(mode="after")
    def _queue_holds_a_batch(self) -> "ServeSpec":
        if self.max_ongoing_requests < self.batching.max_batch_size:
            raise ValueError(
                f"`serve.max_ongoing_requests` ({self.max_ongoing_requests}) must be at least "
                f"`serve.batching.max_batch_size` ({self.batching.max_batch_size}), or batches never fill"
            )
        return self


