from pathlib import Path

import pytest

from flotilla.spec import (
    CustomModelSpec,
    DataSpec,
    GateSpec,
    GPTSpec,
    MLPSpec,
    RunSpec,
    TrackSpec,
    TrainSpec,
    apply_override,
    load_spec,
    validate_spec,
)
from flotilla.errors import SpecError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates_and_shows_its_command(path):
    spec = load_spec(path)
    assert isinstance(spec, RunSpec)
    first_lines = path.read_text().splitlines()[:4]
    assert any(f"--config configs/{path.name}" in line for line in first_lines), "config must start with its command"


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"digits.yaml", "pycode_gpt.yaml"}


def test_defaults_describe_every_field():
    for model in (RunSpec, DataSpec, MLPSpec, GPTSpec, CustomModelSpec, TrainSpec, TrackSpec, GateSpec):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_overrides_parse_yaml_values():
    spec = load_spec(None, ["train.lr=3e-4", "model.hidden=[256,128]", "train.zero_stage=3", "train.run_name=abc"])
    assert spec.train.lr == pytest.approx(3e-4)
    assert spec.model.hidden == [256, 128]
    assert spec.train.zero_stage == 3
    assert spec.train.run_name == "abc"


def test_override_switches_model_kind():
    spec = load_spec(None, ["model.kind=gpt", "data.source=pycode", "model.layers=2"])
    assert isinstance(spec.model, GPTSpec) and spec.model.layers == 2


def test_all_problems_reported_at_once_with_field_value_and_fix():
    with pytest.raises(SpecError) as err:
        validate_spec({"trian": {}, "train": {"lr": -1, "zero_stag": 2, "precision": "fp8"}, "model": {"hiden": [3]}})
    text = str(err.value)
    assert len(err.value.problems) == 5, text
    assert "`trian`: unknown key; did you mean `train`?" in text
    assert "`train.zero_stag`: unknown key; did you mean `train.zero_stage`?" in text
    assert "`model.hiden`: unknown key; did you mean `model.hidden`?" in text
    assert "`train.lr`: Input should be greater than 0 (got -1)" in text
    assert "`train.precision`" in text and "'fp8'" in text and "'bf16'" in text


def test_cross_field_rules_name_the_flags():
    with pytest.raises(SpecError, match=r"`model.heads` \(3\) must divide `model.width` \(128\); try `--set model.heads=4`"):
        load_spec(None, ["model.kind=gpt", "data.source=pycode", "model.heads=3"])
    with pytest.raises(SpecError, match="offload_params.*needs ZeRO stage 3: `--set train.zero_stage=3`"):
        load_spec(None, ["train.offload_params=cpu", "train.zero_stage=2"])
    with pytest.raises(SpecError, match="model.kind.*'transformer' is not a model kind"):
        load_spec(None, ["model.kind=transformer"])


def test_4bit_weights_are_a_variant_and_a_runtime_with_a_block_size_onnx_runtime_takes():
    spec = load_spec(ROOT / "configs" / "instruct_lora.yaml", ["export.variants=[onnx-int4]", "serve.runtime=onnx-int4"])
    assert (spec.export.variants, spec.serve.runtime, spec.export.int4_block_size) == (["onnx-int4"], "onnx-int4", 32)
    assert "onnx-int4" in load_spec(ROOT / "configs" / "instruct_lora.yaml", []).export.variants  # built by default
    with pytest.raises(SpecError, match=r"`export.int4_block_size`.*16, 32, 64, 128 or 256 \(got 48\)"):
        load_spec(ROOT / "configs" / "instruct_lora.yaml", ["export.int4_block_size=48"])
    with pytest.raises(SpecError, match=r"`export.variants.0`.*'onnx-int4' \(got 'onnx-int3'\)"):
        load_spec(ROOT / "configs" / "instruct_lora.yaml", ["export.variants=[onnx-int3]"])


