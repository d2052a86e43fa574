import pytest
import torch
from pydantic import ValidationError

from flotilla.errors import SpecError, TrainingError
from flotilla.spec import TrainSpec, load_spec
from flotilla.train import deepspeed_config, optimizer_steps, resolve_precision
from flotilla.train import _precision
from flotilla.train._deepspeed_config import rank_share
from flotilla.train._layout import Layout, with_layout
from flotilla.train._loop import rank_batches


def test_deepspeed_config_from_spec():
    t = TrainSpec(batch_size=16, grad_accum=4, zero_stage=3, lr=3e-4, grad_clip=0.5, warmup_fraction=0.1)
    cfg = deepspeed_config(t, "bf16", total_steps=200, world_size=2, gpu=False)
    assert cfg["train_batch_size"] == 16 * 4 * 2
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["lr"] == 3e-4
    sched = cfg["scheduler"]["params"]
    assert sched["total_num_steps"] == 200 and sched["warmup_num_steps"] == 20


def test_offload_only_on_gpu():
    t = TrainSpec(zero_stage=3, offload_optimizer="cpu", offload_params="cpu")
    assert "offload_optimizer" not in deepspeed_config(t, "fp32", 10, 2, gpu=False)["zero_optimization"]
    zero = deepspeed_config(t, "bf16", 10, 2, gpu=True)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"


def test_fp16_uses_dynamic_loss_scaling():
    cfg = deepspeed_config(TrainSpec(), "fp16", 10, 1, gpu=True)
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}


def test_optimizer_steps_counts_equal_shards():
    t = TrainSpec(batch_size=32, grad_accum=2)
    assert optimizer_steps(1440, 2, t, whole=False) == (23, 12)  # 720 rows per rank → 23 micro-batches
    # Whole splits: 45 batches of one order, 22 each for 2 ranks (the 45th is left for this epoch).
    assert optimizer_steps(1440, 2, t) == (22, 11)


def test_every_rank_takes_its_share_of_one_order_from_the_batch_an_epoch_reached():
    order = list(range(45))  # one epoch's batches, the same on every rank
    two = [list(rank_batches(order, r, 2, 0, 22)) for r in (0, 1)]
    assert two[0][:3] == [0, 2, 4] and two[1][:3] == [1, 3, 5] and not set(two[0]) & set(two[1])
    # Interrupted after 10 steps of 2 ranks (batch 20), resumed on 3: the rest, each batch once.
    t = TrainSpec(batch_size=32)
    share = rank_share(1440, 3, t, skip=20)
    rest = [b for r in range(3) for b in rank_batches(order, r, 3, 20, share)]
    first = [b for ranks in two for b in ranks[:10]]
    assert share == 8 and len(rest) == 24 and not set(rest) & set(first)
    assert sorted(first + rest) == list(range(44))  # 44 of 45 batches used, none twice


