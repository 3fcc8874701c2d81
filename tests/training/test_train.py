"""train.py end to end on CPU: log lines, TensorBoard tags, loss falls, AMP/fused/compile, bad input.

A failure here points to train.py or the seams it calls (lifecycle/cli.py, loaders/, task/optim.py).
"""
import importlib
import os
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from lifecycle.cli import model_parallel_parser, training_parser
from lifecycle.run import first_line
from tests.conftest import REPO_ROOT, run_command
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")


def run_train(era5_dir, expdir, *flags, config="tiny"):
    train.main(["--config", config, "--data_dir", era5_dir, "--expdir", str(expdir), *flags])
    return os.path.join(str(expdir), config, "1GPU", "00")


@pytest.fixture(scope="module")
def tiny_run(era5_dir, tmp_path_factory):
    """150 iterations at batch 4 over 256 samples: epochs of 64, 64 and 22 steps (the last one partial)."""
    expdir = tmp_path_factory.mktemp("runs")
    run_dir = run_train(era5_dir, expdir, "--num_iters", "150", "--num_data_workers", "2")
    events = EventAccumulator(os.path.join(run_dir, "logs"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    with open(os.path.join(run_dir, "out.log")) as log_file:
        log = log_file.read()
    return run_dir, events, log


def scalar_steps(events, tag):
    return [e.step for e in events.Scalars(tag)]


@pytest.mark.compat
@pytest.mark.multiprocess
def test_log_lines_match_the_tutorial(tiny_run):
    _, _, log = tiny_run
    line_start = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - root - INFO - "
    for epoch in (1, 2, 3):
        epoch_line = rf"Time taken for epoch {epoch} is \d+\.\d{{6}} sec, avg \d+\.\d{{6}} samples/sec$"
        assert re.search(line_start + epoch_line, log, re.M)
    assert len(re.findall(line_start + r"  Avg train loss=\d+\.\d{6}$", log, re.M)) == 3
    assert len(re.findall(line_start + r"  Avg val loss=\d+\.\d+", log, re.M)) == 3
    assert len(re.findall(line_start + r"  Total validation time: \d+\.\d+ sec$", log, re.M)) == 3
    assert re.search(line_start + r"  Throughput per device: \d+\.\d{4} TFLOP/s, MFU \d+\.\d%$", log, re.M)
    assert "Configuration name: tiny" in log and "amp_dtype torch.float32" in log
    assert "Number of parameters: 47,008" in log
    assert re.search(line_start + "DONE ---- rank 0$", log, re.M)


@pytest.mark.parametrize("script", ["train", "train_graph", "train_mp", "train_mp_graphs"])
def test_the_first_log_line_names_the_model_the_yaml_file_and_the_config(script, era5_dir, tmp_path, capsys):
    """Every script's first log line, on the console and at the top of out.log, says what trains from which file
    (a tutorial's command that picked the ViT by default shows it at once). On this CPU the graph scripts stop at
    their check for CUDA, after the run directory opened."""
    argv = ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", "1"]
    try:
        importlib.import_module(script).main(argv)
    except SystemExit as stop:
        assert "graph" in script and stop.code == 2
    console = [line for line in capsys.readouterr().err.splitlines() if " - root - " in line]
    assert console[0].endswith(" - root - INFO - Training ViT: config/ViT.yaml, config tiny"), console[:3]
    run_dir = os.path.join(str(tmp_path), "tiny", "1MP" if "_mp" in script else "1GPU", "00")
    with open(os.path.join(run_dir, "out.log")) as log_file:
        out_log = log_file.read().splitlines()
    assert out_log[:2] == console[:2]  # out.log begins as the console does, "Setting DP = 1, ..." included
    assert "Setting DP = 1" in out_log[1]


@pytest.mark.parametrize("yaml_file, config, flags, line", [
    ("config/ViT.yaml", "short", [], "Training ViT: config/ViT.yaml, config short"),
    ("./config/UNet.yaml", "bs64_opt", [], "Training UNet: config/UNet.yaml, config bs64_opt"),
    ("config/ResNet50.yaml", "bs128", [], "Training ResNet (resnet50): config/ResNet50.yaml, config bs128"),
    ("config/ResNet50.yaml", "demo", ["--arch", "resnet34"], "Training ResNet (resnet34): config/ResNet50.yaml, "
                                                             "config demo"),
    ("config/UNet.yaml", "short", ["--enable_benchy"], "Benchmarking UNet: config/UNet.yaml, config short"),
])
def test_the_first_line_of_each_stage(yaml_file, config, flags, line):
    args = training_parser("t").parse_args(["--yaml_config", yaml_file, "--config", config, *flags])
    assert first_line(args, YParams(yaml_file, config)) == line


def test_the_original_hyphenated_desired_acc_is_an_alias():
    """The ImageNet example's --desired-acc is the same flag as --desired_acc (in every script's parser)."""
    for parser in (training_parser("t"), model_parallel_parser("t")):
        assert parser.parse_args(["--desired-acc", "0.75"]).desired_acc == 0.75
        assert parser.parse_args(["--desired_acc", "0.5"]).desired_acc == 0.5


@pytest.mark.multiprocess
def test_tensorboard_tags_and_steps(tiny_run):
    _, events, _ = tiny_run
    tags = events.Tags()
    assert {"Loss/train", "Loss/valid", "RMSE(u10m)/valid", "Learning Rate", "Avg iters per sec",
            "Avg samples per sec"} <= set(tags["scalars"])
    assert tags["images"] == ["Visualization, t2m"]
    for tag in ("Loss/train", "Loss/valid", "RMSE(u10m)/valid"):
        assert scalar_steps(events, tag) == [0, 64, 128, 150]  # step 0, then each epoch end
    assert scalar_steps(events, "Learning Rate") == [64, 128, 150]
    assert [e.step for e in events.Images("Visualization, t2m")] == [64, 128, 150]
    lr = [e.value for e in events.Scalars("Learning Rate")]
    assert lr[0] > lr[1] > lr[2] == pytest.approx(0.0, abs=1e-12)  # cosine reaches 0 after exactly num_iters


@pytest.mark.compat
@pytest.mark.multiprocess
def test_loss_falls_and_num_iters_are_run(tiny_run):
    run_dir, events, _ = tiny_run
    valid = [e.value for e in events.Scalars("Loss/valid")]
    rmse = [e.value for e in events.Scalars("RMSE(u10m)/valid")]
    assert valid[-1] < 0.8 * valid[0] and rmse[-1] < rmse[0]
    checkpoint = torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)
    assert checkpoint["iteration"] == 150 and checkpoint["scheduler"]["last_epoch"] == 150
    assert not [f for f in os.listdir(os.path.join(run_dir, "checkpoints")) if f.endswith(".tmp")]


@pytest.mark.compat
@pytest.mark.parametrize("flags", [["--amp_mode", "bf16"], ["--enable_fused"], ["--amp_mode", "fp16"]])
def test_precision_and_fused_paths_train_on_cpu(era5_dir, tmp_path, flags):
    run_dir = run_train(era5_dir, tmp_path, "--num_iters", "20", *flags)
    checkpoint = torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)
    assert checkpoint["iteration"] == 20
    assert all(torch.isfinite(v).all() for v in checkpoint["model"].values())
    with open(os.path.join(run_dir, "out.log")) as log_file:
        log = log_file.read()
    if "--enable_fused" in flags:
        assert "enable_fused True" in log
    else:
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[flags[1]]
        assert f"amp_dtype torch.{dtype}" in log and "amp_enabled True" in log
    if flags[1:] == ["fp16"]:
        assert checkpoint["scaler"]["scale"] > 0  # GradScaler active only for fp16


