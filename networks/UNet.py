"""3D UNet mapping N-body fields (4 channels) to hydrodynamic fields (5 channels), as in the sc21 tutorial.

Encoder: stride-2 convolutions (kernel 4) with LeakyReLU, 5 levels (6 with `full_scale`). Decoder: stride-2
transposed convolutions with ReLU, each fed [upsampled, encoder feature] concatenated along channels; the last
transposed convolution returns to the input resolution and a tanh bounds the output to (-1, 1). Its loss is
l1_rho_loss in task/loss.py (`loss: 'l1_rho'`).
"""
import torch
import torch.nn as nn

from utils.errors import UserError

DEFAULT_WEIGHT_INIT = {"conv_init": "normal", "conv_scale": 0.02, "conv_bias": 0.0}


def down_conv(in_channels, out_channels):
    """Halve the spatial size: Conv3d(k4, s2, p1) + LeakyReLU(0.01)."""
    return nn.Sequential(
        nn.Conv3d(in_channels, out_channels, kernel_size=4, stride=2, padding=1),
        nn.LeakyReLU(0.01, inplace=True),
    )


def up_conv(in_channels, out_channels):
    """Double the spatial size: ConvTranspose3d(k4, s2, p1) + ReLU."""
    return nn.Sequential(
        nn.ConvTranspose3d(in_channels, out_channels, kernel_size=4, stride=2, padding=1),
        nn.ReLU(inplace=True),
    )


def check_unet_params(params):
    """Refuse configs the UNet cannot take, with a sentence that says which numbers to change."""
    full_scale = params.full_scale
    levels = 6 if full_scale else 5
    multiple = 2**levels
    if params.data_size % multiple:
        raise UserError(f"data_size {params.data_size} is not divisible by {multiple} (2**{levels} for "
                        f"{levels} stride-2 levels, full_scale {full_scale}); choose a crop edge that is a "
                        f"multiple of {multiple}")
    weight_init = params.get("weight_init", DEFAULT_WEIGHT_INIT)
    conv_init = weight_init.get("conv_init", "normal")
    if conv_init != "normal":
        raise UserError(f"weight_init conv_init '{conv_init}' is unknown; only 'normal' "
                        "(weights ~ Normal(0, conv_scale)) is implemented")


class UNet(nn.Module):
    """The UNet of a config: N_in_channels -> N_out_channels, width `base_channels`, 5 or 6 levels."""

    def __init__(self, params):
        super().__init__()
        check_unet_params(params)
        in_channels = params.get("N_in_channels", 4)
        out_channels = params.N_out_channels
        base = params.get("base_channels", 64)
        self.full_scale = params.full_scale

        # channel ladder base, 2b, 4b, 8b, 8b(, 8b): 64 gives the tutorial's 4-64-128-256-512-512(-512)
        self.conv_down1 = down_conv(in_channels, base)
        self.conv_down2 = down_conv(base, 2 * base)
        self.conv_down3 = down_conv(2 * base, 4 * base)
        self.conv_down4 = down_conv(4 * base, 8 * base)
        self.conv_down5 = down_conv(8 * base, 8 * base)
        if self.full_scale:
            self.conv_down6 = down_conv(8 * base, 8 * base)
            self.conv_up6 = up_conv(8 * base, 8 * base)
            self.conv_up5 = up_conv(16 * base, 8 * base)  # takes [conv_up6, conv_down5]
        else:
            self.conv_up5 = up_conv(8 * base, 8 * base)  # takes conv_down5 directly
        self.conv_up4 = up_conv(16 * base, 4 * base)
        self.conv_up3 = up_conv(8 * base, 2 * base)
        self.conv_up2 = up_conv(4 * base, base)
        self.conv_last = nn.ConvTranspose3d(2 * base, out_channels, kernel_size=4, stride=2, padding=1)

        self.init_weights(params.get("weight_init", DEFAULT_WEIGHT_INIT))

    def init_weights(self, weight_init):
        """Every (transposed) convolution: weight ~ Normal(0, conv_scale), bias = conv_bias (None: untouched)."""
        conv_scale = weight_init.get("conv_scale", DEFAULT_WEIGHT_INIT["conv_scale"])
        conv_bias = weight_init.get("conv_bias", DEFAULT_WEIGHT_INIT["conv_bias"])
        for module in self.modules():
            if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
                nn.init.normal_(module.weight, mean=0.0, std=conv_scale)
                if conv_bias is not None and module.bias is not None:
                    nn.init.constant_(module.bias, conv_bias)

    def forward(self, x):
        d1 = self.conv_down1(x)
        d2 = self.conv_down2(d1)
        d3 = self.conv_down3(d2)
        d4 = self.conv_down4(d3)
        d5 = self.conv_down5(d4)
        if self.full_scale:
            x = torch.cat([self.conv_up6(self.conv_down6(d5)), d5], dim=1)
        else:
            x = d5
        x = torch.cat([self.conv_up5(x), d4], dim=1)
        x = torch.cat([self.conv_up4(x), d3], dim=1)
        x = torch.cat([self.conv_up3(x), d2], dim=1)
        x = torch.cat([self.conv_up2(x), d1], dim=1)
        return torch.tanh(self.conv_last(x))
