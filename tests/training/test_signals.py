"""A time limit, a preemption, Ctrl-C: SIGTERM, SIGINT or SIGUSR1 stop a run at the next step boundary with a
checkpoint, the line "stopped by SIGTERM at iteration N; starting again resumes here" and exit code 75
(lifecycle/signals.py), and the run started again ends where an uninterrupted one does, in every TensorBoard point and
in the weights. Real processes: one process, and 2 gloo ranks under torchrun at tp=2 (torchrun forwards SIGTERM to
its ranks; they agree on the step to stop after).

A failure points to lifecycle/signals.py (handlers, the agreement), loop/milestones.Milestones.stop, finish_run's exit
code, or the checkpoint the loop writes when it stops.
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO_ROOT, free_port, run_command, run_plain_ranks, run_ranks, scalar_points

pytestmark = pytest.mark.multiprocess


def points_and_weights(run_dir):
    return scalar_points(run_dir), torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)


def assert_same_run(run_dir, reference_dir):
    (points, checkpoint), (expected, reference) = points_and_weights(run_dir), points_and_weights(reference_dir)
    assert checkpoint["iteration"] == reference["iteration"]
    assert points.keys() == expected.keys()
    for tag in expected:
        assert [step for step, _ in points[tag]] == [step for step, _ in expected[tag]], tag
        assert [v for _, v in points[tag]] == pytest.approx([v for _, v in expected[tag]], rel=1e-5, abs=1e-7), tag
    for name, weight in reference["model"].items():
        torch.testing.assert_close(checkpoint["model"][name], weight, rtol=1e-5, atol=1e-7, msg=name)


def start_command(command, log_path, nproc=1, **popen):
    """`command` started (through torchrun when nproc > 1) on the CPU, its output to `log_path` (a file, not a pipe:
    a full pipe would stall the ranks' logging)."""
    # the threads run_command gives the same command (another count sums in another order)
    env = dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
               CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    with open(log_path, "w") as log:
        return subprocess.Popen(launcher + command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                **popen)


def start_and_signal(command, log_path, signum, nproc=1):
    """Start `command` (through torchrun when nproc > 1), send `signum` to it as soon as its training loop has
    started, and return (exit code, its output). The runs are long enough for the signal to land mid-run."""
    process = start_command(command, log_path, nproc)
    deadline = time.time() + 120
    while "Starting Training Loop" not in log_path.read_text() and time.time() < deadline:
        assert process.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.02)
    process.send_signal(signum)  # within the first steps (a tiny run takes a few ms a step)
    process.wait(timeout=300)
    return process.returncode, log_path.read_text()


def stopped_at(output, name):
    found = re.findall(rf"stopped by {name} at iteration (\d+); starting again resumes here", output)
    assert found, output[-3000:]
    return int(found[0])