def test_preference_tuning_says_what_it_needs():
    with pytest.raises(SpecError, match=r"`train.objective: dpo` tunes a pretrained language model .* `model.kind: mlp` "
                                        r"trains with `sft` only"):
        load_spec(None, ["train.objective=dpo"])
    with pytest.raises(SpecError, match=r"`model.adaptation: freeze` has no adapter to disable .* "
                                        r"`--set model.adaptation=lora`"):
        load_spec("configs/instruct_dpo.yaml", ["model.adaptation=freeze"])
    with pytest.raises(SpecError, match=r"`data.source: arith` has none: `--set data.source=arith-pairs`"):
        load_spec("configs/instruct_dpo.yaml", ["data.source=arith"])
    with pytest.raises(SpecError, match=r"`data.source: arith-pairs` holds preference pairs.*`--set train.objective=dpo`"):
        load_spec("configs/instruct_lora.yaml", ["data.source=arith-pairs"])
    with pytest.raises(SpecError, match=r"`train.dpo.beta`.*greater than 0"):
        load_spec("configs/instruct_dpo.yaml", ["train.dpo.beta=0"])
    with pytest.raises(SpecError, match=r"tests a harness score, which `flotilla eval` measures for language models"):
        load_spec(None, ["track.gate.require=[eval.arith.acc >= 0.5]"])
    spec = load_spec("configs/instruct_dpo.yaml", ["model.adaptation=prompt", "track.gate.require=[val_reward_margin > 0.1]"])
    assert (spec.train.objective, spec.train.dpo.beta, load_spec(None).train.dpo.beta) == ("dpo", 0.5, 0.1)


def test_missing_config_file_names_it(tmp_path):
    with pytest.raises(SpecError, match="nope.yaml' does not exist"):
        load_spec(tmp_path / "nope.yaml")


def test_malformed_override():
    with pytest.raises(SpecError, match="must look like `section.field=value`"):
        load_spec(None, ["train.lr"])
    raw = {"train": {"lr": 1}}
    with pytest.raises(ValueError, match="is a value, not a section"):
        apply_override(raw, "train.lr.x=3")


def test_docs_spec_reference_matches_the_code():
    from flotilla.spec import spec_reference_markdown

    page = (Path(__file__).parents[2] / "docs" / "spec-reference.md").read_text()
    assert page == spec_reference_markdown() + "\n", "regenerate with: flotilla config > docs/spec-reference.md"
    for section in ("**data**", "**train**", "**train.comm**", "**track.gate**", "**tune**", "**serve.batching**",
                    "**cost**"):
        assert section in page
    # Every "(section below)" has its section below.
    title, titles, nested = "", [], []
    for line in page.splitlines():
        if line.startswith("**"):
            title = line.strip("*").split(" (")[0]
            titles.append(title)
        elif "| (section below) |" in line:
            field = line.split("`")[1]
            nested.append(field if title == "top level" else f"{title}.{field}")
    assert "train.comm" in nested
    assert [n for n in nested if n not in titles and n.split(".")[-1] not in titles] == []


def test_shipped_files_name_the_tracking_store_where_it_is():
    """The default store is ./mlflow.db (MLflow's own default); `mlruns/mlflow.db` was an old location."""
    root = Path(__file__).parents[2]
    for path in [*CONFIGS, root / "serve_apps" / "config.yaml"]:
        assert "mlruns/mlflow.db" not in path.read_text(), f"{path} names the old store mlruns/mlflow.db"
    assert "./mlflow.db" in (root / "configs" / "digits.yaml").read_text()
    assert "sqlite:///mlflow.db" in (root / "serve_apps" / "config.yaml").read_text()


DIGITS = Path(__file__).parents[2] / "configs" / "digits.yaml"
SWEEP = Path(__file__).parents[2] / "configs" / "digits_sweep.yaml"


@pytest.mark.parametrize("override, field", [
    ("train.epochs=yes", "train.epochs"),          # YAML's `yes` is True, which pydantic took as 1
    ("train.zero_stage=true", "train.zero_stage"),  # a Literal[0, 1, 2, 3] took it too
    ("train.lr=on", "train.lr"),
    ("model.hidden=[yes, 64]", "model.hidden"),
    ("train.betas=[0.9, no]", "train.betas"),
    ("serve.traffic={champion: yes}", "serve.traffic"),
    ("data.columns={city: {fill_value: yes}}", "data.columns.city.fill_value"),
])
def test_a_boolean_is_never_a_number(override, field):
    with pytest.raises(SpecError) as err:
        load_spec(DIGITS, [override, "train.lr=-1" if field != "train.lr" else "train.seed=1"])
    problems = err.value.problems
    assert any(p.startswith(f"`{field}`: a number is needed, not a boolean (YAML reads yes/no") for p in problems), problems
    if field != "train.lr":
        assert "`train.lr`: Input should be greater than 0 (got -1)" in problems  # every problem at once
    assert load_spec(DIGITS, ["track.enabled=no", "train.epochs=3"]).track.enabled is False  # booleans stay booleans


