"""The tutorial's single-GPU table on the GPU at hand: each optimisation step as a row, one JSON with device, torch
and date, and the step's targets.

    make gpu-table      # python -m benchmarks.gpu_table --out bench_results/gpu/single_gpu_table.json

Rows (train.py's --enable_benchy on sample data at the real sizes; FULL = loader + copy + step, SYNTHETIC = the same
step on one batch kept on the GPU, IO = the loader alone):
  ViT `short`: baseline (fp32, no loader workers), 8 loader workers, DALI (where it imports), bf16 (8 workers),
  bf16 + fused Adam + torch.compile, bf16 + fused Adam under CUDA Graphs (train_graph.py); `short_h64` (6 heads of
  64, not in the original) bf16, eager and compiled;
  UNet `short` as the original walks it: 2 workers (the config's), 8, fp16 + fused Adam with 2 and 8, bf16 + fused,
  channels_last_3d, compile, both (only where --rows names it: the scripts refuse the pair on a GPU); ResNet
  `bs128` and `bs256-amp-nhwc-extra-opts`; the `mp` ViT at tp=1 on one GPU (train_mp.py, batch 16 as each GPU of
  the published run), eager and compiled;
  then each lever of the ViT step on its own (benchmarks/bench_levers.py, into the same JSON; `levers` in --rows
  places it, --levers-args chooses what it times).
A row that cannot run here (DALI not installed, CUDA Graphs without CUDA) is kept with the reason; each row says
which machine and date measured it (`ran`), and `--merge` keeps the rows of an existing report that a run does not
measure. Targets: ViT `short` bf16, 8 workers, FULL: eager >= 135 samples/s, fused + compile >= 165, the run with
the loader >= 95% of the same step without it, peak memory <= 14.2 GB; UNet `short`: FULL >= 90% of SYNTHETIC; each
with its measured value and whether it was met. On one H100 (2026-11-27) the ViT and UNet rows took 12 minutes at 12
batches x 2 trials; now 12 batches x 1 trial (4 for the fp32 ViT rows, whose step is 0.86 s), on 64 ERA5 samples a
year (4 steps an epoch). Where /dev/shm cannot hold 8 workers' rings, fewer workers run and the row says so.
`--tiny --allow-cpu` runs the same rows on the `tiny` configs (a check of this script on any machine).
"""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import torch

from benchmarks.common import DATA_SIZES, REPO_ROOT, device_name, make_data, ran_on, run_stage
from loaders.common import dali_installed
from utils.atomic import write_json
from utils.errors import ArgumentParser, error_line