@pytest.mark.compat  # also on the container's torch 2.5
@pytest.mark.long
def test_sigterm_checkpoints_exits_75_and_the_restarted_run_equals_an_uninterrupted_one(era5_dir, tmp_path):
    argv = ["train.py", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "400", "--checkpoint_interval",
            "0"]
    whole = run_command(argv + ["--expdir", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr[-2000:]
    code, output = start_and_signal(argv + ["--expdir", str(tmp_path / "split")], tmp_path / "split.log",
                                    signal.SIGTERM)
    assert code == 75, output[-3000:]
    assert "Traceback" not in output
    iteration = stopped_at(output, "SIGTERM")
    run_dir = os.path.join(str(tmp_path / "split"), "tiny", "1GPU", "00")
    assert 0 < iteration < 400
    assert torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)["iteration"] == iteration
    again = run_command(argv + ["--expdir", str(tmp_path / "split")])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"Resumed from {run_dir}/checkpoints/ckpt.pt at iteration {iteration}" in again.stderr
    assert_same_run(run_dir, os.path.join(str(tmp_path / "whole"), "tiny", "1GPU", "00"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_ctrl_c_and_slurms_warning_signal_stop_the_same_way(era5_dir, tmp_path, signum):
    argv = ["train.py", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "2000", "--expdir", str(tmp_path)]
    code, output = start_and_signal(argv, tmp_path / "run.log", signum)
    assert code == 75, output[-3000:]
    iteration = stopped_at(output, signal.Signals(signum).name)
    checkpoint = os.path.join(str(tmp_path), "tiny", "1GPU", "00", "checkpoints", "ckpt.pt")
    assert torch.load(checkpoint, weights_only=True)["iteration"] == iteration < 2000


def test_without_the_handler_a_signal_kills_the_run_without_a_checkpoint(era5_dir, tmp_path):
    """Twin: with the handlers switched off (the loop never learns of the signal) SIGTERM ends the process at once:
    no checkpoint, no line, and not the requeue exit code."""
    code = ("import sys, lifecycle.signals as s; s.install = s.record_from_start = lambda: None; import train; "
            "sys.argv[0] = 'train.py'; train.main(sys.argv[1:])")
    argv = ["-c", code, "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "2000", "--checkpoint_interval",
            "0", "--expdir", str(tmp_path)]
    exit_code, output = start_and_signal(argv, tmp_path / "run.log", signal.SIGTERM)
    assert exit_code == -signal.SIGTERM and "stopped by" not in output
    assert not os.path.exists(os.path.join(str(tmp_path), "tiny", "1GPU", "00", "checkpoints", "ckpt.pt"))


@pytest.mark.compat  # also on the container's torch 2.5
@pytest.mark.long
def test_under_torchrun_at_tp2_both_ranks_stop_after_the_same_step_and_resume_exactly(era5_dir, tmp_path):
    argv = ["train_mp.py", "--config", "tiny", "--tensor_parallel", "2", "--data_dir", era5_dir, "--num_iters", "96",
            "--checkpoint_interval", "0"]
    whole = run_ranks(argv + ["--expdir", str(tmp_path / "whole")], 2)  # plain ranks: this launcher is not under test
    assert whole.returncode == 0, whole.stderr[-2000:]
    _, output = start_and_signal(argv + ["--expdir", str(tmp_path / "split")], tmp_path / "split.log",
                                 signal.SIGTERM, nproc=2)
    # torchrun itself ends with its own SignalException; its ranks checkpointed and exited 75
    iteration = stopped_at(output, "SIGTERM")
    assert 0 < iteration < 96
    assert re.search(r"exitcode\s*:\s*75|exit code 75|exitcode: 75", output) or "SignalException" in output
    run_dir = os.path.join(str(tmp_path / "split"), "tiny", "2MP", "00")
    assert torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)["iteration"] == iteration
    again = run_command(argv + ["--expdir", str(tmp_path / "split")], nproc=2)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_same_run(run_dir, os.path.join(str(tmp_path / "whole"), "tiny", "2MP", "00"))


def _dali_like_worker(source, unpickle, signalled):
    """A process started as DALI starts its workers (spawn); with `unpickle` it unpickles its sample source first.
    It sends itself SIGUSR1, SIGINT and SIGTERM (a sender other than its parent, as Slurm is), then waits."""
    import pickle
    if unpickle:
        pickle.loads(source)
    for signum in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
        os.kill(os.getpid(), signum)
    signalled.set()
    time.sleep(60)


def test_a_dali_worker_ignores_every_stop_signal_but_its_loaders_sigterm():
    """Slurm signals every process of the step, DALI's spawned workers too, and they have none of the training
    process's handlers: a worker started with the signals blocked (signals.workers_start_blocked, as
    PipelineLoader._restart starts them with a run's signals.SIGNAL_PROOF_START) that unpickled its sample source
    lives through SIGUSR1, SIGINT and SIGTERM from anyone else, and ends on its parent's SIGTERM (DALI closing a worker
    that did not exit). Twin: a process started plainly, without the source, dies of the first signal."""
    import multiprocessing
    import pickle

    from lifecycle import signals
    from loaders.common import SamplerSource
    source = pickle.dumps(SamplerSource([0, 1, 2, 3], 2, 2, 0, 0, signals.ignore_in_worker))  # a run's in_worker
    context = multiprocessing.get_context("spawn")
    worker_signalled, twin_signalled = context.Event(), context.Event()
    with signals.workers_start_blocked():
        worker = context.Process(target=_dali_like_worker, args=(source, True, worker_signalled))
        worker.start()
    twin = context.Process(target=_dali_like_worker, args=(source, False, twin_signalled))
    twin.start()
    try:
        assert worker_signalled.wait(60)
        twin.join(60)
        assert twin.exitcode == -signal.SIGUSR1
        time.sleep(0.2)
        assert worker.is_alive()
        worker.terminate()  # SIGTERM from its parent
        worker.join(10)
        assert worker.exitcode == 0
    finally:
        for process in (worker, twin):
            if process.is_alive():
                process.kill()


# --- signals as Slurm sends them: to every process of the job (os.killpg on a session of its own), at any moment ---

def start_in_own_group(command, log_path, nproc=1):
    """Start `command` (through torchrun when nproc > 1) as the leader of a new process group, as a job step is."""
    return start_command(command, log_path, nproc, start_new_session=True)


def children(pid):
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(child) for child in f.read().split()]
    return found


def forked_below(pid, depth):
    """The processes `depth` generations below `pid` that run a training script (ranks: 1 below torchrun; their
    loader workers, forked: 1 below a rank), not the helpers multiprocessing starts."""
    def runs_training(process):
        with contextlib.suppress(OSError), open(f"/proc/{process}/cmdline", "rb") as f:
            return b"train.py" in f.read()
        return False
    level = [pid]
    for _ in range(depth):
        level = [child for process in level for child in children(process) if runs_training(child)]
    return level


def wait_until(process, log_path, condition, what):
    deadline = time.time() + 120
    while not condition():
        assert process.poll() is None and time.time() < deadline, f"{what}: " + log_path.read_text()[-3000:]
        time.sleep(0.01)


@pytest.mark.long
def test_sigterm_to_every_process_with_loader_workers_checkpoints_exits_75_and_resumes_exactly(era5_dir, tmp_path):
    """What scancel, a preemption and the time limit do: SIGTERM to the main process and its two loader workers at
    once. The workers live on (their rank decides), the run stops with a checkpoint and exit 75, and the run started
    again ends where an uninterrupted one does. Before the fix a worker died of it and the main process failed with
    "DataLoader worker (pid N) is killed by signal: Terminated" (exit 1, no checkpoint)."""
    argv = ["train.py", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "80", "--num_data_workers", "2",
            "--checkpoint_interval", "0"]
    whole = start_in_own_group(argv + ["--expdir", str(tmp_path / "whole")], tmp_path / "whole.log")
    log_path = tmp_path / "split.log"
    split = start_in_own_group(argv + ["--expdir", str(tmp_path / "split")], log_path)
    wait_until(split, log_path, lambda: len(forked_below(split.pid, 1)) == 2, "two loader workers")
    os.killpg(split.pid, signal.SIGTERM)
    assert split.wait(timeout=300) == 75, log_path.read_text()[-3000:]
    output = log_path.read_text()
    assert "Traceback" not in output and "killed by signal" not in output
    iteration = stopped_at(output, "SIGTERM")
    run_dir = os.path.join(str(tmp_path / "split"), "tiny", "1GPU", "00")
    assert torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)["iteration"] == iteration
    assert whole.wait(timeout=300) == 0, (tmp_path / "whole.log").read_text()[-3000:]
    again = run_command(argv + ["--expdir", str(tmp_path / "split")])
    assert again.returncode == 0, again.stderr[-2000:]
    assert_same_run(run_dir, os.path.join(str(tmp_path / "whole"), "tiny", "1GPU", "00"))


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGINT])
@pytest.mark.long
def test_slurms_warning_and_ctrl_c_to_every_process_with_loader_workers_stop_with_a_checkpoint(era5_dir, tmp_path,
                                                                                             signum):
    """SIGUSR1 (`--signal=USR1@180`, `scancel -s USR1`) and Ctrl-C in a terminal (the whole foreground group) reach
    the loader workers too: they live on, and the run stops with a checkpoint and exit 75."""
    argv = ["train.py", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "2000", "--num_data_workers", "2",
            "--checkpoint_interval", "0", "--expdir", str(tmp_path)]
    log_path = tmp_path / "run.log"
    process = start_in_own_group(argv, log_path)
    wait_until(process, log_path, lambda: len(forked_below(process.pid, 1)) == 2, "two loader workers")
    os.killpg(process.pid, signum)
    assert process.wait(timeout=300) == 75, log_path.read_text()[-3000:]
    output = log_path.read_text()
    assert "Traceback" not in output
    iteration = stopped_at(output, signal.Signals(signum).name)
    checkpoint = os.path.join(str(tmp_path), "tiny", "1GPU", "00", "checkpoints", "ckpt.pt")
    assert torch.load(checkpoint, weights_only=True)["iteration"] == iteration


