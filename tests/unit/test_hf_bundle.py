import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from flotilla.bundle import ADAPTER_DIR, load_hf_bundle, write_hf_bundle
from flotilla.errors import BundleError
from flotilla.models._hf import build_hf_causal_lm


def lora_spec(path, merge=True):
    return {"kind": "hf_causal_lm", "pretrained": path, "adaptation": "lora",
            "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": None, "merge": merge}}

SCHEMA = {"task": "lm", "vocab_size": 512, "context": 64, "row_format": "messages"}


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """A LoRA model with non-zero adapters, and its bundle written the way the loop will: from a
    fresh model loaded with the trained (consolidated) state dict; merged (`model.lora.merge`)."""
    torch.manual_seed(0)
    model = build_hf_causal_lm(lora_spec(tiny_llama)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    fresh = build_hf_causal_lm(lora_spec(tiny_llama))
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, strict=True)
    bundle = write_hf_bundle(tmp_path_factory.mktemp("bundle"), fresh, lora_spec(tiny_llama),
                             {"task": "lm", "vocab_size": 512, "context": 64, "tokenizer": tiny_llama,
                              "row_format": "messages"}, {"final": {"val_loss": 1.0}})
    return model, bundle


def test_the_bundle_holds_safetensors_json_and_text_only(trained):
    _, bundle = trained
    files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "model.json", "metrics.json", f"{ADAPTER_DIR}/adapter_model.safetensors",
            f"{ADAPTER_DIR}/adapter_config.json"} <= set(files)
    assert all(f.endswith((".safetensors", ".json", ".jinja", ".md")) for f in files), files  # nothing pickled
    assert (bundle / ADAPTER_DIR / "adapter_model.safetensors").stat().st_size < (bundle / "model.safetensors").stat().st_size / 10
    assert json.loads((bundle / "generation_config.json").read_text())["eos_token_id"] == 2  # <|im_end|>


def test_the_merged_bundle_generates_what_the_peft_model_generates(trained):
    model, bundle = trained
    loaded = load_hf_bundle(bundle)
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "def main():"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(model.spec["pretrained"]).eval()
        assert not torch.equal(plain(ids).logits, loaded.model(ids).logits)  # the adapters are in the weights
        assert (model(ids) - loaded.model(ids).logits).abs().max() < 1e-5
    settings = [dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=0, top_p=1.0),
                dict(do_sample=True, temperature=1.3, top_k=20, top_p=0.9)]
    sampled = []
    for kwargs in settings:
        for seed in (0, 1):
            outs = []
            for m in (model.hf, loaded.model):
                torch.manual_seed(seed)
                outs.append(m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                       min_new_tokens=12, **kwargs)[0, ids.shape[1]:].tolist())
            assert outs[0] == outs[1], (kwargs, seed)
            sampled.append(outs[0])
    assert len({tuple(s) for s in sampled[2:]}) == 4  # the seeds and settings did sample different texts
    # The bundle's own decoding (KV cache, one token per step) is transformers' greedy decoding, up to eos.
    greedy = list(loaded.generate_ids(ids[0].tolist(), max_tokens=12, temperature=0))
    with torch.no_grad():
        reference = model.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                      do_sample=False)[0, ids.shape[1]:].tolist()
    assert greedy == [t for t in reference[:len(greedy)]] and (len(greedy) == 12 or reference[len(greedy)] == 2)
    assert loaded.generate("def main():", max_tokens=12, temperature=0, chat=True) == \
        tok.decode(greedy, skip_special_tokens=True)
    # the adapter alone, loaded onto the base, is the same model again
    again = PeftModel.from_pretrained(plain, bundle / ADAPTER_DIR).eval()
    with torch.no_grad():
        assert (again(input_ids=ids).logits - model(ids)).abs().max() < 1e-6


