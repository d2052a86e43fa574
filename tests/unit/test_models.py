import json
import sys
import textwrap

import pytest
import torch

from flotilla.errors import ModelError
from flotilla.models import GPT, MLP, build_model, flops_per_token


def test_mlp_outputs_per_task():
    schema = {"task": "classification", "num_features": 5, "num_classes": 3}
    spec = {"kind": "mlp", "hidden": [8, 4], "dropout": 0.0, "activation": "gelu"}
    model = build_model(spec, schema)
    assert isinstance(model, MLP) and model(torch.zeros(2, 5)).shape == (2, 3)
    reg = build_model(spec, {**schema, "task": "regression"})
    assert reg(torch.zeros(2, 5)).shape == (2, 1)


def test_gpt_is_causal_and_checkpointing_keeps_gradients():
    spec = {"kind": "gpt", "layers": 2, "heads": 2, "width": 16, "context": 12, "dropout": 0.0,
            "activation_checkpointing": True}
    torch.manual_seed(0)
    model = build_model(spec, {"task": "lm", "vocab_size": 256, "context": 12})
    assert isinstance(model, GPT)
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    model.eval()
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :-1], b[0, :-1])  # earlier positions cannot see the last token
    assert not torch.allclose(a[0, -1], b[0, -1])
    model.train()
    plain = GPT(256, 12, 2, 2, 16, activation_checkpointing=False)
    plain.load_state_dict(model.state_dict())
    for m in (model, plain):
        m(tokens).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    n = sum(p.numel() for p in model.parameters())
    assert flops_per_token(spec, n) > 6 * n


def test_gpt_step_with_its_cache_gives_the_logits_of_the_whole_sequence():
    torch.manual_seed(0)
    model = GPT(256, 12, 2, 2, 16).eval()
    tokens = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        whole = model(tokens)
        cache = model.new_cache(batch=2)
        pieces = [model.step(tokens[:, :4], cache), model.step(tokens[:, 4:7], cache)]  # a prompt, then 3 at once
        pieces += [model.step(tokens[:, i:i + 1], cache) for i in range(7, 10)]  # then one at a time
        with pytest.raises(ValueError, match="10 cached \\+ 3 new tokens exceed the context of 12"):
            model.step(tokens[:, :3], cache)
    assert torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-5)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3},
                                      {"temperature": 0.7, "top_k": 20, "seed": 1}])
def test_cached_generation_writes_what_the_uncached_loop_writes(sampling):
    """Past the context too: 40 new tokens through a window of 12, which moves every 3 tokens."""
    from flotilla.bundle import InferenceBundle
    from flotilla.data import DataSchema

    torch.manual_seed(0)
    schema = DataSchema(task="lm", vocab_size=256, context=12, text_column="text")
    bundle = InferenceBundle(path=None, model=GPT(256, 12, 2, 2, 16).eval(), model_spec={}, schema=schema,
                             feature_steps=[], classes=None, metrics={})
    cached = bundle.generate("def main(", max_tokens=40, **sampling)
    assert cached == bundle.generate("def main(", max_tokens=40, cache=False, **sampling)
    assert len(cached) >= 10


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch
        def good(spec, schema):
            return torch.nn.Linear(schema["num_features"], spec["options"]["out"])
        def bad(spec, schema):
            return "not a module"
        def broken(spec, schema):
            raise KeyError("width")
        def planted(spec, schema):
            open(spec["options"]["marker"], "w").write("ran")
            return torch.nn.Linear(schema["num_features"], 1)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_models", None)


def test_user_factory(user_module):
    schema = {"task": "regression", "num_features": 4}
    model = build_model({"kind": "custom", "factory": "my_models:good", "options": {"out": 1}}, schema)
    assert model(torch.zeros(3, 4)).shape == (3, 1)
    with pytest.raises(ModelError, match="returned str, not a torch.nn.Module"):
        build_model({"kind": "custom", "factory": "my_models:bad", "options": {}}, schema)
    with pytest.raises(ModelError, match="has no callable 'nope'; it has: bad, broken, good, planted"):
        build_model({"kind": "custom", "factory": "my_models:nope", "options": {}}, schema)
    with pytest.raises(ModelError, match="cannot import 'no_such_pkg.mod' \\(No module named 'no_such_pkg'\\)"):
        build_model({"kind": "custom", "factory": "no_such_pkg.mod:f", "options": {}}, schema)
    with pytest.raises(ModelError, match="must look like `package.module:function`"):
        build_model({"kind": "custom", "factory": "my_models.good", "options": {}}, schema)
    with pytest.raises(ModelError, match="'my_models:broken' failed: KeyError"):
        build_model({"kind": "custom", "factory": "my_models:broken", "options": {}}, schema)


