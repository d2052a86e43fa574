"""`flotilla eval`: judge a registered language model with lm-evaluation-harness, through its endpoint.

    outcome = evaluate_model("instruct-lora@candidate", "evals/arith")
    outcome.metrics            # {"eval.arith.acc": 0.4, "eval.arith_gen.exact_match": 0.1}

The harness (the `lm-eval` library, its `local-completions` model) talks to the version's
OpenAI-compatible `/v1/completions` as it talks to vLLM or OpenAI: log-likelihoods from `echo` and
`logprobs`, generations from `max_tokens`, `temperature: 0` and `stop`. `base_url` is the OpenAI
base URL of an endpoint that serves the model already (`http://HOST:8000/v1`, the router, or a
model's own `.../v1/models/NAME/v1`); without one the
version is served for the duration, as a Serve application of its own that the `/v1` router does
not list (`PRIVATE_APP_PREFIX`), deleted afterwards.

Tasks are the harness's own YAML files, from a directory (or one file) of the user's: a path in a
task's `dataset_kwargs.data_files` is relative to its YAML file, so a task and its JSON Lines data
travel together. Each task's metrics are logged to the version (tags `eval.<task>.<metric>`, and
metrics of the version's run), with the harness's results as an artifact of that run
(`eval/<tasks>.json`). The gate (`track.gate.require: ["eval.arith.acc >= 0.8"]`) reads them.

`runtime` judges one of the version's ONNX variants (`flotilla export`: `onnx-int4`, ...) instead:
the variant is served, then torch, on the same tasks; the variant's scores are logged as
`variant.<runtime>.eval.<task>.<metric>`, and a score worse than torch's by more than
`export.max_eval_drop` fails the variant's gate (`flotilla.export.judge_variant_scores`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from flotilla.errors import SpecError, TrackingError
from flotilla.export import judge_variant_scores, recorded_spec, version_spec_file
from flotilla.serve import PRIVATE_APP_PREFIX, deploy, plan_deployment
from flotilla.track import CHAMPION, GATE_TAG, alias_version, gate_with_scores, local_bundle

EVAL_PREFIX = "eval."  # tags and run metrics: eval.<task>.<metric>


@dataclass
class EvalOutcome:
    model: str
    version: str
    metrics: dict[str, float]
    served_at: str
    results: dict[str, Any] = field(repr=False, default_factory=dict)
    gate: Any = None  # flotilla.track.Registration: the gate decided again (it was waiting for these scores)
    note: str | None = None

    def describe(self) -> str:
        lines = [f"{self.model} v{self.version}, through {self.served_at}:"]
        lines += [f"  {name} {value:.4f}" for name, value in sorted(self.metrics.items())]
        if self.note:
            lines.append(self.note)
        if self.gate is not None:
            promoted = "; now champion" if self.gate.champion else ""
            lines.append(f"gate {self.gate.gate.summary()}{promoted}")
        return "\n".join(lines)


def evaluate_model(reference: str, tasks: str, tracking_uri: str | None = None, *, base_url: str | None = None,
                   config: str | None = None, overrides: list[str] = (), limit: int | None = None,
                   chat: bool | None = None, runtime: str = "torch") -> EvalOutcome:
    """Run the tasks at `tasks` (a directory of task YAML files, or one) against the registered
    version `reference` names, and log each task's metrics to it. `chat`: render each prompt as a
    user turn with the model's chat template (None: when its tokenizer has one, as training
    rendered instructions). `runtime`: what runs the model (torch, or a variant to judge)."""
    with tempfile.TemporaryDirectory(prefix="flotilla-eval-") as tmp, \
            local_bundle(reference, tracking_uri, "flotilla eval") as found:
        if found.client is None:
            raise SpecError([f"--model {reference}: `flotilla eval` judges a registered version (NAME@ALIAS, "
                             "NAME/VERSION), whose metrics it logs; register the bundle first"])
        names, include = task_files(tasks, Path(tmp) / "tasks")
        if chat is None:
            chat = bool(_chat_template(found.path))
        context = _context_of(found.path)
        served = [*overrides, f"serve.runtime={runtime}"]  # (whatever --set says: the scores are this runtime's)
        with _served(found, base_url, config, served, Path(tmp), runtime) as url:
            results = run_harness(url, found.name, found.path, names, include, limit=limit, chat=chat,
                                  max_length=context)
        metrics = task_metrics(results)
        if runtime != "torch":
            return _judge_variant(found, runtime, url, results, metrics, names, include, Path(tmp), config=config,
                                  overrides=list(overrides), limit=limit, chat=chat, context=context)
        _log(found.client, found.name, found.version, metrics, results, names, Path(tmp))
        waiting = found.client.get_model_version(found.name, found.version).tags.get(GATE_TAG) == "pending"
        if not waiting or limit is not None:  # (a sample of each task scores, it does not decide)
            note = "gate not decided: --limit scores a sample of each task" if waiting else None
            return EvalOutcome(found.name, found.version, metrics, url, results, None, note)
        # The gate the version was registered under (its run's spec), whatever -c or --set serve with.
        gate, versus = recorded_spec(_spec_file(found, Path(tmp)), []).track.gate, None
        champion = alias_version(found.client, found.name, CHAMPION)
        if gate.beat_champion and champion not in (None, found.version):
            # The champion on the same tasks, served the same way, for the duration.
            with local_bundle(f"{found.name}/{champion}", found.client.tracking_uri, "flotilla eval") as theirs, \
                    _served(theirs, None, config, served, Path(tmp) / "champion") as their_url:
                their = run_harness(their_url, found.name, theirs.path, names, include, chat=chat, max_length=context)
            theirs_metrics = task_metrics(their)
            _log(found.client, found.name, champion, theirs_metrics, their, names, Path(tmp) / "champion")
            better = higher_is_better(results)
            versus = {k: (v, theirs_metrics[k], better.get(k, True)) for k, v in metrics.items() if k in theirs_metrics}
        gated = gate_with_scores(found.client, found.name, found.version, gate, versus, champion)
        return EvalOutcome(found.name, found.version, metrics, url, results, gated)


def _judge_variant(found, runtime: str, url: str, results: dict[str, Any], metrics: dict[str, float], names: list[str],
                   include: Path, tmp: Path, *, config: str | None, overrides: list[str], limit: int | None, chat: bool,
                   context: int | None) -> EvalOutcome:
    """A variant's scores (`metrics`, of the harness's `results`), logged under its name; then torch on
    the same tasks, and the variant's gate."""
    own = {f"variant.{runtime}.{key}": value for key, value in metrics.items()}
    _log(found.client, found.name, found.version, own, results, [runtime, *names], tmp)
    if limit is not None:
        return EvalOutcome(found.name, found.version, own, url, results, None,
                           f"{runtime} not judged: --limit scores a sample of each task")
    with _served(found, None, config, [*overrides, "serve.runtime=torch"], tmp / "torch", "torch") as torch_url:
        theirs = task_metrics(run_harness(torch_url, found.name, found.path, names, include, chat=chat,
                                          max_length=context))
    better = higher_is_better(results)
    max_drop = recorded_spec(config or _spec_file(found, tmp), overrides).export.max_eval_drop
    record = judge_variant_scores(found, runtime, {k: (v, theirs[k], better.get(k, True))
                                                   for k, v in metrics.items() if k in theirs}, max_drop)
    verdict = f"{runtime} gate {'passed' if record['passed'] else 'FAILED'}: {record['reason']}"
    return EvalOutcome(found.name, found.version, own, url, results, None, verdict)


