"""Gradients over a slow link: the same run with each `train.comm` option, side by side.

    sudo .venv/bin/python benchmarks/comm.py --model gpt --link-mbit 100   # ~8 minutes on 2 cores (1 Gbit/s: ~6); alone, root
    sudo .venv/bin/python benchmarks/comm.py --model digits --link-mbit 100 --variants none,bf16,int8,sync4

Builds the hosts of ops/local_hosts.py with every host's link limited to `--link-mbit` Mbit/s each
way (tc token-bucket filters; measured after `up`), and submits from the client host one run per
variant: a `compression` (none, bf16, fp16, int8, powersgd) or local SGD (`syncN` is `sync_every: N`,
`auto` is `sync_every: auto`). 2 workers of 2 CPUs, one per worker host (hosts of 3 logical CPUs:
room for Ray Data's one beside them), fp32 training (in bf16 training the gradients travel in bf16
already), ZeRO-`--stage` (0: int8, PowerSGD and local SGD need it). The models:

- `gpt`: a byte-level GPT of 3.3M parameters (4 layers, width 256, context 128: 13 MB of fp32
  gradients a step) on 60 kB of the Python standard library, 16 windows a step;
- `digits`: the digits MLP with two 512-wide layers (~300k parameters: 1.2 MB a step), 64 rows a step.

For each: samples/s of the epochs after the first (the bundle's metrics), and the validation loss
(and for digits the accuracy) after the same samples.

Goal (issue: communication that fits the link): at 100 Mbit/s, >= 2x the samples/s of uncompressed
synchronization with a validation loss at most 2 % higher.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from elastic import finish, local_hosts

RUN = ["train.num_workers=2", "train.cpus_per_worker=2", "train.placement=spread", "train.precision=fp32",
       "track.enabled=false"]
MODELS = {
    "digits": ("configs/digits.yaml", ["train.global_batch_size=64", "model.hidden=[512, 512]"], 6),
    "gpt": ("configs/pycode_gpt.yaml", [
        "data.max_bytes=60000", "data.val_fraction=0.2", "model.width=256", "model.activation_checkpointing=false",
        "train.batch_size=8", "train.grad_accum=1"], 2),
}


def comm_settings(variant: str) -> list[str]:
    """`--set`s of a variant: `auto`, `syncN`, `powersgdR` (PowerSGD at rank R) or a compression."""
    if variant == "auto":
        return ["train.comm.sync_every=auto"]
    if variant.startswith("sync"):
        return [f"train.comm.sync_every={variant.removeprefix('sync')}"]
    if variant.startswith("powersgd") and variant != "powersgd":
        return ["train.comm.compression=powersgd", f"train.comm.powersgd_rank={variant.removeprefix('powersgd')}"]
    return [f"train.comm.compression={variant}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link-mbit", type=float, default=100, help="0: the veths' own speed")
    p.add_argument("--model", choices=sorted(MODELS), default="gpt")
    p.add_argument("--epochs", type=int, help="default: 2 for gpt, 6 for digits")
    p.add_argument("--stage", type=int, default=0, help="ZeRO stage (local SGD needs 0)")
    p.add_argument("--variants", default="none,bf16,powersgd,auto",
                   help="compressions (none, bf16, fp16, int8, powersgd; powersgdR: at rank R) and local SGD (syncN: train.comm.sync_every=N; "
                        "auto: train.comm.sync_every=auto)")
    p.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = p.parse_args()
    config, model_sets, default_epochs = MODELS[args.model]
    epochs = args.epochs or default_epochs
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
            sets = [f"train.run_name={run}", f"train.epochs={epochs}", f"train.zero_stage={args.stage}",
                    *comm_settings(variant), *RUN, *model_sets]
            out = hosts.submit(run, "pipelines/train.py", "--config", config,
                               *[arg for s in sets for arg in ("--set", s)], wait=False, timeout=120)
            if out.returncode != 0:
                raise RuntimeError(f"submitting {run}: {out.stderr[-3000:]}")
            history = finish(hosts, run, run, timeout=3600)["history"]
            later = history[1:] or history  # the first epoch carries the start-up
            results[variant] = {
                "samples_per_s": sum(m["samples_per_s"] for m in later) / len(later),
                "val_accuracy": history[-1].get("val_accuracy"), "val_loss": history[-1]["val_loss"],
                "gradient_dtype": history[-1]["gradient_dtype"], "sync_every": history[-1]["sync_every"],
                "sync_auto": history[-1].get("sync_auto"),
                # (waiting for the next batch from Ray Data, seconds, the slowest rank's, per epoch after the first)
                "data_wait_s": sum(m.get("data_wait_s", 0.0) for m in later) / len(later),
                "epoch_s": sum(m.get("epoch_time_s", 0.0) for m in later) / len(later),
            }
            print(f"{variant}: {results[variant]}", flush=True)
    finally:
        hosts.down()
    base = results[args.variants.split(",")[0]]
    print(f"\n{f'{args.link_mbit:g} Mbit/s links' if args.link_mbit else 'links not limited'} (measured {link:.1f} Mbit/s), "
          f"{args.model}, ZeRO-{args.stage}, fp32 training, 2 workers on 2 hosts, {epochs} epochs")
    print(f"{'comm':<12} {'gradients':<10} {'every':>5} {'samples/s':>10} {'x first':>7} {'val_loss':>9} {'x first':>7} "
          f"{'val_accuracy':>13}")
    for name, r in results.items():
        accuracy = f"{r['val_accuracy']:>13.4f}" if r["val_accuracy"] is not None else f"{'-':>13}"
        print(f"{name:<12} {r['gradient_dtype']:<10} {r['sync_every']:>5} {r['samples_per_s']:>10.1f} "
              f"{r['samples_per_s'] / base['samples_per_s']:>7.2f} {r['val_loss']:>9.4f} {r['val_loss'] / base['val_loss']:>7.3f} "
              f"{accuracy}")
    for name, r in results.items():
        if r["sync_auto"]:
            print(f"{name}: {r['sync_auto']}")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "link_mbit": args.link_mbit, "measured_mbit": link,
                                        "epochs": epochs, "results": results}, indent=1))


if __name__ == "__main__":
    main()