def test_prompts_decoded_together_get_the_tokens_each_gets_alone(trained):
    """Left-padded rows of different lengths, greedy and sampled (with top_p), different max_tokens,
    one row ended from outside before its first token: each row's ids are those it decodes alone."""
    import threading

    _, bundle = trained
    loaded = load_hf_bundle(bundle)
    prompts = [loaded.encode(p, chat=True) for p in ("What is 12 plus 7?", "Hi", "Tell me a long story, please")]
    prompts.append(loaded.encode("def f(x):"))
    settings = [{"max_tokens": 12, "temperature": 0.0}, {"max_tokens": 5, "temperature": 1.0, "seed": 3},
                {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 1}, {"max_tokens": 9, "temperature": 1.0}]
    settings.append({"max_tokens": 10, "temperature": 0.0, "logit_bias": {2: -100.0, 300: 3.0}})
    prompts.append(prompts[0])
    alone = [list(loaded.generate_ids(p, **s)) for p, s in zip(prompts, settings)]
    ended = [threading.Event() for _ in prompts]
    ended[3].set()  # (the row without a seed: its client went away)
    together = loaded.generate_ids_batch(prompts, settings, ended)
    assert together[:3] == alone[:3] and together[3] == [] and together[4] == alone[4]
    assert len({len(p) for p in prompts[:4]}) == 4 and any(len(ids) > 1 for ids in alone)
    assert alone[4] != alone[0]  # the bias made a difference
    # A row that `on_token` ends stops there; the others go on.
    cut = loaded.generate_ids_batch(prompts[:3], settings[:3], on_token=lambda row, token: row == 0)
    assert cut == [alone[0][:1], *alone[1:3]]


def test_text_pieces_are_the_whole_decoded_text_each_from_a_few_tokens(tiny_llama):
    """Streamed pieces join into exactly what the tokenizer decodes from all the tokens, multi-byte
    characters split across byte-level tokens and bytes that never form one included, while each
    step decodes only the last few tokens (a token costs the same at the end of a long text)."""
    import random
    import textwrap

    from transformers import AutoTokenizer

    from flotilla.bundle import HFBundle

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    longest = []

    class Counting:  # the tokenizer, with the longest run of tokens it was asked to decode
        def decode(self, ids, **kwargs):
            longest.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    bundle = HFBundle(path=None, model=None, tokenizer=Counting(), model_spec={}, metrics={})
    text = open(textwrap.__file__).read() + " héllo wörld ✓ 日本語 🙂 " * 40
    ids = tokenizer(text)["input_ids"]
    pieces = list(bundle.text_pieces(iter(ids)))
    assert len(ids) > 3000 and "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces) and max(longest) <= 8, max(longest)
    rng = random.Random(0)
    noise = [rng.randrange(3, len(tokenizer)) for _ in range(2000)]  # with bytes that never form a character
    longest.clear()
    assert "".join(bundle.text_pieces(iter(noise))) == tokenizer.decode(noise, skip_special_tokens=True)
    assert "\ufffd" in tokenizer.decode(noise) and max(longest) < 100


def test_logit_bias_bans_or_forces_tokens(trained):
    """OpenAI's `logit_bias`: -100 bans a token (here the end of the turn: the text runs to
    max_tokens), 100 all but forces one; the same dict leaves other settings' sampling intact."""
    _, bundle = trained
    loaded = load_hf_bundle(bundle)
    prompt = loaded.encode("What is 12 plus 7?", chat=True)
    eos = loaded.tokenizer.eos_token_id
    greedy = list(loaded.generate_ids(prompt, max_tokens=40, temperature=0.0))
    first = greedy[0]
    banned = list(loaded.generate_ids(prompt, max_tokens=40, temperature=0.0, logit_bias={first: -100.0}))
    assert banned[0] != first
    forced = list(loaded.generate_ids(prompt, max_tokens=6, temperature=1.0, seed=1, logit_bias={300: 100}))
    assert forced == [300] * 6
    endless = list(loaded.generate_ids(prompt, max_tokens=200, temperature=1.0, seed=2, logit_bias={eos: -100.0}))
    assert len(endless) == 200 and eos not in endless


