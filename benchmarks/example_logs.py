"""Example logs: real runs of this project on its sample data, small enough to commit (`make example-logs`).

    python -m benchmarks.example_logs [--out example_logs] [--runs vit,vit-dp2,vit-dp4,wfm-tiny,unet,resnet]

Each run is train.py on the CPU (the demo configs are CPU-sized), and lands where train.py puts it,
<out>/<stage>/<config>/<N>GPU/00/, with its out.log and TensorBoard events (logs/events.out.tfevents.*);
the checkpoint and the run lock are removed. The runs:

  vit      <out>/vit/demo/1GPU/00     ViT `demo` config: batch 8, 256 iterations (8 epochs)
  vit-dp2  <out>/vit/demo/2GPU/00     the same data-parallel over 2 gloo ranks (torchrun), local batch 8
                                      (global 16), 128 iterations: the same 8 epochs
  vit-dp4  <out>/vit/demo/4GPU/00     4 ranks, global batch 32, 64 iterations (8 epochs)
  wfm-tiny <out>/vit/wfm_tiny/1GPU/00 `wfm_tiny`, the 0.25-degree family's CPU model, on 25 x 48 sample data read
                                      as 24 x 48 (as 721 x 1440 is read as 720 x 1440): batch 8, 256 iterations
  unet     <out>/unet/demo/1GPU/00    3D UNet `demo` config (4 epochs)
  resnet   <out>/resnet/demo/1GPU/00  ResNet18 `demo` config on CIFAR-100 sample data (3 epochs)

The data-parallel sweep keeps the local batch and the number of epochs, so every run sees the same samples;
the learning rate is the config's (no scaling with the batch). Missing sample data are generated first. An ERA5
run's summary gives persistence's validation loss beside the model's, on the same data and crop. A run
is written afresh (its old directory is removed). <out>/runs.json records the machine, date, commit, command
and wall time of each run; <out>/README.md says the same for readers. Copy a stage to TensorBoard's log
directory to compare with your own runs: `cp -r example_logs/vit $SCRATCH/dl-at-scale-training/logs`.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

from benchmarks.common import REPO_ROOT, free_port, machine
from resilience.exits import exit_on_user_error
from utils.atomic import write_bytes, write_json
from utils.errors import ArgumentParser, UserError, error_line

VIT_EPOCH_ITERS = 256  # the ViT demo config's num_iters at batch 8: 8 epochs of the default sample data

# name -> (stage folder, yaml, config, data kind, ranks, extra flags, what it is)
RUNS = {
    "vit": ("vit", "config/ViT.yaml", "demo", "era5", 1, ["--local_batch_size", "8", "--num_iters", "256"],
            "ViT demo, 1 process, batch 8"),
    "vit-dp2": ("vit", "config/ViT.yaml", "demo", "era5", 2, ["--local_batch_size", "8", "--num_iters", "128"],
                "ViT demo, 2 ranks (gloo), local batch 8, global 16"),
    "vit-dp4": ("vit", "config/ViT.yaml", "demo", "era5", 4, ["--local_batch_size", "8", "--num_iters", "64"],
                "ViT demo, 4 ranks (gloo), local batch 8, global 32"),
    "wfm-tiny": ("vit", "config/ViT.yaml", "wfm_tiny", "era5_wfm_tiny", 1, [],
                 "ViT wfm_tiny (the 0.25-degree configs' CPU model: 24 x 48 at patch 2, 288 tokens), 1 process, "
                 "batch 8"),
    "unet": ("unet", "config/UNet.yaml", "demo", "cosmo", 1, [], "3D UNet demo, 1 process"),
    "resnet": ("resnet", "config/ResNet50.yaml", "demo", "cifar100", 1, [],
               "ResNet18 demo (CIFAR-100 sample data), 1 process"),
}
# data kind -> (a file that exists once the data are there, relative to the data dir; generator arguments)
DATA = {
    "era5": ("stats/global_stds.npy", ["era5"]),
    # wfm_tiny's grid: 7.5 degrees with both poles (25 rows, 48 columns), as ERA5's 0.25 degrees is 721 x 1440
    "era5_wfm_tiny": ("stats/global_stds.npy", ["era5", "--height", "25", "--width", "48"]),
    "cosmo": ("downsamp_1024crop_valid.h5", ["cosmo"]),
    "cifar100": ("cifar-100-python/meta", ["cifar100"]),
}
LAST_VAL_LOSS = re.compile(r"Avg val loss=(\S+)")
LAST_ACC = re.compile(r"valid acc1=(\S+), valid acc5=(\S+)")


def torch_version():
    import torch
    return torch.__version__


def git_commit():
    """(short commit, whether the working tree differs from it), or (None, None) outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip() != ""
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        return None, None


