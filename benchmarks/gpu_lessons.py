"""The tutorial's lessons as an attendee runs them on one GPU: their logs and TensorBoard events to compare against,
and a profile of each single-GPU step (torch.profiler through `--torch_profile`).

    python -m benchmarks.gpu_lessons --out DIR [--budget SECONDS]     # on a GPU node
    python -m benchmarks.gpu_lessons --out DIR --tiny --allow-cpu     # a check of this script on any machine

Runs, most important first, each with a deadline inside the budget (a run cut short is reported and the next goes):
  profiles of the ViT `short` step: the baseline (fp32, 0 loader workers) and 8 workers, 6 steps each of which
  the table uses the last 3 (the first ones warm up); then the example runs, each the attendee's whole command with
  the last epoch profiled (as the original's Nsight window): ViT `short` bf16 with 8 workers (`--run_num nw8_bf16`),
  bf16 + fused Adam + torch.compile (`nw8_bf16_fused_jit`), UNet `short` (`baseline`); the UNet's fp16 + fused
  Adam step and the `mp` config at tp=1 (`--enable_benchy`). The UNet runs first, while the ERA5 files are written.
Everything lands under DIR: `data/` (the sample data: ERA5 at 360 x 720, four training years of 128 steps, so
`short` reads its 512 samples, 32 steps an epoch, as on the cluster; cosmology boxes of 128^3), `runs/` (run
directories), `profiles/` (the traces), `lessons.json` (what ran, how long, how it ended) and, with `--pack`, one
archive of the logs, events and traces (checkpoints and data left out).
"""
import os
import subprocess
import sys
import tarfile
import time

from benchmarks.common import REPO_ROOT, device_name, era5_assemble, era5_parts
from utils.atomic import write_json
from utils.errors import ArgumentParser

ERA5_FULL = {"height": 360, "width": 720, "steps_per_year": 128}
ERA5_TINY = {"height": 16, "width": 32, "steps_per_year": 24}
TRAIN_YEARS = 4
SHORT_VIT = ["--yaml_config", "config/ViT.yaml", "--config", "short", "--checkpoint_interval", "0"]
SHORT_UNET = ["--yaml_config", "config/UNet.yaml", "--config", "short", "--checkpoint_interval", "0"]
LAST_EPOCH = ["--profile_epoch", "3", "--profile_iters", "6"]


def log(message):
    print(f"[lessons {time.strftime('%H:%M:%S')}] {message}", flush=True)


def cosmo_data(root, tiny):
    from sample_data import write_cosmo
    target = os.path.join(root, "cosmo")
    if not os.path.isdir(target):
        write_cosmo(target, verbose=False, **({} if tiny else {"train_size": 128, "valid_size": 64}))
    return target


