"""Data parallelism over the grid's "dp" group for a model split over tp and cp: DDP, and its comm hook for the
weights whose gradients tp/cp ranks must also reduce among themselves.

A weight shared over cp (a norm, a bias) meets only this rank's tokens, so its gradient is partial and is summed over
"cp"; a weight replicated over a group (its `is_shared_mp`, helpers.mark_shared) has equal gradients on every copy in
exact arithmetic, which are averaged anyway so that rounding cannot make the copies drift. DDP's comm hook does both
on each bucket, then averages it over "dp" (train.py's DDP, on one group, needs none of this: its wrap is the lesson
there). FSDP runs the same sums on its gradient shards (parallelize.sum_marked_gradient_shards).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from utils import comm
from utils.compat import ddp_buffer_sync


@dataclass(frozen=True)
class DDPOptions:
    """What DDP is asked for (train_mp.py's flags, read once): on or off (--noddp), its bucket size (--bucket_cap_mb),
    and whether buffers are broadcast from rank 0 before each forward (off: --disable_broadcast_buffers, which also
    lets the gradients be views into the buckets)."""
    enabled: bool = True
    bucket_cap_mb: float = 25.0
    broadcast_buffers: bool = True

    @classmethod
    def from_flags(cls, args):
        return cls(not args.noddp, args.bucket_cap_mb, not args.disable_broadcast_buffers)


def all_reduce_in_place(grads, axis):
    """One all-reduce (sum) over the group `axis` for a list of gradients, set in place (views into DDP's bucket, or the
    gradients a pipeline stage reduces once a step: pipeline.reduce_gradients)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=axis.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_marked_gradients(grid, params, grads):
    """Sum the gradients of weights shared over another group (their `mark_for_reduction`, e.g. ["cp"]: each cp rank
    saw only its part of the sequence) over that group; then average the gradients of every copy of a shared weight
    over the rest of the groups it is shared over (`is_shared_mp`, e.g. "tp"). The copies compute equal gradients in
    exact arithmetic, so the average changes nothing there, but on a GPU kernels with atomics or cuDNN algorithms
    that each rank autotunes alone (cudnn.benchmark) round differently, and un-averaged copies would drift apart step
    by step. `grads` are set in place (DDP's bucket views, or FSDP's gradient shards: parallelize.py); the groups
    are `grid`'s (utils/layout.Grid)."""
    names = grid.split()
    params = list(zip(params, grads))
    for name in names:
        summed = [g for p, g in params if name in getattr(p, "mark_for_reduction", [])]
        if summed:
            all_reduce_in_place(summed, grid[name])
    for name in names:
        copies = [g for p, g in params
                  if name in getattr(p, "is_shared_mp", []) and name not in getattr(p, "mark_for_reduction", [])]
        if copies:
            all_reduce_in_place([g.div_(grid.size(name)) for g in copies], grid[name])


def _reduce_marked_gradients(grid, bucket):
    """DDP comm hook (its state: the grid): reduce_marked_gradients on the bucket, then average it over "dp". All of
    it is linear, so the order does not matter; the group reductions run here, synchronously, because DDP calls the
    hook for the buckets in the same order on every rank (a callback on the dp future could run them in another order
    on each rank with gloo)."""
    reduce_marked_gradients(grid, bucket.parameters(), bucket.gradients())
    buffer = bucket.buffer()
    # the bucket, reduced in place (what the future holds; a dry run's stand-in ranks hand back nothing)
    return dist.all_reduce(buffer.div_(grid.size("dp")), group=grid["dp"].group,
                           async_op=True).get_future().then(lambda fut: buffer)


def init_ddp_model_and_reduction_hooks(model, grid, device, options=DDPOptions()):
    """DDP over the grid's data-parallel group; with tensor or context parallelism, a comm hook that also sums the
    gradients of cp-shared weights over "cp" and averages those of replicated weights over the groups holding their
    copies (_reduce_marked_gradients). Buffers are not broadcast under cp (each cp rank's are its own). Returns the
    model unchanged when not distributed."""
    if not dist.is_initialized():
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, output_device=device_ids,
                                  process_group=grid["dp"].group, bucket_cap_mb=options.bucket_cap_mb,
                                  **ddp_buffer_sync(options.broadcast_buffers and grid.size("cp") == 1),
                                  gradient_as_bucket_view=not options.broadcast_buffers)
    # (a dry run's stand-in ranks hand back no bucket from DDP's own all-reduce: the hook returns the bucket itself)
    if grid.size("tp-cp") > 1 or comm.is_dry_run():
        ddp.register_comm_hook(grid, _reduce_marked_gradients)
    return ddp
