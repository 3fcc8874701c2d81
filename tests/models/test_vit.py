"""ViT shapes and exact parameter counts of the tutorial's configs. Failures point to networks/vit.py."""
import pytest
import torch

from networks import get_model
from networks.vit import ViT
from utils.errors import UserError
from utils.layout import Layout
from utils.YParams import YParams


@pytest.mark.parametrize("config, expected", [("base", 23_832_960), ("mp", 157_926_400), ("mp_patch4", 168_401_920)])
def test_parameter_counts(config, expected):
    with torch.device("meta"):  # full-size models without allocating them
        model = ViT(YParams("config/ViT.yaml", config))
    assert sum(p.numel() for p in model.parameters()) == expected


def test_base_output_shape_on_meta():
    with torch.device("meta"):
        model = ViT(YParams("config/ViT.yaml", "base"))
        out = model(torch.empty(2, 20, 360, 720))
    assert out.shape == (2, 20, 360, 720)


def test_unpatchify_puts_each_token_back_on_its_own_pixels():
    """Without blocks, changing one input patch must change exactly that patch of the output."""
    params = YParams("config/ViT.yaml", "tiny")
    params.update({"depth": 0})
    model = get_model(params).eval()
    inp = torch.zeros(1, 20, 16, 32)
    with torch.no_grad():
        baseline = model(inp)
        inp[:, :, 8:12, 20:24] = torch.randn(20, 4, 4)  # patch row 2, column 5 (patch size 4)
        changed = (model(inp) - baseline).abs().sum(dim=(0, 1)) > 0
    expected = torch.zeros(16, 32, dtype=torch.bool)
    expected[8:12, 20:24] = True
    assert torch.equal(changed, expected)


def test_samples_are_independent():
    model = get_model(YParams("config/ViT.yaml", "tiny")).eval()
    inp = torch.randn(2, 20, 16, 32)
    with torch.no_grad():
        both = model(inp)
        first = model(inp[:1])
    torch.testing.assert_close(both[:1], first, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("changes, layout, message", [
    ({"img_size": [18, 32]}, {}, r"img_size \[18, 32\] is not divisible by patch_size 4"),
    ({"embed_dim": 33}, {}, "embed_dim 33 is not divisible by num_heads 2"),
    ({"dropout": 0.1}, {"tp": 2, "sequence_parallel": True}, "dropout 0.1 with --sequence_parallel would draw"),
    ({"num_heads": 4}, {"tp": 8}, "num_heads 4 does not divide by tp = 8"),
])
def test_shapes_that_do_not_divide_are_refused(changes, layout, message):
    """The ViT's own shape rules, and the layout's rules on its shape (utils/layout.py), when it is built."""
    params = YParams("config/ViT.yaml", "tiny")
    params.update(changes)
    with pytest.raises(UserError, match=message):
        ViT(params, Layout(**layout))


@pytest.mark.parametrize("backend, kernel", [("math", "aten::_scaled_dot_product_attention_math"),
                                             ("flash", "aten::_scaled_dot_product_flash_attention_for_cpu")])
def test_sdpa_backend_runs_the_kernel_it_names(backend, kernel):
    """--sdpa_backend (config sdpa_backend) leaves scaled_dot_product_attention one kernel; "auto" gives torch's
    choice back. On the CPU: math or flash, each seen in the profiler (each check fails under the other backend).
    Not in the compat subset: torch 2.5's profiler starts a process."""
    from lifecycle.kernels import select_attention_backend
    q = torch.randn(2, 4, 16, 8)

    def kernels_run():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return {event.name for event in prof.events()}

    try:
        select_attention_backend(backend, torch.device("cpu"))
        assert kernel in kernels_run()
        other = {"math": "flash", "flash": "math"}[backend]
        select_attention_backend(other, torch.device("cpu"))
        assert kernel not in kernels_run()
    finally:
        select_attention_backend("auto", torch.device("cpu"))
    assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


@pytest.mark.parametrize("backend, device, half, refused", [
    ("cudnn", "cpu", True, "--sdpa_backend cudnn is a CUDA kernel; on the CPU use auto, flash or math"),
    ("flash", "cuda", False, "--sdpa_backend flash takes fp16/bf16 inputs only; add --amp_mode bf16"),
    ("cudnn", "cuda", False, "--sdpa_backend cudnn takes fp16/bf16 inputs only"),
])
def test_sdpa_backend_refuses_what_cannot_run_in_one_line(backend, device, half, refused):
    """Refused before any switch moves (no GPU needed): a CUDA kernel on the CPU; FlashAttention or cuDNN in fp32,
    which would otherwise fail at the first forward with torch's "No available kernel"."""
    from lifecycle.kernels import select_attention_backend
    with pytest.raises(UserError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        select_attention_backend(backend, torch.device(device), half=half)
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
