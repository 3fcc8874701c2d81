"""The tutorial's single-GPU table on the GPU at hand: each optimisation step as a row, one JSON with device, torch
and date, and the step's targets.

    make gpu-table      # python -m benchmarks.gpu_table --out bench_results/gpu/single_gpu_table.json

Rows (train.py's --enable_benchy on sample data at the real sizes; FULL = loader + copy + step, SYNTHETIC = the same
step on one batch kept on the GPU):
  ViT `short`: baseline (fp32, no loader workers), 8 loader workers, DALI (where it imports), bf16 (8 workers),
  bf16 + fused Adam + torch.compile, bf16 + fused Adam under CUDA Graphs (train_graph.py);
  UNet `short` and `short` with fp16 + fused Adam; ResNet `bs128` and `bs256-amp-nhwc-extra-opts`;
  then each lever of the ViT step on its own (benchmarks/bench_levers.py, into the same JSON).
A row that cannot run here (DALI not installed, CUDA Graphs without CUDA) is kept with the reason. Targets (ViT
`short` bf16, 8 workers, FULL): eager >= 135 samples/s, fused + compile >= 165, the run with the loader >= 95% of
the same step without it, peak memory <= 14.2 GB; each with its measured value and whether it was met. On one H100
(2026-11-27) the rows took 12 minutes in all at 12 batches x 2 trials on 128 samples a year; now 12 batches x 1
trial (4 for the fp32 ViT rows, whose step is 0.86 s) on 64 samples (4 steps an epoch), estimated from those rows'
times at about 7.5 minutes with the data, and 1 more for the levers (not yet rerun on a GPU). Where /dev/shm cannot
hold 8 workers' rings, fewer workers run and the row says so. `--tiny --allow-cpu` runs the same rows on the `tiny`
configs (a check of this script on any machine).
"""
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from benchmarks.common import DATA_SIZES, REPO_ROOT, device_name, make_data, run_stage
from loaders.common import dali_installed
from utils.atomic import write_json
from utils.errors import ArgumentParser

BF16 = ["--amp_mode", "bf16", "--num_data_workers", "8"]
# name: (label, yaml, config, data set, script, flags)
ROWS = {
    "vit_baseline": ("ViT short: baseline (fp32, 0 workers)", "config/ViT.yaml", "short", "era5", "train.py",
                     ["--num_data_workers", "0"]),
    "vit_workers": ("ViT short: 8 loader workers", "config/ViT.yaml", "short", "era5", "train.py",
                    ["--num_data_workers", "8"]),
    "vit_dali": ("ViT short: DALI, 8 workers", "config/ViT.yaml", "short", "era5", "train.py",
                 ["--num_data_workers", "8", "--data_loader_config", "dali"]),
    "vit_bf16": ("ViT short: bf16", "config/ViT.yaml", "short", "era5", "train.py", BF16),
    "vit_fused_compile": ("ViT short: bf16 + fused + compile", "config/ViT.yaml", "short", "era5", "train.py",
                          [*BF16, "--enable_fused", "--enable_jit"]),
    "vit_graphs": ("ViT short: bf16 + fused + CUDA Graphs", "config/ViT.yaml", "short", "era5", "train_graph.py",
                   [*BF16, "--enable_fused"]),
    "unet_short": ("UNet short", "config/UNet.yaml", "short", "cosmo", "train.py", []),
    "unet_fp16_fused": ("UNet short: fp16 + fused", "config/UNet.yaml", "short", "cosmo", "train.py",
                        ["--amp_mode", "fp16", "--enable_fused"]),
    "resnet_bs128": ("ResNet bs128", "config/ResNet50.yaml", "bs128", "cifar100", "train.py", []),
    "resnet_extra_opts": ("ResNet bs256-amp-nhwc-extra-opts", "config/ResNet50.yaml", "bs256-amp-nhwc-extra-opts",
                          "cifar100", "train.py", []),
}
# the fp32 ViT step takes 0.86 s on an H100 (2026-11-27) and varied by 0.02% between trials: 4 batches measure it
FP32_VIT_ROWS = ("vit_baseline", "vit_workers")
TARGETS = {  # (row, what, at least / at most)
    "eager_samples_per_s": ("vit_bf16", "FULL samples/s", 135.0, None),
    "fused_compile_samples_per_s": ("vit_fused_compile", "FULL samples/s", 165.0, None),
    "loader_fraction_eager": ("vit_bf16", "FULL / SYNTHETIC", 0.95, None),
    "loader_fraction_fused_compile": ("vit_fused_compile", "FULL / SYNTHETIC", 0.95, None),
    "peak_memory_gb": ("vit_bf16", "peak memory GB", None, 14.2),
}


