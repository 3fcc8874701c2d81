"""pytest plugin (-p tests.gpu.fake_gpu_plugin) for tests/gpu/test_gpu_presence.py: torch.cuda says a GPU is present
(an H100) where there is none, as on the GPU node where `make test` must pass too. Nothing here can run a kernel."""
import torch


def pytest_configure(config):
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3"
