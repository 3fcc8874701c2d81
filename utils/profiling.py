"""Nsight hooks: NVTX ranges and a cudaProfilerApi window (`nsys profile -c cudaProfilerApi`); no-ops on CPU."""
import contextlib

import torch


def nvtx_range(name):
    """An NVTX range around a block on CUDA; nothing on CPU."""
    return torch.cuda.nvtx.range(name) if torch.cuda.is_available() else contextlib.nullcontext()


class CudaProfilerWindow:
    """torch.cuda.profiler.start()/stop() around the first `num_iters` steps (None: all) of one epoch."""

    def __init__(self, epoch, num_iters=None, enabled=True):
        self.epoch = epoch
        self.num_iters = num_iters
        self.enabled = enabled and torch.cuda.is_available()
        self.running = False

    def step(self, epoch, step_in_epoch):
        """Call at the start of each step."""
        if not self.enabled or epoch != self.epoch:
            return
        if step_in_epoch == 0 and not self.running:
            torch.cuda.profiler.start()
            self.running = True
        elif self.running and self.num_iters is not None and step_in_epoch >= self.num_iters:
            self.end_epoch()

    def end_epoch(self):
        if self.running:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            self.running = False
