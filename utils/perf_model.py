"""Counts of the ViT of config/ViT.yaml under a tp x cp x dp layout, from its shape alone (no model is built): the
first part of a performance model (issue "A performance model and layout planner").

- `flops_per_sample`: the matmul FLOPs of one sample's forward and backward pass, as torch.utils.flop_counter counts
  them on the model (linear layers and the patch-embedding convolution: 2 m n k forward, twice that backward, the
  convolution's input gradient left out as the input needs none; attention: 4 T^2 D forward, 8 T^2 D backward).
- `parameters_per_rank`: the parameters a rank holds: tp splits each block's q, k, v, fc1 (columns: weight and
  bias) and proj, fc2 (rows: weight; the bias stays whole); the norms, the patch and position embedding and the
  head stay whole; FSDP (`fsdp=True`) then keeps 1/dp of each (rounded up along the first dimension).
- `state_bytes_per_rank`: fp32 parameters, gradients and Adam's two moments of those parameters.
- `saved_activation_bytes`: what autograd keeps for the backward pass after one forward on rank 0 of a tp x cp
  layout, with or without sequence parallelism and activation checkpointing, in fp32 or under 16-bit autocast: the
  tensors each op saves, as utils/profiling.SavedActivations measures them.

Checked against the real model and the flop counter in tests/test_perf_model.py.
"""
import math
from dataclasses import dataclass

MLP_RATIO = 4.0  # networks/vit.py's default


