"""`hf_causal_lm`: a pretrained Hugging Face causal language model, fine-tuned whole, in part, or
through LoRA adapters (peft).

    model = build_hf_causal_lm({"kind": "hf_causal_lm", "pretrained": "/models/tiny", "adaptation": "lora",
                                "lora": {"rank": 8, "alpha": 16, "dropout": 0.05, "target_modules": None}}, schema)
    logits = model(input_ids)                          # (batch, time, vocab): the loop computes the loss
    merged = merge_into_base(model)                    # LoRA folded into the base: what the bundle holds

The module the loop trains is `HFCausalLM`, a thin wrapper whose forward takes token ids and
returns logits, like the built-in `gpt`; the Hugging Face model (peft-wrapped for LoRA) is its
`.hf`. transformers and peft are imported only when such a model is built: the other model kinds
never need them.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from typing import Any

import torch
from torch import nn

from flotilla.errors import ModelError
from flotilla.models._hf_tiny import resolve_pretrained

ADAPTATIONS = ("lora", "prompt", "full", "freeze")
# Where LoRA goes when `model.lora.target_modules` is null: the attention projections, as in the
# LoRA paper (Hu et al. 2021, section 7.1: adapting W_q and W_v, or all four, works best per
# parameter), under each architecture's own module names. Other architectures get every Linear
# layer except the output head (peft's `all-linear`).
DEFAULT_TARGET_MODULES = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gpt2": ["c_attn"],
    "gpt_neox": ["query_key_value"],
}
LORA_DEFAULTS = {"rank": 8, "alpha": 16, "dropout": 0.05, "target_modules": None, "merge": False}
PROMPT_DEFAULTS = {"num_virtual_tokens": 16, "init_text": None}


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as the training loop sees it: token ids in, logits out.

    `attention_mask` may be left out for right-padded rows: in a causal model a real token never
    attends to the padding after it, and the loss ignores the padded positions."""

    def __init__(self, hf: nn.Module, spec: dict[str, Any]):
        super().__init__()
        self.hf = hf
        self.spec = spec
        self._as_reference = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # No KV cache in training: it would only hold memory the backward pass needs.
        logits = self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        # Prompt tuning puts its virtual tokens first (peft): the inputs' own logits follow them.
        skip = 0 if self._as_reference else self.virtual_tokens
        return logits[:, skip:] if skip else logits

    @contextlib.contextmanager
    def reference(self):
        """Within it, the model is the one training started from: the base with the adapter disabled
        (peft's `disable_adapter`), in eval mode (no dropout). DPO's reference, without a second copy."""
        if not self.is_adapter:
            raise ModelError("a reference model is the base with the adapter disabled; "
                             f"`adaptation: {self.spec.get('adaptation')}` has no adapter")
        training = self.training
        self.eval()
        self._as_reference = True
        try:
            with self.hf.disable_adapter():
                yield self
        finally:
            self._as_reference = False
            self.train(training)

    @property
    def is_lora(self) -> bool:
        return self.spec.get("adaptation", "lora") == "lora"

    @property
    def is_adapter(self) -> bool:
        """Trained as an adapter on a frozen base (peft): LoRA or prompt tuning."""
        return self.spec.get("adaptation", "lora") in ("lora", "prompt")

    @property
    def virtual_tokens(self) -> int:
        """Prompt tuning's virtual tokens before every input (0 for other adaptations)."""
        if self.spec.get("adaptation") != "prompt":
            return 0
        return int((self.spec.get("prompt_tuning") or {}).get("num_virtual_tokens", PROMPT_DEFAULTS["num_virtual_tokens"]))

    @property
    def config(self):
        return self.base.config

    @property
    def base(self) -> nn.Module:
        """The transformers model underneath (for LoRA: with its LoRA layers still in place)."""
        return self.hf.get_base_model() if self.is_adapter else self.hf


