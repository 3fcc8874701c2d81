"""CUDA-only paths (single GPU: bf16/fp16 autocast, fused optimizers, NVTX ranges, the profiler window, the
benchmark mode, DataParallel with channels_last; on 2 GPUs: tensor parallelism and FSDP over NCCL).

Skipped without a GPU. A failure points to device handling in train.py, utils/comm.py or loop/profiling.py.
"""
import json
import os

import pytest
import torch

import train
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_train_on_gpu_with_bf16_fused_and_profiler_window(era5_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", "140",
                "--amp_mode", "bf16", "--enable_fused", "--profile_epoch", "1", "--profile_iters", "5"])
    run_dir = os.path.join(str(tmp_path), "tiny", "1GPU", "00")
    log = open(os.path.join(run_dir, "out.log")).read()
    assert "datasheet" in log or "measured torch.bfloat16 and torch.float32 matmul on cuda" in log
    checkpoint = torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=True)
    assert checkpoint["iteration"] == 140
    assert all(torch.isfinite(v).all() for v in checkpoint["model"].values())


def test_unet_fp16_fused_benchmark_on_gpu(tmp_path, monkeypatch):
    from sample_data.cosmo import write_cosmo
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("BENCHY_OUTPUT", str(tmp_path / "bench"))
    data = write_cosmo(tmp_path / "cosmo", verbose=False)
    train.main(["--yaml_config", "config/UNet.yaml", "--config", "tiny", "--data_dir", str(data), "--expdir",
                str(tmp_path), "--enable_amp", "--enable_apex", "--enable_benchy", "--benchy_nbatches", "4",
                "--benchy_ntrials", "2", "--benchy_nwarmup", "1"])
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["device"].startswith("cuda") and results["FULL"]["mean"] > 0


def test_resnet_dataparallel_channels_last_fp16_on_gpu(tmp_path, monkeypatch):
    from sample_data.images import write_cifar100
    monkeypatch.chdir(REPO_ROOT)
    data = write_cifar100(tmp_path / "cifar", train_per_class=4, test_per_class=1, verbose=False)
    train.main(["--yaml_config", "config/ResNet50.yaml", "--config", "tiny", "--data_dir", str(data), "--expdir",
                str(tmp_path), "--num_iters", "5", "--parallel", "dp", "--enable_nhwc", "--amp_mode", "fp16",
                "--enable_fused"])
    checkpoint = torch.load(os.path.join(str(tmp_path), "tiny", "1GPU", "00", "checkpoints", "ckpt.pt"),
                            weights_only=True)
    assert checkpoint["iteration"] == 5 and checkpoint["scaler"]["scale"] > 0
    assert all(torch.isfinite(v.float()).all() for v in checkpoint["model"].values())


def test_train_mp_on_one_gpu_logs_cuda_memory(era5_dir, tmp_path, monkeypatch):
    import train_mp
    monkeypatch.chdir(REPO_ROOT)
    train_mp.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", "5",
                   "--amp_mode", "bf16"])
    log = open(os.path.join(str(tmp_path), "tiny", "1MP", "00", "out.log")).read()
    assert "Scaffolding memory high watermark:" in log and " Memory usage after forward pass:" in log


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs 2 GPUs")
def test_train_mp_tensor_parallel_over_nccl(era5_dir, tmp_path):
    from tests.conftest import run_command
    result = run_command(["train_mp.py", "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path),
                          "--num_iters", "5", "--tensor_parallel", "2", "--amp_mode", "fp16"], nproc=2, gpu=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Setting DP = 1, TP = 2, CP = 1" in result.stderr
    log = open(os.path.join(str(tmp_path), "tiny", "2MP", "00", "out.log")).read()
    assert "on cuda" in log or "datasheet" in log  # NCCL ranks on GPUs, not gloo on the CPU


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP over NCCL needs 2 GPUs")
def test_train_mp_fsdp_over_nccl_matches_one_gpu(era5_dir, tmp_path):
    """--fsdp at dp=2 on 2 GPUs (the container's torch 2.5 runs FSDP2 on CUDA only) ends where train.py on one GPU
    does (fp32; 1e-3 for the GPU kernels' rounding and the dp sum's order)."""
    from tests.conftest import run_command
    from tests.training.test_train_mp import results
    common = ["--config", "tiny", "--data_dir", era5_dir, "--num_iters", "10"]
    one = run_command(["train.py", *common, "--expdir", str(tmp_path / "one")], gpu=True)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_command(["train_mp.py", *common, "--expdir", str(tmp_path / "fsdp"), "--fsdp"], nproc=2, gpu=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "FSDP over dp=2" in two.stderr
    (points, checkpoint) = results(os.path.join(str(tmp_path / "fsdp"), "tiny", "1MP", "00"))
    (ref_points, ref_checkpoint) = results(os.path.join(str(tmp_path / "one"), "tiny", "1GPU", "00"))
    assert points == pytest.approx(ref_points, rel=1e-3)
    for name, weight in ref_checkpoint["model"].items():
        torch.testing.assert_close(checkpoint["model"][name], weight, atol=1e-3, rtol=1e-3, msg=name)


@pytest.mark.multiprocess
def test_two_ranks_on_one_gpu_are_refused_in_one_line(era5_dir, tmp_path):
    """More ranks than GPUs on a node: every rank stops with one line before NCCL's "Duplicate GPU detected"."""
    from tests.conftest import run_command
    result = run_command(["train.py", "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path),
                          "--num_iters", "2"], nproc=torch.cuda.device_count() + 1, gpu=True)
    assert result.returncode != 0
    assert "shared by two or more ranks of one node" in result.stderr


@pytest.mark.multiprocess
def test_cosmology_crops_turned_on_the_gpu_are_the_host_turned_crops(tmp_path):
    """On a GPU the cosmology loader turns its crops after the copy (turn_later by default), on its copy stream:
    with workers and without, the batches on the GPU are bit for bit those the host turns (issue #39)."""
    from sample_data.cosmo import write_cosmo
    from tests.datasets.test_cosmo_turn_later import assert_same, loader_of, params_of, pass_of
    data = write_cosmo(tmp_path / "cosmo", train_size=24, valid_size=16, verbose=False)
    reference = pass_of(loader_of(params_of(data, 0), True, False), 1)
    for workers in (0, 2):
        late = loader_of(params_of(data, workers), True, None)
        assert late.finish is not None
        got = pass_of(late, 1)
        assert all(tensor.is_cuda for batch in got for tensor in batch)
        assert_same([tuple(tensor.cpu() for tensor in batch) for batch in got], reference)
