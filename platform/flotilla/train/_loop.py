"""The per-worker training loop: the only training loop in Flotilla.

`pipelines/train.py`, every Tune trial and every benchmark run it: through `TorchTrainer` (one
Ray Train worker per rank), or, for a one-worker Tune trial, in the trial's own process
(`flotilla.train._in_trial`), which spares the trial Ray Train's worker-group start-up. The loop
sees only a `Session`: its rank, device, data, latest checkpoint and where a report goes.
Each worker builds the model, wraps it with `deepspeed.initialize`, resumes from
the newest complete checkpoint if there is one, and per epoch: trains on its shard of the
train split, evaluates on its shard of the validation split, reduces the metrics across
ranks, checkpoints (every rank) and reports. After the last epoch the consolidated fp32
weights go into the inference bundle inside the final checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import sys
import time
import uuid
import warnings
from typing import Any, Protocol

# DeepSpeed imports MLflow whenever it is installed, for its autotuner's own experiment logging,
# which Flotilla never runs: 1.7 CPU-seconds in every training worker, which has no other use for
# it. MLflow is hidden while DeepSpeed loads; a process that has MLflow already keeps it.
_HIDE_MLFLOW = "mlflow" not in sys.modules
if _HIDE_MLFLOW:
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError, as if it were not installed
try:
    import deepspeed
finally:
    if _HIDE_MLFLOW:
        del sys.modules["mlflow"]
import pyarrow.fs as pafs
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils import logger as ds_logger
from deepspeed.utils import safe_get_full_fp32_param
from ray.train.v2._internal.execution import context as _train_context

from flotilla.bundle import write_hf_bundle
from flotilla.bundle import write_bundle
from flotilla.errors import CheckpointError
from flotilla.metrics import TASKS, format_duration, primary_metric
from flotilla.data import FEATURES, TOKENS, DataSchema, filesystem_for
from flotilla.data._instruct import IGNORE, INPUT_IDS, LABELS
from flotilla.models import build_model, flops_per_token
from flotilla.models._hf import build_hf_causal_lm
from flotilla.redact import redact
from flotilla.train import _checkpoint
from flotilla.train._comm import Comm
from flotilla.train._deepspeed_config import deepspeed_config, optimizer_steps, rank_share
from flotilla.train._metrics import TrainingMetrics
from flotilla.train._precision import measured_peak_flops, resolve_precision, torch_dtype
from flotilla.train._worker_config import WorkerConfig

BUNDLE_DIR = "bundle"
CHECKPOINT_PREFIX = "checkpoint_epoch"  # + the epoch (4 digits) + "_" + the attempt


class _SchedulerStartNotice(logging.Filter):
    """DeepSpeed's WarmupCosineLR asks itself for its learning rate while it is being built (before
    step 0) and warns about its own call; the schedule is unaffected. Drop that one message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Attempting to get learning rate from scheduler before it has started" not in record.getMessage()


ds_logger.addFilter(_SchedulerStartNotice())
# Ray Train logs every report at INFO ("Reporting training result N: TrainingReport(...)", one long
# line per rank per epoch) on a logger named after its source file, outside `ray.train`, so the
# run's LoggingConfig(log_level="WARNING") does not reach it. Flotilla prints its own epoch lines.
logging.getLogger(_train_context.__file__).setLevel(logging.WARNING)
# Within an epoch, rank 0 prints a progress line at most this often.
PROGRESS_EVERY_S = 10.0
# How often the ranks ask Ray Train whether a node of the run got a drain notice (a barrier of Ray
# Train's: one round trip to its sync actor). Ray Train's watcher polls the nodes every second for
# Flotilla's runs (`train._run.PREEMPTION_POLL_S`); a notice gives tens of seconds (spot: 30-120 s).
NOTICE_CHECK_S = 1.0


class Session(Protocol):
    """What the loop needs from where it runs (a Ray Train worker, or a Tune trial's process)."""

    rank: int
    world: int
    device: torch.device

    def latest_checkpoint(self) -> ray.train.Checkpoint | None: ...

    def shard(self, name: str):  # this rank's part of the "train"/"val" dataset (iter_torch_batches)
        ...

    def preemption(self) -> Any:
        """A drain notice for a node of the run (`ray.train.PreemptionInfo`), or None. Collective."""

    def report(self, metrics: dict[str, Any], directory: str, name: str, confirm: bool = False) -> None:
        """Persist the checkpoint written to `directory` as `name` (every rank), then report `metrics`;
        `confirm`: return once a restart would resume from it."""


