"""FLOPs per sample (counted once with torch.utils.flop_counter), the devices that share them, and the peak they are
measured against (a datasheet's, utils/gpus.py, or a measured matmul)."""
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from utils import comm
from utils.gpus import GPU_PEAKS


def train_flops_per_sample(build_model, params, sample_shape):
    """FLOPs of forward + backward for one sample of `sample_shape`, counted on the meta device: the serial model's
    (the model FLOPs of MFU), also on a rank of a tp x cp layout, which does its 1/(tp x cp) share of them. No
    collective runs (torch 2.5 has no meta kernels for them)."""
    batch = 2  # BatchNorm in training mode refuses a single value per channel (1x1 maps at batch 1)
    # a cp rank's loader reads a band of rows (distributed/bands.py); the FLOPs are the whole field's
    if params is not None and params.get("read_rows"):
        sample_shape = (*sample_shape[:-2], *params.img_size)
    with torch.device("meta"):
        model = build_model(params)  # serial: the recipe (distributed/parallelize.py) splits a model afterwards
        inp = torch.empty((batch, *sample_shape))
    with FlopCounterMode(display=False) as counter:
        model(inp).float().sum().backward()
    return counter.get_total_flops() // batch


def devices_in_use(args, device):
    """Devices sharing the model's FLOPs: one per rank, or every visible GPU under DataParallel (--parallel dp)."""
    if args.parallel == "dp" and device.type == "cuda":
        return torch.cuda.device_count()
    return comm.get_world_size()


def measure_matmul_peak(device, dtype=torch.float32, seconds=0.2, max_size=4096):
    """FLOP/s of a square matmul on `device`: the practical peak for CPUs and unknown GPUs.

    The size doubles until one matmul takes 20 ms (large enough to be compute bound, small enough to
    stay quick where a dtype is emulated, like bf16 on CPUs without native support).
    """

    def time_one(a, b):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    generator = torch.Generator(device).manual_seed(0)  # leaves the global RNG (dropout, resume) alone
    size = 256
    while True:
        a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
        b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
        torch.matmul(a, b)  # warm-up
        if time_one(a, b) > 0.02 or size >= max_size:
            break
        size *= 2
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        best = max(best, 2 * size**3 / time_one(a, b))
    return best


def fp32_matmuls_use_tf32():
    """Whether cuBLAS runs float32 matmuls on TF32 tensor cores: PyTorch's switch, or NGC containers'
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 (which overrides it), unless NVIDIA_TF32_OVERRIDE=0 turns TF32 off."""
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    return torch.backends.cuda.matmul.allow_tf32 or os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"


def fp32_convolutions_use_tf32():
    """Whether cuDNN runs float32 convolutions on TF32 tensor cores: PyTorch's switch (on by default), unless
    NVIDIA_TF32_OVERRIDE=0 turns TF32 off."""
    return os.environ.get("NVIDIA_TF32_OVERRIDE") != "0" and torch.backends.cudnn.allow_tf32


def peak_flops(device, dtype, convolutions=False):
    """(peak FLOP/s, where it comes from): the datasheet for known GPUs, else a measured matmul. `convolutions`: the
    model's FLOPs are convolutions (UNet, ResNet), whose fp32 peak is TF32's where cuDNN uses it, not cuBLAS."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for gpu, (half, tf32, fp32) in GPU_PEAKS.items():
            if gpu in name:
                if dtype in (torch.float16, torch.bfloat16):
                    return half, f"{gpu} datasheet {dtype}"
                if fp32_convolutions_use_tf32() if convolutions else fp32_matmuls_use_tf32():
                    return tf32, f"{gpu} datasheet tf32"
                return fp32, f"{gpu} datasheet fp32"
    if dtype == torch.float32:
        return measure_matmul_peak(device, dtype), f"measured {dtype} matmul on {device.type}"
    # reduced precision may be emulated (CPUs without native bf16): its own matmul is then slower than fp32,
    # while other kernels (oneDNN convolutions) are not; the better of the two keeps MFU at most 100%
    peak = max(measure_matmul_peak(device, dtype), measure_matmul_peak(device, torch.float32))
    return peak, f"best of measured {dtype} and torch.float32 matmul on {device.type}"


class Peak:
    """The peak MFU is measured against, for one device and dtype.

    Datasheet peaks are fixed. A measured peak (CPUs, unknown GPUs) is approximate: on a loaded machine the
    start-up matmul can run slower than the model later does. When a throughput beats it, the peak is measured
    again and raised to at least that throughput, so MFU never exceeds 100%.
    """

    def __init__(self, device, dtype, convolutions=False):
        self.device, self.dtype, self.convolutions = device, dtype, convolutions
        self.value, self.source = peak_flops(device, dtype, convolutions)
        self.measured = self.source.startswith(("measured", "best of measured"))

    def describe(self):
        note = "; MFU is approximate against a peak measured on this machine" if self.measured else ""
        return f"peak {self.value / 1e12:.3f} TFLOP/s per device ({self.source}){note}"

    def mfu(self, achieved):
        """achieved / peak, at most 1."""
        if achieved > self.value and self.measured:
            self.value = max(self.value, peak_flops(self.device, self.dtype, self.convolutions)[0], achieved)
        return min(achieved / self.value, 1.0)
