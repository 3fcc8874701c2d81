"""Losses, selected by the config's `loss` key: fn(prediction, target) -> scalar."""
import torch
import torch.nn.functional as F

from utils.errors import UserError

RHO_LOG_SCALE = 14.0  # UNet: Hydro channel 0 holds log(rho) / 14, so exp(14 * x) is the physical density


def l2_loss(pred, target):
    """Relative L2 error per sample, ||pred - target|| / ||target|| over (C, H, W); batch mean."""
    num_examples = pred.shape[0]
    diff_norms = torch.linalg.vector_norm(pred.reshape(num_examples, -1) - target.reshape(num_examples, -1),
                                          dim=1)
    target_norms = torch.linalg.vector_norm(target.reshape(num_examples, -1), dim=1)
    return torch.mean(diff_norms / target_norms)


def l1_rho_loss(gen, tar, lambda_rho):
    """Mean |gen - tar| over all elements, plus lambda_rho * mean |rho_gen - rho_tar| on channel 0 (the UNet).

    rho = exp(14 * x) is the physical density of Hydro channel 0; its term is averaged over the channel-0
    elements only (upstream's TorchScript variant averaged it over all 5 channels, making it 5x smaller).
    """
    loss = F.l1_loss(gen, tar)
    if lambda_rho != 0:
        rho_gen = torch.exp(RHO_LOG_SCALE * gen[:, 0])
        rho_tar = torch.exp(RHO_LOG_SCALE * tar[:, 0])
        loss = loss + lambda_rho * torch.mean(torch.abs(rho_gen - rho_tar))
    return loss


def get_loss(params):
    """fn(prediction, target) of the config's `loss` (l2, l1_rho, cross_entropy)."""
    name = params.get("loss", "l2")
    if name == "l2":  # ViT on ERA5
        return l2_loss
    if name == "l1_rho":  # UNet: L1, plus the density term in physical space when lambda_rho > 0
        lambda_rho = params.lambda_rho
        return lambda gen, tar: l1_rho_loss(gen, tar, lambda_rho)
    if name == "cross_entropy":  # ResNet: logits (B, classes) against labels (B,)
        return F.cross_entropy
    raise UserError(f"loss '{name}' is unknown; choose one of: l2, l1_rho, cross_entropy")