def test_stop_strings_end_rows_decoded_together_early_with_the_text_each_gets_alone(trained):
    """The chat endpoint's batched decoding: each request's text and token count are those it
    gets alone, and a row whose stop string has appeared stops decoding there."""
    from flotilla.serve._chat import _Generation, decode_together

    _, bundle = trained
    loaded = load_hf_bundle(bundle)
    eos = loaded.tokenizer.eos_token_id
    asks = [("What is 12 plus 7?", dict(temperature=0.0)), ("Hi", dict(temperature=1.0, seed=4)),
            ("Tell me a story", dict(temperature=0.9, top_p=0.9, seed=5))]

    def generations(stops):
        return [_Generation(loaded, loaded.encode(q, chat=True), 60, stops(i), logit_bias={eos: -100.0}, **s)
                for i, (q, s) in enumerate(asks)]

    whole = ["".join(g.pieces()) for g in generations(lambda i: None)]
    assert all(len(t) > 20 for t in whole), whole
    stops = [[whole[0][8:10]], [whole[1][12:14], "\u00e9\u00e9"], None]  # the third has none
    assert all(whole[i].find(stop[0]) > 0 for i, stop in enumerate(stops[:2]))
    alone = generations(lambda i: stops[i])
    texts_alone = ["".join(g.pieces()) for g in alone]
    together = generations(lambda i: stops[i])
    assert decode_together(loaded, together) == texts_alone
    assert texts_alone[:2] == [whole[i][:whole[i].find(stops[i][0])] for i in range(2)] and texts_alone[2] == whole[2]
    assert [g.completion_tokens for g in together] == [g.completion_tokens for g in alone]
    assert [g.finish for g in together] == ["stop", "stop", "length"]
    assert [len(g.decoded) for g in together[:2]] == [g.completion_tokens for g in alone[:2]]  # decoding ended there
    assert len(together[2].decoded) == 60

    # A row whose own settings fail is its error; its batch-mates get their texts.
    mixed = generations(lambda i: stops[i])
    mixed[1].settings["seed"] = 2**70
    answers = decode_together(loaded, mixed)
    assert isinstance(answers[1], ValueError) and [answers[0], answers[2]] == [texts_alone[0], texts_alone[2]]


def test_streams_decoded_together_get_each_token_as_it_is_decoded(trained):
    """The chat endpoint's batched streams: one forward pass per token for all rows, each row's
    pieces those it streams alone, short rows' streams complete while a long one still decodes,
    and a failed decoding raised in every stream still open."""
    import queue
    import threading

    from flotilla.serve._chat import _Generation, stream_together

    _, bundle = trained
    loaded = load_hf_bundle(bundle)
    eos = loaded.tokenizer.eos_token_id
    asks = [("What is 12 plus 7?", 6, dict(temperature=0.0)), ("Hi", 40, dict(temperature=1.0, seed=4)),
            ("Tell me a story", 1000, dict(temperature=0.9, top_p=0.9, seed=5, logit_bias={eos: -100.0}))]

    def generations(feed: bool = True):
        made = [_Generation(loaded, loaded.encode(q, chat=True), n, None, **s) for q, n, s in asks]
        for g in made:
            g.feed = queue.SimpleQueue() if feed else None
        return made

    alone = generations(feed=False)
    alone_pieces = [list(g.pieces()) for g in alone]
    forwards = []
    hook = loaded.model.register_forward_hook(lambda *_: forwards.append(1))
    together = generations()
    decoding = threading.Thread(target=stream_together, args=(loaded, together))
    decoding.start()
    streamed = [list(together[0].pieces()), list(together[1].pieces())]
    assert decoding.is_alive()  # the third row decodes on (its end of turn banned) while the others have ended
    streamed.append(list(together[2].pieces()))
    decoding.join(timeout=60)
    hook.remove()
    assert streamed == alone_pieces
    assert [(g.completion_tokens, g.finish) for g in together] == [(g.completion_tokens, g.finish) for g in alone]
    assert together[2].completion_tokens == 1000
    assert len(forwards) == 1000  # the prompts, then one pass per token after the first, for all three rows

    # A row whose own sampling fails (a bias for an id past the vocabulary, a seed torch cannot
    # take) ends with its error; its batch-mates stream what they stream alone.
    broken = generations()
    broken[1].settings["logit_bias"] = {10**6: 1.0}
    broken[2].max_tokens, broken[2].settings["seed"] = 30, 2**70
    broken.append(_Generation(loaded, together[2].ids, 30, None, **{**asks[2][2], "seed": 5}))
    broken[3].feed = queue.SimpleQueue()
    stream_together(loaded, broken)
    assert list(broken[0].pieces()) == alone_pieces[0]
    with pytest.raises(RuntimeError, match="decoding failed: IndexError"):
        list(broken[1].pieces())
    with pytest.raises(RuntimeError, match="decoding failed: ValueError"):
        list(broken[2].pieces())
    assert "".join(broken[3].pieces()) == "".join(_Generation(loaded, together[2].ids, 30, None,
                                                              **asks[2][2]).pieces())
    # A decoding that fails as a whole (a prompt id the model has no embedding for) ends every stream.
    whole = generations()
    whole[0].ids = [10**6]
    with pytest.raises(IndexError):
        stream_together(loaded, whole)
    for g in whole:
        with pytest.raises(RuntimeError, match="decoding the batch failed: IndexError"):
            list(g.pieces())
    # A stream alone decodes as `generate_ids` does (what whole-text requests alone get); a feed
    # that stays empty past the deadline ends the stream instead of waiting for ever.
    (single,) = generations()[2:]
    single.max_tokens = 30
    stream_together(loaded, [single])
    assert "".join(single.pieces()) == "".join(_Generation(loaded, single.ids, 30, None, **single.settings).pieces())
    (waiting,) = generations()[:1]
    waiting.token_wait_s = 0.2
    with pytest.raises(TimeoutError, match="no token within 0.2 s"):
        list(waiting.pieces())


