"""The run spec's sections: one pydantic model per section, a description on every field.

The descriptions are the one source of the spec reference (`flotilla config`) and the JSON
Schema (`flotilla config --schema`). Error messages name fields as the user writes them in
`--set section.field=value`.
"""

from __future__ import annotations

import copy
import math
import os
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from flotilla.metrics import gate_metrics
from flotilla.spec._base import _Section
from flotilla.spec._messages import describe, divisor_near
from flotilla.spec._numbers import boolean_problems
from flotilla.spec._paths import set_path
from flotilla.spec._serve import ServeSpec
from flotilla.spec._tune import TuneSpec

# The cluster-wide default for `train.storage_path` (cluster.yaml sets it on every node).
STORAGE_ENV = "FLOTILLA_STORAGE_PATH"


# --------------------------------------------------------------------------- data
NumericImpute = Literal["mean", "median", "constant"]
CategoricalEncoding = Literal["onehot", "ordinal", "hash"]


class ColumnSpec(_Section):
    """How one feature column becomes numbers; what is left unset follows the column's type and the
    `data` section's defaults."""

    kind: Literal["auto", "numeric", "categorical"] = Field(
        "auto",
        description="`auto`: numbers and booleans are numeric, strings categorical; `categorical` also "
        "takes a numeric column by value (codes, ZIP codes).",
    )
    impute: Optional[Literal["mean", "median", "constant", "most_frequent", "category"]] = Field(
        None,
        description="Missing values: numeric `mean`, `median` or `constant` (default `data.impute`); categorical "
        "`category` (the default: missing is a category of its own), `most_frequent` or `constant`.",
    )
    fill_value: Optional[Union[float, str]] = Field(
        None, description="The value `impute: constant` fills in (default `data.fill_value`, or `missing` for a categorical column)."
    )
    encode: Optional[CategoricalEncoding] = Field(
        None,
        description="Categorical columns: `onehot`, `ordinal` or `hash`; default by the number of distinct values "
        "(see `data.onehot_max`).",
    )


