"""The kernels a run computes with, chosen once at its start (start_run calls choose_kernels): the attention kernel
scaled_dot_product_attention may run (--sdpa_backend), cuDNN's autotuning on a GPU, denormals flushed on a CPU, and a
pair of flags refused where its kernels fail (a compiled channels_last UNet on a GPU)."""
import torch

from utils.errors import UserError, register_cleanup

# each attention kernel's switch and its setting as torch starts (what "auto" puts back)
_SDPA_SWITCHES = {"cudnn": torch.backends.cuda.enable_cudnn_sdp, "flash": torch.backends.cuda.enable_flash_sdp,
                  "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
                  "math": torch.backends.cuda.enable_math_sdp}


_SDPA_DEFAULTS = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
                  "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                  "math": torch.backends.cuda.math_sdp_enabled()}


def select_attention_backend(name, device, half=True):
    """Let scaled_dot_product_attention run only the kernel `name` (sdpa_backend), or torch's own choice ("auto").
    Why a switch: torch picks per version (on an H100, torch 2.11 picks cuDNN's kernel; FlashAttention-2 is 1.65x
    slower there); a run on an older torch can ask for another. `half`: the run's attention sees fp16/bf16."""
    if name in ("cudnn", "efficient") and device.type != "cuda":
        raise UserError(f"--sdpa_backend {name} is a CUDA kernel; on the CPU use auto, flash or math")
    if name in ("cudnn", "flash") and device.type == "cuda" and not half:
        raise UserError(f"--sdpa_backend {name} takes fp16/bf16 inputs only; add --amp_mode bf16, or use "
                        "--sdpa_backend efficient or math for fp32")
    for backend, switch in _SDPA_SWITCHES.items():
        switch(_SDPA_DEFAULTS[backend] if name == "auto" else backend == name)


def refuse_compiled_channels_last_unet(params, device):
    """On a GPU, torch.compile of the UNet in channels_last_3d stopped at its first backward (torch 2.11, fp16, an
    H200, 2026-11-28: Inductor expected a 512-channel 3D convolution's weight gradient in channels_last_3d, cuDNN
    returned it contiguous; compare PyTorch issue 171622); other torch versions were not tried, and on the CPU the
    pair runs. One line instead of Inductor's traceback at the first step."""
    if device.type == "cuda" and params.get("model") == "unet" and params.get("enable_nhwc") and params.enable_jit:
        raise UserError("--enable_nhwc with --enable_jit stops the UNet at its first backward on a GPU (torch.compile "
                        "expects another memory layout for a 3D convolution's weight gradient than cuDNN returns; "
                        "seen with torch 2.11, compare PyTorch issue 171622); use one of the two, e.g. add "
                        "--no-enable_jit (channels_last_3d alone was the faster on an H200)")


def choose_kernels(params, device):
    """At a run's start, before anything runs on `device`: the UNet pair that fails refused, the attention kernel of
    params.sdpa_backend (torch's own choice again when the run ends), cuDNN's autotuning (params.cudnn_benchmark) on a
    GPU, denormals flushed to zero on a CPU."""
    refuse_compiled_channels_last_unet(params, device)
    select_attention_backend(params.sdpa_backend, device, half=params.amp_enabled)
    register_cleanup(lambda: select_attention_backend("auto", device))  # the next run in this process: torch's choice
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = params.cudnn_benchmark
    else:
        torch.set_flush_denormal(True)  # tiny (denormal) floats slow CPU arithmetic down by 2-4x
