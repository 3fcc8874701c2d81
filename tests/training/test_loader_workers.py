"""Loader workers are bounded (issue #53, item 4): a --num_data_workers the machine cannot hold is refused at start in
one line naming the limit, and no worker outlives its training process, even one the kernel kills.

A failure in the refusal tests points to lifecycle/workers.py (check_worker_count, worker_limit, machine_facts); in the
worker tests to loaders/common.py (exit_with_parent, called by every PyTorch and DALI loader worker at its start).
"""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import lifecycle.workers
import train
from lifecycle.cli import apply_overrides, training_parser
from lifecycle.workers import check_worker_count, machine_facts, worker_limit
from loaders import common
from tests.conftest import REPO_ROOT
from utils.errors import UserError
from utils.YParams import YParams, read_configs

GiB = 2**30
TWO_CORES = (2, 24 * GiB, 1)  # the machine of the probe: 2 CPUs, 24 GiB, one rank
PERLMUTTER_TORCHRUN = (128, 230 * GiB, 4)  # a GPU node (64 cores, 128 threads), torchrun's 4 ranks
PERLMUTTER_SRUN = (32, 230 * GiB, 1)  # the same under srun: a task's own 32 CPUs


def run_train(argv, capsys):
    """train.main(argv) in this process: (exit code, the `error:` lines)."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    return exit_info.value.code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


@pytest.mark.usefixtures("in_repo_root")
def test_a_thousand_workers_are_refused_in_one_line_before_the_run_directory(era5_dir, tmp_path, capsys,
                                                                            monkeypatch):
    """The probe's command on the probe's machine (figures injected): before, it was accepted, and the run was
    OOM-killed without a line after its first epoch (without the check, conftest's guard stops the first worker)."""
    monkeypatch.setattr(lifecycle.workers, "machine_facts", lambda: TWO_CORES)
    expdir = tmp_path / "runs"
    code, lines = run_train(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir),
                             "--num_data_workers", "1000"], capsys)
    assert code == 2 and lines == [
        "error: --num_data_workers 1000 is more than this machine can hold: 2 CPUs allow at most 8 loader workers "
        "per rank (4 per CPU, never fewer than 8); lower --num_data_workers to 8 or fewer"]
    assert not expdir.exists()  # nothing written


@pytest.mark.usefixtures("in_repo_root")
def test_the_refusal_reads_this_machine(era5_dir, tmp_path, capsys):
    """The same with this machine's own figures: a million workers is more than any machine holds."""
    expdir = tmp_path / "runs"
    code, lines = run_train(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir),
                             "--num_data_workers", "1000000"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: --num_data_workers 1000000 is more than this machine can hold: ")
    assert lines[0].endswith(f"; lower --num_data_workers to {worker_limit(*machine_facts())[0]} or fewer")
    assert not expdir.exists()


@pytest.mark.usefixtures("in_repo_root")
def test_a_usual_worker_count_passes_the_same_check(monkeypatch):
    """Twin of the refusal: the tiny config with 8 workers on the same injected machine gets through the flags."""
    monkeypatch.setattr(lifecycle.workers, "machine_facts", lambda: TWO_CORES)
    args = training_parser("t").parse_args(["--config", "tiny", "--num_data_workers", "8"])
    params = YParams(args.yaml_config, args.config)
    apply_overrides(params, args, dp_size=1, dp_rank=0)
    assert params.num_data_workers == 8
    args.num_data_workers = 9
    with pytest.raises(UserError, match=r"--num_data_workers 9 is more than this machine can hold"):
        apply_overrides(YParams(args.yaml_config, args.config), args, dp_size=1, dp_rank=0)


@pytest.mark.parametrize("facts, limit, bound_by", [
    (TWO_CORES, 8, "2 CPUs allow at most 8 loader workers per rank"),
    ((2, 24 * GiB, 16), 8, "2 CPUs shared by 16 ranks allow at most 8"),  # many CPU ranks on 2 cores: 8 still
    ((1, None, 1), 8, "1 CPU allows at most 8"),  # memory unknown (not Linux): the CPUs alone
    (PERLMUTTER_TORCHRUN, 128, "128 CPUs shared by 4 ranks allow at most 128"),
    (PERLMUTTER_SRUN, 128, "32 CPUs allow at most 128"),
    ((64, 2 * GiB, 4), 4, "2.0 GiB of available memory shared by 4 ranks allows at most 4 loader workers per rank "
                          "(64 MiB each, for the training and the validation loader)"),
    ((8, 512 * 2**20, 1), 4, "0.5 GiB of available memory allows at most 4"),
])
def test_the_limit_is_the_lower_of_the_cpu_and_the_memory_bound(facts, limit, bound_by):
    assert worker_limit(*facts)[0] == limit
    assert worker_limit(*facts)[1].startswith(bound_by)


def config_worker_counts():
    """(yaml file, config, num_data_workers) of every named config of the three stages."""
    found = []
    for yaml_file in ("config/ViT.yaml", "config/UNet.yaml", "config/ResNet50.yaml"):
        for name, values in read_configs(os.path.join(REPO_ROOT, yaml_file)).items():
            if isinstance(values, dict) and "num_data_workers" in values:
                found.append((yaml_file, name, values["num_data_workers"]))
    return found


@pytest.mark.parametrize("facts", [TWO_CORES, (2, 24 * GiB, 4), PERLMUTTER_TORCHRUN, PERLMUTTER_SRUN, (4, 8 * GiB, 1)],
                         ids=["2-cores", "2-cores-4-ranks", "perlmutter-torchrun", "perlmutter-srun", "laptop"])
