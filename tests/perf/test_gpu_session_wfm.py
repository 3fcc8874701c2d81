""""One GPU, many ranks" (`bash benchmarks/gpu_session.sh DIR --wfm`, benchmarks/gpu_wfm.py, issue #59 item 7) rehearsed
on the CPU: its four parts run end to end and write the JSON a GPU session will be read by: the dry runs of the
0.25-degree family's step (each --cp_method at cp=2), of a patch-4 layout's rank and of each pipeline stage (the
heaviest named); two ranks over gloo, the backend named and why, each collective's probe, DDP, tp=2, cp=2 by each
method and pp=2 within the tolerance of the serial run and the twin (cp=2 without its gradient sums) far outside it.
Beside it: which backend a GPU's NCCL gets (2.30 is the first that takes several ranks on one GPU); the probe checks
each collective's values (twin: an all-reduce one off); on gloo with CUDA tensors the ring and the pipeline, and only
they, cannot run, and say why; a backend that cannot join hands over to the next; a process that dies during a run
leaves that run an error naming its exit code, and the runs after it still run, in a new process (twin: without the
new process they are not reached); Ctrl-C stops every process and marks the report (twin: without the handler the
ranks outlive it); without a GPU, one line.

A failure points to benchmarks/gpu_wfm.py or the --wfm block of benchmarks/gpu_session.sh, or to what a part runs
(train_mp.py --dry_run, --cp_method).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from benchmarks import gpu_wfm
from tests.conftest import REPO_ROOT
from tests.perf.test_gpu_session_stops import SCRIPT, ctrl_c, kill_all, marked, start, survivors, wait_until

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's rehearsal and refusal; a GPU node "
                            "runs the session itself")
CHECKS = ["cp2_allgather", "cp2_alltoall", "cp2_ring", "cp2_twin_noddp", "ddp", "pp2", "tp2"]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """`gpu_session.sh DIR --wfm --tiny --allow-cpu` (about 45 s on 2 cores)."""
    out = tmp_path_factory.mktemp("wfm")
    env = dict(os.environ, WFM_WORK=str(out / "work"), PYTHON=sys.executable)
    began = time.monotonic()
    done = subprocess.run(["bash", "benchmarks/gpu_session.sh", str(out / "report"), "--wfm", "--tiny", "--allow-cpu"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    with open(out / "report" / "wfm_one_gpu.json") as f:
        return done, json.load(f), out / "report", time.monotonic() - began


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_the_rehearsal_runs_the_three_parts_into_one_json(rehearsal):
    done, report, folder, seconds = rehearsal
    assert done.returncode == 0, done.stdout[-4000:]
    assert list(report["parts"]) == list(gpu_wfm.PARTS) and report["status"] == "done"
    assert all(part["ok"] for part in report["parts"].values()), json.dumps(report["parts"], indent=1)[:4000]
    assert (report["gpus"], report["mode"], report["nccl"], report["budget_s"]) == (0, "tiny", None, 540)
    assert report["torch"] == torch.__version__ and report["date"] and "cores" in report["machine"]
    assert report["made_by"].startswith("bash benchmarks/gpu_session.sh DIR --wfm --tiny --allow-cpu")
    assert report["seconds"] < 0.5 * report["budget_s"] and seconds < 300  # well within the deadlines
    assert (folder / "wfm.log").exists() and (folder / "logs" / "ranks_rank0.log").exists()


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_the_kernels_time_each_method_and_the_patch4_rank_is_measured(rehearsal):
    """The step at cp=1 (wfm_tiny at its batch, and at batch 1 standing for wfm_p8), then rank 0 at cp=2 by each
    method; rank 0 of tp=2 x cp=4 standing for wfm_1b_p4's tp=4 x cp=4: each with its step time, memory and the
    performance model's memory beside it."""
    parts = rehearsal[1]["parts"]
    runs = parts["kernels"]["runs"]
    assert [(r["config"], r["tp"], r["cp"]) for r in runs] == [("wfm_tiny", 1, 1)] * 2 + [("wfm_tiny", 1, 2)] * 3
    assert [r["flags"].split("--cp_method ")[-1] for r in runs[2:]] == list(gpu_wfm.METHODS)
    patch4 = parts["patch4"]["run"]
    assert (patch4["tp"], patch4["cp"]) == (2, 4) and "wfm_1b_p4 at tp=4 x cp=4" in parts["patch4"]["stands_for"]
    for row in [*runs, patch4]:
        assert row["ok"] and row["step_time_s"] > 0 and row["peak_memory_gb"] > 0, row
        assert row["predicted"]["parameters"] == row["parameters"] and row["device"] == "cpu", row
    assert runs[0]["local_batch_size"] == 8 and runs[1]["local_batch_size"] == 1
    assert patch4["parameters"] < runs[1]["parameters"]  # tp=2 holds half of each block's weights


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_the_stages_part_measures_each_stage_and_names_the_heaviest(rehearsal):
    """Rank 0 of each of the two stages (wfm_tiny at tp=2 x cp=2 x pp=2 standing for wfm_10b_p2's layout): each
    stage's memory equal to the performance model's within 10%, 1F1B's P - s microbatches held, and the heaviest
    stage (the first: the embeddings, two microbatches in flight) named by both."""
    stages = rehearsal[1]["parts"]["stages"]
    assert stages["ok"] and "wfm_10b_p2 at tp=8 x cp=8 x dp=2 x pp=2" in stages["stands_for"]
    for stage, row in enumerate(stages["runs"]):
        assert (row["stage"], row["pipeline_stage"], row["microbatches_in_flight"]) == (stage, stage, 2 - stage)
        assert row["peak_memory_gb"] == pytest.approx(row["predicted"]["peak_memory_gb"], rel=0.10), row
        assert row["checkpoint_save"]["format"] == "serial" and row["checkpoint_save"]["host_bytes"] > 0
    assert stages["heaviest"]["measured"] == stages["heaviest"]["predicted"] == 0, stages["heaviest"]