def test_a_boolean_for_a_word_says_how_to_keep_the_word():
    with pytest.raises(SpecError, match=r"`data.cache`: .*\(got False\); YAML reads yes/no, on/off, true/false as "
                                        "booleans: quote such a word"):
        load_spec(DIGITS, ["data.cache=no"])


def test_set_overrides_one_search_space_entry():
    spec = load_spec(SWEEP, ["tune.space.train.lr={loguniform: [1e-4, 1e-2]}", "tune.space.train.epochs.choice=[2, 3]"])
    assert spec.tune.space == {
        "train.lr": {"loguniform": [1e-4, 1e-2]},          # replaced
        "model.hidden": {"choice": [[64], [128, 64]]},     # kept from the file
        "train.batch_size": {"choice": [16, 32, 64]},
        "train.epochs": {"choice": [2, 3]},                # added, its kind in the key
    }
    whole = load_spec(SWEEP, ["tune.space={train.lr: {uniform: [0.001, 0.01]}}"])
    assert list(whole.tune.space) == ["train.lr"]  # the whole space still replaces the whole space


def test_each_problem_of_a_sweep_spec_on_its_own_line():
    with pytest.raises(SpecError) as err:
        load_spec(SWEEP, ["tune.space={train.lr: {loguniform: [0, 1]}, train.epochs: {choice: []}, "
                          "model.hidden: {grid: [[8]]}}", "tune.search=optuna"])
    assert err.value.problems == [
        "`tune.space.train.lr`: loguniform needs low > 0 (got [0, 1])",
        "`tune.space.train.epochs`: choice needs a non-empty list (got [])",
        "`grid` entries (model.hidden) need `--set tune.search=random` or `grid`, not optuna",
    ]
    with pytest.raises(SpecError) as err:
        load_spec(SWEEP, ["tune.space={train.learning_rate: {choice: [0.1]}, model.hiden: {choice: [[8]]}, "
                          "train.epochs: {choice: [yes]}}"])
    problems = err.value.problems
    assert len(problems) == 3, problems
    assert problems[0].startswith("`tune.space.train.learning_rate` = 0.1: `train.learning_rate`: unknown key; "
                                  "did you mean `train.lr`?")
    assert problems[1].startswith("`tune.space.model.hiden` = [8]: `model.hiden`: unknown key; did you mean `model.hidden`?")
    assert problems[2].startswith("`tune.space.train.epochs` = True: `train.epochs`: a number is needed, not a boolean")


def test_learning_rate_suggests_lr():
    with pytest.raises(SpecError, match=r"`train.learning_rate`: unknown key; did you mean `train.lr`\?"):
        load_spec(DIGITS, ["train.learning_rate=3e-4"])
    with pytest.raises(SpecError, match=r"`model.n_heads`: unknown key; did you mean `model.heads`\?"):
        load_spec(Path(__file__).parents[2] / "configs" / "pycode_gpt.yaml", ["model.n_heads=2"])


def test_model_kinds_in_messages_come_from_the_code():
    from typing import get_args

    from flotilla.spec import ModelSpec

    kinds = [m.model_fields["kind"].default for m in get_args(get_args(ModelSpec)[0])]
    assert "hf_causal_lm" in kinds
    with pytest.raises(SpecError) as err:
        load_spec(DIGITS, ["model.kind=transformer"])
    assert f"`model.kind`: 'transformer' is not a model kind; allowed: {', '.join(kinds)}" in err.value.problems
    with pytest.raises(SpecError) as err:
        validate_spec({"model": {"kind": None}})
    assert f"allowed: {', '.join(kinds)}" in str(err.value)


def test_a_relative_pretrained_directory_is_made_absolute_for_the_workers(tmp_path, monkeypatch):
    from flotilla.spec import pretrained_made_absolute

    (tmp_path / "runs" / "sft" / "bundle").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    spec = load_spec(Path(__file__).parents[2] / "configs" / "instruct_dpo.yaml", ["model.pretrained=runs/sft/bundle"])
    assert pretrained_made_absolute(spec).model.pretrained == str(tmp_path.resolve() / "runs" / "sft" / "bundle")
    for kept in ("tiny-llama", "Qwen/Qwen2.5-0.5B", "/models/x"):  # a built-in, a hub id, an absolute path
        spec = load_spec(Path(__file__).parents[2] / "configs" / "instruct_dpo.yaml", [f"model.pretrained={kept}"])
        assert pretrained_made_absolute(spec).model.pretrained == kept
    assert pretrained_made_absolute(load_spec(None)).model == load_spec(None).model  # not a language model
