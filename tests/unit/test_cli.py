"""The `flotilla` command: help with examples and exit codes, validate, config, thin scripts."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"train": "pipelines/train.py", "deploy": "pipelines/deploy.py", "promote": "pipelines/promote.py",
           "sweep": "tune/sweep.py"}


def test_top_level_help_lists_every_command_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "sweep", "deploy", "deploy-apps", "promote", "validate", "config"):
        assert f"    {command} " in out or f"    {command}\n" in out
    assert "exit codes:" in out and "2    bad input" in out and "130  interrupted" in out


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_each_command_help_shows_examples(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and f"flotilla {command} " in out and "exit codes:" in out


@pytest.mark.parametrize("command,script", SCRIPTS.items())
def test_scripts_are_the_same_command(command, script):
    """`python pipelines/train.py ARGS` is `flotilla train ARGS`, runnable from a checkout."""
    proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=60,
                          cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert f"usage: flotilla {command}" in proc.stdout and "examples:" in proc.stdout


def test_scripts_and_package_inits_hold_no_logic():
    for script in [*SCRIPTS.values(), "pipelines/_checkout.py"]:
        assert "add_argument" not in (ROOT / script).read_text(), script
    for init in (ROOT / "platform" / "flotilla").rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
        assert defined == [], f"{init} defines {defined}; package __init__ files only re-export"


def test_deploy_apps_checks_the_serve_config_before_reaching_a_cluster(tmp_path, capsys):
    assert main(["deploy-apps", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such Serve config file" in capsys.readouterr().err
    bad = tmp_path / "apps.yaml"
    bad.write_text("applications:\n  - name: digits\n    route_prefix: /v1/models/digits\n")
    assert main(["deploy-apps", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad} is not a Ray Serve config file" in err and "applications.0.import_path: Field required" in err
    # A well-formed file, but no cluster at the address: exit 3, naming the address and the fix.
    assert main(["deploy-apps", str(ROOT / "serve_apps" / "config.yaml"), "--address", "http://127.0.0.1:9"]) == 3
    err = capsys.readouterr().err
    assert "cannot reach the Ray dashboard at http://127.0.0.1:9" in err and "--address http://HEAD:8265" in err


def test_validate_prints_the_resolved_spec(capsys):
    assert main(["validate", "--config", str(ROOT / "configs" / "digits.yaml"), "--set", "train.zero_stage=3"]) == 0
    out = capsys.readouterr().out
    assert "zero_stage: 3" in out and "warmup_fraction: 0.05" in out  # defaults filled in


def test_bad_spec_exits_2_naming_the_field_as_typed(capsys):
    assert main(["validate", "-c", str(ROOT / "configs" / "pycode_gpt.yaml"), "--set", "model.heads=3"]) == 2
    err = capsys.readouterr().err
    assert "`model.heads` (3) must divide `model.width` (128); try `--set model.heads=4`" in err
    assert "--model." not in err


def test_config_prints_the_reference_and_the_json_schema(capsys):
    assert main(["config"]) == 0
    assert "**cost**" in capsys.readouterr().out
    assert main(["config", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Flotilla run spec" and {"data", "train", "serve", "cost"} <= set(schema["properties"])


def test_resume_without_an_earlier_run_says_so(tmp_path, capsys):
    code = main(["train", "-c", str(ROOT / "configs" / "digits.yaml"), "--set", f"train.storage_path={tmp_path}", "--resume"])
    assert code == 2
    assert f"no run of 'digits' under train.storage_path='{tmp_path}'" in capsys.readouterr().err


def test_resume_picks_the_latest_run_of_this_spec(tmp_path):
    from flotilla import load_spec
    from flotilla.train import latest_run

    for name in ("digits-20261130-101500", "digits-20261130-111500", "digits-sweep-20261130-121500", "other-20261130-131500"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "spec.yaml").write_text("name: x\n")
    (tmp_path / "digits-20261130-121500").mkdir()  # never got as far as its spec: not a run
    spec = load_spec(ROOT / "configs" / "digits.yaml", [f"train.storage_path={tmp_path}"])
    assert latest_run(spec) == "digits-20261130-111500"


def test_train_and_sweep_end_with_where_the_run_is_and_what_was_registered(capsys, tmp_path, monkeypatch):
    from flotilla.cli import _print_tracking

    class Registered:
        def describe(self):
            return "registered digits v2 (candidate); gate failed: val_accuracy 0.90 >= 0.95 no"

    monkeypatch.chdir(tmp_path)
    _print_tracking("MLflow run", "abc123", f"sqlite:///{tmp_path}/mlflow.db", Registered())
    _print_tracking("MLflow parent run", "def456", "http://127.0.0.1:5000", None)
    _print_tracking("MLflow run", None, None, None)  # tracking off: nothing to say
    assert capsys.readouterr().out.splitlines() == [
        f"MLflow run abc123 at sqlite:///{tmp_path}/mlflow.db; browse: mlflow ui",
        "registered digits v2 (candidate); gate failed: val_accuracy 0.90 >= 0.95 no",
        "MLflow parent run def456 at http://127.0.0.1:5000",
    ]


def _subparsers():
    from flotilla.cli import build_parser

    parser = build_parser()
    [action] = [a for a in parser._actions if a.dest == "==SUPPRESS==" and getattr(a, "choices", None)]
    return action.choices


def test_version_prints_the_package_version(capsys):
    import flotilla

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"flotilla {flotilla.__version__}"


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_c_is_short_for_config_wherever_there_is_one(command):
    actions = _subparsers()[command]._option_string_actions
    if "--config" in actions:
        assert actions["-c"] is actions["--config"]
    else:
        assert "-c" not in actions


def test_c_loads_the_spec_like_config(capsys):
    assert main(["validate", "-c", str(ROOT / "configs" / "digits.yaml")]) == 0
    assert "name: digits" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "sweep", "deploy", "validate"])
def test_a_command_that_runs_a_spec_needs_one(command, capsys, monkeypatch):
    """No built-in default run: without --config the command stops, naming configs/."""
    import flotilla.cli

    monkeypatch.chdir(ROOT)
    for runner in ("_train", "_sweep", "_deploy", "_validate"):  # never start a run here, whatever happens
        monkeypatch.setattr(flotilla.cli, runner, lambda args: pytest.fail(f"{args.command} ran without a spec"))
    with pytest.raises(SystemExit) as done:
        main([command, "--set", "train.epochs=1"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: flotilla {command}" in err
    assert "no run spec given: pass --config configs/" in err and "see configs/: digits.yaml" in err


def test_an_empty_spec_file_is_an_error_naming_configs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the message names the checkout's
    for text in ("", "# nothing yet\n", "{}\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        assert main(["validate", "-c", str(empty)]) == 2
        err = capsys.readouterr().err
        assert "the file is empty" in err and "configs/digits.yaml" in err and f"{ROOT / 'configs'}/: digits.yaml" in err
