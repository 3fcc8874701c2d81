"""Learning-rate schedules of the three stages, checked at known steps. Failures point to task/optim.py
(or to the config values it reads in config/UNet.yaml and config/ResNet50.yaml)."""
import math

import pytest
import torch

from lifecycle.cli import apply_overrides, training_parser
from task.optim import get_lr_scheduler, get_optimizer
from utils.YParams import YParams

pytestmark = [
    pytest.mark.filterwarnings("ignore:Detected call of"),  # no optimizer steps here
    pytest.mark.usefixtures("in_repo_root"),
]


def lrs_of(yaml, config, steps_per_epoch, flags=(), dp_size=1):
    """params and lr(it) for 1-based iterations it = 1 .. num_iters, from a real optimizer and scheduler."""
    params = YParams(yaml, config)
    apply_overrides(params, training_parser("t").parse_args(list(flags)), dp_size=dp_size, dp_rank=0)
    if params.get("num_iters") is None:
        params.num_iters = params.num_epochs * steps_per_epoch
    optimizer = get_optimizer(params, torch.nn.Linear(1, 1))
    scheduler = get_lr_scheduler(params, optimizer, steps_per_epoch)
    lrs = []
    for _ in range(params.num_iters):
        lrs.append(optimizer.param_groups[0]["lr"])  # the lr the step of this iteration uses
        scheduler.step()
    return params, scheduler, [None] + lrs  # index = 1-based iteration


def test_unet_base_cosine_from_start_lr_to_end_lr():
    """base: 10 epochs x 65536 // 64 = 10240 steps, no warm-up (no batch scaling on one GPU)."""
    params, _, lr = lrs_of("config/UNet.yaml", "base", 65536 // 64)
    assert params.num_iters == 10240
    assert lr[1] == pytest.approx(2.0e-4, rel=1e-6)
    assert lr[1024] == pytest.approx(1.951e-4, rel=1e-3)
    assert lr[10240] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(lr[1:], lr[2:]))  # monotone decay


def test_unet_scaled_batch_warms_up_then_spans_the_rest_exactly():
    """bs512_opt: sqrt scaling from 64, 128 warm-up steps, 40 epochs x 128 steps; the cosine ends at end_lr."""
    params, _, lr = lrs_of("config/UNet.yaml", "bs512_opt", 65536 // 512, dp_size=32)
    init_lr = 2e-4 * math.sqrt(512 / 64)
    assert params.num_iters == 5120
    assert lr[1] == pytest.approx(init_lr / 128, rel=1e-6)  # 4.42e-6
    assert lr[64] == pytest.approx(init_lr / 2, rel=1e-6)
    assert lr[128] == pytest.approx(init_lr, rel=1e-6)  # warm-up end = peak
    assert max(lr[1:]) == pytest.approx(init_lr, rel=1e-6)
    midpoint = 128 + (5120 - 128) // 2
    assert lr[midpoint] == pytest.approx(init_lr / 2, rel=1e-3)
    assert lr[5120] == pytest.approx(0.0, abs=1e-12)  # exactly end_lr at the last step (upstream: above it)


def test_unet_linear_scaling_and_end_lr():
    params = YParams("config/UNet.yaml", "bs256_opt")
    params.lr_schedule = {**params.lr_schedule, "scaling": "linear", "end_lr": 1e-5}
    params.update({"enable_fused": False, "num_iters": 1000, "local_batch_size": 64})
    optimizer = get_optimizer(params, torch.nn.Linear(1, 1))
    scheduler = get_lr_scheduler(params, optimizer, 100)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-4 * 4 / 128)  # it = 1 of the warm-up
    for _ in range(999):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-5)


def test_resnet_warmup_by_epoch_then_plateau():
    """bs1024-warmup-opt: lr 0.28 over 8 warm-up epochs (0.035, 0.07, ...), then ReduceLROnPlateau x0.2."""
    params, scheduler, lr = lrs_of("config/ResNet50.yaml", "bs1024-warmup-opt", 10, dp_size=8)
    assert [lr[1 + 10 * epoch] for epoch in range(3)] == pytest.approx([0.035, 0.07, 0.105])
    assert lr[80] == pytest.approx(0.28) and lr[81] == pytest.approx(0.28)  # warm-up over: stays until plateau
    optimizer = scheduler.optimizer
    for _ in range(12):  # a validation loss that never improves: after patience 10, one reduction
        scheduler.end_epoch(1.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.28 * 0.2)
    state = scheduler.state_dict()
    assert state["last_epoch"] == params.num_iters
