"""The multi-GPU day on the GPUs of this node: each step of the data- and model-parallel lessons run, timed and
checked, into one JSON (issue #50).

    bash benchmarks/gpu_session.sh DIR --multi                        # a node of 2, 4 or 8 GPUs (9 minutes)
    bash benchmarks/gpu_session.sh DIR --multi --tiny --allow-cpu     # the rehearsal: CPU ranks over gloo
    python -m benchmarks.gpu_multi --out DIR [--ranks N] [--tiny] [--allow-cpu] [--budget S] [--parts a,b]

The node's GPUs give the rank count (every GPU, at most 8; `--ranks` fewer); without a GPU, `--allow-cpu` runs the
same parts on `--ranks` CPU processes (default 4) over gloo, on the CPU configs (`demo`; `tiny` with `--tiny`). The
six parts run in this order, each with a deadline (a fraction of `--budget`, 540 s on GPUs), and DIR/multi_gpu.json
is written after each, so a part cut short keeps what it measured:
  exactness       DDP on N ranks against one process at the same global batch, and its failing twin (`--noddp`);
                  train_mp.py at tp=2, cp=2, tp=2 x cp=2 (N >= 4), tp=2 with sequence parallelism, cp=2 with
                  activation checkpointing, FSDP at dp=N, and train_mp_graphs.py against train_mp.py (CUDA only),
                  each against the serial train.py run (and cp=2 without its gradient sums, `--noddp`, the second
                  twin, which must miss): the largest difference of the weights and of the TensorBoard
                  points after 10 steps, over the tolerance of the CPU tests (|a - b| <= 1e-5 + 1e-4 |b|; GPUs with
                  TF32 off, NVIDIA_TF32_OVERRIDE=0)
  data_parallel   the data-parallel lesson's runs: train.py `bs64_opt_short` at local batch 16 (`demo` at 8 on CPUs)
                  with --enable_benchy on 1, 2, 4, ... N ranks (`--run_num weak<n>`): samples/s (on CPU ranks the
                  median of 3 trials, with their range: ranks sharing cores are noisy), peak memory and the
                  weak-scaling efficiency; then the learning-rate step: the same epochs on 1 rank, and on N ranks
                  with the learning rate kept and with it scaled by sqrt(N), each run's validation loss per epoch
  dp_profile      torch.profiler traces of DDP on N ranks (`--torch_profile`) at --bucket_cap_mb 25 and 5, rank 0's
                  reduced by benchmarks/step_profile.py (the collectives a part of their own, and on a GPU how much
                  of their time other kernels ran beside them) and drawn like the single-GPU profiles
  model_parallel  train_mp.py `mp_short` (`demo` on CPUs) at the published layouts scaled to N (tp=1, tp=N, cp=N)
                  and tp=2 x cp=2: samples/s, the memory lines, beside a dry run of rank 0 of the same layout
                  (train_mp.py --dry_run) and the performance model's prediction (a GPU's; on CPUs an H100's)
  collectives     all-reduce, all-gather, reduce-scatter bus bandwidth at the lessons' sizes
                  (benchmarks/bench_collectives.py) against the performance model's constant for the node
  failure         two ranks of train.py: one raises mid-epoch (the job must end within 15 s, with its line the
                  only error), one stalls 8 s under --collective_timeout 3 (the timeout's line naming it)
On one GPU (or more), NCCL's one-rank paths run first (benchmarks/nccl_one_rank.py, and train_mp.py at tp=1 on
that GPU): `one_gpu_nccl` in the JSON. Logs land in DIR/logs, traces in DIR/profiles, figures in DIR/figures (or
--figures), data and run directories in --work (default DIR/work).
"""
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

from benchmarks.common import REPO_ROOT, device_name, era5_assemble, era5_parts, free_port, machine
from utils.atomic import write_json
from utils.errors import ArgumentParser, error_line

PARTS = ("exactness", "data_parallel", "dp_profile", "model_parallel", "collectives", "failure")
ENDS = {"exactness": 0.30, "data_parallel": 0.55, "dp_profile": 0.67, "model_parallel": 0.87, "collectives": 0.93,
        "failure": 1.0}  # each part's deadline, a fraction of the budget from the start
ATOL, RTOL = 1e-5, 1e-4  # the CPU tests' tolerances (tests/parallel/test_ddp.py, tests/training/test_train_mp.py)
EXACT_ITERS = "10"
ENDS_WITHIN_S = 15  # a failing rank ends the job within this (tests/training/test_rank_failure.py)
ERA5_TINY = {"height": 16, "width": 32, "steps_per_year": 24, "train_years": 1, "valid_years": 1, "test_years": 1}
ERA5_GPU = {"height": 360, "width": 720, "steps_per_year": 64}  # x 4 training years: 256 samples
VIT = ["--yaml_config", "config/ViT.yaml"]

