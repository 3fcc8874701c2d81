"""Losses, selected by the config's `loss` key: fn(prediction, target) -> scalar."""
import torch
import torch.nn.functional as F

from utils.errors import UserError


def l2_loss(pred, target):
    """Relative L2 error per sample, ||pred - target|| / ||target|| over (C, H, W); batch mean."""
    num_examples = pred.shape[0]
    diff_norms = torch.linalg.vector_norm(pred.reshape(num_examples, -1) - target.reshape(num_examples, -1),
                                          dim=1)
    target_norms = torch.linalg.vector_norm(target.reshape(num_examples, -1), dim=1)
    return torch.mean(diff_norms / target_norms)


def get_loss(params):
    name = params.get("loss", "l2")
    if name == "l2":  # ViT on ERA5
        return l2_loss
    if name == "l1_rho":  # UNet: L1, plus the density term in physical space when lambda_rho > 0
        from networks.UNet import loss_func
        lambda_rho = params.lambda_rho
        return lambda gen, tar: loss_func(gen, tar, lambda_rho)
    if name == "cross_entropy":  # ResNet: logits (B, classes) against labels (B,)
        return F.cross_entropy
    raise UserError(f"loss '{name}' is unknown; choose one of: l2, l1_rho, cross_entropy")
