"""3D UNet shapes, exact parameter counts, weight init and the loss. Failures point to networks/UNet.py
(layer ladder or skip connections for counts/shapes, init_weights for the statistics) or to task/loss.py
(l1_rho_loss, for values)."""
import math

import pytest
import torch

from networks.UNet import UNet, check_unet_params
from task.loss import l1_rho_loss
from utils.errors import UserError
from utils.YParams import YParams


def _params(config="tiny", **changes):
    params = YParams("config/UNet.yaml", config)
    params.update(changes)
    return params


@pytest.mark.parametrize("full_scale, expected", [(True, 116_977_029), (False, 66_644_357)])
def test_parameter_counts_of_the_tutorial_model(full_scale, expected):
    with torch.device("meta"):  # full-size models without allocating them
        model = UNet(_params("base", full_scale=full_scale))
    assert sum(p.numel() for p in model.parameters()) == expected


def test_full_size_forward_on_meta():
    with torch.device("meta"):
        model = UNet(_params("base"))
        out = model(torch.empty(2, 4, 64, 64, 64))
    assert out.shape == (2, 5, 64, 64, 64)


def test_state_dict_names_match_the_original_tutorial():
    """Failure: a submodule was renamed, so a checkpoint of the original sc21 tutorial no longer loads by name."""
    with torch.device("meta"):
        model = UNet(_params("base", full_scale=True))
    prefixes = {key.split(".")[0] for key in model.state_dict()}
    assert prefixes == {*(f"conv_down{i}" for i in range(1, 7)), *(f"conv_up{i}" for i in range(2, 7)), "conv_last"}


@pytest.mark.parametrize("full_scale, data_size", [(False, 32), (True, 64)])
def test_output_shape_and_tanh_range(full_scale, data_size):
    torch.manual_seed(0)
    model = UNet(_params(base_channels=2, full_scale=full_scale, data_size=data_size)).eval()
    with torch.no_grad():
        out = model(10 * torch.randn(1, 4, data_size, data_size, data_size))  # large inputs push tanh
    assert out.shape == (1, 5, data_size, data_size, data_size)
    assert out.abs().max() < 1.0
    assert out.std() > 0.01  # not a constant output


def test_init_follows_weight_init():
    torch.manual_seed(0)
    model = UNet(_params(base_channels=8))
    convs = [m for m in model.modules() if isinstance(m, (torch.nn.Conv3d, torch.nn.ConvTranspose3d))]
    assert len(convs) == 10  # conv_down1..5, conv_up5..2, conv_last
    weights = torch.cat([m.weight.flatten() for m in convs])
    assert weights.numel() > 500_000
    assert weights.std().item() == pytest.approx(0.02, rel=0.02)
    assert abs(weights.mean().item()) < 1e-3
    assert all(torch.all(m.bias == 0) for m in convs)

    model = UNet(_params(base_channels=8, weight_init={"conv_init": "normal", "conv_scale": 0.05, "conv_bias": 0.1}))
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, torch.nn.Conv3d)])
    assert weights.std().item() == pytest.approx(0.05, rel=0.02)
    assert all(torch.all(m.bias == 0.1) for m in model.modules() if isinstance(m, torch.nn.ConvTranspose3d))


def test_loss_on_hand_computable_inputs():
    gen = torch.zeros(2, 5, 1, 1, 1)
    tar = torch.zeros(2, 5, 1, 1, 1)
    tar[0, 0] = 0.1  # channel 0 (density), first sample
    tar[1, 3] = -0.3  # another channel: only in the L1 part
    l1 = (0.1 + 0.3) / 10
    rho_term = (math.exp(1.4) - 1.0) / 2  # mean over the 2 channel-0 elements, not over all 10
    assert l1_rho_loss(gen, tar, 0).item() == pytest.approx(l1, rel=1e-6)
    assert l1_rho_loss(gen, tar, 0.5).item() == pytest.approx(l1 + 0.5 * rho_term, rel=1e-6)


