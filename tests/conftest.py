"""Shared fixtures: a local Ray cluster for integration tests and hygiene for global state."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

# Tests write built-in samples to a cache of their own, never the user's.
os.environ.setdefault("FLOTILLA_CACHE", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "flotilla"))
# ...and track to a store of their own (tests that check tracking pass an explicit track.uri).
os.environ.setdefault(
    "MLFLOW_TRACKING_URI",
    "sqlite:///" + os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "mlflow", "mlflow.db")),
)

# Checkpoint manifests are signed with a key of the suite's own, never one made in the user's home
# (test_checkpoint.py checks that one too, in a temporary home).
os.environ.setdefault("FLOTILLA_CHECKPOINT_KEY", os.urandom(16).hex())

# The suite runs more busy threads than the machine has cores (two lanes; training workers, Ray
# Data, replicas, each with its own thread pool). GNU OpenMP's threads spin at every barrier by
# default; on 2 cores three processes training a small MLP with 2 threads each took ~6x as long as
# with threads that sleep (~120 s against ~20 s each). Set before any process of the suite loads
# torch: the lanes, and every Ray process they start, inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Ray exports application metrics every 10 s by default; a test run lasts seconds. Set before any
# local Ray starts, so its processes (and the workers they spawn) export every 2 s.
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")

# A raylet starts a Python worker per CPU when the first driver connects, in no runtime environment;
# every Flotilla job has one (its code, as `py_modules`), so none of them ever runs a task here:
# ~1.3 CPU-seconds each, at every node the suite starts, for nothing.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

# `pytest -n 2 --dist loadgroup` runs the suite in two lanes at once: it spends a third of its time
# waiting (clusters starting, autoscalers, health checks, load for N seconds). One lane holds the
# modules that use the session's trained models (`digits_champion`, ...) or Serve on the local Ray;
# the other the modules that build clusters of their own (Serve there runs in other network
# namespaces), those that need only a local Ray, which that lane starts for itself, and the unit
# tests (no Ray): about equal halves (measured 2026-12-07: ~3100 and ~2900 s of the lanes' time).
# Each lane is one process that runs its modules in file order, so module- and session-scoped
# fixtures are built once. The hosts of test_hosts.py (marked `hosts`) are in neither: `make test`
# runs them after the lanes, alone.
OWN_CLUSTERS = {"test_autoscaling", "test_cluster", "test_hosts", "test_streaming",
                "test_bad_input", "test_finetune_weights", "test_tracking_server", "test_tune",
                "test_comm", "test_resize", "test_data_order", "test_drain_view", "test_slow_link"}


def lane(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    own = "/integration/" not in path or Path(path).stem in OWN_CLUSTERS
    return "own-clusters" if own else "session-ray"


def pytest_itemcollected(item):
    """Each test joins its lane: pytest-xdist's `xdist_group` mark, read when collection ends;
    `--dist loadgroup` gives each group to one worker, which runs it in the order below."""
    item.add_marker(pytest.mark.xdist_group(lane(item.nodeid)))


def pytest_collection_modifyitems(config, items):
    """Otherwise in the files' order:
    - test_monitoring.py runs first of the modules on the session's local Ray: the session's
      Prometheus watches from before `digits_champion` trains until that module is done with it,
      and no longer (see `prometheus`);
    - test_serve_proxy.py runs last: the ingress is chosen when Ray starts, so the module shuts the
      session's Ray (HAProxy ingress, the default) down for one with Serve's Python proxy, and every
      module after it would start the session's Ray again (~15 s)."""
    monitoring = [item for item in items if "test_monitoring.py" in item.nodeid]
    rest = [item for item in items if "test_monitoring.py" not in item.nodeid]
    first = next((k for k, item in enumerate(rest) if lane(item.nodeid) == "session-ray"), len(rest))
    items[:] = rest[:first] + monitoring + rest[first:]
    items.sort(key=lambda item: "test_serve_proxy.py" in item.nodeid)


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A session that ran Ray ends its process here, with the session's exit status, instead of
    tearing down the interpreter: Ray's background threads can outlive `ray.shutdown()` (more so
    once the session restarted Ray, as test_serve_proxy does), and one that wakes while Python
    finalizes crashes the process after every test passed (seen once: a segmentation fault after
    the summary). Everything the run reports is written by then."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is not None and "ray" in sys.modules and not hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