def test_the_data_schema_is_checked_where_it_is_read(tmp_path):
    """model.json's schema is validated on load: a bundle that lacks what its task needs says so."""
    import json

    from pydantic import ValidationError

    from flotilla.bundle import MODEL_JSON, load_bundle, write_bundle
    from flotilla.data import DataSchema
    from flotilla.errors import BundleError

    with pytest.raises(ValidationError, match="a classification schema needs classes, num_classes"):
        DataSchema(task="classification", feature_columns=["a"], label_column="y", num_features=1)
    schema = DataSchema(task="regression", feature_columns=["a", "b"], label_column="y", num_features=2)
    spec = {"kind": "mlp", "hidden": [4], "dropout": 0.0, "activation": "relu"}
    model = build_model(spec, schema)
    write_bundle(tmp_path, model.state_dict(), spec, schema, {"features": [], "label": None}, {"final": {}})
    assert load_bundle(tmp_path).schema == schema
    meta = json.loads((tmp_path / MODEL_JSON).read_text())
    del meta["schema"]["num_features"]
    (tmp_path / MODEL_JSON).write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="model.json has no valid data schema: .*needs num_features"):
        load_bundle(tmp_path)


def test_a_bundle_runs_no_factory_its_loader_does_not_allow(user_module, tmp_path):
    from flotilla.bundle import ALLOW_ON_COMMAND_LINE, load_bundle, write_bundle
    from flotilla.spec import load_spec
    from flotilla.data import DataSchema
    from flotilla.errors import BundleError

    schema = DataSchema(task="regression", feature_columns=["a", "b", "c", "d"], label_column="y", num_features=4)
    custom = {"kind": "custom", "factory": "my_models:good", "options": {"out": 1}}
    state = build_model(custom, schema).state_dict()
    bundle = write_bundle(tmp_path / "custom", state, custom, schema, {"features": [], "label": None}, {})
    # No factory runs unless the loader's caller lists it (serve.allow_factories, --allow-factory, the run's own spec).
    sys.modules.pop("my_models", None)
    with pytest.raises(BundleError, match=r"factory 'my_models:good'.*--set \"serve.allow_factories=\['my_models:good'\]\""):
        load_bundle(bundle)
    with pytest.raises(BundleError, match=r"factory 'my_models:good'.*loads only where its factory is allowed: "
                                          r"--allow-factory my_models:good$"):
        load_bundle(bundle, factories=["other:f"], allow_with=ALLOW_ON_COMMAND_LINE)
    assert "my_models" not in sys.modules  # refused before anything was imported
    assert load_bundle(bundle, factories=["my_models:good"]).model(torch.zeros(2, 4)).shape == (2, 1)
    own = load_spec(None, ["model.kind=custom", "model.factory=my_models:good", "model.options={out: 1}"])
    assert own.allowed_factories() == {"my_models:good"}  # the run that wrote it allows its own factory
    assert load_bundle(bundle, factories=own.allowed_factories()).model_spec["factory"] == "my_models:good"
    # model.json is checked with the spec's own model sections before anything is built.
    meta = json.loads((bundle / "model.json").read_text())
    for model, reason in [({**custom, "options": "lots"}, r"model.custom.options: Input should be a valid dictionary"),
                          ({"kind": "mlp", "hidden": "everything"}, r"model.mlp.hidden"),
                          ({"kind": "pickle"}, r"model: Input tag 'pickle' found using 'kind' does not match")]:
        (bundle / "model.json").write_text(json.dumps({**meta, "model": model}))
        with pytest.raises(BundleError, match=reason):
            load_bundle(bundle)


