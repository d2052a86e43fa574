"""The quality gate: rules on a run's final metrics, and "no worse than the current champion"
measured by evaluating both bundles on the same validation rows."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from flotilla.metrics import not_finite, primary_metric
from flotilla.spec import GATE_RULE, GateSpec
from flotilla.data import TOKENS, ByteWindows
from flotilla.data._instruct import IGNORE, INPUT_IDS, LABELS
from flotilla.errors import BundleError

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass
class GateDecision:
    passed: bool
    checks: list[str] = field(default_factory=list)  # one line per rule, with its numbers
    numbers: dict[str, Any] = field(default_factory=dict)  # recorded as version tags
    pending: list[str] = field(default_factory=list)  # harness scores (`eval.*`) not measured yet

    @property
    def verdict(self) -> str:
        """`passed`, `failed`, or `pending`: every rule measured so far holds, and `flotilla eval` is
        still to measure the harness scores the others test."""
        return "failed" if not self.passed else "pending" if self.pending else "passed"

    def summary(self) -> str:
        return f"{self.verdict}: " + "; ".join(self.checks or ["no rules"])


def check_rules(gate: GateSpec, metrics: dict[str, Any]) -> GateDecision:
    """The spec's rules on the run's final metrics; a run with any metric that is not a finite
    number fails, whatever the rules say."""
    decision = GateDecision(passed=True)
    broken = not_finite(metrics)
    if broken:
        decision.passed = False
        decision.checks.append(f"{', '.join(f'{k} {metrics[k]}' for k in broken)}: not a finite number FAILED")
    for rule in gate.require:
        name, op, bound = GATE_RULE.match(rule).groups()
        if name not in metrics and name.startswith("eval."):
            decision.pending.append(name)
            decision.checks.append(f"{rule}: not measured yet (`flotilla eval` measures it, and then promotes a "
                                   "version whose rules all hold)")
            continue
        if name not in metrics:
            decision.passed = False
            decision.checks.append(f"{rule}: the run reported no {name} (it has {', '.join(sorted(metrics))})")
            continue
        value = float(metrics[name])
        ok = math.isfinite(value) and _OPS[op](value, float(bound))
        decision.passed &= ok
        decision.numbers[f"gate.{name}"] = value
        decision.checks.append(f"{name} {value:.4f} {op} {bound} {'ok' if ok else 'FAILED'}")
    return decision


def compare_with_champion(decision: GateDecision, gate: GateSpec, task: str, candidate: float,
                          champion: float | None, champion_version: str | None, rows: int) -> None:
    """Add the champion comparison to `decision` (no champion yet: the candidate wins)."""
    primary = primary_metric(task)
    metric = primary.name
    decision.numbers[f"gate.candidate_{metric}"] = candidate
    if champion is None:
        decision.checks.append(f"no champion yet; {primary.format(candidate)} on {rows} validation rows")
        return
    ok = primary.better(candidate, champion, gate.tolerance)
    decision.passed &= ok
    decision.numbers[f"gate.champion_{metric}"] = champion
    decision.numbers["gate.champion_version"] = champion_version
    better = "higher" if primary.mode == "max" else "lower"
    decision.checks.append(
        f"{primary.format(candidate)} vs champion v{champion_version} {champion:{primary.fmt}} on the same {rows} "
        f"validation rows ({better} is better, tolerance {gate.tolerance:g}) {'ok' if ok else 'FAILED'}"
    )


class BundleEvaluator:
    """Accumulates a bundle's main metric over raw validation batches (exactly what serving sees:
    raw rows through the bundle's own preprocessors)."""

    def __init__(self, bundle, label_column: str | None, text_column: str | None):
        self.bundle, self.label_column, self.text_column = bundle, label_column, text_column
        self.total, self.count, self.rows = 0.0, 0, 0

    @torch.no_grad()
    def add(self, batch: pd.DataFrame) -> None:
        b = self.bundle
        self.rows += len(batch)
        if LABELS in batch.columns:  # a pretrained model's token windows: loss where labels are not IGNORE
            inputs = torch.as_tensor(np.stack(batch[INPUT_IDS].to_numpy()), device=b.device)
            labels = torch.as_tensor(np.stack(batch[LABELS].to_numpy()))
            if inputs.dim() == 3:  # preference pairs: scored on the chosen answers (a DPO run's val_perplexity)
                inputs, labels = inputs[:, 0], labels[:, 0]
            vocab = b.logit_count
            if int(inputs.max()) >= vocab:
                raise BundleError(f"its vocabulary has {vocab} tokens and this run's tokenizer makes ids up to "
                                  f"{int(inputs.max())}: the two models tokenize differently")
            logits = b.logits(inputs).float().cpu()
            self.total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                                reduction="sum"))
            self.count += int((labels != IGNORE).sum())
            return
        if b.task == "lm":
            windows = ByteWindows(self.text_column, b.schema.context)._transform_pandas(batch)[TOKENS]
            if len(windows) == 0:
                return
            tokens = torch.as_tensor(np.stack(windows.to_numpy()))
            logits = b.model(tokens[:, :-1]).float()
            self.total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum"))
            self.count += tokens[:, 1:].numel()
            return
        out = b.predict(batch.drop(columns=[self.label_column]))["predictions"]
        labels = batch[self.label_column].to_numpy()
        if b.task == "classification":
            self.total += float(np.sum(np.asarray(out, dtype=object) == labels.astype(object)))
        else:
            self.total += float(np.sum((np.asarray(out, dtype=np.float64) - labels.astype(np.float64)) ** 2))
        self.count += len(batch)

    def value(self) -> float:
        if self.count == 0:
            return float("nan")
        mean = self.total / self.count
        task = self.bundle.task
        return mean if task == "classification" else math.sqrt(mean) if task == "regression" else math.exp(min(mean, 50.0))


def evaluate_bundles(bundles: list, batches: Iterable[pd.DataFrame], label_column: str | None,
                     text_column: str | None) -> tuple[list[float], int]:
    """Each bundle's main metric over the same batches, in one pass; and the row count."""
    evaluators = [BundleEvaluator(b, label_column, text_column) for b in bundles]
    for batch in batches:
        for e in evaluators:
            e.add(batch)
    return [e.value() for e in evaluators], evaluators[0].rows if evaluators else 0