@pytest.mark.compat
@pytest.mark.multiprocess
@pytest.mark.long
def test_enable_jit_compiles_a_tiny_model(era5_dir, tmp_path):
    from torch._dynamo.utils import counters
    counters.clear()
    run_dir = run_train(era5_dir, tmp_path, "--num_iters", "4", "--enable_jit")
    with open(os.path.join(run_dir, "out.log")) as log_file:
        log = log_file.read()
    assert "enable_jit True" in log and "DONE ---- rank 0" in log
    assert counters["stats"]["unique_graphs"] >= 1  # torch.compile really traced the model


def write_yaml(tmp_path, **changes):
    """A YAML file whose config `bad` is `demo` with some values changed."""
    path = tmp_path / f"bad_{'_'.join(changes)}.yaml"
    lines = ["bad:"] + [f"  {key}: {value}" for key, value in changes.items()]
    original = open(os.path.join(REPO_ROOT, "config", "ViT.yaml")).read()
    path.write_text(original + "\n" + "\n".join(lines).replace("bad:", "bad:\n  <<: *demo", 1) + "\n")
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("unknown_config", "config 'nope' is not in .*choose one of: base, short"),
    ("missing_yaml", "'config/nope.yaml' not found"),
    ("missing_data", "does not exist; generate sample data with `python -m sample_data era5"),
    ("empty_data", "holds no .h5 files; generate sample data"),
    ("patch", r"img_size \[30, 64\] is not divisible by patch_size 4"),
    ("heads", "embed_dim 190 is not divisible by num_heads 6"),
    ("num_iters", "num_iters is 0; it must be at least 1"),
    ("amp_mode", "argument --amp_mode: invalid choice: 'fp8'"),
    ("dali", "--data_loader_config dali-lowmem is a flag of the UNet stage .*: add --yaml_config config/UNet.yaml "
             r"\(for the ViT: --data_loader_config dali\)"),
    ("dali_yaml", "data_loader_config 'dali-lowmem' is the cosmology boxes' DALI loader .*; for ERA5 choose one of: "
                  "pytorch, dali"),
    ("unet_flags", "--enable_apex, --enable_manual_profiling and --data_loader_config lowmem are flags of the UNet "
                   "stage"),
    ("batch", "has 256 samples, fewer than one global batch of 512"),
    ("sdpa_cpu", "--sdpa_backend cudnn is a CUDA kernel; on the CPU use auto, flash or math"),
    ("sdpa_yaml", "sdpa_backend 'fast' is unknown; choose one of: auto, cudnn, flash, efficient, math"),
])
def test_bad_input_is_one_clear_line(era5_dir, tmp_path, capsys, case, message):
    argv = ["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path)]
    (tmp_path / "empty" / "train").mkdir(parents=True)
    extra = {
        "unknown_config": ["--config", "nope"],
        "missing_yaml": ["--yaml_config", "config/nope.yaml"],
        "missing_data": ["--data_dir", str(tmp_path / "nowhere")],
        "empty_data": ["--data_dir", str(tmp_path / "empty")],
        "patch": ["--yaml_config", write_yaml(tmp_path, img_size="[30, 64]"), "--config", "bad"],
        "heads": ["--yaml_config", write_yaml(tmp_path, embed_dim=190), "--config", "bad"],
        "num_iters": ["--num_iters", "0"],
        "amp_mode": ["--amp_mode", "fp8"],
        "dali": ["--data_loader_config", "dali-lowmem"],
        "dali_yaml": ["--yaml_config", write_yaml(tmp_path, data_loader_config="dali-lowmem"), "--config", "bad"],
        "unet_flags": ["--enable_apex", "--enable_manual_profiling", "--data_loader_config", "lowmem"],
        "batch": ["--local_batch_size", "512"],
        "sdpa_cpu": ["--sdpa_backend", "cudnn"],
        "sdpa_yaml": ["--yaml_config", write_yaml(tmp_path, sdpa_backend="fast"), "--config", "bad"],
    }[case]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv + extra)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    err_lines = [line for line in stderr.splitlines() if " - root - " not in line]  # drop normal log lines
    assert len(err_lines) == 1 and err_lines[0].startswith("error: "), stderr
    assert re.search(message, err_lines[0]), err_lines[0]


@pytest.mark.multiprocess
def test_bad_input_from_the_command_line_has_no_traceback(tmp_path):
    result = run_command(["train.py", "--config", "tiny", "--data_dir", str(tmp_path / "nowhere"),
                          "--expdir", str(tmp_path)])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: data directory")