def test_no_config_and_no_documented_count_is_refused(facts):
    """Every config's count, and the counts the README and the original tutorials use (up to 8 a GPU; the ImageNet
    example's 20 on a Perlmutter node), on the machines they run on: this machine, Perlmutter, a 4-core laptop."""
    counts = {count for _, _, count in config_worker_counts()}
    assert counts and max(counts) == 8, counts
    for count in counts:
        check_worker_count(count, facts)
    if facts in (PERLMUTTER_TORCHRUN, PERLMUTTER_SRUN):
        check_worker_count(20, facts)
    with pytest.raises(UserError):
        check_worker_count(1000, facts)


def test_machine_facts_are_this_processs_cpus_memory_and_ranks(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cpus, memory, ranks = machine_facts()
    assert cpus == len(os.sched_getaffinity(0)) and ranks == 1
    assert 0 < memory <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's ranks on this node
    assert machine_facts()[2] == 4


# --- a worker whose training process is gone exits ---

class FakeLibc:
    def __init__(self):
        self.calls = []

    def prctl(self, *args):
        self.calls.append(args)
        return 0


class ExitCalled(Exception):
    pass


@pytest.mark.parametrize("parent_alive", [True, False])
def test_a_worker_asks_for_the_death_signal_and_exits_if_its_parent_is_already_gone(monkeypatch, parent_alive):
    """exit_with_parent's two halves, without a process: prctl(PR_SET_PDEATHSIG, SIGKILL), then a parent that died
    before the call (the worker now has another parent) ends the worker at once; a living parent does not."""
    libc, parent_pid = FakeLibc(), os.getppid() if parent_alive else os.getppid() + 1
    monkeypatch.setattr(common.ctypes, "CDLL", lambda *args, **kwargs: libc)
    monkeypatch.setattr(common.multiprocessing, "parent_process", lambda: type("Parent", (), {"pid": parent_pid}))

    def exit_now(code):
        raise ExitCalled(code)

    monkeypatch.setattr(common.os, "_exit", exit_now)
    if parent_alive:
        common.exit_with_parent()
    else:
        with pytest.raises(ExitCalled):
            common.exit_with_parent()
    assert libc.calls == [(common.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)]


def test_a_dali_worker_asks_for_it_when_it_unpickles_its_source(monkeypatch):
    """DALI's parallel-source workers (spawned) run no worker_init_fn: they unpickle the sampler's source, and ask
    there (SamplerSource.__setstate__)."""
    asked = []
    monkeypatch.setattr(common, "exit_with_parent", lambda: asked.append(True))
    source = common.SamplerSource(common.ResumableSampler(list(range(8)), num_replicas=1, rank=0), 2, 4, 0, 0)
    pickle.loads(pickle.dumps(source))
    assert asked == [True]


# A training process in miniature: the project's PyTorch loader (torch_loader: its worker_init_fn, its worker
# context) with 2 workers over a data set whose every sample takes a minute, as a worker blocked in a read. Each
# worker writes its pid into the folder argv[1] once it is inside __getitem__. argv[2] == "off": the death signal
# switched off (exit_with_parent does nothing), as before the fix.
BLOCKED_LOADER = textwrap.dedent("""
    import os, sys, time
    import torch
    from loaders import common
    from utils.YParams import YParams
    if sys.argv[2] == "off":
        common.exit_with_parent = lambda: None

    class Blocked(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
            time.sleep(60)
            return torch.zeros(1)

    params = YParams("config/ViT.yaml", "tiny")
    params.update({"local_batch_size": 1, "data_num_shards": 1, "data_shard_id": 0, "seed": 0, "num_data_workers": 2})
    loader = common.torch_loader(params, Blocked(), train=True)
    loader.set_epoch(0)
    next(iter(loader))
""")


def running(pid):
    """Whether `pid` is a live process (a zombie, exited but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def workers_after_the_parent_is_killed(tmp_path, death_signal, wait):
    """Start BLOCKED_LOADER, wait until both workers are inside __getitem__, SIGKILL it (as the OOM killer does), and
    return the worker pids still running after up to `wait` seconds (polling; all gone: at once), and the pids."""
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", BLOCKED_LOADER, str(pids_dir), "on" if death_signal else "off"],
                              cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [int(name) for name in os.listdir(pids_dir)]
        assert len(pids) == 2, f"the workers did not start (exit code {parent.poll()})"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + wait
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if running(pid)], pids


def kill_left_over(pids):
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.compat
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_blocked_in_a_read_exit_when_their_training_process_is_killed(tmp_path):
    left, pids = workers_after_the_parent_is_killed(tmp_path, death_signal=True, wait=5)
    try:
        assert left == [], f"loader workers {left} outlived their training process"
    finally:
        kill_left_over(pids)


@pytest.mark.multiprocess
@pytest.mark.compat
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_without_the_death_signal_the_blocked_workers_live_on_as_orphans(tmp_path):
    """Twin: the same workers without the death signal are still running 3 s after their parent died (torch's own
    check of the parent runs only between requests); the cleanup kills them."""
    left, pids = workers_after_the_parent_is_killed(tmp_path, death_signal=False, wait=0)
    try:
        time.sleep(3)
        assert sorted(left) == sorted(pids) and all(running(pid) for pid in pids)
    finally:
        kill_left_over(pids)
