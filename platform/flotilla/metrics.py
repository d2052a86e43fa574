"""What each task reports and which of its metrics decides: the one table that training's epoch
lines, the quality gate, sweeps and the `flotilla` command read.

    primary_metric("classification")   # Metric(name="val_accuracy", mode="max", fmt=".4f")
    mode_of("val_rmse")                # "min"
    gate_metrics("lm")                 # the final metrics a gate rule may test on an LM run
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TASKS = ("classification", "regression", "lm")


@dataclass(frozen=True)
class Metric:
    name: str
    mode: str  # "max": higher is better; "min": lower is better
    fmt: str  # how the epoch line and the CLI print it

    def format(self, value: float) -> str:
        return f"{self.name} {value:{self.fmt}}"

    def better(self, a: float, b: float, tolerance: float = 0.0) -> bool:
        """True when `a` is no worse than `b` (within `tolerance`, in the metric's units). A value
        that is not a finite number is worse than any finite one."""
        if not math.isfinite(a):
            return False
        if not math.isfinite(b):
            return True
        return a >= b - tolerance if self.mode == "max" else a <= b + tolerance


# Per task: the primary metric first (what "no worse than the champion", a sweep with no
# `tune.metric` and the end-of-run line use), then the other final metrics a gate rule may test.
_TABLE: dict[str, tuple[Metric, ...]] = {
    "classification": (Metric("val_accuracy", "max", ".4f"), Metric("val_loss", "min", ".4f"),
                       Metric("train_loss", "min", ".4f"), Metric("train_accuracy", "max", ".4f")),
    "regression": (Metric("val_rmse", "min", ".4f"), Metric("val_loss", "min", ".4f"),
                   Metric("train_loss", "min", ".4f"), Metric("train_rmse", "min", ".4f")),
    "lm": (Metric("val_perplexity", "min", ".2f"), Metric("val_loss", "min", ".4f"),
           Metric("train_loss", "min", ".4f"), Metric("train_perplexity", "min", ".2f"),
           Metric("tokens_per_s", "max", ".0f"), Metric("mfu", "max", ".3f"),
           # `train.objective: dpo` (val_perplexity then is that of the chosen answers)
           Metric("val_preference_accuracy", "max", ".4f"), Metric("val_reward_accuracy", "max", ".4f"),
           Metric("val_reward_margin", "max", ".4f"), Metric("val_reference_preference_accuracy", "max", ".4f"),
           Metric("train_preference_accuracy", "max", ".4f")),
}
# Reported by every task, never a gate's subject: throughput and time.
_OTHER = (Metric("samples_per_s", "max", ".0f"), Metric("epoch_time_s", "min", ".1f"),
          Metric("data_wait_s", "min", ".1f"))
_BY_NAME = {m.name: m for metrics in (*_TABLE.values(), _OTHER) for m in metrics}


def primary_metric(task: str) -> Metric:
    """The metric that ranks runs of `task` (`classification`, `regression` or `lm`)."""
    return _TABLE[task][0]


def gate_metrics(task: str | None = None) -> tuple[str, ...]:
    """The final metrics a gate rule may test: for one task, or for any task (None)."""
    tasks = [task] if task else list(TASKS)
    return tuple(dict.fromkeys(m.name for t in tasks for m in _TABLE[t]))


def mode_of(name: str) -> str:
    """Whether `name` is maximized or minimized; unknown names (a custom metric) are minimized,
    like a loss."""
    metric = _BY_NAME.get(name)
    return metric.mode if metric else "min"


def metric(name: str) -> Metric:
    """The table's entry for `name`; unknown names print with four decimals and are minimized."""
    return _BY_NAME.get(name) or Metric(name, "min", ".4f")


def not_finite(metrics: dict) -> list[str]:
    """The names of the numeric metrics in `metrics` that are NaN or infinite."""
    return sorted(k for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v))


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`: a duration a person reads at a glance."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