def task_files(tasks: str, into: Path) -> tuple[list[str], Path]:
    """The task names at `tasks` and a directory of their YAML files with each `data_files` path
    made absolute (relative to the YAML file it is written in), for the harness's TaskManager."""
    source = Path(tasks).expanduser()
    files = sorted(source.glob("*.yaml")) + sorted(source.glob("*.yml")) if source.is_dir() else [source]
    if not source.exists() or not files:
        raise SpecError([f"--tasks {tasks}: no task YAML files there; point it at a directory of lm-evaluation-harness "
                         "task files (e.g. evals/arith) or at one such file"])
    into.mkdir(parents=True, exist_ok=True)
    names = []
    for path in files:
        try:
            task = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise SpecError([f"--tasks: {path} is not YAML: {e}"]) from None
        if not isinstance(task, dict) or not isinstance(task.get("task"), str):
            raise SpecError([f"--tasks: {path} is not an lm-evaluation-harness task (no `task:` name)"])
        files_of = (task.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files_of, dict):
            task["dataset_kwargs"]["data_files"] = {split: _beside(path, f) for split, f in files_of.items()}
        elif files_of is not None:
            task["dataset_kwargs"]["data_files"] = _beside(path, files_of)
        (into / path.name).write_text(yaml.safe_dump(task, sort_keys=False))
        names.append(task["task"])
    return names, into