@pytest.mark.parametrize("lambda_rho", [0.0, 0.1])
@pytest.mark.multiprocess
def test_compiled_loss_equals_eager(lambda_rho):
    generator = torch.Generator().manual_seed(0)
    gen = 0.2 * torch.rand(2, 5, 4, 4, 4, generator=generator) - 0.1
    tar = 0.2 * torch.rand(2, 5, 4, 4, 4, generator=generator) - 0.1
    eager = l1_rho_loss(gen, tar, lambda_rho)
    compiled = torch.compile(l1_rho_loss, fullgraph=True)(gen, tar, lambda_rho)
    assert eager.item() > 0.01
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("full_scale, data_size, multiple", [(True, 32, 64), (True, 96, 64), (False, 48, 32)])
def test_crop_sizes_that_do_not_divide_are_refused(full_scale, data_size, multiple):
    params = _params(full_scale=full_scale, data_size=data_size)
    with pytest.raises(UserError, match=f"data_size {data_size} is not divisible by {multiple}"):
        check_unet_params(params)
    with pytest.raises(UserError):
        UNet(params)


def test_unknown_conv_init_is_refused():
    with pytest.raises(UserError, match="conv_init 'xavier' is unknown"):
        UNet(_params(weight_init={"conv_init": "xavier", "conv_scale": 0.02, "conv_bias": 0.0}))


@pytest.mark.parametrize("model, device, nhwc, jit, refused", [
    ("unet", "cuda", True, True, True),
    ("unet", "cpu", True, True, False),  # the pair trains on the CPU (train.py, tiny, run by hand)
    ("unet", "cuda", True, False, False),
    ("unet", "cuda", False, True, False),
    ("vit", "cuda", True, True, False),  # 2D convolutions in channels_last: not seen failing
    ("resnet", "cuda", True, True, False),
])
def test_compiled_channels_last_unet_is_refused_on_a_gpu_in_one_line(model, device, nhwc, jit, refused):
    """On an H200 (torch 2.11) `--enable_nhwc --enable_jit` stopped the UNet at its first backward with Inductor's
    stride assertion (bench_results/gpu/h200/heads64.log); start_run refuses the pair there, and only there."""
    from lifecycle.kernels import refuse_compiled_channels_last_unet
    params = YParams("config/UNet.yaml", "tiny")
    params.update({"model": model, "enable_nhwc": nhwc, "enable_jit": jit})
    if refused:
        with pytest.raises(UserError, match=r"^--enable_nhwc with --enable_jit stops the UNet at its first backward "
                                            r"on a GPU .*PyTorch issue 171622\); use one of the two"):
            refuse_compiled_channels_last_unet(params, torch.device(device))
    else:
        refuse_compiled_channels_last_unet(params, torch.device(device))


def test_train_py_refuses_the_pair_where_the_device_is_a_gpu(tmp_path, monkeypatch, capsys):
    """start_run asks before anything touches the device: with comm.get_device standing in for a GPU, train.py
    exits 2 with the one line and makes no run directory. Twin: without --enable_jit the same run goes past the
    check (to the loaders, where the test stops it)."""
    import train
    from sample_data.cosmo import write_cosmo
    from tests.conftest import REPO_ROOT
    from utils import comm

    class PastTheCheck(Exception):
        pass

    def loaders_reached(*args, **kwargs):
        raise PastTheCheck()

    monkeypatch.chdir(REPO_ROOT)
    data = write_cosmo(tmp_path / "cosmo", verbose=False)
    argv = ["--yaml_config", "config/UNet.yaml", "--config", "tiny", "--data_dir", str(data), "--expdir",
            str(tmp_path / "runs"), "--num_iters", "1", "--enable_nhwc"]
    monkeypatch.setattr(comm, "get_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(train, "get_data_loader_distributed", loaders_reached)
    with pytest.raises(SystemExit) as exit_info:
        train.main([*argv, "--enable_jit"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if " - root - " not in line]
    assert len(errors) == 1 and errors[0].startswith("error: --enable_nhwc with --enable_jit stops the UNet"), errors
    assert not (tmp_path / "runs").exists()
    with pytest.raises(PastTheCheck):
        train.main(argv)