# what each machine runs: the configs and flags of the lessons' runs, and how much each is cut
MODES = {
    "gpu": {"dp": [*VIT, "--config", "bs64_opt_short", "--local_batch_size", "16", "--data_loader_config", "pytorch",
                   "--num_data_workers", "4", "--no-enable_jit"],
            "mp": [*VIT, "--config", "mp_short", "--local_batch_size", "16", "--data_loader_config", "pytorch",
                   "--num_data_workers", "4"],
            "lr": ("demo", 8, 8), "benchy": ["--benchy_nbatches", "10", "--benchy_ntrials", "1", "--benchy_nwarmup",
                                             "1"],
            "dry_run": [], "collective_scale": 1.0, "budget": 540},
    "cpu": {"dp": [*VIT, "--config", "demo", "--local_batch_size", "8", "--num_data_workers", "0"],
            "mp": [*VIT, "--config", "demo", "--local_batch_size", "2", "--num_data_workers", "0"],
            "lr": ("demo", 8, 4),
            "benchy": ["--benchy_nbatches", "6", "--benchy_ntrials", "3", "--benchy_nwarmup", "1"],
            "dry_run": ["--local_batch_size", "1", "--amp_mode", "none"], "collective_scale": 0.05, "budget": 3600},
    "tiny": {"dp": [*VIT, "--config", "tiny", "--local_batch_size", "2", "--num_data_workers", "0"],
             "mp": [*VIT, "--config", "tiny", "--local_batch_size", "2", "--num_data_workers", "0"],
             "lr": ("tiny", 2, 2), "benchy": ["--benchy_nbatches", "3", "--benchy_ntrials", "1", "--benchy_nwarmup",
                                              "1"],
             "dry_run": ["--local_batch_size", "1", "--amp_mode", "none"], "collective_scale": 0.01, "budget": 1800},
}
# the failure part's ranks: train.py with rank 1's 13th training read raising, or stalling 8 s
RANK_SCRIPT = """\
import os, sys, time
sys.path.insert(0, {root!r})
import loaders.era5
import train
from utils.errors import OneRankError

reads = [0]
real_read_into = loaders.era5.ERA5Dataset.read_into


def read_into(self, year_idx, step, out):
    if "/train/" in self.files_paths[0] and os.environ["RANK"] == "1":
        reads[0] += 1
        if reads[0] == 13:
            print(f"session: rank 1 fails at {{time.time()}}", flush=True)
            if {mode!r} == "stall":
                time.sleep(8)
            else:
                raise OneRankError("sample 12 of the shard cannot be read (injected by the session)")
    return real_read_into(self, year_idx, step, out)


loaders.era5.ERA5Dataset.read_into = read_into
train.main(sys.argv[1:])
"""


def log(message):
    print(f"[multi {time.strftime('%H:%M:%S')}] {message}", flush=True)


class OutOfTime(Exception):
    """A part's deadline came before its next command could run."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the session (Ctrl-C, scancel): raised in the main thread wherever it waits, past the
    parts' `except Exception`, so that the running command's processes are stopped and the report marked."""


def interrupt_on_signals():
    """SIGINT and SIGTERM raise Interrupted (once: a second signal during the clean-up is ignored)."""
    def handler(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signal.Signals(signum).name)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


class Session:
    def __init__(self, out, work, figures, ranks, gpus, mode, budget):
        self.out, self.work, self.figures = out, work, figures
        self.ranks, self.gpus, self.settings = ranks, gpus, MODES[mode]
        self.budget = budget
        self.running = None  # the command running now, in words (what an interruption stops)
        self.start = time.monotonic()
        self.deadline = budget
        for folder in (out, work, figures, os.path.join(out, "logs"), os.path.join(out, "profiles")):
            os.makedirs(folder, exist_ok=True)
        for name in os.listdir(work):  # an earlier session's runs would resume, not train: only the data stays
            if name != "data":
                path = os.path.join(work, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def elapsed(self):
        return time.monotonic() - self.start

    def env(self, extra=None):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("WORLD_SIZE", None)  # a launcher's, or the caller's below
        env.update(extra or {})
        if not self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU ranks
        return env

    def run(self, name, argv, nproc=1, env=None, module=False):
        """One command as an attendee types it (torchrun for several ranks), within the part's deadline; its
        console in DIR/logs/<name>.log. Returns (exit code, output); a command cut by the deadline raises
        OutOfTime after its output is kept."""
        seconds = self.deadline - self.elapsed()
        if seconds < 10:
            raise OutOfTime(f"the part's deadline came before {name}")
        launcher = [sys.executable]
        if nproc > 1:
            launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                         str(free_port())]
        if module:
            launcher += ["-m"]
        command = launcher + argv
        shown = " ".join((["torchrun", "--nproc_per_node", str(nproc)] if nproc > 1 else ["python"]) +
                         (["-m"] if module else []) + argv)
        log(f"{name}: {shown} (deadline in {seconds:.0f} s)")
        path = os.path.join(self.out, "logs", f"{name}.log")
        began = time.monotonic()
        with open(path, "w") as console:
            console.write(f"$ {shown}\n")
            console.flush()
            # a session of its own: at the deadline torchrun and its ranks get SIGTERM together (they checkpoint and
            # stop, as at a time limit), then SIGKILL 15 s later, as `timeout --kill-after=15` does
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=self.env(env), stdout=console,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            self.running = f"{name} ({shown})"
            try:
                code = process.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                code = None
                stop_group(process)
            except Interrupted:  # Ctrl-C reaches this process alone: its command runs in a session of its own
                stop_group(process)
                raise
            self.running = None
        with open(path) as console:
            output = console.read()
        log(f"{name}: {'deadline' if code is None else f'exit {code}'} in {time.monotonic() - began:.1f} s")
        if code is None:
            raise OutOfTime(f"{name} was cut by the part's deadline after {time.monotonic() - began:.0f} s")
        return code, output