def _beside(yaml_file: Path, data: Any) -> Any:
    if isinstance(data, list):
        return [_beside(yaml_file, d) for d in data]
    if not isinstance(data, str) or "://" in data or Path(data).is_absolute():
        return data
    found = (yaml_file.parent / data).resolve()
    if not found.exists():
        raise SpecError([f"--tasks: {yaml_file} names data file {data!r}, which is not at {found}"])
    return str(found)


def _chat_template(bundle_dir: Path) -> str | None:
    from flotilla.data._instruct import load_tokenizer

    return load_tokenizer(str(bundle_dir)).chat_template


@contextlib.contextmanager
def _served(found, base_url: str | None, config: str | None, overrides: list[str], tmp: Path,
            runtime: str = "torch") -> Iterator[str]:
    """The URL of an endpoint answering for the version, run by `runtime`: `base_url`, or one deployed
    for the duration (all traffic to this version, on a prefix of its own, not listed by the `/v1`
    router)."""
    if base_url:
        url = base_url.rstrip("/")  # an OpenAI base URL: what clients take, `.../v1`
        _check_serves(url, found.name, found.version, runtime)
        yield url
        return
    from ray import serve

    # Its own application and prefix per evaluation (two at once never answer for each other).
    app = f"{PRIVATE_APP_PREFIX}{found.name}-v{found.version}-{uuid.uuid4().hex[:6]}"
    spec = recorded_spec(config or _spec_file(found, tmp), [
        *overrides, f"serve.traffic={{'{found.version}': 100}}", f"serve.route_prefix=/{app}", "serve.shadow=null",
        "serve.openai_router=false", "serve.autoscaling.min_replicas=1", "serve.autoscaling.max_replicas=1"])
    plan = plan_deployment(spec, model=found.name, tracking_uri=found.client.tracking_uri)
    if plan.kind != "chat":
        raise SpecError([f"{found.name} v{found.version} is not a language model (its endpoint is {plan.kind}); "
                         "`flotilla eval` judges language models"])
    try:
        endpoint = deploy(plan, app_name=app)
        yield endpoint.url + "/v1"
    finally:
        with contextlib.suppress(Exception):
            serve.delete(app)