BF16 = ["--amp_mode", "bf16", "--num_data_workers", "8"]
W8, FP16 = ["--num_data_workers", "8"], ["--amp_mode", "fp16", "--enable_fused"]
# the `mp` ViT at tp=1 on one GPU, local batch 16 as each of the published run's 4 A100s; its config names DALI,
# which a GPU node may lack: the PyTorch loader
MP_TP1 = ["--local_batch_size", "16", "--data_loader_config", "pytorch", "--num_data_workers", "8",
          "--tensor_parallel", "1", "--checkpoint_interval", "0"]
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
    "vit_h64_bf16": ("ViT short_h64 (6 heads of 64): bf16", "config/ViT.yaml", "short_h64", "era5", "train.py", BF16),
    "vit_h64_fused_compile": ("ViT short_h64 (6 heads of 64): bf16 + fused + compile", "config/ViT.yaml", "short_h64",
                              "era5", "train.py", [*BF16, "--enable_fused", "--enable_jit"]),
    "unet_short": ("UNet short", "config/UNet.yaml", "short", "cosmo", "train.py", []),
    "unet_w8": ("UNet short: 8 workers", "config/UNet.yaml", "short", "cosmo", "train.py", W8),
    "unet_fp16_fused": ("UNet short: fp16 + fused", "config/UNet.yaml", "short", "cosmo", "train.py", FP16),
    "unet_fp16_fused_w8": ("UNet short: fp16 + fused, 8 workers", "config/UNet.yaml", "short", "cosmo", "train.py",
                           [*FP16, *W8]),
    "unet_bf16_fused_w8": ("UNet short: bf16 + fused, 8 workers", "config/UNet.yaml", "short", "cosmo", "train.py",
                           ["--amp_mode", "bf16", "--enable_fused", *W8]),
    "unet_fp16_fused_nhwc_w8": ("UNet short: fp16 + fused + channels_last_3d, 8 workers", "config/UNet.yaml", "short",
                                "cosmo", "train.py", [*FP16, *W8, "--enable_nhwc"]),
    "unet_fp16_fused_jit_w8": ("UNet short: fp16 + fused + compile, 8 workers", "config/UNet.yaml", "short", "cosmo",
                               "train.py", [*FP16, *W8, "--enable_jit"]),
    "unet_fp16_fused_nhwc_jit_w8": ("UNet short: fp16 + fused + channels_last_3d + compile, 8 workers",
                                    "config/UNet.yaml", "short", "cosmo", "train.py",
                                    [*FP16, *W8, "--enable_nhwc", "--enable_jit"]),
    "resnet_bs128": ("ResNet bs128", "config/ResNet50.yaml", "bs128", "cifar100", "train.py", []),
    "resnet_extra_opts": ("ResNet bs256-amp-nhwc-extra-opts", "config/ResNet50.yaml", "bs256-amp-nhwc-extra-opts",
                          "cifar100", "train.py", []),
    "mp_tp1": ("ViT mp, tp=1 (fp16, batch 16)", "config/ViT.yaml", "mp", "era5", "train_mp.py", MP_TP1),
    "mp_tp1_compile": ("ViT mp, tp=1 (fp16, batch 16) + compile", "config/ViT.yaml", "mp", "era5", "train_mp.py",
                       [*MP_TP1, "--enable_jit"]),
}
# run only when --rows names it: the training scripts refuse the pair on a GPU (the H200's run of 2026-11-28, torch
# 2.11, stopped at the first backward; compare PyTorch issue 171622), so the row says that refusal until it is lifted
NAMED_ONLY = ("unet_fp16_fused_nhwc_jit_w8",)
DEFAULT_ROWS = [name for name in ROWS if name not in NAMED_ONLY]
LEVERS = "levers"  # a name --rows takes beside the rows: benchmarks/bench_levers.py, where it stands in the list
# the fp32 ViT step takes 0.86 s on an H100 (2026-11-27) and varied by 0.02% between trials: 4 batches measure it
FP32_VIT_ROWS = ("vit_baseline", "vit_workers")
TARGETS = {  # (row, what, at least / at most)
    "eager_samples_per_s": ("vit_bf16", "FULL samples/s", 135.0, None),
    "fused_compile_samples_per_s": ("vit_fused_compile", "FULL samples/s", 165.0, None),
    "loader_fraction_eager": ("vit_bf16", "FULL / SYNTHETIC", 0.95, None),
    "loader_fraction_fused_compile": ("vit_fused_compile", "FULL / SYNTHETIC", 0.95, None),
    "peak_memory_gb": ("vit_bf16", "peak memory GB", None, 14.2),
    "unet_loader_fraction": ("unet_short", "FULL / SYNTHETIC", 0.90, None),  # issue #39: the loader keeps up
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


class Deadline(Exception):
    """SIGTERM (gpu_session.sh's deadline for the part): keep what was measured, then stop."""


def on_sigterm(signum, frame):
    raise Deadline()


def run_levers(era5_dir, work, tiny, extra=()):
    """benchmarks/bench_levers.py in its own process: each lever of the ViT step on its own; its JSON, or the error."""
    out = os.path.join(work, "levers.json")
    # the levers' one loader holds one ring: workers_that_fit counts two, so what it allows fits
    workers, note = workers_that_fit(["--num_data_workers", "8"], tiny, shm_free_bytes())
    command = [sys.executable, "-m", "benchmarks.bench_levers", "--data_dir", era5_dir, "--out", out,
               "--workers", workers[-1], *(["--tiny", "--steps", "3", "--warmup", "1"] if tiny else []), *extra]
    if note:
        log(f"levers: {note}")
    log(f"levers: {' '.join(command[1:])}")
    if os.path.exists(out):
        os.remove(out)  # an earlier run's
    try:  # its progress goes to this log as it comes
        result = subprocess.run(command, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    except Deadline:  # the session's deadline stopped both: what it measured so far (it writes after each variant)
        if not os.path.exists(out):
            raise
        with open(out) as f:
            return {"ok": True, "cut": "stopped by the session's deadline", **json.load(f)}
    if result.returncode != 0:
        return {"ok": False, "error": [error_line(result.stderr)]}
    with open(out) as f:
        return {"ok": True, **json.load(f)}


def run_row(name, tiny, data, work, bench, ran):
    """One row of the table: its --enable_benchy run's JSON with `ran` (the machine and date), or why not."""
    label, yaml, config, dataset, script, flags = ROWS[name]
    reason = cannot_run(script, flags)
    if reason:
        log(f"{label}: not run ({reason})")
        return {"ok": False, "skipped": reason}
    flags, note = workers_that_fit(flags, tiny, shm_free_bytes())
    if note:
        log(f"{label}: {note}")
    if tiny and "--local_batch_size" in flags:  # the tiny config's batch
        at = flags.index("--local_batch_size") + 1
        flags = [*flags[:at], "4", *flags[at + 1:]]
    row_bench = {**bench, "nbatches": 4} if name in FP32_VIT_ROWS and not tiny else bench
    result = run_stage(name, yaml, "tiny" if tiny else config, data[dataset], flags, work, row_bench,
                       script=script, log=log)
    if result["ok"]:
        log(f"{label}: FULL {result['FULL']['mean']:.1f} samples/s, SYNTHETIC {result['SYNTHETIC']['mean']:.1f}, "
            f"IO {result['IO']['mean']:.1f}, peak memory {result['peak_memory_gb']:.2f} GB ({result['seconds']:.0f} s)")
    else:
        log(f"{label} FAILED: {result['error'][0]}")
    return {**result, "ran": ran, **({"note": note} if note else {})}


RUN_KEYS = ("device", "torch", "date", "steps")  # what names a levers run


def merged(old, new):
    """`new` with the rows of `old` that `new` did not run (each keeping the stamp of the run that measured it) and
    the levers of both, each measurement the newest."""
    rows = {name: {"ran": ran_on(old), **result} for name, result in old.get("rows", {}).items()
            if name not in new["rows"]}
    order = [name for name in ROWS if name in rows or name in new["rows"]]
    new["rows"] = {name: new["rows"].get(name) or rows[name] for name in order}
    old_levers, new_levers = old.get("levers", {}), new.get("levers")
    if old_levers.get("ok") and (not new_levers or not new_levers.get("ok")):
        new["levers"] = old_levers if not new_levers or "skipped" in new_levers else {**old_levers,
                                                                                     "last_error": new_levers}
    elif old_levers.get("ok"):
        runs = old_levers.get("runs") or [{key: old_levers[key] for key in RUN_KEYS if key in old_levers}]
        levers = {**old_levers, **{k: v for k, v in new_levers.items() if not isinstance(v, dict)}}
        for key, value in new_levers.items():
            if isinstance(value, dict):
                levers[key] = {**old_levers.get(key, {}), **value}
        levers["runs"] = [*runs, {key: new_levers[key] for key in RUN_KEYS if key in new_levers}]
        new["levers"] = levers
    return new


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
            lines.append(f"| {label} | not run: {result.get('skipped') or ' '.join(result.get('error', []))} | | | |")
    return "\n".join(lines)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/gpu/single_gpu_table.json", help="the JSON report")
    parser.add_argument("--work", default="data/gpu_table", help="sample data and runs go here")
    parser.add_argument("--rows", default=",".join([*DEFAULT_ROWS, LEVERS]),
                        help=f"comma-separated rows to run in this order, '{LEVERS}' among them for "
                        f"benchmarks/bench_levers.py (default: all but {', '.join(NAMED_ONLY)}, then the levers)")
    parser.add_argument("--tiny", action="store_true", help="the tiny configs and data (a check of this script)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (with --tiny, for tests)")
    parser.add_argument("--skip-levers", action="store_true", help="the table's rows only")
    parser.add_argument("--levers-args", default="", help="more arguments of bench_levers, e.g. \"--variants "
                        "now,cast_by_each --attention '' --compiled default\"")
    parser.add_argument("--merge", action="store_true", help="keep the rows (and levers) of an existing --out that "
                        "this run does not measure, each with the machine and date that measured it")
    parser.add_argument("--data-only", action="store_true", help="generate the sample data and stop (to make it "
                        "on the CPU while the GPU does something else)")
    parser.add_argument("--datasets", default="era5,cosmo,cifar100", help="with --data-only: which sample data")
    args = parser.parse_args(argv)
    names = [name for name in args.rows.split(",") if name and not (name == LEVERS and args.skip_levers)]
    unknown = sorted(set(names) - set(ROWS) - {LEVERS})
    if unknown:
        print(f"error: unknown row {', '.join(unknown)}; choose among: {', '.join([*ROWS, LEVERS])}", file=sys.stderr)
        return 2
    sizes = "tiny" if args.tiny else "full"
    work = os.path.abspath(args.work)
    unknown = sorted(set(args.datasets.split(",")) - set(TABLE_SIZES[sizes]))
    if unknown:
        print(f"error: unknown data set {', '.join(unknown)}; choose among: {', '.join(TABLE_SIZES[sizes])}",
              file=sys.stderr)
        return 2
    if args.data_only:
        make_data(os.path.join(work, sizes), TABLE_SIZES[sizes], log, names=args.datasets.split(","))
        return 0
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: make gpu-table measures a GPU (torch.cuda.is_available() is False here); run it on a GPU "
              "node, e.g. `salloc -C gpu -N 1 -G 1` then `make gpu-table`", file=sys.stderr)
        return 2
    old = None
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
    report = {"device": device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": time.strftime("%Y-%m-%d"), "started": time.ctime(), "tiny": args.tiny, "rows": {}}
    needed = {ROWS[name][3] for name in names if name in ROWS} | ({"era5"} if LEVERS in names else set())
    data = make_data(os.path.join(work, sizes), TABLE_SIZES[sizes], log, names=needed)
    bench = {"nbatches": 2, "ntrials": 1, "nwarmup": 0} if args.tiny else {"nbatches": 12, "ntrials": 1, "nwarmup": 1}

    def save():  # after every row: a run cut short keeps what it measured
        done = {**report, "rows": dict(report["rows"])}
        done = merged(json.loads(json.dumps(old)), done) if old else done
        write_json(args.out, {**done, "targets": check_targets(done["rows"])})

    before = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for name in names:
            if name == LEVERS:
                report["levers"] = run_levers(data["era5"], work, args.tiny, shlex.split(args.levers_args))
                if report["levers"].get("cut"):
                    raise Deadline()  # the levers kept what they measured; the session stops this part
            else:
                report["rows"][name] = run_row(name, args.tiny, data, work, bench, ran_on(report))
            save()
    except Deadline:
        save()
        log(f"stopped by the session's deadline; what it measured is in {args.out}")
        return 124
    finally:
        signal.signal(signal.SIGTERM, before)
    if LEVERS not in names:
        report["levers"] = {"skipped": "--skip-levers" if args.skip_levers else "not among --rows"}
    if old:
        report = merged(old, report)
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