class _TrainWorker:
    """A Ray Train worker: Ray Train's context, dataset shards and checkpoint storage."""

    def __init__(self) -> None:
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        return ray.train.get_checkpoint()

    def shard(self, name: str):
        return ray.train.get_dataset_shard(name)

    def preemption(self) -> Any:
        return ray.train.get_preemption_info()

    def report(self, metrics: dict[str, Any], directory: str, name: str, confirm: bool = False) -> None:
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory), checkpoint_dir_name=name)
        if confirm:  # until Ray Train's controller holds it: a restart from now on resumes from it
            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def train_loop_per_worker(raw_config: dict[str, Any]) -> str | None:
    """`TorchTrainer`'s entry on every worker; Ray Train hands rank 0's return to the driver."""
    return train(WorkerConfig.model_validate(raw_config), _TrainWorker())


def train(config: WorkerConfig, session: Session) -> str | None:
    """Train the run to its last epoch (None), or stop early and return why: a loss that is not a
    number (every rank returns the same message at the same step). A raise would be retried by Ray
    Train (`train.max_failures`) from the last checkpoint, only to diverge the same way again."""
    # DeepSpeed calls torch.distributed's older collective names once per step; the
    # deprecation notice would fill the log.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    spec, schema = config.spec, config.data
    t = spec.train
    rank, world, device = session.rank, session.world, session.device
    if device.type == "cpu":
        # One thread per reserved CPU: more only fights the other ranks for the same cores.
        torch.set_num_threads(max(1, int(t.cpus_per_worker)))
    precision = resolve_precision(t.precision, device)
    dtype = torch_dtype(precision)

    if device.type == "cpu":
        _skip_shared_memory_op()
    torch.manual_seed(t.seed)  # identical initial weights on every rank
    model_spec = spec.model.model_dump(mode="json")
    micro_batches, steps_per_epoch = optimizer_steps(config.train_rows, world, t, config.whole_splits)
    # The checkpoint to resume from is chosen first: one written at another world size makes
    # DeepSpeed load it as a universal checkpoint, which the engine must be built for.
    stack = contextlib.ExitStack()
    resume_dir = None
    latest = session.latest_checkpoint()
    if latest is not None:
        chosen, note = _checkpoint.choose(latest)
        if note and rank == 0:
            say(f"WARNING: {note}")
        resume_dir = stack.enter_context(chosen.as_directory())
    universal = resume_dir is not None and _checkpoint.needs_universal(resume_dir, world)
    # Where each rank runs: the driver prices the run by these nodes' price labels, and local SGD
    # averages within a node before across nodes.
    worker_nodes = _all_gather(ray.get_runtime_context().get_node_id())
    ds_config = deepspeed_config(t, precision, steps_per_epoch * t.epochs, world, device.type == "cuda",
                                 load_universal=universal, local_world=worker_nodes.count(worker_nodes[rank]))
    if model_spec["kind"] == "hf_causal_lm":
        # Loaded in the precision it trains in; under ZeRO-3 created partitioned across the ranks
        # (rank 0 alone reads the weights), never whole on every rank. Partitioning needs DeepSpeed's
        # view of the process group Ray Train made, which `deepspeed.initialize` would only set up later.
        deepspeed.init_distributed()
        model = build_hf_causal_lm(model_spec, schema, dtype=dtype, deepspeed_config=ds_config)
    else:
        model = build_model(model_spec, schema)
    # (a parameter ZeRO-3 partitioned at build holds an empty tensor here; `ds_numel` is its size)
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
    )
    torch.manual_seed(t.seed + 1 + rank)  # dropout differs per rank; restored on resume
    comm = Comm(engine, t.comm, world, worker_nodes,
                warmup_steps=ds_config["scheduler"]["params"]["warmup_num_steps"])

    start_epoch, history, resumed_from, state = 0, [], None, {}
    if resume_dir is not None:
        with stack:
            resumed = _checkpoint.load(engine, resume_dir, rank, universal)
        state = resumed.state
        start_epoch, history, resumed_from = state["epoch"], state["history"], state["global_step"]
        if rank == 0:
            resized = "" if resumed.written_by == world else \
                f"; written by {resumed.written_by} workers, now {world}, {_global_batch_change(t, resumed.written_by, world)}"
            if resumed.converted_s is not None:
                resized += f" (converted to DeepSpeed's universal checkpoint in {resumed.converted_s:.1f}s)"
            within = f", batch {state['position']} of its epoch" if state.get("position") else ""
            say(f"resumed from epoch {start_epoch}{within}, step {resumed_from} ({chosen.path}){resized}")
    # Where the epoch resumes: the batch its checkpoint reached (batches of one order at any size).
    position = state.get("position", 0) if config.whole_splits else 0
    carried = state.get("partial") if position else None
    attempt, began = _broadcast((uuid.uuid4().hex[:6], time.time()) if rank == 0 else None)
    # Each attempt's size and time: the driver prices the run by the workers that ran.
    segments = state.get("segments", [])
    if segments:  # the workers before this attempt held their nodes until it began
        segments[-1]["to"] = max(segments[-1]["to"], began)
    segments.append({"workers": world, "from": began, "to": began})
    events, event, notice = state.get("events", []), None, None
    if resumed_from is not None:
        before, heard = resumed.written_by, state.get("notice")
        event = {"at": began, "reason": "drain notice" if heard else "grew" if world > before else
                 "lost workers" if world < before else "restarted", "from_workers": before, "to_workers": world,
                 "resumed_step": resumed_from, "resumed_batch": position,
                 "since_checkpoint_s": round(began - state.get("saved_at", began), 3)}
        if heard:
            # The finished steps the notice came after that this checkpoint does not hold (0: it holds them all).
            event.update(nodes=heard["nodes"], notice_step=heard["step"], steps_lost=max(0, heard["step"] - resumed_from))
        events.append(event)

    is_lm = schema.task == "lm"
    peak = measured_peak_flops(device.type, precision) if is_lm else None
    live = TrainingMetrics(
        config.run_name, rank,
        tokens_per_sample=(schema.context * (2 if schema.pairs else 1)) if is_lm else None,  # (a pair: two answers)
        flops_per_token=flops_per_token(model_spec, num_params) if is_lm else None,
        peak_flops=peak,
    )
    train_shard = session.shard("train")
    val_shard = session.shard("val")
    batch_dtypes = _batch_dtypes(schema)

    first_step_at = 0.0  # wall-clock time of this attempt's first finished step (start-up cost)
    accumulation = t.accumulation(world)
    within_epoch = config.within_epoch and config.whole_splits
    if config.within_epoch and not config.whole_splits and t.checkpoint_every_s and rank == 0:
        say("WARNING: train.checkpoint_every_s needs the splits cached in memory (`data.cache`): an epoch of "
            "streamed shards resumes from its start, so this run checkpoints at each epoch's end only")
    last_checkpoint = last_check = time.perf_counter()
    for epoch in range(start_epoch, t.epochs):
        engine.train()
        skip = position if epoch == start_epoch else 0
        loss_sum, loss_count, samples, correct, train_before, wait_before = 0.0, 0, 0, 0, 0.0, 0.0
        if carried is not None and epoch == start_epoch:
            train_before, wait_before = carried["train_time_s"], carried["data_wait_s"]
            if rank == 0:  # the epoch's sums so far, over every rank that ran it (counted once)
                loss_sum, loss_count, samples, correct = (carried[k] for k in ("loss_sum", "loss_count", "samples", "correct"))
        started = time.perf_counter()
        stopped = None
        live.start_epoch()
        step_started, data_wait, done = started, 0.0, 0
        progress = _Progress(config.run_name, epoch + 1, t.epochs, micro_batches, enabled=rank == 0)
        batches = _epoch_batches(train_shard, t, config.train_rows, config.whole_splits, epoch, (rank, world), skip,
                                 batch_dtypes, device)
        while True:
            asked = time.perf_counter()
            batch = next(batches, None)
            data_wait += time.perf_counter() - asked
            if batch is None:
                break
            inputs, targets = _split(batch, schema, dtype)
            if schema.pairs:  # DPO: the pairs' losses against the reference (the adapter disabled)
                losses, pair_sums = _preference(engine, inputs, targets, t.dpo.beta)
                loss, out = losses.mean(), None
            else:
                out = engine(inputs)
                loss = _loss(out, targets, schema, "mean")
            engine.backward(loss)
            comm.after_backward()  # (gradients, where Flotilla sends them: `train.comm`)
            stepped = engine.global_steps
            engine.step()
            if engine.global_steps != stepped:
                chosen = comm.after_step()  # (weights, under local SGD)
                if chosen and rank == 0:
                    say(f"[{config.run_name}] {chosen}")
            done += 1
            step_loss = loss.item()
            now = time.perf_counter()
            # What every rank must do at this step, decided together (their collectives pair up):
            # stop (a loss that is not a number), checkpoint now, ask Ray Train about drain notices.
            flags = [float(not math.isfinite(step_loss)),
                     float(within_epoch and 0 < t.checkpoint_every_s <= now - last_checkpoint),
                     float(within_epoch and now - last_check >= NOTICE_CHECK_S)]
            if world > 1:
                flags = _all_reduce(flags, device, op=dist.ReduceOp.MAX)
            if flags[0] > 0:
                what = "train_loss" if not math.isfinite(step_loss) else "train_loss on another rank"
                stopped = not_finite_message(config, what, step_loss, epoch + 1, int(engine.global_steps), precision)
                break
            loss_sum += step_loss * _loss_count(targets, schema)
            loss_count += _loss_count(targets, schema)
            samples += len(targets)
            live.step(now - step_started, len(targets), step_loss)
            progress.step(now, len(targets) * world, step_loss)
            if not first_step_at:
                first_step_at = time.time()
                if event is not None:
                    event["first_step_s"] = round(first_step_at - began, 3)
            step_started = now
            if schema.task == "classification":
                correct += int((out.detach().argmax(dim=-1) == targets).sum())
            elif schema.pairs:  # pairs whose chosen answer the model finds likelier than the rejected one
                correct += int(pair_sums["preferred"])
            if flags[2] > 0:
                last_check = now
                info = session.preemption()
                if info is not None and notice is None:
                    notice = {"nodes": list(info.preempted_node_ids), "ranks": list(info.preempted_ranks),
                              "deadline_ms": info.deadline_ms, "step": int(engine.global_steps), "at": time.time()}
                    if rank == 0:
                        left = "" if info.deadline_ms is None else f", {info.deadline_ms / 1000 - time.time():.0f} s before its deadline"
                        say(f"[{config.run_name}] drain notice for node(s) {', '.join(n[:12] for n in notice['nodes'])} "
                            f"(ranks {notice['ranks']}){left}: checkpointing at step {notice['step']}")
            due = flags[1] > 0 or (notice is not None and notice.get("saved") is None)
            if due and engine.micro_steps % accumulation == 0:  # (a checkpoint holds whole optimizer steps)
                if notice is not None:
                    notice["saved"] = int(engine.global_steps)
                sums = _all_reduce([loss_sum, loss_count, samples, correct], device)
                slowest, most_waited = _all_reduce([now - started, data_wait], device, op=dist.ReduceOp.MAX)
                partial = {"loss_sum": sums[0], "loss_count": int(sums[1]), "samples": int(sums[2]),
                           "correct": int(sums[3]), "train_time_s": train_before + slowest,
                           "data_wait_s": wait_before + most_waited}
                reached = skip + done * world
                segments[-1]["to"] = time.time()
                state = {"epoch": epoch, "global_step": int(engine.global_steps), "history": history,
                         "position": reached, "partial": partial, "events": events, "segments": segments,
                         "notice": notice, "saved_at": time.time()}
                comm.same_weights()
                with _checkpoint.staging_dir() as directory:
                    _checkpoint.save(engine, directory, rank, world, state)
                    _report(session, config, {"epoch": epoch, "global_step": state["global_step"], "within_epoch": True,
                                              "batch": reached}, directory,
                            f"{CHECKPOINT_PREFIX}{epoch:04d}_{attempt}_step{state['global_step']:07d}", epoch,
                            confirm=True)
                last_checkpoint = time.perf_counter()
                if rank == 0:
                    why = " after the drain notice" if notice is not None and notice["saved"] == state["global_step"] else ""
                    say(f"[{config.run_name}] checkpoint at step {state['global_step']} (batch {reached} of epoch "
                        f"{epoch + 1}) committed{why}")
        train_time = time.perf_counter() - started
        if stopped is not None:
            return _stop(session, stopped)
        data_wait += wait_before

        comm.same_weights()  # (evaluated, checkpointed and bundled: one model)
        val = _evaluate(engine, val_shard, schema, dtype, t.batch_size, device, (rank, world) if config.whole_splits else None,
                        beta=t.dpo.beta)
        totals = _all_reduce(
            [loss_sum, samples, val["loss_sum"], val["correct"], val["count"], val["rows"], correct, loss_count], device
        )
        slowest, most_waited, ended_at = _all_reduce([train_time, data_wait, time.time()], device, op=dist.ReduceOp.MAX)
        slowest += train_before
        metrics: dict[str, Any] = {
            "epoch": epoch + 1,
            "global_step": int(engine.global_steps),
            "train_loss": totals[0] / max(totals[7], 1),
            "val_loss": totals[2] / max(totals[4], 1),
            "samples_per_s": totals[1] / slowest if slowest > 0 else 0.0,
            "epoch_time_s": slowest,
            # The longest any rank waited for its input batches this epoch (part of epoch_time_s).
            "data_wait_s": most_waited,
            "precision": precision,
            "zero_stage": t.zero_stage,
            # What the gradients travelled in between the ranks (`train.comm.compression`), or that they
            # stayed on each rank and the weights were averaged every `sync_every` steps (local SGD), and
            # under `sync_every: auto` the measurement that chose it.
            **comm.metrics(),
            "world_size": world,
            "backend": dist.get_backend(),
            "first_step_at": first_step_at,
            "ended_at": ended_at,  # one wall-clock time for every rank: the epoch's MLflow timestamp
        }
        if schema.task == "classification":
            metrics["val_accuracy"] = totals[3] / max(totals[5], 1)
            metrics["train_accuracy"] = totals[6] / max(totals[1], 1)
        elif schema.task == "regression":
            metrics["val_rmse"] = math.sqrt(metrics["val_loss"])
            metrics["train_rmse"] = math.sqrt(metrics["train_loss"])
        elif schema.pairs:  # DPO: train_loss and val_loss are its loss; perplexity is the chosen answers'
            pair = dict(zip(PAIR_SUMS, _all_reduce([val["pairs"][k] for k in PAIR_SUMS], device)))
            pairs = max(totals[5], 1)
            metrics["val_perplexity"] = math.exp(min(pair["chosen_nll"] / max(pair["chosen_tokens"], 1), 50.0))
            metrics["val_preference_accuracy"] = pair["preferred"] / pairs
            metrics["val_reference_preference_accuracy"] = pair["reference_preferred"] / pairs
            metrics["val_reward_accuracy"] = pair["rewarded"] / pairs
            metrics["val_reward_margin"] = pair["margin"] / pairs
            metrics["train_preference_accuracy"] = totals[6] / max(totals[1], 1)
            metrics["tokens_per_s"] = metrics["samples_per_s"] * schema.context * 2  # two answers a pair
            # A step runs the reference forward (2 FLOPs a parameter a token) besides the model's forward
            # and backward (6): 8/6 of a supervised step's work per token.
            metrics["mfu"] = flops_per_token(model_spec, num_params) * 8 / 6 * metrics["tokens_per_s"] / (peak * world)
        else:
            metrics["val_perplexity"] = math.exp(min(metrics["val_loss"], 50.0))
            metrics["train_perplexity"] = math.exp(min(metrics["train_loss"], 50.0))
            metrics["tokens_per_s"] = metrics["samples_per_s"] * schema.context
            metrics["mfu"] = flops_per_token(model_spec, num_params) * metrics["tokens_per_s"] / (peak * world)
        if resumed_from is not None:
            metrics["resumed_from_step"] = resumed_from
        for name in ("train_loss", "val_loss"):  # reduced over ranks: every rank sees the same
            if not math.isfinite(metrics[name]):
                return _stop(session, not_finite_message(config, name, metrics[name], epoch + 1,
                                                         metrics["global_step"], precision))
        history.append(metrics)
        final = epoch + 1 == t.epochs
        live.end_epoch(epoch + 1, samples / train_time if train_time > 0 else 0.0, metrics["val_loss"])
        checkpoint_started = time.perf_counter()

        segments[-1]["to"] = time.time()  # (the bundle and the checkpoint record this attempt's span so far)
        with _checkpoint.staging_dir() as directory:
            if final:
                _write_bundle(engine, os.path.join(directory, BUNDLE_DIR), rank, model_spec, schema, config,
                              metrics, history, val["probe"], worker_nodes, {"events": events, "segments": segments})
            state = {"epoch": epoch + 1, "global_step": metrics["global_step"], "history": history, "events": events,
                     "segments": segments, "notice": notice, "saved_at": time.time()}
            _checkpoint.save(engine, directory, rank, world, state)
            _report(session, config, metrics, directory, f"{CHECKPOINT_PREFIX}{epoch + 1:04d}_{attempt}", epoch)
        live.checkpointed(time.perf_counter() - checkpoint_started)
        if rank == 0:
            say(format_epoch(config.run_name, metrics, t.epochs))


