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
    for section in ("**data**", "**train**", "**track.gate**", "**tune**", "**serve.batching**", "**cost**"):
        assert section in page


def test_shipped_files_name_the_tracking_store_where_it_is():
    """The default store is ./mlflow.db (MLflow's own default); `mlruns/mlflow.db` was an old location."""
    root = Path(__file__).parents[2]
    for path in [*CONFIGS, root / "serve_apps" / "config.yaml"]:
        assert "mlruns/mlflow.db" not in path.read_text(), f"{path} names the old store mlruns/mlflow.db"
    assert "./mlflow.db" in (root / "configs" / "digits.yaml").read_text()
    assert "sqlite:///mlflow.db" in (root / "serve_apps" / "config.yaml").read_text()