def stop_group(process, grace_s=15):
    """SIGTERM to the process group of `process`, SIGKILL after `grace_s` if it has not ended."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever of the group outlived its leader
    except ProcessLookupError:
        pass


# ---- reading what the runs wrote ---------------------------------------------------------------------------------

def run_results(run_dir):
    """(TensorBoard points {(tag, step): value} but the timings, the final checkpoint's weights)."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(run_dir, "logs"))
    events.Reload()
    timings = {"Avg iters per sec", "Avg samples per sec"}
    points = {(tag, e.step): e.value for tag in events.Tags()["scalars"] if tag not in timings
              for e in events.Scalars(tag)}
    model = torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True, map_location="cpu")
    return points, model["model"]


def difference(got, reference):
    """How far a run is from its reference: the largest weight and point differences, and `excess`, the largest
    |a - b| / (ATOL + RTOL |b|) over both (within the tolerance: at most 1)."""
    (points, weights), (ref_points, ref_weights) = got, reference
    if sorted(points) != sorted(ref_points) or sorted(weights) != sorted(ref_weights):
        return {"excess": math.inf, "why": "the runs logged other points or saved other weights"}
    weight_diff = max((weights[k].float() - ref_weights[k].float()).abs().max().item() for k in ref_weights)
    excess = max(((weights[k].float() - ref_weights[k].float()).abs() /
                  (ATOL + RTOL * ref_weights[k].float().abs())).max().item() for k in ref_weights)
    point_diff = max((abs(points[k] - v) / max(abs(v), 1e-12) for k, v in ref_points.items()), default=0.0)
    excess = max(excess, max((abs(points[k] - v) / (ATOL + RTOL * abs(v)) for k, v in ref_points.items()),
                             default=0.0))
    return {"max_weight_difference": weight_diff, "max_relative_point_difference": point_diff, "excess": excess}


def benchy(path):
    """The median of each benchmark's trials (their spread beside it: CPU ranks sharing cores are noisy, and one
    trial's figure can invert an order), and rank 0's peak memory."""
    with open(path) as f:
        found = json.load(f)
    full, step = found["FULL"]["trial_throughputs"], found["SYNTHETIC"]["trial_throughputs"]
    return {"samples_per_s": statistics.median(full), "trials": len(full),
            "samples_per_s_range": [min(full), max(full)], "step_alone_samples_per_s": statistics.median(step),
            "step_alone_samples_per_s_range": [min(step), max(step)],
            "loader_alone_samples_per_s": statistics.median(found["IO"]["trial_throughputs"]),
            "peak_memory_gb": found["peak_memory_gb"]}


def flag_value(flags, name):
    """The value that follows `name` in a list of command-line flags."""
    return flags[flags.index(name) + 1]


def lines_of(output, pattern):
    return [line.split(" - ")[-1] for line in output.splitlines() if re.search(pattern, line)]


def val_losses(output):
    return [float(x) for x in re.findall(r"Avg val loss=([0-9.eE+-]+|nan|inf)", output)]


# ---- the parts -------------------------------------------------------------------------------------------------

