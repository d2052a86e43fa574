"""Hosts on one machine: a Ray cluster whose nodes share nothing but a network and a storage directory.

    .venv/bin/python ops/local_hosts.py up          # head, 2 workers, a client; Ray started; prints how to use them
    .venv/bin/python ops/local_hosts.py exec client -- ray job submit --address http://10.231.0.1:8265 \\
        --working-dir . -- python pipelines/train.py --config configs/digits.yaml
    .venv/bin/python ops/local_hosts.py down        # stops every process of the hosts, removes mounts and namespaces

Needs root (Linux network and mount namespaces). Each host is
- a network namespace of its own, linked to the others through a bridge in one more namespace
  (`PREFIX-net`): nothing is added to this machine's own interfaces, routes or addresses;
- a host name of its own (UTS namespace) that resolves to its address (its own /etc/hosts);
- a mount namespace of its own: a private tmpfs over /tmp/ray (its Ray session directory) and, on
  every host but the client, an empty tmpfs over the checkout's source folders, so Flotilla's code
  reaches head and workers only the way it reaches a cloud node (the job's runtime environment).
  The installed environment (.venv) stays, as a node image would have it.
Each host starts from cluster.yaml's own start commands (`start_commands` says what is substituted):
the head runs the MLflow server and Ray with `CPU: 0`, each worker Ray with `--worker-cpus`, and
every node's `ray start` exports MLFLOW_TRACKING_URI (the head's server) and FLOTILLA_STORAGE_PATH
(cluster.yaml's s3://BUCKET/..., here a bucket on moto's S3 server on the head; with --no-s3, the
shared directory). One token (RAY_AUTH_TOKEN) is handed to every host, the way
cluster.yaml's file_mounts hand out ~/.ray/auth_token. The shared directory (`--shared`, default
/var/tmp/PREFIX-shared) has the same path on every host: a stand-in for NFS/EFS. Each host has a
home of its own (/var/tmp/PREFIX-home-HOST: `~` in cluster.yaml's commands).

`up` records what it made in /var/tmp/PREFIX.json; `down` reads it and removes exactly that.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUBNET = "10.231.0"
# What a node image does not have: the checkout's source (present on the client only).
SOURCE_DIRS = ("platform", "pipelines", "tune", "configs", "serve_apps", "tests", "ops", "benchmarks")
DASHBOARD_PORT, GCS_PORT, MLFLOW_PORT, S3_PORT = 8265, 6379, 5000, 9000
# The S3 endpoint on the head (moto): the bucket that stands in for cluster.yaml's s3://BUCKET, and
# the credentials every host is given for it (moto accepts any; nothing real).
S3_BUCKET = "flotilla"
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "local-hosts", "AWS_SECRET_ACCESS_KEY": "local-hosts",
                  "AWS_DEFAULT_REGION": "us-east-1"}
CLUSTER_YAML = ROOT / "cluster.yaml"
START_ATTEMPTS = 3  # a worker whose `ray start` timed out joining a busy head starts again (start_node)
# The elastic run of the hosts' tests and `make benchmark-elastic` (`--set` arguments after
# configs/digits.yaml): 1 or 2 workers of 2 CPUs, one per worker host; 64 samples an optimizer step at
# either size; a wider model than digits.yaml's, so that an epoch lasts long enough (~1 s on 2
# workers) to lose a host in it; a checkpoint within an epoch every 3 s; no quality gate.
ELASTIC_RUN = ["--set", "train.num_workers=[1, 2]", "--set", "train.cpus_per_worker=2", "--set",
               "train.global_batch_size=64", "--set", "train.placement=spread", "--set", "train.resize_check_s=5",
               "--set", "train.checkpoint_every_s=3", "--set", "model.hidden=[512, 512]", "--set", "track.gate.require=[]"]


def mlflow_password(token: str) -> str:
    """The MLflow server's password for user `flotilla`, derived from the Ray token as cluster.yaml's
    start commands derive it (`printf 'flotilla-mlflow:%s' TOKEN | sha256sum | cut -c1-48`)."""
    import hashlib

    return hashlib.sha256(f"flotilla-mlflow:{token}".encode()).hexdigest()[:48]


@dataclass
class Host:
    name: str  # head, worker1, worker2, client
    namespace: str
    address: str
    holder_pid: int = 0  # a process that keeps the host's mount namespace (and sits in its network one)


@dataclass
class Hosts:
    prefix: str = "flt"
    workers: int = 2
    worker_cpus: int = 2
    shared: str = ""
    s3: bool = True  # an S3 endpoint on the head (moto) for s3:// paths; cluster.yaml's BUCKET is its bucket
    # Hosts made with the others but booted only by `start_node` (`spare1`, ...): capacity that joins
    # later, as an autoscaler's new node does.
    spares: int = 0
    # Each host's link limited to this many Mbit/s each way (Linux `tc` token-bucket filters on both
    # ends of its veth), like a link between racks or data centres; 0: the veth's own speed.
    link_mbit: float = 0.0
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self):
        self.shared = self.shared or f"/var/tmp/{self.prefix}-shared"
        if not self.hosts:
            names = ["head", *(f"worker{i + 1}" for i in range(self.workers)),
                     *(f"spare{i + 1}" for i in range(self.spares)), "client"]
            last = {"head": 1, "client": 100}
            self.hosts = [Host(n, f"{self.prefix}-{n}", f"{SUBNET}.{last.get(n, 10 + i)}")
                          for i, n in enumerate(names)]

    # ------------------------------------------------------------------ lookup
    def __getitem__(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    @property
    def head_address(self) -> str:
        return self["head"].address

    @property
    def jobs_address(self) -> str:
        return f"http://{self.head_address}:{DASHBOARD_PORT}"

    @property
    def state_file(self) -> Path:
        return Path(f"/var/tmp/{self.prefix}.json")

    def save(self) -> None:
        self.state_file.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, prefix: str) -> "Hosts":
        data = json.loads(Path(f"/var/tmp/{prefix}.json").read_text())
        data["hosts"] = [Host(**h) for h in data["hosts"]]
        return cls(**data)

    # ------------------------------------------------------------------ running things on a host
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """What every host's processes get: the venv first on PATH (jobs run `python` from the
        raylet's PATH), token auth with the cluster's token, and nothing of this machine's Ray, MLflow
        or Flotilla settings (the cluster's own come from cluster.yaml's start commands)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "FLOTILLA_"))}
        env.update(PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", RAY_AUTH_MODE="token",
                   RAY_AUTH_TOKEN=self.token, PYTHONUNBUFFERED="1",
                   # The MLflow server's user, as cluster.yaml hands it out (an operator's laptop sets the same).
                   MLFLOW_TRACKING_USERNAME="flotilla", MLFLOW_TRACKING_PASSWORD=mlflow_password(self.token))
        if self.s3:  # what an instance profile gives a cloud node: pyarrow, Ray and MLflow all read these
            env.update(S3_CREDENTIALS, AWS_ENDPOINT_URL=self.s3_endpoint)
        env.update(extra or {})
        return env

    def command(self, host: str, argv: list[str], cwd: str | Path | None = None) -> list[str]:
        """`argv` on `host`, in `cwd` (entering a mount namespace moves a process to its root;
        default: the checkout on the client, / elsewhere)."""
        cwd = cwd or (ROOT if host == "client" else "/")
        return ["nsenter", "-t", str(self[host].holder_pid), "-m", "-n", "-u", f"--wd={cwd}", "--", *argv]

    def run(self, host: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
            timeout: float = 600, check: bool = False) -> subprocess.CompletedProcess:
        """Run `argv` on `host` and wait for it (output captured)."""
        return subprocess.run(self.command(host, argv, cwd), env=self.env(env), capture_output=True, text=True,
                              timeout=timeout, check=check)

    def spawn(self, host: str, argv: list[str], log: Path, *, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` on `host` in the background, its output in `log`."""
        with open(log, "ab") as out:
            return subprocess.Popen(self.command(host, argv), env=self.env(env), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    # ------------------------------------------------------------------ up
    def up(self, start_ray: bool = True) -> None:
        try:
            self._network()
            for host in self.hosts:
                host.holder_pid = self._holder(host)
            Path(self.shared).mkdir(parents=True, exist_ok=True)
            self.save()
            if start_ray:
                self.start_ray()
        except BaseException:
            self.down()
            raise

    def _network(self) -> None:
        net = f"{self.prefix}-net"
        _ip("netns", "add", net)
        self.save()  # from here on, `down` has something to remove
        _ip("-n", net, "link", "add", "br0", "type", "bridge")
        _ip("-n", net, "link", "set", "br0", "up")
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
            self.save()
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            # Both ends are created inside namespaces: nothing appears in this machine's own.
            _ip("-n", host.namespace, "link", "add", "eth0", "type", "veth", "peer", "name", host.name, "netns", net)
            _ip("-n", net, "link", "set", host.name, "master", "br0")
            _ip("-n", net, "link", "set", host.name, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            if self.link_mbit:  # what the host sends (its eth0) and what it receives (the bridge's end)
                _limit(host.namespace, "eth0", self.link_mbit)
                _limit(net, host.name, self.link_mbit)

    def measure_link(self, sender: str = "worker1", receiver: str = "worker2", seconds: float = 2.0) -> float:
        """Mbit/s of one TCP stream from `sender` to `receiver` for `seconds` (an iperf-style transfer
        in Python, timed where it is received)."""
        to = self[receiver].address
        server = subprocess.Popen(self.command(receiver, [sys.executable, "-c", _RECEIVE, to, str(LINK_PROBE_PORT)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError(f"link probe on {receiver}: {server.stdout.read()[-2000:]}")
            sent = self.run(sender, [sys.executable, "-c", _SEND, to, str(LINK_PROBE_PORT), str(seconds)],
                            timeout=seconds + 60)
            if sent.returncode != 0:
                raise RuntimeError(f"link probe from {sender}: {(sent.stdout + sent.stderr)[-2000:]}")
            received, elapsed = map(float, server.communicate(timeout=60)[0].split())
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        return received * 8 / elapsed / 1e6

    @property
    def hosts_file(self) -> Path:
        return Path(f"/var/tmp/{self.prefix}-hosts")

    def _holder(self, host: Host) -> int:
        # A name of its own that resolves to its link address, as a cloud VM's does (Gloo and
        # others bind to what the host name resolves to; a shared /etc/hosts would say 127.0.0.1).
        names = "".join(f"{h.address} {h.namespace}\n" for h in self.hosts)
        self.hosts_file.write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
        mounts = [f"hostname {host.namespace}", f"mount --bind {self.hosts_file} /etc/hosts",
                  "mkdir -p /tmp/ray", "mount -t tmpfs -o size=2g,mode=1777 tmpfs /tmp/ray"]
        if host.name != "client":
            mounts += [f"mount -t tmpfs -o size=1m,ro tmpfs {shlex.quote(str(ROOT / d))}"
                       for d in SOURCE_DIRS if (ROOT / d).is_dir()]
        script = " && ".join(mounts) + " && echo ready && exec sleep infinity"
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, "unshare", "--mount", "--uts", "--propagation", "private",
             "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"host {host.name}: could not set up its mounts: {line} {proc.stdout.read()[:2000]}")
        return proc.pid

    def home(self, host: str) -> Path:
        """The host's own home directory (`~` in cluster.yaml's commands): the head keeps MLflow's data there."""
        return Path(f"/var/tmp/{self.prefix}-home-{host}")

    def start_commands(self, host: str) -> list[str]:
        """cluster.yaml's start commands for `host` (head or a worker), as `ray up` would run them there,
        with what only a cloud has substituted: the head's link address for the dashboard (the client
        host submits to it) and no autoscaler config; the shared directory for s3://BUCKET; the
        host's address and a small object store on `ray start`. `ray stop` is left out: it stops
        every Ray process of the machine, not only this host's."""
        import yaml

        kind = "head" if host == "head" else "worker"
        commands = yaml.safe_load(CLUSTER_YAML.read_text())[f"{kind}_start_ray_commands"]
        out = []
        for command in commands:
            if command.strip() == "ray stop" or "spot_notice.py" in command:  # (no spot instances here)
                continue
            command = command.replace("s3://BUCKET/", f"s3://{S3_BUCKET}/" if self.s3 else f"{self.shared}/")
            if "ray start" in command:
                command = (command.replace("--dashboard-host=127.0.0.1", f"--dashboard-host={self.head_address}")
                           .replace(" --autoscaling-config=~/ray_bootstrap_config.yaml", "")
                           + f" --node-ip-address={self[host].address} --object-store-memory=300000000")
            out.append(command)
        return out

    def start_node(self, host: str) -> None:
        """Run cluster.yaml's start commands on `host`, with the environment the autoscaler gives them."""
        cpus = 0 if host == "head" else self.worker_cpus
        home = self.home(host)
        home.mkdir(parents=True, exist_ok=True)
        env = {"HOME": str(home), "RAY_HEAD_IP": self.head_address, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": cpus})}
        if host == "head":
            # The head's GCS asks each node every second whether it lives (Ray's default: every 3 s), so
            # a host lost in a test is declared dead after ~5 s instead of ~15 s; until then Ray may
            # still place a restarted run's workers on it.
            env["RAY_health_check_period_ms"] = "1000"
        else:
            # Ray keeps at most as many idle worker processes as a node has CPUs. When a restarted run
            # puts both its ranks on one 2-CPU host, each epoch's small Ray Data task (equalizing the
            # ranks' shards) then found no idle process and started a fresh one: seconds of CPU an
            # epoch beside the ranks, and a 2x slower run. Two spare processes stay instead.
            env["RAY_num_workers_soft_limit"] = str(cpus + 2)
        for attempt in range(1, START_ATTEMPTS + 1):
            failed = next(((command, done) for command in self.start_commands(host)
                           if (done := self.run(host, ["bash", "-c", command], env=env, timeout=300)).returncode), None)
            if failed is None:
                return
            command, done = failed
            output = done.stdout + done.stderr
            # "The current node timed out during startup ... the GCS has become overloaded": the head
            # did not answer a joining worker in time (seen with both CPUs busy). What the attempt
            # started is stopped and the worker joins again; any other failure is the answer.
            if host == "head" or "timed out during startup" not in output or attempt == START_ATTEMPTS:
                raise RuntimeError(f"host {host}: `{command}` failed ({done.returncode}, attempt {attempt}): "
                                   f"{output[-3000:]}")
            print(f"host {host}: ray start timed out joining the head (attempt {attempt}); starting it again",
                  flush=True)
            self.kill_host(host)
            self.run(host, ["sh", "-c", "umount -l /tmp/ray; mount -t tmpfs -o size=2g,mode=1777 tmpfs /tmp/ray"],
                     check=True)

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.head_address}:{S3_PORT}"

    def start_s3(self, timeout_s: float = 60) -> None:
        """moto's S3 server on the head, with the bucket that cluster.yaml's s3://BUCKET stands for."""
        home = self.home("head")
        home.mkdir(parents=True, exist_ok=True)
        self.spawn("head", ["moto_server", "-H", self.head_address, "-p", str(S3_PORT)], home / "moto.log")
        # (pyarrow's URIs read AWS_ENDPOINT_URL from the environment; its S3FileSystem() does not.)
        make_bucket = (f"fs.S3FileSystem(endpoint_override={self.s3_endpoint!r}, allow_bucket_creation=True)"
                       f".create_dir({S3_BUCKET!r})")
        self._wait_on_client("import pyarrow.fs as fs", make_bucket, timeout_s, "the S3 endpoint", home / "moto.log")

    def start_ray(self, timeout_s: float = 180) -> None:
        """The cluster as cluster.yaml starts it: the head (MLflow server, Ray with CPU 0, the jobs API
        on its link address), then the workers. First the S3 endpoint, a cloud service of its own."""
        if self.s3:
            self.start_s3()
        self.start_node("head")
        self._wait_on_client("from ray.job_submission import JobSubmissionClient",
                             f"JobSubmissionClient({self.jobs_address!r}).list_jobs()", timeout_s, "the head's jobs API",
                             self.home("head"))
        # The workers boot at once, as a cloud's do.
        workers = [host.name for host in self.hosts if host.name.startswith("worker")]
        with ThreadPoolExecutor(len(workers)) as pool:
            list(pool.map(self.start_node, workers))
        self._wait_on_client("from ray.util.state import list_nodes", f"{self._alive_workers} == {self.workers}",
                             timeout_s, "the worker nodes", Path(f"/proc/{self['worker1'].holder_pid}/root/tmp/ray"))
        self._wait_on_client("import urllib.request", f"urllib.request.urlopen({self.tracking_uri + '/health'!r}, "
                             "timeout=5)", timeout_s, "the head's MLflow server",
                             self.home("head") / "flotilla" / "mlflow" / "server.log")

    @property
    def tracking_uri(self) -> str:
        return f"http://{self.head_address}:{MLFLOW_PORT}"

    @property
    def _alive_workers(self) -> str:
        """A Python expression (after `from ray.util.state import list_nodes`): the worker nodes the head's
        GCS counts as alive."""
        # (A filter makes Ray's state API count the nodes it filtered out as missing output and raise,
        # once a node has died: `raise_on_missing_output=False`.)
        return (f"sum(1 for n in list_nodes(address={self.jobs_address!r}, filters=[('state', '=', 'ALIVE')], "
                "raise_on_missing_output=False) if not n.is_head_node)")

    def wait_alive(self, host: str, timeout_s: float = 120) -> None:
        """Until the head's GCS counts a node at `host`'s address as alive (RuntimeError after `timeout_s`)."""
        self._wait_on_client("from ray.util.state import list_nodes",
                             f"{self[host].address!r} in [n.node_ip for n in list_nodes(address={self.jobs_address!r}, "
                             "filters=[('state', '=', 'ALIVE')], raise_on_missing_output=False)]", timeout_s,
                             f"host {host}'s Ray node",
                             Path(f"/proc/{self[host].holder_pid}/root/tmp/ray"))

    def alive_workers(self) -> int:
        """Worker nodes the head's GCS counts as alive (asked from the client host); -1 if it does not answer."""
        out = self.run("client", ["python", "-c", f"from ray.util.state import list_nodes; print({self._alive_workers})"],
                       timeout=60)
        return int(out.stdout.strip()) if out.returncode == 0 else -1

    def _wait_on_client(self, imports: str, ready: str, timeout_s: float, what: str, log: Path) -> None:
        """Until the Python expression `ready` (after `imports`) neither raises nor is False, asked every
        second by one process on the client host (a `ray` command a second would cost ~1.5 CPU-s of
        start-up each)."""
        code = "\n".join([
            "import sys, time", imports, f"deadline = time.monotonic() + {timeout_s}",
            "while True:",
            "    try:",
            f"        if {ready} is not False: sys.exit(0)",
            "    except Exception:",
            "        pass",
            "    if time.monotonic() > deadline: sys.exit(1)",
            "    time.sleep(1)",
        ])
        if self.run("client", ["python", "-c", code], timeout=timeout_s + 60).returncode != 0:
            raise RuntimeError(f"{what} did not come up within {timeout_s:.0f} s; see {log}")

    # ------------------------------------------------------------------ jobs, from the client host
    def submit(self, job_id: str, script: str, *args: str, wait: bool = True,
               timeout: float = 600) -> subprocess.CompletedProcess:
        """`ray job submit --working-dir .` from the client host, as a user types it."""
        return self.run("client", [
            "ray", "job", "submit", "--address", self.jobs_address, "--working-dir", ".", "--submission-id", job_id,
            *([] if wait else ["--no-wait"]), "--", "python", script, *args], timeout=timeout)

    def job_log(self, job_id: str) -> str:
        """The job driver's log, read straight from the head's own session directory."""
        root = Path(f"/proc/{self['head'].holder_pid}/root")
        try:
            session = os.readlink(root / "tmp/ray/session_latest")  # absolute on the head: resolve it under its root
        except FileNotFoundError:  # not readable at this instant (seen once in a full run): no log yet, ask again
            return ""
        path = root / session.lstrip("/") / "logs" / f"job-driver-{job_id}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_in_log(self, job_id: str, found, what: str, timeout: float = 400) -> str:
        """The job's log once `found(log)` holds; AssertionError with the log's end after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.job_log(job_id)
            if found(log):
                return log
            assert time.monotonic() < deadline, f"{what} not seen: " + log[-4000:]
            time.sleep(0.2)

    def wait_for_job(self, job_id: str, timeout: float = 600) -> str:
        """Block until the job ends; its final status (SUCCEEDED, FAILED, ...). A job still running
        after `timeout` s is an error that quotes the end of its log."""
        try:
            self.run("client", ["ray", "job", "logs", "--address", self.jobs_address, "--follow", job_id],
                     timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"job {job_id} still running after {timeout:g} s; its log ends:\n"
                               f"{self.job_log(job_id)[-6000:]}") from None
        out = self.run("client", ["ray", "job", "status", "--address", self.jobs_address, job_id], timeout=60)
        found = re.search(rf"Job '{job_id}' (succeeded|failed|was stopped)|Status for job '{job_id}': (\w+)",
                          out.stdout + out.stderr)
        return (found.group(1) or found.group(2)).upper().replace("WAS ", "") if found else out.stdout + out.stderr

    def stop_job(self, job_id: str) -> None:
        """Stop a job (a no-op once it has ended), so that it holds no host's CPUs."""
        self.run("client", ["ray", "job", "stop", "--address", self.jobs_address, job_id], timeout=120)

    def on_client(self, code: str, timeout: float = 120):
        """Python run on the client host; its stdout's last line parsed as JSON."""
        out = self.run("client", ["python", "-c", code], timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"on the client host: {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stored_run(self, run: str) -> dict:
        """A run's entries and its bundle's record in S3 (cluster.yaml's FLOTILLA_STORAGE_PATH; moto on the head)."""
        return self.on_client(f"""
import json, pyarrow.fs as fs
s3, run = fs.FileSystem.from_uri("s3://{S3_BUCKET}/flotilla/runs/{run}")  # the endpoint: AWS_ENDPOINT_URL
names = sorted(i.base_name for i in s3.get_file_info(fs.FileSelector(run)))
with s3.open_input_stream(run + "/bundle/metrics.json") as f:
    print(json.dumps({{"names": names, "metrics": json.loads(f.read())}}))
""")

    def drain(self, host: str, deadline_s: int) -> float:
        """A spot notice for `host`, as a cloud's reaches Ray (`ray drain-node` with the preemption reason
        and a deadline, from the client host); the time Ray had it (when the command returned). The
        command takes its deadline when it starts, a second or two before: the deadline is at most
        `deadline_s` after the time returned, so a kill at that time is at or just past it."""
        node = self.on_client(f"""
import json
from ray.util.state import list_nodes
print(json.dumps([n.node_id for n in list_nodes(address={self.jobs_address!r}) if n.node_ip == {self[host].address!r}
                  and n.state == "ALIVE"][0]))
""")
        out = self.run("client", ["ray", "drain-node", "--address", f"{self.head_address}:{GCS_PORT}",
                                  "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                                  "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds",
                                  str(deadline_s)], timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"ray drain-node {host}: {out.stdout + out.stderr}")
        return time.time()

    # ------------------------------------------------------------------ faults and teardown
    def kill_host(self, name: str) -> list[int]:
        """Every process of `name` killed at once (its network namespace lists them), as a machine
        that loses power; the namespace, its link and its mounts stay for `revive`."""
        pids = self._pids(self[name].namespace, keep={self[name].holder_pid})
        _kill(pids)
        return pids

    def replace_host(self, name: str) -> None:
        """A fresh machine in place of a dead worker host (as an autoscaler would launch one): an empty
        Ray session directory and home, then cluster.yaml's start commands."""
        self.run(name, ["sh", "-c", "umount -l /tmp/ray; mount -t tmpfs -o size=2g,mode=1777 tmpfs /tmp/ray"],
                 check=True)
        shutil.rmtree(self.home(name), ignore_errors=True)
        self.start_node(name)

    def down(self) -> None:
        """Stop every process of every host (by pid), then remove the namespaces, the bridge and the
        shared directory. Safe to call on a half-built set of hosts, and twice."""
        namespaces = [h.namespace for h in self.hosts] + [f"{self.prefix}-net"]
        existing = set(_netns_list())
        for ns in namespaces:
            if ns in existing:
                _kill(self._pids(ns))
        for host in self.hosts:  # holders are in the namespaces too; this covers a half-made one
            if host.holder_pid:
                _kill([host.holder_pid])
        for ns in namespaces:
            if ns in existing:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.shared, ignore_errors=True)
        for host in self.hosts:
            shutil.rmtree(self.home(host.name), ignore_errors=True)
        self.hosts_file.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)

    @staticmethod
    def _pids(namespace: str, keep: set[int] = frozenset()) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split() if int(p) not in keep]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _kill(pids: list[int], timeout_s: float = 15) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for pid in pids:  # gone, not merely signalled (our own children are reaped here too)
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                if not Path(f"/proc/{pid}").exists():
                    break
            time.sleep(0.05)


def can_make_hosts() -> str | None:
    """None when this machine can build hosts; otherwise the kernel's (or the system's) reason."""
    if os.geteuid() != 0:
        return "building hosts needs root (network and mount namespaces)"
    if not shutil.which("ip") or not shutil.which("nsenter") or not shutil.which("unshare"):
        return "building hosts needs iproute2 (`ip`) and util-linux (`nsenter`, `unshare`)"
    probe = f"flt-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add: {made.stderr.strip()}"
    try:
        mount = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--mount", "--propagation", "private",
                                "mount", "-t", "tmpfs", "tmpfs", "/mnt"], capture_output=True, text=True)
        if mount.returncode != 0:
            return f"unshare --mount: {mount.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


LINK_PROBE_PORT = 5201  # iperf's
# The two ends of `measure_link`: the receiver counts what arrives from its first byte to the end.
_RECEIVE = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
n, first = 0, None
while True:
    data = c.recv(1 << 20)
    if not data:
        break
    first = first or time.perf_counter()
    n += len(data)
print(n, time.perf_counter() - first)
"""
_SEND = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk, end = bytes(1 << 16), time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    c.sendall(chunk)
c.close()
"""


def _limit(namespace: str, device: str, mbit: float) -> None:
    """A token-bucket filter on `device`'s egress: `mbit` Mbit/s, bursts of 10 ms of it (at least a
    few packets), packets queued at most 50 ms. (tbf, not netem: netem is not in every kernel.)"""
    burst = max(16 * 1024, int(mbit * 1e6 / 8 / 100))
    subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                    "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"],
                   check=True, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "exec", "status"])
    parser.add_argument("host", nargs="?", help="exec: head, worker1, worker2 or client")
    parser.add_argument("--prefix", default="flt", help="names of the namespaces and files (default: flt)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-cpus", type=int, default=2)
    parser.add_argument("--shared", default="", help="the shared storage directory (default: /var/tmp/PREFIX-shared)")
    parser.add_argument("--no-s3", action="store_true",
                        help="no S3 endpoint: cluster.yaml's s3://BUCKET/ becomes the shared directory")
    parser.add_argument("--link-mbit", type=float, default=0.0,
                        help="limit each host's link to this many Mbit/s each way (tc tbf), measured at `up`")
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_intermixed_args(argv[:argv.index("--")] if "--" in argv else argv)

    if args.action == "up":
        reason = can_make_hosts()
        if reason:
            print(f"cannot build hosts here: {reason}", file=sys.stderr)
            return 2
        hosts = Hosts(args.prefix, args.workers, args.worker_cpus, args.shared, s3=not args.no_s3,
                      link_mbit=args.link_mbit)
        hosts.up()
        for h in hosts.hosts:
            print(f"{h.name:8} {h.address:14} namespace {h.namespace}")
        if args.link_mbit:
            pair = ("worker1", "worker2") if args.workers >= 2 else ("client", "head")
            print(f"links limited to {args.link_mbit:g} Mbit/s each way; measured {pair[0]} -> {pair[1]}: "
                  f"{hosts.measure_link(*pair):.1f} Mbit/s")
        print(f"jobs API and dashboard: {hosts.jobs_address}   MLflow: {hosts.tracking_uri}   "
              f"shared storage: {hosts.shared}")
        if hosts.s3:
            print(f"S3 endpoint: {hosts.s3_endpoint}, bucket {S3_BUCKET} "
                  f"(FLOTILLA_STORAGE_PATH=s3://{S3_BUCKET}/flotilla/runs)")
        print(f"run on a host:  {sys.argv[0]} exec client -- ray status --address {hosts.head_address}:{GCS_PORT}")
        print(f"stop:           {sys.argv[0]} down")
        return 0
    hosts = Hosts.load(args.prefix)
    if args.action == "down":
        hosts.down()
        print(f"removed {', '.join(h.namespace for h in hosts.hosts)} and {hosts.prefix}-net")
        return 0
    if args.action == "status":
        print(f"{hosts.alive_workers()} worker node(s) alive; jobs API {hosts.jobs_address}")
        return 0
    if not args.host or not command:
        parser.error("exec needs a host and a command: exec client -- ray status")
    proc = subprocess.run(hosts.command(args.host, command, os.getcwd() if args.host == "client" else "/"),
                          env=hosts.env())
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
