"""The `flotilla` command: argument parsing and exit codes; every subcommand calls one library entry.

    flotilla train --config configs/digits.yaml --set train.lr=3e-4
    flotilla --help              # subcommands, exit codes
    flotilla train --help        # examples for one subcommand

`pipelines/train.py`, `pipelines/deploy.py`, `pipelines/promote.py`, `pipelines/predict.py` and
`tune/sweep.py` run the subcommand named like the script (for `ray job submit -- python pipelines/train.py ...`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import Callable

from flotilla import __version__
from flotilla.errors import EXIT_CODES, FlotillaError, NotFiniteError, SpecError
from flotilla.metrics import primary_metric
from flotilla.redact import redact, redact_output
from flotilla.spec import (VARIANTS, check_local_paths, load_spec, shipped_specs, spec_json_schema, spec_reference_markdown,
                           spec_to_yaml, traffic_override)

# The subcommands import the rest of Flotilla (Ray, torch, MLflow) inside their functions, each
# marked `lazy`: `flotilla --help` and `flotilla validate` answer in a fraction of a second.

EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE
EXIT_CODES_TEXT = "exit codes:\n" + "".join(
    f"  {code:<4} {meaning}\n"
    for code, meaning in {**EXIT_CODES, EXIT_PIPE_CLOSED: "the output's reader went away (`| head`); it stopped quietly"}.items())

# The subcommands that run a spec: without --config they stop (there is no built-in spec to run).
SPEC_REQUIRED = {"train": "digits.yaml", "sweep": "digits_sweep.yaml", "deploy": "digits.yaml", "validate": "digits.yaml"}

# Each subcommand: (one-line summary, examples shown by --help).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "Train one run: preprocess, train (Ray Train + DeepSpeed), evaluate, bundle, register.",
        """examples:
  flotilla train --config configs/digits.yaml
  flotilla train --config configs/digits.yaml --set train.zero_stage=3 --set model.hidden=[256,128]
  flotilla train --config configs/digits.yaml --resume                 # the latest run of this spec
  flotilla train --config configs/digits.yaml --resume digits-20261130-101500
  flotilla train -c configs/digits.yaml --tracking-uri http://mlflow:5000   # overrides track.uri
  ray job submit --working-dir . -- python pipelines/train.py --config configs/digits.yaml

With no Ray cluster running it starts a local one; under `ray job submit` (or with RAY_ADDRESS
set) it uses that cluster. The run is recorded in MLflow (track.uri; default sqlite:///mlflow.db
in the working directory, which `mlflow ui` there shows) and its bundle registered.""",
    ),
    "sweep": (
        "Sweep hyperparameters with Ray Tune; every trial is an ordinary training run.",
        """examples:
  flotilla sweep --config configs/digits_sweep.yaml
  flotilla sweep --config configs/digits_sweep.yaml --set tune.num_samples=16 --set tune.search=optuna
  ray job submit --working-dir . -- python tune/sweep.py --config configs/digits_sweep.yaml

The spec needs a `tune` section. Running the same command again (same tune.name) resumes an
interrupted sweep: finished trials are kept, unfinished ones resume from their checkpoints.""",
    ),
    "deploy": (
        "Deploy a registered model as an HTTP endpoint with Ray Serve (the spec's `serve` section).",
        """examples:
  flotilla deploy --config configs/digits.yaml                   # champion, until Ctrl-C
  flotilla deploy --config configs/digits.yaml --query           # deploy, query once, exit
  flotilla deploy --config configs/digits.yaml --split champion=90,candidate=10
  flotilla deploy --config configs/digits.yaml --model digits/3  # version 3, all traffic
  flotilla deploy --config configs/digits.yaml --promote         # candidate -> champion, in place
  flotilla deploy --config configs/digits.yaml --delete

