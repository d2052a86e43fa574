"""The `flotilla` command: help with examples and exit codes, validate, config, thin scripts."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.cli import SUBCOMMANDS, main
from flotilla.errors import SpecError

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


# ---------------------------------------------------------------- one model reference syntax
@pytest.mark.parametrize("text, name, alias, version", [
    ("digits@champion", "digits", "champion", None),
    ("digits/3", "digits", None, "3"),
    ("models:/digits@champion", "digits", "champion", None),
    ("models:/digits/3", "digits", None, "3"),
    ("team/digits/12", "team/digits", None, "12"),
])
def test_model_references_parse_one_way(text, name, alias, version):
    from flotilla.track import parse_model_reference

    ref = parse_model_reference(text)
    assert (ref.name, ref.alias, ref.version, ref.path) == (name, alias, version, None)
    assert ref.target == (alias or version) and ref.text == text


def test_model_references_paths_names_and_mistakes(tmp_path):
    from flotilla.track import parse_model_reference

    (tmp_path / "digits").mkdir()
    ref = parse_model_reference(str(tmp_path / "digits"))
    assert ref.path == tmp_path / "digits" and ref.name is None  # an existing path is a bundle
    assert parse_model_reference("digits", name_alone=True).name == "digits"  # deploy, promote
    for bad, why in [("digits", "not a model reference"), ("models:/digits", "a models:/ URI names"),
                     (str(tmp_path / "nope"), "no such file or directory"), ("@champion", "not a model reference")]:
        with pytest.raises(SpecError, match=why) as err:
            parse_model_reference(bad)
        assert "NAME@ALIAS (digits@champion), NAME/VERSION (digits/3), models:/NAME@ALIAS" in str(err.value)
    with pytest.raises(SpecError, match="models:/NAME/VERSION or NAME$"):
        parse_model_reference("a b/c", name_alone=True, paths=False)


def test_every_command_that_takes_a_model_or_touches_mlflow_says_so_alike():
    commands = _subparsers()
    for name in ("deploy", "promote", "predict", "export"):
        assert "models:/NAME@ALIAS" in commands[name]._option_string_actions["--model"].help, name
    for name in ("train", "sweep", "deploy", "promote", "predict", "export"):
        assert "--tracking-uri" in commands[name]._option_string_actions, name


@pytest.fixture
def registry_uri(registry):
    """The unit tests' registry (`m` v1..4), v2 aliased `candidate`: its tracking URI."""
    registry.set_registered_model_alias("m", "candidate", "2")
    return registry.tracking_uri


def test_promote_takes_the_version_in_the_model_reference(registry_uri, capsys):
    for model in ("m/3", "models:/m/4", "m@candidate", "models:/m@candidate"):
        assert main(["promote", "--model", model, "--tracking-uri", registry_uri]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "m@champion: unset -> v3 (promoted)", "m@champion: v3 -> v4 (promoted)", "m@champion: v4 -> v2 (promoted)",
        "m@champion stays v2 (no change)"]
    assert main(["promote", "--model", "m@nope", "--tracking-uri", registry_uri]) == 2
    assert "--model 'm@nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["promote", "--model", "m/3", "--version", "3", "--tracking-uri", registry_uri])
    assert done.value.code == 2 and "names the version already" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["promote", "--model", "m", "--tracking-uri", registry_uri])  # which version?
    assert "name the version: --version N, --model NAME/VERSION or NAME@ALIAS, or --rollback" in capsys.readouterr().err


def test_registry_resolves_models_uris(registry_uri):
    from mlflow import MlflowClient

    from flotilla.track import resolve_reference

    client = MlflowClient(registry_uri)
    assert resolve_reference(client, "models:/m@candidate", "test") == ("m", "2")
    assert resolve_reference(client, "models:/m/4", "test") == ("m", "4")
    assert resolve_reference(client, "m@candidate", "test") == ("m", "2")


class _Stop(Exception):
    """Raised by a faked library entry, with what the command passed it."""


def _fake_module(monkeypatch, module: str, **functions):
    import types

    fake = types.ModuleType(module)
    for name, fn in functions.items():
        setattr(fake, name, fn)
    monkeypatch.setitem(sys.modules, module, fake)


def _stop(*args, **kwargs):
    raise _Stop(args, kwargs)