class Lessons:
    def __init__(self, out, budget, tiny):
        self.out, self.budget, self.tiny = out, budget, tiny
        self.start = time.monotonic()
        self.report = {"device": device_name(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "runs": []}
        try:
            import torch
            self.report["torch"] = torch.__version__
        except ImportError:
            pass

    def left(self):
        return self.budget - (time.monotonic() - self.start)

    def run(self, name, script, flags, data_dir, deadline, expdir="runs"):
        """`script flags` as the attendee types it, with a deadline (seconds from the start); its outcome recorded."""
        seconds = min(deadline - (time.monotonic() - self.start), self.left())
        entry = {"name": name, "command": " ".join(["python", script, *flags, "--data_dir", "DATA"]), "status": None}
        if seconds < 20:
            entry["status"] = "skipped: no time left"
            log(f"{name}: skipped, {seconds:.0f} s left")
        else:
            argv = [sys.executable, script, *flags, "--data_dir", data_dir, "--expdir", os.path.join(self.out, expdir)]
            log(f"{name}: {' '.join(argv[1:])} (deadline in {seconds:.0f} s)")
            began = time.monotonic()
            try:
                done = subprocess.run(argv, cwd=REPO_ROOT, timeout=seconds, capture_output=True, text=True)
                entry["status"] = "ok" if done.returncode == 0 else f"exit {done.returncode}"
                tail = (done.stdout + done.stderr)[-3000:]
            except subprocess.TimeoutExpired as err:
                entry["status"] = "deadline"
                tail = ((err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace"))
                tail = tail[-3000:]
            entry["seconds"] = round(time.monotonic() - began, 1)
            entry["tail"] = tail
            log(f"{name}: {entry['status']} in {entry['seconds']} s")
            if entry["status"] != "ok":
                print(tail, flush=True)
        self.report["runs"].append(entry)
        write_json(os.path.join(self.out, "lessons.json"), self.report)
        return entry["status"] == "ok"

    def profile(self, name):
        return ["--torch_profile", os.path.join(self.out, "profiles", f"{name}.json.gz")]


def pack(out, archive):
    """The logs, TensorBoard events, traces and reports under `out` in one .tar.gz (no data, no checkpoints)."""
    keep = (".log", ".json", ".json.gz")
    with tarfile.open(archive, "w:gz") as tar:
        for folder, _, files in os.walk(out):
            if os.path.relpath(folder, out).split(os.sep)[0] == "data":
                continue
            for name in files:
                path = os.path.join(folder, name)
                if name.startswith("events.out.tfevents") or name.endswith(keep):
                    tar.add(path, arcname=os.path.relpath(path, out))
    log(f"packed {archive} ({os.path.getsize(archive) / 1e6:.1f} MB)")


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the data, runs, profiles and report")
    parser.add_argument("--budget", type=float, default=520, help="seconds for everything (default 520)")
    parser.add_argument("--tiny", action="store_true", help="the `tiny` configs on tiny data (a check of the script)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (with --tiny: a check)")
    parser.add_argument("--pack", default=None, help="write one .tar.gz of the logs, events and traces here")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available() and not args.allow_cpu:
        parser.error("no GPU here: these are the GPU lessons (add --tiny --allow-cpu to check the script)")
    os.makedirs(args.out, exist_ok=True)
    lessons = Lessons(args.out, args.budget, args.tiny)
    data_root = os.path.join(args.out, "data")
    os.makedirs(data_root, exist_ok=True)
    sizes = ERA5_TINY if args.tiny else ERA5_FULL
    vit, unet = (["--config", "tiny", "--checkpoint_interval", "0"],
                 ["--yaml_config", "config/UNet.yaml", "--config", "tiny", "--checkpoint_interval", "0"]) \
        if args.tiny else (SHORT_VIT, SHORT_UNET)
    short_run = ["--num_iters", "6", "--profile_epoch", "0", "--profile_iters", "6"]
    last_epoch = ["--num_epochs", "2", "--profile_epoch", "1", "--profile_iters", "3"] if args.tiny else LAST_EPOCH

    # the UNet runs while the ERA5 years are written (about 1.5 minutes on one core each, 4 cores)
    log(f"{lessons.report['device']}, torch {lessons.report.get('torch')}: writing the sample data")
    began = time.monotonic()
    pool, pending, parts = era5_parts(data_root, sizes, TRAIN_YEARS)
    cosmo = cosmo_data(data_root, args.tiny)
    B = args.budget
    lessons.run("unet_baseline", "train.py", [*unet, *last_epoch, "--run_num", "baseline",
                                              *lessons.profile("unet_baseline")], cosmo, 0.38 * B, expdir="runs_unet")
    lessons.run("unet_fp16_fused_benchy", "train.py",
                [*unet, "--amp_mode", "fp16", "--enable_fused", "--enable_benchy", "--benchy_nbatches", "12",
                 "--benchy_ntrials", "1", "--benchy_nwarmup", "1", "--run_num", "fp16_fused_benchy"], cosmo, 0.47 * B,
                expdir="runs_unet")
    pending.wait(max(lessons.left() - 0.5 * B, 1))  # until half the budget
    pool.close()
    if not pending.ready():
        log("the ERA5 data is not written in time")
        pool.terminate()
    else:
        pending.get()  # raises a writer's error
        era5 = era5_assemble(data_root, parts)
        lessons.report["era5_seconds"] = round(time.monotonic() - began, 1)
        log(f"ERA5 data ready after {lessons.report['era5_seconds']} s")
        lessons.run("vit_baseline_profile", "train.py", [*vit, "--num_data_workers", "0", *short_run,
                                                         "--run_num", "profile_baseline",
                                                         *lessons.profile("vit_baseline")], era5, 0.58 * B)
        lessons.run("vit_nw8_profile", "train.py", [*vit, "--num_data_workers", "8", *short_run,
                                                    "--run_num", "profile_nw8", *lessons.profile("vit_nw8")], era5,
                    0.66 * B)
        lessons.run("vit_nw8_bf16", "train.py", [*vit, "--num_data_workers", "8", "--amp_mode", "bf16", *last_epoch,
                                                 "--run_num", "nw8_bf16", *lessons.profile("vit_nw8_bf16")], era5,
                    0.77 * B)
        lessons.run("vit_nw8_bf16_fused_jit", "train.py",
                    [*vit, "--num_data_workers", "8", "--amp_mode", "bf16", "--enable_fused", "--enable_jit",
                     *last_epoch, "--run_num", "nw8_bf16_fused_jit", *lessons.profile("vit_nw8_bf16_fused_jit")],
                    era5, 0.93 * B)
        # the `mp` config at tp=1 on one GPU, eager (published: 93 samples/s on 4 A100s, 44.9 GB after the forward); its
        # config names DALI, which a GPU node may lack: the PyTorch loader
        lessons.run("mp_tp1_benchy", "train_mp.py",
                    [*(["--config", "tiny"] if args.tiny else ["--yaml_config", "config/ViT.yaml", "--config", "mp"]),
                     "--local_batch_size", "4" if args.tiny else "16", "--data_loader_config", "pytorch",
                     "--num_data_workers", "0" if args.tiny else "8", "--tensor_parallel", "1", "--enable_benchy",
                     "--benchy_nbatches", "12", "--benchy_ntrials", "1", "--benchy_nwarmup", "1",
                     "--checkpoint_interval", "0", "--run_num", "tp1_benchy"], era5, B)
    lessons.report["seconds"] = round(time.monotonic() - lessons.start, 1)
    write_json(os.path.join(args.out, "lessons.json"), lessons.report)
    if args.pack:
        pack(args.out, args.pack)
    failed = [r["name"] for r in lessons.report["runs"] if r["status"] != "ok"]
    log(f"done in {lessons.report['seconds']} s; " + (f"not ok: {', '.join(failed)}" if failed else "all ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