def ensure_data(kind, data_dir):
    """Generate the sample data set `kind` into `data_dir` unless it is there already (like `make demo`)."""
    marker, generator = DATA[kind]
    if os.path.exists(os.path.join(data_dir, marker)):
        return
    print(f"[example_logs] generating {kind} sample data in {data_dir} ...", flush=True)
    result = subprocess.run([sys.executable, "-m", "sample_data", *generator, "--out", data_dir],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"generating {kind} sample data in '{data_dir}' failed: "
                        f"{error_line(result.stderr, empty='no message')}")


def train_args(name, data_dir, expdir):
    """train.py and its flags for run `name` (the launcher comes in front)."""
    _, yaml, config, _, _, flags, _ = RUNS[name]
    return ["train.py", "--yaml_config", yaml, "--config", config, "--data_dir", data_dir, "--expdir", expdir,
            "--checkpoint_interval", "0", *flags]


def shown_command(name, data_dir, expdir):
    """The command of run `name` as a reader would type it, from the repository root."""
    ranks = RUNS[name][4]
    launcher = [f"torchrun --nproc_per_node {ranks}"] if ranks > 1 else ["python"]
    relative = [os.path.relpath(path, REPO_ROOT) for path in (data_dir, expdir)]
    return " ".join(launcher + train_args(name, *relative))


def summary_of(out_log, persistence=None):
    """The last validation line(s) of a run's out.log, in words (with persistence's loss on the same data, if given)."""
    with open(out_log) as f:
        text = f.read()
    losses, accuracies = LAST_VAL_LOSS.findall(text), LAST_ACC.findall(text)
    summary = f"final validation loss {float(losses[-1]):.4f}" if losses else "no validation line"
    if losses and persistence is not None:
        summary += f" (persistence {persistence:.4f})"
    if accuracies:
        summary += f", top-1 {float(accuracies[-1][0]):.1%}, top-5 {float(accuracies[-1][1]):.1%}"
    return summary


def persistence_of(name, data_dir):
    """Persistence's validation loss (x(t+dt) predicted by x(t)) on an ERA5 run's data, cropped to its config's
    img_size as the loader crops; None for the other stages."""
    _, yaml, config, kind, *_ = RUNS[name]
    if not kind.startswith("era5"):
        return None
    from sample_data.era5 import persistence_error
    from utils.YParams import YParams
    return persistence_error(data_dir, split="valid", img_size=YParams(os.path.join(REPO_ROOT, yaml), config).img_size)


def run_one(name, out, data_dirs, code):
    """Train run `name` afresh into <out>/<stage>/<config>/<N>GPU/00; keep out.log and the events only."""
    stage, _, config, kind, ranks, _, what = RUNS[name]
    expdir = os.path.join(out, stage)
    run_dir = os.path.join(expdir, config, f"{ranks}GPU", "00")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: nothing to resume, no events appended
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    command = launcher + train_args(name, data_dirs[kind], expdir)
    # CPU only (gloo for several ranks); one thread per rank when several share the cores
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    if ranks > 1:
        env["OMP_NUM_THREADS"] = "1"
    print(f"[example_logs] {name}: {what} -> {os.path.relpath(run_dir, REPO_ROOT)} ...", flush=True)
    start = time.time()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    seconds = time.time() - start
    if result.returncode != 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        sys.exit(f"error: run {name} failed (exit code {result.returncode}); its output ends:\n"
                 f"{result.stderr[-3000:]}")
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)  # too big to commit
    if os.path.exists(os.path.join(run_dir, "run.lock")):
        os.remove(os.path.join(run_dir, "run.lock"))
    summary = summary_of(os.path.join(run_dir, "out.log"), persistence_of(name, data_dirs[kind]))
    print(f"[example_logs]   {seconds:.0f} s, {summary}", flush=True)
    return {"name": name, "what": what, "run_dir": os.path.relpath(run_dir, out), "ranks": ranks,
            "command": shown_command(name, data_dirs[kind], expdir), "wall_seconds": round(seconds, 1),
            "summary": summary, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(),
            "torch": torch_version(), **code}


