"""The `tune` section: a sweep's search space, searcher and scheduler."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from flotilla.spec._base import _Section


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
        None, description="Metric to optimize; null uses the task's primary metric, the one the gate ranks versions by "
        "(val_accuracy for classification, val_rmse for regression, val_perplexity for gpt)."
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
                problems.append(f"`grid` entries ({', '.join(grids)}) need `--set tune.search=random` or `grid`, not optuna")
        if self.search == "grid":
            continuous = [path for path, dim in self.space.items() if set(dim) & {"loguniform", "uniform", "randint"}]
            if continuous:
                problems.append(f"`tune.search: grid` takes only choice/grid entries; {', '.join(continuous)} are ranges")
        if problems:
            raise ValueError("\n".join(problems))  # one line each
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


