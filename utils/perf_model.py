"""Counts of the ViT of config/ViT.yaml under a tp x cp x dp layout, from its shape alone (no model is built): the
first part of a performance model (issue "A performance model and layout planner").

- `flops_per_sample`: the matmul FLOPs of one sample's forward and backward pass, as torch.utils.flop_counter counts
  them on the model (linear layers and the patch-embedding convolution: 2 m n k forward, twice that backward, the
  convolution's input gradient left out as the input needs none; attention: 4 T^2 D forward, 8 T^2 D backward).
- `parameters_per_rank`: the parameters a rank holds: tp splits each block's q, k, v, fc1 (columns: weight and
  bias) and proj, fc2 (rows: weight; the bias stays whole); the norms, the patch and position embedding and the
  head stay whole; FSDP (`fsdp=True`) then keeps 1/dp of each (rounded up along the first dimension).
- `state_bytes_per_rank`: fp32 parameters, gradients and Adam's two moments of those parameters.
- `comm_bytes_per_step`: the bytes the collectives of one training step hand to the network, by process group.
- `saved_activation_bytes`: what autograd keeps for the backward pass after one forward on rank 0 of a tp x cp
  layout, with or without sequence parallelism and activation checkpointing, in fp32 or under 16-bit autocast: the
  tensors each op saves, as utils/profiling.SavedActivations measures them.

Checked against the real model and the flop counter in tests/test_perf_model.py.
"""
import math
from dataclasses import dataclass

from distributed.helpers import compute_split_shapes

MLP_RATIO = 4.0  # networks/vit.py's default (utils may not import the models: tests/test_layout.py)


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