def exactness(s, data, found):
    n = s.ranks
    exact_env = {"NVIDIA_TF32_OVERRIDE": "0"}  # fp32 matmuls on GPUs: the CPU tests' tolerances hold
    base = ["--config", "tiny", "--data_dir", data["tiny"], "--num_iters", EXACT_ITERS, "--checkpoint_interval", "0"]
    expdir = os.path.join(s.work, "exact")
    shutil.rmtree(expdir, ignore_errors=True)
    found.update({"ranks": n, "tolerance": f"|a - b| <= {ATOL:g} + {RTOL:g} |b|", "iterations": int(EXACT_ITERS),
                  "checks": {}})

    def train(name, script, nproc, flags, folder):
        code, output = s.run(f"exact_{name}", [script, *base, "--expdir", os.path.join(expdir, name), *flags],
                             nproc, exact_env)
        if code != 0:
            return None, error_line(output)
        return run_results(os.path.join(expdir, name, "tiny", folder, "00")), None

    serial, why = train("serial", "train.py", 1, [], "1GPU")  # global batch 4, the mp runs' reference
    serial_dp, why_dp = train("serial_dp", "train.py", 1, ["--local_batch_size", str(2 * n)], "1GPU")

    def check(name, script, flags, folder, reference, twin=False):
        if reference is None:
            found["checks"][name] = {"ok": False, "error": f"the serial run failed: {why or why_dp}"}
            return
        got, error = train(name, script, n, flags, folder)
        if error:
            found["checks"][name] = {"ok": False, "error": error}
            return
        result = difference(got, reference)
        within = result["excess"] <= 1.0
        result.update(ok=not within if twin else within, within_tolerance=within)
        if twin:
            result["twin"] = "must miss the tolerance: without the gradient reduction the ranks drift"
        found["checks"][name] = result

    check("ddp", "train.py", ["--local_batch_size", "2"], f"{n}GPU", serial_dp)
    check("ddp_twin_noddp", "train.py", ["--local_batch_size", "2", "--noddp"], f"{n}GPU", serial_dp, twin=True)
    check("tp2", "train_mp.py", ["--tensor_parallel", "2"], "2MP", serial)
    check("cp2", "train_mp.py", ["--context_parallel", "2"], "2MP", serial)
    check("cp2_twin_noddp", "train_mp.py", ["--context_parallel", "2", "--noddp"], "2MP", serial, twin=True)
    if n >= 4:
        check("tp2_cp2", "train_mp.py", ["--tensor_parallel", "2", "--context_parallel", "2"], "4MP", serial)
    check("tp2_sequence_parallel", "train_mp.py", ["--tensor_parallel", "2", "--sequence_parallel"], "2MP", serial)
    check("cp2_activation_checkpointing", "train_mp.py", ["--context_parallel", "2", "--activation_checkpointing"],
          "2MP", serial)
    check("fsdp_dp", "train_mp.py", ["--fsdp", "--local_batch_size", "2"], "1MP", serial_dp)
    if s.gpus:
        graphed, error = train("tp2_graphs", "train_mp_graphs.py", n, ["--tensor_parallel", "2"], "2MP")
        eager = os.path.join(expdir, "tp2", "tiny", "2MP", "00")
        if error or not os.path.isdir(eager):
            found["checks"]["train_mp_graphs_vs_train_mp"] = {"ok": False, "error": error or "no tp2 run"}
        else:
            result = difference(graphed, run_results(eager))
            found["checks"]["train_mp_graphs_vs_train_mp"] = {**result, "ok": result["excess"] <= 1.0}
    else:
        found["checks"]["train_mp_graphs_vs_train_mp"] = {
            "ok": True, "not_on_this_machine": "CUDA Graphs need a GPU (train_mp_graphs.py refuses a CPU)"}
    found["ok"] = all(c["ok"] for c in found["checks"].values())
    return found


def data_parallel(s, data, found):
    st, n = s.settings, s.ranks
    counts = [k for k in (1, 2, 4, 8) if k < n] + [n]
    found.update({"flags": " ".join(st["dp"]), "weak": []})
    expdir = os.path.join(s.work, "dp")
    for k in counts:
        bench = os.path.join(s.work, f"benchy_weak{k}")
        code, output = s.run(f"dp_weak{k}", ["train.py", *st["dp"], *st["benchy"], "--enable_benchy", "--data_dir",
                                             data["dp"], "--expdir", expdir, "--run_num", f"weak{k}"], k,
                             {"BENCHY_OUTPUT": bench})
        row = {"ranks": k, "ok": code == 0}
        if code == 0:
            row.update(benchy(bench + ".json"))
            row["summary_lines"] = lines_of(output, r"BENCHY::SUMMARY::( ?SYNTHETIC|FULL) average|peak memory")
        else:
            row["error"] = error_line(output)
        found["weak"].append(row)
    one = next((r for r in found["weak"] if r["ranks"] == 1 and r["ok"]), None)
    for row in found["weak"]:
        if one and row["ok"]:
            row["weak_scaling_efficiency"] = row["samples_per_s"] / (row["ranks"] * one["samples_per_s"])
    # the learning-rate step: the same epochs at local batch `local` on 1 rank and on N, the rate kept and scaled
    from utils.YParams import YParams
    config, local, epochs = st["lr"]
    params = YParams(os.path.join(REPO_ROOT, "config", "ViT.yaml"), config).params
    configs = {"lr_kept": params, "lr_sqrt": {**params, "lr": params["lr"] * math.sqrt(n)}}
    yaml_path = os.path.join(s.work, "lr_scaling.yaml")
    import yaml
    with open(yaml_path, "w") as f:
        yaml.safe_dump(configs, f)
    found["learning_rate"] = {"config": config, "local_batch_size": local, "epochs": epochs, "base_lr": params["lr"],
                              "runs": []}
    for name, ranks, cfg in (("1 rank", 1, "lr_kept"), (f"{n} ranks, lr kept", n, "lr_kept"),
                             (f"{n} ranks, lr x sqrt({n})", n, "lr_sqrt")):
        code, output = s.run(f"dp_lr_{ranks}_{cfg}", [
            "train.py", "--yaml_config", yaml_path, "--config", cfg, "--local_batch_size", str(local), "--num_epochs",
            str(epochs), "--checkpoint_interval", "0", "--num_data_workers", "0", "--data_dir", data["lr"],
            "--expdir", expdir, "--run_num", f"lr_{ranks}"], ranks)
        run = {"run": name, "ranks": ranks, "global_batch_size": local * ranks, "lr": configs[cfg]["lr"],
               "ok": code == 0}
        run.update({"val_loss": val_losses(output)} if code == 0 else {"error": error_line(output)})
        found["learning_rate"]["runs"].append(run)
    found["ok"] = all(r["ok"] for r in found["weak"]) and all(r["ok"] for r in found["learning_rate"]["runs"])
    return found


