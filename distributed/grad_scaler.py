"""fp16 loss scaling when each rank holds a different shard of the gradients (tensor and context parallelism).

GradScaler skips an optimizer step whose gradients hold an inf or a nan, and halves the scale. Under data
parallelism every rank sees the same all-reduced gradients and so decides alike; under tensor parallelism each rank
checks only its own shard, so one rank could skip a step its peers take, and the copies of the shared weights (norms,
embeddings, biases) part for good, with different loss scales on each rank. Here the found-inf flags are
combined (max) over a named group before anyone decides, as Megatron's scaler does over its model-parallel group.
Under FSDP (--fsdp) each dp rank also holds another shard; there the gradients are DTensors, whose unscale op itself
combines the flag (max) over their dp mesh (torch.distributed.tensor's found_inf_reduce_handler).
"""
import torch
import torch.distributed as dist

from distributed.helpers import axis_of


class ModelParallelGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose skip decision is taken together by the ranks of `group` (the grid's "tp-cp" in
    train_mp.py; an Axis or a group's name): a step is skipped everywhere when any rank's gradient shard overflowed.
    Works with the plain and the fused optimizer paths (both find infs through `_unscale_grads_`), also inside a CUDA
    graph."""

    def __init__(self, device="cuda", group="tp-cp", **kwargs):
        super().__init__(device, **kwargs)
        self.group = axis_of(group)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found_inf_per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if self.group.size > 1:
            for device in sorted(found_inf_per_device, key=str):  # the same order on every rank
                dist.all_reduce(found_inf_per_device[device], op=dist.ReduceOp.MAX, group=self.group.group)
        return found_inf_per_device
