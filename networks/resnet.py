"""ResNet for image classification: torchvision's architectures, with the CIFAR stem for 32x32 inputs."""
import difflib

import torch.nn as nn
import torchvision

from utils.errors import UserError


def _check_arch(arch):
    valid_names = torchvision.models.list_models(module=torchvision.models)
    if arch in valid_names:
        return
    suggestions = difflib.get_close_matches(arch, valid_names, n=3) or ["resnet18", "resnet50", "wide_resnet50_2"]
    raise UserError(f"arch '{arch}' is not a torchvision classification model; use one of e.g. "
                    f"{', '.join(suggestions)} (all: torchvision.models.list_models())")


def ResNet(params):
    """The torchvision model `params.arch` (default resnet50) with `params.num_classes` outputs, never pretrained.

    For CIFAR-100 (unless `cifar_stem: False`) the stem keeps 32x32 inputs large, as the tutorial's
    ResNet50 does: a 7x7 stride-1 stem conv and no max-pool, so layer4 sees 4x4 instead of 1x1.
    """
    arch = params.get("arch", "resnet50")
    _check_arch(arch)
    model = torchvision.models.get_model(arch, num_classes=params.num_classes, weights=None)
    if params.dataset == "cifar100" and params.get("cifar_stem", True):
        if not isinstance(model, torchvision.models.ResNet):
            raise UserError(f"cifar_stem applies to ResNet architectures (resnet*, resnext*, wide_resnet*), "
                            f"not '{arch}'; set cifar_stem: False")
        stem = model.conv1
        model.conv1 = nn.Conv2d(stem.in_channels, stem.out_channels, kernel_size=7, stride=1, padding=3, bias=False)
        # same init torchvision gives its own convs (the replaced stem had it)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    return model
