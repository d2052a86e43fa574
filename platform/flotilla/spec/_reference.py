"""The spec reference (Markdown, for docs/spec-reference.md) and its JSON Schema, both generated
from the field descriptions: `flotilla config` and `flotilla config --schema` print them."""

from __future__ import annotations

import json

import yaml
from pydantic import BaseModel

from flotilla.spec._sections import (
    ColumnSpec,
    CommSpec,
    CostSpec,
    CustomModelSpec,
    DataSpec,
    DPOSpec,
    ExportSpec,
    GateSpec,
    GPTSpec,
    HFCausalLMSpec,
    LoraSpec,
    MLPSpec,
    PromptTuningSpec,
    RunSpec,
    TrackSpec,
    TrainSpec,
)
from flotilla.spec._serve import AdaptersSpec, AutoscalingSpec, BatchingSpec, ReplicaSpec, ServeSpec, ShadowSpec
from flotilla.spec._tune import TuneSpec


def spec_reference_markdown() -> str:
    """The run spec reference (docs/spec-reference.md): every section and field, its default and meaning."""
    sections = [
        ("top level", RunSpec, ["name"]),
        ("data", DataSpec, None),
        ("data.columns.<column>", ColumnSpec, None),
        ("model (kind: mlp)", MLPSpec, None),
        ("model (kind: gpt)", GPTSpec, None),
        ("model (kind: hf_causal_lm)", HFCausalLMSpec, None),
        ("model.lora", LoraSpec, None),
        ("model.prompt_tuning", PromptTuningSpec, None),
        ("model (kind: custom)", CustomModelSpec, None),
        ("train", TrainSpec, None),
        ("train.comm", CommSpec, None),
        ("train.dpo", DPOSpec, None),
        ("track", TrackSpec, None),
        ("track.gate", GateSpec, None),
        ("tune", TuneSpec, None),
        ("serve", ServeSpec, None),
        ("serve.shadow", ShadowSpec, None),
        ("serve.replica", ReplicaSpec, None),
        ("serve.autoscaling", AutoscalingSpec, None),
        ("serve.batching", BatchingSpec, None),
        ("serve.adapters", AdaptersSpec, None),
        ("export", ExportSpec, None),
        ("cost", CostSpec, None),
    ]
    lines = [
        "# Run spec reference",
        "",
        "Every section and field of a run spec, its default and meaning. Generated from the code by",
        "`flotilla config > docs/spec-reference.md` (a test keeps it in step); `flotilla config --schema`",
        "prints the same as a JSON Schema for editors. Override any field on the command line with",
        "`--set section.field=value` (the value is parsed as YAML).",
        "",
    ]
    for title, model, only in sections:
        lines += [f"**{title}**", "", "| field | default | meaning |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            if only is not None and name not in only:
                continue
            default = "required" if field.is_required() else field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                lines.append(f"| `{name}` | (section below) | {field.description} |")
                continue
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"| `{name}` | `{shown}` | {field.description} |")
        lines.append("")
    return "\n".join(lines)


def spec_json_schema() -> str:
    """The JSON Schema of a run spec file (editors complete and check YAML with it)."""
    schema = RunSpec.model_json_schema()
    schema["title"] = "Flotilla run spec"
    return json.dumps(schema, indent=2)