def test_the_heaviest_stage_is_the_one_with_the_largest_peak():
    rows = [{"stage": 0, "ok": True, "peak_memory_gb": 2.0, "predicted": {"peak_memory_gb": 1.0}},
            {"stage": 1, "ok": True, "peak_memory_gb": 1.5, "predicted": {"peak_memory_gb": 3.0}}]
    assert gpu_wfm.heaviest_stage(rows) == {"measured": 0, "predicted": 1, "peak_memory_gb": 2.0,
                                            "predicted_peak_memory_gb": 1.0}
    assert gpu_wfm.heaviest_stage([{**rows[0], "ok": False}, rows[1]]) is None  # a run cut short names none


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_the_ranks_say_their_backend_and_each_check_meets_the_tolerance(rehearsal):
    """Gloo on CPU tensors, every collective probed ran (send/recv too: the ring and the pipeline run here); DDP, tp=2,
    cp=2 by each method and pp=2 (two stages) within |a - b| <= 1e-5 + 1e-4 |b| of the serial run after 10 steps,
    the twin far outside it."""
    ranks = rehearsal[1]["parts"]["ranks"]
    assert (ranks["backend"], ranks["tensors_on"], ranks["ranks"], ranks["backends_tried"]) == ("gloo", "cpu", 2,
                                                                                                 ["gloo"])
    assert ranks["backend_why"].startswith("no GPU") and ranks["tf32"] == "off" and ranks["iterations"] == 10
    assert ranks["collectives"] == {op: {"ok": True} for op in ("all_reduce", "broadcast", "all_gather",
                                                                "all_to_all_single", "send_recv")}
    assert ranks["ran"] == CHECKS and ranks["could_not_run"] == {} and ranks["serial"]["ok"]
    for name in CHECKS:
        check = ranks["checks"][name]
        if name == "cp2_twin_noddp":
            assert check["excess"] > 10 and not check["within_tolerance"] and check["ok"], check
        else:
            assert check["excess"] <= 1.0 and check["within_tolerance"] and check["ok"], (name, check)


@pytest.mark.parametrize("gpus, nccl, backends, words", [
    (0, None, ["gloo"], "no GPU"),
    (1, None, ["gloo"], "no NCCL"),
    (1, (2, 27, 5), ["gloo"], "NCCL 2.27.5 is older than 2.30"),
    (1, (2, 29, 9), ["gloo"], "NCCL 2.29.9 is older than 2.30"),
    (1, (2, 30, 0), ["nccl", "gloo"], "NCCL_MULTI_RANK_GPU_ENABLE=1"),
    (1, (3, 0, 1), ["nccl", "gloo"], "NCCL 3.0.1 takes several ranks on one GPU")])
def test_nccl_from_2_30_takes_the_ranks_else_gloo(gpus, nccl, backends, words):
    got, why = gpu_wfm.choose_backend(gpus, nccl)
    assert got == backends and words in why, why


