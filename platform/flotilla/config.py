"""The run spec: one YAML file describes one reproducible run.

    spec = load_spec("configs/digits.yaml", overrides=["train.lr=3e-4", "model.hidden=[256,128]"])

Validation happens here, before Ray starts, and reports every problem at once; each line
names the field (as the `--set` path), the bad value and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flotilla.errors import SpecError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------- data
class DataSpec(_Section):
    """Where the rows come from and how they become tensors."""

    source: str = Field(
        "digits",
        description="`digits` or `pycode` (built-in samples that need no download), or a Parquet/CSV "
        "file, directory or glob: a local path or a pyarrow filesystem URI such as `s3://bucket/prefix/`.",
    )
    format: Literal["auto", "parquet", "csv"] = Field(
        "auto", description="File format; `auto` decides from the file extension."
    )
    features: Optional[list[str]] = Field(
        None, description="Feature columns (numeric). Null means every column except `label`."
    )
    label: Optional[str] = Field(
        "target", description="Label column (classification or regression). Unused for text sources."
    )
    text_column: str = Field("text", description="Text column for language-model sources.")
    task: Literal["auto", "classification", "regression"] = Field(
        "auto",
        description="`auto` treats string, boolean and integer labels as classes and float labels "
        "as regression targets.",
    )
    scaling: Literal["standard", "minmax", "none"] = Field(
        "standard", description="Numeric feature scaling, fitted on the train split only."
    )
    val_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of rows (or documents, for text) held out for validation."
    )
    split_seed: int = Field(
        0, description="Seed of the train/validation split; the split is a hash of each row's content "
        "and this seed, so it does not depend on file order or block layout."
    )
    cache: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Keep the preprocessed splits in Ray's object store instead of re-reading and "
        "re-transforming the source every epoch. `auto` caches when the estimate is under a quarter of "
        "the object store; larger data always streams.",
    )
    max_bytes: Optional[int] = Field(
        2_000_000,
        gt=0,
        description="For `pycode`: stop adding standard-library files once the corpus has this many "
        "bytes (keeps CPU runs short). Null takes every file.",
    )


# -------------------------------------------------------------------------- models
Activation = Literal["relu", "gelu", "tanh", "silu"]


class MLPSpec(_Section):
    """A multi-layer perceptron for classification or regression on numeric features."""

    kind: Literal["mlp"] = Field("mlp", description="Model kind: `mlp`, `gpt` or `custom`.")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(
        [128, 64], description="Hidden layer widths, input to output."
    )
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout after each hidden layer.")
    activation: Activation = Field("relu", description="Hidden-layer activation.")


class GPTSpec(_Section):
    """A decoder-only transformer language model over bytes."""

    kind: Literal["gpt"] = Field("gpt", description="Model kind: `mlp`, `gpt` or `custom`.")
    layers: int = Field(4, gt=0, description="Transformer blocks.")
    heads: int = Field(4, gt=0, description="Attention heads per block; must divide `width`.")
    width: int = Field(128, gt=0, description="Embedding width (d_model).")
    context: int = Field(128, gt=1, description="Context length in tokens (bytes).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on attention and MLP outputs.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in the backward pass (less memory, ~30% more compute)."
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "GPTSpec":
        if self.width % self.heads:
            raise ValueError(
                f"`--model.heads` ({self.heads}) must divide `--model.width` ({self.width}); "
                f"try heads={_divisor_near(self.width, self.heads)}"
            )
        return self


class CustomModelSpec(_Section):
    """A user model: `factory(model_spec: dict, schema: dict) -> torch.nn.Module`."""

    kind: Literal["custom"] = Field("custom", description="Model kind: `mlp`, `gpt` or `custom`.")
    factory: str = Field(
        ..., description="Import path `package.module:function`, importable from the working directory."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Free-form options passed to the factory inside the model spec."
    )


ModelSpec = Annotated[Union[MLPSpec, GPTSpec, CustomModelSpec], Field(discriminator="kind")]


# ---------------------------------------------------------------------------- train
class TrainSpec(_Section):
    """How the model is trained: Ray Train workers, DeepSpeed, schedule, checkpoints."""

    num_workers: int = Field(2, gt=0, description="Ray Train workers (data-parallel ranks).")
    cpus_per_worker: float = Field(1, gt=0, description="CPUs reserved per worker; also its torch thread count.")
    gpus_per_worker: float = Field(0, ge=0, description="GPUs per worker; > 0 trains on CUDA with NCCL.")
    epochs: int = Field(10, gt=0, description="Passes over the train split.")
    batch_size: int = Field(64, gt=0, description="Micro-batch per worker per step.")
    grad_accum: int = Field(
        1, gt=0, description="Micro-batches accumulated per optimizer step (simulates a larger batch)."
    )
    lr: float = Field(1e-3, gt=0, description="Peak learning rate of AdamW.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_fraction: float = Field(
        0.05, ge=0, lt=1, description="Share of optimizer steps spent warming the LR up linearly."
    )
    min_lr_ratio: float = Field(
        0.01, ge=0, le=1, description="Cosine decay ends at `lr * min_lr_ratio`."
    )
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 disables).")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Offload of optimizer state to CPU memory (stages 1-3, GPU training)."
    )
    offload_params: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Infinity offload of parameters to CPU memory (stage 3, GPU training)."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="`auto`: bf16 on GPUs that support it, fp16 with dynamic loss scaling on older GPUs, "
        "fp32 on CPUs without native bf16 matrix units.",
    )
    seed: int = Field(0, description="Seed for weights, dropout and data order.")
    max_failures: int = Field(
        2, ge=-1, description="Worker failures to recover from (restart + resume from the last checkpoint); -1 is unlimited."
    )
    run_name: Optional[str] = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Name of the run under `storage_path`. Re-running with the same name resumes it; "
        "null makes a new name from the spec name and the time.",
    )
    storage_path: str = Field(
        "runs", description="Where checkpoints and the bundle go: a local directory or a pyarrow URI."
    )
    checkpoints_to_keep: int = Field(
        2, ge=1, description="Checkpoints kept per run; more than one lets a torn latest fall back to the one before."
    )
    scale_up_timeout_s: float = Field(
        600,
        ge=0,
        description="On a running cluster too small for the workers: how long to wait for its autoscaler to add "
        "nodes before failing (a cluster whose autoscaler launches nothing fails after ~30 s).",
    )

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> "TrainSpec":
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError(
                "`--train.offload_params` needs `--train.zero_stage=3`; set zero_stage to 3 or offload_params to none"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(
                "`--train.offload_optimizer` needs ZeRO stage 1, 2 or 3; raise `--train.zero_stage` or set offload_optimizer to none"
            )
        return self


# ---------------------------------------------------------------------------- track
# A gate rule: `<metric> <op> <number>`, e.g. `val_accuracy >= 0.95`.
GATE_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
# Final metrics a gate may test, by task; `primary` is what "no worse than the champion" compares.
GATE_METRICS = {
    "classification": ("val_accuracy", "val_loss", "train_loss"),
    "regression": ("val_rmse", "val_loss", "train_loss"),
    "lm": ("val_perplexity", "val_loss", "train_loss", "tokens_per_s", "mfu"),
}
PRIMARY_METRIC = {"classification": ("val_accuracy", "max"), "regression": ("val_rmse", "min"), "lm": ("val_perplexity", "min")}


class GateSpec(_Section):
    """When a newly registered version is also promoted to `champion`."""

    require: list[str] = Field(
        default_factory=list,
        description="Rules on the run's final metrics, all of which must hold, e.g. `val_accuracy >= 0.95`.",
    )
    beat_champion: bool = Field(
        False,
        description="Also require the new version to be no worse than the current `champion` on this run's "
        "validation rows (both evaluated there from their bundles, on the task's main metric).",
    )
    tolerance: float = Field(
        0.0, ge=0, description="How much worse than the champion still counts as no worse (absolute, same units)."
    )

    @model_validator(mode="after")
    def _rules_parse(self) -> "GateSpec":
        known = sorted({m for names in GATE_METRICS.values() for m in names})
        bad = []
        for rule in self.require:
            match = GATE_RULE.match(rule)
            if not match:
                bad.append(f"{rule!r} is not `<metric> <op> <number>` (op one of >=, <=, >, <)")
            elif match.group(1) not in known:
                bad.append(f"{rule!r}: unknown metric {match.group(1)!r}; gates can test {', '.join(known)}")
        if bad:
            raise ValueError("`--track.gate.require`: " + "; ".join(bad))
        return self


class TrackSpec(_Section):
    """MLflow: where runs are recorded and which registered model a run's bundle becomes."""

    enabled: bool = Field(True, description="Record the run in MLflow and register its model.")
    uri: Optional[str] = Field(
        None,
        description="MLflow tracking URI: `http(s)://host:port` for a tracking server, or a database URI. "
        "Null uses $MLFLOW_TRACKING_URI, else the embedded store `sqlite:///mlruns/mlflow.db` "
        "(artifacts in `mlruns/artifacts`) under the working directory.",
    )
    experiment: Optional[str] = Field(None, description="MLflow experiment; null uses the spec's `name`.")
    model_name: Optional[str] = Field(
        None, description="Registered model that each successful run adds a version to; null uses the spec's `name`."
    )
    register_model: bool = Field(
        True, description="Register the bundle as a new model version with the alias `candidate`."
    )
    gate: GateSpec = Field(default_factory=GateSpec, description="The quality gate for promotion to `champion`.")