class DataSpec(_Section):
    """Where the rows come from and how they become tensors."""

    source: str = Field(
        "digits",
        description="`digits`, `pycode`, `arith` or `arith-pairs` (built-in samples that need no download: digit "
        "images, Python source text, arithmetic instructions with `prompt`/`response`, and the same questions as "
        "preference pairs, `prompt`/`chosen`/`rejected`, a right and a wrong answer), or a Parquet/CSV/JSON Lines "
        "file, directory or glob: a local path or a pyarrow filesystem URI such as `s3://bucket/prefix/`.",
    )
    format: Literal["auto", "parquet", "csv", "json"] = Field(
        "auto", description="File format; `auto` decides from the file extension (`json`: JSON Lines, one object "
        "per line, `.jsonl`/`.json`)."
    )
    features: Optional[list[str]] = Field(
        None, description="Feature columns: numbers, booleans or strings (categories). Null means every column "
        "except `label`."
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
    impute: NumericImpute = Field(
        "mean",
        description="How missing numeric values (empty cells, nulls, NaN) are filled: the train split's mean or "
        "median, or `fill_value`. Missing values never reach the model; a missing categorical value is a "
        "category of its own.",
    )
    fill_value: float = Field(0.0, description="The number `impute: constant` fills in.")
    onehot_max: int = Field(
        16, ge=1,
        description="A categorical column with at most this many distinct values in the train split is one-hot "
        "encoded; one with more is encoded as `high_cardinality` says. A value never seen in training "
        "encodes as all zeros (one-hot), -1 (ordinal) or its hash.",
    )
    high_cardinality: Literal["hash", "ordinal"] = Field(
        "hash", description="Encoding of categorical columns above `onehot_max`: hashed into `hash_buckets` "
        "counts, or one ordinal number per value (sorted)."
    )
    hash_buckets: int = Field(32, ge=2, description="Buckets of the `hash` encoding, per column.")
    columns: dict[str, ColumnSpec] = Field(
        default_factory=dict,
        description="Per-column overrides by column name, e.g. `--set data.columns.city.encode=ordinal`.",
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
        description="Keep the source as read and the preprocessed splits in Ray's object store instead "
        "of re-reading and re-transforming the source for every fit and every epoch. `auto` caches when the estimate is under a quarter of "
        "the object store (for a pretrained model's token windows: `model.context` x 16 bytes per prompt/response or chat row); "
        "larger data always streams.",
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

    kind: Literal["mlp"] = Field("mlp", description="Model kind: `mlp`, `gpt`, `hf_causal_lm` or `custom`.")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(
        [128, 64], description="Hidden layer widths, input to output."
    )
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout after each hidden layer.")
    activation: Activation = Field("relu", description="Hidden-layer activation.")


class GPTSpec(_Section):
    """A decoder-only transformer language model over bytes."""

    kind: Literal["gpt"] = Field("gpt", description="Model kind: `mlp`, `gpt`, `hf_causal_lm` or `custom`.")
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
                f"`model.heads` ({self.heads}) must divide `model.width` ({self.width}); "
                f"try `--set model.heads={divisor_near(self.width, self.heads)}`"
            )
        return self


class CustomModelSpec(_Section):
    """A user model: `factory(model_spec: dict, schema: dict) -> torch.nn.Module`."""

    kind: Literal["custom"] = Field("custom", description="Model kind: `mlp`, `gpt`, `hf_causal_lm` or `custom`.")
    factory: str = Field(
        ..., description="Import path `package.module:function`, importable from the working directory."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Free-form options passed to the factory inside the model spec."
    )


class LoraSpec(_Section):
    """LoRA adapters (Hu et al. 2021) through peft: the pretrained weights stay frozen and each targeted layer
    learns a low-rank update `alpha / rank * B A`."""

    rank: int = Field(8, gt=0, description="Rank r of each update (the adapters' width).")
    alpha: float = Field(16.0, gt=0, description="Scale of the update: it is multiplied by `alpha / rank`.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the adapters' input.")
    target_modules: Optional[list[str]] = Field(
        None, description="Names of the layers that get adapters (e.g. `[q_proj, v_proj]`). Null: the attention "
        "projections of Llama, Mistral, Qwen2, GPT-2 and GPT-NeoX models; every linear layer but the output head "
        "of other architectures."
    )
    merge: bool = Field(
        False, description="What the bundle (and so the registered version) holds: `false`, the adapter alone (megabytes) "
        "and a pinned reference to its base (the base's directory and the SHA-256 of its weights, checked when it "
        "loads: the base must be on each node that serves it); `true`, the adapter merged into a whole copy of the "
        "base, which loads anywhere without it."
    )


class PromptTuningSpec(_Section):
    """Prompt tuning (Lester et al. 2021) through peft: the model stays frozen and only the embeddings of a few
    virtual tokens, put before every input, are learned."""

    num_virtual_tokens: int = Field(16, gt=0, le=512, description="How many virtual tokens are learned.")
    init_text: Optional[str] = Field(
        None, description="Start the virtual tokens from this text's token embeddings (e.g. `Answer the arithmetic "
        "question.`); null: random."
    )


class HFCausalLMSpec(_Section):
    """A pretrained Hugging Face causal language model (transformers), fine-tuned on instructions, chats or text."""

    kind: Literal["hf_causal_lm"] = Field("hf_causal_lm", description="Model kind: `mlp`, `gpt`, `hf_causal_lm` or `custom`.")
    pretrained: str = Field(
        ..., description="A directory written by `save_pretrained` (weights, config, tokenizer) on storage every node "
        "sees, or a Hugging Face hub id where the nodes can download it."
    )
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit) of `pretrained`.")
    trust_remote_code: bool = Field(
        False, description="Run code that the model's repository ships (a custom architecture). Off: such a model is "
        "refused; turn it on only after reading that code."
    )
    adaptation: Literal["lora", "prompt", "full", "freeze"] = Field(
        "lora", description="`lora`: train LoRA adapters only; `prompt`: train only the embeddings of virtual tokens "
        "put before every input (prompt tuning; registered and served as an adapter, like LoRA); `full`: every "
        "weight; `freeze`: every weight but the layers listed in `freeze`."
    )
    lora: LoraSpec = Field(default_factory=LoraSpec, description="The adapters, with `adaptation: lora`.")
    prompt_tuning: PromptTuningSpec = Field(
        default_factory=PromptTuningSpec, description="The virtual tokens, with `adaptation: prompt`.")
    freeze: list[str] = Field(
        default_factory=list, description="With `adaptation: freeze`: parameter-name prefixes kept frozen, e.g. "
        "`[model.embed_tokens, model.layers.0]`."
    )
    context: int = Field(256, gt=1, description="Tokens per training window: longer rows are cut, text is packed.")
    prompt_format: Literal["auto", "chat", "plain"] = Field(
        "auto", description="How `prompt`/`response` rows become text: `chat` renders them as a one-turn chat with "
        "the tokenizer's chat template, `plain` joins them (prompt, then response and end of text); `auto`: chat "
        "when the tokenizer has a template."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in the backward pass (less memory, ~30% more compute)."
    )

    @model_validator(mode="after")
    def _merge_is_lora_s(self) -> "HFCausalLMSpec":
        if self.lora.merge and self.adaptation != "lora":
            raise ValueError(f"`model.lora.merge: true` merges LoRA adapters into the base; with `adaptation: "
                             f"{self.adaptation}` there are none: `--set model.lora.merge=false`")
        return self


