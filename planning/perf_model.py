"""A performance model of the ViT of config/ViT.yaml under a tp x cp x dp layout, from its shape alone (no model is
built). First the counts:

- `flops_per_sample`: the matmul FLOPs of one sample's forward and backward pass, as torch.utils.flop_counter counts
  them on the model (linear layers and the patch-embedding convolution: 2 m n k forward, twice that backward, the
  convolution's input gradient left out as the input needs none; attention: 4 T^2 D forward, 8 T^2 D backward).
- `parameters_per_rank`: the parameters a rank holds: tp splits each block's q, k, v, fc1 (columns: weight and
  bias) and proj, fc2 (rows: weight; the bias stays whole); the norms, the patch and position embedding and the
  head stay whole; FSDP (`fsdp=True`) then keeps 1/dp of each (rounded up along the first dimension).
- `state_bytes_per_rank`: fp32 parameters, gradients and Adam's two moments of those parameters.
- `collectives_per_step`, `comm_bytes_per_step`: the bytes each collective of one training step hands to the
  network, by process group and op.
- `saved_activation_bytes`: what autograd keeps for the backward pass after one forward on rank 0 of a tp x cp
  layout, with or without sequence parallelism and activation checkpointing, in fp32 or under 16-bit autocast: the
  tensors each op saves, as loop/profiling.SavedActivations measures them.

Then a roofline of one training step on a GPU (`predict`): the counts above, the work each kind of kernel does
(GEMMs and FlashAttention on the tensor cores, softmax on the CUDA cores, elementwise kernels on HBM bandwidth),
ring collectives on NVLink or the NIC as `--parallel_order` places each group, DDP's all-reduce overlapped with the
backward pass; a table of systems (SYSTEMS) and one efficiency per kind of work (EFFICIENCY). planning/plan.py
(`make plan`) is its command; docs/perf_model.md compares it with the published runs.

With pipeline stages (layout.pp > 1, `predict_pipeline`) each stage is counted as a ViT of its own blocks
(`stage_shapes`: the embeddings on the first, the final norm and head on the last; the cut of
distributed/pipeline.balanced_layers): its FLOPs, parameters, memory with the microbatches it holds in flight, and
time; the step is the slowest stage's stretched by the bubble (P - 1) / (M + P - 1), plus the transfers between
stages and the tail after the last backward (tests/perf/test_perf_model_pp.py).

Checked against the real model, the flop counter and the collectives on gloo in tests/perf/test_perf_model.py; the
predictions against the published GPU runs and the planner's obvious truths in tests/perf/test_plan.py.
"""
import dataclasses
import functools
import math
from dataclasses import dataclass

from distributed.helpers import compute_split_shapes
from networks.vit import mlp_hidden
from utils.gpus import GPU_PEAKS
from utils.layout import Layout

SERIAL = Layout()


def cp_method_of(layout):
    """How attention reaches the other cp ranks' keys and values (utils/layout.py's cp_method); at cp = 1 every
    method is the serial attention, counted as all-gather's."""
    return layout.cp_method if layout.cp > 1 else "allgather"