def test_an_adapter_bundle_holds_the_adapter_and_a_pinned_base_and_loads_as_the_merged_one(trained, tiny_llama,
                                                                                            tmp_path):
    import shutil

    from flotilla.bundle import is_adapter_bundle, lineage_tags, weights_file

    model, merged = trained
    # The default for LoRA: the adapter alone and a reference to its base, pinned by content.
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    spec = lora_spec(str(base), merge=False)
    fresh = build_hf_causal_lm(spec)
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, strict=True)
    bundle = write_hf_bundle(tmp_path / "adapter", fresh, spec, {**SCHEMA, "tokenizer": str(base)}, {})
    files = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files) and "config.json" not in files
    assert {f"{ADAPTER_DIR}/adapter_model.safetensors", "generation_config.json", "tokenizer.json", "model.json"} <= files
    assert is_adapter_bundle(bundle) and not is_adapter_bundle(merged)
    assert weights_file(bundle) == bundle / ADAPTER_DIR / "adapter_model.safetensors"
    size = sum((bundle / f).stat().st_size for f in files)
    whole = sum(p.stat().st_size for p in merged.rglob("*") if p.is_file())
    tags = lineage_tags(bundle)
    assert tags["flotilla.form"] == "adapter" and tags["flotilla.bundle_bytes"] == str(size)
    assert tags["flotilla.base"] == f"{base} ({base.resolve()})" and len(tags["flotilla.base_sha256"]) == 64
    print(f"adapter bundle {size} bytes (adapter {tags['flotilla.adapter_bytes']}), merged bundle {whole} bytes")
    assert size < whole / 2
    # It loads as the merged bundle does: the same logits.
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    with torch.no_grad():
        assert torch.allclose(load_hf_bundle(bundle).model(ids).logits, load_hf_bundle(merged).model(ids).logits,
                              atol=1e-5)
    # A base that changed under it, or is gone, is refused, naming where it must be and the way out.
    weights = next(base.glob("*.safetensors"))
    kept = weights.read_bytes()
    weights.write_bytes(kept[:-4] + b"\x00\x00\x00\x00")
    with pytest.raises(BundleError, match=rf"a LoRA adapter for the base model .* at {base.resolve()} .*: {base.resolve()} "
                                          r"has SHA-256 .*model.lora.merge=true"):
        load_hf_bundle(bundle)
    shutil.rmtree(base)
    with pytest.raises(BundleError, match="it is not on this machine. Put that model at"):
        load_hf_bundle(bundle)


def test_adapters_on_one_base_decode_together_each_as_alone_and_leave_when_unused(trained, tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    from flotilla.bundle import AdapterSet

    model, merged = trained
    spec = lora_spec(tiny_llama, merge=False)
    fresh = build_hf_causal_lm(spec)
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, strict=True)
    first = write_hf_bundle(tmp_path / "a", fresh, spec, {**SCHEMA, "tokenizer": tiny_llama}, {})
    import shutil

    shutil.copytree(first, tmp_path / "b")
    weights = tmp_path / "b" / ADAPTER_DIR / "adapter_model.safetensors"
    save_file({k: -2 * v if "lora_B" in k else v for k, v in load_file(weights).items()}, str(weights))
    adapters = AdapterSet(first, "a")
    a, b = adapters.first, adapters.add(tmp_path / "b", "b")
    assert a.model is b.model  # one base in memory
    prompt = a.encode("def main():", chat=True)
    settings = [dict(max_tokens=12, temperature=0.0), dict(max_tokens=12, temperature=1.0, seed=3)]
    alone = {(bundle.adapter, i): list(bundle.generate_ids(prompt, **s))
             for bundle in (a, b) for i, s in enumerate(settings)}
    assert alone[("a", 1)] != alone[("b", 1)]
    # The adapter on the shared base generates what the merged bundle does.
    assert alone[("a", 0)] == list(load_hf_bundle(merged).generate_ids(prompt, **settings[0]))
    rows = [(bundle, i) for i in range(2) for bundle in (a, b, a)]
    together = a.generate_ids_batch([prompt] * len(rows), [{**settings[i], "adapter": bundle.adapter}
                                                           for bundle, i in rows])
    assert together == [alone[(bundle.adapter, i)] for bundle, i in rows]
    # Dropped while held: it stays until released; the base keeps at least one adapter.
    assert adapters.hold("b")
    adapters.drop("b")
    assert "b" in adapters.names and not adapters.hold("b")
    adapters.release("b")
    assert adapters.names == {"a"}
    adapters.drop("a")
    assert adapters.names == {"a"}
    with pytest.raises(BundleError, match="holds a whole model, not a LoRA adapter"):
        adapters.add(merged, "m")