def build_hf_causal_lm(model_spec: dict[str, Any], schema: Any = None, dtype: torch.dtype = torch.float32,
                       deepspeed_config: dict[str, Any] | None = None) -> HFCausalLM:
    """The model `model_spec` names, ready to train as its `adaptation` says.

    `deepspeed_config` (the engine's config, every rank): with ZeRO stage 3 the weights are created
    already partitioned across ranks (`deepspeed.zero.Init`, through transformers'
    `HfDeepSpeedConfig`) and rank 0 alone reads the checkpoint, instead of every rank holding the
    whole model first. The process group must exist already (Ray Train sets it up)."""
    del schema  # the vocabulary and context come from the pretrained model itself
    spec = {**model_spec, "lora": {**LORA_DEFAULTS, **(model_spec.get("lora") or {})}}
    adaptation = spec.get("adaptation", "lora")
    if adaptation not in ADAPTATIONS:
        raise ModelError(f"model.adaptation {adaptation!r} is not one of {', '.join(ADAPTATIONS)}; "
                         "`--set model.adaptation=lora`")
    hf = load_pretrained(spec, dtype, deepspeed_config)
    if spec.get("gradient_checkpointing"):
        # Non-reentrant checkpointing: the reentrant kind gives frozen embeddings' outputs no grad
        # and so drops the LoRA gradients of every checkpointed layer (peft's known workaround is
        # `enable_input_require_grads`; non-reentrant needs none).
        # (transformers 5 renamed the method and its argument; 4.x has only the old names.)
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adaptation == "lora":
        hf = _add_lora(hf, spec)
    elif adaptation == "prompt":
        hf = _add_prompt(hf, spec)
    elif adaptation == "freeze":
        _freeze(hf, spec.get("freeze") or [])
    elif spec.get("freeze"):
        raise ModelError("model.freeze lists layers to freeze, which only `adaptation: freeze` does; "
                         "`--set model.adaptation=freeze` or `--set model.freeze=[]`")
    return HFCausalLM(hf, spec)