def dp_profile(s, data, found):
    from benchmarks.step_profile import draw, read_trace, reduce_trace
    from loop.profiling import trace_path
    st, n = s.settings, s.ranks
    found.update({"ranks": n, "flags": " ".join(st["dp"]), "buckets": {}})
    where = f"{n} {'GPUs' if s.gpus else 'CPU ranks (gloo)'}"
    for cap in (25, 5):
        trace = os.path.join(s.out, "profiles", f"dp_bcap{cap}.json.gz")
        code, output = s.run(f"dp_profile_bcap{cap}", [
            "train.py", *st["dp"], "--bucket_cap_mb", str(cap), "--num_epochs", "2", "--profile_epoch", "1",
            "--profile_iters", "3", "--torch_profile", trace, "--checkpoint_interval", "0", "--data_dir", data["dp"],
            "--expdir", os.path.join(s.work, "dp_profile"), "--run_num", f"profile_bcap{cap}"], n)
        if code != 0:
            found["buckets"][str(cap)] = {"ok": False, "error": error_line(output)}
            continue
        rank0 = trace_path(trace, 0, n)
        for rank in range(1, n):  # rank 0's is the one read and committed
            other = trace_path(trace, rank, n)
            if os.path.exists(other):
                os.remove(other)
        recorded = read_trace(rank0)
        table = reduce_trace(recorded)
        figure = os.path.join(s.figures, f"profile_dp_bcap{cap}{'' if s.gpus else '_cpu'}.png")
        draw(recorded, figure, f"DDP step, rank 0 of {where}, --bucket_cap_mb {cap}: {device_name()}")
        entry = {"ok": True, **table, "trace": os.path.relpath(rank0, s.out), "figure": figure}
        if not s.gpus:
            entry["not_on_this_machine"] = ("NCCL's kernels: on CPU ranks gloo moves the data on threads of its own, "
                                            "which the profiler does not record; `communication` is the c10d calls "
                                            "that hand it the buckets")
        found["buckets"][str(cap)] = entry
    found["ok"] = len(found["buckets"]) == 2 and all(b["ok"] for b in found["buckets"].values())
    return found


def layouts_of(n):
    """(tp, cp) of the published layouts scaled to n ranks (tp=1, tp=n, cp=n) and the tutorial's tp=2 x cp=2."""
    found = [(1, 1), (n, 1), (1, n)]
    if n >= 4 and (2, 2) not in found:
        found.append((2, 2))
    return found


def prediction(s, params, local, tp, cp):
    """The performance model's samples/s and memory for this layout of the config `params` at local batch `local`
    (on CPUs: an H100's, a prediction for a GPU)."""
    from planning import perf_model
    from planning.dry_run import gpu_system
    from utils.layout import Layout
    system = (gpu_system(device_name()) if s.gpus else None) or "H100-SXM"
    shape = perf_model.ViTShape.from_params(params)
    layout = Layout.for_world(s.ranks, tp, cp)
    amp = params.get("amp_mode", "none")
    row = perf_model.predict(shape, perf_model.SYSTEMS[system], layout, local * layout.dp, amp)
    return {"system": system, "samples_per_s": row["samples_per_sec"], "peak_memory_gb": row["peak_memory_gb"],
            "memory_after_forward_gb": row["memory_after_forward_gb"],
            "is": "a prediction" + ("" if s.gpus else " for GPUs of that kind, not for these CPU ranks")}


