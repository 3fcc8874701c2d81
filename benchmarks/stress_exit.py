"""Stress: does every rank of a finished run exit? The 4-rank start-to-exit cycle, looped (issue #40 item 10).

    python -m benchmarks.stress_exit [--cycles 30] [--teardowns 300] [--switched_off]
                                     [--out bench_results/stress_exit.json]

Two loops, on this machine's CPUs over gloo (`make stress-exit` runs both on the container's torch 2.5 and on
.venv's; not part of `make test`: about 15 minutes a torch):
  runs       `--cycles` times the issue's command: torchrun, 4 ranks of train_mp.py at tp=2 x cp=2 with
             --sequence_parallel --activation_checkpointing --enable_benchy (one batch, one trial); a cycle not over
             `--cycle_timeout` s after its start is a hang, and so is a rank still alive once torchrun has ended
             (torchrun starts each rank in a session of its own: a hung rank outlives it). Hung ranks are killed.
  teardowns  4 plain ranks, started once, that `--teardowns` times join a process group, build the tp x cp groups,
             train a few DDP steps and run collectives on every group, pass a barrier, leave the process group
             (utils/comm.destroy) and drop the model and the grid: the end of a run without the imports, a third
             of a second a cycle, so it meets the race far more often per minute. A rank silent for `--stall` s is
             hung; the ranks are then killed and started again, until `--teardowns` cycles have been tried.
With --switched_off the ranks leave as before the fix: dist.destroy_process_group() with each backend torn down
inside it, under the GIL on torch < 2.8 (utils/compat.leave_process_group says why that hangs), and the grid's Axes
keeping their groups past it (utils/comm.forget_groups).
The JSON: per loop the cycles tried and hung, the exit codes and times; torch's version. Exit code 1 if any hung.
"""
import os
import runpy
import signal
import subprocess
import sys
import time

from benchmarks.common import cpu_cores, free_port
from utils.atomic import write_json
from utils.errors import ArgumentParser

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 4
RUN_FLAGS = ["--config", "tiny", "--data_loader_config", "synthetic", "--tensor_parallel", "2", "--context_parallel",
             "2", "--sequence_parallel", "--activation_checkpointing", "--enable_benchy", "--benchy_nbatches", "1",
             "--benchy_ntrials", "1", "--benchy_nwarmup", "0"]


def switch_off():
    """The fix switched off: every backend goes inside dist.destroy_process_group(), and the grid's Axes keep their
    groups past it, as before."""
    from utils import compat
    from utils.layout import Axis
    compat._backends = lambda: []
    Axis.let_go = lambda self: None


def processes_with(marker):
    """The pids of the processes whose command line holds `marker` (a cycle's own --expdir or log folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and int(pid) != os.getpid():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def environment(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO_ROOT)
    env.pop("WORLD_SIZE", None)  # torchrun's own, or one of the teardown ranks' (extra)
    return dict(env, **extra)


def one_run(work, cycle, switched_off, timeout):
    """One start-to-exit cycle of the issue's command. Returns (hung, torchrun's exit code, seconds, log tail)."""
    expdir = os.path.join(work, f"run_{cycle}")
    script = (["-m", "benchmarks.stress_exit", "--as_run_rank", "--"] if switched_off else ["train_mp.py"])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS), "--master_port",
               str(free_port())] + script + RUN_FLAGS + ["--expdir", expdir]
    log_path = os.path.join(work, f"run_{cycle}.log")
    start = time.time()
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(command, cwd=REPO_ROOT, env=environment(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        code = launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.time() - start
    time.sleep(1)  # a rank ends a moment after torchrun sees its exit
    left = processes_with(expdir)
    hung = code is None or bool(left)
    if hung:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        kill_all(processes_with(expdir))
        launcher.wait()
    with open(log_path) as f:
        tail = f.read()[-1500:]
    return hung, code, seconds, tail


def teardown_rank(cycles, switched_off):
    """One of the plain ranks of the teardown loop (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE set): prints each
    cycle's number once it has left the process group."""
    import datetime

    import torch
    import torch.distributed as dist

    from distributed.data_parallel import init_ddp_model_and_reduction_hooks
    from resilience import host
    from utils import comm
    from utils.layout import Layout
    if switched_off:
        switch_off()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    for cycle in range(cycles):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"cycle_{cycle}", store), rank=rank, world_size=world)
        grid = comm.init(Layout.for_world(world, 2, 2, sequence_parallel=True, checkpointing=True))
        model = init_ddp_model_and_reduction_hooks(torch.nn.Linear(4, 4), grid, torch.device("cpu"))  # + comm hook
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            for name in ("tp", "cp", "tp-cp", "dp"):
                comm.all_reduce_sum(torch.ones(3), name)  # a tensor Python lets go of at once
            host.HostMax(0).wait()
        comm.barrier()
        comm.destroy()
        del model, grid  # as at a run's end: the model and the grid go after the teardown
        print(cycle, flush=True)
    store.set(f"done/{rank}", "1")  # rank 0 holds the store: it waits for the others before it exits
    if rank == 0:
        store.wait([f"done/{other}" for other in range(world)])


