"""Profiling hooks: NVTX ranges and a profiler window for Nsight Systems (no-ops on CPU), and the same window as a
torch.profiler trace (`--torch_profile PATH`, on any device).

The window both calls cudaProfilerStart/Stop (`nsys profile -c cudaProfilerApi`) and spans an NVTX range named
PROFILE (`nsys profile --capture-range=nvtx --nvtx-capture=PROFILE`, the ResNet stage's command). With a trace path
it also records torch.profiler over the window (CPU ops, and CUDA kernels and copies on a GPU), with the loop's NVTX
ranges (`step N`, `forward`, ...) as named ranges, and writes a Chrome trace (gzipped where the path ends in .gz)
that `python -m benchmarks.step_profile` reduces to a table and draws as a timeline. Like the Nsight window, it
starts at the first step of its epoch: a run resumed in the middle of that epoch records nothing.
"""
import contextlib
import logging
import os

import torch

_tracing = False  # a torch.profiler window is recording: nvtx_range also names its range there


def nvtx_range(name):
    """An NVTX range around a block on CUDA, also a named range in a torch.profiler trace being recorded; nothing on
    CPU otherwise."""
    if _tracing:
        return _named_range(name)
    return torch.cuda.nvtx.range(name) if torch.cuda.is_available() else contextlib.nullcontext()


@contextlib.contextmanager
def _named_range(name):
    with torch.profiler.record_function(name):
        if torch.cuda.is_available():
            with torch.cuda.nvtx.range(name):
                yield
        else:
            yield


def trace_path(path, rank, world_size):
    """The trace file of this rank: PATH itself for one rank, PATH with `.rank<R>` before its extension for many."""
    if world_size <= 1:
        return path
    root, ext = (path[:-8], ".json.gz") if path.endswith(".json.gz") else os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class CudaProfilerWindow:
    """torch.cuda.profiler.start()/stop() and the NVTX range PROFILE around the first `num_iters` steps (None: all)
    of one epoch; with `trace` (a file path), a torch.profiler recording of the same steps written there."""

    def __init__(self, epoch, num_iters=None, enabled=True, trace=None):
        self.epoch = epoch
        self.num_iters = num_iters
        self.enabled = enabled and torch.cuda.is_available()
        self.trace = None
        if trace:
            rank, size = ((torch.distributed.get_rank(), torch.distributed.get_world_size())
                          if torch.distributed.is_available() and torch.distributed.is_initialized() else (0, 1))
            self.trace = trace_path(trace, rank, size)
        self.profiler = None
        self.running = False
        self.recorded = False  # a window ran: it is not started again

    def step(self, epoch, step_in_epoch):
        """Call at the start of each step."""
        if not (self.enabled or self.trace) or epoch != self.epoch:
            return
        if step_in_epoch == 0 and not self.running and not self.recorded:
            self._start()
        elif self.running and self.num_iters is not None and step_in_epoch >= self.num_iters:
            self.stop()  # the trace is written after the epoch's report (write_trace)
        elif self.profiler is not None and self.running:
            self.profiler.step()

    def _start(self):
        global _tracing
        if self.trace:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            _tracing = True
        if self.enabled:
            torch.cuda.profiler.start()
            torch.cuda.nvtx.range_push("PROFILE")
        self.running = True

    def stop(self):
        """End the window (its kernels done): at the epoch's end, before its timed report, or after num_iters."""
        global _tracing
        if not self.running:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the window's kernels end inside it
        if self.enabled:
            torch.cuda.nvtx.range_pop()
            torch.cuda.profiler.stop()
        if self.profiler is not None:
            self.profiler.stop()
            _tracing = False
        self.running = False
        self.recorded = True

    def write_trace(self):
        """Write the recorded trace, if one waits (after the epoch's report, so that its time is not the epoch's)."""
        if self.profiler is not None and not self.running:
            self._write_trace()

    def end_epoch(self):
        """stop() and write_trace() at once."""
        self.stop()
        self.write_trace()

    def close(self):
        """At the run's end: a window the stop cut short is ended and written; a trace asked for that the run never
        reached is said in one line."""
        self.end_epoch()
        if self.trace and not self.recorded:
            logging.warning(f"--torch_profile: no trace written to {self.trace}: the run never began epoch "
                            f"{self.epoch + 1} at its first step (--profile_epoch {self.epoch} counts from 0)")

    def _write_trace(self):
        """The Chrome trace, written whole or not at all (a temporary file beside it, renamed)."""
        folder, name = os.path.split(os.path.abspath(self.trace))
        os.makedirs(folder, exist_ok=True)
        partial = os.path.join(folder, f".partial-{os.getpid()}-{name}")
        try:
            self.profiler.export_chrome_trace(partial)
            os.replace(partial, self.trace)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        self.profiler = None


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
