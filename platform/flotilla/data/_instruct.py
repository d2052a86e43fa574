"""Rows → token windows for a pretrained causal LM (`model.kind: hf_causal_lm`), with a loss mask.

Four row formats, told apart by their columns (`detect_format`):
    prompt, response   one instruction and its answer; loss on the answer (and the eos after it)
    messages           a chat: a list of {role, content}, rendered with the tokenizer's chat
                       template; loss on every assistant turn (with the tokens that end it)
    text               plain text, packed: documents joined by eos and cut into full windows;
                       loss on every token
    prompt, chosen,    a preference pair (`train.objective: dpo`): the prompt with each answer, as
    rejected           two windows of the prompt_response kind. The prompt may be a chat (a list
                       of {role, content}) and each answer a string or a list of assistant turns.

`TokenWindows` is a Ray Data batch function (`ds.map_batches(TokenWindows(...))`): a pandas
DataFrame or a dict of numpy arrays in, a dict of numpy arrays out, no Ray needed to call it.
It carries the pretrained directory (or hub id), not a tokenizer: each Ray Data worker loads the
tokenizer itself, once per process.

Output, every row exactly `context` long (fixed shapes batch without collation); preference rows
are (n, 2, context): the chosen answer's window, then the rejected one's:
    input_ids  int64 (n, context)   padded on the right with the pad token (eos where none)
    labels     int64 (n, context)   ALREADY SHIFTED: labels[t] is the token input_ids[t] must
                                    predict (input_ids[t + 1] of the unpadded row), or IGNORE
                                    (-100) where no loss is taken: prompt tokens, padding
No attention mask: the padding is on the right, and in a causal model no real token attends to
a later one. Never pass these labels to a Hugging Face model's own `labels=` argument, which
shifts them a second time; the loss is `cross_entropy(logits.flatten(0, 1), labels.flatten(),
ignore_index=IGNORE)`.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Iterable

import numpy as np
import pandas as pd

from flotilla.errors import DataError

INPUT_IDS, LABELS = "input_ids", "labels"
IGNORE = -100  # torch.nn.functional.cross_entropy's default ignore_index
FORMATS = ("prompt_response", "messages", "text", "preference")
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


def detect_format(columns: Iterable[str]) -> str:
    """The row format a set of columns holds: `messages`, then `prompt` + `chosen` + `rejected`, then
    `prompt` + `response`, then `text`."""
    columns = set(columns)
    if "messages" in columns:
        return "messages"
    if set(PREFERENCE_COLUMNS) <= columns:
        return "preference"
    if {"prompt", "response"} <= columns:
        return "prompt_response"
    if "text" in columns:
        return "text"
    raise DataError(f"the data has columns {', '.join(sorted(columns)) or '(none)'}; fine-tuning a pretrained "
                    "language model needs `prompt` and `response` (instructions), `messages` (chats: lists of "
                    "{role, content}), `text` (plain text), or `prompt`, `chosen` and `rejected` (preference pairs, "
                    "for `train.objective: dpo`)")


@functools.lru_cache(maxsize=4)
def load_tokenizer(pretrained: str, revision: str | None = None, trust_remote_code: bool = False):
    """The pretrained model's tokenizer, loaded once per process."""
    from transformers import AutoTokenizer

    # Imported here: the `flotilla.models` package loads torch, and `flotilla.data` is loaded by every
    # Ray Data worker that prepares a run's data, which needs no torch (~2.5 CPU-seconds each).
    from flotilla.models._hf_tiny import resolve_pretrained

    try:
        return AutoTokenizer.from_pretrained(resolve_pretrained(pretrained), revision=revision, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise DataError(f"cannot load the tokenizer of model.pretrained {pretrained!r}: {e}") from None


class TokenWindows:
    """A Ray Data batch function: rows of `fmt` (see `FORMATS`; `auto` decides per batch from the
    columns) → `input_ids` and shifted `labels`, each `context` tokens.

    `chat`: render `prompt`/`response` rows as a one-turn chat with the tokenizer's chat template
    (`auto`: when it has one), or as plain text, `prompt` then `response` and eos (what a
    completions request that sends the prompt alone continues). Instruction rows longer than
    `context + 1` tokens are cut at the end; a row cut before its first answer token is dropped
    (it has nothing to learn)."""

    def __init__(self, pretrained: str, context: int, fmt: str = "auto", *, revision: str | None = None,
                 trust_remote_code: bool = False, chat: str = "auto"):
        if fmt != "auto" and fmt not in FORMATS:
            raise DataError(f"unknown row format {fmt!r}; one of auto, {', '.join(FORMATS)}")
        self.pretrained, self.context, self.fmt, self.chat = pretrained, int(context), fmt, chat
        self.revision, self.trust_remote_code = revision, trust_remote_code

    @property
    def tokenizer(self):
        return load_tokenizer(self.pretrained, self.revision, self.trust_remote_code)

    def __call__(self, batch: pd.DataFrame | dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        fmt = self.fmt if self.fmt != "auto" else detect_format(batch.keys())
        if fmt == "text":
            rows = self._packed(_column(batch, "text"))
        elif fmt == "messages":
            rows = [self._chat(_messages(m)) for m in _column(batch, "messages")]
        elif fmt == "preference":
            return self._pairs(batch)
        else:
            pairs = zip(_column(batch, "prompt"), _column(batch, "response"))
            if self._use_chat():
                rows = [self._chat([{"role": "user", "content": str(p)}, {"role": "assistant", "content": str(r)}])
                        for p, r in pairs]
            else:
                rows = [self._plain(str(p), str(r)) for p, r in pairs]
        return self._pad([row for row in rows if row is not None])

    # ------------------------------------------------------------------ formats
    def _pairs(self, batch: pd.DataFrame | dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Preference rows → (n, 2, context) windows: [chosen, rejected]. A pair either of whose windows
        has no answer token left after the cut is dropped (there is nothing to compare)."""
        rows = []
        for prompt, *answers in zip(*(_column(batch, name) for name in PREFERENCE_COLUMNS)):
            pair = [self._answered(prompt, answer) for answer in answers]
            if None not in pair:
                rows += pair
        out = self._pad(rows)
        return {k: v.reshape(-1, 2, self.context) for k, v in out.items()}

    def _answered(self, prompt: Any, answer: Any) -> tuple[list[int], list[bool]] | None:
        """One prompt and one answer as a window, loss on the answer: a chat (`prompt` a list of turns, or
        the tokenizer's template in use) or plain text."""
        turns, reply = _turns(prompt), _turns(answer)
        if turns is None and reply is None and not self._use_chat():
            return self._plain(str(prompt), str(answer))
        turns = turns if turns is not None else [{"role": "user", "content": str(prompt)}]
        reply = reply if reply is not None else [{"role": "assistant", "content": str(answer)}]
        return self._chat(turns + reply, answer_from=len(turns))  # (a chat prompt's own assistant turns: no loss)

    def _use_chat(self) -> bool:
        if self.chat == "auto":
            return bool(self.tokenizer.chat_template)
        if self.chat == "chat" and not self.tokenizer.chat_template:
            raise DataError(f"the tokenizer of {self.pretrained!r} has no chat template to render prompts with")
        return self.chat == "chat"

    def _plain(self, prompt: str, response: str) -> tuple[list[int], list[bool]] | None:
        tok = self.tokenizer
        # Tokenized apart, as serving tokenizes a prompt alone before continuing it.
        head = tok(prompt)["input_ids"]
        tail = tok(response, add_special_tokens=False)["input_ids"] + [self._eos()]
        return self._cut(head + tail, [False] * len(head) + [True] * len(tail))

    def _chat(self, messages: list[dict[str, str]], answer_from: int = 0) -> tuple[list[int], list[bool]] | None:
        """`messages` rendered with the chat template; loss on the assistant turns from `answer_from` on."""
        tok = self.tokenizer
        if not tok.chat_template:
            raise DataError(f"`messages` rows need a chat template, and the tokenizer of {self.pretrained!r} has "
                            "none; give the rows as `prompt`/`response` or `text` instead")
        text = tok.apply_chat_template(messages, tokenize=False)
        spans = []  # character ranges of the assistant turns in `text`
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < answer_from:
                continue
            before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            through = tok.apply_chat_template(messages[: i + 1], tokenize=False)
            # The turn is what rendering it adds to the conversation before it (with the generation
            # prompt). That needs a template whose rendering of a conversation begins with its
            # rendering of every shorter one; templates that rewrite earlier turns do not.
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(f"the chat template of {self.pretrained!r} renders earlier turns differently once "
                                "later ones follow, so the assistant's tokens cannot be located for the loss mask; "
                                "give the rows as `prompt`/`response`")
            spans.append((len(before), len(through)))
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)  # the template has its specials
        mask = [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]
        return self._cut(encoded["input_ids"], mask)

    def _packed(self, texts: Iterable[Any]) -> list[tuple[list[int], list[bool]]]:
        tok, eos = self.tokenizer, self._eos()
        stream: list[int] = []
        for text in texts:
            stream += tok(str(text))["input_ids"] + [eos]
        width = self.context + 1  # a window's inputs and its shifted targets; windows overlap by one
        rows = []
        for start in range(0, max(len(stream) - 1, 0), self.context):
            piece = stream[start : start + width]
            rows.append((piece, [True] * len(piece)))  # the last, shorter piece is padded, not dropped
        return rows

    # ------------------------------------------------------------------ shapes
    def _cut(self, ids: list[int], mask: list[bool]) -> tuple[list[int], list[bool]] | None:
        ids, mask = ids[: self.context + 1], mask[: self.context + 1]
        return (ids, mask) if any(mask[1:]) else None

    def _pad(self, rows: list[tuple[list[int], list[bool]]]) -> dict[str, np.ndarray]:
        pad = self.tokenizer.pad_token_id
        inputs = np.full((len(rows), self.context), self._eos() if pad is None else pad, dtype=np.int64)
        labels = np.full((len(rows), self.context), IGNORE, dtype=np.int64)
        for i, (ids, mask) in enumerate(rows):
            n = len(ids) - 1
            inputs[i, :n] = ids[:-1]
            targets = np.asarray(ids[1:], dtype=np.int64)
            labels[i, :n] = np.where(np.asarray(mask[1:], dtype=bool), targets, IGNORE)
        return {INPUT_IDS: inputs, LABELS: labels}

    def _eos(self) -> int:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise DataError(f"the tokenizer of {self.pretrained!r} has no eos token to end responses and documents with")
        return eos


def _column(batch: pd.DataFrame | dict[str, np.ndarray], name: str) -> list[Any]:
    if name not in batch:
        raise DataError(f"the rows have no `{name}` column; they have {', '.join(map(str, batch.keys()))}")
    return list(batch[name])


def _turns(value: Any) -> list[dict[str, str]] | None:
    """A preference cell as chat turns when it is one (a list of {role, content}, or that as JSON text),
    else None: plain text."""
    text = isinstance(value, str)
    if text:
        if not value.lstrip().startswith("["):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    try:
        return _messages(value)
    except DataError:
        if text:  # text that only looks like JSON
            return None
        raise


def _messages(value: Any) -> list[dict[str, str]]:
    """One `messages` cell as a list of {role, content}: from Python lists, Arrow's list of structs
    (numpy arrays of dicts) or a JSON string (a CSV cell)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"a `messages` cell is a string but not JSON: {value[:80]!r}") from None
    try:
        out = [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    except (TypeError, KeyError):
        raise DataError(f"a `messages` cell must be a list of {{role, content}}; got {str(value)[:120]!r}") from None
    if not out:
        raise DataError("a `messages` cell is an empty list; a chat needs at least one assistant turn")
    return out