def _global_batch_change(t, before: int, now: int) -> str:
    """What a resize did to the samples per optimizer step."""
    size = t.batch_size * t.accumulation(now) * now
    if t.global_batch_size is not None:
        return f"global batch {size} held (grad_accum {t.accumulation(before)} -> {t.accumulation(now)})"
    return (f"global batch {t.batch_size * t.grad_accum * before} -> {size} "
            "(train.global_batch_size holds it across sizes)")


def _report(session: Session, config: WorkerConfig, metrics: dict[str, Any], directory: str, name: str,
            epochs_before: int, confirm: bool = False) -> None:
    """`session.report`, with a full storage said as such: which checkpoint, where, what to do. The
    half-written checkpoint is removed (it could never load, and it holds space) by every rank that
    failed to write it; the one before stays as it was."""
    t = config.spec.train
    try:
        session.report(metrics, directory, name, confirm=confirm)
    except OSError as e:
        # A rank whose copy hits the full disk removes the torn checkpoint (below) while another
        # rank's copy may still be landing files in it: that rank sees them vanish, not ENOSPC.
        full = e.errno == errno.ENOSPC or "No space left on device" in str(e)
        if not full and not (isinstance(e, FileNotFoundError) and f"/{config.run_name}/{name}/" in str(e)):
            raise
        # Every rank that failed removes it, again while another rank's copy may still be landing
        # files in it: the last one out leaves no half-written checkpoint behind.
        with contextlib.suppress(Exception):
            fs, root = filesystem_for(t.storage_path, "train.storage_path")
            torn = f"{root}/{config.run_name}/{name}"
            for _ in range(5):
                with contextlib.suppress(Exception):
                    fs.delete_dir(torn)
                time.sleep(0.5)
                if fs.get_file_info(torn).type == pafs.FileType.NotFound:
                    break
        then = (f"it continues from epoch {epochs_before}, whose checkpoint is intact" if epochs_before
                else "it starts over (no epoch had finished)")
        raise CheckpointError(
            f"run {config.run_name!r}: no space left on device for checkpoint {name} in train.storage_path "
            f"{redact(t.storage_path)}. Free space there, then resume the run (`flotilla train ... --resume "
            f"{config.run_name}`): {then}."
        ) from None


