import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flotilla.errors import ModelError
from flotilla.models._hf import (HFCausalLM, adapter_state_dict, build_hf_causal_lm, merge_into_base,
                                 merged_state_dict, trainable_parameters)


def spec(path, **over):
    return {"kind": "hf_causal_lm", "pretrained": path, "revision": None, "trust_remote_code": False,
            "adaptation": "lora", "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": None},
            "freeze": [], "gradient_checkpointing": False, **over}


def test_tiny_llama_loads_offline_with_a_chat_template(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok)
    assert 100_000 < model.num_parameters() < 500_000
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"


def test_lora_trains_only_the_adapters_on_the_attention_projections(tiny_llama):
    model = build_hf_causal_lm(spec(tiny_llama))
    assert isinstance(model, HFCausalLM) and model.is_lora
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # per layer and projection: A (rank x in) + B (out x rank); q,o are 64->64, k,v 64->32 (2 kv heads)
    assert trainable_parameters(model) == 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32))
    logits = model(torch.randint(0, 500, (2, 16)))
    assert logits.shape == (2, 16, model.config.vocab_size)
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_merged_weights_compute_what_the_adapted_model_computes(tiny_llama):
    torch.manual_seed(0)
    model = build_hf_causal_lm(spec(tiny_llama)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero (a no-op adapter); make the update real
                p.normal_(0, 0.2)
        ids = torch.randint(0, 500, (2, 12))
        adapted = model(ids)
        state = merged_state_dict(model)
        assert set(adapter_state_dict(model)) == {n.replace("hf.", "", 1).replace(".default", "")
                                                   for n, p in model.named_parameters() if p.requires_grad}
        assert not any("lora" in k for k in state)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama)
        base.load_state_dict(state)
        merged = base.eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()(ids).logits
    assert (plain - adapted).abs().max() > 1e-2  # the adapters change the function...
    assert (merged - adapted).abs().max() < 1e-5  # ...and the merged weights compute the same one
    assert (model(ids) - adapted).abs().max() == 0  # merged_state_dict left the model as it was
    assert type(merge_into_base(model)).__name__ == "LlamaForCausalLM"


def test_full_and_freeze(tiny_llama):
    full = build_hf_causal_lm(spec(tiny_llama, adaptation="full"))
    total = sum(p.numel() for p in full.parameters())
    assert trainable_parameters(full) == total
    frozen = build_hf_causal_lm(spec(tiny_llama, adaptation="freeze", freeze=["model.embed_tokens", "model.layers.0."]))
    off = {n for n, p in frozen.named_parameters() if not p.requires_grad}
    assert "hf.model.embed_tokens.weight" in off and all(".layers.1." not in n for n in off)
    assert trainable_parameters(frozen) < total
    sharded = torch.nn.Linear(4, 4)
    sharded.weight.data = torch.empty(0)  # what a ZeRO-3 rank holds of a partitioned parameter
    sharded.weight.ds_numel = 16
    assert trainable_parameters(sharded) == 16 + 4
    with pytest.raises(ModelError, match=r"model.freeze \['model.nothing'\] matches no parameter; names start with: "
                                         r"lm_head.weight, model.embed_tokens"):
        build_hf_causal_lm(spec(tiny_llama, adaptation="freeze", freeze=["model.nothing"]))
    with pytest.raises(ModelError, match="only `adaptation: freeze` does"):
        build_hf_causal_lm(spec(tiny_llama, adaptation="full", freeze=["lm_head"]))


def test_gradient_checkpointing_keeps_the_lora_gradients(tiny_llama):
    ids = torch.randint(0, 500, (2, 10))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_hf_causal_lm(spec(tiny_llama, gradient_checkpointing=checkpointing))
        assert model.base.is_activation_checkpointing == checkpointing
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.01)
        model.train()
        model(ids).float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name
    assert all(g.abs().sum() > 0 for g in grads[1].values())


def test_lora_targets_that_match_nothing_name_the_layers(tiny_llama):
    with pytest.raises(ModelError, match=r"its Linear layers are named .*q_proj.*--set model.lora.target_modules="):
        build_hf_causal_lm(spec(tiny_llama, lora={"target_modules": ["attn_proj"]}))