ModelSpec = Annotated[Union[MLPSpec, GPTSpec, HFCausalLMSpec, CustomModelSpec], Field(discriminator="kind")]


# ---------------------------------------------------------------------------- train
class DPOSpec(_Section):
    """Direct Preference Optimization (Rafailov et al. 2023), with `train.objective: dpo`: on pairs of answers to
    one prompt, the model learns to raise the chosen answer's likelihood against the rejected one's, each
    measured relative to a frozen reference (the model before training: for an adapter, the base with the
    adapter disabled, so no second copy is held)."""

    beta: float = Field(
        0.1, gt=0, description="How far the model may move from the reference: the scale of the implicit reward "
        "`beta * log(model / reference)` (smaller: further)."
    )


class CommSpec(_Section):
    """How the workers' gradients travel between them at each optimizer step."""

    compression: Literal["none", "bf16", "fp16", "int8", "powersgd"] = Field(
        "none",
        description="What gradients travel in. `none`: the training precision (fp32, or bf16/fp16 in mixed "
        "precision). `bf16`/`fp16` (every ZeRO stage, DeepSpeed's `communication_data_type`): half the bytes of "
        "fp32; `bf16` keeps fp32's range, `fp16` more of its digits (gradients below ~6e-8 become 0). "
        "`int8` and `powersgd` run a DDP communication hook on the gradients, at ZeRO stage 0 in fp32: "
        "`int8` quantizes every 512 values to 8 bits with their own scale (a quarter of the bytes; sent by "
        "all-gather, so each rank receives every rank's share: for 2 to 4 workers), `powersgd` sends a "
        "rank-`powersgd_rank` approximation of each weight matrix with error feedback (PyTorch's PowerSGD hook; "
        "hundreds of times fewer bytes for large matrices; plain all-reduce during the learning-rate warmup). On GPUs at ZeRO "
        "stage 3, `int8` is DeepSpeed's ZeRO++ (quantized weights and gradients, and hierarchical partitioning "
        "within a node).",
    )
    powersgd_rank: int = Field(
        2, ge=1, le=32,
        description="`compression: powersgd`: the rank of each matrix's approximation (higher: closer to the "
        "uncompressed gradient, more bytes).",
    )
    sync_every: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = Field(
        1,
        description="Average the workers' weights every N optimizer steps instead of all-reducing gradients at "
        "every step (local SGD, with PyTorch's model averaging): 1/N of the traffic; between averages each worker "
        "steps on its own gradients. Where several workers share a node their weights are averaged within the "
        "node every step and across nodes every N (PyTorch's hierarchical scheme). `auto`: the first "
        "steps all-reduce the gradients and time it against the step's compute, then N is chosen so that "
        "communication takes at most a fifth of a step (1 where it already does); the measurement and the "
        "choice are logged, and made again whenever the run restarts or resizes. Needs ZeRO stage 0 and "
        "`train.precision: fp32` (said, not `auto`), and no `compression` (weights are averaged in fp32). "
        "1: every step (plain data-parallel training).",
    )

    @property
    def deepspeed_dtype(self) -> str | None:
        """DeepSpeed's `communication_data_type`, or None for its default (the training precision)."""
        return self.compression if self.compression in ("bf16", "fp16") else None

    @property
    def hooked(self) -> bool:
        """Gradients sent by a DDP communication hook (stage 0) rather than by DeepSpeed."""
        return self.compression in ("int8", "powersgd")

    @property
    def local_sgd(self) -> bool:
        """Weights averaged every N steps (or N measured): `sync_every` other than 1."""
        return self.sync_every != 1