def _stop(session: Session, message: str) -> str:
    if session.rank == 0:
        say(f"ERROR: {message}")
    return message


def not_finite_message(config: WorkerConfig, what: str, value: float, epoch: int, step: int, precision: str) -> str:
    """Where the loss stopped being a number, and the likely cause."""
    t = config.spec.train
    text = (f"run {config.run_name!r}: {what} became {value:g} at epoch {epoch}, step {step}; the run stopped there, "
            "failed, and registered nothing.")
    profile = config.preprocessors.get("profile")
    if profile is not None:
        huge = [f"{name} ({max(abs(p['min']), abs(p['max'])):.3g})" for name, p in profile.items()
                if p["kind"] == "numeric" and p.get("min") is not None and max(abs(p["min"]), abs(p["max"])) > 1e6]
        if huge and config.spec.data.scaling == "none":
            text += (f" Input columns reach the model unscaled with values beyond 1e6: {', '.join(huge[:5])}; "
                     "`--set data.scaling=standard` scales them. Otherwise")
        else:
            text += " Its inputs were finite (gaps filled by the imputer, infinite values refused before training):"
    else:
        text += " Most likely"
    text += f" the training diverged: lower train.lr (now {t.lr:g})"
    if not t.grad_clip:
        text += ", or clip gradients (`--set train.grad_clip=1.0`)"
    if precision == "fp16":
        text += ", or train in `--set train.precision=fp32`"
    return text + "."