# ERA5 at 360 x 720 with 64 samples a year: 4 steps of `short`'s batch 16 an epoch, so the runs cross epoch
# boundaries (the tutorial's `short` reads 512 samples: 32 steps)
TABLE_SIZES = {"full": {**DATA_SIZES["full"], "era5": {**DATA_SIZES["full"]["era5"], "steps_per_year": 64}},
               "tiny": DATA_SIZES["tiny"]}
VIT_SHORT_BATCH_BYTES = 16 * 2 * 20 * 360 * 720 * 4  # input and target of one `short` batch, float32: 664 MB


def shm_free_bytes():
    return shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None


def workers_that_fit(flags, tiny, free):
    """`flags` with --num_data_workers lowered where the ViT's two rings of shared memory (training and validation:
    (workers x 2 + 2) batches each) would not fit in /dev/shm's free space; a note saying so, or None."""
    if tiny or free is None or "--num_data_workers" not in flags:
        return flags, None
    at = flags.index("--num_data_workers") + 1
    asked = workers = int(flags[at])

    def rings(n):
        return 2 * (2 * n + 2) * VIT_SHORT_BATCH_BYTES

    while workers > 0 and rings(workers) > 0.9 * free:
        workers -= 1
    if workers == asked:
        return flags, None
    note = (f"{workers} loader workers instead of {asked}: /dev/shm has {free / 1e9:.1f} GB free, {asked} workers' "
            f"rings need {rings(asked) / 1e9:.1f} GB")
    return [*flags[:at], str(workers), *flags[at + 1:]], note


def log(message):
    print(f"[gpu-table {time.strftime('%H:%M:%S')}] {message}", flush=True)


def cannot_run(script, flags):
    """Why a row cannot run on this machine, or None."""
    if script == "train_graph.py" and not torch.cuda.is_available():
        return "CUDA Graphs need a CUDA GPU"
    if "dali" in flags and not dali_installed():
        return "NVIDIA DALI is not installed here (pip install nvidia-dali-cuda120)"
    return None


def measured(result, what):
    if what == "FULL samples/s":
        return result["FULL"]["mean"]
    if what == "FULL / SYNTHETIC":
        return result["FULL"]["mean"] / result["SYNTHETIC"]["mean"]
    return result["peak_memory_gb"]


def check_targets(rows):
    """Each target with its measured value and whether it was met (None where its row did not run)."""
    checked = {}
    for target, (row, what, at_least, at_most) in TARGETS.items():
        result = rows.get(row, {})
        value = measured(result, what) if result.get("ok") else None
        met = None if value is None else ((at_least is None or value >= at_least)
                                          and (at_most is None or value <= at_most))
        checked[target] = {"row": row, "what": what, "at_least": at_least, "at_most": at_most, "value": value,
                           "met": met}
    return checked


def run_levers(era5_dir, work, tiny):
    """benchmarks/bench_levers.py in its own process: each lever of the ViT step on its own; its JSON, or the error."""
    out = os.path.join(work, "levers.json")
    # the levers' one loader holds one ring: workers_that_fit counts two, so what it allows fits
    workers, note = workers_that_fit(["--num_data_workers", "8"], tiny, shm_free_bytes())
    command = [sys.executable, "-m", "benchmarks.bench_levers", "--data_dir", era5_dir, "--out", out,
               "--workers", workers[-1], *(["--tiny", "--steps", "3", "--warmup", "1"] if tiny else [])]
    if note:
        log(f"levers: {note}")
    log(f"levers: {' '.join(command[1:])}")
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    print(result.stdout[-3000:], flush=True)
    if result.returncode != 0:
        return {"ok": False, "error": result.stderr.strip().splitlines()[-1:] or ["(no output)"]}
    with open(out) as f:
        return {"ok": True, **json.load(f)}