class TrainSpec(_Section):
    """How the model is trained: Ray Train workers, DeepSpeed, schedule, checkpoints."""

    num_workers: Union[int, tuple[int, int], Literal["auto"]] = Field(
        2,
        description="Ray Train workers (data-parallel ranks): a number, or `[min, max]` for an elastic run that starts "
        "as soon as `min` fit (asking an autoscaler for `max`), grows when capacity joins and goes on without "
        "a lost node's workers while `min` remain. Each size change resumes from the last checkpoint. `auto`: on "
        "one CPU node of N cores, N workers x 1 thread or 1 worker x N threads, whichever a short measurement at "
        "the start finds faster (it sets `cpus_per_worker`, and one worker takes `batch_size` x N rows a step: "
        "the same samples per step either way); with GPUs, one worker per GPU.",
    )
    resize_check_s: float = Field(
        60, ge=1,
        description="Elastic runs (`num_workers: [min, max]`): how often a running run looks for room to grow into.",
    )
    checkpoint_every_s: float = Field(
        0, ge=0,
        description="Also checkpoint within an epoch at most this often (0: at each epoch's end only). A run resumes "
        "mid-epoch at the batch it reached, at any number of workers, using no row twice within the epoch. On a "
        "node's drain notice (a spot reclaim) a checkpoint is written at once, whatever this is.",
    )
    cpus_per_worker: float = Field(1, gt=0, description="CPUs reserved per worker; also its torch thread count.")
    gpus_per_worker: float = Field(0, ge=0, description="GPUs per worker; > 0 trains on CUDA with NCCL.")
    placement: Literal["pack", "spread"] = Field(
        "pack",
        description="Where the workers go: `pack` fills a node before the next (fastest collectives); "
        "`spread` puts them on different nodes where it can (a lost node costs fewer ranks).",
    )
    epochs: int = Field(10, gt=0, description="Passes over the train split.")
    batch_size: int = Field(64, gt=0, description="Micro-batch per worker per step.")
    grad_accum: int = Field(
        1, gt=0, description="Micro-batches accumulated per optimizer step (simulates a larger batch)."
    )
    global_batch_size: Optional[int] = Field(
        None, gt=0,
        description="Samples per optimizer step over all workers, held whatever the number of workers: "
        "`grad_accum` becomes `global_batch_size / (batch_size × workers)`, which must be a whole number. "
        "A run resumed on another number of workers then takes the same steps. Null: `batch_size × grad_accum` "
        "per worker, so the global batch follows the number of workers.",
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
    objective: Literal["sft", "dpo"] = Field(
        "sft", description="What a language model learns. `sft`: to predict the responses (or text) it is given, "
        "token by token (every model kind trains this way). `dpo`: to prefer the chosen answer of each "
        "`prompt`/`chosen`/`rejected` row to the rejected one (`hf_causal_lm` with `adaptation: lora` or `prompt`; "
        "see `train.dpo`)."
    )
    dpo: DPOSpec = Field(default_factory=DPOSpec, description="Preference tuning, with `objective: dpo`.")
    comm: CommSpec = Field(default_factory=CommSpec, description="How gradients travel between the workers.")
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
        2, ge=-1, description="Worker failures to recover from (restart + resume from the last checkpoint); -1 is unlimited. "
        "A one-worker sweep trial trains in its trial's process: `tune.trial_max_failures` retries it instead."
    )
    run_name: Optional[str] = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Name of the run under `storage_path`. Re-running with the same name resumes it; "
        "null makes a new name from the spec name and the time.",
    )
    storage_path: str = Field(
        default_factory=lambda: os.environ.get(STORAGE_ENV) or "runs",
        description="Where checkpoints and the bundle go: a local directory or a pyarrow URI (`s3://...`). "
        f"Left out, ${STORAGE_ENV} if set (a cluster sets it for every job), else `runs`. On a cluster of "
        "more than one node it must be storage that every node sees (checked before training).",
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

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def auto_layout(self) -> bool:
        """`num_workers: auto`: the run chooses its workers when it starts (`flotilla.train.choose_layout`)."""
        return self.num_workers == "auto"

    @property
    def min_workers(self) -> int:
        if self.auto_layout:
            raise ValueError("`train.num_workers` is `auto`: the run chooses it when it starts (choose_layout)")
        return self.num_workers[0] if self.elastic else self.num_workers

    @property
    def max_workers(self) -> int:
        if self.auto_layout:
            raise ValueError("`train.num_workers` is `auto`: the run chooses it when it starts (choose_layout)")
        return self.num_workers[1] if self.elastic else self.num_workers

    def describe_workers(self) -> str:
        """`2`, `1-2` for an elastic run, `auto` before the run chose."""
        if self.auto_layout:
            return "auto"
        return f"{self.min_workers}-{self.max_workers}" if self.elastic else str(self.num_workers)

    def worker_resources(self) -> dict[str, float]:
        """What one worker reserves: its CPUs, and its GPUs when it has any."""
        return {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.gpus_per_worker else {})}

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on `world_size` workers."""
        if self.global_batch_size is None:
            return self.grad_accum
        return self.global_batch_size // (self.batch_size * world_size)

    def accumulation_problem(self, world_size: int) -> str | None:
        """Why `global_batch_size` cannot be held on `world_size` workers (None when it can)."""
        if self.global_batch_size is None:
            return None
        per_step = self.batch_size * world_size
        if self.global_batch_size % per_step == 0:
            return None
        fits = [self.batch_size * world_size * k for k in (max(1, self.global_batch_size // per_step),
                                                           self.global_batch_size // per_step + 1)]
        return (f"`train.global_batch_size` = {self.global_batch_size} is not a whole number of micro-batches of "
                f"`train.batch_size` = {self.batch_size} on {world_size} worker(s) ({per_step} samples a "
                f"micro-step); use a multiple of {per_step}, e.g. {' or '.join(map(str, sorted(set(fits))))}")

    @model_validator(mode="after")
    def _global_batch_fits(self) -> "TrainSpec":
        if self.global_batch_size is not None and self.grad_accum != 1:
            raise ValueError("`train.global_batch_size` sets the gradient accumulation itself: give it or "
                             f"`train.grad_accum` (now {self.grad_accum}), not both")
        if self.auto_layout:  # checked when the run has chosen its workers
            return self
        sizes = range(self.min_workers, self.max_workers + 1)  # every size an elastic run may take
        if self.elastic and any(self.accumulation_problem(n) for n in sizes):
            every = self.batch_size * math.lcm(*sizes)
            raise ValueError(
                f"`train.global_batch_size` = {self.global_batch_size} must split into micro-batches of "
                f"`train.batch_size` = {self.batch_size} on every number of workers an elastic run may have "
                f"({self.min_workers} to {self.max_workers}); use a multiple of {every}, e.g. "
                f"{max(1, self.global_batch_size // every) * every}")
        problem = self.accumulation_problem(self.min_workers)
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        def count(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v > 0
        if value == "auto" or isinstance(value, bool) or count(value) or (isinstance(value, (list, tuple)) and len(value) == 2 and all(map(count, value))):
            return tuple(value) if isinstance(value, (list, tuple)) else value  # (a boolean: said by boolean_problems)
        raise ValueError(f"`train.num_workers` is a number of workers, e.g. 2, [min, max] for an elastic run, "
                         "e.g. [1, 4] (whole numbers from 1), or `auto` (measured at the start)")

    @model_validator(mode="after")
    def _elastic_range(self) -> "TrainSpec":
        if self.elastic:
            low, high = self.num_workers
            if low > high:
                raise ValueError(f"`train.num_workers` = [{low}, {high}]: the first is the minimum and the second the "
                                 f"maximum; write [{high}, {low}]")
            if low == high:
                self.num_workers = low  # a fixed size written as a range
        return self

    @model_validator(mode="after")
    def _auto_sets_the_threads(self) -> "TrainSpec":
        if self.auto_layout and self.cpus_per_worker != 1 and not self.gpus_per_worker:
            raise ValueError(f"`train.num_workers: auto` chooses `train.cpus_per_worker` too (the threads of each worker); "
                             f"leave it out (now {self.cpus_per_worker:g}), or give `train.num_workers` a number")
        return self

    @model_validator(mode="after")
    def _local_sgd_needs_stage_0(self) -> "TrainSpec":
        c = self.comm
        if c.local_sgd:
            if self.zero_stage != 0:
                raise ValueError(
                    f"`train.comm.sync_every` = {c.sync_every} needs ZeRO stage 0 (stages 1-3 partition the "
                    "optimizer: every rank steps its part of the weights with every rank's gradients): "
                    "`--set train.zero_stage=0`, or `--set train.comm.compression=bf16` to halve the traffic instead"
                )
            if self.precision != "fp32":  # (`auto` may choose bf16 on the workers' devices)
                raise ValueError(f"`train.comm.sync_every` = {c.sync_every} averages fp32 weights: "
                                 "`--set train.precision=fp32`")
            if c.compression != "none":
                raise ValueError("`train.comm.compression` applies to gradients, which `train.comm.sync_every` other "
                                 "than 1 does not send (it averages the weights): set one of them")
        if c.compression == "int8" and self.zero_stage == 3 and self.gpus_per_worker > 0:
            return self  # DeepSpeed's ZeRO++ quantized weights and gradients
        if c.hooked and (self.zero_stage != 0 or self.precision != "fp32"):
            ds = "; on GPUs (`train.gpus_per_worker`) at stage 3, DeepSpeed's ZeRO++" if c.compression == "int8" else ""
            raise ValueError(
                f"`train.comm.compression` = {c.compression} runs a DDP communication hook on fp32 gradients "
                f"at ZeRO stage 0 (now stage {self.zero_stage}, precision {self.precision}){ds}: "
                "`--set train.zero_stage=0 --set train.precision=fp32`, or `--set train.comm.compression=bf16` "
                "(every stage)"
            )
        return self

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> "TrainSpec":
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError(
                "`train.offload_params` needs ZeRO stage 3: `--set train.zero_stage=3` or `--set train.offload_params=none`"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(
                "`train.offload_optimizer` needs ZeRO stage 1, 2 or 3: `--set train.zero_stage=2` or `--set train.offload_optimizer=none`"
            )
        return self


# ---------------------------------------------------------------------------- track
# A gate rule: `<metric> <op> <number>`, e.g. `val_accuracy >= 0.95`.
# A language model's harness scores (`flotilla eval`) are `eval.<task>.<metric>`, e.g. `eval.arith.acc >= 0.8`.
GATE_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*|eval\.[A-Za-z0-9_-]+\.[A-Za-z0-9_]+)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


class GateSpec(_Section):
    """When a newly registered version is also promoted to `champion`."""

    require: list[str] = Field(
        default_factory=list,
        description="Rules on the run's final metrics, all of which must hold, e.g. `val_accuracy >= 0.95`. A "
        "language model's may test its lm-evaluation-harness scores, `eval.<task>.<metric>` (e.g. `eval.arith.acc "
        ">= 0.8`): its version then waits (gate `pending`) until `flotilla eval` measures them.",
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
        known = sorted(gate_metrics())
        bad = []
        for rule in self.require:
            match = GATE_RULE.match(rule)
            if not match:
                bad.append(f"{rule!r} is not `<metric> <op> <number>` (op one of >=, <=, >, <)")
            elif match.group(1) not in known and not match.group(1).startswith("eval."):
                bad.append(f"{rule!r}: unknown metric {match.group(1)!r}; gates can test {', '.join(known)}")
        if bad:
            raise ValueError("`track.gate.require`: " + "; ".join(bad))
        return self


class TrackSpec(_Section):
    """MLflow: where runs are recorded and which registered model a run's bundle becomes."""

    enabled: bool = Field(True, description="Record the run in MLflow and register its model.")
    uri: Optional[str] = Field(
        None,
        description="MLflow tracking URI: `http(s)://host:port` for a tracking server, or a database URI. "
        "Null uses $MLFLOW_TRACKING_URI, else MLflow's own default, `sqlite:///mlflow.db` in the working "
        "directory (artifacts in `mlruns/` beside it), which a plain `mlflow ui` started there shows.",
    )
    experiment: Optional[str] = Field(None, description="MLflow experiment; null uses the spec's `name`.")
    model_name: Optional[str] = Field(
        None, description="Registered model that each successful run adds a version to; null uses the spec's `name`."
    )
    register_model: bool = Field(
        True, description="Register the bundle as a new model version with the alias `candidate`."
    )
    gate: GateSpec = Field(default_factory=GateSpec, description="The quality gate for promotion to `champion`.")


