"""Optimizer and learning-rate schedule, selected by the config (`optimizer`, `lr_schedule`)."""
import math

import torch

from utils.errors import UserError


def get_optimizer(params, model):
    """Adam with betas (0.9, 0.95), as in the tutorial; fused kernels when `enable_fused`."""
    name = params.get("optimizer", "Adam")
    if name != "Adam":
        raise UserError(f"optimizer '{name}' is unknown; choose one of: Adam")
    return torch.optim.Adam(model.parameters(), lr=params.lr, betas=(0.9, 0.95),
                            fused=bool(params.enable_fused) or None)


def cosine_with_warmup(warmup_iters, total_iters):
    """LR factor at scheduler step x: linear warm-up over `warmup_iters`, cosine to 0 at `total_iters`."""

    def factor(x):
        cosine = 0.5 * (1 + math.cos(math.pi * x / total_iters))
        return min((x + 1) / warmup_iters, cosine) if warmup_iters > 0 else cosine

    return factor


def get_lr_scheduler(params, optimizer):
    """Stepped once per iteration; 'cosine' ends at 0 after num_iters, 'constant' keeps lr."""
    name = params.lr_schedule
    if name == "cosine":
        factor = cosine_with_warmup(params.warmup, params.num_iters)
    elif name == "constant":
        def factor(x):
            return 1.0
    else:
        raise UserError(f"lr_schedule '{name}' is unknown; choose one of: cosine, constant")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
