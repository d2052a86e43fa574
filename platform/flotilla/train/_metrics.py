"""Training metrics through Ray's metrics API, for Prometheus and the Grafana dashboard.

Each rank records its own numbers, tagged `run` (the run name) and `rank`; Ray exports them on
every node's metrics port with the `ray_` prefix, e.g. `ray_flotilla_train_samples_per_s`.
Per-rank throughput sums to the run's (`sum by (run)`); MFU averages (`avg by (run)`).
"""

from __future__ import annotations

import time

from ray.util.metrics import Counter, Gauge, Histogram

TAGS = ("run", "rank")
# Live throughput is measured over at least this long, so one fast or slow step does not
# make the gauge jump about; the epoch's figure replaces it at the end of each epoch.
_WINDOW_S = 2.0
_STEP_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_CHECKPOINT_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


class TrainingMetrics:
    """The live numbers of one rank of one run."""

    def __init__(self, run_name: str, rank: int, *, tokens_per_sample: int | None, flops_per_token: float | None,
                 peak_flops: float | None):
        self._tags = {"run": run_name, "rank": str(rank)}
        self._tokens_per_sample = tokens_per_sample
        self._flops_per_token = flops_per_token
        self._peak = peak_flops
        self.samples_per_s = Gauge("flotilla_train_samples_per_s", "Training samples per second on this rank.", TAGS)
        self.tokens_per_s = Gauge("flotilla_train_tokens_per_s", "Training tokens per second on this rank (LMs).", TAGS)
        self.mfu = Gauge("flotilla_train_mfu", "Model FLOPs utilization of this rank against its measured peak.", TAGS)
        self.loss = Gauge("flotilla_train_loss", "Training loss of the latest micro-batch.", TAGS)
        self.val_loss = Gauge("flotilla_train_val_loss", "Validation loss after the latest epoch.", TAGS)
        self.epoch = Gauge("flotilla_train_epoch", "Epochs completed.", TAGS)
        self.samples = Counter("flotilla_train_samples", "Training samples processed by this rank.", TAGS)
        self.step_time = Histogram("flotilla_train_step_seconds", "Time of one training step on this rank: waiting "
                                   "for the batch, forward, backward and optimizer.", _STEP_BOUNDARIES, TAGS)
        self.checkpoint_time = Histogram("flotilla_train_checkpoint_seconds", "Time to write and report one "
                                         "checkpoint on this rank.", _CHECKPOINT_BOUNDARIES, TAGS)
        self._window_start = time.perf_counter()
        self._window_samples = 0

    def step(self, seconds: float, samples: int, loss: float) -> None:
        self.step_time.observe(seconds, self._tags)
        self.loss.set(loss, self._tags)
        self.samples.inc(samples, self._tags)
        self._window_samples += samples
        now = time.perf_counter()
        if now - self._window_start >= _WINDOW_S:
            self._throughput(self._window_samples / (now - self._window_start))
            self._window_start, self._window_samples = now, 0

    def start_epoch(self) -> None:
        self._window_start, self._window_samples = time.perf_counter(), 0

    def end_epoch(self, epoch: int, samples_per_s_this_rank: float, val_loss: float) -> None:
        self._throughput(samples_per_s_this_rank)
        self.epoch.set(epoch, self._tags)
        self.val_loss.set(val_loss, self._tags)

    def checkpointed(self, seconds: float) -> None:
        self.checkpoint_time.observe(seconds, self._tags)

    def _throughput(self, samples_per_s: float) -> None:
        self.samples_per_s.set(samples_per_s, self._tags)
        if self._tokens_per_sample:
            tokens_per_s = samples_per_s * self._tokens_per_sample
            self.tokens_per_s.set(tokens_per_s, self._tags)
            if self._flops_per_token and self._peak:
                self.mfu.set(self._flops_per_token * tokens_per_s / self._peak, self._tags)
