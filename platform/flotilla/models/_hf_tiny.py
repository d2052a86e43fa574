"""A tiny pretrained-looking causal LM, built locally: a real architecture (Llama) with random
weights and a byte-level BPE tokenizer trained on the spot, saved as a Hugging Face directory.

    path = build_tiny_llama("/tmp/tiny-llama")
    AutoModelForCausalLM.from_pretrained(path)   # offline: nothing comes from a hub
    AutoTokenizer.from_pretrained(path)

Tests point `model.pretrained` at it (no test downloads weights), and so does a shipped config
on a machine that has no pretrained model. The tokenizer is trained on the source of a few
standard-library modules: text every Python has, so the same Python gives the same vocabulary.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
import tempfile
from pathlib import Path

from flotilla._cache import cache_dir

# `model.pretrained` names that Flotilla builds itself, on first use, under its cache directory:
# a model to try the fine-tuning path with where no pretrained model can be downloaded.
BUILTIN_MODELS = ("tiny-llama",)

# ChatML, the template Qwen and many fine-tunes use: `<|im_end|>` ends a turn (the eos token, so
# generation stops there) and a generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, turn end (eos)
CORPUS_MODULES = ("textwrap", "json.decoder", "string", "difflib", "shlex")


def _corpus() -> list[str]:
    return [inspect.getsource(importlib.import_module(name)) for name in CORPUS_MODULES]


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (every string encodes; none is unknown) with a chat template,
    eos `<|im_end|>` and pad `<|endoftext|>`, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the corpus or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(directory: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 128, vocab_size: int = 512, max_positions: int = 512, seed: int = 0) -> Path:
    """Write a random-weight Llama (~0.14M parameters at the defaults) and its tokenizer to
    `directory` with `save_pretrained`; return the directory."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out = Path(directory)
    tokenizer = build_tiny_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,  # grouped-query attention, as in Llama 2 70B and Llama 3
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,  # the tokenizer adds no bos; the chat template marks turns itself
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def resolve_pretrained(name: str) -> str:
    """Where `model.pretrained` loads from: a built-in name (`BUILTIN_MODELS`) becomes its directory
    under the cache (`$FLOTILLA_CACHE/models/`), built on first use by whichever process needs it
    first (the same Python builds the same model); anything else is returned as it is."""
    if name not in BUILTIN_MODELS:
        return name
    final = cache_dir() / "models" / name
    if (final / "config.json").exists():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build_tiny_llama(building)
        os.rename(building, final)  # atomic; another process that got there first wins
    except OSError:
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return str(final)
