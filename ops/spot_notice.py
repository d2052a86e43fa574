"""Turns an EC2 spot interruption notice into a Ray drain notice for this node.

cluster.yaml starts it on every worker node beside `ray start`. On an on-demand instance it exits at
once. On a spot instance it asks the instance metadata service (IMDSv2) every 5 s whether AWS has
scheduled the instance's reclaim (`spot/instance-action`, posted 2 minutes ahead); when it has, it
runs

    ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N

for this node, which is what Ray's own autoscaler does for the clouds it watches: Ray Train then
checkpoints the runs with ranks here before the deadline and goes on without them (an elastic
run, `train.num_workers: [min, max]`, on the workers left), and no new work is placed here.

    python spot_notice.py [--every 5] [--ray ray]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

IMDS = os.environ.get("FLOTILLA_IMDS_ENDPOINT", "http://169.254.169.254")


def _token(timeout_s: float = 2) -> str:
    request = urllib.request.Request(f"{IMDS}/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return r.read().decode()


def metadata(path: str, timeout_s: float = 2) -> str | None:
    """`latest/meta-data/<path>` (None when the service says there is none: 404)."""
    request = urllib.request.Request(f"{IMDS}/latest/meta-data/{path}",
                                     headers={"X-aws-ec2-metadata-token": _token(timeout_s)})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def seconds_left(notice: str, now: dt.datetime | None = None) -> tuple[str, int]:
    """(action, whole seconds until it) of an `instance-action` document such as
    `{"action": "terminate", "time": "2026-12-05T10:02:00Z"}`; at least 1."""
    body = json.loads(notice)
    when = dt.datetime.strptime(body["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    now = now or dt.datetime.now(dt.timezone.utc)
    return body["action"], max(1, int((when - now).total_seconds()))


def drain_command(ray: str, action: str, seconds: int) -> list[str]:
    return [ray, "drain-node", "--reason", "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message", f"EC2 spot interruption: {action} in {seconds} s",
            "--deadline-remaining-seconds", str(seconds)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=5.0, help="seconds between questions to the metadata service")
    parser.add_argument("--ray", default="ray", help="the ray command")
    args = parser.parse_args(argv)
    try:
        lifecycle = metadata("instance-life-cycle")
    except OSError as e:
        print(f"spot_notice: no instance metadata service at {IMDS} ({e}); not an EC2 instance, nothing to watch")
        return 0
    if lifecycle != "spot":
        print(f"spot_notice: this instance is {lifecycle or 'on-demand'}, not spot; nothing to watch")
        return 0
    print(f"spot_notice: watching for an interruption notice every {args.every:g} s", flush=True)
    while True:
        try:
            notice = metadata("spot/instance-action")
        except OSError as e:  # the service is briefly unreachable: ask again
            print(f"spot_notice: metadata service did not answer ({e})", flush=True)
            notice = None
        if notice:
            action, seconds = seconds_left(notice)
            command = drain_command(args.ray, action, seconds)
            print(f"spot_notice: {action} in {seconds} s; {' '.join(command)}", flush=True)
            done = subprocess.run(command, capture_output=True, text=True)
            print(done.stdout + done.stderr, flush=True)
            return done.returncode
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main())
