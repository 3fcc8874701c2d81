"""Peak FLOP/s of the GPUs the tutorial names: one table for MFU (loop/flops.py) and the performance model
(planning/perf_model.py).

Dense peaks, from NVIDIA's datasheets (SXM boards): the datasheets give the tensor-core figures with 2:4 structured
sparsity (marked *), which doubles them; a dense matmul reaches half. Looked up by a device's name
(torch.cuda.get_device_name): its first key found in the name.
"""
from typing import NamedTuple


class GpuPeaks(NamedTuple):
    """FLOP/s of one GPU: `half` on the bf16/fp16 tensor cores, `tf32` fp32 matmuls on the TF32 tensor cores, `fp32`
    on the CUDA cores (no tensor cores)."""
    half: float
    tf32: float
    fp32: float

    def tensor_flops(self):
        """{precision: tensor-core FLOP/s}, as the performance model reads them."""
        return {"bf16": self.half, "fp16": self.half, "tf32": self.tf32}


GPU_PEAKS = {
    # NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 Tensor Core 312 TFLOPS (624*), TF32 Tensor Core 156 TFLOPS
    # (312*), FP32 19.5 TFLOPS
    "A100": GpuPeaks(312e12, 156e12, 19.5e12),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16/FP16 Tensor Core 1,979* TFLOPS, TF32 Tensor Core 989*,
    # FP32 67 (dense: 989.5 and 494.5, kept at 989 and 494)
    "H100": GpuPeaks(989e12, 494e12, 67e12),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: the H100 SXM's figures (the same GH100 chip, more memory)
    "H200": GpuPeaks(989e12, 494e12, 67e12),
}