def _tensor_shapes(shape, tp, distributed=None):
    """[(first dimension, elements)] of every parameter a rank holds at tensor parallelism `tp` (before FSDP); the
    distributed layers (tp x cp > 1) store each linear bias as (1, 1, n)."""
    d, hidden = shape.embed_dim, shape.hidden
    distributed = tp > 1 if distributed is None else distributed

    def bias(n):
        return (1 if distributed else n, n)

    block = ([(d // tp, d * d // tp), bias(d // tp)] * 3  # q, k, v: column-parallel weight and bias
             + [(d, d * d // tp), bias(d)]  # proj: row-parallel weight (stored out x in/tp), whole bias
             + [(hidden // tp, d * hidden // tp), bias(hidden // tp)]  # fc1
             + [(d, hidden * d // tp), bias(d)]  # fc2
             + [(d, d)] * 4)  # norm1, norm2: weight and bias
    patch_values = shape.patch_size ** 2
    root = [(d, d * shape.in_channels * patch_values), (d, d),  # patch embedding (convolution) and its bias
            (1, shape.tokens * d), (d, d), (d, d),  # position embedding, final norm
            (shape.out_channels * patch_values, d * shape.out_channels * patch_values)]  # head, no bias
    return block * shape.depth + root


def _shard(rows, numel, dp):
    """FSDP's rank 0 share of a tensor: ceil(rows / dp) of its first dimension."""
    return math.ceil(rows / dp) * (numel // rows)


def parameters_per_rank(shape, tp=1, dp=1, fsdp=False, cp=1):
    """Parameters held by one rank; with FSDP its share of each tensor over dp: the first dimension split in
    ceil-sized chunks, so rank 0 holds the most, and that is the count given."""
    tensors = _tensor_shapes(shape, tp, tp * cp > 1)
    if not fsdp or dp == 1:
        return sum(numel for _, numel in tensors)
    return sum(_shard(rows, numel, dp) for rows, numel in tensors)


def state_bytes_per_rank(shape, tp=1, dp=1, fsdp=False, cp=1):
    """{"parameters", "gradients", "optimizer_state"}: fp32 bytes on one rank (Adam: two moments)."""
    params = 4 * parameters_per_rank(shape, tp, dp, fsdp, cp)
    return {"parameters": params, "gradients": params, "optimizer_state": 2 * params}


def _chunk(size, parts):
    """Rank 0's part of `size` split over `parts` ranks: the largest of compute_split_shapes."""
    return compute_split_shapes(size, parts)[0]


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


def comm_bytes_per_step(shape, batch, tp=1, cp=1, dp=1, sequence_parallel=False, checkpointing=False, fsdp=False,
                        activation_bytes=4):
    """Bytes each collective of one training step hands to the network on rank 0, summed by process group ("tp",
    "cp", "tp-cp", "dp"): the whole tensor of an all-reduce, the gathered output of an all-gather, the input of a
    reduce-scatter (what a ring then moves per rank is (n-1)/n of it, twice for an all-reduce). Padded chunks count
    padded, as the collectives pad them. `activation_bytes` is the size of one activation or activation-gradient
    value (fp32 here; what 16-bit autocast sends is not modelled); gradients and weights are fp32.

    Blocks (checkpointing repeats the forward's collectives up to fc1 in the backward pass): tp without sp
    all-reduces the row-parallel outputs forward and the column-parallel inputs' gradients backward; with sp these
    become all-gathers and reduce-scatters of the same tensors. cp all-gathers keys and values forward and
    reduce-scatters their gradients backward. Outside the blocks the token splits of cp and sp are all-gathered.
    Gradients, in DDP's hook or before FSDP's step: the cp sums of every block weight and the final norm, the tp sums
    (or averages) of the norms and row-parallel biases, the tp-cp averages of the embeddings, final norm and head;
    then DDP all-reduces everything over dp, or FSDP all-gathers each block twice (forward, backward) and the root
    once, and reduce-scatters the gradients.
    """
    d, t, depth = shape.embed_dim, shape.tokens, shape.depth
    t_c = _chunk(t, cp)
    t_s = _chunk(t_c, tp) if sequence_parallel and tp > 1 else t_c
    act = activation_bytes * batch
    out = {"tp": 0, "cp": 0, "tp-cp": 0, "dp": 0}
    # checkpointing's recomputation stops at the block's last saved tensor (GELU's output): it repeats the
    # collectives up to fc1, not fc2's exit
    again = 1 if checkpointing else 0
    if tp > 1:
        if sequence_parallel:
            gathered, scattered = tp * t_s * d, t_c * d
            forward = 2 * gathered + 2 * scattered + again * (2 * gathered + scattered)
            out["tp"] += depth * act * (forward + 2 * scattered + 2 * gathered)  # backward: the adjoints
            out["tp"] += 2 * act * tp * t_s * d  # the token split before the blocks (backward), joined after (forward)
        else:
            out["tp"] += depth * act * (2 + again + 2) * t_c * d
    if cp > 1:
        out["cp"] += depth * act * 2 * ((1 + again) * cp * t_c * d // tp + t * d // tp)  # keys and values
        out["cp"] += 2 * act * cp * t_c * d  # the token split after the embedding (backward), joined before the head
    tensors = _tensor_shapes(shape, tp, tp * cp > 1)
    per_block = len(tensors[:-6]) // depth
    block, root = tensors[:per_block], tensors[-6:]

    def held(group):
        return sum(_shard(rows, numel, dp) if fsdp else numel for rows, numel in group)

    if tp * cp > 1:  # DDP's hook, or the sums on FSDP's shards (also at dp = 1)
        if tp > 1:
            out["tp"] += 4 * depth * held([block[7], block[11]] + block[12:])  # row-parallel biases, norms
        if cp > 1:
            out["cp"] += 4 * (depth * held(block) + held(root[3:5]))  # every block weight, the final norm
        out["tp-cp"] += 4 * held(root)
    if dp > 1 and fsdp:
        padded_block = dp * held(block)
        out["dp"] += 4 * (2 * depth * padded_block + dp * held(root))  # all-gathers
        out["dp"] += 4 * (depth * padded_block + dp * held(root))  # reduce-scatters (fp32 gradients)
    elif dp > 1:
        out["dp"] += 4 * parameters_per_rank(shape, tp, cp=cp)
    return out