# ---------------------------------------------------------------------------- export
VARIANTS = ("onnx", "onnx-int8", "onnx-int4")


class ExportSpec(_Section):
    """ONNX variants of a registered version (`flotilla export`): each is checked against the torch
    model on the run's validation rows (its parity gate) before serving may use it."""

    variants: list[Literal["onnx", "onnx-int8", "onnx-int4"]] = Field(
        ["onnx", "onnx-int8", "onnx-int4"],
        description="Variants to build: `onnx` (the fp32 graph, run by ONNX Runtime), `onnx-int8` (its weights "
        "quantized to int8 by ONNX Runtime's dynamic quantization) and, for language models (`gpt`, "
        "`hf_causal_lm`), `onnx-int4` (weights only, in 4 bits: ONNX Runtime's `MatMulNBits`; a table model "
        "gets no 4-bit variant).",
    )
    int4_block_size: Literal[16, 32, 64, 128, 256] = Field(
        32, description="`onnx-int4`: weights that share one scale (a block along a matrix's input). Smaller "
        "blocks keep more precision and take more bytes (32: ~4.5 bits a weight).",
    )
    int4_compute: Literal["int8", "fp32"] = Field(
        "int8", description="`onnx-int4`: how its matrix multiplications compute. `int8`: each block of "
        "activations is quantized to int8 on the fly and multiplied with int8 dot products (ONNX Runtime's "
        "`accuracy_level` 4; measured 2.4x the tokens/s of `fp32` for one stream on a 2-core AVX-512 CPU); "
        "`fp32`: the weights are dequantized and the math is fp32. The perplexity gate judges either.",
    )
    max_accuracy_drop: float = Field(
        0.005, description="A classifier's variant fails its gate when its validation accuracy is below the torch "
        "model's by more than this (0.005: half a point).",
    )
    max_relative_increase: float = Field(
        0.02, description="A language model's (perplexity) or regressor's (RMSE) variant fails its gate when its "
        "validation metric is above the torch model's by more than this fraction (0.02: 2 %).",
    )
    max_eval_drop: float = Field(
        0.02, description="A language model's variant also fails its gate when `flotilla eval --runtime VARIANT` "
        "scores it below the torch model on the same tasks by more than this, on any task's metric (absolute: "
        "0.02 is two points of accuracy).",
    )
    after_training: bool = Field(
        False, description="Build, gate and time the variants at the end of `flotilla train`, once the version is "
        "registered (as `flotilla export --model NAME/VERSION` would, on the run's own validation rows).",
    )


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
    export: ExportSpec = Field(default_factory=ExportSpec, description="ONNX and int8 variants (`flotilla export`).")
    cost: CostSpec = Field(default_factory=CostSpec, description="Prices for resource accounting.")

    def allowed_factories(self) -> frozenset[str]:
        """The `custom` model factories this spec lets a bundle run when it is loaded: its own
        model's and `serve.allow_factories`. Only a spec the user gave counts; one read back from
        the registry or a run directory is data and allows none."""
        own = {self.model.factory} if isinstance(self.model, CustomModelSpec) else set()
        return frozenset(own | set(self.serve.allow_factories))

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
                    booleans = boolean_problems(raw, RunSpec)
                    if booleans:
                        raise ValueError("\n".join(booleans))
                    RunSpec.model_validate(raw)
                except ValueError as e:
                    errors = e.errors() if isinstance(e, ValidationError) else [{"loc": (), "msg": str(e), "type": "value_error"}]
                    problems += [f"`tune.space.{path}` = {value!r}: {line}" for err in errors
                                 for line in describe(err, RunSpec).splitlines()]
                    break
        return problems

    @model_validator(mode="after")
    def _model_fits_data(self) -> "RunSpec":
        if isinstance(self.model, GPTSpec) and self.data.source == "digits":
            raise ValueError("`model.kind: gpt` needs a text source: `--set data.source=pycode`, or a file with a text column")
        if isinstance(self.model, HFCausalLMSpec) and self.data.source == "digits":
            raise ValueError("`model.kind: hf_causal_lm` fine-tunes on text, instructions or chats: `--set data.source=arith` "
                             "(built-in instructions), or a file with `prompt`/`response`, `messages` or `text` columns")
        if self.train.objective == "dpo":
            if not isinstance(self.model, HFCausalLMSpec):
                raise ValueError(f"`train.objective: dpo` tunes a pretrained language model on preference pairs; "
                                 f"`model.kind: {self.model.kind}` trains with `sft` only: `--set model.kind=hf_causal_lm` "
                                 "or `--set train.objective=sft`")
            if self.model.adaptation not in ("lora", "prompt"):
                raise ValueError(f"`train.objective: dpo` measures the model against its reference, the base with the "
                                 f"adapter disabled; `model.adaptation: {self.model.adaptation}` has no adapter to "
                                 "disable (a second copy of the model would be needed): `--set model.adaptation=lora`")
            if self.data.source in ("arith", "digits", "pycode"):
                raise ValueError(f"`train.objective: dpo` learns from preference pairs (`prompt`, `chosen`, "
                                 f"`rejected`); `data.source: {self.data.source}` has none: `--set data.source=arith-pairs` "
                                 "(built in), or a file with those columns")
        elif self.data.source == "arith-pairs":
            raise ValueError("`data.source: arith-pairs` holds preference pairs, which `train.objective: dpo` learns "
                             "from: `--set train.objective=dpo`, or `--set data.source=arith` for instructions")
        if isinstance(self.model, MLPSpec) and self.data.source in ("pycode", "arith", "arith-pairs"):
            raise ValueError(f"`data.source: {self.data.source}` is text; train a language model on it: `--set model.kind=gpt`")
        if self.tune is not None:
            if self.train.elastic:
                raise ValueError(
                    f"`train.num_workers` = [{self.train.min_workers}, {self.train.max_workers}] is an elastic size, which a "
                    "sweep's trials do not take (the scheduler compares trials by their steps, and a resize would make "
                    "them unequal); give its trials a fixed number of workers, e.g. "
                    f"`--set train.num_workers={self.train.min_workers}`")
            if self.train.auto_layout:
                raise ValueError(
                    "`train.num_workers: auto` measures the node's layout at the start of a run, and a sweep's trials "
                    "share the node (the measurement would see the others); give its trials a number of workers, e.g. "
                    "`--set train.num_workers=1`")
            problems = self._space_paths_problems()
            if problems:
                raise ValueError("\n".join(problems))  # one line each
        if isinstance(self.model, (GPTSpec, HFCausalLMSpec)):
            lm = gate_metrics("lm")
            for rule in self.track.gate.require:
                match = GATE_RULE.match(rule)
                if match and match.group(1) not in lm and not match.group(1).startswith("eval."):
                    raise ValueError(
                        f"`track.gate.require`: {rule!r} tests {match.group(1)!r}, which a {self.model.kind} run does not report; "
                        f"use one of {', '.join(lm)}"
                    )
        if not isinstance(self.model, HFCausalLMSpec):
            scored = [r for r in self.track.gate.require if (m := GATE_RULE.match(r)) and m.group(1).startswith("eval.")]
            if scored:
                raise ValueError(f"`track.gate.require`: {scored[0]!r} tests a harness score, which `flotilla eval` "
                                 f"measures for language models (`model.kind: hf_causal_lm`), not `{self.model.kind}`; "
                                 "its version would wait for it forever")
        return self


