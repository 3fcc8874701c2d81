"""`--torch_profile PATH`: the profiler window recorded by torch.profiler on any device (loop/profiling.py).

- `trace_path`: PATH itself for one rank, `.rank<R>` before the extension (.json.gz or .json) for several;
- the window alone (CudaProfilerWindow driving a small loop on the CPU): the steps of the window and no others, the
  loop's nvtx_range names inside it as named ranges (and nothing outside it); the file written whole or not at all
  (a failed export leaves the previous trace and no temporary file; twin: the file is absent while it is written);
- train.py --config tiny end to end: a gzipped Chrome trace with exactly the window's 3 `step N` ranges, each with
  `forward`, `backward` and `optimizer` inside, that benchmarks/step_profile.py reduces to 3 steps; twin: the same
  run without the flag writes no trace; 2 ranks under torchrun write one trace each, t.rank0 and t.rank1.

A failure points to loop/profiling.py, or to train.py's and lifecycle/cli.py's wiring of --torch_profile.
"""
import collections
import contextlib
import gzip
import json
import os

import pytest
import torch

import train
from benchmarks.step_profile import read_trace, reduce_trace
from loop import profiling
from loop.profiling import CudaProfilerWindow, nvtx_range, trace_path
from tests.conftest import run_command

pytestmark = pytest.mark.usefixtures("in_repo_root")

STEP_NAMES = {"step 0", "step 1", "step 2"}


@pytest.mark.compat
@pytest.mark.parametrize("path, rank, world, expected", [
    ("runs/t.json.gz", 0, 1, "runs/t.json.gz"),
    ("runs/t.json", 0, 1, "runs/t.json"),
    ("runs/t.json.gz", 0, 4, "runs/t.rank0.json.gz"),
    ("runs/t.json.gz", 3, 4, "runs/t.rank3.json.gz"),
    ("runs/t.json", 0, 4, "runs/t.rank0.json"),
    ("runs/t.json", 3, 4, "runs/t.rank3.json"),
    ("runs.v2/t", 1, 4, "runs.v2/t.rank1"),  # a dot in the folder is not the extension
])
def test_trace_path_names_one_file_a_rank(path, rank, world, expected):
    assert trace_path(path, rank, world) == expected