def say(line: str) -> None:
    """One line to the worker's own stdout, which Ray relays to the driver once. (Ray Train replaces
    `print` on its workers with one that both prints and logs, and the log line is printed again.)"""
    print(line, file=sys.__stdout__ or sys.stdout, flush=True)


def format_epoch(run_name: str, m: dict[str, Any], epochs: int) -> str:
    parts = [
        f"[{run_name}] epoch {m['epoch']}/{epochs}",
        f"step {m['global_step']}",
        f"train_loss {m['train_loss']:.4f}",
        f"val_loss {m['val_loss']:.4f}",
    ]
    parts += [primary_metric(task).format(m[primary_metric(task).name])
              for task in TASKS if primary_metric(task).name in m]
    if "val_preference_accuracy" in m:
        parts += [f"val_preference_accuracy {m['val_preference_accuracy']:.4f}",
                  f"val_reward_margin {m['val_reward_margin']:.4f}"]
    parts.append(f"{m['samples_per_s']:.0f} samples/s")
    if "tokens_per_s" in m:
        parts += [f"{m['tokens_per_s']:.0f} tokens/s", f"MFU {m['mfu']:.1%}"]
    parts.append(f"({m['precision']}, ZeRO-{m['zero_stage']}, {m['world_size']} workers, {m['epoch_time_s']:.1f}s)")
    if m["epoch"] < epochs:  # the epochs left at this epoch's pace
        parts.append(f"ETA {format_duration((epochs - m['epoch']) * m['epoch_time_s'])}")
    return "  ".join(parts)


