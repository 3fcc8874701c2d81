"""Benchmark: train.py samples/s on one config for the single-device optimisations of the tutorial.

    python -m utils.bench_train --data_dir data/era5 [--config demo] [--out bench_results/train_demo.json]

Each variant runs train.py for one warm-up epoch plus part of a second and reports the second epoch's
samples/s (from train.py's own "Time taken for epoch" line). Variants whose steps are very slow on this
device (reduced precision on CPUs without native support) run a few steps only and say so.
"""
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

import torch

from utils.errors import ArgumentParser

VARIANTS = [  # name, train.py flags
    ("baseline (0 workers)", ["--num_data_workers", "0"]),
    ("2 workers", ["--num_data_workers", "2"]),
    ("4 workers", ["--num_data_workers", "4"]),
    ("2 workers + bf16", ["--num_data_workers", "2", "--amp_mode", "bf16"]),
    ("2 workers + fused Adam", ["--num_data_workers", "2", "--enable_fused"]),
    ("2 workers + fused + compile", ["--num_data_workers", "2", "--enable_fused", "--enable_jit"]),
]
EPOCH_LINE = re.compile(r"Time taken for epoch (\d+) is ([\d.]+) sec, avg ([\d.]+) samples/sec")
MFU_LINE = re.compile(r"Throughput per device: ([\d.]+) TFLOP/s, MFU ([\d.]+)%")


def run_variant(args, flags, num_iters, workdir):
    command = [sys.executable, "train.py", "--yaml_config", args.yaml_config, "--config", args.config,
               "--data_dir", args.data_dir, "--expdir", workdir, "--num_iters", str(num_iters),
               "--checkpoint_interval", "0", "--run_num", str(len(os.listdir(workdir))), *flags]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: train.py failed for {flags}:\n{result.stderr[-2000:]}")
    epochs = EPOCH_LINE.findall(result.stderr)
    mfus = MFU_LINE.findall(result.stderr)
    return {"epoch": int(epochs[-1][0]), "epoch_seconds": float(epochs[-1][1]),
            "samples_per_sec": float(epochs[-1][2]), "mfu_percent": float(mfus[-1][1])}


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--yaml_config", default="config/ViT.yaml")
    parser.add_argument("--config", default="demo")
    parser.add_argument("--steps_per_epoch", type=int, default=32, help="the config's steps per epoch")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    slow_precision = not torch.cuda.is_available()  # CPUs here emulate bf16 matmuls (~100x slower)

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, flags in VARIANTS:
            short = slow_precision and "bf16" in flags
            num_iters = 3 if short else args.steps_per_epoch + args.steps_per_epoch // 2
            print(f"[bench_train] {name}: {num_iters} iterations ...", flush=True)
            row = {"variant": name, "flags": " ".join(flags), "measured_over": "3 steps of epoch 1" if short
                   else "epoch 2 (epoch 1 is warm-up)", **run_variant(args, flags, num_iters, workdir)}
            print(f"[bench_train]   {row['samples_per_sec']:.2f} samples/s, MFU {row['mfu_percent']:.1f}%",
                  flush=True)
            rows.append(row)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    results = {"config": args.config, "device": device, "cpu_count": os.cpu_count(), "rows": rows}
    print(f"\n| variant | samples/s | MFU | measured over |  ({args.config}, {device}, {os.cpu_count()} cores)")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['samples_per_sec']:.2f} | {row['mfu_percent']:.1f}% "
              f"| {row['measured_over']} |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"[bench_train] wrote {args.out}")


if __name__ == "__main__":
    main()
