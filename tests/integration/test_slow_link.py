"""Hosts joined by a slow link (`ops/local_hosts.py up --link-mbit N`): each host's link is limited
with Linux token-bucket filters, each way, and a transfer between two hosts measures it. No Ray:
the namespaces only. Skipped, with the kernel's reason, where namespaces cannot be made."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from ._helpers import ROOT

pytestmark = [pytest.mark.integration]

_spec = importlib.util.spec_from_file_location("local_hosts", ROOT / "ops" / "local_hosts.py")
local_hosts = sys.modules.setdefault("local_hosts", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(local_hosts)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_link_limited_to_100_mbit_carries_about_100_mbit_each_way():
    reason = local_hosts.can_make_hosts()
    if reason:
        pytest.skip(f"cannot build hosts on this machine: {reason}")
    prefix = f"lnk{os.getpid() % 100000}"
    hosts = local_hosts.Hosts(prefix, workers=2, worker_cpus=1, s3=False, link_mbit=100)
    try:
        hosts.up(start_ray=False)
        there = hosts.measure_link("worker1", "worker2")
        back = hosts.measure_link("worker2", "worker1")
    finally:
        hosts.down()
    print(f"100 Mbit/s links: worker1 -> worker2 {there:.1f} Mbit/s, back {back:.1f} Mbit/s")
    # TCP's headers take ~4 % of what the filter lets through; an unlimited veth carries gigabits.
    # The cap is what the filter guarantees; the floor only rules out a wrong rate (a 10 Mbit/s link),
    # since the measuring processes share the cores with the suite's other lane (84.6 seen there).
    assert 60 <= there <= 101 and 60 <= back <= 101, (there, back)
    assert prefix not in _namespaces()