class _Progress:
    """A line every `PROGRESS_EVERY_S` within a long epoch (rank 0): step, samples/s, ETA, so a
    GPT epoch is not minutes of silence. Epochs shorter than that print only their epoch line."""

    def __init__(self, run_name: str, epoch: int, epochs: int, micro_batches: int, enabled: bool):
        self.label, self.total, self.enabled = f"[{run_name}] epoch {epoch}/{epochs}", micro_batches, enabled
        self.started = self.last = time.perf_counter()
        self.done, self.samples = 0, 0

    def step(self, now: float, samples: int, loss: float) -> None:
        self.done += 1
        self.samples += samples
        if not self.enabled or now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        elapsed = now - self.started
        eta = elapsed / self.done * max(self.total - self.done, 0)
        say(f"{self.label}  batch {self.done}/{self.total}  loss {loss:.4f}  {self.samples / elapsed:.0f} samples/s  "
            f"ETA {format_duration(eta)} (this epoch)")


def _epoch_batches(shard, t, train_rows: int, whole: bool, epoch: int, place: tuple[int, int], skip: int, dtypes,
                   device):
    """The batches of rank `place[0]` of `place[1]` in one epoch. `whole`: `shard` is the whole train
    split, read in one shuffled order that is the same on every rank and at every number of workers
    (the shuffle is seeded by the epoch, not the rank), of which this rank takes its share from batch
    `skip` on. Else: `shard` is its streamed shard."""
    rank, world = place
    if not whole:
        return iter(shard.iter_torch_batches(batch_size=t.batch_size, dtypes=dtypes, device=device,
                                             local_shuffle_buffer_size=t.batch_size * 8,
                                             local_shuffle_seed=t.seed + 1000 * epoch + rank))
    order = shard.iter_torch_batches(batch_size=t.batch_size, dtypes=dtypes, device="cpu",
                                     local_shuffle_buffer_size=t.batch_size * 8, local_shuffle_seed=t.seed + 1000 * epoch)
    count = rank_share(train_rows, world, t, skip)
    return ({k: v.to(device) for k, v in batch.items()} for batch in rank_batches(order, rank, world, skip, count))


