"""Shared fixtures: small generated ERA5 data and a way to run train.py in-process or as a command.

Tests not marked `gpu` run on the CPU also on a GPU node (`make test` there checks what it checks here): CUDA is
hidden from them and from the commands they start. TESTS_KEEP_CUDA=1 leaves CUDA visible (the twin in
tests/gpu/test_gpu_presence.py shows what then fails). Tests not marked `multiprocess` may not start processes.
"""
import concurrent.futures
import multiprocessing.process
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from sample_data.era5 import write_era5

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pyproject.toml puts it on sys.path


class StartsAProcess(RuntimeError):
    """A test not marked `multiprocess` started a process (`make test-fast` would then not be fast)."""


def refuse_processes(patch, item):
    def refuse(self, *args, **kwargs):
        self._child_created = False  # for Popen.__del__
        raise StartsAProcess(f"{item.nodeid} starts a process: mark it @pytest.mark.multiprocess")
    patch.setattr(subprocess.Popen, "__init__", refuse)
    patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


def pytest_sessionstart(session):
    """matplotlib's first import on a machine builds its font cache, running `fc-list` in a process: done here, once
    per pytest process, so that a test not marked multiprocess that draws the first figure (a run's validation)
    does not start that process itself."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests of a module that use a module-scoped fixture of that module (a reference run, ranks spawned once
    for several tests) share one xdist group: under `make test`'s `--dist loadgroup` they run in one pytest process,
    which computes the fixture once (with `load` each process computed it for the tests it was sent).

    pytest-xdist marks a group by a suffix on the test's id in each worker (`test@group`), which pytest 9 no longer
    lets it set (xdist 3.8 writes `_nodeid`, pytest 9 reads `_id`): the suffix is set here, after xdist's hook."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        module = item.nodeid.split("::")[0]
        if info is not None and any(
                defs[-1].scope == "module" and defs[-1].baseid == module
                for defs in (info.name2fixturedefs.get(name) for name in info.names_closure) if defs):
            item.add_marker(pytest.mark.xdist_group(module.rsplit("/", 1)[-1].removesuffix(".py")))
        groups = sorted({str(mark.args[0]) for mark in item.iter_markers("xdist_group")})
        if getattr(config.option, "loadgroup", False) and groups and "@" not in item.nodeid:
            nodeid = f"{item.nodeid}@{'_'.join(groups)}"
            if hasattr(item, "_id"):  # pytest >= 9
                from _pytest.nodeid import NodeId
                item._id = NodeId.parse(nodeid)
            else:
                item._nodeid = nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """From the set-up of a test's fixtures (module-scoped ones too) to their teardown:
    - a test not marked gpu sees no CUDA, in this process and in the commands it starts: the device every script
      chooses, DALI's device_id and the MFU's peak are then the CPU's, as on the machines CI runs on
      (TESTS_KEEP_CUDA=1 leaves CUDA visible);
    - a test not marked multiprocess cannot start a process (training ranks, commands, loader workers), so that
      `make test-fast` (-m "not multiprocess") stays fast."""
    with pytest.MonkeyPatch.context() as patch:
        if item.get_closest_marker("gpu") is None and os.environ.get("TESTS_KEEP_CUDA") != "1":
            patch.setenv("CUDA_VISIBLE_DEVICES", "")
            patch.setattr(torch.cuda, "is_available", lambda: False)
        if item.get_closest_marker("multiprocess") is None:
            refuse_processes(patch, item)
        yield


@pytest.fixture
def in_repo_root(monkeypatch):
    """Run a test from the repository root (configs are read by relative path), as a single process."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(scope="session")
def era5_dir(tmp_path_factory):
    """Default-size sample data (32 x 64, 2 train years, 1 valid, 1 test), generated once per session."""
    out = tmp_path_factory.mktemp("era5")
    write_era5(out, verbose=False)
    return str(out)


def as_spawned_rank(rank, world, port, gpu=False, **extra):
    """Environment of a rank spawned by a test, rendezvous on localhost: gloo on the CPU (also on a GPU node, where
    several ranks would otherwise share one GPU under NCCL), or with `gpu` NCCL on GPU number `rank`."""
    if not gpu:
        extra["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), **extra)


def scalar_points(run_dir):
    """{tag: [(step, value), ...]} of a run's TensorBoard scalars as TensorBoard shows them (a point written twice
    appears twice), the timings left out (they differ between any two runs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(str(run_dir), "logs"))
    events.Reload()
    timings = {"Avg iters per sec", "Avg samples per sec"}
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if tag not in timings}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(args, nproc=1, timeout=600, gpu=False):
    """Run train.py (or a module) as a real command; nproc > 1 goes through torchrun, with gloo on the CPU, or with
    `gpu` NCCL on one GPU per rank (the caller checks there are enough)."""
    env = dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"))
    env.pop("WORLD_SIZE", None)
    if nproc > 1 and not gpu:  # gloo on the CPU: a GPU node may have fewer GPUs than ranks (NCCL needs one each)
        env["CUDA_VISIBLE_DEVICES"] = ""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                     "--master_port", str(free_port())]
    return subprocess.run(launcher + args, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_ranks(args, nproc, timeout=600):
    """`args` (as for run_command) on `nproc` plain gloo processes, each told its rank: where the launcher is not
    under test, torchrun would only add a process that imports torch. Returns what run_command returns: a
    CompletedProcess whose returncode is the first non-zero rank's (0 if none) and whose stdout and stderr are the
    ranks' in rank order (each to a file while it runs: a full pipe would stall a rank)."""
    port = free_port()
    processes = []
    try:
        for rank in range(nproc):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            env = plain_rank_env(rank, nproc, port)
            processes.append((subprocess.Popen([sys.executable] + args, cwd=REPO_ROOT, env=env, stdout=out, stderr=err),
                              out, err))
        deadline = time.time() + timeout
        codes = [process.wait(timeout=max(deadline - time.time(), 0.1)) for process, _, _ in processes]
    finally:
        outs, errs = [], []
        for process, out, err in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            for f, texts in ((out, outs), (err, errs)):
                f.seek(0)
                texts.append(f.read())
                f.close()
    return subprocess.CompletedProcess([sys.executable] + args, next((c for c in codes if c != 0), 0), "".join(outs),
                                       "".join(errs))


def beside(*calls):
    """Run the callables at once, each in a thread, and return their results in order (the first exception raised
    is raised here): for a test and its twin that mostly wait (a stall, a timeout), whose runs then overlap."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def plain_rank_env(rank, ranks, port, **extra):
    """The environment of rank `rank` of `ranks` plain processes (no launcher) meeting on localhost over gloo."""
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **extra)


def run_plain_ranks(argv, ranks, log_dir, timeout=120):
    """`ranks` processes of `argv` over gloo, each told its rank (no launcher: each one's exit code and output),
    logging to files in `log_dir` (a full pipe would stall a rank). Returns (exit codes, outputs, time of the last
    exit); a rank left waiting for another fails the wait."""
    port = free_port()
    processes = []
    for rank in range(ranks):
        env = plain_rank_env(rank, ranks, port)
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w+")
        processes.append((subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes, outputs, last_exit = [], [], 0.0
    try:
        for process, _ in processes:
            codes.append(process.wait(timeout=timeout))
            last_exit = time.time()
    finally:
        for process, log in processes:
            process.kill()
            log.seek(0)
            outputs.append(log.read())
            log.close()
    return codes, outputs, last_exit

