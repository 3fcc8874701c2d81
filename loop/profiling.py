"""Nsight hooks: NVTX ranges and a profiler window; no-ops on CPU.

The window both calls cudaProfilerStart/Stop (`nsys profile -c cudaProfilerApi`) and spans an NVTX range named
PROFILE (`nsys profile --capture-range=nvtx --nvtx-capture=PROFILE`, the ResNet stage's command).
"""
import contextlib

import torch


def nvtx_range(name):
    """An NVTX range around a block on CUDA; nothing on CPU."""
    return torch.cuda.nvtx.range(name) if torch.cuda.is_available() else contextlib.nullcontext()


class CudaProfilerWindow:
    """torch.cuda.profiler.start()/stop() and the NVTX range PROFILE around the first `num_iters` steps (None: all)
    of one epoch."""

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
            torch.cuda.nvtx.range_push("PROFILE")
            self.running = True
        elif self.running and self.num_iters is not None and step_in_epoch >= self.num_iters:
            self.end_epoch()

    def end_epoch(self):
        if self.running:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.profiler.stop()
            self.running = False


def peak_memory_gb(device):
    """Peak memory of this rank so far: the CUDA allocator's high watermark on a GPU, the process's maximum
    resident size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # kB on Linux


def local_tensor(tensor):
    """This rank's part of a tensor: the local shard of a DTensor (FSDP's sharded parameters), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class SavedActivations:
    """Bytes that autograd keeps for the backward pass while this context is open (torch.autograd.graph's
    saved-tensor hooks): the span of each storage that saved tensors cover, counted once (a batch that is a view of
    a data loader's larger buffer counts as the batch), the model's parameters left out (they are held anyway),
    each storage's size read when asked, so that what is freed in the meantime counts nothing (FSDP frees a block's
    all-gathered weights after its forward; the root's stay gathered and are parameters). A measurement of the
    activation memory of a forward pass, on any device."""

    def __init__(self, model):
        self.model = model
        self.parameters = self._parameter_storages()
        self.spans = {}  # storage pointer -> (storage, first byte, end byte) covered by saved tensors

    def _parameter_storages(self):
        return {local_tensor(param).untyped_storage().data_ptr() for param in self.model.parameters()}

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.parameters:
            extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
            start = tensor.storage_offset() * tensor.element_size()
            end = start + (extent if tensor.numel() else 0) * tensor.element_size()
            _, first, last = self.spans.get(ptr, (storage, start, end))
            self.spans[ptr] = (storage, min(first, start), max(last, end))
        return tensor

    @property
    def nbytes(self):
        parameters = self.parameters | self._parameter_storages()
        return sum(min(storage.nbytes(), end - start) for ptr, (storage, start, end) in self.spans.items()
                   if ptr not in parameters)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)
