"""Slurm's warning (`--signal=USR1@180`), its SIGTERM and a terminal's Ctrl-C reach every process of the step, also
the helpers torch and multiprocessing start: inductor's compile workers (a sidecar process and the workers it forks,
under `--enable_jit`) and multiprocessing's resource tracker. Started by `signals.start_compile_workers()` (what
restore does when the run compiles), they live through the three signals and the pool compiles on; started as
torch and the loaders started them before, SIGUSR1 kills them, and the pool is gone for the rest of the run.

A real process per test, in a session of its own (as a job step): it compiles a small function on the CPU with
compile_threads=2, signals its whole process group (os.killpg, as Slurm does), and reports on its children.
A failure points to lifecycle/signals.py (start_compile_workers, start_resource_tracker).
"""
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.multiprocess

COMPILER = shutil.which(os.environ.get("CXX", "g++"))  # inductor's C++ kernels on the CPU need one


def _descendants(pid):
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                found += [child] + _descendants(child)
    return found


def _kind(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        command = f.read()
    return ("resource tracker" if b"resource_tracker" in command else
            "compile worker" if b"compile_worker" in command else command.decode(errors="replace")[:80])


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except OSError:
        return False


def _start_as_torch_does():
    """What torch's inductor backend does at a run's first compile (torch 2.14), or the import that does it (2.5)."""
    from torch._inductor import async_compile
    if hasattr(async_compile, "maybe_warm_pool"):
        async_compile.maybe_warm_pool()


def child(protect):
    """The process under test: a training process's handlers, its compile workers started protected (as start_run
    does) or as torch starts them, a compile, the three stop signals to its whole process group, then a report (one
    JSON line on stdout) of its children and of what still compiles."""
    import torch

    from lifecycle import signals
    signals.install()  # the training process records the stop signals (start_run)
    if protect:
        signals.start_compile_workers()
    else:
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()  # as the loaders started it before (workers_start_blocked)
        if not COMPILER:
            _start_as_torch_does()
    function = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    if COMPILER:
        function(torch.randn(8))  # the first compile: torch starts the pool here, where nothing started it before
    from torch._inductor import async_compile
    pool = async_compile.AsyncCompile.process_pool()
    pool.submit(os.getpid).result(timeout=300)  # the workers are up
    before = {pid: _kind(pid) for pid in _descendants(os.getpid())}
    for signum in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):  # SIGINT first: a second one would stop here
        os.killpg(0, signum)
        time.sleep(0.2)
    time.sleep(3)  # long enough for a dead sidecar's pipe to close
    try:
        job = f"ran in worker {pool.submit(os.getpid).result(timeout=120 if protect else 15)}"
    except Exception as error:  # noqa: BLE001 -- torch 2.14: RuntimeError; torch 2.5: the job never returns
        job = f"failed: {type(error).__name__} {error}"
    compiles = None
    if COMPILER:
        x = torch.randn(16)  # another shape: a recompile
        compiles = bool(torch.allclose(function(x), torch.sin(x) * 2 + 1))
    print(json.dumps({"before": before, "alive": [str(pid) for pid in before if _alive(pid)], "job": job,
                      "compiles": compiles, "received": signals.received()}), flush=True)


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """One inductor cache for both tests: the second compiles from the first's kernels (torch still starts its pool
    at the compile, before it looks in the cache)."""
    return str(tmp_path_factory.mktemp("inductor"))


def run_child(protect, tmp_path, inductor_cache):
    """Run child(protect) in a session of its own; (its report, seconds from the report to its exit)."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="2", TORCHINDUCTOR_CACHE_DIR=inductor_cache,
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("TORCH_WARM_POOL", None)
    code = f"from tests.training.test_compile_worker_signals import child; child({protect})"
    with open(tmp_path / "stderr.log", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=stderr, text=True, start_new_session=True)
        try:
            line = process.stdout.readline()
            reported = time.monotonic()
            process.wait(timeout=300)
            took = time.monotonic() - reported
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert line, (tmp_path / "stderr.log").read_text()[-3000:]
    return json.loads(line), took


def skip_without_a_pool():
    if importlib.util.find_spec("torch._inductor.compile_worker.subproc_pool") is None:
        pytest.skip("this torch has no subprocess compile-worker pool")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("inductor starts its compile-worker pool only where Triton is installed")


@pytest.mark.compat  # also on the container's torch 2.5
@pytest.mark.long
def test_compile_workers_and_the_resource_tracker_live_through_every_stop_signal_and_compile_on(tmp_path,
                                                                                             inductor_cache):
    """Started protected, the resource tracker, the compile pool's sidecar and its 2 workers live through SIGINT,
    SIGUSR1 and SIGTERM to the whole process group; the training process records the first (SIGINT); a job still
    runs in a worker, and a recompile (another shape) still works. The process then exits at once: told to quiesce
    first, torch 2.14's sidecar does not wait 10 s for workers to end on a SIGTERM they do not hear."""
    skip_without_a_pool()
    report, took = run_child(True, tmp_path, inductor_cache)
    kinds = sorted(report["before"].values())
    assert kinds == ["compile worker"] * 3 + ["resource tracker"], report  # sidecar + 2 workers, the tracker
    assert sorted(report["alive"]) == sorted(report["before"]), report
    assert report["job"].startswith("ran in worker"), report
    assert report["compiles"] in (True, None), report  # None: no C++ compiler here, the pool alone checked
    assert report["received"] == "SIGINT"
    assert took < 10, f"the exit took {took:.1f} s"


@pytest.mark.compat
@pytest.mark.long
def test_without_the_protection_slurms_warning_kills_the_compile_workers_and_the_resource_tracker(tmp_path,
                                                                                                inductor_cache):
    """Twin: started as torch (at the first compile) and the loaders (the tracker) started them, every one of them
    dies of the signals, and the pool runs no job again (torch 2.14: "Attempting to use a closed pool"; 2.5: the job
    never returns): on a GPU every later Triton compile of the run would fail."""
    skip_without_a_pool()
    report, _ = run_child(False, tmp_path, inductor_cache)
    assert sorted(report["before"].values()) == ["compile worker"] * 3 + ["resource tracker"], report
    assert report["alive"] == [], report
    assert report["job"].startswith("failed"), report


@pytest.mark.parametrize("enable_jit", [True, False])
def test_a_run_that_compiles_starts_the_protected_workers_in_restore(monkeypatch, enable_jit):
    """Every script calls restore() after its own refusals (the graph scripts refuse --enable_jit after start_run)
    and before its first compile: a run with --enable_jit starts the protected pool there, a run without does not."""
    from types import SimpleNamespace

    from lifecycle import run as run_module
    from lifecycle import signals
    started = []
    monkeypatch.setattr(signals, "start_compile_workers", lambda: started.append(True))
    monkeypatch.setattr(signals, "stop_before_training", lambda *args: None)
    run = SimpleNamespace(params=SimpleNamespace(enable_jit=enable_jit), checkpoint=None, resume_path=None,
                          exp_dir="unused")
    assert run_module.restore(run, None, None, None, None) == (0, None)
    assert started == ([True] if enable_jit else [])