def test_precision_auto_follows_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(_precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", cpu) == "fp32"
    with pytest.warns(RuntimeWarning, match="60x slower"):
        assert resolve_precision("bf16", cpu) == "bf16"
    monkeypatch.setattr(_precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", cpu) == "bf16"
    assert resolve_precision("fp32", cpu) == "fp32"


def test_short_runs_and_zero_warmup_still_build_a_schedule():
    import deepspeed.runtime.lr_schedules as schedules

    for fraction, total in ((0.0, 100), (0.05, 3)):
        cfg = deepspeed_config(TrainSpec(warmup_fraction=fraction), "fp32", total, 1, gpu=False)
        params = cfg["scheduler"]["params"]
        assert params["warmup_num_steps"] >= 1
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        schedules.WarmupCosineLR(opt, total_num_steps=params["total_num_steps"],
                                 warmup_num_steps=params["warmup_num_steps"])  # DeepSpeed accepts it


def test_a_failed_run_reports_the_rank_that_says_why_over_a_lower_rank_that_saw_the_effect():
    """Rank 1 ran out of disk and removed its torn checkpoint; rank 0's copy into it then found its
    files gone. The user reads rank 1's message, not rank 0's FileNotFoundError."""
    from ray.train.v2.api.exceptions import WorkerGroupError

    from flotilla.errors import CheckpointError, TrainingError
    from flotilla.train._run import _explain

    full = CheckpointError("run 'r': no space left on device for checkpoint checkpoint_epoch0004_ab")
    vanished = FileNotFoundError("Failed to open local file '/d/r/checkpoint_epoch0004_ab/latest'")
    assert _explain(WorkerGroupError("failed", {0: vanished, 1: full})) is full
    plain = _explain(WorkerGroupError("failed", {1: ValueError("bad"), 0: vanished}))
    assert isinstance(plain, TrainingError) and str(plain).startswith("training failed on rank 0: FileNotFoundError")


def test_a_training_worker_and_the_train_controllers_relay_do_not_load_mlflow():
    """Each process that Ray Train starts per run imports only what it uses: a worker imports the
    loop (and DeepSpeed, which would pull MLflow in for its autotuner), the controller the epoch
    relay. MLflow costs each ~1.5 CPU-seconds; it is the driver's alone."""
    import subprocess
    import sys

    probe = ("import sys; import flotilla.train._loop, flotilla._epoch_relay; "
             "print(sorted(m for m in ('mlflow', 'sqlalchemy') if m in sys.modules)); "
             "import mlflow; print(mlflow.MlflowClient.__name__)")  # hidden only while DeepSpeed loads
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "MlflowClient"]


def test_the_epoch_line_says_how_long_the_remaining_epochs_take_at_this_pace():
    from flotilla.train import format_epoch

    m = {"epoch": 3, "global_step": 69, "train_loss": 0.18, "val_loss": 0.16, "val_accuracy": 0.95,
         "samples_per_s": 2600.0, "precision": "fp32", "zero_stage": 2, "world_size": 2, "epoch_time_s": 65.0}
    line = format_epoch("digits-1", m, epochs=12)
    assert line.startswith("[digits-1] epoch 3/12  step 69") and line.endswith("ETA 9m45s"), line
    assert "ETA" not in format_epoch("digits-1", {**m, "epoch": 12}, epochs=12)  # the last epoch: done


def test_a_global_batch_is_held_across_world_sizes_by_gradient_accumulation():
    t = TrainSpec(batch_size=32, global_batch_size=128, num_workers=2)
    for world, accumulation in ((1, 4), (2, 2), (4, 1)):
        config = deepspeed_config(t, "fp32", 100, world, gpu=False)
        assert config["gradient_accumulation_steps"] == accumulation
        assert config["train_batch_size"] == 128
    # The same optimizer steps per epoch (and so the same LR schedule) whatever the size.
    assert {optimizer_steps(1440, world, t, whole=False)[1] for world in (1, 2, 4)} == {12}
    # Whole splits: the same batches too (whole optimizer steps of the one order: 44 of 45 batches).
    assert {optimizer_steps(1440, world, t)[1] for world in (1, 2, 4)} == {11}
    assert {rank_share(1440, world, t) * world for world in (1, 2, 4)} == {44}
    # Without it, the per-worker batch is kept and the global batch follows the workers.
    plain = TrainSpec(batch_size=32, grad_accum=2)
    assert [deepspeed_config(plain, "fp32", 100, w, gpu=False)["train_batch_size"] for w in (1, 2)] == [64, 128]


def test_num_workers_is_a_number_or_an_elastic_range():
    t = TrainSpec(num_workers=[1, 3])
    assert (t.elastic, t.min_workers, t.max_workers, t.describe_workers()) == (True, 1, 3, "1-3")
    assert TrainSpec(num_workers=[2, 2]).num_workers == 2  # a range of one size is that size
    with pytest.raises(ValidationError, match=r"\[2, 1\]: the first is the minimum .* write \[1, 2\]"):
        TrainSpec(num_workers=[2, 1])
    for bad in ([0, 2], [1, 2, 3], "x", 0):
        with pytest.raises(ValidationError, match=r"a number of workers, e.g. 2, \[min, max\] for an elastic run, .* or `auto`"):
            TrainSpec(num_workers=bad)
    # Every size it may take must split the global batch.
    with pytest.raises(ValidationError, match=r"on every number of workers an elastic run may have \(1 to 3\); "
                                              r"use a multiple of 192"):
        TrainSpec(num_workers=[1, 3], batch_size=32, global_batch_size=128)
    assert TrainSpec(num_workers=[1, 3], batch_size=32, global_batch_size=192).accumulation(2) == 3


def test_num_workers_auto_is_chosen_at_the_start_and_keeps_the_samples_per_step():
    t = TrainSpec(num_workers="auto", batch_size=32)
    assert (t.auto_layout, t.elastic, t.describe_workers()) == (True, False, "auto")
    with pytest.raises(ValueError, match="the run chooses it when it starts"):
        t.max_workers
    with pytest.raises(ValidationError, match=r"chooses `train.cpus_per_worker` too .* \(now 2\)"):
        TrainSpec(num_workers="auto", cpus_per_worker=2)
    assert TrainSpec(num_workers="auto", gpus_per_worker=1, cpus_per_worker=4).auto_layout  # one per GPU
    with pytest.raises(SpecError, match=r"a sweep's trials share the node .* `--set train.num_workers=1`"):
        load_spec(None, ["train.num_workers=auto", "tune.space={train.lr: {loguniform: [0.001, 0.01]}}"])
    # The chosen layout is validated again: one worker of 2 threads takes both workers' rows a step.
    spec = load_spec(None, ["train.num_workers=auto", "train.batch_size=32", "train.global_batch_size=128"])
    one = with_layout(spec, Layout(1, 2, 64, "measured", {}))
    assert (one.train.num_workers, one.train.cpus_per_worker, one.train.accumulation(1)) == (1, 2, 2)
    assert with_layout(spec, Layout(2, 1, 32, "measured", {})).train.accumulation(2) == 2
    with pytest.raises(ValidationError, match=r"global_batch_size` = 128 is not a whole number of micro-batches"):
        with_layout(spec, Layout(1, 3, 96, "measured", {}))
    # What the run prints.
    assert Layout(1, 1, 32, "one core", {}).describe() == (
        "train.num_workers auto: 1 worker x 1 thread, batch 32 per worker (the node has one CPU for training beside "
        "the data pipeline's: nothing to choose)")
    assert Layout(2, 1, 32, "measured", {"2x1": 50.0, "1x2": 40.0}, 4.2).describe() == (
        "train.num_workers auto: 2 workers x 1 thread, batch 32 per worker (measured in 4 s: 2x1 50.0 samples/s, "
        "1x2 40.0 samples/s)")


def test_a_global_batch_the_workers_cannot_split_is_refused_naming_a_size_that_fits():
    with pytest.raises(ValidationError, match=r"global_batch_size` = 96 is not a whole number of micro-batches .* "
                                              r"on 2 worker\(s\) \(64 samples a micro-step\); use a multiple of 64, "
                                              r"e.g. 64 or 128"):
        TrainSpec(batch_size=32, global_batch_size=96, num_workers=2)
    with pytest.raises(ValidationError, match="give it or `train.grad_accum` \\(now 2\\), not both"):
        TrainSpec(batch_size=32, global_batch_size=128, grad_accum=2)
    # A run resumed on a size the global batch does not divide into stops with the same words.
    with pytest.raises(TrainingError, match=r"on 3 worker\(s\)"):
        deepspeed_config(TrainSpec(batch_size=32, global_batch_size=128), "fp32", 100, 3, gpu=False)


def test_gradients_travel_in_the_compression_asked_for_else_in_the_training_precision(tmp_path):
    from flotilla.spec import load_spec

    for compression, dtype in (("bf16", "bf16"), ("fp16", "fp16")):
        t = TrainSpec(comm={"compression": compression})
        assert deepspeed_config(t, "fp32", 10, 2, gpu=False)["communication_data_type"] == dtype
    assert "communication_data_type" not in deepspeed_config(TrainSpec(), "bf16", 10, 2, gpu=False)
    # What is not offered is refused naming what is, before anything runs.
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\ndata: {source: digits}\nmodel: {kind: mlp}\n")
    with pytest.raises(Exception, match=r"train\.comm\.compression.*'none', 'bf16', 'fp16', 'int8' or 'powersgd'"):
        load_spec(spec, ["train.comm.compression=int4"])


def test_int8_and_powersgd_run_pytorchs_hooks_at_stage_0_and_zero_plus_plus_on_gpus_at_stage_3():
    for compression in ("int8", "powersgd"):
        t = TrainSpec(zero_stage=0, precision="fp32", comm={"compression": compression})
        # (sent by the hook, not by DeepSpeed: no communication_data_type)
        assert t.comm.hooked and "communication_data_type" not in deepspeed_config(t, "fp32", 10, 2, gpu=False)
        for stage, precision in ((2, "fp32"), (0, "bf16"), (0, "auto")):
            with pytest.raises(ValidationError, match=rf"compression` = {compression} runs a DDP communication "
                               rf"hook on fp32 gradients at ZeRO stage 0 \(now stage {stage}, precision {precision}\).*"
                               r"`--set train.zero_stage=0 --set train.precision=fp32`, or .*compression=bf16"):
                TrainSpec(zero_stage=stage, precision=precision, comm={"compression": compression})
    # On GPUs at stage 3, int8 is ZeRO++: quantized weights and gradients, and the weights' secondary
    # partition within each node of 4 ranks (of 8).
    t = TrainSpec(zero_stage=3, gpus_per_worker=1, comm={"compression": "int8"})
    zero = deepspeed_config(t, "bf16", 10, 8, gpu=True, local_world=4)["zero_optimization"]
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"], zero["zero_hpz_partition_size"]) == (True, True, 4)
    # One rank per node: nothing to partition within a node.
    assert "zero_hpz_partition_size" not in deepspeed_config(t, "bf16", 10, 8, gpu=True)["zero_optimization"]
    with pytest.raises(ValidationError, match=r"on GPUs \(`train.gpus_per_worker`\) at stage 3, DeepSpeed's ZeRO\+\+"):
        TrainSpec(zero_stage=3, comm={"compression": "int8"})
    with pytest.raises(ValidationError):
        TrainSpec(zero_stage=0, precision="fp32", comm={"compression": "powersgd", "powersgd_rank": 0})


def test_local_sgd_is_offered_where_every_rank_holds_the_whole_optimizer():
    assert TrainSpec(zero_stage=0, precision="fp32", comm={"sync_every": 4}).comm.sync_every == 4
    with pytest.raises(ValidationError, match=r"sync_every` = 4 needs ZeRO stage 0 .* `--set train.zero_stage=0`"):
        TrainSpec(zero_stage=2, comm={"sync_every": 4})
    with pytest.raises(ValidationError, match=r"averages fp32 weights: `--set train.precision=fp32`"):
        TrainSpec(zero_stage=0, precision="bf16", comm={"sync_every": 4})
    with pytest.raises(ValidationError, match=r"compression` applies to gradients.*set one of them"):
        TrainSpec(zero_stage=0, precision="fp32", comm={"sync_every": 4, "compression": "bf16"})
    with pytest.raises(ValidationError):
        TrainSpec(comm={"sync_every": 0})
    # `auto` chooses N by measuring, under the same conditions.
    assert TrainSpec(zero_stage=0, precision="fp32", comm={"sync_every": "auto"}).comm.local_sgd
    with pytest.raises(ValidationError, match=r"sync_every` = auto needs ZeRO stage 0"):
        TrainSpec(zero_stage=1, comm={"sync_every": "auto"})
    with pytest.raises(ValidationError, match=r"compression` applies to gradients.*set one of them"):
        TrainSpec(zero_stage=0, precision="fp32", comm={"sync_every": "auto", "compression": "powersgd"})
