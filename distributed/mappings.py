"""Autograd functions that move activations between parallel regions, each the adjoint of the other's backward.

Each takes the name of a process group (utils.comm: "tp", "cp", ...) and is a no-op on a group of size 1 (or an
unknown name), so the same model code runs serially. Sequence splits may be uneven (`shapes` = sizes per rank).
Collectives inside autograd functions break torch.compile graphs: where a group is active, the autograd function
runs through `_apply`, marked compiler.disable (a deliberate break); on a group of size 1 the identity stays in the
graph (marking the whole wrapper split a serial ViT's compiled forward in three graphs).
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distributed.helpers import compute_split_shapes, gather, reduce, reduce_scatter, split
from utils import comm
from utils.compat import ddp_buffer_sync


class _CopyToParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x

    @staticmethod
    def backward(ctx, grad):
        return reduce(grad, ctx.name), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx, x, name):
        return reduce(x, name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToParallelRegion(torch.autograd.Function):
    """Forward: split along dim, keep this rank's chunk. Backward: all-gather of the gradient along dim."""

    @staticmethod
    def forward(ctx, x, dim, name):
        ctx.dim, ctx.name = dim, name
        ctx.shapes = compute_split_shapes(x.shape[dim], comm.get_size(name))
        return split(x, dim, name)

    @staticmethod
    def backward(ctx, grad):
        return gather(grad, ctx.dim, ctx.shapes, ctx.name), None, None


class _GatherFromParallelRegion(torch.autograd.Function):
    """Forward: all-gather along dim. Backward: split of the gradient, keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, dim, shapes, name):
        ctx.dim, ctx.name = dim, name
        return gather(x, dim, shapes, name)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.dim, ctx.name), None, None, None


class _AllGatherFromParallelRegion(torch.autograd.Function):
    """Forward: all-gather along dim. Backward: reduce-scatter (sum) of the gradient along dim."""

    @staticmethod
    def forward(ctx, x, dim, shapes, name):
        ctx.dim, ctx.name = dim, name
        ctx.shapes = shapes or [x.shape[dim]] * comm.get_size(name)
        return gather(x, dim, shapes, name)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.shapes, ctx.name), None, None, None


class _ReduceScatterToParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along dim. Backward: all-gather of the gradient along dim."""

    @staticmethod
    def forward(ctx, x, dim, shapes, name):
        ctx.dim, ctx.name, ctx.shapes = dim, name, shapes
        return reduce_scatter(x, dim, shapes, name)

    @staticmethod
    def backward(ctx, grad):
        return gather(grad, ctx.dim, ctx.shapes, ctx.name), None, None, None


def _active(name):
    return name is not None and comm.get_size(name) > 1


@torch.compiler.disable
def _apply(function, *args):
    """`function.apply(*args)` outside torch.compile's graph (its collectives would break the graph anyway)."""
    return function.apply(*args)


def copy_to_parallel_region(x, comm_name):
    """Identity forward; all-reduce of the gradient over `comm_name` backward (enter a column-parallel layer)."""
    return _apply(_CopyToParallelRegion, x, comm_name) if _active(comm_name) else x


def reduce_from_parallel_region(x, comm_name):
    """All-reduce over `comm_name` forward; identity backward (leave a row-parallel layer)."""
    return _apply(_ReduceFromParallelRegion, x, comm_name) if _active(comm_name) else x


def scatter_to_parallel_region(x, dim, comm_name):
    """Keep this rank's chunk along `dim` forward; all-gather of the gradient backward."""
    return _apply(_ScatterToParallelRegion, x, dim, comm_name) if _active(comm_name) else x


def gather_from_parallel_region(x, dim, shapes, comm_name):
    """All-gather along `dim` forward (`shapes`: sizes per rank); keep this rank's gradient chunk backward."""
    return _apply(_GatherFromParallelRegion, x, dim, shapes, comm_name) if _active(comm_name) else x