def test_deploy_model_reference_names_the_version_to_serve(monkeypatch):
    """`--model NAME/VERSION` or `NAME@ALIAS` on deploy: that one gets all traffic (no Ray: the library is faked)."""
    _fake_module(monkeypatch, "flotilla.runtime", started_local_ray=lambda: False)
    _fake_module(monkeypatch, "flotilla.serve", plan_deployment=_stop, deploy=_stop, delete_endpoint=_stop,
                 promote_candidate=_stop, query_endpoint=_stop)
    config = str(ROOT / "configs" / "digits.yaml")
    for model, traffic in [("digits/3", {"3": 100}), ("models:/digits@candidate", {"candidate": 100}),
                           ("digits", {"champion": 100})]:
        with pytest.raises(_Stop) as stopped:
            main(["deploy", "-c", config, "--model", model, "--tracking-uri", "sqlite:///elsewhere.db"])
        (spec,), kwargs = stopped.value.args
        assert kwargs == {"model": "digits", "tracking_uri": "sqlite:///elsewhere.db"}
        assert spec.serve.traffic == traffic and spec.track.uri == "sqlite:///elsewhere.db"
    with pytest.raises(SystemExit):
        main(["deploy", "-c", config, "--model", "digits/3", "--split", "champion=90,candidate=10"])


@pytest.mark.parametrize("command, entry", [("train", "run_training"), ("sweep", "run_sweep")])
def test_tracking_uri_overrides_the_spec_on_train_and_sweep(command, entry, monkeypatch):
    _fake_module(monkeypatch, "flotilla.pipeline", **{entry: _stop})
    _fake_module(monkeypatch, "flotilla.train", latest_run=_stop, new_run_name=lambda spec: "r1")
    config = str(ROOT / "configs" / ("digits_sweep.yaml" if command == "sweep" else "digits.yaml"))
    uri = "postgresql://u@db/mlflow#x"  # as it is: not parsed as YAML (`#` would start a comment there)
    with pytest.raises(_Stop) as stopped:
        main([command, "-c", config, "--set", "track.uri=sqlite:///spec.db", "--tracking-uri", uri])
    (spec,), _ = stopped.value.args
    assert spec.track.uri == uri


def test_deploy_apps_takes_its_file_like_the_others(tmp_path, capsys):
    missing = str(tmp_path / "missing.yaml")
    for args in (["-c", missing], ["--config", missing], [missing]):
        assert main(["deploy-apps", *args]) == 2
        assert "missing.yaml: no such Serve config file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["deploy-apps"])
    assert done.value.code == 2 and "pass -c serve_apps/config.yaml" in capsys.readouterr().err


def test_model_references_are_parsed_in_one_place():
    """predict, export, the registry, serve and the CLI call flotilla.track.parse_model_reference; none splits on `@`."""
    package = ROOT / "platform" / "flotilla"
    for path in package.rglob("*.py"):
        if path == package / "track" / "_reference.py":
            continue
        text = path.read_text()
        for own_parser in ('partition("@")', "split(\"@\")", 'rsplit("/", 1)[1].isdigit()'):
            assert own_parser not in text, f"{path.relative_to(ROOT)} parses a model reference itself ({own_parser})"


