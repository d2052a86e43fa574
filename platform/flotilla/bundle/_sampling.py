"""Choosing the next token from logits, the same for every language-model bundle: greedy or
sampled, top-k, nucleus (top-p), and OpenAI's `logit_bias`."""

from __future__ import annotations

import math

import torch


def sample_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> int:
    """The next token from one row of logits: greedy at temperature 0, else sampled (top-k first)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def logit_bias_tensors(logit_bias: dict[int, float] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`logit_bias` as the token ids and the biases `sample_next` adds to their logits."""
    if not logit_bias:
        return None
    return (torch.tensor(list(logit_bias), dtype=torch.long),
            torch.tensor(list(logit_bias.values()), dtype=torch.float32))


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float, generator,
            bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
    """One token from one position's logits, as `generate_ids` and `generate_ids_batch` both sample."""
    if bias is not None:
        logits = logits.index_add(0, *bias)
    if top_p < 1.0 and temperature > 0:
        logits = nucleus(logits / temperature, top_p) * temperature
    return sample_token(logits, temperature, top_k, generator)


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` with every token outside the nucleus (the most likely tokens whose probabilities
    first add up to `top_p`; at least one) set to -inf."""
    probs, order = torch.softmax(logits, -1).sort(descending=True)
    outside = probs.cumsum(-1) - probs >= top_p  # tokens whose predecessors already reach top_p
    outside[0] = False  # the most likely token stays, however small top_p (1e-300 is 0 in float32)
    return logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
