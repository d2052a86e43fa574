"""Sweep specs and search spaces, without Ray: validation, Tune domains, trial specs, slots."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.spec import load_spec
from flotilla.errors import SpecError
from flotilla.tune import (SweepOutcome, TrialRow, concurrent_slots, largest_trial, metric_and_mode, trial_resources,
                           trial_spec, tune_domains)

SWEEP = Path(__file__).parents[2] / "configs" / "digits_sweep.yaml"


def _sweep(*overrides: str):
    return load_spec(SWEEP, list(overrides))


def test_shipped_sweep_converts_to_tune_domains():
    spec = _sweep()
    domains = tune_domains(spec.tune)
    assert set(domains) == {"train.lr", "model.hidden", "train.batch_size"}
    assert domains["train.lr"].lower == pytest.approx(1e-4) and domains["train.lr"].upper == pytest.approx(3e-2)
    assert domains["model.hidden"].categories == [[64], [128, 64]]


def test_randint_includes_its_upper_end_and_grid_search_expands_choices():
    spec = _sweep("tune.space={train.epochs: {randint: [1, 3]}, train.zero_stage: {choice: [1, 2]}}", "tune.search=grid",
                  "tune.space={train.zero_stage: {choice: [1, 2]}, model.hidden: {grid: [[8], [16]]}}")
    domains = tune_domains(spec.tune)
    assert domains["train.zero_stage"] == {"grid_search": [1, 2]}
    assert domains["model.hidden"] == {"grid_search": [[8], [16]]}
    ranged = tune_domains(_sweep("tune.space={train.epochs: {randint: [1, 3]}}").tune)
    assert (ranged["train.epochs"].lower, ranged["train.epochs"].upper) == (1, 4)  # Ray's upper end is exclusive


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tune.space={train.lrr: {loguniform: [1.0e-4, 1.0e-2]}}"], "`tune.space.train.lrr` = 0.0001: `train.lrr`: unknown key; did you mean `train.lr`?"),
        (["tune.space={train.lr: {loguniform: [0, 1]}}"], "loguniform needs low > 0"),
        (["tune.space={train.lr: {uniform: [1, 0.5]}}"], "uniform needs low < high"),
        (["tune.space={train.epochs: {randint: [1.5, 3]}}"], "randint needs integers"),
        (["tune.space={model.hidden: {choice: []}}"], "choice needs a non-empty list"),
        (["tune.space={train.lr: {between: [1, 2]}}"], "must be one of {loguniform: ..., uniform: ..., randint: ..., choice: ..., grid: ...}"),
        (["tune.space={train.zero_stage: {choice: [2, 4]}}"], "`tune.space.train.zero_stage` = 4: `train.zero_stage`: Input should be 0, 1, 2 or 3"),
        (["tune.search=optuna", "tune.space={model.hidden: {grid: [[8], [16]]}}"], "need `--set tune.search=random` or `grid`, not optuna"),
        (["tune.search=grid"], "`tune.search: grid` takes only choice/grid entries; train.lr are ranges"),
    ],
)
def test_malformed_sweeps_are_rejected_naming_the_entry(overrides, message):
    with pytest.raises(SpecError) as info:
        _sweep(*overrides)
    assert message in str(info.value)


def test_yaml_exponents_without_a_dot_are_numbers():
    spec = _sweep("tune.space={train.lr: {loguniform: [1e-4, 1e-2]}}")  # YAML 1.1 reads 1e-4 as a string
    assert spec.tune.space["train.lr"] == {"loguniform": [1e-4, 1e-2]}


def test_trial_spec_applies_sampled_values_and_fixed_fields():
    spec = _sweep()
    trial = trial_spec(spec, {"train.lr": 0.002, "model.hidden": [32]}, **{"train.run_name": "t-1", "track.register_model": False})
    assert trial.tune is None and trial.train.lr == 0.002 and trial.model.hidden == [32]
    assert trial.train.run_name == "t-1" and trial.track.register_model is False


def test_the_largest_trial_decides_fit_and_slots():
    spec = _sweep("tune.space={train.num_workers: {choice: [1, 3]}, train.lr: {uniform: [0.001, 0.01]}}")
    assert largest_trial(spec).train.num_workers == 3
    assert concurrent_slots(spec, {"CPU": 8}, data_cpus=1) == 2  # (8 - 1) // 3
    assert concurrent_slots(_sweep(), {"CPU": 3}, data_cpus=1) == 2  # 1-worker trials beside Ray Data's CPU
    assert concurrent_slots(_sweep(), {"CPU": 1}, data_cpus=1) == 1  # never below one


def test_a_one_worker_trial_reserves_its_worker_and_a_larger_one_leaves_it_to_its_workers():
    one = trial_spec(_sweep(), {"train.cpus_per_worker": 2})
    assert trial_resources(one) == {"CPU": 2}  # it trains in its own process
    assert trial_resources(trial_spec(_sweep(), {"train.gpus_per_worker": 1})) == {"CPU": 1, "GPU": 1}
    two = trial_spec(_sweep(), {"train.num_workers": 2})
    assert trial_resources(two)["CPU"] == 0  # its TorchTrainer's workers hold the CPUs


def test_trials_share_one_data_preparation_unless_the_space_changes_what_it_reads():
    from flotilla.tune import space_changes_data

    assert not space_changes_data(_sweep().tune.space)  # lr, hidden, batch size: the same data
    assert space_changes_data({"data.source": {"grid": ["a", "b"]}})
    assert space_changes_data({"model.context": {"choice": [32, 64]}})  # a GPT's windows


def test_metric_and_mode_defaults():
    assert metric_and_mode(_sweep()) == ("val_accuracy", "max")
    assert metric_and_mode(_sweep("tune.metric=val_loss", "tune.mode=null")) == ("val_loss", "min")
    gpt = load_spec(Path(SWEEP).with_name("pycode_gpt.yaml"), ["tune={space: {train.lr: {uniform: [0.001, 0.002]}}}"])
    assert metric_and_mode(gpt) == ("val_perplexity", "min")


def test_a_sweep_without_a_metric_optimizes_what_the_gate_ranks_by(tmp_path):
    """`data.task: auto` is resolved from the label's type, as training resolves it, so the sweep
    optimizes the task's primary metric: the one the gate compares versions on."""
    import pandas as pd

    from flotilla.data import resolve_task
    from flotilla.metrics import primary_metric

    space = "tune={space: {train.lr: {uniform: [0.001, 0.002]}}}"
    digits = load_spec(None, ["data.source=digits", "data.task=auto", space])
    assert digits.tune.metric is None and digits.data.task == "auto"
    assert resolve_task(digits) == "classification"
    assert metric_and_mode(digits) == ("val_accuracy", "max") == (primary_metric("classification").name, "max")

    table = tmp_path / "houses.csv"
    pd.DataFrame({"rooms": [1, 2, 3, 4], "area": [30.0, 50.0, 70.0, 90.0], "price": [1.5, 2.5, 3.1, 4.9]}).to_csv(table, index=False)
    regression = load_spec(None, [f"data.source={table}", "data.label=price", space])
    assert resolve_task(regression) == "regression"
    assert metric_and_mode(regression) == ("val_rmse", "min")
    labels_as_text = tmp_path / "labels.csv"
    pd.DataFrame({"x": [0.1, 0.2], "kind": ["cat", "dog"]}).to_csv(labels_as_text, index=False)
    assert metric_and_mode(load_spec(None, [f"data.source={labels_as_text}", "data.label=kind", space]))[0] == "val_accuracy"


def test_summary_table_lists_every_trial():
    outcome = SweepOutcome("s", "val_accuracy", "max", trials=[
        TrialRow("a_0", "s-a_0", {"train.lr": 0.00123456}, 0.9712, 3, "completed"),
        TrialRow("a_1", "s-a_1", {"train.lr": 0.1}, None, 0, "errored", "boom"),
    ])
    lines = outcome.table().splitlines()
    assert lines[0].split() == ["trial", "train.lr", "val_accuracy", "epochs", "status"]
    assert lines[1].split() == ["s-a_0", "0.001235", "0.9712", "3", "completed"]
    assert lines[2].split() == ["s-a_1", "0.1", "-", "0", "errored"]