# ----------------------------------------------------------------------------- tune
# How a dimension of the search space is written: `train.lr: {loguniform: [1e-4, 1e-2]}`.
SPACE_KINDS = ("loguniform", "uniform", "randint", "choice", "grid")


class TuneSpec(_Section):
    """A hyperparameter sweep over this spec: each trial is an ordinary training run."""

    space: dict[str, dict[str, Any]] = Field(
        ...,
        description="Search space by dotted spec path, e.g. `train.lr: {loguniform: [1e-4, 1e-2]}`, "
        "`model.hidden: {choice: [[64], [128, 64]]}`; kinds: loguniform, uniform, randint (both ends "
        "included), choice, grid (every value, once per sample).",
    )
    search: Literal["random", "grid", "optuna"] = Field(
        "random", description="`random` (and `grid` entries), `grid` (every combination of grid/choice "
        "entries; no continuous ones), or `optuna` (TPE)."
    )
    scheduler: Literal["fifo", "asha"] = Field(
        "asha", description="`asha` stops trials early on the per-epoch metric; `fifo` runs every trial to the end."
    )
    num_samples: int = Field(8, gt=0, description="Trials to sample (with `grid` entries: repeats of the grid).")
    max_concurrent_trials: Optional[int] = Field(
        None, gt=0, description="Trials running at once; null fits as many as the cluster's CPUs/GPUs hold."
    )
    time_budget_s: Optional[float] = Field(
        None, gt=0, description="Wall-clock budget of the sweep; running trials stop when it is spent."
    )
    metric: Optional[str] = Field(
        None, description="Metric to optimize; null uses the task's main one (val_accuracy, val_rmse, val_perplexity)."
    )
    mode: Optional[Literal["min", "max"]] = Field(
        None, description="Whether the metric is minimized or maximized; null infers it from the metric's name."
    )
    grace_period: int = Field(1, gt=0, description="ASHA: epochs every trial runs before it may be stopped.")
    reduction_factor: float = Field(2.0, gt=1, description="ASHA: keep the top 1/reduction_factor at each rung.")
    trial_max_failures: int = Field(
        1, ge=0, description="Retries of a trial that errors (it resumes from its checkpoints) before it is reported failed."
    )
    seed: int = Field(0, description="Seed of the search algorithm (random sampling and Optuna's TPE).")
    name: Optional[str] = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Name of the sweep; re-running with the same name resumes it. Null uses `<name>-sweep`.",
    )

    @field_validator("space", mode="before")
    @classmethod
    def _numbers_in_ranges(cls, space: Any) -> Any:
        # YAML 1.1 reads `1e-4` (no dot) as a string; in a range it can only mean a number.
        if not isinstance(space, dict):
            return space
        fixed = {}
        for path, dim in space.items():
            if isinstance(dim, dict) and len(dim) == 1 and next(iter(dim)) in ("loguniform", "uniform", "randint"):
                kind, arg = next(iter(dim.items()))
                if isinstance(arg, list):
                    dim = {kind: [_number(v) for v in arg]}
            fixed[path] = dim
        return fixed

    @model_validator(mode="after")
    def _space_is_well_formed(self) -> "TuneSpec":
        problems = [p for path, dim in self.space.items() for p in space_problems(path, dim)]
        if self.search == "optuna":
            grids = [path for path, dim in self.space.items() if "grid" in dim]
            if grids:
                problems.append(f"`grid` entries ({', '.join(grids)}) need `--tune.search=random` or `grid`, not optuna")
        if self.search == "grid":
            continuous = [path for path, dim in self.space.items() if set(dim) & {"loguniform", "uniform", "randint"}]
            if continuous:
                problems.append(f"`--tune.search=grid` takes only choice/grid entries; {', '.join(continuous)} are ranges")
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def space_problems(path: str, dim: Any) -> list[str]:
    """What is wrong with one search-space entry (empty when nothing is)."""
    where = f"`tune.space.{path}`"
    if not isinstance(dim, dict) or len(dim) != 1 or next(iter(dim)) not in SPACE_KINDS:
        return [f"{where} must be one of {{{': ..., '.join(SPACE_KINDS)}: ...}} (got {dim!r})"]
    kind, arg = next(iter(dim.items()))
    if kind in ("choice", "grid"):
        return [] if isinstance(arg, list) and arg else [f"{where}: {kind} needs a non-empty list (got {arg!r})"]
    if not (isinstance(arg, list) and len(arg) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in arg)):
        return [f"{where}: {kind} needs [low, high] (got {arg!r})"]
    low, high = arg
    if low >= high:
        return [f"{where}: {kind} needs low < high (got {arg!r})"]
    if kind == "loguniform" and low <= 0:
        return [f"{where}: loguniform needs low > 0 (got {arg!r})"]
    if kind == "randint" and not all(isinstance(v, int) for v in arg):
        return [f"{where}: randint needs integers (got {arg!r})"]
    return []


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
    look_back_period_s: float = Field(10.0, gt=0, description="Window over which load is averaged.")

    @model_validator(mode="after")
    def _min_below_max(self) -> "AutoscalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"`--serve.autoscaling.min_replicas` ({self.min_replicas}) is above `max_replicas` ({self.max_replicas})"
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


