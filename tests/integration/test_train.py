"""Training end to end on a local Ray: Ray Data → TorchTrainer → DeepSpeed → bundle."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from flotilla.bundle import load_bundle
from flotilla.pipeline import run_training
from flotilla.train import checkpoint_problems

from ._helpers import (DIGITS, ROOT, accuracy, digits_spec, digits_val_rows, metric_steps, mlflow_runs,
                       own_ray_processes, store_uri, worker_killed_after_first_checkpoint)

pytestmark = pytest.mark.integration


# Every ZeRO stage trains and consolidates fp32 weights that reproduce the engine's outputs:
# stage 0 in test_bad_input (the CSV run), stage 1 in test_streaming, stage 2 (the default) on the
# session's default run (test_track), stage 3 in the killed-worker run here. Each of those runs
# checks it besides its own subject, so no run is spent on the stage alone. The same runs send their
# gradients compressed (`train.comm.compression`): bf16 at stage 1 (test_streaming), fp16 at stage 3
# here; the CSV run is local SGD (`train.comm.sync_every`).
def _assert_trained_and_consolidated(outcome, stage: int) -> None:
    first, last = outcome.history[0], outcome.history[-1]
    assert last["train_loss"] < first["train_loss"] and last["val_loss"] < first["val_loss"]
    assert last["zero_stage"] == stage and last["precision"] == "fp32"
    assert load_bundle(outcome.bundle_path).metrics["bundle_check_max_abs_diff"] < 1e-5


def test_gpt_trains_with_activation_checkpointing(ray_cluster, gpt_champion):
    outcome = gpt_champion.outcome  # tests/conftest.py: 2 layers, activation checkpointing, grad_accum 2
    first, last = outcome.history
    assert last["val_loss"] < first["val_loss"] < 5.545  # below uniform over 256 bytes: ln 256
    assert last["val_perplexity"] < first["val_perplexity"]
    assert last["tokens_per_s"] > 0 and 0 < last["mfu"] < 1
    bundle = load_bundle(outcome.bundle_path)
    assert bundle.metrics["bundle_check_max_abs_diff"] < 1e-4
    text = bundle.generate("def ", max_tokens=20, temperature=0.8, top_k=20, seed=0)
    assert text == bundle.generate("def ", max_tokens=20, temperature=0.8, top_k=20, seed=0)
    assert len(text) > 0
    # The registered pyfunc model generates the same text from the same seed.
    import mlflow
    import pandas as pd

    mlflow.set_tracking_uri(outcome.tracking_uri)
    model = mlflow.pyfunc.load_model("models:/pycode-gpt@candidate")
    out = model.predict(pd.DataFrame({"prompt": ["def "]}), params={"max_tokens": 20, "temperature": 0.8, "top_k": 20, "seed": 0})
    assert out["text"].tolist() == [text]
    client, runs = mlflow_runs(outcome.tracking_uri, "pycode-gpt")
    assert metric_steps(client, runs[0].info.run_id, "val_perplexity") == [1, 2]
    assert runs[0].data.tags["flotilla.precision"] == "fp32"


@dataclass
class FaultyRun:
    storage: Path
    spec: object
    outcome: object
    killed: list[int]


@pytest.fixture(scope="module")
def faulty_run(ray_cluster, tmp_path_factory) -> FaultyRun:
    """A ZeRO-3 run of 4 epochs that loses a worker after its first checkpoint (and recovers);
    the torn-checkpoint test then continues it under the same name."""
    storage = tmp_path_factory.mktemp("faulty")
    spec = digits_spec(storage, "train.epochs=4", "train.run_name=faulty", "train.max_failures=2", "train.precision=fp32",
                       "train.zero_stage=3", "train.comm.compression=fp16")
    with worker_killed_after_first_checkpoint(storage / "faulty") as killed:
        outcome = run_training(spec)
    return FaultyRun(storage, spec, outcome, killed)


def test_killed_worker_resumes_from_last_checkpoint(faulty_run):
    spec, outcome = faulty_run.spec, faulty_run.outcome
    assert faulty_run.killed, "the test never killed a worker"
    epochs = [m["epoch"] for m in outcome.history]
    assert epochs == [1, 2, 3, 4]
    resumed = [m for m in outcome.history if "resumed_from_step" in m]
    assert resumed, "the run restarted from scratch instead of resuming"
    per_epoch = outcome.history[0]["global_step"]
    # The step counter continues from the checkpoint instead of starting again at 0.
    assert resumed[0]["resumed_from_step"] == per_epoch * (resumed[0]["epoch"] - 1) > 0
    assert [m["global_step"] for m in outcome.history] == [per_epoch * e for e in epochs]
    # One MLflow run, one point per epoch: the restart neither duplicated nor lost an epoch.
    client, runs = mlflow_runs(outcome.tracking_uri)
    assert [r.info.run_id for r in runs] == [outcome.mlflow_run_id]
    assert runs[0].info.status == "FINISHED"
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert metric_steps(client, outcome.mlflow_run_id, key) == [1, 2, 3, 4]
    # ZeRO-3 (parameters partitioned across ranks) resumed and still consolidates: the bundle
    # predicts the validation rows as well as the run measured.
    _assert_trained_and_consolidated(outcome, 3)
    # ...its gradients reduce-scattered in fp16 between the 2 workers (train.comm.compression).
    assert (outcome.history[-1]["gradient_dtype"], outcome.history[-1]["world_size"]) == ("float16", 2)
    assert runs[0].data.tags["flotilla.gradient_dtype"] == "float16"
    rows, labels = digits_val_rows(spec)
    assert accuracy(load_bundle(outcome.bundle_path).predict(rows)["predictions"], labels) == pytest.approx(
        outcome.history[-1]["val_accuracy"], abs=2 / len(labels))


def test_torn_checkpoint_is_skipped_and_the_same_name_resumes(faulty_run, capsys):
    first, storage = faulty_run.outcome, faulty_run.storage
    latest = sorted((storage / "faulty").glob("checkpoint_epoch0004_*"))[-1]
    shard = next(latest.glob("ds/*zero_pp_rank_1_*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])  # rank 1 "died" mid-write

    # Same name, one more epoch: the torn epoch-4 checkpoint is skipped, epoch 3's is used.
    second = run_training(digits_spec(storage, "train.epochs=5", "train.run_name=faulty", "train.max_failures=2",
                                      "train.precision=fp32", "train.zero_stage=3"))
    assert [m["epoch"] for m in second.history] == [1, 2, 3, 4, 5]
    resumed = [m for m in second.history if "resumed_from_step" in m and m["epoch"] > 3]
    assert resumed[0]["epoch"] == 4
    per_epoch = first.history[0]["global_step"]
    assert resumed[0]["resumed_from_step"] == 3 * per_epoch
    assert second.history[-1]["global_step"] == 5 * per_epoch
    # The same name continues the same MLflow run; the changed epoch count is recorded.
    client, runs = mlflow_runs(second.tracking_uri)
    assert [r.info.run_id for r in runs] == [first.mlflow_run_id] == [second.mlflow_run_id]
    assert metric_steps(client, second.mlflow_run_id) == [1, 2, 3, 4, 5]
    assert runs[0].data.params["train.epochs"] == "4"
    assert runs[0].data.tags["flotilla.changed.train.epochs"] == "4 -> 5"
    versions = client.search_model_versions("name = 'digits'")
    assert sorted(int(v.version) for v in versions) == [1, 2]  # new weights, a new version
    _assert_trained_and_consolidated(second, 3)
    # The same command once more (as after a driver that died past registering): nothing is left to
    # train, so no worker group starts; the weights are those of v2, and no third version is registered.
    capsys.readouterr()
    third = run_training(digits_spec(storage, "train.epochs=5", "train.run_name=faulty", "train.max_failures=2",
                                     "train.precision=fp32", "train.zero_stage=3"))
    said = capsys.readouterr().out
    assert "[faulty] finished already: its bundle holds all 5 epochs of this data; nothing to train" in said, said
    assert "epoch 5/5" not in said and third.history == second.history and third.resources is None
    assert third.registration.version == "2"
    assert sorted(int(v.version) for v in client.search_model_versions("name = 'digits'")) == [1, 2]
    assert metric_steps(client, third.mlflow_run_id) == [1, 2, 3, 4, 5]
    # A copy of the bundle cut short (a driver killed while copying it out of the final checkpoint)
    # is never taken for a finished run: the same command resumes from that checkpoint, copies the
    # bundle again whole, and finds it registered already (v2, the same weights).
    from flotilla.bundle import BUNDLE_COPYING

    (storage / "faulty" / BUNDLE_COPYING).write_text("copying")
    weights = storage / "faulty" / "bundle" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    fourth = run_training(digits_spec(storage, "train.epochs=5", "train.run_name=faulty", "train.max_failures=2",
                                      "train.precision=fp32", "train.zero_stage=3"))
    said = capsys.readouterr().out
    assert "finished already" not in said and not (storage / "faulty" / BUNDLE_COPYING).exists(), said
    assert fourth.registration.version == "2" and fourth.history[-1] == second.history[-1]
    _assert_trained_and_consolidated(fourth, 3)


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs: storage that can fill up (unmounted when the test ends)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:  # as test_hosts' hosts: a machine without the privilege to mount
        pytest.skip(f"cannot mount a tmpfs on this machine: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True, capture_output=True)


def test_a_killed_driver_then_a_full_disk_each_resume_with_the_same_command(ray_cluster, small_disk, tmp_path):
    """One run, two faults: its driver is SIGKILLed after epoch 2 and the same command resumes it;
    then its storage fills up after epoch 3: a clear error and the resume command, which finishes
    the run once space is freed. One MLflow run, every epoch once, one version."""
    cmd = [sys.executable, str(ROOT / "pipelines" / "train.py"), "--config", str(DIGITS),
           "--set", f"train.storage_path={small_disk}", "--set", f"track.uri={store_uri(tmp_path)}",
           "--set", "train.run_name=unlucky", "--set", "train.epochs=6", "--set", "train.max_failures=0"]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    run_dir, filler = small_disk / "unlucky", small_disk / "filler"

    def start(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)

    def wait_for_epoch(proc: subprocess.Popen, name: str, epoch: int) -> None:
        """Until Ray Train has registered a checkpoint of `epoch` or later (its snapshot lists it)."""
        snapshot = run_dir / "checkpoint_manager_snapshot.json"
        deadline = time.monotonic() + 300
        while not (snapshot.exists() and max(map(int, re.findall(r"checkpoint_epoch(\d{4})", snapshot.read_text())),
                                             default=0) >= epoch):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()[-3000:]
            time.sleep(0.05)

    began = time.monotonic()
    first = start("first")
    try:
        wait_for_epoch(first, "first", 2)
        print(f"timing: epoch 2 of the first driver at {time.monotonic() - began:.1f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # the driver, mid-run, without a word
        first.wait()
    # Its Train controller and workers go with it (Ray ends the actors a dead driver owned).
    deadline = time.monotonic() + 120
    while own_ray_processes("ray::RayTrainWorker") and time.monotonic() < deadline:
        time.sleep(0.5)

    print(f"timing: the dead driver's workers gone at {time.monotonic() - began:.1f} s")
    second = start("second")
    try:
        wait_for_epoch(second, "second", 3)
        print(f"timing: epoch 3 of the second driver at {time.monotonic() - began:.1f} s")
        # Every byte left. The run's own next checkpoint may hold the disk full at this instant (seen
        # once: even creating the file failed): ask again until it can be made, or the run has met the
        # full disk itself.
        f, deadline = None, time.monotonic() + 120
        while f is None and second.poll() is None and time.monotonic() < deadline:
            try:
                f = open(filler, "wb")
            except OSError:
                time.sleep(0.05)
        if f is not None:
            with f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
        assert second.wait(timeout=300) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(second.pid, signal.SIGKILL)
    out = (tmp_path / "second.log").read_text()
    assert re.search(r"resumed from epoch [23], step \d+", out), out[-4000:]
    # The error says what, where and what to do; the checkpoints left are all complete.
    match = re.search(r"no space left on device for checkpoint (checkpoint_epoch(\d{4})_\w+) in train.storage_path "
                      rf"{re.escape(str(small_disk))}\. Free space there, then resume the run .* it continues from "
                      r"epoch (\d+), whose checkpoint is intact", out)
    assert match, out[-4000:]
    torn, failed_epoch, intact = match.group(1), int(match.group(2)), int(match.group(3))
    assert failed_epoch == intact + 1 and intact >= 3
    assert not (run_dir / torn).exists()  # the half-written one is gone
    left = sorted(run_dir.glob("checkpoint_epoch*"))
    assert left and left[-1].name.startswith(f"checkpoint_epoch{intact:04d}_") and not checkpoint_problems(str(left[-1]))
    client, runs = mlflow_runs(store_uri(tmp_path))
    assert [r.info.status for r in runs] == ["FAILED"] and "no space left" in runs[0].data.tags["flotilla.error"]
    hint = re.search(r"^resume with: (.*)$", out, re.M)
    assert hint and hint.group(1).endswith("--resume unlucky"), out[-2000:]

    print(f"timing: the second driver stopped at {time.monotonic() - began:.1f} s")
    filler.unlink(missing_ok=True)
    words = shlex.split(hint.group(1))
    third = subprocess.run([str(Path(sys.executable).parent / words[0]), *words[1:]], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=900)
    out = third.stdout + third.stderr
    assert third.returncode == 0, out[-4000:]
    assert f"resumed from epoch {intact}" in out, out[-4000:]
    print(f"timing: the third driver finished at {time.monotonic() - began:.1f} s")
    history = json.loads((run_dir / "bundle" / "metrics.json").read_text())["history"]
    assert [m["epoch"] for m in history] == [1, 2, 3, 4, 5, 6]
    client, runs = mlflow_runs(store_uri(tmp_path))
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", [(r.info.run_name, r.info.status) for r in runs]
    assert metric_steps(client, runs[0].info.run_id) == [1, 2, 3, 4, 5, 6]
    assert [int(v.version) for v in client.search_model_versions("name = 'digits'")] == [1]


def test_the_storage_check_counts_a_node_that_left_as_silent_not_as_blind(ray_cluster, tmp_path):
    """A node that leaves while every node is asked to look for the run's storage (an autoscaler
    removing it, a spot node taken back) is reported as not answering, and does not fail the run;
    the node that answers still sees the directory."""
    import ray

    from flotilla.cluster import _nodes_not_seeing

    alive = [n for n in ray.nodes() if n.get("Alive")]
    node_id = alive[0]["NodeID"]  # a well-formed id that no node of this cluster has
    gone = {**alive[0], "NodeID": node_id[:-8] + ("0" * 8 if node_id[-8:] != "0" * 8 else "1" * 8),
            "NodeManagerAddress": "192.0.2.99"}
    blind, silent = _nodes_not_seeing({"train.storage_path": str(tmp_path)}, alive + [gone], timeout_s=60)
    assert blind == {} and silent == ["192.0.2.99"]