@pytest.fixture(autouse=True)
def _restore_environment():
    """One test's environment variables never leak into the next."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(scope="session")
def _ray_session():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _local_ray():
    """The session's local Ray: 3 logical CPUs, 2 training workers plus one for Ray Data's tasks.

    Started once for the session (starting Ray costs ~10 s on 2 cores and the tests leave no state
    in it beyond finished runs under their own tmp directories); started again after a module
    that needed a cluster of its own (test_serve_proxy) shut it down.
    """
    import ray

    from flotilla.runtime import ensure_ray

    if ray.is_initialized() and ray.cluster_resources().get("CPU") != 3:
        ray.shutdown()  # some other Ray than the one these tests are written for
    if not ray.is_initialized():
        # The dashboard stays on: Ray Train's placement-group cleaner asks its state API whether a
        # controller died (a trial stopped by ASHA), and without it the stopped run's CPUs leak.
        ensure_ray(num_cpus=3, address="local")
    return ray


@pytest.fixture(scope="module")
def ray_cluster(_ray_session):
    yield _local_ray()


@dataclass
class TrainedModel:
    """One finished, registered run, shared by the modules that only need a model to exist."""

    spec: object
    outcome: object
    store: Path  # its runs and its MLflow store (mlflow.db, artifacts under mlruns/)

    def store_copy(self, directory: Path) -> str:
        """A private copy of the MLflow store in `directory` (its registry can change freely; the
        artifacts stay shared, append-only): the tracking URI of the copy."""
        shutil.copy(self.store / "mlflow.db", directory / "mlflow.db")
        return f"sqlite:///{directory}/mlflow.db"


@dataclass
class Prometheus:
    """A running Prometheus: its URL, and `stop()` for the module that is done with it."""

    url: str
    stop: Callable[[], None]


@pytest.fixture(scope="session")
def prometheus(_ray_session):
    """A real Prometheus, configured from ops/prometheus.yml as shipped (scraping every 2 s), that
    watches the session's local Ray from before its first training run: test_monitoring queries
    what `digits_champion`'s run exported, with no training run of its own, and then stops it. (Each
    scrape makes Ray's metrics agent render every series the session has exported, which grows
    with every run and endpoint: scraped every second to the end of the suite, the agent burned a
    core for most of it, 18 CPU-minutes in one run.)"""
    import contextlib
    import time

    import yaml

    from tests.integration._helpers import ROOT
    from tests.services import prometheus_server

    ray = _local_ray()
    node = ray._private.worker.global_worker.node
    discovery = Path(node.get_session_dir_path()) / "prom_metrics_service_discovery.json"
    deadline = time.monotonic() + 60
    while not discovery.exists():
        assert time.monotonic() < deadline, f"Ray never wrote {discovery}"
        time.sleep(1)
    config = yaml.safe_load((ROOT / "ops" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "2s"
    sd = config["scrape_configs"][0]["file_sd_configs"][0]
    assert sd["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]  # Ray's default temp dir
    sd["files"], sd["refresh_interval"] = [str(discovery)], "2s"
    with contextlib.ExitStack() as running:
        url = running.enter_context(prometheus_server(config))
        yield Prometheus(url, running.close)


@pytest.fixture(scope="session")
def digits_champion(_ray_session, prometheus, tmp_path_factory) -> TrainedModel:
    """The default digits run as `make demo` trains it (ZeRO-2, 2 workers, gate val_accuracy >= 0.95),
    with a CPU price: registered as digits v1, candidate and champion. Trained once per session,
    with `prometheus` scraping it."""
    from flotilla.pipeline import run_training
    from tests.integration._helpers import digits_spec

    _local_ray()
    store = tmp_path_factory.mktemp("digits-champion")
    spec = digits_spec(store, "cost.cpu_hour=0.05", "cost.currency=EUR")
    return TrainedModel(spec, run_training(spec), store)


# The small byte-level GPT of the suite: two layers, activation checkpointing, gradient accumulation.
GPT_TEST = ["data.max_bytes=80000", "model.layers=2", "model.heads=2", "model.width=64", "model.context=64",
            "model.activation_checkpointing=true", "train.epochs=2", "train.batch_size=32", "train.grad_accum=2",
            "train.precision=fp32"]


@pytest.fixture(scope="session")
def gpt_champion(digits_champion) -> TrainedModel:
    """The small GPT trained once per session into the store of `digits_champion` (experiment and
    model `pycode-gpt`, v1 champion), so that one copy of that store serves both models."""
    from flotilla.spec import load_spec
    from flotilla.pipeline import run_training
    from tests.integration._helpers import ROOT, store_uri

    store = digits_champion.store
    spec = load_spec(ROOT / "configs" / "pycode_gpt.yaml",
                     [f"train.storage_path={store}", f"track.uri={store_uri(store)}", *GPT_TEST])
    return TrainedModel(spec, run_training(spec), store)


@pytest.fixture(scope="session")
def tables_champion(digits_champion) -> TrainedModel:
    """A table as people have them (`tests.integration._helpers.messy_table`: a string category with
    gaps, a boolean, numbers with gaps), trained once per session into the store of
    `digits_champion` as model `tables` v1 (champion)."""
    from flotilla.pipeline import run_training
    from tests.integration._helpers import tables_spec

    store = digits_champion.store
    spec = tables_spec(store, overrides=["export.after_training=true"])  # its ONNX variants too
    return TrainedModel(spec, run_training(spec), store)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random-weight Llama and its freshly trained tokenizer, saved as a pretrained directory that
    `model.pretrained` can name (nothing downloaded); built once per session (~1 s), read-only. Its
    context is long (rotary positions: no weights grow with it), so that an endpoint serving it
    can be asked for generations that take minutes."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from flotilla.models._hf_tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_positions=65536))