def test_a_factory_imports_from_the_working_directory_as_the_docs_say(tmp_path, monkeypatch):
    """The `flotilla` command is an installed script: the working directory is not on its path, yet
    the docs say to run it from the directory that holds the factory's module."""
    (tmp_path / "here_models.py").write_text("import torch\ndef build(spec, schema):\n    return torch.nn.Linear(4, 1)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), ".")])
    try:
        model = build_model({"kind": "custom", "factory": "here_models:build", "options": {}}, {"task": "regression"})
        assert model(torch.zeros(2, 4)).shape == (2, 1)
        assert sys.path[-1] == str(tmp_path)  # after the installed packages: a local file shadows none
    finally:
        sys.modules.pop("here_models", None)


def test_predict_and_export_run_no_factory_unless_allowed_on_the_command_line(user_module, tmp_path, capsys):
    """A model.json written into a bundle (or the registry) names code that loading would run:
    `flotilla predict` and `flotilla export` refuse it, run nothing, and name --allow-factory."""
    from flotilla.bundle import write_bundle
    from flotilla.cli import main
    from flotilla.data import DataSchema
    from flotilla.spec import load_spec, spec_to_yaml

    marker = tmp_path / "ran.txt"
    schema = DataSchema(task="regression", feature_columns=["a", "b", "c", "d"], label_column="y", num_features=4)
    custom = {"kind": "custom", "factory": "my_models:planted", "options": {"marker": str(marker)}}
    write_bundle(tmp_path / "run" / "bundle", torch.nn.Linear(4, 1).state_dict(), custom, schema,
                 {"features": [], "label": None}, {})
    spec = load_spec(None, ["model.kind=custom", "model.factory=my_models:planted", f"model.options={{marker: {marker}}}"])
    (tmp_path / "run" / "spec.yaml").write_text(spec_to_yaml(spec))  # the run's own record: data, not permission
    (tmp_path / "rows.csv").write_text("a,b,c,d\n1,2,3,4\n")
    sys.modules.pop("my_models", None)
    assert main(["predict", "--model", str(tmp_path / "run"), "--input", str(tmp_path / "rows.csv"),
                 "--output", str(tmp_path / "out")]) == 2
    assert main(["export", "--model", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("factory 'my_models:planted', code that loading it would run; a custom model loads only "
                     "where its factory is allowed: --allow-factory my_models:planted") == 2, err
    assert not marker.exists() and "my_models" not in sys.modules


def test_export_does_not_honour_trust_remote_code_from_a_recorded_spec(tmp_path, capsys):
    from flotilla.export import recorded_spec
    from flotilla.spec import load_spec, spec_to_yaml

    written = load_spec(None, ["model.kind=hf_causal_lm", "model.pretrained=tiny-llama", "model.trust_remote_code=true",
                               "data.source=arith"])
    assert written.model.trust_remote_code
    (tmp_path / "spec.yaml").write_text(spec_to_yaml(written))
    assert not recorded_spec(str(tmp_path / "spec.yaml"), []).model.trust_remote_code
    assert "sets model.trust_remote_code; a spec read back from a run is not trusted" in capsys.readouterr().err
    assert recorded_spec(str(tmp_path / "spec.yaml"), ["model.trust_remote_code=true"]).model.trust_remote_code


def test_generations_decoded_together_write_what_each_writes_alone():
    """Left-padded prompts of different lengths, different settings, one forward pass per token."""
    from flotilla.bundle import InferenceBundle
    from flotilla.data import DataSchema

    torch.manual_seed(0)
    schema = DataSchema(task="lm", vocab_size=256, context=48, text_column="text")
    bundle = InferenceBundle(path=None, model=GPT(256, 48, 2, 2, 16).eval(), model_spec={}, schema=schema,
                             feature_steps=[], classes=None, metrics={})
    requests = [{"prompt": "def main(", "max_tokens": 30, "temperature": 0.0},
                {"prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": 3},
                {"prompt": "import os, sys\n", "max_tokens": 25, "temperature": 0.7, "top_k": 20, "seed": 1}]
    alone = [bundle.generate(**r) for r in requests]
    assert bundle.generate_batch(requests) == alone
    calls = []
    step = bundle.model.step
    bundle.model.step = lambda *a, **k: calls.append(a[0].shape) or step(*a, **k)
    bundle.generate_batch(requests)
    assert calls[0] == (3, 15) and len(calls) == 30 and all(shape == (3, 1) for shape in calls[1:])
    # The MLflow pyfunc contract: a frame of prompts, one setting for all.
    import pandas as pd

    frame = bundle.predict_frame(pd.DataFrame({"prompt": ["def ", "x"]}), {"max_tokens": 10, "temperature": 0.9, "seed": 5})
    assert frame["text"].tolist() == [bundle.generate(p, max_tokens=10, temperature=0.9, seed=5) for p in ("def ", "x")]
    # Past the context together (15 + 40 > 48): one after the other, the same texts as alone.
    longer = [{**r, "max_tokens": 40} for r in requests]
    assert bundle.generate_batch(longer) == [bundle.generate(**r) for r in longer]
