"""CUDA-only paths (NCCL-free single GPU: bf16 autocast, fused Adam, NVTX ranges, the profiler window).

Skipped without a GPU. A failure points to device handling in train.py, utils/comm.py or utils/profiling.py.
"""
import os

import pytest
import torch

import train
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_train_on_gpu_with_bf16_fused_and_profiler_window(era5_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    train.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path), "--num_iters", "140",
                "--amp_mode", "bf16", "--enable_fused", "--profile_epoch", "1", "--profile_iters", "5"])
    run_dir = os.path.join(str(tmp_path), "tiny", "1GPU", "00")
    log = open(os.path.join(run_dir, "out.log")).read()
    assert "datasheet" in log or "measured torch.bfloat16 matmul on cuda" in log
    checkpoint = torch.load(os.path.join(run_dir, "checkpoints", "ckpt.pt"), weights_only=False)
    assert checkpoint["iteration"] == 140
    assert all(torch.isfinite(v).all() for v in checkpoint["model"].values())
