"""train_graph.py and train_mp_graphs.py: the training step captured in a CUDA graph (loop/cuda_graphs.py).

On the CPU there are no graphs: without CUDA both scripts (and benchmarks/bench_graph.py) stop with one line and
exit code 2, and so do fp16 without the fused Adam, --enable_jit and the ResNet stage. With the capture
emulated (test only: a "replay" calls the same step on the captured static buffers and, as a real graph does, reads
the learning-rate tensors the optimizer held at capture), train_graph.py and train_mp_graphs.py (tp = cp = 1)
reproduce train.py's per-step losses, step-0 points and weights: the warm-up leaves no trace, each batch reaches the
static buffers, the schedule fills the lr tensor in place. Their failing twins (a static buffer not refreshed, an lr
replaced instead of filled) do not. On a GPU (marked gpu, run by `make gpu-check`): 30 graph steps give train.py's
losses for the ViT, the UNet and train_mp.py (tp=1; tp=2 with 2 GPUs), the lr follows the schedule, and a
launch-bound step is faster.

A failure points to loop/cuda_graphs.py (warm-up snapshot and restore, static buffers, cloned outputs),
task/optim.py (make_capturable, set_lr, the plain checkpoint form) or the few lines of the scripts around
GraphedStep.
"""
import contextlib
import math
import os
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
import train_graph
import train_mp
import train_mp_graphs
from loop import cuda_graphs, flops
from loop.meter import EpochMeter
from task.optim import WarmupThenPlateau, cosine_with_warmup, make_capturable
from tests.conftest import REPO_ROOT, free_port
from utils import comm
from utils.errors import UserError

pytestmark = pytest.mark.usefixtures("in_repo_root")
STEPS = ["--num_iters", "8", "--stop_at_iter", "3"]  # 3 steps, stopped mid-epoch: no validation pass (CPU time)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA Graphs need a CUDA GPU")


def record_step_losses(monkeypatch):
    """The training loss of every step, as the loop hands it to the epoch meter (a list that fills)."""
    losses = []
    add = EpochMeter.add

    def recording_add(self, loss, metrics):
        losses.append(loss.item())
        add(self, loss, metrics)

    monkeypatch.setattr(EpochMeter, "add", recording_add)
    return losses


def run_on_the_cpu(monkeypatch):
    """The CPU tests run on the CPU also where CUDA is present (the device every script gets from comm), without
    the half-second matmul that measures the MFU's peak at each start (no run here reaches an epoch report)."""
    monkeypatch.setattr(comm, "get_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda device, dtype=torch.float32: 1e11)


@pytest.fixture
def step_losses(monkeypatch):
    return record_step_losses(monkeypatch)


@pytest.fixture
def emulated_graphs(monkeypatch):
    """CUDA graphs emulated on the CPU, for this test only: no CUDA check, no stream, and a "capture" whose replay
    runs the step on the captured buffers with the lr tensors the optimizer held at capture (a graph reads those
    addresses, whatever the param groups hold later). Returns the lr each replay read."""
    optimizers, lrs_read = [], []

    def recording_make_capturable(optimizer):
        optimizers.append(optimizer)
        return make_capturable(optimizer)

    def emulated_capture(step, static_inputs, stream):
        groups = optimizers[-1].param_groups
        captured_lrs = [group["lr"] for group in groups]

        def replay():
            for group, lr in zip(groups, captured_lrs):
                group["lr"] = lr
            lrs_read.append(captured_lrs[0].item())
            return step(*static_inputs)

        return replay

    run_on_the_cpu(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "make_capturable", recording_make_capturable)
    monkeypatch.setattr(cuda_graphs, "require_cuda", lambda device, instead: None)
    monkeypatch.setattr(cuda_graphs, "side_stream", lambda device: None)
    monkeypatch.setattr(cuda_graphs, "on_stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graphs, "enter_stream", lambda stream: None)
    monkeypatch.setattr(cuda_graphs, "leave_stream", lambda stream: None)
    monkeypatch.setattr(cuda_graphs, "capture", emulated_capture)
    monkeypatch.setattr(cuda_graphs, "WARMUP_STEPS", 2)  # enough to leave traces if the restore missed any
    return lrs_read


def run_tiny(main, era5_dir, expdir, layout, steps=STEPS):
    main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir), *steps])
    run_dir = os.path.join(str(expdir), "tiny", layout, "00")
    events = EventAccumulator(os.path.join(run_dir, "logs"))
    events.Reload()
    points = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    return points, torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)


