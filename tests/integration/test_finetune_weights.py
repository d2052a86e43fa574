"""Fine-tuning every weight of a pretrained causal LM, or every weight but some layers
(`model.adaptation: full | freeze`), on 2 workers under ZeRO: a tiny random-weight Llama (nothing
downloaded; tests/conftest.py), configs/instruct_lora.yaml's built-in arithmetic instructions.
Prompt tuning (`adaptation: prompt`) too, and preference tuning (`train.objective: dpo`) from the
fully fine-tuned model. LoRA, its bundle, registration and serving are in test_finetune.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flotilla.pipeline import run_training

from ._helpers import ROOT, instruct_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def supervised(ray_cluster, tiny_llama, tmp_path_factory):
    """Every weight fine-tuned (ZeRO-2, 2 epochs): a whole model, which the DPO test starts from."""
    store = tmp_path_factory.mktemp("full")
    return run_training(instruct_spec(
        store, tiny_llama, "model.adaptation=full", "train.zero_stage=2", "train.precision=fp32", "train.epochs=2",
        "train.lr=0.001", "train.run_name=full", "track.enabled=false"))


def test_full_fine_tuning_trains_every_weight_on_two_workers(supervised, tiny_llama):
    _check_trained(supervised, tiny_llama, [], 2)


def test_partly_frozen_fine_tuning_trains_the_rest_under_zero3(ray_cluster, tiny_llama, tmp_path):
    """Every weight but the embeddings and the first layer, under ZeRO-3 (where frozen parameters are
    partitioned too)."""
    frozen = ["model.embed_tokens", "model.layers.0."]
    outcome = run_training(instruct_spec(
        tmp_path, tiny_llama, "model.adaptation=freeze", f"model.freeze=[{', '.join(frozen)}]",
        "train.zero_stage=3", "train.precision=fp32", "train.epochs=2", "train.lr=0.001",
        "train.run_name=freeze", "track.enabled=false"))
    _check_trained(outcome, tiny_llama, frozen, 3)


def _check_trained(outcome, tiny_llama: str, frozen: list[str], stage: int) -> None:
    """Validation loss fell; the trained weights are in the bundle, the frozen ones exactly as pretrained."""
    from transformers import AutoModelForCausalLM

    from flotilla.bundle import ADAPTER_DIR, load_bundle, load_hf_bundle

    losses = [m["val_loss"] for m in outcome.history]
    assert losses[1] < losses[0], losses
    assert (outcome.metrics["zero_stage"], outcome.metrics["world_size"]) == (stage, 2)
    bundle_dir = Path(outcome.bundle_path)
    assert not (bundle_dir / ADAPTER_DIR).exists()  # an adapter is a LoRA run's alone
    assert load_bundle(bundle_dir).metrics["bundle_check_max_abs_diff"] < 1e-5
    trained = load_hf_bundle(bundle_dir).model.state_dict()
    pretrained = AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()
    assert trained.keys() == pretrained.keys()
    unchanged = sorted(name for name in trained if torch.equal(trained[name], pretrained[name]))
    assert unchanged == sorted(name for name in trained if name.startswith(tuple(frozen))), unchanged
    assert bool(unchanged) == bool(frozen)


def test_dpo_from_the_supervised_model_raises_its_held_out_preference_accuracy(supervised, tmp_path):
    """configs/instruct_dpo.yaml (LoRA, built-in arithmetic preference pairs) from the supervised
    fine-tune's whole model, under ZeRO-3 on 2 workers: on held-out pairs the tuned model finds the
    right answer likelier than the wrong one more often than the model it started from, its implicit
    reward ranks most pairs right, and the version is registered through the gate on those numbers."""
    from flotilla.bundle import is_adapter_bundle
    from flotilla.spec import load_spec

    from ._helpers import metric_steps, mlflow_runs, store_uri

    spec = load_spec(ROOT / "configs" / "instruct_dpo.yaml", [
        f"model.pretrained={supervised.bundle_path}", f"train.storage_path={tmp_path / 'runs'}",
        f"track.uri={store_uri(tmp_path)}", "train.zero_stage=3", "train.precision=fp32", "train.epochs=2",
        "train.lr=0.01", "train.run_name=dpo"])
    outcome = run_training(spec)
    history, final = outcome.history, outcome.metrics
    print("DPO from the supervised model: " + "; ".join(
        f"epoch {m['epoch']}: loss {m['val_loss']:.4f}, preference accuracy {m['val_preference_accuracy']:.4f} "
        f"(start {m['val_reference_preference_accuracy']:.4f}), reward accuracy {m['val_reward_accuracy']:.4f}, "
        f"margin {m['val_reward_margin']:.4f}" for m in history))
    start = final["val_reference_preference_accuracy"]  # the supervised model's, on the same held-out pairs
    assert final["val_preference_accuracy"] >= start + 0.1, (final["val_preference_accuracy"], start)
    assert final["val_reward_accuracy"] >= 0.7 and final["val_reward_margin"] > 0
    assert history[-1]["val_loss"] < history[0]["val_loss"] < math.log(2)  # below a coin's loss
    assert (final["zero_stage"], final["world_size"]) == (3, 2)
    bundle_dir = Path(outcome.bundle_path)
    assert is_adapter_bundle(bundle_dir)  # the DPO adapter, on the supervised model as its base
    client, runs = mlflow_runs(outcome.tracking_uri, "instruct-dpo")
    assert metric_steps(client, outcome.mlflow_run_id, "val_preference_accuracy") == [1, 2]
    r = outcome.registration
    assert r.gate.passed and "val_preference_accuracy" in r.gate.summary(), r.gate.summary()


def test_prompt_tuning_trains_its_virtual_tokens_on_two_workers_and_bundles_them(ray_cluster, tiny_llama, tmp_path):
    """`model.adaptation: prompt` under ZeRO-3 on 2 workers: validation loss falls, the bundle is the
    virtual tokens and a pinned base (like a LoRA adapter), and it loads and generates with them
    first: the same logits as the trained model's, whose base weights are exactly as pretrained."""
    from flotilla.bundle import ADAPTER_DIR, is_adapter_bundle, lineage_tags, load_bundle, load_hf_bundle

    outcome = run_training(instruct_spec(
        tmp_path, tiny_llama, "model.adaptation=prompt", "model.prompt_tuning.num_virtual_tokens=8",
        "model.prompt_tuning.init_text='Answer the arithmetic question.'", "train.zero_stage=3",
        "train.precision=fp32", "train.epochs=2", "train.lr=0.3", "train.run_name=prompt", "track.enabled=false"))
    losses = [m["val_loss"] for m in outcome.history]
    assert losses[1] < losses[0], losses
    bundle_dir = Path(outcome.bundle_path)
    assert is_adapter_bundle(bundle_dir) and lineage_tags(bundle_dir)["flotilla.adapter"] == "prompt"
    assert (bundle_dir / ADAPTER_DIR / "adapter_model.safetensors").stat().st_size < 20_000  # 8 x 64 floats and a header
    assert load_bundle(bundle_dir).metrics["bundle_check_max_abs_diff"] < 1e-5
    bundle = load_hf_bundle(bundle_dir)
    assert bundle.prefix.shape[0] == 8
    answer = bundle.generate("What is 3 plus 4?", max_tokens=8, temperature=0, chat=True)
    assert isinstance(answer, str)
    print(f"prompt tuning on 2 workers under ZeRO-3: val_loss {' -> '.join(f'{x:.4f}' for x in losses)}; "
          f"'What is 3 plus 4?' -> {answer!r}")
