"""Fine-tuning a pretrained causal LM (`model.kind: hf_causal_lm`) with LoRA under ZeRO-3 on 2 workers,
served OpenAI-style.

Nothing is downloaded: the "pretrained" model is a tiny random-weight Llama with a tokenizer trained
on the spot (`flotilla.models._hf_tiny`), saved to a temporary directory that `model.pretrained`
points at. One run of the shipped configs/instruct_lora.yaml (the built-in arithmetic instructions)
loses a worker after its first checkpoint and resumes; then its bundle, adapter and registration are
checked against the model it trained, and the registered version answers a stock OpenAI client.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch

from flotilla.pipeline import run_training
from tests.services import free_port

from openai import UnprocessableEntityError

from ._helpers import (any_json, assert_leaving_clients_stop_generating, fuzz, instruct_spec, metric_steps, metric_sum,
                       metrics_text, mlflow_runs, published_body, store_uri, wait_for,
                       worker_killed_after_first_checkpoint)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class FineTuned:
    spec: object
    outcome: object
    store: Path
    killed: list[int]


@pytest.fixture(scope="module")
def finetuned(ray_cluster, tiny_llama, tmp_path_factory) -> FineTuned:
    """The LoRA run (ZeRO-3, fp32, 2 workers, 3 epochs) that loses a worker after its first checkpoint."""
    store = tmp_path_factory.mktemp("finetune")
    storage = store / "runs"
    spec = instruct_spec(store, tiny_llama, "train.zero_stage=3", "train.precision=fp32", "train.epochs=3",
                         "train.lr=0.01", "train.run_name=lora", "train.max_failures=1")
    with worker_killed_after_first_checkpoint(storage / "lora") as killed:
        outcome = run_training(spec)
    return FineTuned(spec, outcome, store, killed)


def test_lora_under_zero3_on_two_workers_learns_resumes_and_registers_the_adapter(finetuned, tiny_llama):
    outcome, killed, storage = finetuned.outcome, finetuned.killed, finetuned.store / "runs"
    # The adapters learned: validation loss fell every epoch, across the lost worker's restart,
    # which resumed from the epoch-1 checkpoint instead of starting over.
    history = outcome.history
    assert killed, "the test never killed a worker"
    assert [m["epoch"] for m in history] == [1, 2, 3]
    assert any("resumed_from_step" in m for m in history), "the run started over instead of resuming"
    losses = [m["val_loss"] for m in history]
    assert losses[2] < losses[1] < losses[0], losses
    final = outcome.metrics
    assert (final["zero_stage"], final["world_size"], final["precision"]) == (3, 2, "fp32")
    assert final["val_perplexity"] == pytest.approx(torch.tensor(final["val_loss"]).exp().item(), rel=1e-6)
    print(f"LoRA under ZeRO-3 on 2 workers: val_loss {' -> '.join(f'{x:.4f}' for x in losses)}")

    # The bundle: the adapter alone and its base pinned by content (no copy of the base), as
    # safetensors, JSON and text only; the consolidated ZeRO-3 partitions reproduce the engine's logits.
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    from flotilla.bundle import ADAPTER_DIR, load_hf_bundle

    bundle_dir = storage / "lora" / "bundle"
    files = {str(p.relative_to(bundle_dir)) for p in bundle_dir.rglob("*") if p.is_file()}
    assert {"tokenizer.json", f"{ADAPTER_DIR}/adapter_model.safetensors"} <= files and "config.json" not in files
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files), files
    assert all(f.endswith((".safetensors", ".json", ".jinja", ".md")) for f in files), files
    base = json.loads((bundle_dir / "model.json").read_text())["base"]
    assert Path(base["path"]) == Path(tiny_llama).resolve() and len(base["sha256"]) == 64
    from flotilla.bundle import load_bundle

    assert load_bundle(bundle_dir).metrics["bundle_check_max_abs_diff"] < 1e-5
    # The loaded bundle is the adapted model: the adapter on the base gives the same logits and
    # generates the same tokens, greedy and sampled with the same seed.
    bundle = load_hf_bundle(bundle_dir)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), bundle_dir / ADAPTER_DIR).eval()
    ids = torch.tensor([bundle.encode("What is 12 plus 7?", chat=True)])
    with torch.no_grad():
        assert (adapted(input_ids=ids).logits - bundle.model(input_ids=ids).logits).abs().max() < 1e-5
        for kwargs in (dict(do_sample=False), dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)):
            texts = []
            for model in (adapted, bundle.model):
                torch.manual_seed(0)
                texts.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                            min_new_tokens=10, **kwargs)[0, ids.shape[1]:].tolist())
            assert texts[0] == texts[1], kwargs

    # One MLflow run, every epoch once; the version is registered and, the first, champion.
    client, runs = mlflow_runs(outcome.tracking_uri, "instruct-lora")
    assert [(r.info.run_id, r.info.status) for r in runs] == [(outcome.mlflow_run_id, "FINISHED")]
    assert metric_steps(client, outcome.mlflow_run_id, "val_perplexity") == [1, 2, 3]
    r = outcome.registration
    assert (r.model_name, r.version, r.champion.after) == ("instruct-lora", "1", "1")
    assert r.gate.passed and "val_perplexity" in r.gate.summary()
    from flotilla.track import load_registered_bundle

    registered = load_registered_bundle(client, "instruct-lora", "1")
    prompt = "What is 3 times 4?"
    assert registered.generate(prompt, max_tokens=8, temperature=0, chat=True) == \
        bundle.generate(prompt, max_tokens=8, temperature=0, chat=True)
    # The version is the adapter: MLflow shows its base and its size, a fraction of a merged copy's.
    tags = client.get_model_version("instruct-lora", "1").tags
    assert tags["flotilla.form"] == "adapter" and tags["flotilla.base_sha256"] == base["sha256"], tags
    assert tags["flotilla.base"] == f"{tiny_llama} ({base['path']})", tags
    merged = finetuned.store / "merged"
    bundle.model.save_pretrained(merged)
    bundle.tokenizer.save_pretrained(merged)
    merged_bytes = sum(p.stat().st_size for p in merged.rglob("*") if p.is_file())
    adapter_bytes = int(tags["flotilla.bundle_bytes"])
    print(f"registered adapter version: {adapter_bytes} bytes (adapter weights {tags['flotilla.adapter_bytes']}); "
          f"a merged copy: {merged_bytes} bytes ({100 * adapter_bytes / merged_bytes:.1f} %)")
    assert adapter_bytes < merged_bytes * 0.2  # a 0.14M-parameter base: its tokenizer is most of the adapter's bundle


def test_the_registered_model_answers_a_stock_openai_client(finetuned, tiny_llama):
    import mlflow
    from mlflow import MlflowClient
    from openai import OpenAI, UnprocessableEntityError, NotFoundError
    from ray import serve

    from flotilla.bundle import load_hf_bundle
    from flotilla.serve import deploy, plan_deployment

    spec = instruct_spec(finetuned.store, tiny_llama, f"serve.port={free_port()}", "serve.replica.num_cpus=0.5",
                         "serve.max_new_tokens=60000", "serve.autoscaling.max_replicas=1", "serve.max_prompt_tokens=200")
    endpoint = deploy(plan_deployment(spec))
    try:
        assert endpoint.plan.kind == "chat"
        client = OpenAI(base_url=endpoint.url + "/v1", api_key="unused", max_retries=0)
        bundle = load_hf_bundle(finetuned.store / "runs" / "lora" / "bundle")
        question = [{"role": "user", "content": "What is 12 plus 7?"}]
        # Greedy: the endpoint's answer is the bundle's own generation, whole or streamed.
        expected = bundle.generate("What is 12 plus 7?", max_tokens=10, temperature=0, chat=True)
        answer = client.chat.completions.create(model="instruct-lora", messages=question, max_tokens=10, temperature=0)
        assert answer.choices[0].message.content == expected
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens <= 10
        chunks = list(client.chat.completions.create(model="instruct-lora", messages=question, max_tokens=10,
                                                     temperature=0, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert len(pieces) > 2 and "".join(pieces) == expected
        assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
        # Sampling with a seed repeats itself; a stop string ends the text before it.
        sampled = [client.completions.create(model="instruct-lora", prompt="What is 3 times 4?", max_tokens=12,
                                             temperature=1.0, top_p=0.9, seed=7).choices[0].text for _ in range(2)]
        assert sampled[0] == sampled[1]
        whole = client.completions.create(model="instruct-lora", prompt="What is 3 times 4?", max_tokens=12,
                                          temperature=0).choices[0].text
        assert len(whole) >= 4, repr(whole)
        stop = whole[2:4]
        cut = client.completions.create(model="instruct-lora", prompt="What is 3 times 4?", max_tokens=12,
                                        temperature=0, stop=[stop])
        assert cut.choices[0].text == whole[:whole.find(stop)] and cut.choices[0].finish_reason == "stop"
        assert [m.id for m in client.models.list()] == ["instruct-lora"]
        # Requests that arrive together decode together, each answered as it would be alone.
        asks = [(f"What is {a} plus {b}?", seed) for seed, (a, b) in enumerate([(3, 4), (12, 7), (25, 16), (8, 9),
                                                                              (40, 2), (6, 6)])]
        alone = [bundle.generate(q, max_tokens=10, temperature=seed % 2, seed=seed, chat=True) for q, seed in asks]

        def ask(q_seed):
            q, seed = q_seed
            answer = client.chat.completions.create(model="instruct-lora", messages=[{"role": "user", "content": q}],
                                                    max_tokens=10, temperature=seed % 2, seed=seed)
            return answer.choices[0].message.content

        def ask_streamed(q_seed):
            q, seed = q_seed
            chunks = client.chat.completions.create(model="instruct-lora", messages=[{"role": "user", "content": q}],
                                                    max_tokens=10, temperature=seed % 2, seed=seed, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        with ThreadPoolExecutor(len(asks)) as pool:
            for _ in range(3):
                assert list(pool.map(ask, asks)) == alone
                assert list(pool.map(ask_streamed, asks)) == alone  # streams that arrive together, too

        def shared():  # some batch held more than one request (Ray exports the histogram's buckets exactly)
            text = metrics_text()
            single = metric_sum(text, "ray_flotilla_batch_size_bucket", model="instruct-lora", le="1.0")
            return metric_sum(text, "ray_flotilla_batch_size_count", model="instruct-lora") > single

        wait_for(shared, 90, "a chat batch of more than one request in Ray's Prometheus export", interval_s=3)
        _one_request_never_fails_its_batch_mates(endpoint.url, expected)
        # What it cannot do is refused in OpenAI's error shape, naming the field.
        with pytest.raises(UnprocessableEntityError, match="only n=1 is supported"):
            client.chat.completions.create(model="instruct-lora", messages=question, n=2)
        with pytest.raises(UnprocessableEntityError, match=r"above this endpoint's limit of 60000 \(serve.max_new_tokens\)"):
            client.chat.completions.create(model="instruct-lora", messages=question, max_tokens=60001)
        with pytest.raises(UnprocessableEntityError, match=r"logit_bias: token 600 is not in this model's vocabulary"):
            client.chat.completions.create(model="instruct-lora", messages=question, logit_bias={"600": -100})
        _clients_that_leave_stop_their_generation(endpoint.url, bundle.tokenizer.eos_token_id)
        with pytest.raises(NotFoundError, match="not served here"):
            client.chat.completions.create(model="gpt-4o", messages=question)
        raw = requests.post(endpoint.url + "/v1/chat/completions", json={"model": "instruct-lora", "messages": []},
                            timeout=30)
        assert raw.status_code == 422 and raw.json()["error"]["param"] == "messages", raw.text
        assert raw.headers.get("X-Model-Version") is None

        _one_base_url_routes_by_model(endpoint, expected)
        _log_probabilities_are_the_models_own(client, endpoint.url, bundle, question)
        mlflow_client = MlflowClient(store_uri(finetuned.store))
        v1 = mlflow_client.get_model_version("instruct-lora", "1")
        mlflow.set_tracking_uri(store_uri(finetuned.store))

        # A canary split between v1 and v2 (the same weights, registered again): both answer, each
        # caller who names itself (`X-User-Id`) stays with one version.
        mlflow_client.create_model_version("instruct-lora", source=v1.source, run_id=v1.run_id, model_id=v1.model_id)
        split = instruct_spec(finetuned.store, tiny_llama, f"serve.port={endpoint.plan.serve.port}",
                              "serve.replica.num_cpus=0.5", "serve.traffic={'1': 50, '2': 50}")
        endpoint = deploy(plan_deployment(split))

        def version_of(user: str | None = None) -> str:
            raw = client.chat.completions.with_raw_response.create(
                model="instruct-lora", messages=question, max_tokens=10, temperature=0,
                extra_headers={"X-User-Id": user} if user else None)
            assert raw.parse().choices[0].message.content == expected
            return raw.headers["X-Model-Version"]

        assert {version_of() for _ in range(24)} == {"1", "2"}
        pinned = {user: {version_of(user) for _ in range(3)} for user in ("ada", "bob", "cy", "dee", "eve", "fay")}
        assert all(len(v) == 1 for v in pinned.values()), pinned

        # Shadow mode: v2 mirrors every answered request, after the caller has its answer; greedy
        # answers agree. (Deployed with a 2 s deadline, for below.)
        shadowed = instruct_spec(finetuned.store, tiny_llama, f"serve.port={endpoint.plan.serve.port}",
                                 "serve.replica.num_cpus=0.5", "serve.shadow.target='2'", "serve.shadow.percent=100",
                                 "serve.max_new_tokens=60000", "serve.request_timeout_s=2")
        endpoint = deploy(plan_deployment(shadowed))
        for _ in range(3):
            again = client.chat.completions.create(model="instruct-lora", messages=question, max_tokens=10,
                                                   temperature=0)
            assert again.choices[0].message.content == expected
        agreed = wait_for(lambda: metric_sum(metrics_text(), "ray_flotilla_shadow_requests_total", version="2",
                                             agree="yes") >= 3, 60, "three agreeing shadow generations", interval_s=2)
        assert agreed
        # Past serve.request_timeout_s a generation ends: a 504, or an error event that ends the stream.
        endless = {"model": "instruct-lora", "messages": question, "max_tokens": 60000,
                   "logit_bias": {str(bundle.tokenizer.eos_token_id): -100}}
        late = requests.post(endpoint.url + "/v1/chat/completions", json=endless, timeout=60)
        assert late.status_code == 504 and "(serve.request_timeout_s)" in late.json()["error"]["message"], late.text
        assert late.json()["error"]["type"] == "server_error"
        with requests.post(endpoint.url + "/v1/chat/completions", json={**endless, "stream": True}, stream=True,
                           timeout=60) as r:
            events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        assert r.status_code == 200 and len(events) > 10 and "[DONE]" not in events, events[-3:]
        error = json.loads(events[-1])["error"]
        assert error["type"] == "server_error" and "(serve.request_timeout_s)" in error["message"], error
    finally:
        serve.shutdown()


def _one_base_url_routes_by_model(endpoint, expected: str) -> None:
    """The OpenAI router at /v1, started by the first chat deploy, answers for the model as its own
    prefix does; a model served nowhere is OpenAI's 404. (More in the adapters test below.)"""
    from openai import NotFoundError, OpenAI

    base = f"http://127.0.0.1:{endpoint.plan.serve.port}/v1"
    assert any(base in note for note in endpoint.notes), endpoint.notes
    client = OpenAI(base_url=base, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["instruct-lora"]
    question = [{"role": "user", "content": "What is 12 plus 7?"}]
    raw = client.chat.completions.with_raw_response.create(model="instruct-lora", messages=question, max_tokens=10,
                                                           temperature=0)
    assert raw.parse().choices[0].message.content == expected and raw.headers["X-Model-Version"] == "1"
    with pytest.raises(NotFoundError, match="The model `gpt-4o` does not exist") as missing:
        client.chat.completions.create(model="gpt-4o", messages=question)
    error = missing.value.response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "models served: instruct-lora" in error["message"], error


def _register_adapter(store: Path, name: str, scale: float, tmp: Path, base_sha256: str | None = None,
                      version: str = "1") -> None:
    """instruct-lora v1's model with its LoRA updates scaled by `scale` (a different adapter on the
    same base, no training), registered as `name` `version`, champion; optionally claiming another base."""
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts
    from safetensors.torch import load_file, save_file

    client = MlflowClient(store_uri(store))
    v1 = client.get_model_version("instruct-lora", "1")
    model = Path(download_artifacts(artifact_uri=client.get_model_version_download_uri("instruct-lora", "1"),
                                    dst_path=str(tmp / name), tracking_uri=store_uri(store)))
    (weights,) = model.rglob("adapter_model.safetensors")
    save_file({k: v * scale if "lora_B" in k else v for k, v in load_file(weights).items()}, str(weights))
    tags = dict(v1.tags)
    if base_sha256 is not None:
        (meta_file,) = weights.parent.parent.glob("model.json")
        meta = json.loads(meta_file.read_text())
        meta["base"]["sha256"] = tags["flotilla.base_sha256"] = base_sha256
        meta_file.write_text(json.dumps(meta))
    if version == "1":
        client.create_registered_model(name)
    assert str(client.create_model_version(name, source=str(model), tags=tags).version) == version
    client.set_registered_model_alias(name, "champion", version)


def _log_probabilities_are_the_models_own(client, url: str, bundle, question) -> None:
    """`logprobs` and `echo` as OpenAI defines them and lm-evaluation-harness's `local-completions` uses
    them to score a text: each token's log-probability is the model's own (the bundle's logits here)."""
    text = "What is 12 plus 7? 12 plus 7 is 19."
    ids = bundle.encode(text)
    with torch.no_grad():
        logp = bundle.logits(torch.tensor([ids])).float().log_softmax(-1)[0]
    expected = [float(logp[i, t]) for i, t in enumerate(ids[1:])]
    # The prompt alone (max_tokens 0): its text, its tokens, each scored after the ones before it.
    scored = client.completions.create(model="instruct-lora", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == text and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == text and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) <= 2 and max(top.values()) >= chosen - 1e-6
               for top, chosen in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    # lm-evaluation-harness's own request body: token ids in a list of one, one token generated (greedy).
    raw = requests.post(url + "/v1/completions", json={"model": "instruct-lora", "prompt": [ids], "temperature": 0,
                                                       "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True},
                        timeout=60)
    assert raw.status_code == 200, raw.text
    listed = raw.json()["choices"][0]["logprobs"]
    assert len(listed["token_logprobs"]) == len(ids) + 1  # the last: the token generated (or the eos that ended it)
    assert listed["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert listed["token_logprobs"][-1] == pytest.approx(max(listed["top_logprobs"][-1].values()), abs=1e-6)
    # A chat answer's tokens, greedy: each the likeliest of its position's top 3.
    chat = client.chat.completions.create(model="instruct-lora", messages=question, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content and len(content) >= 1
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6)
        assert bytes(t.bytes).decode() == t.token
    with pytest.raises(UnprocessableEntityError, match="log-probabilities come with whole answers only"):
        client.chat.completions.create(model="instruct-lora", messages=question, logprobs=True, stream=True)


def test_many_adapters_share_one_replica_and_its_base(finetuned, tiny_llama, tmp_path):
    """`serve.adapters.max_per_replica`: one replica holds instruct-lora's base once and adapters of
    other registered models trained on it, loaded on first use (one registered after the deploy
    too) and evicted least recently used; requests for different adapters that arrive together
    decode together, each with exactly the tokens it gets alone; all behind the one /v1 base URL."""
    from openai import NotFoundError, OpenAI
    from ray import serve

    from flotilla.serve import deploy, plan_deployment

    store = finetuned.store
    _register_adapter(store, "adapter-b", 3.0, tmp_path)
    _register_adapter(store, "adapter-c", -2.0, tmp_path)
    spec = instruct_spec(store, tiny_llama, f"serve.port={free_port()}", "serve.replica.num_cpus=0.5",
                         "serve.autoscaling.max_replicas=1", "serve.adapters.max_per_replica=2",
                         "serve.max_new_tokens=60000")
    endpoint = deploy(plan_deployment(spec))
    try:
        port = endpoint.plan.serve.port
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        _register_adapter(store, "adapter-d", 0.5, tmp_path)  # after the deploy: served without a redeploy
        models = ["instruct-lora", "adapter-b", "adapter-c", "adapter-d"]
        listed = wait_for(lambda: sorted(m.id for m in client.models.list()) == sorted(models) or None, 30,
                          "every adapter of the base listed at /v1/models")
        assert listed
        question = [{"role": "user", "content": "What is 12 plus 7?"}]

        def ask(model_seed):
            model, seed = model_seed
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=question, max_tokens=8, temperature=seed % 2, seed=seed)
            answer = raw.parse()
            assert answer.model == model
            return answer.choices[0].message.content, raw.headers.get("X-Model-Name") or "instruct-lora"

        asks = [(m, seed) for m in models for seed in (0, 1, 3)]
        alone = [ask(a) for a in asks]
        assert [who for _, who in alone] == [m for m, _ in asks]
        # The adapters differ (else routing could not be told from their answers).
        assert len({text for (text, _), (m, seed) in zip(alone, asks) if seed == 1}) >= 3, alone
        with ThreadPoolExecutor(len(asks)) as pool:
            assert list(pool.map(ask, asks)) == alone  # four models on a replica that holds three: some reload
            # Three that fit, loaded: requests for them that arrive together decode in one batch.
            fit = [a for a in asks if a[0] != "adapter-d"]
            for model in ("adapter-b", "adapter-c"):
                ask((model, 0))
            for _ in range(3):
                assert list(pool.map(ask, fit)) == [alone[asks.index(a)] for a in fit]

        def mixed():  # a batch held requests for more than one adapter
            return metric_sum(metrics_text(), "ray_flotilla_batch_size_count", model="instruct-lora", version="mixed") > 0

        try:
            wait_for(mixed, 60, "a batch of several adapters in Ray's Prometheus export", interval_s=3)
        except AssertionError:
            print("\n".join(line for line in metrics_text().splitlines() if "flotilla_batch_size_count" in line))
            raise
        # At most 2 adapters besides its own version on the replica: the least recently used left.
        about = requests.get(endpoint.url + "/", timeout=30).json()
        assert about["adapters"]["max_per_replica"] == 2 and len(about["adapters"]["loaded"]) <= 2, about
        assert about["adapters"]["base"]["sha256"] == json.loads(
            (store / "runs" / "lora" / "bundle" / "model.json").read_text())["base"]["sha256"]
        for model in ("adapter-b", "adapter-c", "adapter-d", "adapter-b"):
            assert ask((model, 0)) == alone[asks.index((model, 0))]
        about = requests.get(endpoint.url + "/", timeout=30).json()
        assert sorted(about["adapters"]["loaded"]) == ["adapter-b", "adapter-d"], about
        # NAME follows its champion: a promotion reaches the replica without a redeploy.
        _register_adapter(store, "adapter-b", -1.0, tmp_path / "v2", version="2")
        moved = wait_for(lambda: client.chat.completions.with_raw_response.create(
            model="adapter-b", messages=question, max_tokens=8, temperature=0, seed=0).headers["X-Model-Version"] == "2",
            30, "adapter-b's new champion answering", interval_s=1)
        assert moved
        about = requests.get(endpoint.url + "/", timeout=30).json()
        assert len(about["adapters"]["loaded"]) <= 2 and "path" not in about["adapters"]["base"], about
        # A version by alias or number goes to the same replica; what is not there is refused.
        assert ask(("adapter-c/1", 0))[0] == alone[asks.index(("adapter-c", 0))][0]
        with pytest.raises(NotFoundError, match="The model `adapter-x` does not exist"):
            client.chat.completions.create(model="adapter-x", messages=question)
        r = requests.post(endpoint.url + "/v1/chat/completions", json={"model": "adapter-x@champion", "messages": question},
                          timeout=60)
        assert r.status_code == 404 and "no registered model, alias or version" in r.json()["error"]["message"], r.text
        # The router: streams and completions by model, OpenAI's model objects, its own refusals.
        base = f"http://127.0.0.1:{port}/v1"
        for model in ("adapter-c", "instruct-lora"):
            chunks = list(client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0,
                                                         seed=0, stream=True))
            assert {c.model for c in chunks} == {model}
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone[asks.index((model, 0))][0]
        completion = client.completions.create(model="adapter-b", prompt="What is 3 times 4?", max_tokens=6, temperature=0)
        assert completion.model == "adapter-b" and completion.choices[0].text
        assert client.models.retrieve("adapter-b").id == "adapter-b"
        with pytest.raises(NotFoundError):
            client.models.retrieve("gpt-4o")
        for body, says in ((b"{not json", "not valid JSON"), (b'{"messages": []}', "model: name the model")):
            r = requests.post(base + "/chat/completions", data=body, headers={"content-type": "application/json"},
                              timeout=30)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        # A client that leaves through the router stops its generation, as on the model's own route.
        eos = json.loads((store / "runs" / "lora" / "bundle" / "generation_config.json").read_text())["eos_token_id"]
        endless = {"model": "adapter-b", "messages": [{"role": "user", "content": "Tell me everything."}],
                   "temperature": 1.0, "seed": 5, "logit_bias": {str(eos): -100}, "max_tokens": 60000}
        assert_leaving_clients_stop_generating("instruct-lora", base + "/chat/completions", endless)
        _register_adapter(store, "elsewhere", 1.0, tmp_path, base_sha256="0" * 64)  # another base: not listed
        with pytest.raises(NotFoundError, match="The model `elsewhere` does not exist"):
            client.chat.completions.create(model="elsewhere", messages=question)
        r = requests.post(endpoint.url + "/v1/chat/completions", json={"model": "elsewhere", "messages": question},
                          timeout=60)
        assert r.status_code == 422 and "is an adapter for the base" in r.json()["error"]["message"], r.text
        assert "this replica holds" in r.json()["error"]["message"], r.text
        serve.delete("instruct-lora")  # a deleted app's models leave the list
        assert [m.id for m in client.models.list()] == []
    finally:
        serve.shutdown()


CHAT_FUZZ_CASES = 200  # per route: 400 for the endpoint (drawing from the chat schema is slow, ~15 ms a body)


def test_the_harness_judges_the_registered_model_through_its_endpoint(finetuned, tiny_llama, tmp_path):
    """`flotilla eval`: lm-evaluation-harness (`local-completions`) against the version, served for the
    duration; each task's score on the version (tag) and its run (metric), the results as an artifact.
    The multiple-choice score is the model's own: the choice it finds likeliest, from the bundle here."""
    from mlflow import MlflowClient
    from ray import serve

    from flotilla.bundle import load_hf_bundle
    from flotilla.evaluate import evaluate_model

    from ._helpers import ROOT

    # The shipped tasks on their first 12 questions each (four harness runs below).
    limit, tasks = 12, tmp_path / "arith"
    tasks.mkdir()
    for name in ("arith", "arith_gen"):
        (tasks / f"{name}.yaml").write_text((ROOT / "evals" / "arith" / f"{name}.yaml").read_text())
        rows = (ROOT / "evals" / "arith" / f"{name}.jsonl").read_text().splitlines()[:limit]
        (tasks / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    outcome = evaluate_model("instruct-lora/1", str(tasks), store_uri(finetuned.store),
                             overrides=["serve.replica.num_cpus=0.5"])
    print(outcome.describe())
    assert set(outcome.metrics) == {"eval.arith.acc", "eval.arith_gen.exact_match"}
    assert all(0 <= v <= 1 and round(v * limit, 6) == round(v * limit) for v in outcome.metrics.values())
    client = MlflowClient(store_uri(finetuned.store))
    version = client.get_model_version("instruct-lora", "1")
    assert {k: float(v) for k, v in version.tags.items() if k.startswith("eval.")} == \
        pytest.approx(outcome.metrics, abs=1e-5)
    assert client.get_run(version.run_id).data.metrics["eval.arith.acc"] == outcome.metrics["eval.arith.acc"]
    assert [a.path for a in client.list_artifacts(version.run_id, "eval")] == ["eval/arith+arith_gen.json"]
    assert not any(name.startswith("flotilla-eval-") for name in serve.status().applications)  # deleted after
    # The harness's choice per question: the likeliest answer after the chat-rendered question (its
    # trailing newline moved before the answer, as the harness encodes a pair), by the bundle here.
    bundle = load_hf_bundle(finetuned.store / "runs" / "lora" / "bundle")
    tok = bundle.tokenizer
    right = 0
    for line in (tasks / "arith.jsonl").read_text().splitlines()[:limit]:
        row = json.loads(line)
        context = tok.apply_chat_template([{"role": "user", "content": row["question"]}], tokenize=False,
                                          add_generation_prompt=True)
        stripped = context.rstrip()
        head = tok(stripped, add_special_tokens=False)["input_ids"]
        scores = []
        for choice in row["choices"]:
            whole = tok(stripped + context[len(stripped):] + choice, add_special_tokens=False)["input_ids"]
            logps, _ = bundle.score(whole)
            scores.append(sum(logps[len(head) - 1:]))
        right += int(max(range(3), key=scores.__getitem__) == row["answer"])
    assert outcome.metrics["eval.arith.acc"] == pytest.approx(right / limit)
    # A version whose gate waits for its scores (the same weights registered again), held to the
    # champion on the same tasks: it scores as the champion does, so it passes, and is promoted.
    v1 = client.get_model_version("instruct-lora", "1")
    waiting = client.create_model_version("instruct-lora", source=v1.source, run_id=v1.run_id,
                                          model_id=v1.model_id).version
    client.set_model_version_tag("instruct-lora", waiting, "flotilla.gate", "pending")
    sample = evaluate_model(f"instruct-lora/{waiting}", str(tasks), store_uri(finetuned.store), limit=4,
                            overrides=["serve.replica.num_cpus=0.5"])
    assert sample.gate is None and "--limit" in sample.note  # scored only
    judged = evaluate_model(f"instruct-lora/{waiting}", str(tasks), store_uri(finetuned.store),
                            overrides=["serve.replica.num_cpus=0.5", "track.gate.beat_champion=false"])
    print(judged.describe())
    # The gate it was registered under (its run's spec: beat_champion), not --set's: held to v1, every task.
    assert judged.gate.gate.verdict == "passed" and judged.gate.champion.after == str(waiting)
    summary = judged.gate.gate.summary()
    assert "eval.arith.acc" in summary and "eval.arith_gen.exact_match" in summary and "vs champion v1" in summary


def test_the_4bit_variant_passes_its_gate_keeps_the_cache_and_answers_the_chat_routes(finetuned, tiny_llama,
                                                                                       capsys, tmp_path):
    """`flotilla export` of the registered adapter version (merged into its base for the graph): the
    fp32 graph decodes exactly as torch does, the 4-bit one passes its perplexity gate in fewer than
    half the bytes, decodes a batch of prompts as it decodes each alone (its KV cache in and out of
    the graph, left padding masked), and a replica with `serve.runtime: onnx-int4` answers the stock
    OpenAI client with the variant's own tokens. Then `flotilla eval --runtime onnx-int4` judges it
    against torch on the harness's tasks."""
    from mlflow import MlflowClient
    from openai import OpenAI
    from ray import serve

    from flotilla.cli import main
    from flotilla.serve import deploy, plan_deployment
    from flotilla.track import load_registered_bundle, registered_variants

    uri = store_uri(finetuned.store)
    code = main(["export", "--model", "instruct-lora/1", "--tracking-uri", uri, "--set",
                 "export.variants=[onnx,onnx-int4]"])
    out = capsys.readouterr().out
    print(out)
    assert code == 0 and "onnx-int4" in out, out
    client = MlflowClient(uri)
    tags = client.get_model_version("instruct-lora", "1").tags
    for variant in ("onnx", "onnx-int4"):  # held-out perplexity within 2 % of torch's
        assert tags[f"flotilla.runtime.{variant}"].startswith("passed: val_perplexity"), tags

    torch_bundle = load_registered_bundle(client, "instruct-lora", "1")
    fp32 = load_registered_bundle(client, "instruct-lora", "1", runtime="onnx")
    int4 = load_registered_bundle(client, "instruct-lora", "1", runtime="onnx-int4")
    assert (fp32.runtime, int4.runtime) == ("onnx", "onnx-int4")
    records = registered_variants(client, "instruct-lora", "1")
    assert records["onnx-int4"]["bytes"] < 0.5 * records["onnx"]["bytes"], records
    questions = ["What is 12 plus 7?", "What is 3 times 4?", "Write the number forty-two in digits, please."]
    prompts = [torch_bundle.encode(q, chat=True) for q in questions]
    greedy = [dict(max_tokens=12, temperature=0.0)] * len(prompts)
    assert fp32.generate_ids_batch(prompts, greedy) == torch_bundle.generate_ids_batch(prompts, greedy)
    together = int4.generate_ids_batch(prompts, greedy)
    assert together == [list(int4.generate_ids(p, max_tokens=12, temperature=0.0)) for p in prompts]
    assert any(together)

    spec = instruct_spec(finetuned.store, tiny_llama, f"serve.port={free_port()}", "serve.replica.num_cpus=0.5",
                         "serve.autoscaling.max_replicas=1", "serve.runtime=onnx-int4", "serve.openai_router=false")
    endpoint = deploy(plan_deployment(spec))
    try:
        openai = OpenAI(base_url=endpoint.url + "/v1", api_key="unused", max_retries=0)
        expected = [int4.generate(q, max_tokens=12, temperature=0, chat=True) for q in questions]

        def ask(question: str):
            return openai.chat.completions.with_raw_response.create(
                model="instruct-lora", messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0)

        with ThreadPoolExecutor(len(questions)) as pool:
            answers = list(pool.map(ask, questions))
        assert [a.parse().choices[0].message.content for a in answers] == expected
        assert {a.headers["X-Model-Runtime"] for a in answers} == {"onnx-int4"}
    finally:
        serve.shutdown()

    # Its gate's second half: the harness scores the variant, then torch, on the same tasks (the shipped
    # ones' first 8 questions). Held to a bar no variant meets (better than torch by a whole point),
    # it fails: the record, the tag and serving say so.
    from flotilla.errors import ServeError
    from flotilla.evaluate import evaluate_model

    from ._helpers import ROOT

    tasks = tmp_path / "arith"
    tasks.mkdir()
    for name in ("arith", "arith_gen"):
        (tasks / f"{name}.yaml").write_text((ROOT / "evals" / "arith" / f"{name}.yaml").read_text())
        rows = (ROOT / "evals" / "arith" / f"{name}.jsonl").read_text().splitlines()[:8]
        (tasks / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    judged = evaluate_model("instruct-lora/1", str(tasks), uri, runtime="onnx-int4",
                            overrides=["serve.replica.num_cpus=0.5", "export.max_eval_drop=-1"])
    print(judged.describe())
    assert set(judged.metrics) == {"variant.onnx-int4.eval.arith.acc", "variant.onnx-int4.eval.arith_gen.exact_match"}
    record = registered_variants(client, "instruct-lora", "1")["onnx-int4"]
    assert record["parity_passed"] and not record["eval_passed"] and not record["passed"], record
    assert {k: v["variant"] for k, v in record["eval"].items()} == \
        {k.removeprefix("variant.onnx-int4."): v for k, v in judged.metrics.items()}
    tag = client.get_model_version("instruct-lora", "1").tags["flotilla.runtime.onnx-int4"]
    assert tag.startswith("failed: val_perplexity") and "eval FAILED: arith.acc" in tag, tag
    with pytest.raises(ServeError, match=r"its onnx-int4 variant failed its gate \(val_perplexity .* eval FAILED"):
        plan_deployment(spec)


def test_fuzzed_chat_requests_never_get_a_5xx(finetuned, tiny_llama):
    """Hypothesis draws bodies for both OpenAI routes from the schemas the chat app publishes
    (`hypothesis-jsonschema` over its `/openapi.json`), half of them naming the served model with a
    few tokens so that they generate, beside any JSON at all, raw bytes and wrong Content-Types;
    sent 8 at a time, so that they share batches. No answer is a 5xx, no stream ends with a server
    error, and the endpoint answers a valid request afterwards."""
    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema
    from ray import serve

    from flotilla.serve import deploy, plan_deployment

    spec = instruct_spec(finetuned.store, tiny_llama, f"serve.port={free_port()}", "serve.replica.num_cpus=0.5",
                         "serve.max_new_tokens=4", "serve.autoscaling.max_replicas=1", "serve.max_prompt_tokens=256")
    endpoint = deploy(plan_deployment(spec))
    try:
        served = {"model": st.just("instruct-lora"), "max_tokens": st.integers(1, 4) | st.none()}
        statuses, server_errors = {}, []
        for route in ("/v1/chat/completions", "/v1/completions"):
            published = from_schema(published_body(endpoint.url, route))
            bodies = published | published.flatmap(
                lambda b: st.fixed_dictionaries(served).map(lambda fix: {**b, **fix})) | any_json()
            statuses[route], errors = fuzz(endpoint.url + route, bodies, CHAT_FUZZ_CASES)
            server_errors += [(route, *e) for e in errors]
        print(f"fuzzed: { {k: dict(sorted(v.items())) for k, v in statuses.items()} }")
        assert not server_errors, server_errors[:5]
        assert sum(sum(c.values()) for c in statuses.values()) >= 3 * CHAT_FUZZ_CASES // 2, statuses  # (hypothesis may draw fewer)
        assert all(c[200] > 0 for c in statuses.values()), statuses  # valid bodies were drawn too
        answer = requests.post(endpoint.url + "/v1/completions", json={"model": "instruct-lora", "prompt": "Hi",
                                                                       "max_tokens": 2}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 2, answer.text
    finally:
        serve.shutdown()


def _one_request_never_fails_its_batch_mates(url: str, expected: str) -> None:
    """What once answered 500 to a whole batch (a seed past 64 bits, a temperature that turns the
    probabilities into NaN) or stalled it (stop strings of 250,000 characters), sent together with
    valid requests, whole and streamed: each bad one is a 4xx naming its field in OpenAI's shape,
    each valid one gets its text; a top_p that float32 rounds to 0 keeps the likeliest token."""
    question = [{"role": "user", "content": "What is 12 plus 7?"}]
    base = {"model": "instruct-lora", "messages": question, "max_tokens": 10}
    bad = [({"seed": 2**70}, "seed", "less than or equal to 9223372036854775807"),
           ({"temperature": 1e-300}, "temperature", "temperature of at least 0.01"),
           ({"stop": ["x" * 250_000] * 3}, "stop", "at most 256 characters"),
           ({"logit_bias": {str(i): 1 for i in range(1000)}}, "logit_bias", "at most 300 token ids"),
           ({"messages": [{"role": "user", "content": "seven " * 300}]}, "messages", "(serve.max_prompt_tokens)")]
    good = [{"temperature": 0}, {"temperature": 1.0, "top_p": 1e-300, "seed": 3}, {"temperature": 0, "stream": True},
            {"temperature": 1.0, "top_p": 1e-300, "stream": True}]

    def send(extra: dict) -> tuple[int, object]:
        r = requests.post(url + "/v1/chat/completions", json={**base, **extra}, timeout=120)
        if r.status_code != 200:
            return r.status_code, r.json()
        if not extra.get("stream"):
            return 200, r.json()["choices"][0]["message"]["content"]
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        return 200, "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                            if json.loads(e)["choices"])

    with ThreadPoolExecutor(len(bad) + len(good)) as pool:
        for _ in range(3):  # arriving together, they share batches
            answers = list(pool.map(send, [extra for extra, _, _ in bad] + good))
            for (status, body), (_, field, says) in zip(answers, bad):
                assert status == 422 and body["error"]["param"] == field and says in body["error"]["message"], body
                assert body["error"]["type"] == "invalid_request_error"
            assert answers[len(bad):] == [(200, expected)] * len(good), answers[len(bad):]
    # The framework's own errors speak OpenAI's shape too; a body without a Content-Type is a 415.
    nowhere = requests.get(url + "/v1/nowhere", timeout=30)
    assert nowhere.status_code == 404 and "no route /v1/models/instruct-lora/v1/nowhere" in nowhere.json()["error"]["message"], nowhere.text
    untyped = requests.post(url + "/v1/chat/completions", data=json.dumps(base), timeout=30)
    assert untyped.status_code == 415 and "Content-Type" in untyped.json()["error"]["message"], untyped.text


def _clients_that_leave_stop_their_generation(url: str, eos: int) -> None:
    """With the end of its turn banned (`logit_bias`), the model writes until `max_tokens`: 60000
    tokens are minutes of a core. A client that leaves, streaming or waiting for the whole text,
    stops its generation within a token."""
    body = {"model": "instruct-lora", "messages": [{"role": "user", "content": "Tell me everything."}],
            "temperature": 1.0, "seed": 5, "logit_bias": {str(eos): -100}}
    # The ban holds: a bounded request runs to its max_tokens.
    answer = requests.post(url + "/v1/chat/completions", json={**body, "max_tokens": 300}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["usage"]["completion_tokens"], answer.json()["choices"][0]["finish_reason"]) == (300, "length")
    assert_leaving_clients_stop_generating("instruct-lora", url + "/v1/chat/completions", {**body, "max_tokens": 60000})
