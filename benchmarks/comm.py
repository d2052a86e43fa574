"""Gradients over a slow link: the same run with each `train.comm` option, side by side.

    sudo .venv/bin/python benchmarks/comm.py --link-mbit 100    # ~4 minutes on 2 cores; run it alone (needs root)

Builds the hosts of ops/local_hosts.py with every host's link limited to `--link-mbit` Mbit/s each
way (tc token-bucket filters; measured after `up`), and submits from the client host one run per
variant (a `compression`, or local SGD: `syncN` is `sync_every: N`): digits with a 512x512 MLP
(~300k parameters: 1.2 MB of fp32 gradients a step), 2 workers of 2 CPUs, one per worker host
(hosts of 3 logical CPUs: room for Ray Data's one beside them), `global_batch_size: 64`, fp32
training (in bf16 training the gradients travel in bf16 already), ZeRO-`--stage` (0: local SGD
needs it). For each: samples/s of the epochs after the first (the bundle's metrics), and the
validation loss and accuracy after the same samples.

Goal (issue: communication that fits the link): at 100 Mbit/s, >= 2x the samples/s of uncompressed
synchronization with a validation loss at most 2 % higher. Half-precision gradients alone halve the
bytes, not the time; local SGD sends 1/N of the traffic (int8 and PowerSGD are not offered yet).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from elastic import finish, local_hosts

RUN = ["--set", "train.num_workers=2", "--set", "train.cpus_per_worker=2", "--set", "train.placement=spread",
       "--set", "train.global_batch_size=64", "--set", "model.hidden=[512, 512]", "--set", "train.precision=fp32",
       "--set", "track.enabled=false"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link-mbit", type=float, default=100, help="0: the veths' own speed")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--stage", type=int, default=0, help="ZeRO stage (local SGD needs 0)")
    p.add_argument("--variants", default="none,bf16,fp16,sync4,sync8",
                   help="compressions (none, bf16, fp16) and local SGD (syncN: train.comm.sync_every=N)")
    p.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = p.parse_args()
    reason = local_hosts.can_make_hosts()
    if reason:
        sys.exit(f"cannot build hosts here: {reason}")
    hosts = local_hosts.Hosts(f"fltcomm{int(time.time()) % 10000}", workers=2, worker_cpus=3, link_mbit=args.link_mbit)
    results = {}
    try:
        hosts.up()
        link = hosts.measure_link()
        limit = f"limited to {args.link_mbit:g} Mbit/s" if args.link_mbit else "not limited"
        print(f"links {limit}; measured worker1 -> worker2 {link:.1f} Mbit/s", flush=True)
        for variant in args.variants.split(","):
            run = f"comm-{variant}"
            comm = (f"train.comm.sync_every={variant.removeprefix('sync')}" if variant.startswith("sync")
                    else f"train.comm.compression={variant}")
            out = hosts.submit(run, "pipelines/train.py", "--config", "configs/digits.yaml", "--set", f"train.run_name={run}",
                               "--set", f"train.epochs={args.epochs}", "--set", f"train.zero_stage={args.stage}",
                               "--set", comm, *RUN, wait=False, timeout=120)
            if out.returncode != 0:
                raise RuntimeError(f"submitting {run}: {out.stderr[-3000:]}")
            history = finish(hosts, run, run)["history"]
            later = history[1:] or history  # the first epoch carries the start-up
            results[variant] = {
                "samples_per_s": sum(m["samples_per_s"] for m in later) / len(later),
                "val_accuracy": history[-1]["val_accuracy"], "val_loss": history[-1]["val_loss"],
                "gradient_dtype": history[-1]["gradient_dtype"],
            }
            print(f"{variant}: {results[variant]}", flush=True)
    finally:
        hosts.down()
    base = results[args.variants.split(",")[0]]
    print(f"\n{f'{args.link_mbit:g} Mbit/s links' if args.link_mbit else 'links not limited'} (measured {link:.1f} Mbit/s), "
          f"ZeRO-{args.stage}, fp32 training, 2 workers on 2 hosts")
    print(f"{'comm':<12} {'gradients':<10} {'samples/s':>10} {'x first':>7} {'val_loss':>9} {'x first':>7} {'val_accuracy':>13}")
    for name, r in results.items():
        print(f"{name:<12} {r['gradient_dtype']:<10} {r['samples_per_s']:>10.0f} {r['samples_per_s'] / base['samples_per_s']:>7.2f} "
              f"{r['val_loss']:>9.4f} {r['val_loss'] / base['val_loss']:>7.2f} {r['val_accuracy']:>13.4f}")
    if args.out:
        args.out.write_text(json.dumps({"link_mbit": args.link_mbit, "measured_mbit": link, "results": results}, indent=1))


if __name__ == "__main__":
    main()