def rank_batches(order, rank: int, world: int, skip: int, count: int):
    """Of `order` (one epoch's batches, the same on every rank), those of `rank` of `world` from batch
    `skip` on: skip + rank, skip + rank + world, ...; `count` of them, as many as every rank takes."""
    if count <= 0:
        return
    taken = 0
    for i, batch in enumerate(order):
        if i >= skip and (i - skip) % world == rank:
            yield batch
            taken += 1
            if taken == count:
                return


def _batch_dtypes(schema: DataSchema) -> dict[str, torch.dtype]:
    if schema.masked:
        return {INPUT_IDS: torch.int64, LABELS: torch.int64}
    if schema.task == "lm":
        return {TOKENS: torch.int64}
    label_dtype = torch.int64 if schema.task == "classification" else torch.float32
    return {FEATURES: torch.float32, schema.label_column: label_dtype}


def _split(batch: dict[str, torch.Tensor], schema: DataSchema, dtype: torch.dtype):
    if schema.masked:  # labels come shifted, IGNORE where no loss is taken (prompts, padding)
        return batch[INPUT_IDS], batch[LABELS]
    if schema.task == "lm":
        tokens = batch[TOKENS]
        return tokens[:, :-1], tokens[:, 1:]
    return batch[FEATURES].to(dtype), batch[schema.label_column]


def _loss(out: torch.Tensor, targets: torch.Tensor, schema: DataSchema, reduction: str) -> torch.Tensor:
    out = out.float()
    if schema.task == "classification":
        return F.cross_entropy(out, targets, reduction=reduction)
    if schema.task == "regression":
        return F.mse_loss(out.squeeze(-1), targets, reduction=reduction)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1), reduction=reduction,
                           ignore_index=IGNORE)


def _loss_count(targets: torch.Tensor, schema: DataSchema) -> int:
    """What a batch's mean loss is a mean over: rows (preference pairs too), or for language models
    the tokens a loss is taken on (every target of byte windows; the unmasked ones of a pretrained
    model's windows)."""
    if schema.pairs:
        return len(targets)
    if schema.masked:
        return int((targets != IGNORE).sum())
    return targets.numel() if schema.task == "lm" else len(targets)


# What `_preference` sums over a batch of pairs, besides their losses.
PAIR_SUMS = ("preferred", "reference_preferred", "rewarded", "margin", "chosen_nll", "chosen_tokens")


