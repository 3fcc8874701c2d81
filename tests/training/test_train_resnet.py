"""The ResNet stage through train.py on the CIFAR-100 sample data: learning, accuracy metrics, early stop,
channels_last and bf16 on CPU, DataParallel mode, DDP == one process, bad input.

A failure points to train.py, task/metrics.py (top-k), task/optim.py (SGD, plateau schedule), or the
image seams (networks/resnet.py, loaders/images.py).
"""
import hashlib
import json
import os
import pickle
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from lifecycle.cli import apply_overrides, training_parser
from sample_data.images import write_cifar100
from tests.conftest import REPO_ROOT, run_command, run_ranks
from utils.YParams import YParams

RESNET_YAML = "config/ResNet50.yaml"
ORIGINAL_CONFIGS = ["default", "bs128", "bs256", "bs256-prof", "bs256-amp", "bs256-amp-prof", "bs256-amp-nhwc",
                    "bs256-amp-nhwc-prof", "bs256-amp-nhwc-extra-opts", "bs256-amp-nhwc-extra-opts-prof",
                    "bs128-opt", "bs512-opt", "bs1024-opt", "bs2048-opt", "bs1024-warmup-opt", "bs2048-warmup-opt"]


pytestmark = pytest.mark.usefixtures("in_repo_root")


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    return str(write_cifar100(tmp_path_factory.mktemp("cifar"), verbose=False))


def run_resnet(cifar_dir, expdir, *flags, config="tiny", yaml=RESNET_YAML):
    train.main(["--yaml_config", yaml, "--config", config, "--data_dir", cifar_dir, "--expdir", str(expdir), *flags])
    run_dir = os.path.join(str(expdir), config, "1GPU", "00")
    events = EventAccumulator(os.path.join(run_dir, "logs"))
    events.Reload()
    return run_dir, events, open(os.path.join(run_dir, "out.log")).read()


@pytest.mark.parametrize("name", ORIGINAL_CONFIGS)
def test_original_configs_keep_their_meaning(name):
    params = YParams(RESNET_YAML, name)
    apply_overrides(params, training_parser("t").parse_args([]), dp_size=1, dp_rank=0)
    assert params.arch == "resnet50" and params.momentum == 0.9 and params.weight_decay == 5e-4
    assert (params.amp_mode == "fp16") == ("amp" in name or "opt" in name)
    assert params.enable_nhwc == ("nhwc" in name or "opt" in name)
    assert params.enable_fused == params.cudnn_benchmark == ("extra" in name or name.endswith("-opt"))
    assert bool(params.enable_profiling) == name.endswith("-prof")


@pytest.mark.long  # on torch 2.5 the ResNet's steps run below (channels_last, bf16, DataParallel); learning: here
def test_cpu_run_learns_logs_accuracy_and_stops_at_desired_acc(cifar_dir, tmp_path):
    """tiny, ResNet18 on 5000 images of 100 classes, 156 steps per epoch: after one epoch the validation
    top-1 is far above chance (1%), so --desired_acc 0.05 stops the 3-epoch run there."""
    _, events, log = run_resnet(cifar_dir, tmp_path, "--num_epochs", "3", "--desired_acc", "0.05")
    tags = set(events.Tags()["scalars"])
    assert {"Loss/train", "Loss/valid", "Accuracy/top1/valid", "Accuracy/top5/valid", "Accuracy/top1/train",
            "Learning Rate"} <= tags
    top1 = [e.value for e in events.Scalars("Accuracy/top1/valid")]
    top5 = [e.value for e in events.Scalars("Accuracy/top5/valid")]
    assert [e.step for e in events.Scalars("Accuracy/top1/valid")] == [0, 156]  # stopped after epoch 1 of 3
    assert "Reached the desired validation accuracy 0.05 at iteration 156" in log
    assert top1[-1] > 0.08 and top5[-1] > top1[-1], (top1, top5)  # chance: 0.01 and 0.05
    valid = [e.value for e in events.Scalars("Loss/valid")]
    assert valid[-1] < valid[0]
    for iteration in (0, 20):  # from iteration 0 on, as the original
        assert re.search(rf"Epoch: 1, Iteration: {iteration}, Avg img/sec: \d+\.\d+", log)
    assert re.search(r"train acc1=\d\.\d+, valid acc1=\d\.\d+", log)