@pytest.fixture(scope="module")
def eager(era5_dir, tmp_path_factory):
    """train.py's tiny run: per-step losses, TensorBoard points, checkpoint."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(REPO_ROOT)
        run_on_the_cpu(monkeypatch)
        losses = record_step_losses(monkeypatch)
        points, checkpoint = run_tiny(train.main, era5_dir, tmp_path_factory.mktemp("eager"), "1GPU")
    return losses, points, checkpoint


def weights_close(checkpoint, reference):
    return all(torch.allclose(checkpoint["model"][name], weight, rtol=1e-5, atol=1e-7)
               for name, weight in reference["model"].items())


def error_line(main, argv, capsys):
    """main(argv) exits with code 2 and exactly one `error:` line (after the log lines), no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "Traceback" not in err
    assert err.splitlines()[-1] == errors[0]
    return errors[0]


def test_no_cuda_is_one_line_and_exit_code_2(era5_dir, tmp_path, capsys, monkeypatch):
    run_on_the_cpu(monkeypatch)
    for main, eager_script in ((train_graph.main, "train.py"), (train_mp_graphs.main, "train_mp.py")):
        line = error_line(main, ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path)], capsys)
        assert line.startswith("error: CUDA Graphs need an NVIDIA GPU") and f"use {eager_script}," in line


@pytest.mark.parametrize("flags, expected", [
    (["--amp_mode", "fp16"], "error: fp16 in a CUDA graph needs --enable_fused"),
    (["--enable_jit"], "error: torch.compile (enable_jit) does not combine with this script"),
    (["--yaml_config", "config/ResNet50.yaml"], "error: the captured step supports Adam (capturable) for the ViT"),
])
def test_what_cannot_be_captured_is_one_line(flags, expected, emulated_graphs, era5_dir, tmp_path, capsys):
    line = error_line(train_graph.main, ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path),
                                         *flags], capsys)
    assert line.startswith(expected)


@pytest.mark.parametrize("flag", ["--activation_checkpointing", "--fsdp"])
def test_the_memory_flags_not_tried_under_capture_are_refused(emulated_graphs, era5_dir, tmp_path, capsys, flag):
    line = error_line(train_mp_graphs.main, ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path),
                                             flag], capsys)
    assert line.startswith(f"error: {flag} is not supported in the captured step")
    assert line.endswith("use train_mp.py")


def test_a_pipeline_is_refused_under_capture():
    """--pipeline_parallel needs 2 ranks or more, so the refusal is asked of check_support itself (on a CUDA device:
    the GPU check comes first); the twin: the same flags without the pipeline pass."""
    from lifecycle.cli import model_parallel_parser
    from loop.cuda_graphs import check_support
    from utils.YParams import YParams
    params = YParams("config/ViT.yaml", "tiny")
    params.update({"amp_mode": "none", "enable_fused": False, "enable_jit": False})
    parse = model_parallel_parser("t").parse_args
    with pytest.raises(UserError, match="--pipeline_parallel is not supported in the captured step"):
        check_support(params, parse(["--pipeline_parallel", "2"]), torch.device("cuda"), "train_mp_graphs.py")
    check_support(params, parse([]), torch.device("cuda"), "train_mp_graphs.py")


