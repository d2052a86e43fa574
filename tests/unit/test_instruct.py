import pickle

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

pytest.importorskip("transformers")

from flotilla.data._instruct import IGNORE, INPUT_IDS, LABELS, TokenWindows, detect_format, load_tokenizer
from flotilla.errors import DataError


def answer_of(out, row, tok):
    """The text the loss is taken on in one output row."""
    labels = out[LABELS][row]
    return tok.decode(labels[labels != IGNORE])


def test_prompt_response_rows_take_the_loss_on_the_answer_only(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    windows = TokenWindows(tiny_llama, context=48)
    out = windows(pd.DataFrame({"prompt": ["Add 2 and 3.", "Say hi."], "response": ["5", "hi there"]}))
    assert out[INPUT_IDS].shape == out[LABELS].shape == (2, 48) and out[INPUT_IDS].dtype == np.int64
    # the chat template renders the pair; the answer and the tokens that end its turn are learned
    assert answer_of(out, 0, tok) == "5<|im_end|>\n"
    assert answer_of(out, 1, tok) == "hi there<|im_end|>\n"
    text = tok.decode(out[INPUT_IDS][0][out[LABELS][0] != IGNORE])
    assert text == "\n5<|im_end|>"  # shifted: the inputs that predict the answer start at the "\n" before it
    ids = out[INPUT_IDS][0]
    shown = np.flatnonzero(out[LABELS][0] != IGNORE)
    assert (out[LABELS][0][shown[:-1]] == ids[shown[:-1] + 1]).all()
    rendered = tok.apply_chat_template([{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}],
                                       tokenize=False)
    n = len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert (ids[n - 1:] == tok.pad_token_id).all() and (out[LABELS][0][n - 1:] == IGNORE).all()


def test_plain_prompt_response_ends_the_answer_with_eos(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    out = TokenWindows(tiny_llama, context=32, chat="plain")({"prompt": np.array(["Q: 1+1?\nA:"]),
                                                             "response": np.array([" 2"])})
    assert answer_of(out, 0, tok) == " 2<|im_end|>"
    assert tok.decode(out[INPUT_IDS][0][: len(tok("Q: 1+1?\nA: 2")["input_ids"])]).startswith("Q: 1+1?\nA:")


def test_chats_learn_every_assistant_turn_from_arrow_and_json_cells(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6"}]
    table = pa.table({"messages": [chat]})
    import json

    for batch in (table.to_pandas(), {"messages": table.column("messages").to_numpy(zero_copy_only=False)},
                  {"messages": np.array([json.dumps(chat)])}):
        out = TokenWindows(tiny_llama, context=64)(batch)
        assert answer_of(out, 0, tok) == "4<|im_end|>\n6<|im_end|>\n"


def test_text_is_packed_into_full_windows_with_every_token_learned(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    docs = ["import os\nprint(os.getcwd())\n" * 3, "def f(x):\n    return x * 2\n" * 4]
    stream = sum((tok(d)["input_ids"] + [tok.eos_token_id] for d in docs), [])
    out = TokenWindows(tiny_llama, context=16)(pd.DataFrame({"text": docs}))
    rows = -(-(len(stream) - 1) // 16)
    assert out[INPUT_IDS].shape == (rows, 16)
    assert (out[LABELS][:-1] != IGNORE).all()  # only the last window is padded
    # the windows overlap by one token: a window's last target is the next window's first input
    assert (out[LABELS][:-1, -1] == out[INPUT_IDS][1:, 0]).all()
    learned = np.concatenate([out[INPUT_IDS][:, :1].ravel()[:1], out[LABELS][out[LABELS] != IGNORE]])
    assert learned.tolist() == stream


def test_long_rows_are_cut_to_the_context_and_rows_with_no_answer_left_dropped(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    long_answer = "word " * 200
    out = TokenWindows(tiny_llama, context=24)(pd.DataFrame({"prompt": ["short", "x " * 200],
                                                            "response": [long_answer, "lost"]}))
    assert out[INPUT_IDS].shape == (1, 24)
    assert (out[LABELS][0][-5:] != IGNORE).all() and long_answer.startswith(answer_of(out, 0, tok))
    empty = TokenWindows(tiny_llama, context=8)(pd.DataFrame({"prompt": [], "response": []}))
    assert empty[INPUT_IDS].shape == (0, 8)


def test_the_transform_pickles_without_a_tokenizer(tiny_llama):
    windows = TokenWindows(tiny_llama, context=16)
    windows(pd.DataFrame({"text": ["warm the cache"]}))
    payload = pickle.dumps(windows)
    assert len(payload) < 500 and b"tokenizer" not in payload  # a path and numbers, loaded again where it runs
    again = pickle.loads(payload)
    assert (again(pd.DataFrame({"text": ["abc"]}))[INPUT_IDS] == windows(pd.DataFrame({"text": ["abc"]}))[INPUT_IDS]).all()


def test_formats_are_detected_and_bad_cells_named():
    assert detect_format(["messages", "id"]) == "messages"
    assert detect_format(["prompt", "response"]) == "prompt_response"
    assert detect_format(["text"]) == "text"
    with pytest.raises(DataError, match=r"columns a, b; .* needs `prompt` and `response`"):
        detect_format(["a", "b"])


def test_bad_messages_and_templates_say_what_to_change(tiny_llama, tmp_path):
    windows = TokenWindows(tiny_llama, context=16)
    with pytest.raises(DataError, match="must be a list of {role, content}"):
        windows({"messages": np.array([[{"who": "user"}]], dtype=object)})
    with pytest.raises(DataError, match="is a string but not JSON"):
        windows({"messages": np.array(["hello"])})
    tok = load_tokenizer(tiny_llama)
    rewriting = tmp_path / "rewriting"
    tok2 = type(tok).from_pretrained(tiny_llama)
    # a template that renders the last turn differently (as some 'thinking' templates do)
    tok2.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                          "{% if loop.last %}!{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok2.save_pretrained(rewriting)
    (rewriting / "config.json").write_text((__import__("pathlib").Path(tiny_llama) / "config.json").read_text())
    with pytest.raises(DataError, match="renders earlier turns differently"):
        TokenWindows(str(rewriting), context=32)({"messages": np.array([[
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]], dtype=object)})


def test_the_cache_estimate_counts_padded_token_windows():
    from flotilla.data._prepare import windows_bytes

    # 10,000 chat rows of ~200 bytes pad to 2,048 positions each: 328 MB of windows from 2 MB of
    # JSON, which no fixed expansion of the input size foresees.
    assert windows_bytes(10_000, 2_000_000, 2048, "messages") == 10_000 * 2048 * 16
    assert windows_bytes(10_000, 2_000_000, 2048, "prompt_response") == 10_000 * 2048 * 16
    # Packed text: at most one token per input byte, whatever the row count.
    assert windows_bytes(3, 2_000_000, 2048, "text") == 2_000_000 * 16


def test_preference_pairs_become_a_chosen_and_a_rejected_window(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    assert detect_format(["prompt", "chosen", "rejected", "id"]) == "preference"
    windows = TokenWindows(tiny_llama, context=48)
    chat_prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    import json

    out = windows(pd.DataFrame({
        "prompt": ["What is 2 plus 3?", json.dumps(chat_prompt), "x " * 60],
        "chosen": ["5", json.dumps([{"role": "assistant", "content": "4"}]), "cut off"],
        "rejected": ["6", "five", "cut off too"],
    }))
    # (pairs, 2, context): the third pair's prompt fills the window, so neither answer has a token left
    assert out[INPUT_IDS].shape == out[LABELS].shape == (2, 2, 48)
    flat = {k: v.reshape(4, 48) for k, v in out.items()}
    assert [answer_of(flat, i, tok) for i in range(4)] == ["5<|im_end|>\n", "6<|im_end|>\n", "4<|im_end|>\n",
                                                           "five<|im_end|>\n"]
    # the two windows of a pair share the prompt's tokens: only the answers differ
    same = out[INPUT_IDS][0, 0] == out[INPUT_IDS][0, 1]
    first_answer = np.flatnonzero(out[LABELS][0, 0] != IGNORE)[0]
    assert same[: first_answer + 1].all() and not same.all()
    system = tok.decode(out[INPUT_IDS][1, 0])
    assert system.startswith("<|im_start|>system\nBe brief.<|im_end|>")  # a chat prompt keeps its turns
    # plain prompts end each answer with eos, as prompt/response rows do
    plain = TokenWindows(tiny_llama, context=32, chat="plain")({"prompt": np.array(["Q: 1+1?\nA:"]),
                                                               "chosen": np.array([" 2"]), "rejected": np.array([" 3"])})
    flat = {k: v.reshape(2, 32) for k, v in plain.items()}
    assert [answer_of(flat, i, tok) for i in range(2)] == [" 2<|im_end|>", " 3<|im_end|>"]


def test_preference_data_and_the_objective_must_agree():
    from flotilla.data._prepare import _check_objective, windows_bytes
    from flotilla.spec import load_spec

    dpo = load_spec("configs/instruct_dpo.yaml", ["data.source=pairs.jsonl"])
    with pytest.raises(DataError, match=r"objective: dpo` learns from preference pairs, and 'chats.jsonl' has columns "
                                        r"messages: it needs `prompt`, `chosen` and `rejected`"):
        _check_objective(dpo, "messages", "chats.jsonl", ["messages"])
    sft = load_spec("configs/instruct_lora.yaml", ["data.source=pairs.jsonl"])
    with pytest.raises(DataError, match=r"'pairs.jsonl' holds preference pairs .*`--set train.objective=dpo`"):
        _check_objective(sft, "preference", "pairs.jsonl", ["prompt", "chosen", "rejected"])
    _check_objective(dpo, "preference", "pairs.jsonl", ["prompt", "chosen", "rejected"])
    assert windows_bytes(10, 0, 48, "preference") == 2 * windows_bytes(10, 0, 48, "prompt_response")


def test_a_chat_prompts_own_assistant_turns_take_no_loss_and_scalar_cells_are_text(tiny_llama):
    import json

    from flotilla.data._prepare import _turns_as_json

    tok = load_tokenizer(tiny_llama)
    earlier = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
               {"role": "user", "content": "and 3+3?"}]
    out = TokenWindows(tiny_llama, context=64)({"prompt": np.array([json.dumps(earlier)]),
                                               "chosen": np.array(["6"]), "rejected": np.array(["7"])})
    flat = {k: v.reshape(2, 64) for k, v in out.items()}
    assert [answer_of(flat, i, tok) for i in range(2)] == ["6<|im_end|>\n", "7<|im_end|>\n"]  # not "4" too
    # a prompt that leaves no room for the answer drops the pair, earlier assistant turns or not
    long = earlier[:2] + [{"role": "user", "content": "x " * 80}]
    cut = TokenWindows(tiny_llama, context=64)({"prompt": np.array([json.dumps(long)]), "chosen": np.array(["6"]),
                                               "rejected": np.array(["7"])})
    assert cut[INPUT_IDS].shape == (0, 2, 64)
    # cells as a CSV gives them: numbers become their text; an empty one is named
    frame = _turns_as_json(pd.DataFrame({"prompt": ["1+1?"], "chosen": [2], "rejected": [3.5]}),
                           ["prompt", "chosen", "rejected"])
    assert frame.iloc[0].tolist() == ["1+1?", "2", "3.5"]
    with pytest.raises(DataError, match="a `rejected` cell is empty"):
        _turns_as_json(pd.DataFrame({"prompt": ["a"], "chosen": ["b"], "rejected": [None]}), ["prompt", "chosen", "rejected"])