def _preference(engine, inputs: torch.Tensor, targets: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct Preference Optimization (Rafailov et al. 2023, eq. 7) on (pairs, 2, context) windows, the
    chosen answer first: each pair's loss, `-log sigmoid(beta * ((log p(chosen) - log p_ref(chosen)) -
    (log p(rejected) - log p_ref(rejected))))`, where `log p` sums an answer's token log-probabilities;
    and the batch's sums of `PAIR_SUMS`: pairs whose chosen answer the model (`preferred`) and the
    reference (`reference_preferred`) find likelier, pairs with a positive reward margin (`rewarded`),
    the margins, and the chosen answers' negative log-likelihood and tokens (their perplexity).

    The reference is the model with its adapter disabled (`HFCausalLM.reference`): one copy of the
    weights. Both windows of a pair go through one forward pass."""
    flat_inputs, flat_targets = inputs.flatten(0, 1), targets.flatten(0, 1)
    with torch.no_grad(), engine.module.reference():
        reference = _answer_logps(engine(flat_inputs), flat_targets).view(-1, 2)
    policy = _answer_logps(engine(flat_inputs), flat_targets).view(-1, 2)
    margin = beta * ((policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1]))
    losses = -F.logsigmoid(margin)
    chosen = policy.detach()[:, 0]
    sums = {"preferred": float((policy.detach()[:, 0] > policy.detach()[:, 1]).sum()),
            "reference_preferred": float((reference[:, 0] > reference[:, 1]).sum()),
            "rewarded": float((margin.detach() > 0).sum()), "margin": float(margin.detach().sum()),
            "chosen_nll": float(-chosen.sum()), "chosen_tokens": float((targets[:, 0] != IGNORE).sum())}
    return losses, sums


def _answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per window: the sum of the log-probabilities of its labelled tokens (its answer)."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
    return -nll.view(labels.shape).sum(-1)


@torch.no_grad()
def _evaluate(engine, shard, schema, dtype, batch_size, device, share: tuple[int, int] | None = None,
              beta: float = 0.1) -> dict[str, Any]:
    """Sums over this rank's validation batches. `share=(rank, world)`: `shard` is the whole split,
    and this rank scores batches rank, rank + world, ... Under ZeRO-3 a forward is collective, so
    every rank runs as many as the rank with the most batches (the extra ones are not counted).
    Preference pairs: DPO's loss, and `PAIR_SUMS` under "pairs"."""
    engine.eval()
    loss_sum, correct, count, rows, probe, forwards, seen = 0.0, 0, 0, 0, None, 0, 0
    pair_sums = dict.fromkeys(PAIR_SUMS, 0.0)
    first = None
    for i, batch in enumerate(shard.iter_torch_batches(batch_size=batch_size, dtypes=_batch_dtypes(schema), device=device)):
        seen = i + 1
        inputs, targets = _split(batch, schema, dtype)
        if first is None:
            first = inputs, targets
        if share is not None and i % share[1] != share[0]:
            continue
        forwards += 1
        count += _loss_count(targets, schema)
        rows += len(targets)
        if schema.pairs:
            losses, sums = _preference(engine, inputs, targets, beta)
            loss_sum += float(losses.sum())
            for k, v in sums.items():
                pair_sums[k] += v
            continue
        out = engine(inputs)
        loss_sum += _loss(out, targets, schema, "sum").item()
        if schema.task == "classification":
            correct += int((out.argmax(dim=-1) == targets).sum())
    if share is not None and first is not None:
        for _ in range(-(-seen // share[1]) - forwards):
            _preference(engine, *first, beta) if schema.pairs else engine(first[0])
    if first is not None:  # the inputs the bundle is checked on: windows, whatever the rows
        probe = first[0].flatten(0, 1) if schema.pairs else first[0]
    return {"loss_sum": loss_sum, "correct": correct, "count": count, "rows": rows, "probe": probe, "pairs": pair_sums}


def consolidated_fp32_state_dict(engine) -> dict[str, torch.Tensor]:
    """Full fp32 weights on every rank, whatever the ZeRO stage (collective: all ranks call it).

    ZeRO-1/2 and the bf16 optimizer keep fp32 master copies behind `_hp_mapping`; ZeRO-3
    keeps partitions behind `ds_id`; `safe_get_full_fp32_param` assembles both. Without a
    wrapper (stage 0 in fp32) the module's own parameters are the weights.
    """
    state = {}
    # Every name a shared parameter has (tied embeddings; prompt tuning's reference to the input
    # embeddings): the state dict a fresh model loads names them all.
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        full = safe_get_full_fp32_param(param)
        if full is None and hasattr(param, "ds_id"):
            # ZeRO-3 keeps no fp32 copy of a frozen parameter, and its tensor here may be this rank's
            # empty placeholder (whether it is depends on what the last forward left gathered): gathered.
            with deepspeed.zero.GatheredParameters([param]):
                full = param.detach().float().cpu().clone()
        state[name] = (full if full is not None else param.detach()).float().cpu().clone()
    saved = set(engine.module.state_dict().keys())
    for name, buf in engine.module.named_buffers():
        if name in saved:  # non-persistent buffers (a rotary embedding's frequencies) are rebuilt, not saved
            state[name] = buf.detach().cpu().clone()
    return state


def _write_bundle(engine, directory, rank, model_spec, schema, config, metrics, history, probe, worker_nodes, ledger):
    state = consolidated_fp32_state_dict(engine)
    engine.eval()
    with torch.no_grad():  # every rank runs the probe: ZeRO-3's forward is collective
        reference = engine(probe).float().cpu() if probe is not None else None
    if rank != 0:
        return
    check = None
    hf = model_spec["kind"] == "hf_causal_lm"
    if reference is not None:
        fresh = build_hf_causal_lm(model_spec, schema) if hf else build_model(model_spec, schema)
        fresh.load_state_dict(state, strict=True)
        fresh.eval()
        with torch.no_grad():
            inputs = probe.cpu().float() if probe.is_floating_point() else probe.cpu()
            check = float((fresh(inputs) - reference).abs().max())
    record = {
        "final": metrics,
        "history": history,
        "fingerprint": config.fingerprint,
        "run_name": config.run_name,
        "worker_nodes": worker_nodes,
        "events": ledger["events"],  # each resize, restart and drain notice of the run
        "segments": ledger["segments"],  # each attempt's workers and its wall-clock span: what was paid for
        "bundle_check_max_abs_diff": check,
    }
    if hf:  # the merged weights as the pretrained model's own format (flotilla.bundle)
        if reference is None:
            fresh = build_hf_causal_lm(model_spec, schema)
            fresh.load_state_dict(state, strict=True)
        write_hf_bundle(directory, fresh, model_spec, schema.as_dict(), record)
        return
    write_bundle(directory, state, model_spec, schema, config.preprocessors, record)


def _all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _all_gather(value: Any) -> list[Any]:
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, value)
    return box


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _skip_shared_memory_op() -> None:
    """Tell DeepSpeed its CPU shared-memory collective op is unavailable. It serves only
    `inference_all_reduce` (training's collectives go through torch.distributed/Gloo either way),
    yet DeepSpeed compiles it on the first run of every environment (~80 s on 2 cores) under a lock
    file that a killed worker leaves behind for every later run to wait on forever."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False