Against a running cluster (RAY_ADDRESS, `ray start`, `ray job submit`) the endpoint keeps
running after the command exits, and a second deploy of the same model updates it in place.
With no cluster, a local one is started and lives as long as the command.""",
    ),
    "deploy-apps": (
        "Deploy a Ray Serve config file to a running cluster, this checkout as its apps' code.",
        """examples:
  flotilla deploy-apps -c serve_apps/config.yaml --address http://HEAD:8265
  flotilla deploy-apps -c my_apps.yaml             # RAY_DASHBOARD_ADDRESS, else http://127.0.0.1:8265

Ray's `serve deploy` needs the apps' code on every node already (or at a remote URI in the file's
runtime_env). This uploads the working directory and Flotilla's package to the cluster, as `ray
job submit --working-dir .` does, names them in each app's runtime_env (unless the file gives its
own), deploys the file and waits until every app runs. Each run rolls the apps, resolving their
aliases anew: after `flotilla promote`, the same command serves the new champion. `serve status
--address ...` shows them.""",
    ),
    "promote": (
        "Move a registered model's alias: promote a version, or roll `champion` back.",
        """examples:
  flotilla promote --model digits --version 3                  # v3 becomes champion
  flotilla promote --model digits --version 4 --alias candidate
  flotilla promote --model digits@candidate                    # the candidate version becomes champion
  flotilla promote --model digits --rollback                   # champion back to the one before
  flotilla promote --config configs/digits.yaml --rollback     # model name and store from a spec

The store is --tracking-uri, else the spec's track.uri, else $MLFLOW_TRACKING_URI, else
sqlite:///mlflow.db in the working directory.""",
    ),
    "predict": (
        "Score a whole table with a registered model (or a bundle) on Ray Data; write the predictions as Parquet.",
        """examples:
  flotilla predict --model digits@champion --input new_rows.parquet --output scored/
  flotilla predict --model tables/3 --input s3://bucket/rows/ --output s3://bucket/scored/ --id customer_id
  flotilla predict --model runs/digits-20261130-101500/bundle --input rows.csv --output scored/
  flotilla predict --model models:/digits@champion --tracking-uri http://mlflow:5000 --input ... --output ...
  ray job submit --working-dir . -- python pipelines/predict.py --model digits@champion --input ... --output ...

Writes OUTPUT/predictions/ (the id columns, `prediction`, and per class `probability_<class>`) and,
for rows that cannot be scored (text in a numeric column, an infinite value), OUTPUT/rejected/
with the row and the reason; the job goes on past them. A registered model's scoring is logged
as an MLflow run in the experiment that trained it (store: --tracking-uri, else
$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory).""",
    ),
    "export": (
        "Build ONNX and int8 variants of a registered model, each gated for parity with the torch model.",
        """examples:
  flotilla export --model digits@champion
  flotilla export --model pycode-gpt/2 --set export.variants=[onnx]
  flotilla export --model runs/digits-20261130-101500/bundle
  flotilla deploy --config configs/digits.yaml --set serve.runtime=onnx-int8     # then serve one

Exports the model to ONNX (a `gpt` with its KV cache as inputs and outputs), quantizes it to int8
with ONNX Runtime, and runs each variant and the torch model over the validation rows of the spec
the version was trained with: a variant passes when its accuracy is within export.max_accuracy_drop
(perplexity, RMSE: export.max_relative_increase) of torch's. The variants join the same version
(its model's bundle/variants/, a `flotilla.runtime.<variant>` tag each, passed or failed and why)
with their speed measured here, from which serve.runtime=auto picks; a failed one is never served.""",
    ),
    "eval": (
        "Judge a registered language model with lm-evaluation-harness through its OpenAI endpoint; log the scores.",
        """examples:
  flotilla eval --model instruct-lora@candidate --tasks evals/arith
  flotilla eval --model instruct-lora/3 --tasks evals/arith/arith.yaml --limit 20
  flotilla eval --model instruct-lora@champion --tasks my_tasks/ --base-url http://127.0.0.1:8000/v1
  flotilla eval --model instruct-lora/3 --tasks evals/arith --runtime onnx-int4   # its 4-bit variant vs torch
Runs the harness's `local-completions` model against the version's /v1/completions: at --base-url
(where it serves that version), or on an endpoint served for the duration (all traffic to this version, on a prefix of its own that
the /v1 router does not list; deleted afterwards). Tasks are lm-evaluation-harness task YAML files
with their data beside them (a `data_files` path is relative to its YAML file); the harness's own
tasks, which download data, are not loaded. Each task's metrics become tags of the version and
metrics of its run (`eval.<task>.<metric>`, e.g. eval.arith.acc), which gate rules may test, and the
harness's results an artifact of the run (eval/<tasks>.json). With --runtime, the variant is scored,
then torch on the same tasks: its scores are logged as variant.<runtime>.eval.<task>.<metric>, and a
score worse than torch's by more than export.max_eval_drop fails the variant's gate.""",
    ),
    "validate": (
        "Check a spec (with its overrides) and print it resolved, every default filled in.",
        """examples:
  flotilla validate --config configs/digits.yaml
  flotilla validate --config configs/digits.yaml --set train.zero_stage=3

Prints every problem at once and exits 2 when the spec is not well-formed, or when a local path it
names (data.source, model.pretrained) does not exist here; a remote one (s3://..., a hub id) is
noted as not checked. Ray does not start.""",
    ),
    "config": (
        "Print the spec reference (Markdown) or the spec's JSON Schema.",
        """examples:
  flotilla config                                  # every section and field, default and meaning
  flotilla config --schema > spec.schema.json      # editors complete and check spec YAML with it""",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (see `flotilla --help`)."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at interpreter exit
    except BrokenPipeError:
        # The standard recipe: what is still buffered goes nowhere, and the command ends quietly with
        # the code a process killed by SIGPIPE has (what `yes | head -1` leaves in PIPESTATUS).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in SPEC_REQUIRED and args.config is None:
        args.parser.error(_no_spec_message(args.command))  # exits 2, after the command's usage line
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per epoch is the log
    redact_output()  # no password in a URI is printed in full, whoever prints it
    try:
        return args.run(args)
    except FlotillaError as e:
        print(f"error: {e}", file=sys.stderr)
        if not isinstance(e, NotFiniteError):  # resuming would diverge again
            _print_resume_hint(args, e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _print_resume_hint(args, 130)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flotilla",
        description="Flotilla: raw data to a trained, registered, served model on one Ray cluster.",
        epilog="Run `flotilla COMMAND --help` for a command's examples.\n\n" + EXIT_CODES_TEXT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    parser.add_argument("--version", action="version", version=f"flotilla {__version__}")
    parser.set_defaults(command=None)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    commands: dict[str, Callable[[argparse.ArgumentParser], None]] = {
        "train": _train_args, "sweep": _sweep_args, "deploy": _deploy_args, "deploy-apps": _deploy_apps_args,
        "promote": _promote_args, "predict": _predict_args, "export": _export_args, "eval": _eval_args,
        "validate": _sweep_args,
        "config": _config_args,
    }
    runners = {"train": _train, "sweep": _sweep, "deploy": _deploy, "deploy-apps": _deploy_apps, "promote": _promote,
               "predict": _predict, "export": _export, "eval": _eval, "validate": _validate, "config": _config}
    for name, add_args in commands.items():
        summary, examples = SUBCOMMANDS[name]
        p = sub.add_parser(name, help=summary, description=summary, epilog=examples + "\n\n" + EXIT_CODES_TEXT,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(p)
        p.set_defaults(command=name, run=runners[name], parser=p)
    return parser


# ------------------------------------------------------------------ arguments
# `--model` on every command: one syntax, parsed by flotilla.track.parse_model_reference.
MODEL_FORMS = "NAME@ALIAS, NAME/VERSION, models:/NAME@ALIAS, models:/NAME/VERSION"


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", metavar="SPEC.yaml",
                   help="run spec YAML (required; the shipped ones are in configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, the value parsed as YAML, e.g. --set train.lr=3e-4 (repeatable)")


def _tracking_uri_arg(p: argparse.ArgumentParser, help: str = "MLflow tracking URI (overrides the spec's track.uri)"):
    p.add_argument("--tracking-uri", metavar="URI", help=help)


def _model_arg(p: argparse.ArgumentParser, required: bool, help: str) -> None:
    """`--model`: a registered model, with a bundle path where the command takes one (required) or a bare NAME."""
    forms = f"{MODEL_FORMS} or a bundle directory" if required else f"NAME, {MODEL_FORMS}"
    p.add_argument("--model", required=required, metavar="MODEL", help=f"{help}; one of {forms}")


def _sweep_args(p: argparse.ArgumentParser) -> None:
    _spec_args(p)
    _tracking_uri_arg(p)


def _train_args(p: argparse.ArgumentParser) -> None:
    _sweep_args(p)
    p.add_argument("--resume", nargs="?", const="latest", metavar="RUN",
                   help="continue a run from its last checkpoint: RUN by name, or with no name the latest run "
                        "of this spec under train.storage_path")


def _deploy_args(p: argparse.ArgumentParser) -> None:
    _spec_args(p)
    _model_arg(p, False, "registered model (default: serve.model, track.model_name, name); with an alias or a "
                         "version, that one gets all traffic (as --split ALIAS=100)")
    _tracking_uri_arg(p)
    p.add_argument("--split", metavar="TARGET=W,...",
                   help="traffic split by alias or version, e.g. champion=90,candidate=10 (sets serve.traffic)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--promote", action="store_true",
                        help="point `champion` at the `candidate` version and send it all traffic, in place")
    action.add_argument("--delete", action="store_true", help="remove the endpoint")
    p.add_argument("--query", action="store_true", help="send one sample request, print the answer, exit")


def _deploy_apps_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", metavar="CONFIG.yaml", help="a Ray Serve config file, e.g. serve_apps/config.yaml")
    p.add_argument("serve_config", nargs="?", metavar="CONFIG.yaml", help="the same file as a positional argument, "
                   "as earlier versions took it")
    p.add_argument("--address", help="the cluster's dashboard (default: $RAY_DASHBOARD_ADDRESS, else "
                                     "http://127.0.0.1:8265)")
    p.add_argument("--working-dir", default=".", help="the apps' code and files (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for every app to run (default: %(default)s)")


def _promote_args(p: argparse.ArgumentParser) -> None:
    _model_arg(p, False, "registered model (default: the spec's track.model_name or name); NAME/VERSION or "
                         "NAME@ALIAS also names the version to promote, as --version does")
    p.add_argument("-c", "--config", metavar="SPEC.yaml", help="run spec whose track section names the model and the store")
    _tracking_uri_arg(p)
    action = p.add_mutually_exclusive_group()
    action.add_argument("--version", help="version to point the alias at")
    action.add_argument("--rollback", action="store_true", help="point champion back at the previous champion")
    p.add_argument("--alias", default="champion", help="alias to move with --version (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="make champion a version that failed its gate or has no gate record (refused otherwise)")


def _predict_args(p: argparse.ArgumentParser) -> None:
    _model_arg(p, True, "a registered model by alias or version, or the path of a bundle (or run) directory")
    p.add_argument("--input", required=True, metavar="PATH_OR_URI",
                   help="Parquet/CSV file, directory or glob: a local path or a pyarrow filesystem URI")
    p.add_argument("--output", required=True, metavar="DIR_OR_URI", help="a new directory for predictions/ and rejected/")
    p.add_argument("--id", dest="id_columns", action="append", default=[], metavar="COLUMN",
                   help="an input column to copy next to each prediction, e.g. a row id (repeatable)")
    _tracking_uri_arg(p, "MLflow tracking URI of the registry (for a registered model)")
    p.add_argument("--actors", type=int, metavar="N", help="scoring actors, one CPU each (default: the cluster's "
                                                           "CPUs but one)")
    p.add_argument("--batch-size", type=int, default=4096, metavar="ROWS", help="rows per batch (default: %(default)s)")
    _allow_factory_arg(p)


def _allow_factory_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-factory", dest="factories", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="a `custom` model factory the model may import and run when it loads (repeatable; default "
                        "none: a model.json names code, and whoever can write the registry or the bundle chose it)")


def _export_args(p: argparse.ArgumentParser) -> None:
    _model_arg(p, True, "a registered model by alias or version, or the path of a bundle (or run) directory")
    _tracking_uri_arg(p, "MLflow tracking URI of the registry (for a registered model)")
    _spec_args(p)
    p.set_defaults(config=None)
    p._option_string_actions["--config"].help = (
        "the spec for the validation rows and the `export` section (default: the one the version was trained with)")
    _allow_factory_arg(p)


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="MODEL", help=f"the registered version to judge; one of {MODEL_FORMS}")
    p.add_argument("--tasks", required=True, metavar="PATH",
                   help="a directory of lm-evaluation-harness task YAML files (or one file), their data beside them")
    _tracking_uri_arg(p, "MLflow tracking URI of the registry")
    p.add_argument("--base-url", metavar="URL", help="the OpenAI base URL of an endpoint serving the model already, "
                                                     "e.g. http://127.0.0.1:8000/v1 (the router); default: serve the "
                                                     "version for the duration")
    p.add_argument("--limit", type=int, metavar="N", help="at most N examples per task (a quick look)")
    p.add_argument("--runtime", default="torch", choices=["torch", *VARIANTS],
                   help="judge a variant `flotilla export` built (e.g. onnx-int4) against torch on the same tasks: "
                        "a score worse by more than export.max_eval_drop fails its gate (default: torch, the "
                        "version itself)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_const", const=True, default=None,
                      help="render each prompt as a user turn with the model's chat template (default: when its "
                           "tokenizer has one, as training rendered instructions)")
    chat.add_argument("--plain", dest="chat", action="store_const", const=False, help="send each prompt as it is")
    _spec_args(p)
    p.set_defaults(config=None)
    p._option_string_actions["--config"].help = (
        "the spec whose `serve` section serves the version for the duration (default: the one it was trained with)")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schema", action="store_true", help="print the JSON Schema of a spec file instead")


# ---------------------------------------------------------------- subcommands
def _load(args, extra: list[str] = ()):

    spec = load_spec(args.config, [*args.overrides, *extra])
    if getattr(args, "tracking_uri", None):
        spec.track.uri = args.tracking_uri  # a URI as it is, not parsed as YAML like a --set value
    return spec


def _model_reference(args, name_alone: bool, paths: bool):
    """`--model` parsed (None when not given): one syntax for every command."""
    if args.model is None:
        return None
    from flotilla.track import parse_model_reference  # lazy

    return parse_model_reference(args.model, name_alone=name_alone, paths=paths, command=f"flotilla {args.command}")


def _train(args) -> int:
    spec = _load(args)  # validated before Ray (or torch) is imported
    from flotilla.pipeline import run_training  # lazy
    from flotilla.train import latest_run, new_run_name  # lazy

    if args.resume:
        name = latest_run(spec) if args.resume == "latest" else args.resume
        if name is None:
            raise SpecError([f"--resume: no run of {spec.name!r} under train.storage_path={spec.train.storage_path!r} "
                             "to resume; train one first, or name it: --resume RUN"], "--resume")
        spec.train.run_name = name
    elif spec.train.run_name is None:
        spec.train.run_name = new_run_name(spec)
    args.run_name = spec.train.run_name  # for the resume hint, should the run fail
    outcome = run_training(spec)
    m = outcome.metrics
    task = outcome.task
    print(f"run {outcome.run_name}: {primary_metric(task).format(m[primary_metric(task).name])} after {m['epoch']} "
          f"epochs; bundle at {outcome.bundle_path}")
    _print_tracking("MLflow run", outcome.mlflow_run_id, outcome.tracking_uri, outcome.registration)
    if outcome.exported is not None:
        print(outcome.exported.describe())
    return 0


def _sweep(args) -> int:
    spec = _load(args)
    from flotilla.pipeline import run_sweep  # lazy

    if spec.tune is None:
        raise SpecError(["the spec has no `tune` section; a sweep needs one (see `flotilla config`, section tune, "
                         "and configs/digits_sweep.yaml)"], args.config)
    outcome = run_sweep(spec)
    print(outcome.table())
    if outcome.best is None:
        print(f"sweep {outcome.name}: no trial completed")
        return 1
    print(f"sweep {outcome.name}: best {outcome.best.run_name} {outcome.metric} {outcome.best.metric:.4f}")
    _print_tracking("MLflow parent run", outcome.parent_run_id, outcome.tracking_uri, outcome.registration)
    return 0


def _print_tracking(what: str, run_id: str | None, tracking_uri: str | None, registration) -> None:
    """Where the run is in MLflow and what was registered: the last lines of `train` and `sweep`."""
    if run_id:
        print(f"{what} {run_id} at {redact(tracking_uri)}{_browse_hint(tracking_uri)}")
    if registration is not None:
        print(registration.describe())


def _deploy(args) -> int:

    ref = _model_reference(args, name_alone=True, paths=False)
    extra = [traffic_override(args.split)] if args.split else []
    if args.promote:
        extra.append("serve.traffic={champion: 100}")
    if ref is not None and ref.target is not None:
        if args.split or args.promote:
            args.parser.error(f"--model {args.model} names the version to serve; with --split or --promote give "
                              f"the model by name: --model {ref.name}")
        extra.append(f"serve.traffic={{{ref.target!r}: 100}}")
    model = ref.name if ref is not None else None
    spec = _load(args, extra)  # validated before Ray starts
    from flotilla.runtime import started_local_ray  # lazy
    from flotilla.serve import delete_endpoint, deploy, plan_deployment, promote_candidate, query_endpoint  # lazy

    if args.delete:
        print(f"deleted the endpoint {delete_endpoint(spec, model)}")
        return 0
    if args.promote:
        print(promote_candidate(spec, model, args.tracking_uri).describe("promoted"))
    plan = plan_deployment(spec, model=model, tracking_uri=args.tracking_uri)
    print(f"deploying {plan.describe()}")
    endpoint = deploy(plan)
    for note in endpoint.notes:
        print(f"note: {note}")
    print(f"serving {endpoint.plan.kind} {plan.model} at {endpoint.url}  (docs: {endpoint.url}/docs)")
    if args.query:
        ok, lines = query_endpoint(endpoint)
        print("\n".join(lines[:1] + (lines[1:] if ok else [])))
        if not ok:
            print("\n".join(lines[1:]), file=sys.stderr)
        return 0 if ok else 1
    if started_local_ray():
        _wait_until_stopped("no Ray cluster was running, so this one lives as long as this command: Ctrl-C "
                            "(or SIGTERM) stops it")
    return 0


def _wait_until_stopped(message: str) -> None:
    """Block until Ctrl-C or SIGTERM, which end the same way: the endpoint and the local Ray go with
    the process (Ray's own SIGTERM handler, installed by ray.init, would exit with 15 instead)."""
    _stop_on_sigterm()
    try:  # the message inside: a signal that comes as soon as it is read still ends here
        print(message, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)


def _stop_on_sigterm() -> None:
    """SIGTERM (`kill`, `docker stop`, a service manager) raises KeyboardInterrupt, as Ctrl-C does."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _deploy_apps(args) -> int:
    from flotilla.serve import deploy_apps  # lazy

    if args.config and args.serve_config and args.config != args.serve_config:
        args.parser.error(f"two Serve config files, {args.config} and {args.serve_config}: give one, with -c")
    path = args.config or args.serve_config
    if path is None:
        args.parser.error("no Serve config file given: pass -c serve_apps/config.yaml (or your own)")
    urls = deploy_apps(path, address=args.address, working_dir=args.working_dir, timeout_s=args.timeout)
    for name, url in urls.items():
        print(f"serving {name} at {url}")
    return 0


def _promote(args) -> int:
    from flotilla.track import registry_client, resolve_reference, rollback_champion, set_alias  # lazy

    ref = _model_reference(args, name_alone=True, paths=False)
    if ref is not None and ref.target is not None and (args.version or args.rollback):
        args.parser.error(f"--model {args.model} names the version already; drop --version/--rollback, or give "
                          f"--model {ref.name}")
    if ref is None or ref.target is None:
        if not (args.version or args.rollback):
            args.parser.error("name the version: --version N, --model NAME/VERSION or NAME@ALIAS, or --rollback")
    spec = load_spec(args.config) if args.config else None
    name = ref.name if ref is not None else (spec and (spec.track.model_name or spec.name))
    if not name:
        raise SpecError(["name the model: --model NAME, or --config SPEC.yaml"], "flotilla promote")
    client = registry_client(args.tracking_uri or (spec.track.uri if spec else None))
    if args.rollback:
        print(rollback_champion(client, name).describe("rolled back"))
    else:
        version = args.version or resolve_reference(client, ref, "flotilla promote")[1]
        print(set_alias(client, name, args.alias, version, force=args.force).describe("promoted"))
    return 0


def _predict(args) -> int:
    from flotilla.predict import predict_table  # lazy

    outcome = predict_table(args.model, args.input, args.output, id_columns=args.id_columns,
                            tracking_uri=args.tracking_uri, actors=args.actors, batch_size=args.batch_size,
                            factories=args.factories)
    print(outcome.describe())
    if outcome.mlflow_run_id:
        print(f"MLflow run {outcome.mlflow_run_id} (batch prediction, linked to {outcome.model})")
    return 0


def _export(args) -> int:
    from flotilla.export import export_model  # lazy

    outcome = export_model(args.model, tracking_uri=args.tracking_uri, config=args.config, overrides=args.overrides,
                           factories=args.factories)
    print(outcome.describe())
    return 0


def _eval(args) -> int:
    from flotilla.evaluate import evaluate_model  # lazy

    outcome = evaluate_model(args.model, args.tasks, args.tracking_uri, base_url=args.base_url, config=args.config,
                             overrides=args.overrides, limit=args.limit, chat=args.chat, runtime=args.runtime)
    print(outcome.describe())
    return 0


def _validate(args) -> int:

    spec = _load(args)
    problems, notes = check_local_paths(spec)  # what this machine can see, before Ray or torch is imported
    if problems:
        raise SpecError(problems, args.config)
    print(f"# {args.config}: well-formed; resolved with every default:")
    for note in notes:
        print(f"# not checked: {note}")
    print(spec_to_yaml(spec), end="")
    return 0


def _config(args) -> int:

    print(spec_json_schema() if args.schema else spec_reference_markdown())
    return 0


# ------------------------------------------------------------------- helpers
def _no_spec_message(command: str) -> str:
    """What to pass instead of nothing: a spec from configs/."""

    return f"no run spec given: pass --config configs/{SPEC_REQUIRED[command]} ({shipped_specs()})"


def _browse_hint(uri: str | None) -> str:
    """How to look at a SQLite store: `mlflow ui` in its directory when it is MLflow's default."""
    if not uri or not uri.startswith("sqlite:///"):
        return ""
    from pathlib import Path

    db = Path(uri.removeprefix("sqlite:///"))
    if db.name == "mlflow.db" and db.parent == Path.cwd().resolve():
        return "; browse: mlflow ui"
    return f"; browse: mlflow ui --backend-store-uri {uri}"


def _print_resume_hint(args, code: int) -> None:
    """After a training run failed or was interrupted: the exact command that continues it."""
    run_name = getattr(args, "run_name", None)
    if args.command != "train" or run_name is None or code not in (1, 3, 130):
        return
    words = ["flotilla", "train"]
    if args.config:
        words += ["--config", args.config]
    for item in args.overrides:
        words += ["--set", item]
    if args.tracking_uri:
        words += ["--tracking-uri", args.tracking_uri]
    words += ["--resume", run_name]
    print(f"resume with: {shlex.join(words)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
