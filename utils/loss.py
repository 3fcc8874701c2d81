"""Losses, selected by the config's `loss` key."""
import torch

from utils.errors import UserError


def l2_loss(pred, target):
    """Relative L2 error per sample, ||pred - target|| / ||target|| over (C, H, W); batch mean."""
    num_examples = pred.shape[0]
    diff_norms = torch.linalg.vector_norm(pred.reshape(num_examples, -1) - target.reshape(num_examples, -1),
                                          dim=1)
    target_norms = torch.linalg.vector_norm(target.reshape(num_examples, -1), dim=1)
    return torch.mean(diff_norms / target_norms)


LOSSES = {"l2": l2_loss}


def get_loss(params):
    name = params.get("loss", "l2")
    if name not in LOSSES:
        raise UserError(f"loss '{name}' is unknown; choose one of: {', '.join(LOSSES)}")
    return LOSSES[name]