@pytest.mark.compat
@pytest.mark.parametrize("main, layout", [(train_graph.main, "1GPU"), (train_mp_graphs.main, "1MP")])
def test_the_captured_step_is_train_py_step(main, layout, eager, emulated_graphs, step_losses, era5_dir,
                                            tmp_path):
    """Per-step losses to 1e-5 (float32 lr tensor vs Python float), step-0 points and weights after 3 steps; the lr
    tensor read by each replay follows the cosine schedule; the checkpoint keeps train.py's form."""
    eager_losses, eager_points, eager_checkpoint = eager
    points, checkpoint = run_tiny(main, era5_dir, tmp_path, layout)
    assert step_losses == pytest.approx(eager_losses, rel=1e-5) and len(step_losses) == 3
    assert points == pytest.approx(eager_points, rel=1e-5)
    assert weights_close(checkpoint, eager_checkpoint)
    lr0, factor = 1e-3, cosine_with_warmup(0, 8)  # tiny: lr 1e-3, cosine over 8 iterations
    assert emulated_graphs[-3:] == pytest.approx([lr0 * factor(k) for k in range(3)], rel=1e-6)
    group = checkpoint["optimizer"]["param_groups"][0]
    assert isinstance(group["lr"], float) and group["capturable"] is False  # resumes in train.py


@pytest.mark.compat
def test_twins_stale_buffer_or_replaced_lr_give_other_numbers(eager, emulated_graphs, step_losses, era5_dir,
                                                              tmp_path, monkeypatch):
    """The check above can fail: a batch that never reaches the static buffers, or a schedule that puts a new lr
    into the param group instead of filling the captured tensor, each change what is trained."""
    eager_losses, _, eager_checkpoint = eager
    with monkeypatch.context() as patch:  # the twin: replay without copying the batch in
        patch.setattr(cuda_graphs.GraphedStep, "__call__",
                      lambda self, *batch: tuple(out.detach().clone() for out in self.replay()))
        _, checkpoint = run_tiny(train_graph.main, era5_dir, tmp_path / "stale", "1GPU")
    assert step_losses[0] == pytest.approx(eager_losses[0], rel=1e-5)  # the first batch is the buffers' own
    assert step_losses[1:] != pytest.approx(eager_losses[1:], rel=1e-5)  # fails the check above
    assert not weights_close(checkpoint, eager_checkpoint)

    step_losses.clear()
    step = torch.optim.lr_scheduler.LambdaLR.step

    def replacing_step(self, *args, **kwargs):
        for group in self.optimizer.param_groups:  # a float lr: the step below puts a new one in its place
            group["lr"] = float(group["lr"])
        step(self, *args, **kwargs)

    with monkeypatch.context() as patch:  # the twin: every schedule step replaces the group's lr
        patch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", replacing_step)
        _, checkpoint = run_tiny(train_graph.main, era5_dir, tmp_path / "replaced", "1GPU")
    assert emulated_graphs[-3:] == pytest.approx([1e-3] * 3)  # the graph keeps reading the captured lr
    assert not weights_close(checkpoint, eager_checkpoint)


@pytest.mark.compat
def test_checkpoints_resume_across_the_two_scripts(eager, emulated_graphs, era5_dir, tmp_path):
    """train.py's checkpoint (iteration 3) resumed in train_graph.py for one step, that checkpoint resumed in train.py
    for one more: the weights and schedule of train.py resumed from 3 to 5 (make_capturable after the load, the
    plain checkpoint form)."""
    eager_path = tmp_path / "eager_ckpt.pt"
    torch.save(eager[2], eager_path)
    _, graph_checkpoint = run_tiny(train_graph.main, era5_dir, tmp_path / "graph", "1GPU",
                                   ["--num_iters", "8", "--resume", str(eager_path), "--stop_at_iter", "4"])
    graph_path = tmp_path / "graph_ckpt.pt"
    torch.save(graph_checkpoint, graph_path)
    _, mixed = run_tiny(train.main, era5_dir, tmp_path / "mixed", "1GPU",
                        ["--num_iters", "8", "--resume", str(graph_path), "--stop_at_iter", "5"])
    _, reference = run_tiny(train.main, era5_dir, tmp_path / "reference", "1GPU",
                            ["--num_iters", "8", "--resume", str(eager_path), "--stop_at_iter", "5"])
    assert graph_checkpoint["iteration"] == 4 and mixed["iteration"] == reference["iteration"] == 5
    assert weights_close(mixed, reference) and not weights_close(eager[2], reference)
    assert mixed["optimizer"]["param_groups"][0]["lr"] == pytest.approx(reference["optimizer"]["param_groups"][0]["lr"])
    assert mixed["epoch_sums"]["steps"] == reference["epoch_sums"]["steps"] == 5
    assert mixed["epoch_sums"]["sums"] == pytest.approx(reference["epoch_sums"]["sums"], rel=1e-5)


