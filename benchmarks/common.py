"""What the benchmark commands share: the machine in words, a free port for torchrun, and for those that run the
training scripts (gpu_check.py, bench_graph.py) sample data at the stages' sizes, generated once, one
`--enable_benchy` run of a stage. No benchmark module imports another's helpers: shared ones live here (the dry run
in its own process, which the planner uses too, is planning/dry_run.py's)."""
import json
import multiprocessing
import os
import platform
import shutil
import socket
import subprocess
import sys
import time

from utils.errors import error_line

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_SIZES = {  # generator arguments: real image sizes, few samples (the benchmark cycles through them)
    "full": {"era5": {"height": 360, "width": 720, "steps_per_year": 48, "train_years": 1, "valid_years": 1,
                      "test_years": 1},
             "cosmo": {"train_size": 128, "valid_size": 64}, "cifar100": {}},
    "tiny": {"era5": {"height": 16, "width": 32, "steps_per_year": 24, "train_years": 1, "valid_years": 1,
                      "test_years": 1},
             "cosmo": {}, "cifar100": {"train_per_class": 2, "test_per_class": 1}},
}


def cpu_cores():
    """This machine's processor and core count, e.g. 'x86_64, 2 cores'."""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def machine():
    """This machine in words, e.g. 'AMD EPYC, 2 CPU cores, no GPU' (the runs themselves use the CPU)."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{model or 'CPU'}, {os.cpu_count()} CPU cores, {gpu}"


def device_name():
    """The GPU the runs use, else 'CPU (<processor>)'."""
    import torch  # lazy: example_logs.py imports this module without needing torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"


def ran_on(report):
    """Where and when a report's measurements ran, in words (its `device`, `torch` and `date`): each row of a report
    that merges several runs keeps its own."""
    return f"{report['device']}, torch {report['torch']}, {report['date']}"


def free_port():
    """A TCP port free on this machine now (torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(root, sizes, log=print, names=None):
    """Sample data of each stage under `root` at `sizes` (DATA_SIZES[...]), generated where missing; {name: dir}.
    `names`: only those stages' data (default: all three)."""
    from sample_data import write_cifar100, write_cosmo, write_era5
    writers = {"era5": write_era5, "cosmo": write_cosmo, "cifar100": write_cifar100}
    paths = {}
    for name, writer in writers.items():
        if names is not None and name not in names:
            continue
        paths[name] = os.path.join(root, name)
        if not os.path.isdir(paths[name]):
            log(f"generating {name} sample data in {paths[name]}")
            writer(paths[name], verbose=False, **sizes[name])
    return paths


def run_stage(name, yaml, config, data_dir, flags, work, bench, script="train.py", log=print):
    """`script --enable_benchy` (train.py, or train_graph.py for bench_graph) for one stage; its JSON plus the wall
    time, or the error."""
    out = os.path.join(work, f"benchy_{name}")
    command = [sys.executable, script, "--yaml_config", yaml, "--config", config, "--data_dir", data_dir,
               "--expdir", os.path.join(work, "runs", name), "--enable_benchy", "--benchy_nbatches",
               str(bench["nbatches"]), "--benchy_ntrials", str(bench["ntrials"]), "--benchy_nwarmup",
               str(bench["nwarmup"]), *flags]
    log(f"{name}: {' '.join(command[1:])}")
    start = time.time()
    result = subprocess.run(command, cwd=REPO_ROOT, env=dict(os.environ, BENCHY_OUTPUT=out), capture_output=True,
                            text=True)
    if result.returncode != 0:
        return {"ok": False, "error": [error_line(result.stderr)],
                "log_tail": result.stderr[-3000:]}
    with open(out + ".json") as f:
        bench_results = json.load(f)
    return {"ok": True, "seconds": time.time() - start, "command": " ".join(command[1:]), **bench_results}


def one_year(args):
    """One process's share of the ERA5 data: a whole small data set, of which the caller keeps one year file."""
    from sample_data import write_era5
    out, sizes, first_year = args
    write_era5(out, train_years=1, valid_years=1, test_years=1, first_year=first_year, verbose=False, **sizes)
    return out


def era5_parts(root, sizes, years=4):
    """Start writing an ERA5 set of `years` training years: one process a year, each a whole small data set of which
    one year is kept (the generator writes one year at a time). Returns (pool, pending result, the parts)."""
    parts = [(os.path.join(root, f"era5_part{k}"), sizes, 2000 + 3 * k) for k in range(years)]
    for part, _, _ in parts:
        shutil.rmtree(part, ignore_errors=True)
    pool = multiprocessing.get_context("spawn").Pool(years)
    return pool, pool.map_async(one_year, parts), parts


def era5_assemble(root, parts):
    """The ERA5 set from the parts: every part's training year, the first part's validation and test years and
    statistics (computed over its training year)."""
    target = os.path.join(root, "era5")
    staging = target + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    for split in ("train", "valid", "test"):
        os.makedirs(os.path.join(staging, split))
    for k, (part, _, first_year) in enumerate(parts):
        os.replace(os.path.join(part, "train", f"{first_year}.h5"), os.path.join(staging, "train", f"{first_year}.h5"))
        if k == 0:
            for split, year in (("valid", first_year + 1), ("test", first_year + 2)):
                os.replace(os.path.join(part, split, f"{year}.h5"), os.path.join(staging, split, f"{year}.h5"))
            os.replace(os.path.join(part, "stats"), os.path.join(staging, "stats"))
        shutil.rmtree(part)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target