def cycles_left(log_path):
    """How many teardown cycles a rank has printed (its log also holds torch's warnings)."""
    with open(log_path) as f:
        return sum(line.strip().isdigit() for line in f)


def teardowns(work, cycles, switched_off, stall):
    """Start the plain ranks until `cycles` teardown cycles have been tried. Returns (tried, hung, seconds)."""
    tried, hung, start, attempt = 0, 0, time.time(), 0
    while tried < cycles:
        attempt += 1
        folder = os.path.join(work, f"teardowns_{attempt}")
        os.makedirs(folder, exist_ok=True)
        port, processes, logs = free_port(), [], []
        for rank in range(RANKS):
            logs.append(os.path.join(folder, f"rank{rank}.log"))
            env = environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS))
            with open(logs[-1], "w") as log:
                argv = [sys.executable, "-m", "benchmarks.stress_exit", "--as_teardown_rank",
                        str(cycles - tried)] + (["--switched_off"] if switched_off else [])
                processes.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        progress, last_change = -1, time.time()
        while any(p.poll() is None for p in processes) and time.time() - last_change < stall:
            time.sleep(0.5)
            done = min(map(cycles_left, logs))  # the cycles every rank has left
            if done != progress:
                progress, last_change = done, time.time()
        stalled = any(p.poll() is None for p in processes)
        kill_all([p.pid for p in processes if p.poll() is None])
        for process in processes:
            process.wait()
        done = min(map(cycles_left, logs))
        tried += done + (1 if stalled else 0)
        hung += int(stalled)
        print(f"  teardowns: {done} cycles left cleanly{', then one hung' if stalled else ''}", flush=True)
        if not stalled and any(p.returncode for p in processes):
            raise SystemExit(f"a teardown rank failed: see {folder}")
    return tried, hung, time.time() - start


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=30, help="start-to-exit cycles of the 4-rank run")
    parser.add_argument("--teardowns", type=int, default=300, help="cycles of the teardown loop")
    parser.add_argument("--cycle_timeout", type=float, default=180.0, help="seconds a run cycle may take")
    parser.add_argument("--stall", type=float, default=60.0, help="seconds a teardown rank may be silent")
    parser.add_argument("--switched_off", action="store_true", help="leave the process group as before the fix")
    parser.add_argument("--work", default="/tmp/stress_exit", help="run directories and logs")
    parser.add_argument("--out", default=None, help="the JSON (none: printed only)")
    parser.add_argument("--as_run_rank", action="store_true", help=argparse_hidden())
    parser.add_argument("--as_teardown_rank", type=int, default=None, help=argparse_hidden())
    args, rest = parser.parse_known_args(argv)
    if args.as_run_rank:  # a rank of one_run with the fix switched off: train_mp.py as the program, the run's flags
        switch_off()
        sys.argv = ["train_mp.py"] + [a for a in rest if a != "--"]
        runpy.run_path(os.path.join(REPO_ROOT, "train_mp.py"), run_name="__main__")
        return 0
    if args.as_teardown_rank is not None:
        teardown_rank(args.as_teardown_rank, args.switched_off)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    import torch
    os.makedirs(args.work, exist_ok=True)
    what = "switched off (as before the fix)" if args.switched_off else "as it is"
    print(f"torch {torch.__version__}, the process group's teardown {what}", flush=True)
    runs = []
    for cycle in range(args.cycles):
        hung, code, seconds, tail = one_run(args.work, cycle, args.switched_off, args.cycle_timeout)
        runs.append({"hung": hung, "exit_code": code, "seconds": round(seconds, 1)})
        print(f"  run {cycle + 1}/{args.cycles}: {'HUNG' if hung else 'exited'}, exit code {code}, "
              f"{seconds:.0f} s", flush=True)
        if not hung and code != 0:
            raise SystemExit(f"run {cycle} failed (exit code {code}):\n{tail}")
    tried, hung_teardowns, teardown_seconds = (teardowns(args.work, args.teardowns, args.switched_off, args.stall)
                                               if args.teardowns else (0, 0, 0.0))
    hung_runs = sum(run["hung"] for run in runs)
    result = {"torch": torch.__version__, "machine": cpu_cores(), "switched_off": args.switched_off,
              "runs": {"tried": len(runs), "hung": hung_runs, "cycles": runs},
              "teardowns": {"tried": tried, "hung": hung_teardowns, "seconds": round(teardown_seconds, 1)}}
    print(f"runs: {hung_runs} of {len(runs)} hung; teardowns: {hung_teardowns} of {tried} hung "
          f"({teardown_seconds:.0f} s)", flush=True)
    if args.out:
        write_json(args.out, result)
    return 1 if hung_runs or hung_teardowns else 0


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
