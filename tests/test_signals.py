"""A time limit, a preemption, Ctrl-C: SIGTERM, SIGINT or SIGUSR1 stop a run at the next step boundary with a
checkpoint, the line "stopped by SIGTERM at iteration N; starting again resumes here" and exit code 75
(utils/signals.py), and the run started again ends where an uninterrupted one does, in every TensorBoard point and
in the weights. Real processes: one process, and 2 gloo ranks under torchrun at tp=2 (torchrun forwards SIGTERM to
its ranks; they agree on the step to stop after).

A failure points to utils/signals.py (handlers, the agreement), utils/training.Milestones.stop, finish_run's exit
code, or the checkpoint the loop writes when it stops.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO_ROOT, free_port, run_command, scalar_points

pytestmark = pytest.mark.multiprocess


def points_and_weights(run_dir):
    return scalar_points(run_dir), torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=False)


def assert_same_run(run_dir, reference_dir):
    (points, checkpoint), (expected, reference) = points_and_weights(run_dir), points_and_weights(reference_dir)
    assert checkpoint["iteration"] == reference["iteration"]
    assert points.keys() == expected.keys()
    for tag in expected:
        assert [step for step, _ in points[tag]] == [step for step, _ in expected[tag]], tag
        assert [v for _, v in points[tag]] == pytest.approx([v for _, v in expected[tag]], rel=1e-5, abs=1e-7), tag
    for name, weight in reference["model"].items():
        torch.testing.assert_close(checkpoint["model"][name], weight, rtol=1e-5, atol=1e-7, msg=name)


def start_and_signal(command, log_path, signum, nproc=1):
    """Start `command` (through torchrun when nproc > 1), send `signum` to it as soon as its training loop has
    started, and return (exit code, its output). The runs are long enough for the signal to land mid-run."""
    # the threads run_command gives the same command (another count sums in another order)
    env = dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
               CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would stall the ranks' logging
        process = subprocess.Popen(launcher + command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
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
    assert torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=False)["iteration"] == iteration
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
    assert torch.load(checkpoint, weights_only=False)["iteration"] == iteration < 2000


def test_without_the_handler_a_signal_kills_the_run_without_a_checkpoint(era5_dir, tmp_path):
    """Twin: with the handlers switched off (the loop never learns of the signal) SIGTERM ends the process at once:
    no checkpoint, no line, and not the requeue exit code."""
    code = ("import sys, utils.signals as s; s.install = s.record_from_start = lambda: None; import train; "
            "sys.argv[0] = 'train.py'; train.main(sys.argv[1:])")
    argv = ["-c", code, "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "2000", "--checkpoint_interval",
            "0", "--expdir", str(tmp_path)]
    exit_code, output = start_and_signal(argv, tmp_path / "run.log", signal.SIGTERM)
    assert exit_code == -signal.SIGTERM and "stopped by" not in output
    assert not os.path.exists(os.path.join(str(tmp_path), "tiny", "1GPU", "00", "checkpoints", "ckpt.pt"))


@pytest.mark.compat  # also on the container's torch 2.5
def test_under_torchrun_at_tp2_both_ranks_stop_after_the_same_step_and_resume_exactly(era5_dir, tmp_path):
    argv = ["train_mp.py", "--config", "tiny", "--tensor_parallel", "2", "--data_dir", era5_dir, "--num_iters", "96",
            "--checkpoint_interval", "0"]
    whole = run_command(argv + ["--expdir", str(tmp_path / "whole")], nproc=2)
    assert whole.returncode == 0, whole.stderr[-2000:]
    _, output = start_and_signal(argv + ["--expdir", str(tmp_path / "split")], tmp_path / "split.log",
                                 signal.SIGTERM, nproc=2)
    # torchrun itself ends with its own SignalException; its ranks checkpointed and exited 75
    iteration = stopped_at(output, "SIGTERM")
    assert 0 < iteration < 96
    assert re.search(r"exitcode\s*:\s*75|exit code 75|exitcode: 75", output) or "SignalException" in output
    run_dir = os.path.join(str(tmp_path / "split"), "tiny", "2MP", "00")
    assert torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=False)["iteration"] == iteration
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
    PipelineLoader._restart starts them) that unpickled its sample source lives through SIGUSR1, SIGINT and SIGTERM
    from anyone else, and ends on its parent's SIGTERM (DALI closing a worker that did not exit). Twin: a process
    started plainly, without the source, dies of the first signal."""
    import multiprocessing
    import pickle

    from loaders.common import SamplerSource
    from utils import signals
    source = pickle.dumps(SamplerSource([0, 1, 2, 3], 2, 2, 0, 0))
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