class ReplicaSpec(_Section):
    """Resources of one serving replica."""

    num_cpus: float = Field(1, ge=0, description="CPUs reserved per replica; also its torch thread count (at least 1).")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica; > 0 serves on CUDA.")


class ShadowSpec(_Section):
    """Mirror a share of traffic to another version; only the primary's answer is returned."""

    target: str = Field(..., description="Alias or version that receives the mirrored requests, e.g. `candidate`.")
    percent: float = Field(100, gt=0, le=100, description="Share of requests mirrored, in percent.")

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
    host: str = Field("127.0.0.1", description="Address Serve's HTTP proxy binds; 0.0.0.0 exposes it beyond this machine.")
    port: int = Field(8000, gt=0, lt=65536, description="Port of Serve's HTTP proxy.")
    ingress: Literal["proxy", "haproxy"] = Field(
        "proxy",
        description="How HTTP reaches the replicas. `proxy`: Ray Serve's Python proxy forwards each request to a "
        "replica. `haproxy`: Ray Serve's HAProxy ingress: each replica answers HTTP itself on a port of its own and "
        "HAProxy (shipped with Ray) balances them on `serve.port`; 2.4-2.9x the requests/s of `proxy` on 2 cores, but "
        "the whole Ray cluster must start with it (Flotilla does that for the local cluster it starts; see README), "
        "HAProxy's stats and metrics ports bind all interfaces, and a replica drains for 30 s when removed.",
    )
    route_prefix: Optional[str] = Field(
        None, description="URL prefix of the endpoint; null uses `/v1/models/<model>`."
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
                f"`--serve.max_ongoing_requests` ({self.max_ongoing_requests}) must be at least "
                f"`--serve.batching.max_batch_size` ({self.batching.max_batch_size}), or batches never fill"
            )
        return self