def _check_serves(url: str, name: str, version: str, runtime: str = "torch", probes: int = 3) -> None:
    """`url` answers `name` with `version` run by `runtime` (the headers of a few short completions):
    the scores go to that version, and a split or a champion elsewhere would score another one."""
    import requests

    from flotilla.serve import RUNTIME_HEADER, VERSION_HEADER

    seen, runtimes = set(), set()
    for _ in range(probes):
        answer = requests.post(f"{url}/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1}, timeout=120)
        if answer.status_code != 200:
            raise SpecError([f"--base-url {url}: a completion for {name!r} answered {answer.status_code}: "
                             f"{answer.text[:300]}"])
        seen.add(answer.headers.get(VERSION_HEADER))
        runtimes.add(answer.headers.get(RUNTIME_HEADER))
    if seen == {version} and runtimes != {runtime}:
        raise SpecError([f"--base-url {url} runs {name} v{version} with {', '.join(sorted(r or '?' for r in runtimes))}, "
                         f"not {runtime}: its scores would be another runtime's. Leave --base-url out to serve it "
                         f"with {runtime} for the duration"])
    if seen != {version}:
        shown = ", ".join(f"v{v}" for v in sorted(s or "?" for s in seen))
        raise SpecError([f"--base-url {url} answers {name} with {shown}, not only v{version}: its scores would be "
                         f"another version's. Leave --base-url out to serve v{version} for the duration"])


def _context_of(bundle_dir: Path) -> int | None:
    """The longest sequence the model reads (its config's `max_position_embeddings`), where it says."""
    from transformers import AutoConfig

    model = json.loads((bundle_dir / "model.json").read_text())
    base = (model.get("base") or {}).get("path")
    for where in (bundle_dir, base):
        with contextlib.suppress(Exception):
            return int(AutoConfig.from_pretrained(str(where)).max_position_embeddings)
    return None


def _spec_file(found, tmp: Path) -> str:
    """The spec the version was trained with (its run's spec.yaml), downloaded once into `tmp`."""
    done = tmp / "run" / "spec.yaml"
    if done.is_file():
        return str(done)
    return version_spec_file(found, found.client.get_model_version(found.name, found.version).run_id, tmp)


def run_harness(url: str, model: str, tokenizer: Path, tasks: list[str], include: Path, *, limit: int | None = None,
                chat: bool = False, max_length: int | None = None) -> dict[str, Any]:
    """lm-evaluation-harness's `simple_evaluate` with its `local-completions` model at the OpenAI base
    URL `url` (`.../v1`): the
    task files under `include` only (none of the harness's built-in tasks, which download data)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    for name in ("lm-eval", "lm_eval"):  # its INFO lines are a page per task
        logging.getLogger(name).setLevel(logging.WARNING)
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{url}/completions", "model": model, "tokenizer": str(tokenizer),
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                    "max_retries": 2, "timeout": 300,
                    **({"max_length": max_length} if max_length else {})},
        tasks=tasks, task_manager=TaskManager(include_path=str(include), include_defaults=False), limit=limit,
        apply_chat_template=chat, log_samples=False, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0,
    )


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """`eval.<task>.<metric>` for each task's metrics (the harness names them `metric,filter`; the
    filter is kept unless it is `none`; standard errors are left out)."""
    out = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            metric, _, filtered = key.partition(",")
            if not filtered or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            name = metric if filtered == "none" else f"{metric}_{filtered}"
            out[f"{EVAL_PREFIX}{task}.{name.replace('-', '_')}"] = float(value)
    return out


def higher_is_better(results: dict[str, Any]) -> dict[str, bool]:
    """Whether each `eval.<task>.<metric>` is better higher, as the harness says of its metrics."""
    out = {}
    for task, metrics in (results.get("higher_is_better") or {}).items():
        for metric, better in (metrics or {}).items():
            out[f"{EVAL_PREFIX}{task}.{metric.replace('-', '_')}"] = bool(better)
    return out


def _log(client, name: str, version: str, metrics: dict[str, float], results: dict[str, Any], tasks: list[str],
         tmp: Path) -> None:
    """Each metric as a tag of the version and a metric of its run; the results as its run's artifact."""
    from mlflow.entities import Metric

    run_id = client.get_model_version(name, version).run_id
    for key, value in metrics.items():
        client.set_model_version_tag(name, version, key, f"{value:.6g}")
    if run_id is None:
        raise TrackingError(f"{name} v{version} has no run to log its evaluation to")
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])
    out = tmp / "eval" / f"{'+'.join(tasks)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: results.get(k) for k in ("results", "configs", "versions", "n-shot", "config")},
                              indent=1, default=str))
    client.log_artifact(run_id, str(out), artifact_path="eval")
