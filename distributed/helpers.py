"""Split shapes and the collectives under the parallel mappings; the shared-weight protocol (mark_shared,
init_params_for_shared_weights).

Every collective takes the group it runs over as an Axis of the run's grid (utils/layout.py: name, size, this rank's
place, process group), handed down by the recipe (parallelize.py), or by its name ("tp", "cp", ...), looked up in
utils.comm as the original tutorial's code does (axis_of); None or an unknown name is a group of one.

Sequence lengths rarely divide the number of ranks (4050 tokens over cp=4), so every collective here takes the
per-rank sizes along the split dimension. Uneven all-gathers and reduce-scatters are padded to the largest chunk,
which works on gloo (CPU) as well as NCCL.
"""
import torch
import torch.distributed as dist

from utils import comm
from utils.layout import Axis


def axis_of(group):
    """`group` as an Axis: as given, or the named group of utils.comm (size 1 when None or unknown)."""
    if isinstance(group, Axis):
        return group
    if group is None:
        return Axis(None)
    return Axis(group, comm.get_size(group), comm.get_rank(group), comm.get_group(group))


def compute_split_shapes(size, num_chunks):
    """Sizes of `num_chunks` consecutive chunks of `size`: ceil-sized chunks and a smaller last one, e.g.
    (4050, 4) -> [1013, 1013, 1013, 1011]; when that leaves nothing for the last, floor-sized ones:
    (5, 4) -> [1, 1, 1, 2]."""
    if num_chunks == 1:
        return [size]
    chunk = (size + num_chunks - 1) // num_chunks
    last = size - chunk * (num_chunks - 1)
    if last <= 0:
        chunk = size // num_chunks
        last = size - chunk * (num_chunks - 1)
    return [chunk] * (num_chunks - 1) + [last]


def split_tensor_along_dim(tensor, dim, num_chunks):
    """`tensor` split along `dim` into compute_split_shapes chunks (views)."""
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of {tensor.dim()} dimensions")
    if tensor.shape[dim] < num_chunks:
        raise ValueError(f"cannot split {tensor.shape[dim]} elements along dim {dim} into {num_chunks} chunks")
    return torch.split(tensor, compute_split_shapes(tensor.shape[dim], num_chunks), dim=dim)


def reduce(x, group):
    """Sum of `x` over `group` (a new contiguous tensor; `x` itself is left alone)."""
    axis = axis_of(group)
    if axis.size == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=axis.group)
    return x


def split(x, dim, group):
    """This rank's chunk of `x` along `dim` (contiguous)."""
    axis = axis_of(group)
    if axis.size == 1:
        return x
    return split_tensor_along_dim(x, dim, axis.size)[axis.rank].contiguous()


def _padded_all_gather(x, dim, shapes, axis):
    """The chunks of every rank along `dim` (their sizes in `shapes`), gathered by padding to the largest."""
    longest = max(shapes)
    x = x.contiguous()
    if x.shape[dim] < longest:
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    pieces = [torch.empty_like(x) for _ in shapes]
    dist.all_gather(pieces, x, group=axis.group)
    return [piece.narrow(dim, 0, length) for piece, length in zip(pieces, shapes)]


def gather(x, dim, shapes, group):
    """Concatenation along `dim` of every rank's `x` (rank order); `shapes` = sizes along `dim` per rank
    (None: all equal to this rank's)."""
    axis = axis_of(group)
    size = axis.size
    if size == 1:
        return x
    shapes = shapes or [x.shape[dim]] * size
    if len(shapes) != size or x.shape[dim] != shapes[axis.rank]:
        raise ValueError(f"gather over '{axis.name}': this rank holds {x.shape[dim]} elements along dim {dim}, "
                         f"but the split shapes are {shapes} for {size} ranks")
    return torch.cat(_padded_all_gather(x, dim, shapes, axis), dim=dim)


def reduce_scatter(x, dim, shapes, group):
    """This rank's chunk (sizes per rank in `shapes`, None: even) of the sum of `x` over the group."""
    axis = axis_of(group)
    size = axis.size
    if size == 1:
        return x
    shapes = shapes or compute_split_shapes(x.shape[dim], size)
    if len(shapes) != size or sum(shapes) != x.shape[dim]:
        raise ValueError(f"reduce-scatter over '{axis.name}': split shapes {shapes} do not cover {x.shape[dim]} "
                         f"elements along dim {dim} for {size} ranks")
    rank = axis.rank
    if dist.get_backend(axis.group) == "nccl":
        longest = max(shapes)
        chunks = []
        for chunk in torch.split(x, shapes, dim=dim):
            if chunk.shape[dim] < longest:
                pad = list(chunk.shape)
                pad[dim] = longest - chunk.shape[dim]
                chunk = torch.cat([chunk, chunk.new_zeros(pad)], dim=dim)
            chunks.append(chunk.contiguous())
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=axis.group)
        return out.narrow(dim, 0, shapes[rank]).contiguous()
    # gloo has no reduce-scatter: the same result from a sum over the group and this rank's slice
    return torch.split(reduce(x, axis), shapes, dim=dim)[rank].contiguous()


def _names(groups):
    names = [group.name if isinstance(group, Axis) else group for group in groups]
    return [name for name in names if name is not None]


def mark_shared(param, shared_over, summed_over=()):
    """Mark `param` as a weight whose copies live on several ranks (the shared-weight protocol): `is_shared_mp`
    names the groups over which its copies must stay equal (init_params_for_shared_weights, the DDP hook averages
    their gradients), `mark_for_reduction` those over which its gradients are summed instead (each rank's covers
    only its part of the sequence, e.g. ["cp"]). Groups are given as names or Axes and kept as names; None entries
    (a layer built without that group) are left out."""
    param.is_shared_mp = _names(shared_over)
    param.mark_for_reduction = _names(summed_over)
    return param


@torch.no_grad()
def init_params_for_shared_weights(model, grid):
    """Make every copy of a shared weight equal to its copy on rank 0 of each group it is shared over.

    Parameters of the distributed layers say where they are shared (`is_shared_mp`, e.g. ["cp"] or ["tp", "cp"]:
    mark_shared); every other parameter (e.g. a ViT's patch and position embedding and head) is replicated over the
    whole model-parallel group and is marked ["tp-cp"] here. With the same seed on every rank the copies are already
    equal; this guarantees it whatever the seeds. `grid`: the run's (utils/layout.Grid), whose groups the names are.
    """
    for param in model.parameters():
        mark_shared(param, getattr(param, "is_shared_mp", ["tp-cp"]), getattr(param, "mark_for_reduction", []))
        for name in param.is_shared_mp:
            if grid.size(name) > 1:
                group = grid[name].group
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)