# ------------------------------------------------------------------------ cost
class CostSpec(_Section):
    """Prices for the resource accounting of runs and sweeps (CPU-hours, GPU-hours, cost)."""

    cpu_hour: Optional[float] = Field(
        None, ge=0, description="Price of one CPU for one hour. Null: from the nodes' `flotilla.io/price-per-hour` "
        "labels (cluster.yaml), else no cost estimate."
    )
    gpu_hour: Optional[float] = Field(
        None, ge=0, description="Price of one GPU for one hour (null: from the node labels, as cpu_hour)."
    )
    currency: str = Field("USD", pattern=r"^[A-Z]{3}$", description="Currency of the prices (ISO 4217 code).")


# ---------------------------------------------------------------------------- spec
class RunSpec(_Section):
    """One reproducible run."""

    name: str = Field(
        "run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Name of the spec; prefixes run names."
    )
    data: DataSpec = Field(default_factory=DataSpec, description="Input data and preprocessing.")
    model: ModelSpec = Field(default_factory=MLPSpec, description="The model to train.")
    train: TrainSpec = Field(default_factory=TrainSpec, description="Training and checkpoints.")
    track: TrackSpec = Field(default_factory=TrackSpec, description="Experiment tracking and the model registry.")
    tune: Optional[TuneSpec] = Field(None, description="A hyperparameter sweep over this spec (`tune/sweep.py`).")
    serve: ServeSpec = Field(default_factory=ServeSpec, description="The HTTP endpoint (`pipelines/deploy.py`).")
    cost: CostSpec = Field(default_factory=CostSpec, description="Prices for resource accounting.")

    @model_validator(mode="before")
    @classmethod
    def _model_kind_defaults_to_mlp(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "kind" not in raw["model"]:
            raw = {**raw, "model": {"kind": "mlp", **raw["model"]}}
        return raw

    def _space_paths_problems(self) -> list[str]:
        """Every value the sweep can give each path must make a valid spec (ranges: both ends)."""
        base = self.model_dump(mode="json", exclude={"tune"})
        problems = []
        for path, dim in self.tune.space.items():
            kind, arg = next(iter(dim.items()))
            for value in arg:
                raw = copy.deepcopy(base)
                try:
                    set_path(raw, path, value)
                    RunSpec.model_validate(raw)
                except ValueError as e:
                    errors = e.errors() if isinstance(e, ValidationError) else [{"loc": (), "msg": str(e), "type": "x"}]
                    problems += [f"`tune.space.{path}` = {value!r}: {_describe(err)}" for err in errors]
                    break
        return problems

    @model_validator(mode="after")
    def _model_fits_data(self) -> "RunSpec":
        if isinstance(self.model, GPTSpec) and self.data.source == "digits":
            raise ValueError("`--model.kind=gpt` needs a text source such as `--data.source=pycode`")
        if isinstance(self.model, MLPSpec) and self.data.source == "pycode":
            raise ValueError("`--data.source=pycode` is text; use `--model.kind=gpt`")
        if self.tune is not None:
            problems = self._space_paths_problems()
            if problems:
                raise ValueError("; ".join(problems))
        if isinstance(self.model, GPTSpec):
            lm = GATE_METRICS["lm"]
            for rule in self.track.gate.require:
                match = GATE_RULE.match(rule)
                if match and match.group(1) not in lm:
                    raise ValueError(
                        f"`--track.gate.require`: {rule!r} tests {match.group(1)!r}, which a gpt run does not report; "
                        f"use one of {', '.join(lm)}"
                    )
        return self


# -------------------------------------------------------------------- loading
def load_spec(path: str | Path | None = None, overrides: list[str] | None = None) -> RunSpec:
    """Load a YAML run spec, apply `a.b=c` overrides, validate, and return it.

    Raises `SpecError` listing every problem at once.
    """
    source = str(path) if path else "built-in default spec"
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise SpecError([f"config file {str(p)!r} does not exist; configs/ has {_list_configs()}"], source)
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise SpecError([f"not valid YAML: {e}"], source) from None
        if not isinstance(raw, dict):
            raise SpecError([f"the top level must be a mapping of sections, got {type(raw).__name__}"], source)
    problems = []
    for item in overrides or []:
        try:
            apply_override(raw, item)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise SpecError(problems, source)
    return validate_spec(raw, source)


def validate_spec(raw: dict[str, Any], source: str = "run spec") -> RunSpec:
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError([_describe(err) for err in e.errors()], source) from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `--set a.b.c=value` override in place; the value is parsed as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} must look like `section.field=value`, e.g. `train.lr=3e-4`")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    set_path(raw, key.strip(), parsed, f"override {item!r}")


