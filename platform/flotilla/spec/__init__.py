"""The run spec: one YAML file describes one reproducible run.

    spec = load_spec("configs/digits.yaml", overrides=["train.lr=3e-4", "model.hidden=[256,128]"])

Validation happens before Ray starts and reports every problem at once; each line names the
field as `--set` writes it (`model.heads`), the bad value and what is allowed.
"""

from flotilla.spec._local import check_local_paths, pretrained_made_absolute
from flotilla.spec._load import (
    apply_override,
    load_spec,
    shipped_specs,
    spec_to_yaml,
    traffic_override,
    validate_spec,
)
from flotilla.spec._trial import trial_spec
from flotilla.spec._paths import set_path
from flotilla.spec._reference import spec_json_schema, spec_reference_markdown
from flotilla.spec._sections import (
    GATE_RULE,
    VARIANTS,
    ColumnSpec,
    CostSpec,
    CustomModelSpec,
    DataSpec,
    ExportSpec,
    CommSpec,
    DPOSpec,
    GateSpec,
    GPTSpec,
    HFCausalLMSpec,
    LoraSpec,
    MLPSpec,
    ModelSpec,
    RunSpec,
    TrackSpec,
    TrainSpec,
)
from flotilla.spec._serve import TARGET, AutoscalingSpec, BatchingSpec, ReplicaSpec, ServeSpec, ShadowSpec
from flotilla.spec._tune import SPACE_KINDS, TuneSpec, space_problems

__all__ = [
    "GATE_RULE",
    "SPACE_KINDS",
    "TARGET",
    "VARIANTS",
    "AutoscalingSpec",
    "BatchingSpec",
    "ColumnSpec",
    "CostSpec",
    "CustomModelSpec",
    "DataSpec",
    "ExportSpec",
    "GPTSpec",
    "CommSpec",
    "DPOSpec",
    "GateSpec",
    "HFCausalLMSpec",
    "LoraSpec",
    "MLPSpec",
    "ModelSpec",
    "ReplicaSpec",
    "RunSpec",
    "trial_spec",
    "ServeSpec",
    "ShadowSpec",
    "TrackSpec",
    "TrainSpec",
    "TuneSpec",
    "apply_override",
    "check_local_paths",
    "pretrained_made_absolute",
    "load_spec",
    "set_path",
    "shipped_specs",
    "space_problems",
    "spec_json_schema",
    "spec_reference_markdown",
    "spec_to_yaml",
    "traffic_override",
    "validate_spec",
]
