"""The multi-GPU session (benchmarks/gpu_multi.py, `bash benchmarks/gpu_session.sh DIR --multi`) rehearsed on CPU ranks:
its six parts run end to end over gloo and write the JSON README's multi-GPU steps read; the exactness part's
twins miss the tolerance its checks meet; the collectives' bus bandwidth is the performance model's definition, and
is not without the benchmark's bus factors; NCCL's one-rank checks (benchmarks/nccl_one_rank.py) run over gloo, and
their comparison can fail.

A failure points to benchmarks/gpu_multi.py, bench_collectives.py or nccl_one_rank.py, or to what a part runs.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import bench_collectives, gpu_multi
from planning import perf_model
from tests.conftest import REPO_ROOT

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal and rehearsal; a GPU node "
                            "runs the session itself")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """`gpu_session.sh DIR --multi --tiny --allow-cpu` on 4 CPU ranks (about 4 minutes on 2 cores)."""
    out = tmp_path_factory.mktemp("multi")
    env = dict(os.environ, MULTI_WORK=str(out / "work"), PYTHON=sys.executable)
    done = subprocess.run(["bash", "benchmarks/gpu_session.sh", str(out / "report"), "--multi", "--tiny",
                           "--allow-cpu"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    with open(out / "report" / "multi_gpu.json") as f:
        return done, json.load(f), out / "report"


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_the_rehearsal_runs_the_six_parts_and_writes_one_json(rehearsal):
    done, report, folder = rehearsal
    assert done.returncode == 0, done.stdout[-4000:]
    assert list(report["parts"]) == list(gpu_multi.PARTS)
    assert all(part["ok"] for part in report["parts"].values()), json.dumps(report["parts"], indent=1)[:4000]
    assert (report["backend"], report["ranks"], report["gpus"]) == ("gloo", 4, 0)
    assert report["torch"] == torch.__version__ and report["date"] and "cores" in report["machine"]
    assert os.path.exists(folder / "multi.log") and os.path.exists(folder / "logs" / "exact_ddp.log")


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_each_exactness_check_meets_the_tolerance_and_each_twin_misses_it(rehearsal):
    """DDP, tp, cp, tp x cp, sequence parallelism, checkpointing and FSDP within |a - b| <= 1e-5 + 1e-4 |b| of the
    serial run; DDP and cp without their gradient sums (--noddp) far outside it."""
    checks = rehearsal[1]["parts"]["exactness"]["checks"]
    exact = ["ddp", "tp2", "cp2", "tp2_cp2", "tp2_sequence_parallel", "cp2_activation_checkpointing", "fsdp_dp"]
    for name in exact:
        assert checks[name]["excess"] <= 1.0 and checks[name]["within_tolerance"], (name, checks[name])
    for twin in ("ddp_twin_noddp", "cp2_twin_noddp"):
        assert checks[twin]["excess"] > 10 and not checks[twin]["within_tolerance"] and checks[twin]["ok"], checks
    assert "not_on_this_machine" in checks["train_mp_graphs_vs_train_mp"]  # CUDA Graphs: a GPU's


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_the_data_parallel_parts_report_what_the_lessons_show(rehearsal):
    """Samples/s and memory on 1, 2 and 4 ranks with the weak-scaling efficiency; the learning-rate runs' losses
    per epoch; rank 0's DDP profile at two bucket sizes, with the c10d calls as communication, drawn."""
    parts = rehearsal[1]["parts"]
    weak = parts["data_parallel"]["weak"]
    assert [row["ranks"] for row in weak] == [1, 2, 4]
    for row in weak:
        assert row["samples_per_s"] > 0 and row["peak_memory_gb"] > 0, row
        assert row["weak_scaling_efficiency"] == pytest.approx(row["samples_per_s"] / (row["ranks"] *
                                                                                        weak[0]["samples_per_s"]))
    runs = parts["data_parallel"]["learning_rate"]["runs"]
    assert [r["global_batch_size"] for r in runs] == [2, 8, 8] and runs[2]["lr"] == pytest.approx(2 * runs[1]["lr"])
    assert all(len(r["val_loss"]) == 2 for r in runs), runs
    for cap, bucket in parts["dp_profile"]["buckets"].items():
        assert bucket["steps"] >= 1 and bucket["ms_per_step"]["communication"] > 0, (cap, bucket)
        assert os.path.exists(rehearsal[2] / bucket["trace"]) and os.path.exists(bucket["figure"])
        assert "not_on_this_machine" in bucket  # NCCL's kernels: a GPU's


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_the_model_parallel_collective_and_failure_parts(rehearsal):
    """Every layout ran or was refused by its rule in one line (tiny's 2 heads: tp=4 cannot split them), each run
    beside its dry run and the model's prediction; five collectives with a bus bandwidth; a failing rank ended the
    job in seconds with its line alone, a stalled one in the timeout's line."""
    parts = rehearsal[1]["parts"]
    layouts = {(row["tp"], row["cp"]): row for row in parts["model_parallel"]["layouts"]}
    assert sorted(layouts) == [(1, 1), (1, 4), (2, 2), (4, 1)]
    assert layouts[(4, 1)]["refused"].startswith("error: ") and "heads" in layouts[(4, 1)]["refused"]
    for key in ((1, 1), (1, 4), (2, 2)):
        row = layouts[key]
        assert row["samples_per_s"] > 0 and row["dry_run"]["peak_memory_gb"] > 0, row
        assert row["predicted"]["samples_per_s"] > 0 and "prediction" in row["predicted"]["is"], row
        assert any(line.startswith("Scaffolding memory high watermark") for line in row["memory_lines"]), row
    messages = parts["collectives"]["messages"]
    assert len(messages) == len(bench_collectives.MESSAGES) and all(m["bus_bandwidth_gb_s"] > 0 for m in messages)
    for m in messages:  # the bus bandwidth recorded is the algorithm bandwidth times the bus factor of the test below
        wire = bench_collectives.WIRE[m["op"]](parts["collectives"]["ranks"])
        assert m["bus_bandwidth_gb_s"] == pytest.approx(m["bytes"] / m["seconds"] * wire / 1e9), m
    failure = parts["failure"]
    assert failure["error"]["seconds_to_last_exit"] < gpu_multi.ENDS_WITHIN_S
    assert len(failure["error"]["error_lines"]) == 1
    assert "--collective_timeout (3 s)" in failure["stall"]["error_lines"][0]


