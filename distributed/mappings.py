"""Autograd functions that move activations between parallel regions, each the adjoint of the other's backward.

Each takes the group it moves over: an Axis of the run's grid (utils/layout.py), as the layers hold them, or a
group's name ("tp", "cp", ...: the original tutorial's way, looked up in utils.comm; helpers.axis_of), and is a
no-op on a group of size 1 (or an unknown name), so the same model code runs serially. Sequence splits may be
uneven (`shapes` = sizes per rank).
Collectives inside autograd functions break torch.compile graphs: where a group is active, the autograd function
runs through `_apply`, marked compiler.disable (a deliberate break); on a group of size 1 the identity stays in the
graph (marking the whole wrapper split a serial ViT's compiled forward in three graphs).
"""
import torch

from distributed.helpers import axis_of, compute_split_shapes, gather, reduce, reduce_scatter, split


class _CopyToParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return reduce(grad, ctx.group), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToParallelRegion(torch.autograd.Function):
    """Forward: split along dim, keep this rank's chunk. Backward: all-gather of the gradient along dim."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        ctx.shapes = compute_split_shapes(x.shape[dim], axis_of(group).size)
        return split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather(grad, ctx.dim, ctx.shapes, ctx.group), None, None


class _GatherFromParallelRegion(torch.autograd.Function):
    """Forward: all-gather along dim. Backward: split of the gradient, keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, dim, shapes, group):
        ctx.dim, ctx.group = dim, group
        return gather(x, dim, shapes, group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.dim, ctx.group), None, None, None


class _AllGatherFromParallelRegion(torch.autograd.Function):
    """Forward: all-gather along dim. Backward: reduce-scatter (sum) of the gradient along dim."""

    @staticmethod
    def forward(ctx, x, dim, shapes, group):
        ctx.dim, ctx.group = dim, group
        ctx.shapes = shapes or [x.shape[dim]] * axis_of(group).size
        return gather(x, dim, shapes, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.shapes, ctx.group), None, None, None


class _ReduceScatterToParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along dim. Backward: all-gather of the gradient along dim."""

    @staticmethod
    def forward(ctx, x, dim, shapes, group):
        ctx.dim, ctx.group, ctx.shapes = dim, group, shapes
        return reduce_scatter(x, dim, shapes, group)

    @staticmethod
    def backward(ctx, grad):
        return gather(grad, ctx.dim, ctx.shapes, ctx.group), None, None, None


def _active(group):
    return group is not None and axis_of(group).size > 1


@torch.compiler.disable
def _apply(function, *args):
    """`function.apply(*args)` outside torch.compile's graph (its collectives would break the graph anyway)."""
    return function.apply(*args)


def copy_to_parallel_region(x, group):
    """Identity forward; all-reduce of the gradient over `group` backward (enter a column-parallel layer)."""
    return _apply(_CopyToParallelRegion, x, group) if _active(group) else x


def reduce_from_parallel_region(x, group):
    """All-reduce over `group` forward; identity backward (leave a row-parallel layer)."""
    return _apply(_ReduceFromParallelRegion, x, group) if _active(group) else x


def scatter_to_parallel_region(x, dim, group):
    """Keep this rank's chunk along `dim` forward; all-gather of the gradient backward."""
    return _apply(_ScatterToParallelRegion, x, dim, group) if _active(group) else x


def gather_from_parallel_region(x, dim, shapes, group):
    """All-gather along `dim` forward (`shapes`: sizes per rank); keep this rank's gradient chunk backward."""
    return _apply(_GatherFromParallelRegion, x, dim, shapes, group) if _active(group) else x


def all_gather_from_parallel_region(x, dim, shapes, group):
    """All-gather along `dim` forward; reduce-scatter (sum) of the gradient backward (keys and values over cp)."""
    return _apply(_AllGatherFromParallelRegion, x, dim, shapes, group) if _active(group) else x


def reduce_scatter_to_parallel_region(x, dim, shapes, group):
    """Reduce-scatter (sum) along `dim` forward (`shapes`: sizes per rank); all-gather of the gradient backward
    (leave a row-parallel layer under sequence parallelism)."""
    return _apply(_ReduceScatterToParallelRegion, x, dim, shapes, group) if _active(group) else x