@dataclass(frozen=True)
class ViTShape:
    embed_dim: int
    depth: int
    num_heads: int
    tokens: int
    in_channels: int
    out_channels: int
    patch_size: int
    hidden: int

    @classmethod
    def from_params(cls, params):
        height, width = params.img_size
        patch = params.patch_size
        return cls(embed_dim=params.embed_dim, depth=params.depth, num_heads=params.num_heads,
                   tokens=(height // patch) * (width // patch), in_channels=params.n_in_channels,
                   out_channels=params.n_out_channels, patch_size=patch,
                   hidden=int(params.embed_dim * params.get("mlp_ratio", MLP_RATIO)))


def flops_per_sample(shape):
    """Forward + backward matmul FLOPs of one sample (the serial model's: what MFU counts)."""
    d, t, depth, patch_values = shape.embed_dim, shape.tokens, shape.depth, shape.patch_size ** 2
    linear = 2 * t * (4 * d * d + 2 * d * shape.hidden)  # q, k, v, proj, fc1, fc2: forward
    attention = 4 * t * t * d  # q k^T and (softmax) v, all heads: forward
    blocks = depth * (3 * linear + 3 * attention)  # backward: twice the forward
    embed = 2 * (2 * t * d * shape.in_channels * patch_values)  # forward + weight gradient (no input gradient)
    head = 3 * (2 * t * d * shape.out_channels * patch_values)
    return blocks + embed + head


def _tensor_shapes(shape, tp):
    """[(first dimension, elements)] of every parameter a rank holds at tensor parallelism `tp` (before FSDP)."""
    d, hidden = shape.embed_dim, shape.hidden
    block = ([(d // tp, d * d // tp), (d // tp, d // tp)] * 3  # q, k, v: column-parallel weight and bias
             + [(d, d * d // tp), (d, d)]  # proj: row-parallel weight (stored out x in/tp), whole bias
             + [(hidden // tp, d * hidden // tp), (hidden // tp, hidden // tp)]  # fc1
             + [(d, hidden * d // tp), (d, d)]  # fc2
             + [(d, d)] * 4)  # norm1, norm2: weight and bias
    patch_values = shape.patch_size ** 2
    root = [(d, d * shape.in_channels * patch_values), (d, d),  # patch embedding (convolution) and its bias
            (1, shape.tokens * d), (d, d), (d, d),  # position embedding, final norm
            (shape.out_channels * patch_values, d * shape.out_channels * patch_values)]  # head, no bias
    return block * shape.depth + root


def parameters_per_rank(shape, tp=1, dp=1, fsdp=False):
    """Parameters held by one rank; with FSDP its share of each tensor over dp: the first dimension split in
    ceil-sized chunks, so rank 0 holds the most, and that is the count given."""
    if not fsdp or dp == 1:
        return sum(numel for _, numel in _tensor_shapes(shape, tp))
    return sum(math.ceil(rows / dp) * (numel // rows) for rows, numel in _tensor_shapes(shape, tp))


def state_bytes_per_rank(shape, tp=1, dp=1, fsdp=False):
    """{"parameters", "gradients", "optimizer_state"}: fp32 bytes on one rank (Adam: two moments)."""
    params = 4 * parameters_per_rank(shape, tp, dp, fsdp)
    return {"parameters": params, "gradients": params, "optimizer_state": 2 * params}


def _chunk(size, parts):
    """Rank 0's part of `size` split over `parts` ranks (distributed.helpers.compute_split_shapes: the largest)."""
    if parts == 1:
        return size
    chunk = (size + parts - 1) // parts
    return chunk if size - chunk * (parts - 1) > 0 else size // parts


def saved_activation_bytes(shape, batch, half=False, checkpointing=False, tp=1, cp=1, sequence_parallel=False):
    """Bytes saved for the backward pass by one forward of `batch` samples on rank 0 of a tp x cp layout (DDP, or
    FSDP in fp32; FSDP's 16-bit policy is not modelled), as utils/profiling.SavedActivations measures them.

    Tokens: t in all, t_c in this rank's cp chunk (the blocks' attention and MLP work on it), t_s between the blocks
    (t_c, or its part over tp with sequence parallelism); keys and values are all-gathered to t under cp.

    Per block and sample, in fp32: the inputs of both LayerNorms (the residual stream: t_s D) and their outputs
    (the column-parallel inputs, all-gathered under sequence parallelism: t_c D), q (t_c D / tp), k and v, the
    attention output (also proj's input: a view), fc1's output and GELU's output (t_c hidden / tp each), the norms'
    means and inverse deviations and attention's log-sum-exp. Under 16-bit autocast the norms run in fp32 on the
    fp32 residual stream; each linear layer casts its own input (q, k and v each keep a copy of the norm's output:
    the cast cache holds weights only) and its 16-bit weight copy is saved once per forward. The serial layers keep
    their outputs in 16 bits; the distributed layers add their bias in fp32, so fc1's output is fp32 and q, k, v
    and GELU's output are 16-bit casts. Outside the blocks: the input image (its 16-bit cast), the final norm's input
    (t_c) and the head's input (t, gathered over cp), and the 16-bit copies of the patch-embedding and head weights.
    With checkpointing a block keeps only its input (fp32: the residual stream)."""
    d, t, hidden, heads = shape.embed_dim, shape.tokens, shape.hidden, shape.num_heads
    t_c = _chunk(t, cp)
    t_s = _chunk(t_c, tp) if sequence_parallel and tp > 1 else t_c
    t_kv = t if cp > 1 else t_c
    distributed = tp * cp > 1
    image = shape.in_channels * shape.tokens * shape.patch_size ** 2
    stats = 2 * 8 * t_s + 4 * (heads // tp) * t_c  # LayerNorm mean/rstd (fp32) and attention's log-sum-exp
    qkv = t_c * d // tp + 2 * t_kv * d // tp  # values of q, k and v
    weights = 0
    if checkpointing:
        block = 4 * t_s * d
    elif not half:
        block = 4 * (2 * t_s * d + 2 * t_c * d + qkv + t_c * d // tp + 2 * t_c * hidden // tp) + stats
    else:
        block = 2 * 4 * t_s * d + 4 * 2 * t_c * d + 2 * qkv + 2 * t_c * d // tp + stats  # norms, casts, attention
        block += (4 + 2) * t_c * hidden // tp if distributed else 2 * 2 * t_c * hidden  # fc1 out, GELU out
        weights = 2 * (4 * d * d + 2 * d * hidden) // tp
    patch_values = shape.patch_size ** 2
    root = (2 if half else 4) * image + 4 * t_c * d + 8 * t_c + (2 if half else 4) * t * d
    root_weights = 2 * d * (shape.in_channels + shape.out_channels) * patch_values if half else 0
    return batch * (shape.depth * block + root) + shape.depth * weights + root_weights