# the factor each twin takes out of the benchmark's bus factor: an all-reduce's 2 (counted as an all-gather), the
# others' (n - 1) / n (counted as the algorithm bandwidth)
DROPPED = {"all_reduce": lambda n: 2, "all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}


@pytest.mark.parametrize("twin", [False, True], ids=["wire", "twin-without-the-factor"])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_bus_bandwidth_is_the_performance_models_link_speed(op, ranks, twin, monkeypatch):
    """A collective taking exactly the model's time (planning/perf_model.collective_seconds) has, by the benchmark's
    bus factors (bench_collectives.WIRE, which its bus bandwidth multiplies the algorithm bandwidth by), the model's
    bus bandwidth (its link times the network efficiency). Twin: the benchmark's factor without the 2 of an
    all-reduce (counted as an all-gather), or without the (n - 1) / n of an all-gather or reduce-scatter (counted as
    the algorithm bandwidth), misses it."""
    if twin:
        wire = bench_collectives.WIRE[op]
        monkeypatch.setitem(bench_collectives.WIRE, op, lambda n: wire(n) / DROPPED[op](n))
    link, nbytes = 150e9, 100 * 2 ** 20
    seconds = perf_model.collective_seconds(op, nbytes, ranks, link)
    bus = nbytes / seconds * bench_collectives.WIRE[op](ranks)
    assert (bus == pytest.approx(link * perf_model.EFFICIENCY["network"])) is not twin, (bus, twin)


def test_the_comparison_takes_a_difference_beyond_the_tolerance():
    """difference(): within 1e-5 + 1e-4 |b| is an excess at most 1; 1e-3 off a weight of 1 is about 9 times over."""
    weights = {"w": torch.ones(3)}
    close = difference_of(weights, {"w": torch.ones(3) + 5e-5})
    far = difference_of(weights, {"w": torch.tensor([1.0, 1.001, 1.0])})
    assert close["excess"] <= 1.0 and far["excess"] == pytest.approx(1e-3 / 1.1e-4, rel=1e-3)


def difference_of(reference, weights):
    return gpu_multi.difference(({("loss", 1): 0.5}, weights), ({("loss", 1): 0.5}, reference))


@NO_GPU
@pytest.mark.multiprocess
def test_without_a_gpu_the_session_says_so_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_multi", "--out", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: no GPU here"), done.stderr
    assert "Traceback" not in done.stderr