@pytest.mark.compat  # also on the container's torch 2.5
@pytest.mark.long
def test_sigterm_to_torchrun_its_ranks_and_their_workers_stops_every_rank_with_a_checkpoint(era5_dir, tmp_path):
    """torchrun with DDP, one loader worker per rank, and SIGTERM to all five processes (srun signals every rank's
    processes the same way): both ranks stop after the same step, with a checkpoint, and exit 75."""
    argv = ["train.py", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "2000", "--num_data_workers", "1",
            "--checkpoint_interval", "0", "--expdir", str(tmp_path)]
    log_path = tmp_path / "run.log"
    process = start_in_own_group(argv, log_path, nproc=2)
    wait_until(process, log_path, lambda: len(forked_below(process.pid, 2)) == 2, "two ranks' workers")
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=300)
    output = log_path.read_text()
    iteration = stopped_at(output, "SIGTERM")
    assert "killed by signal" not in output and "DataLoader worker" not in output, output[-3000:]
    assert re.search(r"exitcode\s*:\s*75|exit code 75", output) or "SignalException" in output, output[-3000:]
    checkpoint = os.path.join(str(tmp_path), "tiny", "2GPU", "00", "checkpoints", "ckpt.pt")
    assert torch.load(checkpoint, weights_only=True)["iteration"] == iteration


