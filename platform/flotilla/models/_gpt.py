"""A decoder-only transformer language model (GPT-2 style, pre-norm) over byte tokens.

Attention goes through `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`,
which picks a fused kernel where the device has one.

Generation runs `GPT.step`: the forward pass over new tokens only, given the keys and values of
the tokens before them (`KVCache`), into which it writes theirs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


# (keys, values) of new tokens -> (keys, values) of every token so far; (batch, heads, tokens, head width)
Extend = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class KVCache:
    """Every layer's keys and values for the tokens seen so far, in buffers sized to the context:
    a step writes its tokens' in place, with no copy of the earlier ones."""

    def __init__(self, layers: int, batch: int, heads: int, context: int, head_width: int, like: torch.Tensor):
        self.keys = like.new_zeros(layers, batch, heads, context, head_width)
        self.values = like.new_zeros(layers, batch, heads, context, head_width)
        self.length = 0

    def extend(self, layer: int, start: int) -> Extend:
        def extend(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            end = start + k.shape[2]
            self.keys[layer, :, :, start:end] = k
            self.values[layer, :, :, start:end] = v
            return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        return extend


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))

    def step(self, x: torch.Tensor, extend: Extend, pads: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` (eval) for tokens that follow those whose keys and values `extend` holds. A new
        token attends to every earlier one and to the new ones up to itself; with `pads` (batch,),
        not to the first `pads[i]` tokens of row i (left padding; a padding token sees itself)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        k, v = extend(k, v)
        if t == 1 and pads is None and not torch.compiler.is_exporting():  # a decode step sees
            # everything: no mask (an exported graph serves any number of new tokens: it keeps the mask)
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            past = k.shape[2] - t
            keys, queries = torch.arange(k.shape[2], device=x.device), torch.arange(past, past + t, device=x.device)
            seen = keys[None, :] <= queries[:, None]
            if pads is not None:
                seen = seen[None] & ((keys[None, None, :] >= pads[:, None, None]) | (keys[None, None, :] == queries[None, :, None]))
                seen = seen[:, None]  # (batch, 1, new tokens, tokens): one mask for every head
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def step(self, x: torch.Tensor, extend: Extend, pads: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn.step(self.ln1(x), extend, pads)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, context: int, layers: int, heads: int, width: int,
                 dropout: float = 0.0, activation_checkpointing: bool = False):
        super().__init__()
        self.context = context
        self.activation_checkpointing = activation_checkpointing
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))

    def new_cache(self, batch: int = 1) -> KVCache:
        """An empty cache for `batch` sequences of up to `context` tokens."""
        heads = self.blocks[0].attn.heads
        return KVCache(len(self.blocks), batch, heads, self.context, self.tok.embedding_dim // heads, self.head.weight)

    def step(self, tokens: torch.Tensor, cache: KVCache, pads: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens` (batch, new tokens) that follow the ones in `cache` (eval: no dropout),
        whose keys and values join the cache. Positions continue from the cache's length.

        Sequences of different lengths decode together left-padded: row i's first `pads[i]`
        tokens are padding, which nothing attends to and which positions do not count, so each
        row's logits are the ones it would get alone."""
        start, t = cache.length, tokens.shape[1]
        if start + t > self.context:
            raise ValueError(f"{start} cached + {t} new tokens exceed the context of {self.context}")
        logits = self.step_with(tokens, start, [cache.extend(i, start) for i in range(len(self.blocks))], pads)
        cache.length = start + t
        return logits

    def step_with(self, tokens: torch.Tensor, start: int, extends: list[Extend],
                  pads: torch.Tensor | None = None) -> torch.Tensor:
        """`step` with each layer's cache given as a function (`Extend`): the ONNX export passes
        ones that concatenate, so the graph takes and returns the cache as tensors."""
        t = tokens.shape[1]
        if pads is None:
            positions = self.pos.weight[start:start + t]
        else:
            positions = self.pos((torch.arange(start, start + t, device=tokens.device)[None, :] - pads[:, None]).clamp(min=0))
        x = self.tok(tokens) + positions
        for block, extend in zip(self.blocks, extends):
            x = block.step(x, extend, pads)
        return self.head(self.ln_f(x))


def build_gpt(spec: dict, schema: dict) -> GPT:
    return GPT(
        vocab_size=schema["vocab_size"],
        context=spec["context"],
        layers=spec["layers"],
        heads=spec["heads"],
        width=spec["width"],
        dropout=spec["dropout"],
        activation_checkpointing=spec["activation_checkpointing"],
    )


def flops_per_token(spec: dict, num_params: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12·L·T·d for attention scores.

    From the PaLM paper (Chowdhery et al. 2022), appendix B; activation checkpointing's
    recomputation is not counted, as is customary for model FLOPs utilization.

    A pretrained model (`hf_causal_lm`, whose layer sizes live in its own config) counts its weights
    only; with frozen weights (LoRA, `freeze`) the backward pass computes no gradient for them,
    which saves a third: 4N.
    """
    if spec.get("kind") == "hf_causal_lm":
        return (6 if spec.get("adaptation") == "full" else 4) * num_params
    return 6 * num_params + 12 * spec["layers"] * spec["context"] * spec["width"]