# NCCL's one-rank checks over gloo: the same code; the twin wraps DDP in a model that adds 0.1 to its output
TWIN = """\
import sys
import torch
sys.path.insert(0, {root!r})
import torch.nn.parallel


class Shifted(torch.nn.Module):
    def __init__(self, module, **kwargs):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x) + 0.1


torch.nn.parallel.DistributedDataParallel = Shifted
from benchmarks import nccl_one_rank
sys.exit(nccl_one_rank.main(sys.argv[1:]))
"""


@NO_GPU
@pytest.mark.multiprocess
@pytest.mark.parametrize("twin", [False, True], ids=["checks", "twin-ddp-shifted"])
def test_the_one_rank_checks_run_over_gloo_and_a_wrong_step_fails_them(tmp_path, twin):
    out = tmp_path / "report.json"
    if twin:
        script = tmp_path / "twin.py"
        script.write_text(TWIN.format(root=REPO_ROOT))
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, "-m", "benchmarks.nccl_one_rank"]
    done = subprocess.run(argv + ["--out", str(out), "--allow-cpu"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    report = json.loads(out.read_text())
    assert list(report["checks"]) == ["init", "ddp", "dtensor", "fsdp2", "destroy"], report
    if twin:
        assert done.returncode == 1 and not report["checks"]["ddp"]["ok"] and report["checks"]["fsdp2"]["ok"]
        assert "differs" in report["checks"]["ddp"]["error"]
    else:
        assert done.returncode == 0 and all(c["ok"] for c in report["checks"].values()), report
        assert report["backend"] == "gloo" and report["checks"]["init"]["collective_timeout_s"] == 60


def test_a_new_session_clears_the_last_ones_runs_and_keeps_its_data(tmp_path):
    """Runs left in the work folder would resume their finished checkpoints instead of training (an empty loss curve,
    no trace): a session starts without them, keeping the generated data. Twin: a folder not under `work` stays."""
    work = tmp_path / "work"
    for folder in ("data/era5_tiny", "dp/demo/4GPU/lr_1/checkpoints", "exact"):
        (work / folder).mkdir(parents=True)
    (work / "lr_scaling.yaml").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    gpu_multi.Session(str(tmp_path / "out"), str(work), str(tmp_path / "figures"), 2, 0, "tiny", 60)
    assert sorted(p.name for p in work.iterdir()) == ["data"] and (work / "data" / "era5_tiny").is_dir()
    assert (tmp_path / "elsewhere").is_dir()


CHILD = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("whole_group", [True, False], ids=["group", "twin-leader-only"])
def test_a_command_cut_by_its_deadline_leaves_no_process(tmp_path, monkeypatch, whole_group):
    """A command the part's deadline cuts (torchrun and its ranks) is stopped with its whole process group, its
    children too. Twin: stopping only the command (what subprocess.run's timeout did) leaves its child running."""
    import signal
    import time
    if not whole_group:
        monkeypatch.setattr(gpu_multi, "stop_group", lambda process, grace_s=15: process.kill())
    session = gpu_multi.Session(str(tmp_path / "out"), str(tmp_path / "work"), str(tmp_path / "figures"), 2, 0,
                                "tiny", 60)
    session.deadline = session.elapsed() + 11
    (tmp_path / "child.py").write_text(CHILD)
    with pytest.raises(gpu_multi.OutOfTime):
        session.run("sleeper", [str(tmp_path / "child.py"), str(tmp_path / "pid")])
    child = int((tmp_path / "pid").read_text())
    time.sleep(0.5)
    try:
        os.kill(child, 0)
        alive = open(f"/proc/{child}/stat").read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    if alive:
        os.kill(child, signal.SIGKILL)
    assert alive is not whole_group