def annotations(path):
    """Counter of the user_annotation names (the loop's ranges) in a Chrome trace, gzipped or not."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    with (gzip.open if gzipped else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return collections.Counter(e["name"] for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X")


def small_loop(window, epochs=2, steps=5):
    x = torch.randn(8, 8)
    for epoch in range(epochs):
        for i in range(steps):
            window.step(epoch, i)
            with nvtx_range(f"step {i}"):
                with nvtx_range("forward"):
                    x = torch.tanh(x @ x)
        window.end_epoch()


def test_the_window_records_its_steps_and_names_the_loop_ranges_inside_it_only(tmp_path):
    """Epoch 1's first 3 of 5 steps: their ranges in the trace, none of epoch 0's or of steps 3 and 4."""
    path = tmp_path / "trace.json"
    window = CudaProfilerWindow(epoch=1, num_iters=3, trace=str(path))
    small_loop(window)
    names = annotations(path)
    assert {n for n in names if n.startswith("step ")} == STEP_NAMES
    assert names["forward"] == 3
    assert not profiling._tracing and isinstance(nvtx_range("after"), contextlib.nullcontext)  # CPU, no window
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]  # no temporary file left


def test_a_failed_export_leaves_the_previous_trace_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "t.json.gz"
    path.write_text("the previous run's trace")
    seen = []

    def export_then_fail(self, partial):
        with open(partial, "w") as f:
            f.write("half a trace")
        seen.append(path.read_text())  # what a reader of PATH sees while the export runs
        raise OSError(28, "No space left on device", partial)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export_then_fail)
    with pytest.raises(OSError):
        small_loop(CudaProfilerWindow(epoch=0, num_iters=2, trace=str(path)), epochs=1)
    assert seen == ["the previous run's trace"] and path.read_text() == "the previous run's trace"
    assert sorted(os.listdir(tmp_path)) == ["t.json.gz"]


def test_twin_a_successful_export_is_absent_at_its_path_until_complete(tmp_path, monkeypatch):
    """Twin: the same export succeeding replaces the file, which was not at PATH while being written."""
    path = tmp_path / "t.json.gz"
    seen = []
    real_export = torch.profiler.profile.export_chrome_trace

    def export(self, partial):
        real_export(self, partial)
        seen.append(path.exists())

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)
    small_loop(CudaProfilerWindow(epoch=0, num_iters=2, trace=str(path)), epochs=1)
    assert seen == [False] and {n for n in annotations(path) if n.startswith("step ")} == {"step 0", "step 1"}
    assert sorted(os.listdir(tmp_path)) == ["t.json.gz"]


def tiny_run(era5_dir, expdir, *flags):
    return ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir), "--num_epochs", "2",
            "--profile_epoch", "1", "--profile_iters", "3", *flags]


def check_trace(path):
    """A gzipped Chrome trace of the window's 3 steps, each with the loop's ranges."""
    with open(path, "rb") as f:
        assert f.read(2) == b"\x1f\x8b", f"{path} is not gzipped"
    names = annotations(path)
    assert {n for n in names if n.startswith("step ")} == STEP_NAMES, names
    assert {n: names[n] for n in ("forward", "backward", "optimizer")} == {"forward": 3, "backward": 3,
                                                                          "optimizer": 3}
    assert {n for n in names if n.startswith("data copy in")} == {"data copy in 0", "data copy in 1", "data copy in 2"}
    table = reduce_trace(read_trace(str(path)))
    assert table["steps"] == 3 and table["device"] == "CPU" and table["ms_per_step"]["gemm"] > 0


@pytest.mark.multiprocess
@pytest.mark.long
def test_train_writes_the_window_as_a_gzipped_trace_and_nothing_without_the_flag(era5_dir, tmp_path):
    traces = tmp_path / "traces"
    train.main(tiny_run(era5_dir, tmp_path / "runs", "--torch_profile", str(traces / "t.json.gz")))
    assert sorted(os.listdir(traces)) == ["t.json.gz"]
    check_trace(traces / "t.json.gz")
    # twin: the same run without --torch_profile records nothing
    train.main(tiny_run(era5_dir, tmp_path / "plain"))
    written = [os.path.join(folder, name) for folder, _, files in os.walk(tmp_path / "plain") for name in files
               if name.endswith((".json.gz", ".pt.trace.json"))]
    assert written == [] and not profiling._tracing


@pytest.mark.multiprocess
@pytest.mark.long
def test_two_ranks_under_torchrun_write_one_trace_each(era5_dir, tmp_path):
    traces = tmp_path / "traces"
    result = run_command(["train.py", *tiny_run(era5_dir, tmp_path / "runs", "--torch_profile",
                                                str(traces / "t.json.gz"))], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(traces)) == ["t.rank0.json.gz", "t.rank1.json.gz"]
    pids = set()
    for name in ("t.rank0.json.gz", "t.rank1.json.gz"):
        check_trace(traces / name)
        with gzip.open(traces / name, "rt") as f:
            pids |= {e["pid"] for e in json.load(f)["traceEvents"] if e.get("cat") == "cpu_op"}
    assert len(pids) == 2  # each rank's own process


def test_a_window_shorter_than_its_epoch_is_written_only_when_asked(tmp_path):
    """The window ends after num_iters steps (stop), but its trace is written by write_trace, which the loops call
    after the epoch's timed report: writing a trace is not the epoch's time. Twin: end_epoch writes at once."""
    path = tmp_path / "t.json.gz"
    window = CudaProfilerWindow(epoch=0, num_iters=2, trace=str(path))
    for i in range(4):
        window.step(0, i)
        with nvtx_range(f"step {i}"):
            torch.tanh(torch.randn(4, 4))
    assert not window.running and not path.exists()  # stopped at step 2, nothing written yet
    window.write_trace()
    assert {n for n in annotations(path) if n.startswith("step ")} == {"step 0", "step 1"}
    twin = CudaProfilerWindow(epoch=0, num_iters=None, trace=str(tmp_path / "twin.json.gz"))
    twin.step(0, 0)
    twin.end_epoch()
    assert (tmp_path / "twin.json.gz").exists()


def test_a_trace_the_run_never_reached_is_said_at_its_end(tmp_path, caplog):
    """--profile_epoch 3 on a run of one epoch: close() says in one line that no trace was written, and why. Twin:
    a window that ran says nothing."""
    window = CudaProfilerWindow(epoch=3, trace=str(tmp_path / "never.json.gz"))
    window.step(0, 0)
    with caplog.at_level("WARNING"):
        window.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"--torch_profile: no trace written to {tmp_path / 'never.json.gz'}: the run never began epoch 4 at its first "
        "step (--profile_epoch 3 counts from 0)"]
    caplog.clear()
    ran = CudaProfilerWindow(epoch=0, trace=str(tmp_path / "ran.json.gz"))
    ran.step(0, 0)
    with caplog.at_level("WARNING"):
        ran.close()
    assert caplog.records == [] and (tmp_path / "ran.json.gz").exists()


@pytest.mark.parametrize("flags, what", [(["--enable_benchy"], "--enable_benchy"), (["--dry_run", "4"], "--dry_run")])
def test_torch_profile_with_a_run_that_has_no_loop_is_refused(flags, what):
    """--enable_benchy and --dry_run never reach the loop's window: the flag would do nothing, so it is refused."""
    from lifecycle.cli import model_parallel_parser, set_profiling_window
    from utils.errors import UserError
    from utils.YParams import YParams
    args = model_parallel_parser("t").parse_args(["--torch_profile", "t.json.gz", *flags])
    params = YParams("config/ViT.yaml", "tiny")
    params.enable_benchy = "--enable_benchy" in flags
    with pytest.raises(UserError, match=f"which {what} does not run; drop one of them"):
        set_profiling_window(params, args)
    args.torch_profile = None  # twin: without the flag both run
    set_profiling_window(params, args)