def all_gather_from_parallel_region(x, dim, shapes, comm_name):
    """All-gather along `dim` forward; reduce-scatter (sum) of the gradient backward (keys and values over cp)."""
    return _apply(_AllGatherFromParallelRegion, x, dim, shapes, comm_name) if _active(comm_name) else x


def reduce_scatter_to_parallel_region(x, dim, shapes, comm_name):
    """Reduce-scatter (sum) along `dim` forward (`shapes`: sizes per rank); all-gather of the gradient backward
    (leave a row-parallel layer under sequence parallelism)."""
    return _apply(_ReduceScatterToParallelRegion, x, dim, shapes, comm_name) if _active(comm_name) else x


def _all_reduce_in_place(grads, name):
    """One all-reduce (sum) over the named group for a list of gradients (views into DDP's bucket, set in place)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=comm.get_group(name))
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_marked_gradients(params, grads):
    """Sum the gradients of weights shared over another group (their `mark_for_reduction`, e.g. ["cp"]: each cp rank
    saw only its part of the sequence) over that group; then average the gradients of every copy of a shared weight
    over the rest of the groups it is shared over (`is_shared_mp`, e.g. "tp"). The copies compute equal gradients in
    exact arithmetic, so the average changes nothing there, but on a GPU kernels with atomics or cuDNN algorithms
    that each rank autotunes alone (cudnn.benchmark) round differently, and un-averaged copies would drift apart step
    by step. `grads` are set in place (DDP's bucket views, or FSDP's gradient shards: parallelize.py)."""
    names = [n for n in comm.get_names() if n != "dp" and comm.get_size(n) > 1]
    params = list(zip(params, grads))
    for name in names:
        summed = [g for p, g in params if name in getattr(p, "mark_for_reduction", [])]
        if summed:
            _all_reduce_in_place(summed, name)
    for name in names:
        copies = [g for p, g in params
                  if name in getattr(p, "is_shared_mp", []) and name not in getattr(p, "mark_for_reduction", [])]
        if copies:
            _all_reduce_in_place([g.div_(comm.get_size(name)) for g in copies], name)


def _reduce_marked_gradients(state, bucket):
    """DDP comm hook: reduce_marked_gradients on the bucket, then average it over "dp". All of it is linear, so the
    order does not matter; the group reductions run here, synchronously, because DDP calls the hook for the buckets
    in the same order on every rank (a callback on the dp future could run them in another order on each rank with
    gloo)."""
    reduce_marked_gradients(bucket.parameters(), bucket.gradients())
    buffer = bucket.buffer()
    # the bucket, reduced in place (what the future holds; a dry run's stand-in ranks hand back nothing)
    return dist.all_reduce(buffer.div_(comm.get_size("dp")), group=comm.get_group("dp"),
                           async_op=True).get_future().then(lambda fut: buffer)


def init_ddp_model_and_reduction_hooks(model, device_ids, output_device, bucket_cap_mb=25, broadcast_buffers=True,
                                       find_unused_parameters=False, gradient_as_bucket_view=True,
                                       static_graph=False):
    """DDP over the data-parallel group; with tensor or context parallelism, a comm hook that also sums the
    gradients of cp-shared weights over "cp" and averages those of replicated weights over the groups holding their
    copies (_reduce_marked_gradients). Returns the model unchanged when not distributed."""
    if not dist.is_initialized():
        return model
    ddp = DistributedDataParallel(model, device_ids=device_ids, output_device=output_device,
                                  process_group=comm.get_group("dp"), bucket_cap_mb=bucket_cap_mb,
                                  **ddp_buffer_sync(broadcast_buffers and comm.get_size("cp") == 1),
                                  find_unused_parameters=find_unused_parameters,
                                  gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
    # (a dry run's stand-in ranks hand back no bucket from DDP's own all-reduce: the hook returns the bucket itself)
    if comm.get_size("tp-cp") > 1 or comm.is_dry_run():
        ddp.register_comm_hook(None, _reduce_marked_gradients)
    return ddp