@pytest.mark.compat
def test_schedules_fill_a_tensor_lr_in_place():
    """WarmupThenPlateau and LambdaLR on a tensor lr: the same values as on a float lr, the same tensor object; the
    saved param groups hold a float, not capturable."""
    def run(tensor_lr):
        param = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.Adam([param], lr=0.1)
        scheduler = WarmupThenPlateau(optimizer, 0.1, warmup_epochs=2, steps_per_epoch=3)
        if tensor_lr:
            make_capturable(optimizer)
        lrs, lr_tensor = [], optimizer.param_groups[0]["lr"]
        for _ in range(16):
            for _step in range(3):
                param.grad = torch.ones(2)
                optimizer.step()
                scheduler.step()
                lrs.append(float(optimizer.param_groups[0]["lr"]))
            scheduler.end_epoch(1.0)  # a flat validation loss: the plateau lowers the lr after its patience
        assert not tensor_lr or optimizer.param_groups[0]["lr"] is lr_tensor  # filled, never replaced
        return lrs, optimizer

    (float_lrs, _), (tensor_lrs, optimizer) = run(False), run(True)
    assert tensor_lrs == pytest.approx(float_lrs, rel=1e-6)
    assert min(tensor_lrs) < max(tensor_lrs) / 4  # warm-up and a plateau cut happened (the check can fail)
    saved = optimizer.state_dict()["param_groups"][0]
    assert isinstance(saved["lr"], float) and saved["capturable"] is False
    assert torch.is_tensor(optimizer.param_groups[0]["lr"])


def test_a_resumed_optimizer_keeps_this_runs_fused_kernels():
    """load_state_dict restores the saved param groups, `fused` included: a train.py checkpoint written without
    --enable_fused, resumed by train_graph.py with it (fp16 in a graph needs it), must run the fused Adam (the
    foreach one refuses GradScaler's device-side inf flag)."""
    weight = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.Adam([weight], lr=1e-3).state_dict()  # written without --enable_fused
    optimizer = torch.optim.Adam([weight], lr=1e-3, fused=True)
    optimizer.load_state_dict(saved)
    assert not optimizer.param_groups[0]["fused"]  # what load_state_dict alone leaves
    make_capturable(optimizer)
    assert optimizer.param_groups[0]["fused"] is True and torch.is_tensor(optimizer.param_groups[0]["lr"])


def test_bench_graph_refuses_a_machine_without_cuda(capsys, monkeypatch):
    from benchmarks import bench_graph
    monkeypatch.setattr(bench_graph.torch.cuda, "is_available", lambda: False)
    assert bench_graph.main(["--out", "unused.json"]) == 2
    assert capsys.readouterr().err.startswith("error: bench_graph times CUDA Graphs and needs an NVIDIA GPU")


# ---- on a GPU (make gpu-check) ----

@pytest.fixture(scope="module")
def cosmo_dir(tmp_path_factory):
    from sample_data import write_cosmo
    return str(write_cosmo(tmp_path_factory.mktemp("cosmo"), verbose=False))