# the original tutorial's q, k and v each cast the norm's output under autocast, as this repository's did until
# 2026-11-28 (the runs measured before then: the published ones, the committed H100 profiles, mp_shape.json)
ORIGINAL_ATTENTION_INPUT_CASTS = 3


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
    # 16-bit copies of the first norm's output that q, k and v read: 1 here (the attention casts once);
    # ORIGINAL_ATTENTION_INPUT_CASTS in the original tutorial's code (its published runs: planning/plan.py)
    attention_input_casts: int = 1
    # attention over earlier tokens only (a language model's); the ViT's is bidirectional. Only the published
    # context-parallel comparison, a causal model, is read with it on (cp_comparison): the kernels skip the masked
    # half of the scores, and contiguous cp chunks then give the last rank the most work
    causal: bool = False
    # patches in a row of the image (w): a cp rank embeds only the band of patch rows holding its tokens
    # (distributed/bands.py); None: not known, the whole image counted
    patch_columns: int = None
    # a pipeline stage (planning.perf_model.stage_shapes): depth is its blocks; whether it holds the patch and
    # position embeddings (the first stage) and the final norm and head (the last). The whole model holds both
    holds_embedding: bool = True
    holds_head: bool = True

    @classmethod
    def from_params(cls, params):
        height, width = params.img_size
        patch = params.patch_size
        return cls(embed_dim=params.embed_dim, depth=params.depth, num_heads=params.num_heads,
                   tokens=(height // patch) * (width // patch), in_channels=params.n_in_channels,
                   out_channels=params.n_out_channels, patch_size=patch,
                   hidden=mlp_hidden(params), patch_columns=width // patch)


def band_tokens(shape, cp):
    """The tokens of rank 0's band of patch rows, the image it reads and embeds under cp (distributed/bands.py): its
    chunk of tokens rounded up to whole rows; every token at cp = 1 or where the shape does not know its rows."""
    if cp == 1 or not shape.patch_columns:
        return shape.tokens
    columns = shape.patch_columns
    return min(shape.tokens, -(-_chunk(shape.tokens, cp) // columns) * columns)


def flops_per_sample(shape):
    """Forward + backward matmul FLOPs of one sample (the serial model's: what MFU counts)."""
    d, t, depth = shape.embed_dim, shape.tokens, shape.depth
    linear = 2 * t * (4 * d * d + 2 * d * shape.hidden)  # q, k, v, proj, fc1, fc2: forward
    attention = 4 * t * t * d  # q k^T and (softmax) v, all heads: forward
    if shape.causal:
        attention //= 2  # the masked half is not computed
    blocks = depth * (3 * linear + 3 * attention)  # backward: twice the forward
    return blocks + embed_flops_per_sample(shape) + head_flops_per_sample(shape)


def embed_flops_per_sample(shape):
    """The patch embedding's forward + weight-gradient FLOPs (no input gradient: the image needs none); 0 on a
    pipeline stage without it."""
    if not shape.holds_embedding:
        return 0
    return 2 * (2 * shape.tokens * shape.embed_dim * shape.in_channels * shape.patch_size ** 2)


def head_flops_per_sample(shape):
    """The head's forward + backward FLOPs; 0 on a pipeline stage without it."""
    if not shape.holds_head:
        return 0
    return 3 * (2 * shape.tokens * shape.embed_dim * shape.out_channels * shape.patch_size ** 2)


def _tensor_shapes(shape, tp, distributed=None):
    """[(first dimension, elements)] of every parameter a rank holds at tensor parallelism `tp` (before FSDP); the
    distributed layers (tp x cp > 1) store each linear bias as (1, 1, n)."""
    embedding, head = _root_shapes(shape)
    return _block_shapes(shape, tp, distributed) * shape.depth + embedding + head


def _block_shapes(shape, tp, distributed=None):
    """[(first dimension, elements)] of one block's parameters on a rank (see _tensor_shapes)."""
    d, hidden = shape.embed_dim, shape.hidden
    distributed = tp > 1 if distributed is None else distributed

    def bias(n):
        return (1 if distributed else n, n)

    block = ([(d // tp, d * d // tp), bias(d // tp)] * 3  # q, k, v: column-parallel weight and bias
             + [(d, d * d // tp), bias(d)]  # proj: row-parallel weight (stored out x in/tp), whole bias
             + [(hidden // tp, d * hidden // tp), bias(hidden // tp)]  # fc1
             + [(d, hidden * d // tp), bias(d)]  # fc2
             + [(d, d)] * 4)  # norm1, norm2: weight and bias
    return block


def _root_shapes(shape):
    """([(first dimension, elements)] of the root's tensors but the head: the patch embedding (convolution), its
    bias, the position embedding, the final norm; [the head's weight]), each as far as `shape` holds them."""
    d, patch_values = shape.embed_dim, shape.patch_size ** 2
    embedding = [(d, d * shape.in_channels * patch_values), (d, d), (1, shape.tokens * d)] \
        if shape.holds_embedding else []
    norm = [(d, d), (d, d)] if shape.holds_head else []
    head = [(shape.out_channels * patch_values, d * shape.out_channels * patch_values)] if shape.holds_head else []
    return embedding + norm, head


def _shard(rows, numel, dp):
    """FSDP's rank 0 share of a tensor: ceil(rows / dp) of its first dimension."""
    return math.ceil(rows / dp) * (numel // rows)


def parameters_per_rank(shape, layout=SERIAL):
    """Parameters held by one rank; with FSDP its share of each tensor over dp: the first dimension split in
    ceil-sized chunks, so rank 0 holds the most, and that is the count given."""
    tensors = _tensor_shapes(shape, layout.tp, layout.model_parallel > 1)
    if not layout.fsdp or layout.dp == 1:
        return sum(numel for _, numel in tensors)
    return sum(_shard(rows, numel, layout.dp) for rows, numel in tensors)


def state_bytes_per_rank(shape, layout=SERIAL):
    """{"parameters", "gradients", "optimizer_state"}: fp32 bytes on one rank (Adam: two moments)."""
    params = 4 * parameters_per_rank(shape, layout)
    return {"parameters": params, "gradients": params, "optimizer_state": 2 * params}


def _chunk(size, parts):
    """Rank 0's part of `size` split over `parts` ranks: the largest of compute_split_shapes."""
    return compute_split_shapes(size, parts)[0]


def saved_activation_bytes(shape, batch, half=False, layout=SERIAL):
    """Bytes saved for the backward pass by one forward of `batch` samples on rank 0 of a tp x cp layout (DDP, or
    FSDP in fp32; FSDP's 16-bit policy is not modelled), as loop/profiling.SavedActivations measures them.

    Tokens: t in all, t_c in this rank's cp chunk (the blocks' attention and MLP work on it), t_s between the blocks
    (t_c, or its part over tp with sequence parallelism); keys and values are all-gathered to t under cp.

    Per block and sample, in fp32: the inputs of both LayerNorms (the residual stream: t_s D) and their outputs
    (the column-parallel inputs, all-gathered under sequence parallelism: t_c D), q (t_c D / tp), k and v, the
    attention output (also proj's input: a view), fc1's output and GELU's output (t_c hidden / tp each), the norms'
    means and inverse deviations and attention's log-sum-exp. Under 16-bit autocast the norms run in fp32 on the
    fp32 residual stream; the attention casts the norm's output once for q, k and v (autocast's cast cache holds
    weights only, so each would cast it again: distributed.layers.cast_once_for_autocast), fc1 casts its own input,
    and each 16-bit weight copy is saved once per forward. The serial layers keep
    their outputs in 16 bits; the distributed layers add their bias in fp32, so fc1's output is fp32 and q, k, v
    and GELU's output are 16-bit casts. Outside the blocks: the input image (its 16-bit cast), the final norm's input
    (t_c) and the head's input (t, gathered over cp), and the 16-bit copies of the patch-embedding and head weights.
    With checkpointing a block keeps only its input (fp32: the residual stream).

    The cp method (layout.cp_method) changes what the attention keeps: all-gather its queries and the whole
    sequence's K/V (t_kv = t); ring its own K/V block (t_kv = t_c), and under autocast q, k, v and its output in fp32
    (they reach it fp32) with proj's 16-bit cast of that output; all-to-all q, k, v and its output on heads / cp heads
    for all t tokens (4 t D / cp), and proj's input, the output back on this rank's tokens (measured to the byte
    against dry runs of wfm_tiny, fp32 and bf16, cp 2 and 4, tp 2 x cp 2)."""
    d, t, hidden, heads = shape.embed_dim, shape.tokens, shape.hidden, shape.num_heads
    tp, cp, sequence_parallel, checkpointing = layout.tp, layout.cp, layout.sequence_parallel, layout.checkpointing
    t_c = _chunk(t, cp)
    t_s = _chunk(t_c, tp) if sequence_parallel and tp > 1 else t_c
    method = cp_method_of(layout)
    distributed = tp * cp > 1
    image = shape.in_channels * band_tokens(shape, cp) * shape.patch_size ** 2  # the input: this rank's band
    lse = 4 * (heads // (tp * cp)) * t if method == "alltoall" else 4 * (heads // tp) * t_c  # log-sum-exp (fp32)
    stats = 2 * 8 * t_s + lse  # LayerNorm mean/rstd (fp32) and attention's log-sum-exp
    qkv = t_c * d // tp + kv_values(shape, layout)  # values of q, k and v
    if method == "alltoall":  # q, k, v and the output on heads / cp heads over every token
        qkv = 2 * kv_values(shape, layout)
    weights = 0
    if checkpointing:
        block = 4 * t_s * d
    elif not half:
        block = 4 * (2 * t_s * d + 2 * t_c * d + qkv + t_c * d // tp + 2 * t_c * hidden // tp) + stats
    else:
        casts = shape.attention_input_casts + 1  # and fc1's
        # the attention: its 16-bit q, k, v and output (proj's input); the ring keeps q, k, v and its output as it
        # gets them, in fp32 (the distributed layers' fp32 bias), and proj casts that output
        attention = 18 * t_c * d // tp if method == "ring" else 2 * qkv + 2 * t_c * d // tp
        block = 2 * 4 * t_s * d + casts * 2 * t_c * d + attention + stats  # norms, casts, attention
        block += (4 + 2) * t_c * hidden // tp if distributed else 2 * 2 * t_c * hidden  # fc1 out, GELU out
        weights = 2 * (4 * d * d + 2 * d * hidden) // tp
    patch_values = shape.patch_size ** 2
    # the first stage keeps the image; the last the final norm's input and statistics and the head's input
    root = ((2 if half else 4) * image if shape.holds_embedding else 0) + \
        (4 * t_c * d + 8 * t_c + (2 if half else 4) * t * d if shape.holds_head else 0)
    root_weights = 2 * d * (shape.in_channels * shape.holds_embedding + shape.out_channels * shape.holds_head) * \
        patch_values if half else 0
    return batch * (shape.depth * block + root) + shape.depth * weights + root_weights


def kv_values(shape, layout=SERIAL):
    """Values of keys and values that one block's attention keeps for the backward pass on rank 0 of `layout`:
    all-gather the whole sequence's (2 t D, D = embed / tp: the same at every cp), ring its own block (2 t_c D),
    all-to-all every token's on heads / cp heads (2 t D / cp)."""
    t, d, tp, cp = shape.tokens, shape.embed_dim, layout.tp, layout.cp
    method = cp_method_of(layout)
    if method == "alltoall":
        return 2 * t * d // (tp * cp)
    return 2 * (t if method == "allgather" and cp > 1 else _chunk(t, cp)) * d // tp


def kv_bytes_per_rank(shape, layout, batch, half=False):
    """Bytes of keys and values the attention of every block keeps on rank 0 at a local batch of `batch`: kv_values
    in the dtype each method keeps them (16-bit under autocast, but the ring's fp32: they reach it so)."""
    width = 2 if half and cp_method_of(layout) != "ring" else 4
    return batch * shape.depth * width * kv_values(shape, layout)


def collectives_per_step(shape, batch, layout=SERIAL, activation_bytes=4, half=False):
    """Every collective of one training step on rank 0, as (group, op, bytes, when): the group ("tp", "cp",
    "tp-cp", "dp"), the op ("all_reduce", "all_gather", "reduce_scatter"), the bytes handed to the network (the
    whole tensor of an all-reduce, the gathered output of an all-gather, the input of a reduce-scatter; what a ring
    then moves per rank is (n-1)/n of it, twice for an all-reduce; padded chunks count padded, as the collectives
    pad them) and when it runs: "activations" (forward and backward, on the critical path), "gradients" (DDP's
    comm hook, overlapped with the backward pass), "weights" (FSDP's gathers and scatters, overlapped with the
    forward and backward), "step" (the sums on FSDP's gradient shards, before the optimizer step), "targets" (the
    targets' bands gathered over cp before the step, on the critical path).

    `activation_bytes` is the size of one activation or activation-gradient value; with `half` (16-bit autocast)
    the row-parallel exits' outputs and their gradients are 16-bit (the matmul's output; the bias is added after the
    sum), everything else stays fp32 (the norms' outputs entering a column-parallel layer, keys and values with their
    fp32 bias, the residual stream), except under FSDP, whose mixed-precision policy makes every activation 16-bit.
    Gradients are fp32.

    Blocks (checkpointing repeats the forward's collectives up to fc1 in the backward pass): tp without sp
    all-reduces the row-parallel outputs forward and the column-parallel inputs' gradients backward; with sp these
    become all-gathers and reduce-scatters of the same tensors. cp all-gathers keys and values forward and
    reduce-scatters their gradients backward. Outside the blocks the tokens split over cp and sp are all-gathered
    before the head (a cp rank embeds only its band of the image: no split there), and the targets' bands over cp
    before the step ("targets"). Gradients, in DDP's hook or before FSDP's step: the cp sums of every block weight,
    the embeddings and the final norm, the tp sums (or averages) of the norms and row-parallel biases, the tp-cp
    averages of the embeddings, final norm and head;
    then DDP all-reduces everything over dp, or FSDP all-gathers each block twice (forward, backward) and the root
    once (in the autocast dtype with `half`: its mixed-precision policy), and reduce-scatters the gradients (fp32).
    """
    d, t, depth = shape.embed_dim, shape.tokens, shape.depth
    tp, cp, dp, sequence_parallel, fsdp = layout.tp, layout.cp, layout.dp, layout.sequence_parallel, layout.fsdp
    checkpointing = layout.checkpointing
    t_c = _chunk(t, cp)
    t_s = _chunk(t_c, tp) if sequence_parallel and tp > 1 else t_c
    act = activation_bytes * batch
    out_act = (2 if half else activation_bytes) * batch  # a row-parallel exit's output (and its gradient)
    if fsdp and half:  # FSDP's policy runs the forward on 16-bit weights: every activation is 16-bit
        act = out_act
    found = []

    def add(group, op, nbytes, when="activations"):
        if nbytes:
            found.append((group, op, nbytes, when))

    # checkpointing's recomputation stops at the block's last saved tensor (GELU's output): it repeats the
    # collectives up to fc1, not fc2's exit
    again = 1 if checkpointing else 0
    if tp > 1:
        if sequence_parallel:
            gathered, scattered = tp * t_s * d, t_c * d
            add("tp", "all_gather", depth * act * (2 + 2 * again) * gathered)  # the entries (forward, recomputed)
            add("tp", "reduce_scatter", depth * out_act * (2 + again) * scattered)  # the exits
            add("tp", "reduce_scatter", depth * act * 2 * scattered)  # backward: the entries' adjoints
            add("tp", "all_gather", depth * out_act * 2 * gathered)  # the exits' adjoints
            # the token split before the blocks (its backward) and the join after them (forward)
            add("tp", "all_gather", (shape.holds_embedding + shape.holds_head) * act * tp * t_s * d)
        else:
            add("tp", "all_reduce", depth * out_act * (2 + again) * t_c * d)  # the exits (forward, recomputed)
            add("tp", "all_reduce", depth * act * 2 * t_c * d)  # backward: the entries' gradients
    if cp > 1:
        method = cp_method_of(layout)
        if method == "allgather":
            add("cp", "all_gather", depth * act * 2 * (1 + again) * cp * t_c * d // tp)  # keys and values
            add("cp", "reduce_scatter", depth * act * 2 * t * d // tp)  # their gradients
        elif method == "ring":
            # this rank sends each K/V block it holds on to the next rank, all but the last (forward, recomputed,
            # backward), at their own lengths; in the backward each block's dK/dV sum (fp32) follows it one step
            # behind, cp sends in all (the last brings this rank's predecessor's sum home)
            shapes = compute_split_shapes(t, cp)
            passed = sum(shapes[-step % cp] for step in range(cp - 1))  # the blocks rank 0 holds at steps 0..cp-2
            add("cp", "send_recv", depth * act * 2 * (2 + again) * passed * d // tp, "ring")  # keys and values
            add("cp", "send_recv", depth * 4 * batch * 2 * t * d // tp, "ring")  # dK/dV, every block once
        else:  # all-to-all: q, k, v (one message) to head shards, the output back; backward the same, reversed
            heads_share = t * d // (tp * cp)  # values of one tensor on heads / cp heads over every token
            add("cp", "all_to_all", depth * act * (2 + again) * 3 * t_c * d // tp)  # q, k, v and their gradients
            add("cp", "all_to_all", depth * out_act * (2 + again) * heads_share)  # the output and its gradient
        # the join before the head (forward; its backward keeps this rank's part). The split after the embedding
        # moves nothing: a rank embeds its own band of the image (distributed/bands.py)
        add("cp", "all_gather", act * cp * t_c * d if shape.holds_head else 0)
        # the target's bands, gathered before the step (train_mp.py's to_device: Band.whole), fp32
        add("cp", "all_gather", 4 * batch * cp * t_c * shape.out_channels * shape.patch_size ** 2, "targets")
    block = _block_shapes(shape, tp, tp * cp > 1)
    but_head, head = _root_shapes(shape)
    root = but_head + head

    def held(group):
        return sum(_shard(rows, numel, dp) if fsdp else numel for rows, numel in group)

    if tp * cp > 1:  # DDP's hook, or the sums on FSDP's shards (also at dp = 1)
        when = "step" if fsdp else "gradients"
        if tp > 1:
            add("tp", "all_reduce", 4 * depth * held([block[7], block[11]] + block[12:]), when)  # row biases, norms
        if cp > 1:
            # block weights, the embeddings (each rank embeds its band) and the final norm
            add("cp", "all_reduce", 4 * (depth * held(block) + held(but_head)), when)
        add("tp-cp", "all_reduce", 4 * held(root), when)
    if dp > 1 and fsdp:
        padded_block = dp * held(block)
        gathered = 2 if half else 4  # FSDP's mixed-precision policy gathers the weights in the autocast dtype
        add("dp", "all_gather", gathered * (2 * depth * padded_block + dp * held(root)), "weights")
        add("dp", "reduce_scatter", 4 * (depth * padded_block + dp * held(root)), "weights")  # fp32 gradients
    elif dp > 1:
        add("dp", "all_reduce", 4 * parameters_per_rank(shape, Layout(tp=tp, cp=cp)), "gradients")
    return found


def comm_bytes_per_step(shape, batch, layout=SERIAL, activation_bytes=4, half=False):
    """Bytes the collectives of one training step hand to the network on rank 0, summed by process group ("tp",
    "cp", "tp-cp", "dp"): collectives_per_step, totalled."""
    return _bytes_by_group(collectives_per_step(shape, batch, layout, activation_bytes, half))


def _bytes_by_group(collectives):
    out = {"tp": 0, "cp": 0, "tp-cp": 0, "dp": 0}
    for group, _, nbytes, _ in collectives:
        out[group] += nbytes
    return out


# ---------------------------------------------------------------------------------------------------------------
# Time and memory on a GPU: a roofline per kind of work, from the counts above and a table of systems.

@dataclass(frozen=True)
class System:
    """One GPU kind in a Perlmutter-style node: 4 GPUs on NVLink, one 25 GB/s Slingshot-11 NIC per GPU. FLOP/s are
    dense tensor-core peaks by precision (utils/gpus.py); `vector_flops`: fp32 on the CUDA cores (softmax's
    exponentials); `nvlink_pair`: bytes/s one way between two GPUs of the node (a ring sends to one neighbour); memory
    in GiB."""
    name: str
    tensor_flops: dict
    vector_flops: float
    hbm_bytes_per_s: float
    memory_gib: float
    nvlink_pair: float
    nic_bytes_per_s: float = 25e9
    gpus_per_node: int = 4


def _system(name, gpu, hbm_bytes_per_s, memory_gib, nvlink_pair, **node):
    """A System of the GPU `gpu`, with its peak FLOP/s from utils/gpus.py (the table MFU is measured against)."""
    peaks = GPU_PEAKS[gpu]
    return System(name, peaks.tensor_flops(), peaks.fp32, hbm_bytes_per_s, memory_gib, nvlink_pair, **node)


# bandwidths and memory: vendor datasheets; FLOP/s: utils/gpus.py; NVLink: links per GPU pair x 25 GB/s one way
SYSTEMS = {system.name: system for system in (
    _system("A100-40GB", "A100", 1.555e12, 40, 4 * 25e9),  # Perlmutter: 4 NVLink-3 links per pair
    _system("A100-80GB", "A100", 2.039e12, 80, 4 * 25e9),
    _system("H100-SXM", "H100", 3.35e12, 80, 6 * 25e9),  # 4-GPU HGX board: 6 NVLink-4 links per pair
    _system("H200", "H200", 4.8e12, 141, 6 * 25e9),
    # an 8-GPU HGX H200 node (the published cp comparison's): NVSwitch gives any pair a GPU's 18 NVLink-4 links;
    # one 400 Gb/s ConnectX-7 NIC per GPU
    _system("H200-HGX8", "H200", 4.8e12, 141, 18 * 25e9, nic_bytes_per_s=50e9, gpus_per_node=8),
)}

# The fraction of a peak that each kind of work reaches: one number each, for every layout and system (none is
# fitted to a configuration; README's table shows how close they land on the published runs).
EFFICIENCY = {
    # tensor-core work: FlashAttention-2's paper (Dao, 2023) measures its forward + backward pass at about half of
    # the A100's 16-bit peak at head dimension 64; the same fraction is taken for the linear layers' GEMMs
    "matmul": 0.5,
    # elementwise and normalisation kernels stream at about 80% of HBM bandwidth (a STREAM-like copy's fraction)
    "memory": 0.8,
    # NCCL rings reach about 80% of a link's bandwidth on large messages (nccl-tests' bus bandwidth)
    "network": 0.8,
}
# GPU memory outside the model's tensors: the CUDA context, NCCL's buffers, DALI's pools. The tutorial logs it as
# "Scaffolding memory high watermark" (NVML's used memory once the model and DDP are built; the original tutorial's
# README: 10.48 GB at tp=1, 10.18 GB at tp=4 on the mp config), less the parameters and DDP's gradient buckets it
# then holds (2 x 0.59, 2 x 0.17 GB): 9.30 and 9.85 GB, 9.6 on average.
RUNTIME_OVERHEAD_GIB = 9.6
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)  # FlashAttention's kernels; a head dimension runs padded up
SOFTMAX_OPS = (5, 6)  # fp32 operations per attention score: forward (scale, max, subtract, exp, sum) and backward
#                       (the recomputed probabilities: scale, subtract, exp; dS = P (dP - D), its scale)
ADAM_BYTES_PER_PARAMETER = 28  # one fused pass: read weight, gradient and both moments, write weight and moments
GIB = 1024 ** 3


def group_spans_nodes(layout, gpus_per_node):
    """{group: True if one of its groups holds ranks of two nodes} for the groups of `layout` (ranks fill the nodes
    in order, `gpus_per_node` each); with a pipeline also "pp" (the slowest dimension unless the order names it)."""
    if layout.pp > 1:
        return dict(_spans_with_pp(layout.tp, layout.cp, layout.dp, layout.pp, layout.order, gpus_per_node))
    return dict(_spans(layout.tp, layout.cp, layout.dp, layout.order, gpus_per_node))


@functools.lru_cache(maxsize=4096)
def _spans_with_pp(tp, cp, dp, pp, order, gpus_per_node):
    grid = Layout(tp=tp, cp=cp, dp=dp, pp=pp, microbatches=pp, order=order).grid()
    return tuple((name, any(len({rank // gpus_per_node for rank in ranks}) > 1 for ranks in grid.get_ranks(name)))
                 for name in ("tp", "cp", "tp-cp", "dp", "pp"))


@functools.lru_cache(maxsize=4096)
def _spans(tp, cp, dp, order, gpus_per_node):
    grid = Layout(tp=tp, cp=cp, dp=dp, order=order).grid()
    return tuple((name, any(len({rank // gpus_per_node for rank in ranks}) > 1 for ranks in grid.get_ranks(name)))
                 for name in ("tp", "cp", "tp-cp", "dp"))


def _group_size(layout, group):
    return {"tp": layout.tp, "cp": layout.cp, "tp-cp": layout.tp * layout.cp, "dp": layout.dp, "pp": layout.pp}[group]


def collective_seconds(op, nbytes, ranks, bandwidth):
    """A ring collective of `ranks` ranks: each rank sends (n-1)/n of the data once (all-gather: of its output;
    reduce-scatter: of its input; all-to-all: of its input, the pieces for the other ranks), twice for an
    all-reduce, at `bandwidth` bytes/s times the network efficiency. A point-to-point send ("send_recv": the ring's
    blocks) sends all its bytes to one rank."""
    if ranks == 1:
        return 0.0
    if op == "send_recv":
        return nbytes / (bandwidth * EFFICIENCY["network"])
    wire = (2 if op == "all_reduce" else 1) * (ranks - 1) / ranks * nbytes
    return wire / (bandwidth * EFFICIENCY["network"])


def attention_scores(shape, layout=SERIAL):
    """Attention scores (query-key pairs, over this rank's heads) of one sample in one block on the cp group's
    slowest rank, which the others wait for. All-gather and ring: this rank's t_c queries against all t keys
    (heads / tp); all-to-all: every query against every key on heads / (tp cp) heads: the same work, whole. Causal
    attention (the published comparison's) computes the unmasked pairs only: t^2 / 2 whole; over contiguous cp chunks
    the last rank's queries see the most keys, t_c (t - t_c / 2), where all-to-all still splits heads evenly."""
    t, heads, tp, cp = shape.tokens, shape.num_heads, layout.tp, layout.cp
    if cp_method_of(layout) == "alltoall":
        pairs, heads_here = (t * t // 2 if shape.causal else t * t), heads // (tp * cp)
    else:
        t_c, heads_here = _chunk(t, cp), heads // tp
        pairs = t_c * t  # this rank's queries x all keys
        if shape.causal:
            pairs = t * t // 2 if cp == 1 else t_c * t - t_c * t_c // 2
    return pairs * heads_here


def attention_work_per_sample(shape, layout=SERIAL):
    """(tensor-core FLOPs, fp32 softmax operations) that attention's kernels execute for one sample on one rank:
    the head dimension padded to a FlashAttention kernel's, the backward pass recomputing the scores (10 T^2 D, where
    the flop counter counts 8), checkpointing's second forward."""
    _, padded = _head_dims(shape)
    checkpointing = layout.checkpointing
    scores = attention_scores(shape, layout)
    forwards = 2 if checkpointing else 1
    tensor = scores * padded * (4 * forwards + 10)
    return shape.depth * tensor, shape.depth * scores * (SOFTMAX_OPS[0] * forwards + SOFTMAX_OPS[1])


def gemm_flops_per_sample(shape, layout=SERIAL):
    """The linear layers' and the patch embedding's FLOPs for one sample on one rank: each block's on this rank's
    tokens and columns (checkpointing: a second forward), the embedding and head on every token (each rank)."""
    d, t_c, tp = shape.embed_dim, _chunk(shape.tokens, layout.cp), layout.tp
    linear = 2 * t_c * (4 * d * d + 2 * d * shape.hidden) // tp
    outside = embed_flops_per_sample(shape) + head_flops_per_sample(shape)
    return shape.depth * linear * (4 if layout.checkpointing else 3) + outside


def memory_bound_bytes_per_sample(shape, layout=SERIAL, half=False):
    """Bytes the elementwise and normalisation kernels of one sample's blocks read and write on one rank (an
    estimate from the ops of networks/vit.py and distributed/layers.py, each operand streamed once; the backward
    pass moves twice the forward's). Per block: the residual stream R (t_s D values), the norms' outputs entering
    the linear layers C (t_c D), this rank's attention output S (t_c D / tp) and MLP activations H (t_c hidden / tp).
    Forward: the two LayerNorms (fp32 in and out: 16 R), the two residual adds (20 R in 16-bit autocast: fp32 stream
    plus a 16-bit branch; 24 R in fp32), attention's output back to tokens (4 or 8 S), GELU (4 or 8 H); under
    autocast the casts of the norms' outputs (6 C each: one for q, k and v, one for fc1; the original's code cast
    for each of q, k and v). The distributed layers add their biases outside the GEMM (fp32: q, k, v, proj, fc1,
    fc2)."""
    tp, cp = layout.tp, layout.cp
    d, t_c = shape.embed_dim, _chunk(shape.tokens, cp)
    t_s = _chunk(t_c, tp) if layout.sequence_parallel and tp > 1 else t_c
    r, c, s, h = t_s * d, t_c * d, t_c * d // tp, t_c * shape.hidden // tp
    if half:
        forward = 36 * r + 6 * (shape.attention_input_casts + 1) * c + 4 * s + 4 * h
        bias = 18 * s + 12 * r + 8 * h
    else:
        forward = 40 * r + 8 * s + 8 * h
        bias = 24 * s + 16 * r + 8 * h
    if tp * cp > 1:
        forward += bias
    return shape.depth * (forward * (4 if layout.checkpointing else 3) + _cp_method_bytes(shape, layout, half))


def _cp_method_bytes(shape, layout, half):
    """Bytes one block's cp method moves through HBM for one sample besides the attention kernels (an estimate, as
    the rest of memory_bound_bytes_per_sample, in units of this rank's q or output, c = t_c D): the ring stacks its K
    and V (16 c, forward and backward), merges each block's result into the running one in fp32 (read both, write
    one: 12 c, cp - 1 merges) and in the backward adds each block's dQ and dK/dV parts and the dK/dV sums received
    (52 c a step), the output's gradient cast to fp32 under autocast; all-to-all copies each tensor it moves three
    times, read and written (stacked, packed, unpacked: q, k, v fp32 under autocast, the output 16-bit), forward and
    backward. Checkpointing repeats the forward's. All-gather: none counted (nccl writes into the gathered tensor)."""
    method, tp, cp = cp_method_of(layout), layout.tp, layout.cp
    if method == "allgather":
        return 0
    c = _chunk(shape.tokens, cp) * shape.embed_dim // tp
    forwards = 2 if layout.checkpointing else 1
    if method == "ring":
        return c * (forwards * (16 + 12 * (cp - 1)) + 16 + 52 * cp - 24 + (6 if half else 0))
    out = 2 if half else 4
    return c * (forwards + 1) * 3 * 2 * (3 * 4 + out)


def _block_saved_bytes(shape, batch, half, layout):
    """Saved activations of one block (without checkpointing): what its backward pass (or recomputation) holds."""
    unchecked = dataclasses.replace(layout, checkpointing=False)
    one, none = (saved_activation_bytes(dataclasses.replace(shape, depth=depth), batch, half, unchecked)
                 for depth in (1, 0))
    return one - none


def memory_bytes(shape, layout, batch, half, ddp=True):
    """Bytes of tensors on rank 0 at a local batch of `batch`, by kind, with their sums "after_forward" and "peak".
    After the forward of a step (the previous step's gradients set to None): fp32 weights and Adam's moments (FSDP:
    this rank's shards, and the root module's weights, gathered (in the autocast dtype with `half`) until its
    backward), DDP's flat gradient buckets (`ddp`: more than one rank and no --noddp), the batch (input and target)
    and the saved activations. The peak, during the backward pass: that, plus the gradients and one block's
    activations (its recomputation under checkpointing, its gradients otherwise), and what the cp method holds in
    flight then (cp_buffer_bytes: none for all-gather)."""
    dp = layout.dp
    states = state_bytes_per_rank(shape, layout)
    buckets = states["gradients"] if ddp and layout.world_size > 1 and not layout.fsdp else 0
    found = {"weights": states["parameters"], "optimizer_state": states["optimizer_state"], "ddp_buckets": buckets,
             "gathered_root": 0}
    if layout.fsdp and dp > 1:
        root = sum(_root_shapes(shape), [])
        found["gathered_root"] = (2 if half else 4) * sum(numel for _, numel in root)
    # the input (this rank's band under cp) and the target (its band gathered over cp: the whole field)
    patch_values = batch * shape.patch_size ** 2
    found["input_batch"] = 4 * patch_values * (shape.in_channels * band_tokens(shape, layout.cp) +
                                               shape.out_channels * shape.tokens)
    found["saved_activations"] = saved_activation_bytes(shape, batch, half, layout)
    found["after_forward"] = sum(found.values())
    found["gradients"] = states["gradients"]
    found["backward_block"] = _block_saved_bytes(shape, batch, half, layout)
    found["cp_buffers"] = cp_buffer_bytes(shape, layout, batch)
    found["peak"] = found["after_forward"] + found["gradients"] + found["backward_block"] + found["cp_buffers"]
    return found


def cp_buffer_bytes(shape, layout, batch):
    """The copies a cp method makes of what it moves, held only while it moves them (an estimate; c = t_c D values,
    fp32 as this repository's methods move them under autocast): the ring a stacked copy of the K/V block it sends
    and the block it receives (2 x 2 c x 4 bytes); all-to-all q, k, v (or their gradients) stacked, packed into its
    send buffer and received (3 x 3 c x 4 bytes); all-gather none (NCCL gathers into the K/V it saves). The
    gradients in flight (the ring's dK/dV sums, all-gather's dK/dV of the whole sequence before its reduce-scatter)
    are left, for every method alike, in the one block of the backward pass that memory_bytes counts."""
    method = cp_method_of(layout)
    if method == "allgather":
        return 0
    c = _chunk(shape.tokens, layout.cp) * shape.embed_dim // layout.tp
    return batch * (16 if method == "ring" else 36) * c


def block_flops_per_sample(shape, layout=SERIAL):
    """(forward, backward) FLOPs of one transformer block for one sample on one rank (the flop counter's way: its
    tokens and columns; attention 4 and 8 T_c T D / tp)."""
    d, t_c, tp = shape.embed_dim, _chunk(shape.tokens, layout.cp), layout.tp
    forward = (2 * t_c * (4 * d * d + 2 * d * shape.hidden) + 4 * t_c * shape.tokens * d) // tp
    return forward, 2 * forward


def predict(shape, system, layout, global_batch, amp_mode="bf16", overhead_gib=RUNTIME_OVERHEAD_GIB):
    """Memory, time and speed of one training step of the ViT `shape` on `system` in `layout` (global batch over
    dp; amp_mode "none" runs on TF32, as the tutorial's container does). Returns a dict: samples_per_sec, mfu,
    memory_after_forward_gb and peak_memory_gb (GiB, as the tutorial logs them: memory_bytes plus the runtime
    overhead; the tutorial's " Memory usage after forward pass" reads NVML's used memory at the second step, when the
    allocator's cache already holds the first step's peak: read it against peak_memory_gb), fits (the peak within
    the GPU's memory), the time breakdown of a step (matmul, softmax, memory-bound, exposed communication: the
    activations' collectives and the sums before FSDP's step, and whatever of DDP's gradient all-reduces outlasts
    the backward pass, or of FSDP's gathers and scatters the whole compute), parts_s (the compute in a step
    profile's parts: attention, GEMMs, memory-bound), flops_per_sample (the serial model's,
    what MFU counts), comm_bytes_per_step by group, counts (one block's FLOPs, the bytes of memory_bytes, every
    collective) and the layout."""
    layout.check(global_batch=global_batch, depth=shape.depth)  # the batch splits over dp (utils/layout.py)
    if layout.pp > 1:
        return predict_pipeline(shape, system, layout, global_batch, amp_mode, overhead_gib)
    batch = global_batch // layout.dp
    half = amp_mode in ("bf16", "fp16")
    peak_flops = system.tensor_flops[amp_mode if half else "tf32"]
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    # time: compute, memory-bound, communication
    attention_flops, softmax_ops = attention_work_per_sample(shape, layout)
    gemm_s = batch * gemm_flops_per_sample(shape, layout) / (peak_flops * EFFICIENCY["matmul"])
    attention_matmul_s = batch * attention_flops / (peak_flops * EFFICIENCY["matmul"])
    matmul_s = gemm_s + attention_matmul_s
    softmax_s = batch * softmax_ops / (system.vector_flops * EFFICIENCY["matmul"])  # compute too: the same fraction
    held = parameters_per_rank(shape, layout)
    memory_s = (batch * memory_bound_bytes_per_sample(shape, layout, half) + ADAM_BYTES_PER_PARAMETER * held) / \
        (system.hbm_bytes_per_s * EFFICIENCY["memory"])
    compute_s = matmul_s + softmax_s + memory_s
    backward_s = compute_s * (3 / 4 if layout.checkpointing else 2 / 3)  # the backward pass (with its recomputation)
    spans = group_spans_nodes(layout, system.gpus_per_node)
    comm_s = {"activations": 0.0, "gradients": 0.0, "weights": 0.0, "step": 0.0, "ring": 0.0, "targets": 0.0}
    collectives = collectives_per_step(shape, batch, layout, half=half)
    for group, op, nbytes, when in collectives:
        bandwidth = system.nic_bytes_per_s if spans[group] else system.nvlink_pair
        comm_s[when] += collective_seconds(op, nbytes, _group_size(layout, group), bandwidth)
    ring = ring_steps(shape, system, layout, batch, amp_mode) if cp_method_of(layout) == "ring" else None
    exposed_s = comm_s["activations"] + comm_s["targets"] + comm_s["step"] + \
        max(0.0, comm_s["gradients"] - backward_s) + max(0.0, comm_s["weights"] - compute_s) + \
        (ring["exposed_s"] if ring else 0.0)
    step_s = compute_s + exposed_s
    samples_per_sec = global_batch / step_s
    memory = memory_bytes(shape, layout, batch, half)
    flops = flops_per_sample(shape)
    return {
        "tp": tp, "cp": cp, "dp": dp, "gpus": layout.world_size, "order": layout.order, "flags": layout.flags(),
        "system": system.name, "amp_mode": amp_mode, "global_batch_size": global_batch, "local_batch_size": batch,
        "samples_per_sec": samples_per_sec,
        "mfu": flops * samples_per_sec / (layout.world_size * peak_flops),
        "memory_after_forward_gb": memory["after_forward"] / GIB + overhead_gib,
        "peak_memory_gb": memory["peak"] / GIB + overhead_gib,
        "fits": memory["peak"] / GIB + overhead_gib <= system.memory_gib,
        "step_time_s": step_s,
        "time_breakdown_s": {"matmul": matmul_s, "softmax": softmax_s, "memory_bound": memory_s,
                             "exposed_communication": exposed_s},
        # the compute again, in the parts a step profile measures (benchmarks/step_profile.py): the attention kernels
        # (their matmuls and softmax), the linear layers' GEMMs, and the memory-bound kernels (norms, elementwise,
        # Adam's update)
        "parts_s": {"attention": attention_matmul_s + softmax_s, "gemm": gemm_s, "memory_bound": memory_s},
        "flops_per_sample": flops,
        "comm_bytes_per_step": _bytes_by_group(collectives),
        "comm_seconds": comm_s,
        "cp_method": cp_method_of(layout),
        "ring": ring,  # ring layouts: its steps, their compute and transfer, the blocks that hide it (ring_steps)
        "parameters_per_gpu": held,
        "counts": {  # rank 0, one step at the local batch (bytes; FLOPs per sample)
            "block_flops_per_sample": dict(zip(("forward", "backward"), block_flops_per_sample(shape, layout))),
            "memory_bytes": memory,
            "collectives": [{"group": group, "op": op, "bytes": nbytes, "when": when}
                            for group, op, nbytes, when in collectives],
        },
    }


def cp_link(system, layout):
    """(bytes/s one way, "NVLink" or "network") of the link the cp group's transfers cross: a GPU pair's NVLink
    inside a node, the NIC when the group spans nodes (the slowest hop sets a ring's pace)."""
    if group_spans_nodes(layout, system.gpus_per_node)["cp"]:
        return system.nic_bytes_per_s, "network"
    return system.nvlink_pair, "NVLink"


def ring_minimal_block(flops, link_bytes_per_s, kv_bytes=2):
    """Ring Attention's overlap condition (Liu et al., 2023): a block of c query tokens attends to a block of c key
    tokens in 4 c^2 d FLOPs (q k^T, then the probabilities times v) while the next K and V block, 2 c d values of
    `kv_bytes`, crosses the link: the transfer hides when 4 c^2 d / F >= 2 c d kv_bytes / B, that is when the block
    holds c >= F kv_bytes / (2 B) tokens: F / B for 16-bit K and V (F the peak FLOP/s, B the link's bytes/s)."""
    return flops * kv_bytes / (2 * link_bytes_per_s)


def _head_dims(shape):
    head_dim = shape.embed_dim // shape.num_heads
    return head_dim, next((size for size in FLASH_HEAD_DIMS if size >= head_dim), head_dim)


def ring_steps(shape, system, layout, batch, amp_mode="bf16"):
    """The ring's steps on one block layer, for `batch` samples (seconds), and what of its transfers is exposed.

    A step computes one block (this rank's t_c queries against t_c keys, heads / tp: the kernels' tensor-core work,
    4 and 10 x the padded head dimension per score forward and backward, and the softmax's fp32 operations, at the
    model's efficiency) while the next K/V block crosses the cp link (cp_link; this repository's ring sends K and V
    in fp32 under autocast: they come out of the distributed layers with an fp32 bias; 16-bit under FSDP's policy),
    and in the backward also the dK/dV sum of the previous step (fp32). A step lasts the longer of its compute and its
    transfers. Forward: cp - 1 transfers behind cp - 1 blocks. Backward: the K/V blocks again and the dK/dV sums one
    step behind them; the last sum, sent after the last block, has nothing to hide behind. Checkpointing runs the
    forward ring twice. `min_block_tokens`: the block at which compute equals transfer, forward and backward, in
    this model, beside Liu's F / B on the same link (ring_minimal_block); `hidden`: whether the layout's block
    reaches both."""
    half = amp_mode in ("bf16", "fp16")
    flops = system.tensor_flops[amp_mode if half else "tf32"] * EFFICIENCY["matmul"]
    vector = system.vector_flops * EFFICIENCY["matmul"]
    bandwidth, link = cp_link(system, layout)
    moved = bandwidth * EFFICIENCY["network"]
    head_dim, padded = _head_dims(shape)
    kv_bytes = 2 if (layout.fsdp and half) else 4
    heads, cp, t_c = shape.num_heads // layout.tp, layout.cp, _chunk(shape.tokens, layout.cp)
    # seconds per score of all this rank's heads, and per block token transferred
    forward_pair = heads * (4 * padded / flops + SOFTMAX_OPS[0] / vector)
    backward_pair = heads * (10 * padded / flops + SOFTMAX_OPS[1] / vector)
    kv_token, dkv_token = 2 * heads * head_dim * kv_bytes / moved, 2 * heads * head_dim * 4 / moved
    forward_s, backward_s = batch * t_c * t_c * forward_pair, batch * t_c * t_c * backward_pair
    kv_s, dkv_s = batch * t_c * kv_token, batch * t_c * dkv_token
    exposed_forward = (cp - 1) * max(0.0, kv_s - forward_s)
    exposed_backward = max(0.0, kv_s - backward_s) + (cp - 2) * max(0.0, kv_s + dkv_s - backward_s) + \
        max(0.0, dkv_s - backward_s) + dkv_s
    forwards = 2 if layout.checkpointing else 1
    peak = system.tensor_flops[amp_mode if half else "tf32"]
    return {
        "link": link, "link_bytes_per_s": bandwidth, "block_tokens": t_c,
        "step_s": {"forward_compute": forward_s, "backward_compute": backward_s, "kv_transfer": kv_s,
                   "dkv_transfer": dkv_s},
        "min_block_tokens": {"forward": kv_token / forward_pair, "backward": (kv_token + dkv_token) / backward_pair,
                             "liu": ring_minimal_block(peak, bandwidth)},
        "hidden": kv_s <= forward_s and kv_s + dkv_s <= backward_s,
        "exposed_s": shape.depth * (forwards * exposed_forward + exposed_backward),
    }


def attention_over_dense(shape):
    """The attention core's FLOPs against the dense layers', per token of one block: 4 L e (q k^T and the
    probabilities times v, L keys) over 2 (4 e^2 + 2 e h) (q, k, v, proj and the MLP of width h): L / 6e at h = 4e.
    Causal attention computes half the scores."""
    e, t = shape.embed_dim, shape.tokens
    return 4 * t * e / (2 if shape.causal else 1) / (2 * (4 * e * e + 2 * e * shape.hidden))


def compute_seconds(prediction):
    """The compute of one step in a `predict` result (matmul, softmax and memory-bound kernels; no collective)."""
    return sum(prediction["time_breakdown_s"][kind] for kind in ("matmul", "softmax", "memory_bound"))


def predicted_memory_line(params, layout, ddp=True):
    """train_mp.py's start-up line: the model's memory of rank 0's tensors after the forward pass and at the peak.
    On a GPU the measured " Memory usage after forward pass" line is the allocator's high watermark since start-up,
    logged after the second step: read it against the peak."""
    if params.get("model", "vit") != "vit":
        return "Performance model: no memory prediction (it covers the ViT)"
    shape = ViTShape.from_params(params)
    if layout.pp > 1:  # rank 0 holds stage 0
        memory = stage_memory_bytes(stage_shapes(shape, layout)[0], layout, params.local_batch_size,
                                    params.amp_enabled, 0)
    else:
        memory = memory_bytes(shape, layout, params.local_batch_size, params.amp_enabled, ddp=ddp)
    stage = " of pipeline stage 0" if layout.pp > 1 else ""
    return (f"Predicted memory of the tensors{stage} (planning/perf_model.py): {memory['after_forward'] / GIB:.6f} GB "
            f"after the forward pass, {memory['peak'] / GIB:.6f} GB at the step's peak")


# ---------------------------------------------------------------------------------------------------------------
# Pipeline stages (--pipeline_parallel P, distributed/pipeline.py): each stage a ViT of its own blocks, the first
# with the patch and position embeddings, the last with the final norm and head; the step's local batch in M
# microbatches through them.

def stage_cost_ratios(shape):
    """(embedding, head) cost in blocks of a config's shape, as distributed/pipeline.stage_costs counts them on the
    serial model (the one formula: pipeline.cost_ratios)."""
    from distributed.pipeline import cost_ratios  # torch.distributed: only where a pipeline is planned
    return cost_ratios(shape.embed_dim, shape.tokens, shape.hidden, shape.in_channels, shape.out_channels,
                       shape.patch_size)


def stage_layers(shape, layout):
    """Blocks per stage: layout.pp_layers, or the cut of distributed/pipeline.balanced_layers with the embedding's
    and head's costs (stage_cost_ratios), as keep_stage cuts the model."""
    if layout.pp_layers:
        return tuple(layout.pp_layers)
    from distributed.pipeline import balanced_layers  # torch.distributed: only where a pipeline is planned
    return tuple(balanced_layers(shape.depth, layout.pp, *stage_cost_ratios(shape)))


def stage_shapes(shape, layout):
    """The ViTShape of each stage: its blocks, the embeddings on the first, the final norm and head on the last."""
    layers = stage_layers(shape, layout)
    last = len(layers) - 1
    return [dataclasses.replace(shape, depth=blocks, holds_embedding=index == 0, holds_head=index == last)
            for index, blocks in enumerate(layers)]


def bubble_fraction(stages, microbatches):
    """The share of a step a stage idles while the pipe fills and drains: (P - 1) / (M + P - 1), for GPipe and for
    1F1B alike (1F1B reorders the work, not the idle slots)."""
    return (stages - 1) / (microbatches + stages - 1)


def microbatches_in_flight(layout, stage):
    """Microbatches whose saved activations stage `stage` holds at its peak: GPipe all M (every forward before any
    backward); 1F1B its warm-up P - s - 1 and one more, P - s (at most M)."""
    if layout.pp_schedule == "gpipe":
        return layout.microbatches
    return min(layout.pp - stage, layout.microbatches)


def pp_tokens_per_rank(shape, layout):
    """Tokens of a stage's output on one rank (distributed/pipeline.Pipeline.tokens_shape): its cp chunk, split
    again over tp with sequence parallelism."""
    t_c = _chunk(shape.tokens, layout.cp)
    return _chunk(t_c, layout.tp) if layout.sequence_parallel and layout.tp > 1 else t_c


def pp_value_bytes(layout, half):
    """Bytes of one value sent between stages: fp32, or FSDP's 16-bit parameter dtype under autocast."""
    return 2 if layout.fsdp and half else 4


def p2p_bytes_per_step(shape, layout, batch, half=False):
    """Bytes one stage boundary carries each way per step at a local batch of `batch`: every microbatch's output
    forward and its gradient back, 2 x M x (batch / M) x tokens on this rank x embed_dim x bytes."""
    micro = batch // layout.microbatches
    return 2 * layout.microbatches * micro * pp_tokens_per_rank(shape, layout) * shape.embed_dim * \
        pp_value_bytes(layout, half)


def stage_memory_bytes(stage, layout, batch, half, index):
    """memory_bytes of pipeline stage `index` (its ViTShape `stage`) at a local batch of `batch`: its weights and
    Adam's moments, the batch (every stage loads it), the saved activations of the microbatches it holds in flight
    (microbatches_in_flight) and, but on the last stage, each one's output kept for its backward; at the peak also
    the gradients, one block's backward at the microbatch, the cp method's buffers and the gradient received from
    the next stage. No DDP buckets: a pipeline reduces its gradients over dp without DDP."""
    micro = batch // layout.microbatches
    found = memory_bytes(stage, layout, micro, half, ddp=False)
    for name in ("after_forward", "peak"):
        del found[name]
    output = 0 if stage.holds_head else \
        micro * pp_tokens_per_rank(stage, layout) * stage.embed_dim * pp_value_bytes(layout, half)
    found["input_batch"] *= layout.microbatches
    in_flight = microbatches_in_flight(layout, index)
    found["saved_activations"] = in_flight * (found["saved_activations"] + output)
    found["microbatches_in_flight"] = in_flight
    found["after_forward"] = sum(found[name] for name in ("weights", "optimizer_state", "ddp_buckets",
                                                          "gathered_root", "input_batch", "saved_activations"))
    found["pp_buffers"] = output  # the gradient of one microbatch's output, received in the backward
    found["peak"] = found["after_forward"] + found["gradients"] + found["backward_block"] + found["cp_buffers"] + \
        found["pp_buffers"]
    return found


def _stage_seconds(stage, system, layout, batch, amp_mode, spans):
    """One stage's step at a local batch of `batch` (all M microbatches): its compute, the collectives inside it
    (on the critical path of each microbatch: tp's and cp's, the ring's exposed part, FSDP's gathers and scatters
    beyond the compute: once per microbatch, as FSDP reshards after each forward and reduces in each backward), and
    what follows the last backward: the gradients' sums over cp and tp and their all-reduce over dp (no DDP: once,
    bucketless, exposed), FSDP's sums before its step, the targets' gather, Adam."""
    half = amp_mode in ("bf16", "fp16")
    peak_flops = system.tensor_flops[amp_mode if half else "tf32"]
    attention_flops, softmax_ops = attention_work_per_sample(stage, layout)
    gemm_s = batch * gemm_flops_per_sample(stage, layout) / (peak_flops * EFFICIENCY["matmul"])
    attention_matmul_s = batch * attention_flops / (peak_flops * EFFICIENCY["matmul"])
    softmax_s = batch * softmax_ops / (system.vector_flops * EFFICIENCY["matmul"])
    hbm = system.hbm_bytes_per_s * EFFICIENCY["memory"]
    memory_s = batch * memory_bound_bytes_per_sample(stage, layout, half) / hbm
    adam_s = ADAM_BYTES_PER_PARAMETER * parameters_per_rank(stage, layout) / hbm
    comm_s = {"activations": 0.0, "gradients": 0.0, "weights": 0.0, "step": 0.0, "ring": 0.0, "targets": 0.0}
    collectives = collectives_per_step(stage, batch, layout, half=half)
    for group, op, nbytes, when in collectives:
        bandwidth = system.nic_bytes_per_s if spans[group] else system.nvlink_pair
        comm_s[when] += collective_seconds(op, nbytes, _group_size(layout, group), bandwidth)
    ring = ring_steps(stage, system, layout, batch, amp_mode) if cp_method_of(layout) == "ring" else None
    compute_s = gemm_s + attention_matmul_s + softmax_s + memory_s
    inside_s = comm_s["activations"] + (ring["exposed_s"] if ring else 0.0) + \
        max(0.0, layout.microbatches * comm_s["weights"] - compute_s)
    return {"matmul": gemm_s + attention_matmul_s, "softmax": softmax_s, "memory_bound": memory_s,
            "attention": attention_matmul_s + softmax_s, "gemm": gemm_s, "compute_s": compute_s,
            "inside_communication_s": inside_s, "busy_s": compute_s + inside_s, "optimizer_s": adam_s,
            "after_communication_s": comm_s["gradients"] + comm_s["step"] + comm_s["targets"],
            "after_s": adam_s + comm_s["gradients"] + comm_s["step"] + comm_s["targets"],
            "comm_seconds": comm_s, "collectives": collectives, "ring": ring}


def predict_pipeline(shape, system, layout, global_batch, amp_mode="bf16", overhead_gib=RUNTIME_OVERHEAD_GIB):
    """`predict` for a layout with pp > 1 stages (its keys, and "pipeline"). Each stage is timed and sized on its
    own (stage_shapes). The step: the slowest stage's busy time over the M microbatches stretched by the bubble,
    x (M + P - 1) / M, plus the point-to-point transfers (blocking in distributed/pipeline.py: each sits in its
    microbatch's slot, stretched alike) on the link the pp group crosses, plus the longest tail after the last
    backward (gradient sums and the dp all-reduce, Adam). Memory: each stage's peak (stage_memory_bytes); the
    heaviest stage's is the layout's, and it must fit. The loss's broadcast (4 bytes) is left out."""
    batch = global_batch // layout.dp
    half = amp_mode in ("bf16", "fp16")
    peak_flops = system.tensor_flops[amp_mode if half else "tf32"]
    P, M = layout.pp, layout.microbatches
    spans = group_spans_nodes(layout, system.gpus_per_node)
    stages = []
    for index, stage in enumerate(stage_shapes(shape, layout)):
        seconds = _stage_seconds(stage, system, layout, batch, amp_mode, spans)
        memory = stage_memory_bytes(stage, layout, batch, half, index)
        stages.append({"stage": index, "blocks": stage.depth, "embedding": stage.holds_embedding,
                       "head": stage.holds_head, "parameters": parameters_per_rank(stage, layout),
                       "flops_per_sample": flops_per_sample(stage), "memory_bytes": memory,
                       "peak_memory_gb": memory["peak"] / GIB + overhead_gib, **seconds})
    bubble = bubble_fraction(P, M)
    slowest = max(stages, key=lambda row: row["busy_s"])
    tail = max(stages, key=lambda row: row["after_s"])
    heaviest = max(stages, key=lambda row: row["memory_bytes"]["peak"])
    p2p_bytes = p2p_bytes_per_step(shape, layout, batch, half)
    link = system.nic_bytes_per_s if spans["pp"] else system.nvlink_pair
    p2p_s = collective_seconds("send_recv", p2p_bytes, P, link) / (1 - bubble)
    bubble_s = slowest["busy_s"] * bubble / (1 - bubble)  # (P - 1) / M of the busy time
    step_s = slowest["busy_s"] + bubble_s + p2p_s + tail["after_s"]
    samples_per_sec = global_batch / step_s
    flops = flops_per_sample(shape)
    memory = heaviest["memory_bytes"]
    first = stages[0]
    comm_bytes = {**_bytes_by_group(first["collectives"]), "pp": p2p_bytes}
    return {
        "tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": P, "microbatches": M,
        "pp_schedule": layout.pp_schedule, "gpus": layout.world_size, "order": layout.order,
        "flags": layout.flags(), "system": system.name, "amp_mode": amp_mode, "global_batch_size": global_batch,
        "local_batch_size": batch, "samples_per_sec": samples_per_sec,
        "mfu": flops * samples_per_sec / (layout.world_size * peak_flops),
        "memory_after_forward_gb": memory["after_forward"] / GIB + overhead_gib,
        "peak_memory_gb": heaviest["peak_memory_gb"],
        "fits": heaviest["peak_memory_gb"] <= system.memory_gib,
        "step_time_s": step_s,
        # the slowest stage's compute, the idle bubble, and what is exposed: its collectives, the transfers between
        # stages and the tail's (the tail's Adam counted as memory-bound)
        "time_breakdown_s": {"matmul": slowest["matmul"], "softmax": slowest["softmax"],
                             "memory_bound": slowest["memory_bound"] + tail["optimizer_s"], "bubble": bubble_s,
                             "exposed_communication": slowest["inside_communication_s"] + p2p_s +
                             tail["after_communication_s"]},
        "parts_s": {"attention": slowest["attention"], "gemm": slowest["gemm"],
                    "memory_bound": slowest["memory_bound"] + slowest["optimizer_s"]},
        "flops_per_sample": flops,
        "comm_bytes_per_step": comm_bytes,  # rank 0's (stage 0), and one stage boundary's each way ("pp")
        "comm_seconds": {**first["comm_seconds"], "pp": p2p_s},
        "cp_method": cp_method_of(layout),
        "ring": first["ring"],
        "parameters_per_gpu": heaviest["parameters"],
        "pipeline": {
            "stages": P, "microbatches": M, "schedule": layout.pp_schedule, "layers": stage_layers(shape, layout),
            "bubble": bubble, "stretch": 1 / (1 - bubble), "p2p_bytes_per_step": p2p_bytes,
            "p2p_link": "network" if spans["pp"] else "NVLink", "p2p_seconds": p2p_s,
            "slowest_stage": slowest["stage"], "heaviest_stage": heaviest["stage"],
            "heaviest_peak_gb": heaviest["peak_memory_gb"],
            "per_stage": [{key: row[key] for key in ("stage", "blocks", "embedding", "head", "parameters",
                                                     "flops_per_sample", "peak_memory_gb", "busy_s", "after_s")}
                          | {"microbatches_in_flight": row["memory_bytes"]["microbatches_in_flight"],
                             "memory_bytes": row["memory_bytes"]}
                          for row in stages],
        },
        "counts": {  # the heaviest stage's memory; rank 0's (stage 0's) block FLOPs and collectives
            "block_flops_per_sample": dict(zip(("forward", "backward"), block_flops_per_sample(shape, layout))),
            "memory_bytes": memory,
            "collectives": [{"group": group, "op": op, "bytes": nbytes, "when": when}
                            for group, op, nbytes, when in first["collectives"]],
        },
    }
