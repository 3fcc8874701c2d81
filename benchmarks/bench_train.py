"""Benchmark: train.py throughput per optimisation step of a tutorial stage, as a table and JSON.

    python -m benchmarks.bench_train --suite vit --data_dir data/era5     [--out bench_results/train_demo.json]
    python -m benchmarks.bench_train --suite unet --data_dir data/cosmo   (the built-in IO / SYNTHETIC / FULL benchmark)
    python -m benchmarks.bench_train --suite resnet --data_dir data/cifar100

vit and resnet: each variant runs train.py for one warm-up epoch plus part of a second and reports the
second epoch's samples/s (train.py's own "Time taken for epoch" line). Variants whose steps are very slow
on this device (reduced precision on CPUs without native support) run a few steps only and say so.
unet: each variant runs `train.py --enable_benchy` and reports its IO, SYNTHETIC and FULL samples/s.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from benchmarks.common import device_name
from utils.atomic import write_json
from utils.errors import ArgumentParser

# yaml, config, steps per epoch of that config on the default sample data (None: run 2 whole epochs), variants
SUITES = {
    "vit": ("config/ViT.yaml", "demo", 32, [
        ("baseline (0 workers)", ["--num_data_workers", "0"]),
        ("2 workers", ["--num_data_workers", "2"]),
        ("4 workers", ["--num_data_workers", "4"]),
        ("2 workers + bf16", ["--num_data_workers", "2", "--amp_mode", "bf16"]),
        ("2 workers + fused Adam", ["--num_data_workers", "2", "--enable_fused"]),
        ("2 workers + fused + compile", ["--num_data_workers", "2", "--enable_fused", "--enable_jit"]),
    ]),
    "unet": ("config/UNet.yaml", "demo", None, [
        ("lowmem, 0 workers", ["--data_loader_config", "lowmem", "--num_data_workers", "0"]),
        ("lowmem, 2 workers", ["--data_loader_config", "lowmem", "--num_data_workers", "2"]),
        ("lowmem, 4 workers", ["--data_loader_config", "lowmem", "--num_data_workers", "4"]),
        ("inmem, 2 workers", ["--data_loader_config", "inmem", "--num_data_workers", "2"]),
        ("inmem, 2 workers + bf16", ["--data_loader_config", "inmem", "--num_data_workers", "2",
                                     "--amp_mode", "bf16"]),
        ("inmem, 2 workers + compile", ["--data_loader_config", "inmem", "--num_data_workers", "2",
                                        "--enable_jit"]),
    ]),
    "resnet": ("config/ResNet50.yaml", "demo", None, [
        ("baseline", []),
        ("bf16", ["--amp_mode", "bf16"]),
        ("bf16 + channels_last", ["--amp_mode", "bf16", "--enable_nhwc"]),
        ("bf16 + channels_last + fused SGD", ["--amp_mode", "bf16", "--enable_nhwc", "--enable_fused"]),
    ]),
}
EPOCH_LINE = re.compile(r"Time taken for epoch (\d+) is ([\d.]+) sec, avg ([\d.]+) samples/sec")
MFU_LINE = re.compile(r"Throughput per device: ([\d.]+) TFLOP/s, MFU ([\d.]+)%")


def run_train(args, yaml_config, flags, workdir, env=None):
    command = [sys.executable, "train.py", "--yaml_config", yaml_config, "--config", args.config,
               "--data_dir", args.data_dir, "--expdir", workdir, "--checkpoint_interval", "0", *flags]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"error: train.py failed for {flags}:\n{result.stderr[-2000:]}")
    return result.stderr


def epoch_throughput(args, yaml_config, steps_per_epoch, flags, slow, workdir):
    """samples/s and MFU of epoch 2 (epoch 1 is warm-up), or of a few steps of epoch 1 when `slow`."""
    if slow:
        length = ["--num_iters", "3"]
    elif steps_per_epoch:
        length = ["--num_iters", str(steps_per_epoch + steps_per_epoch // 2)]
    else:
        length = ["--num_epochs", "2"]
    log = run_train(args, yaml_config, [*length, *flags], workdir)
    epochs, mfus = EPOCH_LINE.findall(log), MFU_LINE.findall(log)
    return {"measured_over": "3 steps of epoch 1" if slow else "epoch 2 (epoch 1 is warm-up)",
            "epoch_seconds": float(epochs[-1][1]), "samples_per_sec": float(epochs[-1][2]),
            "mfu_percent": float(mfus[-1][1])}


def benchy_throughput(args, yaml_config, flags, workdir):
    """IO / SYNTHETIC / FULL samples/s from train.py --enable_benchy."""
    out = os.path.join(workdir, "benchy")
    run_train(args, yaml_config, ["--enable_benchy", "--benchy_nbatches", str(args.benchy_nbatches),
                                  "--benchy_ntrials", "2", "--benchy_nwarmup", "1", *flags],
              workdir, env=dict(os.environ, BENCHY_OUTPUT=out))
    with open(out + ".json") as f:
        results = json.load(f)
    return {name: {"mean": results[name]["mean"], "std": results[name]["std"]} for name in ("IO", "SYNTHETIC", "FULL")}


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=list(SUITES), default="vit")
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--config", default="demo")
    parser.add_argument("--steps_per_epoch", type=int, default=None,
                        help="the config's steps per epoch (default: 32 for vit demo; whole epochs for resnet)")
    parser.add_argument("--benchy_nbatches", type=int, default=20, help="batches per benchmark trial (unet)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    yaml_config, _, default_steps, variants = SUITES[args.suite]
    steps_per_epoch = args.steps_per_epoch or default_steps
    slow_precision = not torch.cuda.is_available()  # CPUs here emulate bf16 matmuls (~100x slower)

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for index, (name, flags) in enumerate(variants):
            print(f"[bench_train] {args.suite}: {name} ...", flush=True)
            variant_dir = os.path.join(workdir, str(index))  # a fresh run directory: nothing to resume
            os.makedirs(variant_dir)
            row = {"variant": name, "flags": " ".join(flags)}
            if args.suite == "unet":
                row.update(benchy_throughput(args, yaml_config, flags, variant_dir))
                print("[bench_train]   " + ", ".join(f"{k} {row[k]['mean']:.2f}" for k in ("IO", "SYNTHETIC", "FULL"))
                      + " samples/s", flush=True)
            else:
                slow = slow_precision and "bf16" in flags
                row.update(epoch_throughput(args, yaml_config, steps_per_epoch, flags, slow, variant_dir))
                print(f"[bench_train]   {row['samples_per_sec']:.2f} samples/s, MFU {row['mfu_percent']:.1f}%",
                      flush=True)
            rows.append(row)

    device = device_name()
    results = {"suite": args.suite, "config": args.config, "device": device, "cpu_count": os.cpu_count(),
               "rows": rows}
    print(f"\n({args.suite}, config {args.config}, {device}, {os.cpu_count()} cores)")
    if args.suite == "unet":
        print("| variant | IO samples/s | SYNTHETIC samples/s | FULL samples/s |\n|---|---|---|---|")
        for row in rows:
            print(f"| {row['variant']} | " + " | ".join(f"{row[k]['mean']:.2f} +/- {row[k]['std']:.2f}"
                                                     for k in ("IO", "SYNTHETIC", "FULL")) + " |")
    else:
        print("| variant | samples/s | MFU | measured over |\n|---|---|---|---|")
        for row in rows:
            print(f"| {row['variant']} | {row['samples_per_sec']:.2f} | {row['mfu_percent']:.1f}% "
                  f"| {row['measured_over']} |")
    if args.out:
        write_json(args.out, results)
        print(f"[bench_train] wrote {args.out}")


if __name__ == "__main__":
    main()
