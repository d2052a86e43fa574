"""ops/spot_notice.py against an HTTP server that answers as EC2's instance metadata service (IMDSv2)
does: a token first, then the instance's life cycle, then no interruption notice (404) until one is
posted. The drain command is a script that records what it was called with."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops" / "spot_notice.py"
_spec = importlib.util.spec_from_file_location("spot_notice", SCRIPT)
spot_notice = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spot_notice)


@pytest.fixture
def imds():
    state = {"lifecycle": "spot", "asked": 0, "notice_after": 2, "tokens": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body: str = "") -> None:
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_PUT(self):
            if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                state["tokens"] += 1
                return self._send(200, "token-1")
            self._send(400)

        def do_GET(self):
            if self.headers.get("X-aws-ec2-metadata-token") != "token-1":
                return self._send(401)
            if self.path == "/latest/meta-data/instance-life-cycle":
                return self._send(200, state["lifecycle"])
            if self.path == "/latest/meta-data/spot/instance-action":
                state["asked"] += 1
                if state["asked"] <= state["notice_after"]:
                    return self._send(404)
                when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=100)
                return self._send(200, json.dumps({"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}))
            self._send(404)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()


def _run(imds, tmp_path) -> tuple[subprocess.CompletedProcess, Path]:
    called = tmp_path / "called.json"
    fake_ray = tmp_path / "ray"
    fake_ray.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(called)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake_ray.chmod(0o755)
    env = {**os.environ, "FLOTILLA_IMDS_ENDPOINT": imds["url"]}
    done = subprocess.run([sys.executable, str(SCRIPT), "--every", "0.1", "--ray", str(fake_ray)], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, called


def test_a_spot_notice_becomes_a_drain_with_the_time_left(imds, tmp_path):
    done, called = _run(imds, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    argv = json.loads(called.read_text())
    assert argv[:3] == ["drain-node", "--reason", "DRAIN_NODE_REASON_PREEMPTION"]
    deadline = int(argv[argv.index("--deadline-remaining-seconds") + 1])
    assert 95 <= deadline <= 100, argv  # the notice's time, less the moments since it was posted
    assert imds["asked"] == 3  # two 404s (no notice yet), then the notice
    assert "EC2 spot interruption: terminate" in argv[argv.index("--reason-message") + 1]


def test_an_on_demand_instance_or_no_metadata_service_watches_nothing(imds, tmp_path):
    imds["lifecycle"] = "normal"
    done, called = _run(imds, tmp_path)
    assert done.returncode == 0 and "not spot; nothing to watch" in done.stdout and not called.exists()
    imds["url"] = "http://127.0.0.1:9"  # nothing listens there
    done, called = _run(imds, tmp_path)
    assert done.returncode == 0 and "not an EC2 instance" in done.stdout and not called.exists()


def test_seconds_left_reads_the_notice_time():
    now = dt.datetime(2026, 12, 5, 10, 0, 0, tzinfo=dt.timezone.utc)
    assert spot_notice.seconds_left('{"action": "stop", "time": "2026-12-05T10:02:00Z"}', now) == ("stop", 120)
    assert spot_notice.seconds_left('{"action": "terminate", "time": "2026-12-05T09:59:00Z"}', now) == ("terminate", 1)