def bare_runner(collectives, backend="gloo"):
    runner = object.__new__(gpu_wfm.Runner)
    runner.backend, runner.collectives = backend, collectives
    return runner


@pytest.mark.parametrize("send_recv", [False, True], ids=["gloo-cuda", "twin-send-recv-runs"])
def test_on_gloo_with_cuda_tensors_only_the_ring_and_the_pipeline_cannot_run_and_say_why(send_recv, tmp_path):
    """The probe on gloo with CUDA tensors does not try send/recv (FACTS I5); the ring and the pipeline alone need
    it: they are not run, each reason naming send_recv and why. Twin: where send/recv ran, every check runs."""
    collectives = {op: {"ok": True} for op in ("all_reduce", "broadcast", "all_gather", "all_to_all_single")}
    collectives["send_recv"] = {"ok": True} if send_recv else {"ok": False, "why": gpu_wfm.GLOO_CUDA_SEND_RECV}
    runner = bare_runner(collectives)
    refused = {item["name"]: runner.cannot_run(item) for item in gpu_wfm.rank_items(str(tmp_path), str(tmp_path))}
    refused = {name: why for name, why in refused.items() if why}
    if send_recv:
        assert refused == {}
    else:
        assert list(refused) == ["cp2_ring", "pp2"], refused
        for name in refused:
            assert refused[name].startswith("needs send_recv, which gloo did not run here") and "FACTS I5" in refused[
                name], name


@pytest.mark.parametrize("wrong", [False, True], ids=["right-values", "twin-all-reduce-off-by-one"])
def test_the_probe_checks_each_collectives_values(monkeypatch, wrong):
    """Rank 0 of 2, each collective stood in for by what the other rank would make of it: every one ok, send/recv
    too on CPU tensors. Twin: an all-reduce one off is 'a wrong result', the others still ok."""
    import torch.distributed as dist
    fakes = {"all_reduce": lambda x: x.fill_(3 + wrong), "broadcast": lambda x, src: x.fill_(5),
             "all_gather": lambda pieces, x: [piece.fill_(r) for r, piece in enumerate(pieces)],
             "all_to_all_single": lambda got, send, out_splits, in_splits: got.copy_(torch.tensor([0.0, 10.0])),
             "batch_isend_irecv": lambda ops: [ops[1].tensor.fill_(1)][:0]}
    for name, fake in fakes.items():
        monkeypatch.setattr(dist, name, fake)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer: type("Op", (), {"tensor": tensor}))
    found = gpu_wfm.probe_collectives("gloo", torch.device("cpu"), 0, 2)
    assert list(found) == ["all_reduce", "broadcast", "all_gather", "all_to_all_single", "send_recv"]
    assert found.pop("all_reduce") == ({"ok": False, "error": "a wrong result"} if wrong else {"ok": True})
    assert all(outcome == {"ok": True} for outcome in found.values()), found


def test_without_a_backend_no_check_runs(tmp_path):
    runner = bare_runner({}, backend=None)
    for item in gpu_wfm.rank_items(str(tmp_path), str(tmp_path))[2:]:
        assert runner.cannot_run(item) == "no backend passed the probe"


def test_a_run_one_rank_did_not_end_is_an_error_naming_that_rank():
    """Rank 0 ended the run, rank 1's process died in it: not ok, the exit code and rank 1's error line."""
    entries = [{"ok": True, "seconds": 2.0}, {"started": 1.0}]
    merged = gpu_wfm.merge_ranks(entries, ["", "x\nRuntimeError: boom\n"], [1, -9])
    assert merged == {"ok": False, "seconds": 2.0,
                      "error": "rank 1's process ended during it (exit code -9): RuntimeError: boom"}
    assert gpu_wfm.merge_ranks([{"ok": True}, {"ok": True}], ["", ""], [0, 0]) == {"ok": True}


@NO_GPU
@pytest.mark.multiprocess
def test_without_a_gpu_the_session_says_so_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_wfm", "--out", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: no GPU here"), done.stderr
    assert "Traceback" not in done.stderr