def load_pretrained(spec: dict[str, Any], dtype: torch.dtype = torch.float32,
                    deepspeed_config: dict[str, Any] | None = None) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained` for `model.pretrained`, its errors said in spec terms."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load and save in every worker's log says nothing
    source, revision = _source(spec), spec.get("revision")
    trust = bool(spec.get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ModelError(
                f"model.pretrained {source!r} needs code of its own from the model's repository (trust_remote_code); "
                "Flotilla runs it only where the spec opts in: `--set model.trust_remote_code=true`, after reading that code"
            ) from None
        raise ModelError(f"model.pretrained {source!r}: {e}") from None
    except OSError as e:
        raise ModelError(_not_found(source, revision, e)) from None
    if torch.get_default_device().type == "meta":
        # The driver's check before training (`with torch.device("meta")`): the architecture from its
        # config, no weights read (from_pretrained refuses the meta device).
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust)
    keep_alive = None
    if deepspeed_config is not None and int(deepspeed_config.get("zero_optimization", {}).get("stage", 0)) == 3:
        from transformers.integrations import HfDeepSpeedConfig

        # transformers holds only a weak reference: the object must live through from_pretrained.
        keep_alive = HfDeepSpeedConfig(deepspeed_config)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, revision=revision, dtype=dtype,
                                                     trust_remote_code=trust)
    except OSError as e:
        raise ModelError(_not_found(source, revision, e)) from None
    finally:
        if keep_alive is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()  # later models in this process (a bundle check) build whole
    return model


def _source(spec: dict[str, Any]) -> str:
    source = spec.get("pretrained")
    if not source:
        raise ModelError("model.pretrained is empty; set a local directory or a hub id: `--set model.pretrained=...`")
    source = os.path.expanduser(resolve_pretrained(str(source)))
    looks_local = source.startswith(("/", "./", "../", "~")) or os.path.exists(source)
    if looks_local and not os.path.isdir(source):
        raise ModelError(f"model.pretrained {source!r} is not a directory here; point `--set model.pretrained=...` at "
                         "a directory written by save_pretrained (config.json, weights, tokenizer files), on storage "
                         "every node sees")
    if looks_local and not os.path.isfile(os.path.join(source, "config.json")):
        raise ModelError(f"model.pretrained {source!r} is a directory but not a loadable model: it has no config.json. "
                         "It needs the files save_pretrained writes (config.json, *.safetensors, tokenizer files)")
    return source


def _not_found(source: str, revision: str | None, error: Exception) -> str:
    where = f" at revision {revision!r}" if revision else ""
    if os.path.isdir(source):
        return (f"model.pretrained {source!r} is a directory but not a loadable model{where}: {error}. It needs the "
                "files save_pretrained writes (config.json, *.safetensors, tokenizer files)")
    return (f"model.pretrained {source!r}{where} is neither a local directory nor a hub model this machine has cached "
            "or can download. Download it where there is network (`hf download ...`) into storage every node sees, "
            "then `--set model.pretrained=/that/directory`")


def _add_lora(hf: nn.Module, spec: dict[str, Any]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = spec["lora"]
    targets = lora.get("target_modules") or DEFAULT_TARGET_MODULES.get(hf.config.model_type, "all-linear")
    config = LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), lora_dropout=float(lora["dropout"]),
                        target_modules=targets, task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():
            # peft 0.21 asks transformers 5 `is_gradient_checkpointing`, which warns that it is renamed
            # (peft's call, once per build); nothing a user can change.
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
            return get_peft_model(hf, config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        names = sorted({name.rsplit(".", 1)[-1] for name, m in hf.named_modules() if isinstance(m, nn.Linear)})
        raise ModelError(f"model.lora.target_modules {targets!r} matches no layer of {spec['pretrained']!r} ({e}); "
                         f"its Linear layers are named {', '.join(names)}: e.g. "
                         f"`--set model.lora.target_modules=[{','.join(names[:2])}]`") from None


def _add_prompt(hf: nn.Module, spec: dict[str, Any]) -> nn.Module:
    from peft import PromptTuningConfig, PromptTuningInit, get_peft_model

    tuning = {**PROMPT_DEFAULTS, **(spec.get("prompt_tuning") or {})}
    text = tuning.get("init_text")
    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=int(tuning["num_virtual_tokens"]),
                                prompt_tuning_init=PromptTuningInit.TEXT if text else PromptTuningInit.RANDOM,
                                prompt_tuning_init_text=text or None,
                                tokenizer_name_or_path=_source(spec) if text else None)
    embeddings = hf.get_input_embeddings().weight
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")  # (as in `_add_lora`)
        if text and hasattr(embeddings, "ds_id"):  # ZeRO-3: the text's embeddings are read from the whole table
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters([embeddings], modifier_rank=None))
        return get_peft_model(hf, config)


def _freeze(hf: nn.Module, prefixes: list[str]) -> None:
    if not prefixes:
        raise ModelError("`adaptation: freeze` needs the layers to freeze: `--set model.freeze=[model.embed_tokens]` "
                         "(parameter-name prefixes)")
    names = [name for name, _ in hf.named_parameters()]
    unmatched = [p for p in prefixes if not any(n.startswith(p) for n in names)]
    if unmatched:
        tops = sorted({".".join(n.split(".")[:2]) for n in names})
        raise ModelError(f"model.freeze {unmatched!r} matches no parameter; names start with: {', '.join(tops)}")
    for name, param in hf.named_parameters():
        if any(name.startswith(p) for p in prefixes):
            param.requires_grad_(False)


def trainable_parameters(model: nn.Module) -> int:
    """How many parameters the optimizer updates (for LoRA: the adapters only). Under ZeRO-3 a
    parameter's tensor is this rank's empty placeholder; its full size is `ds_numel`."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def adapter_state_dict(model: HFCausalLM) -> dict[str, torch.Tensor]:
    """The LoRA weights alone, under peft's names (what `adapter_model.safetensors` holds)."""
    from peft import get_peft_model_state_dict

    if not model.is_lora:
        raise ModelError("adapter_state_dict needs a LoRA model (`model.adaptation: lora`)")
    return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model.hf).items()}


def merge_into_base(model: HFCausalLM) -> nn.Module:
    """The transformers model with each LoRA update folded into its base weight (W + alpha/r * B A):
    the same function as the adapted model, as a plain model of the base architecture.

    For LoRA this changes `model` itself (peft's `merge_and_unload` replaces its LoRA layers):
    call it on a model built from the consolidated weights, or use `merged_state_dict`."""
    if not model.is_lora:
        return model.hf
    return model.hf.merge_and_unload()


def merged_state_dict(model: HFCausalLM) -> dict[str, torch.Tensor]:
    """`merge_into_base`'s weights under the base model's names, leaving `model` as it was (on a copy)."""
    return {k: v.detach().cpu() for k, v in merge_into_base(copy.deepcopy(model)).state_dict().items()}