# ---------------------------------------------------------------- validate checks what it can see
def _validate_in_a_fresh_process(*args: str) -> subprocess.CompletedProcess:
    """`flotilla validate ARGS` in a new interpreter; it prints whether Ray or torch got imported."""
    code = ("import sys; from flotilla.cli import main; rc = main(sys.argv[1:]); "
            "print('heavy imports:', sorted(m for m in ('ray', 'torch', 'pyarrow') if m in sys.modules), "
            "file=sys.stderr); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "validate", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})


def test_validate_fails_fast_on_a_missing_local_data_source(tmp_path):
    missing = tmp_path / "rows.csv"
    proc = _validate_in_a_fresh_process("-c", "configs/digits.yaml", "--set", f"data.source={missing}")
    assert proc.returncode == 2, proc.stderr
    assert f"`data.source`: '{missing}' does not exist" in proc.stderr
    assert "heavy imports: []" in proc.stderr  # decided before Ray or torch is imported


def test_validate_checks_local_paths_and_notes_remote_ones(tmp_path, capsys):
    digits, lora = str(ROOT / "configs" / "digits.yaml"), str(ROOT / "configs" / "instruct_lora.yaml")
    assert main(["validate", "-c", digits, "--set", f"data.source={tmp_path}/*.parquet"]) == 2
    assert f"`data.source`: '{tmp_path}/*.parquet' matches no files" in capsys.readouterr().err
    (tmp_path / "a.parquet").write_bytes(b"")
    for source in (f"{tmp_path}/*.parquet", str(tmp_path), "digits"):  # a built-in name is no path
        assert main(["validate", "-c", digits, "--set", f"data.source={source}"]) == 0
        assert "not checked" not in capsys.readouterr().out
    assert main(["validate", "-c", digits, "--set", "data.source=s3://bucket/rows/"]) == 0
    assert "# not checked: `data.source` 's3://bucket/rows/' is remote" in capsys.readouterr().out

    assert main(["validate", "-c", lora, "--set", f"model.pretrained={tmp_path}/nope"]) == 2
    assert f"`model.pretrained`: '{tmp_path}/nope' does not exist" in capsys.readouterr().err
    assert main(["validate", "-c", lora, "--set", f"model.pretrained={tmp_path}"]) == 2
    assert "has no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["validate", "-c", lora, "--set", f"model.pretrained={tmp_path}"]) == 0
    assert main(["validate", "-c", lora, "--set", "model.pretrained=Qwen/Qwen2.5-0.5B"]) == 0
    out = capsys.readouterr().out
    assert "# not checked: `model.pretrained` 'Qwen/Qwen2.5-0.5B' is a Hugging Face hub id" in out
    assert main(["validate", "-c", lora]) == 0  # tiny-llama and arith: built in


def test_validate_knows_the_same_built_in_names_as_the_data_and_model_code():
    from flotilla.data import BUILTIN_SOURCES
    from flotilla.models._hf_tiny import BUILTIN_MODELS
    from flotilla.spec import _local

    assert _local.BUILTIN_SOURCES == BUILTIN_SOURCES and _local.BUILTIN_MODELS == BUILTIN_MODELS


# ---------------------------------------------------------------- pipes and signals
@pytest.mark.parametrize("args, code", [(["config"], 141), (["config", "--schema"], 141), (["train", "--help"], 0),
                                        (["validate", "-c", "configs/digits.yaml"], 141)])
def test_output_into_a_closed_pipe_ends_quietly(args, code):
    """`flotilla config | head -1`: the reader is gone before the output is; no BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)  # a reader that went away: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "flotilla.cli", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    finally:
        os.close(write)
    assert proc.returncode == code, proc.stderr  # 141: killed by SIGPIPE, as `yes | head` is; argparse's help: 0
    assert proc.stderr == ""


_DEPLOY_IN_THE_FOREGROUND = """
import signal, sys, types
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init installs in a driver

class Plan:
    kind, model = "classifier", "digits"
    def describe(self):
        return "digits: v1 (champion) 100%"

class Endpoint:
    plan, url, notes = Plan(), "http://127.0.0.1:8000/v1/models/digits", []

serve = types.ModuleType("flotilla.serve")
serve.plan_deployment = lambda spec, model=None, tracking_uri=None: Plan()
serve.deploy = lambda plan: Endpoint()
serve.delete_endpoint = serve.promote_candidate = serve.query_endpoint = None
runtime = types.ModuleType("flotilla.runtime")
runtime.started_local_ray = lambda: True
sys.modules.update({"flotilla.serve": serve, "flotilla.runtime": runtime})

from flotilla.cli import main
sys.exit(main(["deploy", "-c", "configs/digits.yaml"]))
"""


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_foreground_deploy_stops_on_sigterm_as_on_ctrl_c(how):
    """`flotilla deploy` with its own local Ray waits until stopped; SIGTERM ends it as Ctrl-C does (exit 0,
    no traceback), not through Ray's handler (exit 15). The Serve and Ray side is faked: no Ray starts."""
    # Ctrl-C as a terminal sends it: a suite started in the background of a non-interactive shell
    # hands its processes SIGINT ignored, which Python (and so the command) would keep.
    proc = subprocess.Popen([sys.executable, "-c", _DEPLOY_IN_THE_FOREGROUND], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "platform")},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        while not lines or "stops it" not in lines[-1]:
            line = proc.stdout.readline()
            assert line, f"ended before waiting: {lines} {proc.stderr.read()}"
            lines.append(line)
        proc.send_signal(how)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and err.strip().endswith("stopping")