def handles(pid, signum):
    """Whether process `pid` has a handler of its own for `signum` (/proc's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (signum - 1) & 1)


def imports_argv(era5_dir, tmp_path):
    """A tiny run of 20 iterations: without a signal it trains and ends with 0."""
    return ["train.py", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "20", "--expdir", str(tmp_path)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_signal_while_torch_imports_stops_in_one_line_with_75_and_no_checkpoint(era5_dir, tmp_path, signum):
    """The signal reaches the process as soon as its first line (lifecycle/early_signals.py) has run, i.e. while torch
    imports: it is recorded, and the run stops at the end of start_run in one line, exit 75, no checkpoint. Before:
    SIGUSR1 exit 138 with nothing said, SIGTERM 143, SIGINT a traceback."""
    log_path = tmp_path / "run.log"
    process = start_in_own_group(imports_argv(era5_dir, tmp_path), log_path)
    wait_until(process, log_path, lambda: handles(process.pid, signal.SIGUSR1), "the first line")
    os.killpg(process.pid, signum)
    assert process.wait(timeout=120) == 75, log_path.read_text()[-3000:]
    output = log_path.read_text()
    assert "Traceback" not in output, output
    name = signal.Signals(signum).name
    assert f"stopped by {name} during start-up, before the first step; no checkpoint was written (this start " \
           "wrote only run.lock, out.log and logs/ in" in output
    assert not os.path.exists(os.path.join(str(tmp_path), "tiny", "1GPU", "00", "checkpoints"))


FIRST_LINE_RAN = "early_signals called record_from_start(program=True)"  # the twin's marker


def test_without_the_first_line_a_signal_during_the_imports_kills_the_run_silently(era5_dir, tmp_path):
    """Twin of the test above: the same train.py run as the program (runpy, as `python train.py` runs it), its first
    line (lifecycle/early_signals.py) reached but its handlers switched off: signals.record_from_start replaced by a
    print of a marker. SIGUSR1, sent once the marker is out (the point the test above waits for: the first line has
    run, torch's import is next), ends the process at once with SIGUSR1's status (138 in a shell), which the submit
    scripts do not requeue, and nothing said after the marker. The marker also shows the first line took the script
    for the program, so that the handlers were the only thing switched off."""
    log_path = tmp_path / "run.log"
    code = ("import runpy, sys; import lifecycle.signals as s; "
            f"s.record_from_start = lambda program=False: print({FIRST_LINE_RAN!r} if program else 'not the program',"
            f" flush=True); sys.argv = {imports_argv(era5_dir, tmp_path)!r}; "
            "runpy.run_path('train.py', run_name='__main__')")
    process = start_in_own_group(["-c", code], log_path)
    wait_until(process, log_path, lambda: FIRST_LINE_RAN in log_path.read_text(), "the first line")
    os.killpg(process.pid, signal.SIGUSR1)
    assert process.wait(timeout=120) == -signal.SIGUSR1, log_path.read_text()[-3000:]
    assert log_path.read_text() == FIRST_LINE_RAN + "\n"


@pytest.mark.long
def test_a_second_ctrl_c_stops_at_once_in_one_line(era5_dir, tmp_path):
    """Two SIGINTs: the second, before the stop's checkpoint is written (the run held there, as a slow write would),
    stops at once (KeyboardInterrupt, SIGINT's status), said in one line. (After the checkpoint it is ignored:
    test_a_second_ctrl_c_after_the_stop_s_checkpoint_is_ignored_and_the_run_exits_75.)"""
    from lifecycle.signals import INTERRUPTED
    process, log_path, _ = start_late(tmp_path, era5_dir, "save", 2000)
    # after steps (the first epoch's line): a stop at iteration 0 has nothing to save, so no checkpoint and no hold
    # there (a signal sent at "Starting Training Loop" reached a loaded machine's run before its first step)
    wait_until(process, log_path, lambda: "Time taken for epoch 1" in log_path.read_text(), "the first epoch")
    process.send_signal(signal.SIGINT)
    wait_until(process, log_path, lambda: "HOLD save" in log_path.read_text(), "the stop's checkpoint")
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=120)
    output = log_path.read_text()
    assert code == -signal.SIGINT, (code, output[-3000:])
    assert "Traceback" not in output and output.count(INTERRUPTED) == 1, output[-3000:]


@pytest.mark.long
def test_a_mistake_every_rank_finds_is_printed_once(era5_dir, tmp_path):
    """Two ranks find the same bad flag value: rank 0 alone prints it, and both exit non-zero. Before, each rank
    printed it (N ranks, N lines). (Plain ranks: each one's exit code; the launcher is not under test.)"""
    codes, outputs, _ = run_plain_ranks([sys.executable, "train.py", "--config", "tiny", "--data_dir", era5_dir,
                                         "--stop_at_iter", "0", "--expdir", str(tmp_path)], 2, tmp_path, 300)
    output = "".join(outputs)
    assert all(code != 0 for code in codes), (codes, output[-3000:])
    assert output.count("error: --stop_at_iter is 0") == 1, output[-3000:]


@pytest.mark.parametrize("rank, error, printed", [
    ("1", "UserError", ""),  # every rank finds it: rank 0 prints it
    ("0", "UserError", "error: the same on every rank\n"),
    ("1", "OneRankError", "error: rank 1: only this rank's node\n"),  # else nobody would say why the job hangs
])
def test_who_prints_a_mistake(monkeypatch, capsys, rank, error, printed):
    """A UserError is printed by rank 0 alone; a OneRankError (its node's GPU or shared memory, a sample of its
    shard) by the rank that found it, named, since rank 0 may not have found it. Every rank exits with code 2."""
    from resilience import exits
    from utils import errors
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = "the same on every rank" if error == "UserError" else "only this rank's node"

    @exits.exit_on_user_error
    def main():
        raise getattr(errors, error)(message)

    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and capsys.readouterr().err == printed


ORPHAN_SCRIPT = """\
import sys
sys.path.insert(0, {root!r})
import lifecycle.signals
import train
import resilience.watch
if {switched_off}:
    lifecycle.signals.launcher_gone = lambda: False
if {unsaid}:  # the stop still noticed, but the job's lines take the agent's store for alive
    resilience.watch.launcher_gone = lambda: False
train.main(sys.argv[1:])
"""


def ranks_of(marker):
    """The pids of the processes whose command line holds `marker` (the run's own --expdir)."""
    from benchmarks.stress_exit import processes_with
    return processes_with(marker)


def start_orphan_job(era5_dir, tmp_path, expdir, **switches):
    """torchrun (in a session of its own) with 2 ranks of ORPHAN_SCRIPT training tiny for good: (its process, the
    log file of its console)."""
    script = tmp_path / "rank.py"
    script.write_text(ORPHAN_SCRIPT.format(root=REPO_ROOT, **switches))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                     "--master_port", str(free_port()), str(script), "--config", "tiny",
                                     "--data_dir", era5_dir, "--num_iters", "100000", "--checkpoint_interval", "0",
                                     "--num_data_workers", "0", "--expdir", expdir], cwd=REPO_ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return launcher, log_path


def training_ranks(launcher, log_path, expdir):
    """The pids of the job's 2 ranks, once they train."""
    deadline = time.time() + 180
    while "Starting Training Loop" not in log_path.read_text() and time.time() < deadline:
        assert launcher.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.1)
    ranks = [pid for pid in ranks_of(expdir) if pid != launcher.pid]
    assert len(ranks) == 2, ranks
    return ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("switched_off", [False, True])