def model_parallel(s, data, found):
    from planning.dry_run import dry_run_in_own_process
    st, n = s.settings, s.ranks
    found.update({"ranks": n, "flags": " ".join(st["mp"]), "layouts": []})
    from networks.vit import layout_facts
    from utils.layout import Layout
    from utils.YParams import YParams
    params = YParams(os.path.join(REPO_ROOT, "config", "ViT.yaml"), flag_value(st["mp"], "--config"))
    local = int(flag_value(st["mp"], "--local_batch_size"))
    for tp, cp in layouts_of(n):
        refused = Layout.for_world(n, tp, cp).refusal(**layout_facts(params))
        if refused:  # the line train_mp.py would stop with: not run
            found["layouts"].append({"tp": tp, "cp": cp, "dp": n // (tp * cp), "ok": True,
                                     "refused": f"error: {refused}"})
            continue
        order = ["--parallel_order", "cp-tp-dp"] if cp > 1 and tp == 1 else []
        layout_flags = ["--tensor_parallel", str(tp), "--context_parallel", str(cp), *order]
        bench = os.path.join(s.work, f"benchy_tp{tp}cp{cp}")
        code, output = s.run(f"mp_tp{tp}cp{cp}", ["train_mp.py", *st["mp"], *layout_flags, *st["benchy"],
                                                  "--enable_benchy", "--data_dir", data["dp"], "--expdir",
                                                  os.path.join(s.work, "mp"), "--run_num", f"tp{tp}cp{cp}"], n,
                             {"BENCHY_OUTPUT": bench})
        row = {"tp": tp, "cp": cp, "dp": n // (tp * cp), "ok": code == 0}
        if code != 0:
            row["error"] = error_line(output)
        else:
            row.update(benchy(bench + ".json"))
            row["memory_lines"] = lines_of(output, r"Scaffolding memory|Predicted memory|peak memory")
            dry_args = [*st["mp"], *layout_flags, *st["dry_run"], "--dry_run", str(n)]
            left = s.deadline - s.elapsed()
            if left > 20:
                dry, error = dry_run_in_own_process(dry_args, timeout=left - 5)
                row["dry_run"] = {"error": error} if error else {
                    k: dry[k] for k in ("peak_memory_gb", "peak_memory_is", "step_time_s", "parameters",
                                        "saved_activations", "local_batch_size")}
            row["predicted"] = prediction(s, params, local, tp, cp)
        found["layouts"].append(row)
    found["ok"] = all(r["ok"] for r in found["layouts"])
    return found


def collectives(s, data, found):
    out = os.path.join(s.out, "collectives.json")
    code, output = s.run("collectives", ["benchmarks.bench_collectives", "--out", out, "--scale",
                                         str(s.settings["collective_scale"])], s.ranks, module=True)
    if code != 0:
        found.update(ok=False, error=error_line(output))
        return found
    with open(out) as f:
        found.update(json.load(f), ok=True)
    return found


def failure(s, data, found):
    """Two plain processes (each one's exit code and console) of train.py with rank 1 failing."""
    folder = os.path.join(s.work, "failure")
    os.makedirs(folder, exist_ok=True)
    for mode, timeout_s in (("error", 60), ("stall", 3)):
        script = os.path.join(folder, f"rank_{mode}.py")
        with open(script, "w") as f:
            f.write(RANK_SCRIPT.format(root=REPO_ROOT, mode=mode))
        port = free_port()
        argv = [sys.executable, script, "--config", "tiny", "--data_dir", data["tiny"], "--expdir",
                os.path.join(folder, mode), "--num_iters", "40", "--local_batch_size", "1", "--num_data_workers", "0",
                "--checkpoint_interval", "4", "--dist_timeout", "60", "--collective_timeout", str(timeout_s)]
        seconds = s.deadline - s.elapsed()
        if seconds < 15:
            found[mode] = {"ok": False, "error": "the part's deadline came first"}
            continue
        log(f"failure_{mode}: 2 ranks of {' '.join(argv[1:])}")
        processes, logs = [], []
        for rank in range(2):
            path = os.path.join(s.out, "logs", f"failure_{mode}_rank{rank}.log")
            logs.append(path)
            env = s.env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                         "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
            with open(path, "w") as console:
                processes.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=console,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
        s.running = f"failure_{mode} (2 ranks)"
        codes, last_exit = [], time.time()
        try:
            for process in processes:
                codes.append(process.wait(timeout=max(seconds, 1)))
                last_exit = time.time()
        except subprocess.TimeoutExpired:
            codes.append(None)
        finally:  # each rank and whatever it started (its loader workers), also when interrupted
            for process in processes:
                stop_group(process, grace_s=0)
            s.running = None
        outputs = []
        for path in logs:
            with open(path) as f:
                outputs.append(f.read())
        console = "".join(outputs)
        errors = [line for line in console.splitlines() if line.startswith("error: ")]
        failed_at = re.search(r"session: rank 1 fails at ([\d.]+)", console)
        entry = {"exit_codes": codes, "error_lines": errors, "traceback": "Traceback" in console}
        if failed_at:
            entry["seconds_to_last_exit"] = round(last_exit - float(failed_at.group(1)), 2)
        if mode == "error":
            entry["ok"] = (None not in codes and all(c != 0 for c in codes) and failed_at is not None
                           and entry["seconds_to_last_exit"] < ENDS_WITHIN_S
                           and errors == ["error: rank 1: sample 12 of the shard cannot be read (injected by the "
                                          "session)"] and not entry["traceback"])
            entry["expected"] = f"every rank gone within {ENDS_WITHIN_S} s, rank 1's line the only error"
        else:
            entry["ok"] = (None not in codes and len(errors) == 1 and errors[0].startswith(
                "error: rank 0: rank 1 did not reach a collective within --collective_timeout (3 s)")
                and not entry["traceback"])
            entry["expected"] = "one line: rank 0 names rank 1 and --collective_timeout (3 s)"
        found[mode] = entry
    found["ok"] = all(found.get(m, {}).get("ok") for m in ("error", "stall"))
    return found


def one_gpu_nccl(s, data, found):
    """NCCL's one-rank paths, and train_mp.py at tp=1 on one GPU under torchrun."""
    out = os.path.join(s.out, "nccl_one_rank.json")
    code, output = s.run("nccl_one_rank", ["benchmarks.nccl_one_rank", "--out", out], module=True)
    found["ok"] = code == 0
    if os.path.exists(out):
        with open(out) as f:
            found.update(json.load(f))
    elif code != 0:
        found["error"] = error_line(output)
    code, output = s.run("train_mp_tp1_one_gpu", [
        "train_mp.py", "--config", "tiny", "--data_dir", data["tiny"], "--expdir", os.path.join(s.work, "one_gpu"),
        "--num_iters", EXACT_ITERS, "--tensor_parallel", "1"])
    found["train_mp_tp1"] = {"ok": code == 0, "note": "a world of one makes no process group (utils/comm.init): it "
                             "trains on the GPU without NCCL", **({} if code == 0 else {"error": error_line(output)})}
    found["ok"] = found["ok"] and found["train_mp_tp1"]["ok"]
    return found


RUNS = {"exactness": exactness, "data_parallel": data_parallel, "dp_profile": dp_profile,
        "model_parallel": model_parallel, "collectives": collectives, "failure": failure}


# ---- the session -----------------------------------------------------------------------------------------------

def versions():
    import torch
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            pass
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}


