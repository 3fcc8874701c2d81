"""Every optimizer the configs can build survives a first step the fp16 loss scaler finds overflowed.

With fp16, GradScaler hands a fused optimizer its inf flag instead of skipping step(). torch's fused SGD then
allocates its momentum buffers uninitialised on a first step, returns at once, and keeps them: the next step
multiplies garbage (the ResNet configs with enable_fused stopped on a nan loss at iteration 3 on an H100 and on a
CPU). A failure here points to task/optim.zero_momentum_buffers or to an optimizer a config newly builds.
"""
import copy
import os

import pytest
import torch

from lifecycle.cli import apply_overrides, training_parser
from task.optim import get_optimizer
from tests.conftest import REPO_ROOT
from utils.YParams import YParams, read_configs

pytestmark = [pytest.mark.usefixtures("in_repo_root"), pytest.mark.compat]
YAMLS = ("config/ViT.yaml", "config/UNet.yaml", "config/ResNet50.yaml")


def config_params(yaml, name):
    """A config as the training scripts see it (the ResNet's enable_extra_opts turns enable_fused on)."""
    params = YParams(os.path.join(REPO_ROOT, yaml), name)
    apply_overrides(params, training_parser("t").parse_args([]), dp_size=1, dp_rank=0)
    return params


def buildable_optimizers():
    """One config per (yaml, optimizer, enable_fused) the YAML files hold, each also with foreach kernels."""
    seen = {}
    for yaml in YAMLS:
        for name in read_configs(os.path.join(REPO_ROOT, yaml)):
            params = config_params(yaml, name)
            seen.setdefault((yaml, params.get("optimizer", "Adam"), bool(params.get("enable_fused"))), name)
    cases = []
    for (yaml, optimizer, fused), name in sorted(seen.items()):
        stage = f"{os.path.basename(yaml)[:-5]}-{name}-{optimizer}"
        cases.append(pytest.param(yaml, name, "fused" if fused else "default", id=f"{stage}-{'fused' * fused}"))
        if not fused:
            cases.append(pytest.param(yaml, name, "foreach", id=f"{stage}-foreach"))
    return cases


def build(yaml, name, kernels, model):
    optimizer = get_optimizer(config_params(yaml, name), model)
    if kernels == "foreach":
        for group in optimizer.param_groups:
            group["foreach"] = True
    return optimizer


def scaled_step(model, optimizer, scaler, overflow):
    """One fp16-style step: the loss scaled, an inf gradient when `overflow` (the scaler then skips the step)."""
    optimizer.zero_grad(set_to_none=True)
    inp = torch.linspace(-1, 1, 8).reshape(2, 4)
    loss = model(inp).square().mean()
    scaler.scale(loss).backward()
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()


def overflow_then_finite(yaml, name, kernels):
    """(weights after an overflowed step and a finite one, weights after the finite step alone)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    optimizer = build(yaml, name, kernels, model)
    scaled_step(model, optimizer, scaler, overflow=True)
    assert scaler.get_scale() == 2.0**15  # the step was seen as overflowed
    scaled_step(model, optimizer, scaler, overflow=False)
    scaled_step(reference, build(yaml, name, kernels, reference), torch.amp.GradScaler("cpu", init_scale=2.0**15),
                overflow=False)
    return model.state_dict(), reference.state_dict()


@pytest.fixture
def uninitialised_memory_is_nan(monkeypatch):
    """Make what empty_like returns nan, as reused GPU memory can be (fresh CPU pages are often zero)."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))


@pytest.mark.parametrize("yaml, name, kernels", buildable_optimizers())
def test_an_overflowed_first_step_leaves_no_trace(yaml, name, kernels, uninitialised_memory_is_nan):
    """After a skipped (overflowed) first step, the next step gives the weights a fresh optimizer's first step
    gives: the skipped step left no state behind (momentum buffers, Adam's moments and step count)."""
    got, expected = overflow_then_finite(yaml, name, kernels)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7, msg=f"{name} {kernels}: {key}")


def test_without_zeroed_buffers_fused_sgd_keeps_the_garbage(uninitialised_memory_is_nan, monkeypatch):
    """The twin: with the buffers left for the fused SGD to allocate, the overflowed first step keeps them
    uninitialised and the weights turn nan."""
    monkeypatch.setattr("task.optim.zero_momentum_buffers", lambda optimizer: optimizer)
    got, _ = overflow_then_finite("config/ResNet50.yaml", "bs128-opt", "fused")
    assert config_params("config/ResNet50.yaml", "bs128-opt").enable_fused
    assert torch.isnan(got["weight"]).any()