def session(tmp_path):
    return gpu_wfm.Session(str(tmp_path / "out"), str(tmp_path / "work"), 300, 0)


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_a_backend_that_cannot_join_hands_over_to_the_next(tmp_path):
    """NCCL first, as on a GPU whose NCCL is 2.30 or newer: on CPUs it cannot join, so gloo runs the ranks, and the
    probe says what NCCL said."""
    s = session(tmp_path)
    results = s.launch("probe", [{"name": "probe", "part": "ranks", "kind": "probe"}], 2, 120, ["nccl", "gloo"])
    probe = results["probe"]
    assert probe["ok"] and probe["backend"] == "gloo" and list(probe["backends_failed"]) == ["nccl"], probe
    assert all(c["ok"] for c in probe["collectives"].values()), probe


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("attempts", [3, 1], ids=["started-again", "twin-one-process-only"])
def test_a_process_killed_during_a_run_leaves_the_runs_after_it_to_a_new_one(tmp_path, monkeypatch, attempts):
    """The one-GPU process SIGKILLed during its first run (the serial wfm_tiny run, long enough to be caught): that
    run is an error naming exit code -9; the dry run after it runs in a second process. Twin: with one process
    only, the dry run is not reached."""
    from sample_data import write_era5
    monkeypatch.setattr(gpu_wfm, "MAX_ATTEMPTS", attempts)
    data = tmp_path / "data"
    write_era5(data, verbose=False, **gpu_wfm.WFM_TINY_DATA)
    serial = gpu_wfm.rank_items(str(data), str(tmp_path / "runs"))[0]
    serial["argv"][serial["argv"].index("--num_iters") + 1] = "2000"
    dry = gpu_wfm.dry_item("wfm_tiny cp=1", "kernels", "wfm_tiny", 1, 1, [])
    s = session(tmp_path)
    progress = tmp_path / "work" / "progress" / "one_gpu_rank0.jsonl"

    def kill_when_started():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if progress.exists() and '"started"' in progress.read_text() and s.processes:
                time.sleep(1)
                os.kill(s.processes[0].pid, signal.SIGKILL)
                return
            time.sleep(0.1)
    killer = threading.Thread(target=kill_when_started)
    killer.start()
    results = s.launch("one_gpu", [serial, dry], 1, 200)
    killer.join()
    assert not results["serial"]["ok"], results
    assert results["serial"]["error"].startswith("rank 0's process ended during it (exit code -9)"), results
    if attempts > 1:
        assert results["wfm_tiny cp=1"]["ok"] and results["wfm_tiny cp=1"]["step_time_s"] > 0, results
        assert (tmp_path / "out" / "logs" / "one_gpu_2.log").exists()
    else:
        assert results["wfm_tiny cp=1"] == {"ok": False, "error": "not reached: the processes ended before it"}


def ranks_started(mark):
    return any("ranks.plan.json" in command for _, command in marked(mark))


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_ctrl_c_stops_the_wfm_rehearsal_and_marks_its_report(tmp_path):
    process, mark = start(SCRIPT, ["--wfm", "--tiny", "--allow-cpu", "--parts", "ranks"], tmp_path)
    try:
        wait_until(lambda: ranks_started(mark), 120, process)
        ctrl_c(process)
        out, err = process.communicate(timeout=120)
        left = survivors(mark)
    finally:
        kill_all(mark)
    assert process.returncode == 130, (out, err)
    errors = [line for line in (out + err).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: interrupted by SIGINT: stopped ranks (2 processes"), errors
    assert "Traceback" not in out + err
    with open(tmp_path / "out" / "wfm_one_gpu.json") as f:
        report = json.load(f)
    assert report["status"] == "interrupted" and report["parts"]["ranks"]["status"] == "interrupted", report
    assert left == [], left


@NO_GPU
@pytest.mark.long
@pytest.mark.multiprocess
def test_twin_without_the_handler_the_ranks_outlive_the_wfm_rehearsal(tmp_path):
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/bash
if [[ $1 == -m && $2 == benchmarks.gpu_wfm && $3 == --out ]]; then
    shift 2
    exec {sys.executable} -c "import sys, benchmarks.gpu_wfm as g; g.interrupt_on_signals = lambda: None; \\
sys.exit(g.main(sys.argv[1:]))" "$@"
fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    process, mark = start(SCRIPT, ["--wfm", "--tiny", "--allow-cpu", "--parts", "ranks"], tmp_path,
                          python=str(wrapper))
    try:
        wait_until(lambda: ranks_started(mark), 120, process)
        ctrl_c(process)
        process.communicate(timeout=120)
        left = survivors(mark, seconds=2.0)
    finally:
        kill_all(mark)
    assert any("ranks.plan.json" in command for _, command in left), left