@pytest.mark.long
def test_ranks_whose_torchrun_died_of_sigusr1_stop_with_a_checkpoint(era5_dir, tmp_path, switched_off):
    """Slurm's warning signal to a step run by torchrun: torchrun does not forward SIGUSR1 and dies of it, while its
    two ranks, each in a session of its own, never hear of it. Each rank notices its launcher is gone at the next
    step boundary and stops as if signalled: a checkpoint, `stopped by its launcher's death`, the run lock released.
    Twin, with that check switched off: the orphaned ranks train on (still running well after torchrun died)."""
    expdir = str(tmp_path / f"orphans_{switched_off}")
    launcher, log_path = start_orphan_job(era5_dir, tmp_path, expdir, switched_off=switched_off, unsaid=False)
    try:
        ranks = training_ranks(launcher, log_path, expdir)
        launcher.send_signal(signal.SIGUSR1)
        assert launcher.wait(timeout=30) == -signal.SIGUSR1  # torchrun's fate: no handler for it
        deadline = time.time() + (15 if switched_off else 120)
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.time() < deadline:
            time.sleep(0.2)
        running = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
        output = log_path.read_text()
        if switched_off:
            assert len(running) == 2 and "stopped by" not in output, output[-3000:]
            return
        assert not running, output[-3000:]
        iteration = stopped_at(output, "its launcher's death")
        assert "the launcher (process" in output and "Traceback" not in output, output[-3000:]
        checkpoint = os.path.join(expdir, "tiny", "2GPU", "00", "checkpoints", "ckpt.pt")
        assert torch.load(checkpoint, weights_only=True)["iteration"] == iteration
    finally:
        for pid in ranks_of(expdir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("said", [True, False], ids=["said", "twin_unsaid"])
@pytest.mark.long
def test_torchrun_killed_with_its_process_group_is_said_as_the_launchers_death(era5_dir, tmp_path, said):
    """SIGKILL to torchrun's process group (its ranks, in sessions of their own, live on): the ranks stop at the
    next step with a checkpoint, the first rank of the node says once that the launcher is gone, and no rank asks
    the rendezvous store torchrun's agent held (a question to it prints a C++ stack of torch's) or blames another
    rank. Twin, the launcher's death not known to the job's lines: the ranks ask that store, find it gone and blame
    another rank ("stopped answering ... killed, out of memory"), with torch's C++ stack."""
    expdir = str(tmp_path / "orphans")
    launcher, log_path = start_orphan_job(era5_dir, tmp_path, expdir, switched_off=False, unsaid=not said)
    try:
        ranks = training_ranks(launcher, log_path, expdir)
        time.sleep(1.0)
        os.killpg(launcher.pid, signal.SIGKILL)
        assert launcher.wait(timeout=30) == -signal.SIGKILL
        deadline = time.time() + 120
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.time() < deadline:
            time.sleep(0.2)
        output = log_path.read_text()
        assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")], output[-3000:]
        iteration = stopped_at(output, "its launcher's death")
        checkpoint = os.path.join(expdir, "tiny", "2GPU", "00", "checkpoints", "ckpt.pt")
        assert torch.load(checkpoint, weights_only=True)["iteration"] == iteration
        assert output.count(f"the launcher (process {launcher.pid}) is gone: stopping after this step") == 1, \
            output[-3000:]
        if said:
            assert "stopped answering" not in output and "TCPStore.cpp" not in output and "frame #" not in output \
                and "Traceback" not in output, output[-3000:]
        else:
            assert "stopped answering in a collective" in output and "TCPStore.cpp" in output, output[-3000:]
    finally:
        for pid in ranks_of(expdir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


LATE_SCRIPT = """\
import atexit, ctypes, os, sys, time
sys.path.insert(0, {root!r})
sys.modules["__main__"].__file__ = "train.py"  # a training script's own process: lifecycle/early_signals.py acts
import train
from lifecycle import signals
from utils import comm
hold, go = {hold!r}, {go!r}


def hold_here(where):
    print(f"HOLD {{where}}", flush=True)
    deadline = time.time() + 60
    while not os.path.exists(go + where) and time.time() < deadline:
        time.sleep(0.02)
    print(f"RELEASED {{where}}", flush=True)  # by the test's file or the deadline: the process goes on from here


def stuck():  # the main thread waits in C without the GIL, as in a process group's teardown, and never returns
    libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)
    lock = libc.pthread_mutex_lock
    lock(mutex)
    print("HOLD destroy", flush=True)
    lock(mutex)


if {ending_off}:
    signals.ending = lambda *args, **kwargs: None
if {thread_off}:
    signals._exit_on_a_signal_in_any_thread = lambda: None
if "save" in hold:  # before a checkpoint is written
    save = train.save
    train.save = lambda *args: (hold_here("save"), save(*args))[1]
if "finish" in hold:  # after the stop's checkpoint, before the run's last lines
    finish_run = train.finish_run
    train.finish_run = lambda run: (hold_here("finish"), finish_run(run))
if "destroy" in hold:
    comm.destroy = stuck
if "exit" in hold:  # the interpreter's end, after main() and its cleanups
    atexit.register(hold_here, "exit")
train.main(sys.argv[1:])
"""
LATE_LINE = "{} came after the run's end: ignored; the process exits now with the run's exit code {}"


def start_late(tmp_path, era5_dir, hold, iters, ending_off=False, thread_off=False):
    """train.py (its own process, the late signals' handling on or off) held where `hold` says until the file
    `go` + the place exists. Returns (process, log path, go)."""
    script, go = tmp_path / "late.py", str(tmp_path / "go_")
    script.write_text(LATE_SCRIPT.format(root=REPO_ROOT, hold=hold, go=go, ending_off=ending_off,
                                         thread_off=thread_off))
    log_path = tmp_path / "run.log"
    process = start_command([str(script), "--config", "tiny", "--data_dir", era5_dir, "--num_iters", str(iters),
                             "--checkpoint_interval", "0", "--expdir", str(tmp_path / "runs")], log_path)
    return process, log_path, go


@pytest.mark.parametrize("switched_off", [False, True])
@pytest.mark.long
def test_a_signal_after_a_finished_run_s_last_line_ends_it_at_once_with_0_and_one_line(era5_dir, tmp_path,
                                                                                        switched_off):
    """SIGTERM while a finished run ends (after DONE, its cleanups done, the interpreter ending: held here for up
    to a minute) ends the process at once with the run's own exit code 0 and one line. Twin, without
    signals.ending: the handlers put back at the end are the defaults, and SIGTERM's status (143) says the run
    failed."""
    process, log_path, _ = start_late(tmp_path, era5_dir, "exit", 4, ending_off=switched_off)
    wait_until(process, log_path, lambda: "HOLD exit" in log_path.read_text(), "the interpreter's end")
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=120)
    output = log_path.read_text()
    assert "DONE ---- rank 0" in output and "Traceback" not in output, output[-3000:]
    if switched_off:
        assert code == -signal.SIGTERM and "came after" not in output, (code, output[-3000:])
        return
    # "at once", against the run's own events rather than a clock: the process ended while still held, so the
    # signal ended it, not the hold's end (a minute later, when a run would then exit 0 by itself); a slower machine
    # fails this only if a minute passes between the signal and the exit
    assert code == 0 and "RELEASED exit" not in output, (code, output[-3000:])
    assert output.count(LATE_LINE.format("SIGTERM", 0)) == 1, output[-3000:]


@pytest.mark.parametrize("switched_off", [False, True])
@pytest.mark.long
def test_a_second_ctrl_c_after_the_stop_s_checkpoint_is_ignored_and_the_run_exits_75(era5_dir, tmp_path,
                                                                                     switched_off):
    """Ctrl-C stops a run with a checkpoint; a second Ctrl-C after that checkpoint (the run held before its last
    lines) is ignored in one line, and the run goes on to DONE; SIGTERM once it ends exits at once with 75, the
    stop's own code (the submit scripts requeue on it), in one line. Twin, without signals.ending: the second
    Ctrl-C interrupts with 'stopped at once, without a checkpoint' (untrue) and SIGINT's status (130)."""
    from lifecycle import signals
    process, log_path, go = start_late(tmp_path, era5_dir, "finish exit", 2000, ending_off=switched_off)
    # after steps (the first epoch's line): a stop at iteration 0 has nothing to save, so no checkpoint and no hold
    # there (a signal sent at "Starting Training Loop" reached a loaded machine's run before its first step)
    wait_until(process, log_path, lambda: "Time taken for epoch 1" in log_path.read_text(), "the first epoch")
    process.send_signal(signal.SIGINT)
    wait_until(process, log_path, lambda: "HOLD finish" in log_path.read_text(), "the stop's checkpoint")
    assert "Checkpoint of iteration" in log_path.read_text()
    process.send_signal(signal.SIGINT)
    if switched_off:
        open(go + "exit", "w").close()  # the interrupted process still runs its atexit hold: let it pass
        code = process.wait(timeout=120)
        output = log_path.read_text()
        assert code == -signal.SIGINT and output.count(signals.INTERRUPTED) == 1, (code, output[-3000:])
        return
    ignored = "SIGINT came after the stop's checkpoint: ignored; the run ends as it was ending, with exit code 75"
    wait_until(process, log_path, lambda: ignored in log_path.read_text(), "the ignored second Ctrl-C")
    open(go + "finish", "w").close()
    wait_until(process, log_path, lambda: "HOLD exit" in log_path.read_text(), "the interpreter's end")
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=120)
    output = log_path.read_text()
    assert code == signals.EXIT_CODE and "DONE ---- rank 0" in output, (code, output[-3000:])
    stopped_at(output, "SIGINT")
    assert output.count(ignored) == 1 and output.count(LATE_LINE.format("SIGTERM", 75)) == 1, output[-3000:]
    assert signals.INTERRUPTED not in output and "Traceback" not in output, output[-3000:]


