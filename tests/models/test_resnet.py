"""Tests for networks/resnet.py: a failure here means the ResNet no longer matches the tutorial's
CIFAR ResNet50 (parameter count, stride-1 stem without max-pool, 4x4 layer4 at 32x32), no longer
builds torchvision models by name for ImageFolder data, loads weights, or accepts a bad arch."""
import pytest
import torch
import torchvision

from networks.resnet import ResNet
from utils.errors import UserError

RESNET50_CIFAR100_PARAMETERS = 23_712_932  # FACTS C3, verified against the upstream model


class Params(dict):
    """The part of YParams the model builder uses: attribute access and get()."""

    __getattr__ = dict.__getitem__


def cifar_params(**overrides):
    return Params({"dataset": "cifar100", "num_classes": 100, "arch": "resnet50", "cifar_stem": True, **overrides})


@pytest.fixture(autouse=True)
def no_weight_downloads(monkeypatch):
    """Every test fails if a model asks torchvision for pretrained weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("ResNet() tried to load pretrained weights")

    monkeypatch.setattr(torchvision.models.WeightsEnum, "get_state_dict", refuse)


def test_resnet50_cifar_parameter_count_on_meta_device():
    """Failure: the CIFAR ResNet50 has the wrong layers or widths, or cannot be built on the meta
    device (the FLOP counter builds it there)."""
    with torch.device("meta"):
        model = ResNet(cifar_params())
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == RESNET50_CIFAR100_PARAMETERS


def test_cifar_stem_is_stride_one_without_max_pool():
    """Failure: the stem still downsamples 32x32 inputs (ImageNet stem kept, or max-pool left in)."""
    with torch.device("meta"):
        model = ResNet(cifar_params())
    stem = model.conv1
    assert (stem.in_channels, stem.out_channels) == (3, 64)
    assert stem.kernel_size == (7, 7) and stem.stride == (1, 1) and stem.padding == (3, 3)
    assert stem.bias is None
    assert isinstance(model.maxpool, torch.nn.Identity)


def test_cifar_forward_shapes():
    """Failure: 32x32 images do not give (B, 100) logits, or layer4 is not 4x4 (stem strides wrong)."""
    torch.manual_seed(0)
    model = ResNet(cifar_params()).eval()
    layer4_shapes = []
    model.layer4.register_forward_hook(lambda module, inp, out: layer4_shapes.append(tuple(out.shape)))
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 100)
    assert torch.isfinite(logits).all()
    assert layer4_shapes == [(2, 2048, 4, 4)]


def test_cifar_stem_off_gives_the_plain_torchvision_model():
    """Failure: cifar_stem: False (the demo configs) still changes the architecture."""
    with torch.device("meta"):
        model = ResNet(cifar_params(arch="resnet18", cifar_stem=False))
        reference = torchvision.models.resnet18(num_classes=100)
    assert model.conv1.stride == (2, 2) and isinstance(model.maxpool, torch.nn.MaxPool2d)
    assert [tuple(p.shape) for p in model.parameters()] == [tuple(p.shape) for p in reference.parameters()]


@pytest.mark.parametrize("arch", ["resnet50", "mobilenet_v3_small"])
def test_imagefolder_builds_torchvision_model_by_name(arch):
    """Failure: ImageFolder data does not get the unmodified torchvision model named by `arch`
    with num_classes outputs (as upstream's `-a ARCH`)."""
    params = Params({"dataset": "imagefolder", "num_classes": 10, "arch": arch})
    with torch.device("meta"):
        model = ResNet(params)
        reference = torchvision.models.get_model(arch, num_classes=10)
    assert type(model) is type(reference)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    assert model(torch.empty(2, 3, 64, 64, device="meta")).shape == (2, 10)


def test_unknown_arch_is_refused_with_suggestions():
    """Failure: a misspelt arch crashes inside torchvision instead of one line naming valid choices."""
    with pytest.raises(UserError, match=r"arch 'resnet5O' is not a torchvision classification model.*resnet50"):
        ResNet(cifar_params(arch="resnet5O"))


def test_cifar_stem_on_a_non_resnet_is_refused():
    """Failure: cifar_stem is silently ignored (or crashes) for a model without conv1/maxpool."""
    with pytest.raises(UserError, match="cifar_stem applies to ResNet"), torch.device("meta"):
        ResNet(cifar_params(arch="mobilenet_v3_small"))