@pytest.mark.compat
@pytest.mark.long
def test_channels_last_bf16_and_dataparallel_run_on_cpu(cifar_dir, tmp_path):
    run_dir, _, log = run_resnet(cifar_dir, tmp_path, "--num_iters", "3", "--amp_mode", "bf16", "--enable_nhwc",
                                 "--enable_fused", "--parallel", "dp")
    assert "enable_nhwc True" in log and "amp_dtype torch.bfloat16" in log and "DONE ---- rank 0" in log
    checkpoint = torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)
    assert checkpoint["iteration"] == 3
    assert not any(name.startswith("module.") for name in checkpoint["model"])  # unwrapped weights


@pytest.mark.multiprocess
def test_imagefolder_path_trains(tmp_path):
    from sample_data.images import write_imagefolder
    data = write_imagefolder(tmp_path / "folders", verbose=False)
    _, events, _ = run_resnet(str(data), tmp_path / "runs", "--num_iters", "4", config="imagefolder_demo")
    assert events.Scalars("Accuracy/top1/valid")[-1].step == 4


def equivalence_yaml(tmp_path):
    """tiny without augmentation and with frozen BatchNorm: per-rank BatchNorm statistics are the one thing
    that makes N ranks differ from one process (SyncBatchNorm needs GPUs); everything else must match."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "resnet_eq.yaml"
    original = open(os.path.join(REPO_ROOT, RESNET_YAML)).read()
    path.write_text(original + "\nequal:\n  <<: *demo\n  augment: False\n  freeze_bn: True\n  num_data_workers: 0\n")
    return str(path)


def ddp_weights(cifar_dir, tmp_path, nproc, *flags):
    yaml = equivalence_yaml(tmp_path)
    argv = ["train.py", "--yaml_config", yaml, "--config", "equal", "--data_dir", cifar_dir, "--expdir",
            str(tmp_path), "--num_iters", "4", *flags]
    result = run_ranks(argv, nproc) if nproc > 1 else run_command(argv)  # plain ranks: torchrun is not under test
    assert result.returncode == 0, result.stderr[-3000:]
    path = os.path.join(str(tmp_path), "equal", f"{nproc}GPU", "00", "checkpoints", "ckpt.pt")
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.multiprocess
@pytest.mark.long
def test_two_ranks_match_one_process(cifar_dir, tmp_path):
    one = ddp_weights(cifar_dir, tmp_path / "one", 1)
    two = ddp_weights(cifar_dir, tmp_path / "two", 2)
    drift = ddp_weights(cifar_dir, tmp_path / "noddp", 2, "--noddp")
    diff = max((one[k].float() - two[k].float()).abs().max().item() for k in one)
    assert diff < 1e-5  # fp32 SGD, 4 steps: only the order of the gradient sums differs
    assert max((one[k].float() - drift[k].float()).abs().max().item() for k in one) > 100 * 1e-5


@pytest.mark.parametrize("flags, message", [
    (["--arch", "resnet_nope"], "arch 'resnet_nope' is not a torchvision classification model"),
    (["--data_dir", "/nowhere"], "CIFAR-100 not found in '/nowhere'; generate sample data with"),
    (["--parallel", "dp", "--desired_acc", "x"], "argument --desired_acc/--desired-acc: invalid float value"),
])
def test_bad_input_is_one_clear_line(cifar_dir, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        run_resnet(cifar_dir, tmp_path, *flags)
    assert exit_info.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if " - root - " not in line]
    assert len(err_lines) == 1 and err_lines[0].startswith("error: ") and message in err_lines[0], err_lines


def test_wrong_image_size_is_refused(tmp_path, capsys):
    folder = write_cifar100(tmp_path / "bad", train_per_class=1, test_per_class=1, verbose=False)
    train_file = folder / "cifar-100-python" / "train"
    content = pickle.loads(train_file.read_bytes(), encoding="latin1")
    content["data"] = content["data"][:, :1024]  # 16 x 16 x 4 values instead of 32 x 32 x 3
    train_file.write_bytes(pickle.dumps(content))
    manifest_path = folder / "cifar-100-python" / "SAMPLE_DATA.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["md5"]["train"] = hashlib.md5(train_file.read_bytes()).hexdigest()  # a consistent, wrong-sized set
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as exit_info:
        run_resnet(str(folder), tmp_path, "--num_iters", "1")
    assert exit_info.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if " - root - " not in line]
    assert len(err_lines) == 1 and "wrong image size" in err_lines[0] and "train" in err_lines[0], err_lines


def test_desired_acc_must_be_a_fraction(cifar_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_resnet(cifar_dir, tmp_path, "--desired_acc", "75")
    assert exit_info.value.code == 2 and "give the top-1 accuracy as a fraction" in capsys.readouterr().err