@pytest.mark.compat  # on the container's torch 2.5 the teardown is where a finished run waited
@pytest.mark.parametrize("switched_off", [False, True])
@pytest.mark.long
def test_a_signal_while_the_main_thread_waits_in_the_teardown_ends_the_run_at_once(era5_dir, tmp_path, switched_off):
    """After DONE the main thread waits in C without the GIL (held here for good, as a process group's teardown
    could), where a Python handler never runs: the signal still ends the process at once, with 0 and the one line
    (a thread reads it from signal.set_wakeup_fd's pipe). Twin, without that thread: the process lives on, deaf to
    SIGTERM."""
    process, log_path, _ = start_late(tmp_path, era5_dir, "destroy", 4, thread_off=switched_off)
    try:
        wait_until(process, log_path, lambda: "HOLD destroy" in log_path.read_text(), "the teardown")
        time.sleep(0.5)  # in C by now: a signal in the last bytecodes after the print would meet the Python handler
        process.send_signal(signal.SIGTERM)
        if switched_off:
            with pytest.raises(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            assert "came after" not in log_path.read_text()
            return
        code = process.wait(timeout=30)
        output = log_path.read_text()
        assert code == 0 and output.count(LATE_LINE.format("SIGTERM", 0)) == 1, (code, output[-3000:])
    finally:
        process.kill()
        process.wait()