def prepare_data(s, tiny):
    """The sample data: tiny ERA5 (the checks), and the lessons' (ERA5 at 360 x 720 on GPUs, written by 4 processes
    while the checks run; the demo's size on CPUs). Returns ({name: folder}, a wait for the large set or None)."""
    from sample_data import write_era5
    root = os.path.join(s.work, "data")
    os.makedirs(root, exist_ok=True)
    data = {"tiny": os.path.join(root, "era5_tiny")}
    if not os.path.isdir(data["tiny"]):
        write_era5(data["tiny"], verbose=False, **ERA5_TINY)
    if tiny:
        return {**data, "dp": data["tiny"], "lr": data["tiny"]}, None
    data["lr"] = os.path.join(root, "era5_demo")
    if not os.path.isdir(data["lr"]):
        write_era5(data["lr"], verbose=False)  # the demo's: 32 x 64, 256 training samples
    if not s.gpus:
        return {**data, "dp": data["lr"]}, None
    target = os.path.join(root, "era5")
    if os.path.isdir(target):
        return {**data, "dp": target}, None
    pool, pending, parts = era5_parts(root, ERA5_GPU)

    def wait(seconds):
        pending.wait(max(seconds, 1))
        pool.close()
        if not pending.ready():
            pool.terminate()
            return None
        pending.get()
        return era5_assemble(root, parts)
    return {**data, "dp": None}, wait


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the report's folder: multi_gpu.json, logs/, profiles/")
    parser.add_argument("--work", default=None, help="data and run directories (default OUT/work)")
    parser.add_argument("--figures", default=None, help="the profiles' figures (default OUT/figures)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks (default: every GPU of the node, at most 8; on CPUs 4)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the six parts (default 540 on GPUs, 3600 on CPUs, 1800 with --tiny)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts (default all: {','.join(PARTS)})")
    parser.add_argument("--tiny", action="store_true", help="the `tiny` config everywhere (a check of the script)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU ranks (gloo) when there is no GPU")
    args = parser.parse_args(argv)
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not args.allow_cpu:
        parser.error("no GPU here: this is the multi-GPU session (add --allow-cpu, and --tiny, to rehearse it on CPU "
                     "ranks)")
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"no part {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    ranks = args.ranks or (min(gpus, 8) if gpus else 4)
    if ranks < 2 and gpus != 1:
        parser.error(f"--ranks {ranks}: the multi-GPU day needs 2 ranks or more")
    if gpus and ranks > gpus:
        parser.error(f"--ranks {ranks}, but this node has {gpus} GPUs (NCCL takes one GPU a rank)")
    mode = "tiny" if args.tiny else ("gpu" if gpus else "cpu")
    budget = args.budget or MODES[mode]["budget"]
    s = Session(args.out, args.work or os.path.join(args.out, "work"),
                args.figures or os.path.join(args.out, "figures"), ranks, gpus, mode, budget)
    report = {"made_by": "bash benchmarks/gpu_session.sh DIR --multi" + (" --tiny" if args.tiny else "") +
              ("" if gpus else " --allow-cpu") + " (benchmarks/gpu_multi.py)",
              "machine": machine() + (f" x {gpus}" if gpus > 1 else ""), "gpus": gpus, "ranks": ranks,
              "backend": "nccl" if gpus else "gloo", **versions(), "date": time.strftime("%Y-%m-%d"),
              "mode": mode, "budget_s": budget, "status": "running", "parts": {}}
    path = os.path.join(args.out, "multi_gpu.json")
    write_json(path, report)  # at once: an earlier session's report never stands as this one's
    log(f"{report['machine']}; torch {report['torch']}; {ranks} ranks over {report['backend']}; parts: "
        f"{', '.join(parts)}; budget {budget:.0f} s")
    interrupt_on_signals()
    try:
        return run_parts(s, args, parts, report, path)
    except Interrupted as stop:  # the running command's processes are gone (Session.run, the failure part)
        what = s.running or "no command"
        report["status"] = "interrupted"
        cut = report.get("cut")
        if cut is not None:
            report["parts"][cut].update(ok=False, status="interrupted", error=f"interrupted by {stop}")
        write_json(path, report)
        print(f"error: interrupted by {stop}: stopped {what} and every process it started"
              + (f", in part {cut}" if cut else "") + f"; {path} marks the session \"interrupted\"",
              file=sys.stderr, flush=True)
        return 130