def run_on_gpu(main, yaml, data_dir, expdir, layout, flags, iters=30):
    main(["--yaml_config", yaml, "--config", "tiny", "--data_dir", data_dir, "--expdir", str(expdir),
          "--num_iters", str(iters), *flags])
    run_dir = os.path.join(str(expdir), "tiny", layout, "00")
    return torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True, map_location="cpu")


def differences(got, expected):
    """'' when the tensors (dicts of tensors) are bitwise equal, else one line per differing tensor: how many
    elements differ, out of how many, and the largest difference."""
    lines = []
    for name, want in expected.items():
        have = got[name]
        if not torch.is_tensor(want):
            if have != want:
                lines.append(f"{name}: {have!r} != {want!r}")
            continue
        unequal = have != want
        if unequal.any():
            largest = (have.double() - want.double()).abs().max().item()
            lines.append(f"{name}: {int(unequal.sum())} of {want.numel()} elements differ, by up to {largest:.3g}")
    return "\n".join(lines)


MATH = ["--sdpa_backend", "math"]  # an attention kernel whose backward sums in a fixed order


def with_deterministic_kernels(monkeypatch, script, graph_arithmetic):
    """Wrap `script`'s restore (called once, after start-up set cudnn.benchmark): cuDNN's deterministic kernels
    without autotuning from then on, and with `graph_arithmetic` the optimizer made capturable as GraphedStep makes
    it (the lr a float32 device tensor, Adam's capturable arithmetic), so the eager run computes what the graph
    computes."""
    restore = script.restore

    def restore_then_pin(run, model, optimizer, *args, **kwargs):
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
        monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
        result = restore(run, model, optimizer, *args, **kwargs)
        if graph_arithmetic:
            make_capturable(optimizer)
        return result

    monkeypatch.setattr(script, "restore", restore_then_pin)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("stage", ["vit", "vit_fp16_fused", "unet", "mp_tp1"])
def test_graph_steps_equal_eager_steps_on_gpu(stage, era5_dir, cosmo_dir, tmp_path, step_losses, monkeypatch):
    """30 replays against 30 eager steps of train.py (train_mp.py), bitwise: per-step losses, weights and the loss
    scale. The eager run computes what the graph computes: the optimizer made capturable as GraphedStep makes it
    (Adam's capturable arithmetic on a float32 lr tensor, not a Python float), cuDNN's deterministic kernels without
    autotuning in both runs, and for the ViT the math attention kernel (FlashAttention's and the memory-efficient
    kernel's backward sum with atomics, in any order). Against plain eager Adam the UNet's weights differ by up to
    2.6e-3 after 30 steps on an H100: the optimizer's arithmetic, not the capture. The lr tensor the graph was
    captured with is filled with the schedule's values."""
    eager_script, graph_script, yaml, data, layout, flags = {
        "vit": (train, train_graph, "config/ViT.yaml", era5_dir, "1GPU", MATH),
        "vit_fp16_fused": (train, train_graph, "config/ViT.yaml", era5_dir, "1GPU",
                           ["--amp_mode", "fp16", "--enable_fused", *MATH]),
        "unet": (train, train_graph, "config/UNet.yaml", cosmo_dir, "1GPU", []),
        "mp_tp1": (train_mp, train_mp_graphs, "config/ViT.yaml", era5_dir, "1MP", MATH),
    }[stage]
    with_deterministic_kernels(monkeypatch, eager_script, graph_arithmetic=True)
    with_deterministic_kernels(monkeypatch, graph_script, graph_arithmetic=False)  # GraphedStep does it
    eager_checkpoint = run_on_gpu(eager_script.main, yaml, data, tmp_path / "eager", layout, flags)
    eager_losses = list(step_losses)
    step_losses.clear()
    optimizers, lrs = [], []
    monkeypatch.setattr(cuda_graphs, "make_capturable", lambda opt: optimizers.append(opt) or make_capturable(opt))
    add = EpochMeter.add

    def add_and_read_lr(self, loss, metrics):
        lr = optimizers[0].param_groups[0]["lr"]
        lrs.append((lr, lr.item()))
        add(self, loss, metrics)

    monkeypatch.setattr(EpochMeter, "add", add_and_read_lr)
    graph_checkpoint = run_on_gpu(graph_script.main, yaml, data, tmp_path / "graph", layout, flags)
    assert len(step_losses) == len(eager_losses) == 30
    steps = {f"loss of step {k + 1}": torch.tensor(v) for k, v in enumerate(eager_losses)}
    graph_steps = {f"loss of step {k + 1}": torch.tensor(v) for k, v in enumerate(step_losses)}
    report = differences(graph_steps, steps) + differences(graph_checkpoint["model"], eager_checkpoint["model"])
    report += differences({"scaler": graph_checkpoint["scaler"]}, {"scaler": eager_checkpoint["scaler"]})
    assert not report, f"the graph's steps are not bitwise the eager ones:\n{report}"
    assert all(tensor is lrs[0][0] for tensor, _ in lrs)  # one lr tensor, filled in place
    if stage != "unet":  # ViT tiny: cosine from 1e-3 over the 30 iterations, read after each scheduler step
        factor = cosine_with_warmup(0, 30)
        assert [value for _, value in lrs] == pytest.approx([1e-3 * factor(k + 1) for k in range(30)], abs=1e-9)


