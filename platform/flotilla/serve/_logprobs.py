"""OpenAI's log-probabilities of a finished generation, from one scoring pass over its prompt and
answer (`HFBundle.score`): each token's log-probability under the model's own distribution
(before temperature, top-p and biases, as vLLM reports them by default), and the likeliest tokens
at each position.

    logprobs, text = completion_logprobs(bundle, prompt_ids, answer_ids, ended_by, text, top=1, echo=True)
    content = chat_logprobs(bundle, prompt_ids, answer_ids, text, top=5)

A completion lists the prompt's tokens first with `echo` (the first has no log-probability), then
the answer's, then the end-of-text token that ended the answer, if one did: lm-evaluation-harness
scores a continuation as the prompt's tokens up to the last listed one.
"""

from __future__ import annotations

from typing import Any

from flotilla.bundle import TextDecoder
from flotilla.serve._openai import CompletionLogprobs, TokenLogprob, TopLogprob


def _scored(bundle, ids: list[int], top: int) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Per token of `ids`: its log-probability after the ones before it (None for the first), and the
    likeliest `top` there (None for the first; [] with `top` 0)."""
    if len(ids) < 2:
        return [None] * len(ids), [None] * len(ids)
    chosen, tops = bundle.score(ids, top)
    return [None, *chosen], [None, *(tops if tops is not None else [[] for _ in chosen])]


def _offsets(bundle, ids: list[int]) -> tuple[list[int], str]:
    """Where each token's text starts in the text of `ids` (as the server decodes it), and that text."""
    decoder, text, offsets = TextDecoder(bundle.tokenizer), "", []
    for token in ids:
        offsets.append(len(text))
        text += decoder.add(token)
    return offsets, text + decoder.rest()


def decoded_text(bundle, ids: list[int]) -> str:
    """The text of `ids` as the server decodes text (what `echo` puts before the answer)."""
    return _offsets(bundle, ids)[1]


def _token_text(bundle, token: int) -> str:
    return bundle.tokenizer.decode([token], skip_special_tokens=False)


def kept_answer(bundle, answer: list[int], text: str) -> list[int]:
    """The answer's tokens that a `text` cut short by a stop string holds: those that start before its end."""
    offsets, _ = _offsets(bundle, answer)
    return [t for t, at in zip(answer, offsets) if at < len(text)]


def completion_logprobs(bundle, prompt: list[int], answer: list[int], ended_by: list[int], text: str, top: int,
                        echo: bool, cut: bool = False) -> tuple[CompletionLogprobs, str]:
    """`choices[0].logprobs` of a completion, and its `text` (with `echo`, the prompt's text first).
    `cut`: a stop string ended `text` (the answer's tokens are those it holds)."""
    answer = kept_answer(bundle, answer, text) if cut else answer
    ids = prompt + answer + ([] if cut else ended_by[:1])
    logps, tops = _scored(bundle, ids, top)
    first = 0 if echo else len(prompt)
    prompt_offsets, prompt_text = _offsets(bundle, prompt) if echo else ([], "")
    answer_offsets, _ = _offsets(bundle, ids[len(prompt):])
    return CompletionLogprobs(
        tokens=[_token_text(bundle, t) for t in ids[first:]],
        token_logprobs=logps[first:],
        top_logprobs=[None if t is None else _top_dict(bundle, t) for t in tops[first:]],
        text_offset=prompt_offsets + [len(prompt_text) + at for at in answer_offsets],
    ), prompt_text + text


def _top_dict(bundle, tops: list[tuple[int, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for token, logp in tops:  # two tokens of one text: the likelier (listed first) stays
        out.setdefault(_token_text(bundle, token), logp)
    return out


def chat_logprobs(bundle, prompt: list[int], answer: list[int], text: str, top: int,
                  cut: bool = False) -> list[TokenLogprob]:
    """`choices[0].logprobs.content` of a chat completion: the answer's tokens."""
    answer = kept_answer(bundle, answer, text) if cut else answer
    logps, tops = _scored(bundle, prompt + answer, top)
    out = []
    for token, logp, best in zip(answer, logps[len(prompt):], tops[len(prompt):]):
        out.append(TokenLogprob(**_entry(bundle, token, logp),
                                top_logprobs=[TopLogprob(**_entry(bundle, t, lp)) for t, lp in best or []]))
    return out


def _entry(bundle, token: int, logp: float) -> dict[str, Any]:
    piece = _token_text(bundle, token)
    return {"token": piece, "logprob": logp, "bytes": list(piece.encode("utf-8"))}