def table(report):
    """The rows as README's Markdown table."""
    lines = ["| run | samples/s (with the loader) | step alone (SYNTHETIC) | MFU | peak memory |",
             "|---|---|---|---|---|"]
    for name, result in report["rows"].items():
        label = ROWS[name][0]
        if result.get("ok"):
            lines.append(f"| {label} | {result['FULL']['mean']:.1f} | {result['SYNTHETIC']['mean']:.1f} | "
                         f"{100 * result['FULL']['mfu']:.1f}% | {result['peak_memory_gb']:.1f} GB |")
        else:
            lines.append(f"| {label} | not run: {result.get('skipped') or result.get('error')} | | | |")
    return "\n".join(lines)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/gpu/single_gpu_table.json", help="the JSON report")
    parser.add_argument("--work", default="data/gpu_table", help="sample data and runs go here")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run (default: all)")
    parser.add_argument("--tiny", action="store_true", help="the tiny configs and data (a check of this script)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (with --tiny, for tests)")
    parser.add_argument("--skip-levers", action="store_true", help="the table's rows only")
    parser.add_argument("--data-only", action="store_true", help="generate the sample data and stop (to make it "
                        "on the CPU while the GPU does something else)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        print(f"error: unknown row {', '.join(unknown)}; choose among: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    sizes = "tiny" if args.tiny else "full"
    work = os.path.abspath(args.work)
    if args.data_only:
        make_data(os.path.join(work, sizes), TABLE_SIZES[sizes], log)
        return 0
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: make gpu-table measures a GPU (torch.cuda.is_available() is False here); run it on a GPU "
              "node, e.g. `salloc -C gpu -N 1 -G 1` then `make gpu-table`", file=sys.stderr)
        return 2
    report = {"device": device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": time.strftime("%Y-%m-%d"), "started": time.ctime(), "tiny": args.tiny, "rows": {}}
    data = make_data(os.path.join(work, sizes), TABLE_SIZES[sizes], log)
    bench = {"nbatches": 2, "ntrials": 1, "nwarmup": 0} if args.tiny else {"nbatches": 12, "ntrials": 1, "nwarmup": 1}
    for name in args.rows.split(","):
        label, yaml, config, dataset, script, flags = ROWS[name]
        reason = cannot_run(script, flags)
        if reason:
            report["rows"][name] = {"ok": False, "skipped": reason}
            log(f"{label}: not run ({reason})")
            continue
        flags, note = workers_that_fit(flags, args.tiny, shm_free_bytes())
        if note:
            log(f"{label}: {note}")
        row_bench = {**bench, "nbatches": 4} if name in FP32_VIT_ROWS and not args.tiny else bench
        result = run_stage(name, yaml, "tiny" if args.tiny else config, data[dataset], flags, work, row_bench,
                           script=script, log=log)
        report["rows"][name] = {**result, **({"note": note} if note else {})}
        write_json(args.out, report)  # after every row: a run cut short keeps what it measured
        if result["ok"]:
            log(f"{label}: FULL {result['FULL']['mean']:.1f} samples/s, SYNTHETIC {result['SYNTHETIC']['mean']:.1f}, "
                f"peak memory {result['peak_memory_gb']:.2f} GB ({result['seconds']:.0f} s)")
        else:
            log(f"{label} FAILED: {result['error'][0]}")
    report["levers"] = {"skipped": "--skip-levers"} if args.skip_levers else run_levers(data["era5"], work, args.tiny)
    report["targets"] = check_targets(report["rows"])
    report["table"] = table(report)
    write_json(args.out, report)
    print(report["table"], flush=True)
    log(f"report written to {args.out}")
    failed = [name for name, result in {**report["rows"], "levers": report["levers"]}.items() if "error" in result]
    if failed:
        print(f"error: gpu-table: {', '.join(failed)} failed (their log tails are in {args.out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
