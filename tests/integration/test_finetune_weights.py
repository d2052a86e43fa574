"""Fine-tuning every weight of a pretrained causal LM, or every weight but some layers
(`model.adaptation: full | freeze`), on 2 workers under ZeRO: a tiny random-weight Llama (nothing
downloaded; tests/conftest.py), configs/instruct_lora.yaml's built-in arithmetic instructions.
Prompt tuning (`adaptation: prompt`) too. LoRA, its bundle, registration and serving are in test_finetune.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.pipeline import run_training

from ._helpers import instruct_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("adaptation, stage", [("full", 2), ("freeze", 3)])
def test_full_and_partly_frozen_fine_tuning_train_on_two_workers(ray_cluster, tiny_llama, tmp_path, adaptation, stage):
    """Every weight (ZeRO-2), or every weight but the embeddings and the first layer (ZeRO-3, where
    frozen parameters are partitioned too): the trained weights are in the bundle, the frozen ones
    exactly as pretrained."""
    from transformers import AutoModelForCausalLM

    from flotilla.bundle import ADAPTER_DIR, load_hf_bundle
    from flotilla.bundle import load_bundle

    frozen = ["model.embed_tokens", "model.layers.0."] if adaptation == "freeze" else []
    outcome = run_training(instruct_spec(
        tmp_path, tiny_llama, f"model.adaptation={adaptation}", f"model.freeze=[{', '.join(frozen)}]",
        f"train.zero_stage={stage}", "train.precision=fp32", "train.epochs=2", "train.lr=0.001",
        f"train.run_name={adaptation}", "track.enabled=false"))
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
