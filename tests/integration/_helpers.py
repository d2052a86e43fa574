"""Helpers shared by the integration tests."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from flotilla.spec import RunSpec, load_spec
from flotilla.data import resolve_source, split_rows

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "configs" / "digits.yaml"


def digits_spec(storage: Path, *overrides: str) -> RunSpec:
    """The default config with its runs and its MLflow store under `storage`."""
    return load_spec(DIGITS, [f"train.storage_path={storage}", f"track.uri={store_uri(storage)}", *overrides])


def store_uri(directory: Path) -> str:
    return f"sqlite:///{directory}/mlflow.db"


def mlflow_runs(uri: str, experiment: str = "digits"):
    """Every MLflow run of `experiment` in the store at `uri`."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id]) if exp else [])


def metric_steps(client, run_id: str, key: str = "train_loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def digits_val_rows(spec: RunSpec):
    """The validation rows of the digits sample, exactly as the pipeline splits them."""
    df = pq.read_table(resolve_source("digits").paths[0]).to_pandas()
    val = split_rows(df, spec.data.split_seed, spec.data.val_fraction, "val")
    return val.drop(columns=["target"]), val["target"].to_numpy()


def accuracy(predictions, labels) -> float:
    return float(np.mean(np.asarray(predictions) == labels))


def own_ray_processes(prefix: str) -> list:
    """This session's Ray worker processes whose title starts with `prefix` (`ray::RayTrainWorker`,
    `ray::_trial`): descendants of its raylet, never another cluster's on the same machine (the
    other test lane's, test_hosts' hosts)."""
    import psutil
    import ray
    from ray._private import ray_constants

    node = ray._private.worker.global_worker.node
    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    found = []
    for p in raylet.children(recursive=True):
        try:
            if p.cmdline() and p.cmdline()[0].startswith(prefix):
                found.append(p)
        except psutil.Error:
            pass
    return found


def haproxy_processes() -> list:
    """Serve's HAProxy processes on this machine's network (children of its HAProxyManager actors),
    not those of test_hosts' hosts, each in a network namespace of its own."""
    import psutil

    own = os.readlink("/proc/self/ns/net")

    def here(pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/net") == own
        except OSError:  # gone meanwhile
            return False

    return [p for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] == "haproxy" and "haproxy-serve" in " ".join(p.info["cmdline"] or []) and here(p.pid)]


def plant_code(uri: str, directory: Path, model: str = "digits", version: str = "1") -> tuple[str, Path]:
    """What anyone with write access to the registry at `uri` can do: register a new version of
    `model` made of `version`'s files, its pyfunc code extended to write a marker file whenever it
    runs. The new version, and the marker's path (absent until the planted code runs)."""
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(uri)
    files = Path(download_artifacts(artifact_uri=client.get_model_version_download_uri(model, version),
                                    dst_path=str(directory / "planted"), tracking_uri=uri))
    marker = directory / "planted-code-ran"
    code = files / "bundle_pyfunc.py"
    code.write_text(code.read_text() + f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    run = client.create_run(client.get_experiment_by_name(model).experiment_id, run_name="planted")
    client.log_artifacts(run.info.run_id, str(files), "model")
    client.set_terminated(run.info.run_id)
    planted = client.create_model_version(model, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    return str(planted.version), marker


def messy_table(n: int, seed: int):
    """Rows as tables come: `city` strings with gaps (5 %), `member` booleans, `x1` numbers,
    `x2` numbers with gaps (15 %); the label `answer` (yes/no) follows from city, member and x1
    with a margin, so a model that reads them all is right on nearly every row."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    city = rng.choice(["Berlin", "Paris", "Rome", "Oslo"], n).astype(object)
    member = rng.random(n) < 0.4
    x1 = rng.normal(size=n)
    x2 = rng.normal(size=n)
    score = 1.5 * x1 + 2.0 * (city == "Paris") - 2.0 * (city == "Oslo") + 1.0 * member - 0.5 + 0.2 * x2
    keep = np.abs(score) > 0.3  # a margin: no row sits on the boundary
    df = pd.DataFrame({"city": city, "member": member, "x1": x1, "x2": x2,
                       "answer": np.where(score > 0, "yes", "no")})[keep].reset_index(drop=True)
    df.loc[rng.random(len(df)) < 0.05, "city"] = None
    df.loc[rng.random(len(df)) < 0.15, "x2"] = np.nan
    return df


def tables_spec(storage: Path, source: Path | None = None, overrides: list[str] = ()) -> RunSpec:
    """Model `tables` on the messy table (written under `storage` once), or on `source`."""
    if source is None:
        source = storage / "tables.csv"
        if not source.exists():
            messy_table(3000, seed=0).to_csv(source, index=False)
    return digits_spec(storage, "name=tables", "track.model_name=tables", f"data.source={source}", "data.label=answer",
                       "model.hidden=[32]", "train.epochs=6", "train.batch_size=32", "track.gate.require=[]",
                       *overrides)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    """`predicate()`'s first truthy value, asked every `interval_s` for up to `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def metrics_text() -> str:
    """What the session's Ray exports to Prometheus (Serve's replicas' metrics included)."""
    import ray
    import requests

    port = ray._private.worker.global_worker.node.metrics_export_port
    return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def metric_sum(text: str, name: str, **labels) -> float:
    """The sum of metric `name`'s series in `text` that carry `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def worker_killed_after_first_checkpoint(run_dir: Path):
    """While the block trains the run in `run_dir`, SIGKILL one of its Ray Train workers once Ray Train
    has registered the epoch-1 checkpoint (it is in the snapshot the controller writes), not merely
    when its files appear. Yields the list of killed pids (one, or none if it never came to that)."""
    import os
    import signal
    import threading
    import time

    killed: list[int] = []
    snapshot = run_dir / "checkpoint_manager_snapshot.json"

    def kill() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if snapshot.exists() and "checkpoint_epoch0001" in snapshot.read_text():
                pids = [p.pid for p in own_ray_processes("ray::RayTrainWorker")]
                if pids:
                    os.kill(pids[-1], signal.SIGKILL)
                    killed.append(pids[-1])
                    return
            time.sleep(0.1)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    yield killed
    killer.join(timeout=5)


def assert_leaving_clients_stop_generating(app: str, url: str, endless: dict) -> None:
    """`endless` (a request body that would keep Serve app `app`'s one replica generating for
    minutes) is posted to `url` as a stream whose reader leaves after 5 events, then whole by clients
    that give up after 1 s: each time, the replica burns almost no CPU once the client has gone.
    Several whole-text tries, since HAProxy with Ray's `option splice-request` (which Flotilla's
    wrapper removes) lost about 1 close in 4."""
    import time

    import psutil
    import pytest
    import ray
    import requests
    from ray.util.state import list_actors

    replicas = [psutil.Process(a.pid) for a in list_actors(address=ray.get_runtime_context().gcs_address,
                                                            filters=[("state", "=", "ALIVE")], limit=1000)
                if a.class_name.startswith(f"ServeReplica:{app}:")]
    assert len(replicas) == 1, replicas
    (process,) = replicas

    def cpu_seconds_over(seconds: float) -> float:  # a generating replica burns ~1 s of CPU a second
        time.sleep(0.5)  # the disconnect reaches the replica
        before = sum(process.cpu_times()[:2])
        time.sleep(seconds)
        return sum(process.cpu_times()[:2]) - before

    with requests.post(url, json={**endless, "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        events = 0
        for line in r.iter_lines(decode_unicode=True):
            events += line.startswith("data: ")
            if events == 5:
                break
    assert events == 5
    assert cpu_seconds_over(2) < 0.4, "the replica kept generating for a stream whose client left"
    for _ in range(4):
        with pytest.raises(requests.ReadTimeout):
            requests.post(url, json=endless, timeout=1)
        assert cpu_seconds_over(1) < 0.2, "the replica kept generating for a request whose client left"


def instruct_spec(store: Path, tiny_llama: str, *overrides: str) -> RunSpec:
    """configs/instruct_lora.yaml on the tiny Llama at `tiny_llama`, its runs and MLflow store under `store`."""
    return load_spec(ROOT / "configs" / "instruct_lora.yaml", [
        f"model.pretrained={tiny_llama}", f"train.storage_path={store / 'runs'}", f"track.uri={store_uri(store)}",
        *overrides])


# ------------------------------------------------------------------ fuzzing an endpoint
FUZZ_CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "application/problem+json",
                      "text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""]


def published_body(base_url: str, path: str) -> dict:
    """The request body schema that the app at `base_url` publishes for `POST path` in its OpenAPI
    document (`/openapi.json`): what a client, or a fuzzer, reads the API from."""
    import requests

    document = requests.get(base_url + "/openapi.json", timeout=30).json()
    return document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def any_json():
    """Hypothesis: any JSON value, with NaN, Infinity and integers past int64."""
    from hypothesis import strategies as st

    big = st.integers(min_value=-(2**70), max_value=2**70)
    scalars = st.none() | st.booleans() | big | st.floats() | st.text(max_size=12)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=12)


def fuzz(target: str, bodies, examples: int, clients: int = 8):
    """Sends `examples` requests drawn by Hypothesis (the same ones every run: derandomized) to
    `target`: each a body from `bodies` as JSON, or raw bytes, with a Content-Type from
    FUZZ_CONTENT_TYPES; `clients` at once. Returns the count of answers by status, and
    (content type, body, status, text) for each answer that is a 5xx or a stream that ended with
    a server error other than a deadline."""
    import json
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    import requests
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cases: list[tuple[bytes, str]] = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies.map(lambda b: json.dumps(b).encode()) | st.binary(max_size=200),
           kind=st.just("application/json") | st.sampled_from(FUZZ_CONTENT_TYPES))
    def draw(body: bytes, kind: str):
        cases.append((body, kind))

    draw()  # the cases first, then sent by several clients at once: the same answers, sooner
    session = requests.Session()

    def send(case):
        body, kind = case
        r = session.post(target, data=body, headers={"content-type": kind} if kind else {}, timeout=120)
        return body, kind, r.status_code, r.text

    statuses: Counter = Counter()
    server_errors: list[tuple] = []
    with ThreadPoolExecutor(clients) as pool:
        for body, kind, status, text in pool.map(send, cases):
            statuses[status] += 1
            streamed_fault = status == 200 and ("data: " in text or "event: " in text) and \
                ('"server_error"' in text or '"status": 500' in text) and "request_timeout_s" not in text
            if status >= 500 or streamed_fault:
                server_errors.append((kind, body[:200], status, text[:300]))
    return statuses, server_errors
