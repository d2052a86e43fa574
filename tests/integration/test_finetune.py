"""Fine-tuning a pretrained causal LM (`model.kind: hf_causal_lm`) with LoRA under ZeRO-3 on 2 workers.

Nothing is downloaded: the "pretrained" model is a tiny random-weight Llama with a tokenizer trained
on the spot (`flotilla.models._hf_tiny`), saved to a temporary directory that `model.pretrained`
points at. One run of the shipped configs/instruct_lora.yaml (the built-in arithmetic instructions)
loses a worker after its first checkpoint and resumes; then its bundle, adapter and registration are
checked against the model it trained.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from flotilla.spec import load_spec
from flotilla.train import run_training

from ._helpers import ROOT, metric_steps, mlflow_runs, own_ray_processes, store_uri

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from flotilla.models._hf_tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def test_lora_under_zero3_on_two_workers_learns_resumes_and_registers_the_merged_model(ray_cluster, tiny_llama,
                                                                                       tmp_path):
    storage = tmp_path / "runs"
    spec = load_spec(ROOT / "configs" / "instruct_lora.yaml", [
        f"model.pretrained={tiny_llama}", f"train.storage_path={storage}", f"track.uri={store_uri(tmp_path)}",
        "train.zero_stage=3", "train.precision=fp32", "train.epochs=3", "train.lr=0.01", "train.run_name=lora",
        "train.max_failures=1",
    ])
    killed: list[int] = []

    def kill_a_worker_after_the_first_checkpoint():
        deadline = time.monotonic() + 600
        snapshot = storage / "lora" / "checkpoint_manager_snapshot.json"
        while time.monotonic() < deadline and not killed:
            if snapshot.exists() and "checkpoint_epoch0001" in snapshot.read_text():
                pids = [p.pid for p in own_ray_processes("ray::RayTrainWorker")]
                if pids:
                    os.kill(pids[-1], signal.SIGKILL)
                    killed.append(pids[-1])
                    return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_a_worker_after_the_first_checkpoint, daemon=True)
    killer.start()
    outcome = run_training(spec)
    killer.join(timeout=5)

    # The adapters learned: validation loss fell every epoch, across the lost worker's restart,
    # which resumed from the epoch-1 checkpoint instead of starting over.
    history = outcome.history
    assert killed, "the test never killed a worker"
    assert [m["epoch"] for m in history] == [1, 2, 3]
    assert any("resumed_from_step" in m for m in history), "the run started over instead of resuming"
    losses = [m["val_loss"] for m in history]
    assert losses[2] < losses[1] < losses[0], losses
    final = outcome.metrics
    assert (final["zero_stage"], final["world_size"], final["precision"]) == (3, 2, "fp32")
    assert final["val_perplexity"] == pytest.approx(torch.tensor(final["val_loss"]).exp().item(), rel=1e-6)
    print(f"LoRA under ZeRO-3 on 2 workers: val_loss {' -> '.join(f'{x:.4f}' for x in losses)}")

    # The bundle: merged weights and the adapter alone, as safetensors, JSON and text only; the
    # consolidated ZeRO-3 partitions reproduce the engine's logits.
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    from flotilla._hf_bundle import ADAPTER_DIR, load_hf_bundle

    bundle_dir = storage / "lora" / "bundle"
    files = {str(p.relative_to(bundle_dir)) for p in bundle_dir.rglob("*") if p.is_file()}
    assert {"model.safetensors", "config.json", "tokenizer.json", f"{ADAPTER_DIR}/adapter_model.safetensors"} <= files
    assert all(f.endswith((".safetensors", ".json", ".jinja", ".md")) for f in files), files
    from flotilla.bundle import load_bundle

    assert load_bundle(bundle_dir).metrics["bundle_check_max_abs_diff"] < 1e-5
    # The merged bundle is the adapted model: the adapter on the base gives the same logits and
    # generates the same tokens, greedy and sampled with the same seed.
    bundle = load_hf_bundle(bundle_dir)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), bundle_dir / ADAPTER_DIR).eval()
    ids = torch.tensor([bundle.encode("What is 12 plus 7?", chat=True)])
    with torch.no_grad():
        assert (adapted(input_ids=ids).logits - bundle.model(input_ids=ids).logits).abs().max() < 1e-5
        for kwargs in (dict(do_sample=False), dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)):
            texts = []
            for model in (adapted, bundle.model):
                torch.manual_seed(0)
                texts.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                            min_new_tokens=10, **kwargs)[0, ids.shape[1]:].tolist())
            assert texts[0] == texts[1], kwargs

    # One MLflow run, every epoch once; the version is registered and, the first, champion.
    client, runs = mlflow_runs(outcome.tracking_uri, "instruct-lora")
    assert [(r.info.run_id, r.info.status) for r in runs] == [(outcome.mlflow_run_id, "FINISHED")]
    assert metric_steps(client, outcome.mlflow_run_id, "val_perplexity") == [1, 2, 3]
    r = outcome.registration
    assert (r.model_name, r.version, r.champion.after) == ("instruct-lora", "1", "1")
    assert r.gate.passed and "val_perplexity" in r.gate.summary()
    from flotilla.track import load_registered_bundle

    registered = load_registered_bundle(client, "instruct-lora", "1")
    prompt = "What is 3 times 4?"
    assert registered.generate(prompt, max_tokens=8, temperature=0, chat=True) == \
        bundle.generate(prompt, max_tokens=8, temperature=0, chat=True)