def run_parts(s, args, parts, report, path):
    """The sample data, NCCL's one-rank paths (GPUs), then each part in turn; the report written after each."""
    gpus = s.gpus
    data, wait = prepare_data(s, args.tiny)
    if gpus:
        s.deadline = min(60, s.budget)
        report["one_gpu_nccl"] = {}
        try:
            one_gpu_nccl(s, data, report["one_gpu_nccl"])
        except OutOfTime as err:
            report["one_gpu_nccl"].update(ok=False, error=str(err))
        write_json(path, report)
        if gpus == 1:
            for name in parts:
                report["parts"][name] = {"ok": False, "not_on_this_machine": "needs 2 GPUs or more; this node has 1"}
            report["seconds"] = round(s.elapsed(), 1)
            report["status"] = "done"
            write_json(path, report)
            return 0 if report["one_gpu_nccl"]["ok"] else 1
    for name in parts:
        s.deadline = ENDS[name] * s.budget
        if name != "exactness" and data.get("dp") is None and wait is not None:
            data["dp"] = wait(s.deadline - s.elapsed() - 60)
            wait = None
        began = time.monotonic()
        found = report["parts"][name] = {}  # what a part measured stays when its deadline cuts it
        report["cut"] = name  # the part an interruption would cut (dropped when it ends)
        try:
            if data.get("dp") is None and name in ("data_parallel", "dp_profile", "model_parallel"):
                raise OutOfTime("the sample data at 360 x 720 was not written in time")
            RUNS[name](s, data, found)
        except OutOfTime as err:
            found.update(ok=False, error=str(err))
        except Exception as err:  # the part's own error, in one line; the next part still runs
            import traceback
            traceback.print_exc()
            found.update(ok=False, error=f"{type(err).__name__}: {err}")
        report["parts"][name]["seconds"] = round(time.monotonic() - began, 1)
        report.pop("cut")
        done = report["parts"][name]
        log(f"{name}: {'ok' if done['ok'] else 'NOT OK ' + str(done.get('error', ''))} ({done['seconds']} s)")
        report["seconds"] = round(s.elapsed(), 1)
        write_json(path, report)
    failed = [name for name in parts if not report["parts"][name]["ok"]]
    if "one_gpu_nccl" in report and not report["one_gpu_nccl"]["ok"]:
        failed.append("one_gpu_nccl")
    report["status"] = "done"
    write_json(path, report)
    log(f"done in {report['seconds']} s; " + (f"not ok: {', '.join(failed)}" if failed else "every part ok") +
        f"; {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