def test_an_incomplete_bundle_or_one_with_its_own_code_is_refused(trained, tmp_path):
    _, bundle = trained
    with pytest.raises(BundleError, match=r"not a complete language-model bundle: missing config.json, "
                                          r"generation_config.json, model.json, metrics.json, model.safetensors"):
        load_hf_bundle(tmp_path)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.M"}}))
    with pytest.raises(BundleError, match="names code of its own"):
        load_hf_bundle(copy)


def test_prompt_tuning_trains_virtual_tokens_only_and_its_bundle_generates_as_peft_does(tiny_llama, tmp_path):
    from flotilla.bundle import is_adapter_bundle, lineage_tags
    from flotilla.data._instruct import IGNORE

    spec = {"kind": "hf_causal_lm", "pretrained": tiny_llama, "adaptation": "prompt",
            "prompt_tuning": {"num_virtual_tokens": 6, "init_text": None}}
    torch.manual_seed(0)
    model = build_hf_causal_lm(spec)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("prompt_encoder" in n for n in trainable), trainable
    ids = torch.randint(3, 500, (4, 12))
    assert model(ids).shape[:2] == (4, 12)  # the inputs' own logits, after the virtual tokens
    # A few steps on one batch: the loss falls, only the virtual tokens change.
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses  # (random tokens on a random model: little to learn)
    model.eval()
    fresh = build_hf_causal_lm(spec)
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, strict=True)
    bundle_dir = write_hf_bundle(tmp_path / "prompt", fresh, spec, {**SCHEMA, "tokenizer": tiny_llama}, {})
    assert is_adapter_bundle(bundle_dir) and lineage_tags(bundle_dir)["flotilla.adapter"] == "prompt"
    assert not (bundle_dir / "model.safetensors").exists()
    bundle = load_hf_bundle(bundle_dir)
    assert bundle.prefix is not None and bundle.prefix.shape[0] == 6
    with torch.no_grad():
        assert torch.allclose(bundle.logits(ids), model(ids), atol=1e-5)
        prompt = bundle.encode("def main():", chat=True)
        # Greedy: what the model with the virtual tokens first predicts, token by token, recomputing
        # the whole sequence each time (no cache): the bundle's cached decoding gives the same.
        seq, theirs = list(prompt), []
        for _ in range(10):
            token = int(model(torch.tensor([seq]))[0, -1].argmax())
            if token in bundle.stop_ids():
                break
            theirs.append(token)
            seq.append(token)
        assert list(bundle.generate_ids(prompt, max_tokens=10, temperature=0.0)) == theirs
    # Rows of different lengths decoded together: each the tokens it gets alone.
    prompts = [prompt, bundle.encode("Hi", chat=True), bundle.encode("What is 3 times 4? Tell me.", chat=True)]
    settings = [dict(max_tokens=8, temperature=0.0), dict(max_tokens=8, temperature=1.0, seed=2),
                dict(max_tokens=8, temperature=0.7, seed=5)]
    alone = [list(bundle.generate_ids(p, **s)) for p, s in zip(prompts, settings)]
    assert bundle.generate_ids_batch(prompts, settings) == alone
    from flotilla.bundle import AdapterSet

    with pytest.raises(BundleError, match="prompt tuning's virtual tokens, which a replica serves one version"):
        AdapterSet(bundle_dir, "p")