def test_missing_directory_and_unknown_hub_id_name_model_pretrained(tmp_path, monkeypatch):
    with pytest.raises(ModelError, match=r"model.pretrained '/nowhere/model' is not a directory here; point "
                                         r"`--set model.pretrained=...`"):
        build_hf_causal_lm(spec("/nowhere/model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"is a directory but not a loadable model.*config.json, \*.safetensors"):
        build_hf_causal_lm(spec(str(tmp_path / "empty")))
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # no network: fail at once
    with pytest.raises(ModelError, match=r"model.pretrained 'no-such-org/no-such-model' is neither a local directory "
                                         r"nor a hub model"):
        build_hf_causal_lm(spec("no-such-org/no-such-model"))


def test_remote_code_is_refused_unless_the_spec_opts_in(tiny_llama, tmp_path):
    import json
    import shutil

    remote = tmp_path / "remote"
    shutil.copytree(tiny_llama, remote)
    config = json.loads((remote / "config.json").read_text())
    config["model_type"] = "flotilla_unknown"
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"needs code of its own .*`--set model.trust_remote_code=true`"):
        build_hf_causal_lm(spec(str(remote)))


@pytest.mark.parametrize("adaptation", ["lora", "prompt"])
def test_the_reference_is_the_base_with_the_adapter_disabled(tiny_llama, adaptation):
    """DPO's reference without a second copy: inside `reference()` the model computes exactly what its
    pretrained base computes (no LoRA update, no virtual tokens), in eval mode; outside, the adapted model."""
    torch.manual_seed(0)
    model = build_hf_causal_lm(spec(tiny_llama, adaptation=adaptation, prompt_tuning={"num_virtual_tokens": 4}))
    for name, p in model.named_parameters():
        if p.requires_grad:  # a trained-looking adapter (LoRA's B starts at zero)
            p.data.normal_(0, 0.5)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    ids = torch.randint(0, 500, (2, 12))
    model.train()
    with torch.no_grad():
        adapted = model(ids)
        with model.reference() as reference:
            assert not reference.training
            same = reference(ids)
        expected = base(input_ids=ids).logits
    assert model.training  # restored
    assert adapted.shape == same.shape == expected.shape
    assert torch.allclose(same, expected, atol=1e-5) and not torch.allclose(adapted, expected, atol=1e-3)
    with pytest.raises(ModelError, match="has no adapter"):
        with build_hf_causal_lm(spec(tiny_llama, adaptation="full")).reference():
            pass


def test_dpo_loss_is_log_2_at_the_start_and_reaches_the_adapter_alone(tiny_llama):
    """`_preference`, on a model whose LoRA update is still zero: the model is its reference, so every
    pair's margin is 0 and its loss log 2; the gradient reaches the adapters only, and the pair sums are
    those computed by hand from the base model's token log-probabilities."""
    import math

    from flotilla.data._instruct import IGNORE
    from flotilla.train._loop import _preference

    torch.manual_seed(0)
    model = build_hf_causal_lm(spec(tiny_llama))

    class Engine:  # what `_preference` uses of a DeepSpeed engine: its module, and calling it
        module = model

        def __call__(self, inputs):
            return model(inputs)

    ids = torch.randint(0, 500, (3, 2, 10))
    labels = torch.full_like(ids, IGNORE)
    labels[..., 5:9] = ids[..., 6:10]  # a 4-token answer
    losses, sums = _preference(Engine(), ids, labels, beta=0.5)
    assert losses.shape == (3,) and torch.allclose(losses, torch.full((3,), math.log(2)))
    assert sums["rewarded"] == 0 and sums["margin"] == 0 and sums["chosen_tokens"] == 12
    losses.mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        logps = base(input_ids=ids.flatten(0, 1)).logits.log_softmax(-1)
    answer = logps[:, 5:9].gather(-1, ids.flatten(0, 1)[:, 6:10, None]).squeeze(-1).sum(-1).view(3, 2)
    assert sums["preferred"] == sums["reference_preferred"] == float((answer[:, 0] > answer[:, 1]).sum())
    assert sums["chosen_nll"] == pytest.approx(float(-answer[:, 0].sum()), rel=1e-5)