def read_manifest(path):
    """{run name: record} of <out>/runs.json ({} if there is none); fields an older file kept once for all runs
    (commit, dirty, torch) are copied into each record."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        manifest = json.load(f)
    shared = {key: manifest[key] for key in ("commit", "dirty", "torch") if key in manifest}
    return {run["name"]: {**shared, **run} for run in manifest.get("runs", [])}


def read_gpu_manifest(out):
    """The GPU runs' records (<out>/gpu_runs.json, written with the runs of benchmarks/gpu_lessons.py), or []."""
    path = os.path.join(out, "gpu_runs.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["runs"]


def gpu_section(runs):
    """README lines on the GPU runs: the lessons as an attendee runs them, to compare against."""
    if not runs:
        return []
    lines = [
        "## On a GPU: the lessons' own runs",
        "",
        "Runs of the tutorial's single-GPU commands on the cluster-sized sample data, made on a GPU node by",
        "`bash benchmarks/gpu_session.sh DIR --lessons` (benchmarks/gpu_lessons.py), which writes ERA5 at 360 x 720",
        "with the 512 training and 128 validation samples `short` reads (32 steps an epoch, as on the cluster) and",
        "cosmology boxes of 128^3. Their epochs compare with yours; their losses are those of the sample data.",
        "The last epoch held the profiled steps (`--torch_profile`; the traces are in `profiles/`) and, in these",
        "runs, the writing of the trace: the ViT's last epoch is slower than the ones before it (the scripts now",
        "write the trace after the epoch's report).",
        "",
        "| run directory | what | machine | result |",
        "|---|---|---|---|",
    ]
    for run in runs:
        lines.append(f"| `{run['run_dir']}` | {run['what']} | {run['machine']}, torch {run['torch']}, {run['date']} | "
                     f"{run['summary']} |")
    lines += ["", "```bash", *[run["command"] for run in runs], "```", ""]
    return lines


def readme(runs, gpu_runs=()):
    """example_logs/README.md: how, when and on what the runs (records of runs.json, and of gpu_runs.json) were
    made."""
    dates = sorted(run["date"] for run in runs)
    code = set()
    for run in runs:
        code.add(f"commit {run.get('commit')}" + (" plus uncommitted changes" if run.get("dirty") else ""))
    lines = [
        "# Example logs",
        "",
        "Real runs of this project on its generated sample data, made with `make example-logs`",
        "(`python -m benchmarks.example_logs`), which wrote this file. Each run directory holds the run's",
        "`out.log` and its TensorBoard events (`logs/events.out.tfevents.*`); checkpoints are not kept.",
        "",
        f"- made: {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else ""),
        f"- machine: {'; '.join(sorted({run['machine'] for run in runs}))}; every run on the CPU",
        f"- code: {'; '.join(sorted(code))}",
        f"- torch {', '.join(sorted({str(run.get('torch')) for run in runs}))}",
        "",
        "| run directory | what | wall time | result |",
        "|---|---|---|---|",
    ]
    for run in runs:
        lines.append(f"| `{run['run_dir']}` | {run['what']} | {run['wall_seconds']:.0f} s | {run['summary']} |")
    lines += [
        "",
        "Commands (from the repository root):",
        "",
        "```bash",
        *[run["command"] for run in runs],
        "```",
        "",
        "Each ran with `CUDA_VISIBLE_DEVICES=` (CPU only); the torchrun runs with `OMP_NUM_THREADS=1` (one thread per",
        "rank, gloo between ranks), the single-process runs with the default threads.",
        "",
        "The data-parallel sweep (`vit/demo/{1,2,4}GPU/00`) keeps the local batch (8) and the number of epochs (8),",
        "so each run sees the same samples in 256, 128 and 64 steps; the learning rate is the config's at every",
        "batch size. Ranks share the machine's cores, so the wall times show no speed-up beyond the core count;",
        "the machine may also have been busy with other work, so treat the times as rough.",
        "",
        "`vit/wfm_tiny/1GPU/00` is `wfm_tiny`, the CPU model of the 0.25-degree configs (`wfm_*`, docs/flags.md), on",
        "25 x 48 sample data (7.5 degrees, both poles) that the loader reads as 24 x 48, as it reads ERA5's 721 x 1440",
        "as 720 x 1440 (`python -m sample_data era5 --out data/era5_wfm_tiny --height 25 --width 48`). Its summary",
        "gives persistence's loss on the same validation year and crop, which the model must beat",
        "(tests/datasets/test_wfm_tiny_log.py).",
        "",
        *gpu_section(list(gpu_runs)),
        "## The multi-GPU session on CPU ranks",
        "",
        "`multi_gpu_cpu/` is `make example-logs-multi`: the multi-GPU session (`bash benchmarks/gpu_session.sh DIR",
        "--multi`, benchmarks/gpu_multi.py) on 4 CPU ranks over gloo, which README's multi-GPU steps quote until GPUs",
        "have run it. `multi_gpu.json` holds its six parts (exactness, data_parallel, dp_profile, model_parallel,",
        "collectives, failure) with the machine, torch version and date; `logs/` each command's console (its first",
        "line the command); `profiles/` rank 0's DDP traces at `--bucket_cap_mb 25` and `5`, drawn into",
        "`tutorial_images/profile_dp_bcap*_cpu.png`. Its data and run directories stay in `data/multi_work/`.",
        "",
        "To look at them in TensorBoard, copy a stage into your log directory and start TensorBoard there",
        "(`start_tensorboard.ipynb`, or `tensorboard --logdir`):",
        "",
        "```bash",
        "cp -r ./example_logs/vit $SCRATCH/dl-at-scale-training/logs    # the GPU runs are under vit/short/",
        "tensorboard --logdir example_logs    # or directly, on a workstation",
        "```",
        "",
        "`make figures` draws the learning curves and the sweep's throughput from these files into `tutorial_images/`.",
        "",
    ]
    return "\n".join(lines)


@exit_on_user_error
def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="example_logs", help="folder of the example logs (default example_logs)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated runs (default all: {','.join(RUNS)})")
    parser.add_argument("--era5_dir", default="data/era5", help="ERA5 sample data (generated if missing)")
    parser.add_argument("--wfm_tiny_dir", default="data/era5_wfm_tiny",
                        help="wfm_tiny's ERA5 sample data, 25 x 48 (generated if missing)")
    parser.add_argument("--cosmo_dir", default="data/cosmo", help="cosmology sample data (generated if missing)")
    parser.add_argument("--cifar_dir", default="data/cifar100", help="CIFAR-100 sample data (generated if missing)")
    parser.add_argument("--readme_only", action="store_true", help="rewrite README.md from runs.json; run nothing")
    args = parser.parse_args(argv)
    names = [name for name in args.runs.split(",") if name]
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        raise UserError(f"unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    out = os.path.abspath(args.out)
    data_dirs = {"era5": os.path.abspath(args.era5_dir), "era5_wfm_tiny": os.path.abspath(args.wfm_tiny_dir),
                 "cosmo": os.path.abspath(args.cosmo_dir), "cifar100": os.path.abspath(args.cifar_dir)}
    manifest_path = os.path.join(out, "runs.json")
    previous = read_manifest(manifest_path)  # the records of runs not made this time are kept
    if args.readme_only:
        if not previous:
            raise UserError(f"{manifest_path} is missing; make the example logs first (make example-logs)")
        write_bytes(os.path.join(out, "README.md"), readme([previous[name] for name in RUNS if name in previous],
                                                           read_gpu_manifest(out)))
        print(f"[example_logs] wrote {os.path.relpath(out)}/README.md from runs.json")
        return
    for kind in dict.fromkeys(RUNS[name][3] for name in names):
        ensure_data(kind, data_dirs[kind])
    commit, dirty = git_commit()
    start = time.time()
    made = {name: run_one(name, out, data_dirs, {"commit": commit, "dirty": dirty}) for name in names}
    runs = [made.get(name) or previous[name] for name in RUNS if name in made or name in previous]
    write_json(manifest_path, {"runs": runs})
    write_bytes(os.path.join(out, "README.md"), readme(runs, read_gpu_manifest(out)))
    print(f"[example_logs] done in {time.time() - start:.0f} s; wrote {os.path.relpath(out)}/runs.json and README.md")


if __name__ == "__main__":
    main()