def set_path(raw: dict[str, Any], dotted: str, value: Any, what: str = "") -> None:
    """Set `raw["a"]["b"]["c"] = value` for `a.b.c`, creating sections as needed."""
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{what or dotted}: `{part}` is a value, not a section")
        node = child
    node[parts[-1]] = value


def spec_to_yaml(spec: RunSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


# ------------------------------------------------------------- error messages
def _describe(err: dict[str, Any]) -> str:
    path, model_cls = _resolve_loc(err["loc"])
    dotted = ".".join(path) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = sorted(model_cls.model_fields) if model_cls else []
        close = difflib.get_close_matches(path[-1], allowed, n=1, cutoff=0.5)
        hint = f"; did you mean `{'.'.join(path[:-1] + [close[0]])}`?" if close else ""
        return f"`{dotted}`: unknown key{hint} Allowed keys here: {', '.join(allowed)}"
    if kind == "union_tag_invalid":
        return f"`{dotted}.kind`: {err['input'].get('kind')!r} is not a model kind; allowed: mlp, gpt, custom"
    if kind == "union_tag_not_found":
        return f"`{dotted}.kind` is missing; allowed: mlp, gpt, custom"
    value = err.get("input")
    shown = "" if kind == "missing" or isinstance(value, dict) else f" (got {value!r})"
    msg = err["msg"].removeprefix("Value error, ")
    if not path and kind == "value_error":  # a cross-field rule: its message names the fields
        return msg
    return f"`{dotted}`: {msg}{shown}"


def _resolve_loc(loc: tuple) -> tuple[list[str], type[BaseModel] | None]:
    """Turn a pydantic error location into the `--set` path and the model that owns its last key."""
    path: list[str] = []
    cls: Any = RunSpec
    owner: type[BaseModel] | None = RunSpec
    pending_union: list[type[BaseModel]] | None = None
    for part in loc:
        if pending_union is not None:
            chosen = next((m for m in pending_union if m.model_fields["kind"].default == part), None)
            pending_union = None
            if chosen is not None:  # a discriminator tag, not a key
                cls = owner = chosen
                continue
        path.append(str(part))
        if isinstance(cls, type) and issubclass(cls, BaseModel) and part in cls.model_fields:
            owner = cls
            annotation = cls.model_fields[part].annotation
            members = [a for a in _flatten(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(members) > 1:
                pending_union, cls = members, None
            elif members:
                cls = members[0]
            else:
                cls = None
        elif isinstance(cls, type) and issubclass(cls, BaseModel):
            owner = cls
            cls = None
    return path, owner


def _flatten(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Annotated:
        return _flatten(args[0])
    if args and typing.get_origin(annotation) in (Union, getattr(__import__("types"), "UnionType", Union)):
        return [m for a in args for m in _flatten(a)]
    return [annotation]


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))


def _list_configs() -> str:
    configs = sorted(Path("configs").glob("*.yaml")) if Path("configs").is_dir() else []
    return ", ".join(str(c) for c in configs) or "no YAML files"


def spec_reference_markdown() -> str:
    """The run spec reference for the README: every section and field, its default and meaning."""
    sections = [
        ("top level", RunSpec, ["name"]),
        ("data", DataSpec, None),
        ("model (kind: mlp)", MLPSpec, None),
        ("model (kind: gpt)", GPTSpec, None),
        ("model (kind: custom)", CustomModelSpec, None),
        ("train", TrainSpec, None),
        ("track", TrackSpec, None),
        ("track.gate", GateSpec, None),
        ("tune", TuneSpec, None),
        ("serve", ServeSpec, None),
        ("serve.shadow", ShadowSpec, None),
        ("serve.replica", ReplicaSpec, None),
        ("serve.autoscaling", AutoscalingSpec, None),
        ("serve.batching", BatchingSpec, None),
    ]
    lines = []
    for title, model, only in sections:
        lines += [f"**{title}**", "", "| field | default | meaning |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            if only is not None and name not in only:
                continue
            default = "required" if field.is_required() else field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                lines.append(f"| `{name}` | (section below) | {field.description} |")
                continue
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"| `{name}` | `{shown}` | {field.description} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m flotilla.config > the README's reference section
    print(spec_reference_markdown())
