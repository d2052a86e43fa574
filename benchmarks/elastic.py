"""Elastic runs on hosts of one machine: what a lost host and a drain notice cost a run.

    sudo .venv/bin/python benchmarks/elastic.py        # ~6 minutes on 2 cores; run it alone (needs root)

Builds the hosts of ops/local_hosts.py (a head, two 2-CPU worker hosts, a client) and submits three
runs of the same elastic spec from the client host (local_hosts.ELASTIC_RUN: `num_workers: [1, 2]`,
`global_batch_size: 64`, a checkpoint within an epoch every 3 s):

- undisturbed: the baseline the other two are measured against (final validation accuracy);
- kill: once it has checkpointed on 2 workers, every process of worker1 is killed at once (no notice);
  seconds from the kill to the next finished step, and the age at the kill of the checkpoint it
  resumed from (the work lost: the steps since then); worker1 comes back and the run grows again;
- drain: `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 20` on
  worker2, which is killed at the deadline; seconds from the notice to its checkpoint, from the
  deadline to the next finished step, and the finished steps lost (those up to the notice that the
  checkpoint it resumed from does not hold).

Each run's ledger (its CPU-hours, as the driver prints them) is priced at cluster.yaml's labels: the
undisturbed run on `cpu_worker` (on-demand), the disturbed ones on `cpu_spot_worker` (an example spot
price): what a preempted spot run costs against an undisturbed on-demand one.

Goals (issue: elastic training): <= 30 s from a kill and <= 10 s from a drain to the next step; 0
steps lost after a notice; both within a point of the undisturbed run's validation accuracy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("local_hosts", ROOT / "ops" / "local_hosts.py")
local_hosts = sys.modules.setdefault("local_hosts", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(local_hosts)

WITHIN = re.compile(r"checkpoint at step (\d+) \(batch \d+ of epoch (\d+)\) committed")
ON_TWO = re.compile(r"\] epoch \d+/\d+ .*, 2 workers, ")


def train(hosts, job: str, run: str, epochs: int, *extra: str):
    out = hosts.submit(job, "pipelines/train.py", "--config", "configs/digits.yaml", "--set", f"train.run_name={run}",
                       "--set", f"train.epochs={epochs}", *local_hosts.ELASTIC_RUN, "--set", "track.enabled=false",
                       *extra, wait=False, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"submitting {run}: {out.stderr[-3000:]}")


def finish(hosts, job: str, run: str, timeout: float = 600) -> dict:
    """The run's bundle record, with `cpu_hours` from its driver's ledger line."""
    status = hosts.wait_for_job(job, timeout=timeout)
    log = hosts.job_log(job)
    if status != "SUCCEEDED":
        raise RuntimeError(f"{run} ended {status}: {log[-3000:]}")
    record = hosts.stored_run(run)["metrics"]
    record["cpu_hours"] = float(re.search(rf"\[{run}\] resources: ([\d.]+) CPU-hours", log).group(1))
    return record


def cpu_hour_prices() -> dict[str, float]:
    """USD a CPU-hour of cluster.yaml's `cpu_worker` and `cpu_spot_worker` (label price / CPUs)."""
    types = yaml.safe_load(local_hosts.CLUSTER_YAML.read_text())["available_node_types"]
    return {name: float(types[name]["labels"]["flotilla.io/price-per-hour"]) / types[name]["resources"]["CPU"]
            for name in ("cpu_worker", "cpu_spot_worker")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--deadline", type=int, default=20, help="the drain notice's seconds to its deadline")
    p.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = p.parse_args()
    reason = local_hosts.can_make_hosts()
    if reason:
        sys.exit(f"cannot build hosts here: {reason}")
    hosts = local_hosts.Hosts(f"fltbench{int(time.time()) % 10000}", workers=2, worker_cpus=2)
    results = {}
    try:
        hosts.up()
        train(hosts, "steady", "steady", args.epochs)
        steady = finish(hosts, "steady", "steady")
        results["undisturbed"] = {"val_accuracy": steady["history"][-1]["val_accuracy"], "cpu_hours": steady["cpu_hours"]}

        train(hosts, "kill", "kill", args.epochs)
        log = hosts.wait_in_log("kill", ON_TWO.search, "an epoch on 2 workers")
        on_two = ON_TWO.search(log).end()
        hosts.wait_in_log("kill", lambda log: WITHIN.search(log, on_two), "a checkpoint within an epoch")
        killed_at = time.time()
        hosts.kill_host("worker1")
        hosts.wait_in_log("kill", lambda log: re.search(r"\] epoch \d+/\d+ .*, 1 workers, ", log), "an epoch on 1 worker")
        hosts.replace_host("worker1")
        record = finish(hosts, "kill", "kill")
        lost = next(e for e in record["events"] if e["reason"] == "lost workers")
        results["kill"] = {"to_next_step_s": lost["at"] + lost["first_step_s"] - killed_at,
                           # (the event's age is taken when the restart began; this one at the kill)
                           "checkpoint_age_s": lost["since_checkpoint_s"] - (lost["at"] - killed_at),
                           "grew_back": any(e["reason"] == "grew" for e in record["events"]),
                           "val_accuracy": record["history"][-1]["val_accuracy"], "cpu_hours": record["cpu_hours"]}

        train(hosts, "drain", "drain", args.epochs, "--set", "train.checkpoint_every_s=0")
        hosts.wait_in_log("drain", ON_TWO.search, "an epoch on 2 workers")
        noticed_at = hosts.drain("worker2", args.deadline)
        hosts.wait_in_log("drain", lambda log: "committed after the drain notice" in log, "the notice's checkpoint",
                          timeout=args.deadline + 30)
        committed_at = time.time()
        time.sleep(max(0.0, noticed_at + args.deadline - time.time()))
        hosts.kill_host("worker2")
        record = finish(hosts, "drain", "drain")
        event = next(e for e in record["events"] if e["reason"] == "drain notice")
        results["drain"] = {"notice_to_checkpoint_s": committed_at - noticed_at,
                            "deadline_to_next_step_s": event["at"] + event["first_step_s"] - noticed_at - args.deadline,
                            "steps_lost": event["steps_lost"],
                            "val_accuracy": record["history"][-1]["val_accuracy"], "cpu_hours": record["cpu_hours"]}
    finally:
        hosts.down()
    base = results["undisturbed"]["val_accuracy"]
    kill, drain = results["kill"], results["drain"]
    print(f"\n{'event':<8} {'to the next finished step':<44} {'lost':<30} {'val_accuracy (undisturbed)'}")
    print(f"{'kill':<8} {kill['to_next_step_s']:>5.1f} s after the kill{'':<20} "
          f"{'since a checkpoint ' + format(kill['checkpoint_age_s'], '.1f') + ' s old':<30} "
          f"{kill['val_accuracy']:.4f} ({base:.4f})")
    print(f"{'drain':<8} {drain['deadline_to_next_step_s']:>5.1f} s after the deadline "
          f"(checkpoint {drain['notice_to_checkpoint_s']:.1f} s after the notice) "
          f"{str(drain['steps_lost']) + ' finished steps':<30} {drain['val_accuracy']:.4f} ({base:.4f})")
    prices = cpu_hour_prices()
    on_demand = results["undisturbed"]["cpu_hours"] * prices["cpu_worker"]
    print(f"\nledger: undisturbed {results['undisturbed']['cpu_hours']:.4f} CPU-hours, on-demand {on_demand:.5f} USD")
    for name in ("kill", "drain"):
        r = results[name]
        r["spot_usd"], r["on_demand_undisturbed_usd"] = r["cpu_hours"] * prices["cpu_spot_worker"], on_demand
        print(f"ledger: {name} on spot {r['cpu_hours']:.4f} CPU-hours, {r['spot_usd']:.5f} USD "
              f"({r['spot_usd'] / on_demand:.2f} of the undisturbed run on-demand)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