def test_differences_names_the_count_and_size_of_each_difference():
    """The GPU test's failure message (and its equality check: one changed element is found)."""
    weight = torch.arange(6.0)
    changed = weight.clone()
    changed[4] += 2.5e-3
    assert differences({"w": weight.clone(), "s": 1.0}, {"w": weight, "s": 1.0}) == ""
    assert differences({"w": changed, "s": 2.0}, {"w": weight, "s": 1.0}) == \
        "w: 1 of 6 elements differ, by up to 0.0025\ns: 2.0 != 1.0"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs 2 GPUs")
def test_mp_graphs_tp2_equals_train_mp_over_nccl(era5_dir, tmp_path):
    """train_mp_graphs.py at tp=2 (the tp collectives and DDP captured, NCCL) against train_mp.py at tp=2: the same
    TensorBoard points and weights after 30 iterations, to 1e-3."""
    results = {}
    for script in ("train_mp.py", "train_mp_graphs.py"):
        expdir = tmp_path / script
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), script, "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(expdir),
                   "--num_iters", "30", "--tensor_parallel", "2"]
        env = dict(os.environ, NVIDIA_TF32_OVERRIDE="0")  # no TF32 convolutions: fp32 rounding only
        env.pop("WORLD_SIZE", None)
        result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        run_dir = os.path.join(str(expdir), "tiny", "2MP", "00")
        events = EventAccumulator(os.path.join(run_dir, "logs"))
        events.Reload()
        points = {(tag, e.step): e.value for tag in events.Tags()["scalars"] if "per sec" not in tag
                  for e in events.Scalars(tag)}
        results[script] = points, torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True,
                                             map_location="cpu")
    (eager_points, eager_checkpoint), (points, checkpoint) = results["train_mp.py"], results["train_mp_graphs.py"]
    assert points == pytest.approx(eager_points, rel=1e-3)
    for name, weight in eager_checkpoint["model"].items():
        torch.testing.assert_close(checkpoint["model"][name], weight, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.multiprocess
@needs_cuda
def test_graphs_make_a_launch_bound_step_faster(era5_dir, tmp_path):
    """The tiny ViT (2 blocks, 16 x 32 images, batch 4) is launch bound: its graphed step must be faster."""
    from benchmarks import bench_graph
    case = bench_graph.CASES[0]
    assert case.config == "tiny"
    result = bench_graph.measure(case, era5_dir, str(tmp_path), nbatches=20, ntrials=2, nwarmup=1)
    assert result["graph"]["ms_per_step"] < result["eager"]["ms_per_step"], result
    assert math.isfinite(result["speedup"]) and result["speedup"] > 1
