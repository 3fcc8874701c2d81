"""Context parallelism's attention: each cp rank holds a chunk of the token sequence, and attention, the one layer
whose every token reads every other's, reaches the other chunks in one of three ways (`--cp_method`, the layout's
`cp_method`; DistributedAttention in layers.py calls the one asked for):

- allgather (the original's, in layers.py): each rank all-gathers the keys and values of the whole sequence over
  cp (backward: reduce-scatter) and attends its queries over them. It holds the whole sequence's K/V.
- ring (ring_attention): each rank keeps its own K/V block and passes it on round the cp ring, to the next rank,
  receiving the previous rank's (point-to-point send/recv, batch_isend_irecv); cp - 1 steps bring every block past
  every rank. Each step starts the next block's transfer, then attends its queries over the block it holds, then
  waits: the transfer is in flight while the block computes. A block's result merges with the running one through
  their log-sum-exps (online softmax: the running result is rescaled as the running maximum and sum grow), so no
  rank ever holds more K/V than the block it computes with and the one in flight. The backward passes the blocks
  round again: each rank adds its queries' part of a block's dK/dV to a sum that travels with the block, one step
  behind it, and arrives back at the block's owner after cp transfers; dQ stays local.
- alltoall (all_to_all_attention, DeepSpeed's "Ulysses"): one all-to-all over cp turns q, k and v from sequence
  shards (B, heads, tokens of this rank, head_dim) into head shards (B, heads / cp, all tokens, head_dim);
  attention then runs over the whole sequence for heads / cp heads; a second all-to-all brings the output back to
  sequence shards. Its backward is the two all-to-alls reversed. cp must divide the heads left after tp (a rule of
  the layout, utils/layout.py).

What each moves and holds, per rank and attention layer, for N tokens, cp ranks, h = heads after tp, d = head_dim
(forward; the backward moves as much again, the ring twice as much: its blocks and their dK/dV): allgather receives
the (cp - 1) / cp of K and V it lacks, 2 N h d (cp - 1) / cp values, and holds all 2 N h d; ring moves the same
bytes in cp - 1 point-to-point steps but holds 2 x 2 N h d / cp (the block computed with and the one in flight);
alltoall sends 3 N h d (cp - 1) / cp^2 of q, k, v and N h d (cp - 1) / cp^2 of the output, 2 / cp of ring's bytes,
and holds 3 N h d / cp. Sequence splits may be uneven (4050 tokens over cp = 4: 1013, 1013, 1013, 1011): every
rank knows each block's length from the split shapes, so blocks are sent and received at their own lengths (no
padding).

Which kernel runs where. A ring block's attention must return its log-sum-exp, and its backward must take the whole
attention's output and log-sum-exp; F.scaled_dot_product_attention returns neither, so the ring calls the kernels
under it (block_kernel chooses, once per forward): on a CPU torch's flash-attention kernel for CPUs
(aten._scaled_dot_product_flash_attention_for_cpu and its backward; the same signatures in torch 2.5 and 2.14); on an
NVIDIA GPU CUDA's memory-efficient attention (aten._scaled_dot_product_efficient_attention and its backward; fp32,
fp16 or bf16, head_dim a multiple of 8), which no GPU has run here yet (its test is marked gpu). Elsewhere (other
dtypes or head sizes, ROCm, a kernel switched off by --sdpa_backend) plain math: q k^T x scale, its log-sum-exp,
softmax, @ v, in fp32 whatever the inputs' dtype, which holds a block's scores (queries x block tokens) in memory.
Blocks merge in fp32, autocast off inside. FlashAttention's CUDA kernel (fp16/bf16 only) is not used. all-to-all and
all-gather call F.scaled_dot_product_attention, the library's choice per device (cuDNN, flash or efficient
attention on a GPU, flash attention for CPUs on a CPU). Attention dropout is refused with cp > 1 (a rule of the
layout), so the ring has none.

Each path is a no-op wrapper on a cp group of one rank (plain scaled_dot_product_attention). The autograd functions
run outside torch.compile's graph (their collectives would break it anyway), as mappings.py's do. The switches
below are for tests: their twins switch one off in the spawned ranks and show that the comparison with the serial
model then fails.
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed.helpers import axis_of

RESCALE = True  # ring: the running result rescaled to the new log-sum-exp as blocks merge (tests switch it off)
EACH_BLOCK_ONCE = True  # ring: off, the own block is taken again in place of the first block received (tests)
HEADS_IN_ORDER = True  # all-to-all: off, the head shards come back in reversed rank order (tests)
# ring: a block's attention in a library kernel that returns the log-sum-exp where one applies (block_kernel); off,
# plain math on every device (the tests' reference, run on the CPU)
BLOCK_KERNEL = True


def _active(axis):
    return axis.size > 1


@torch.compiler.disable
def _outside_the_graph(function, *args):
    """`function.apply(*args)` outside torch.compile's graph (as mappings._apply)."""
    return function.apply(*args)


def _shapes_of(axis, shapes, tokens):
    """Tokens per cp rank: as given, or all equal to this rank's."""
    shapes = list(shapes) if shapes else [tokens] * axis.size
    if len(shapes) != axis.size or shapes[axis.rank] != tokens:
        raise ValueError(f"attention over '{axis.name}': this rank holds {tokens} tokens, but the split shapes are "
                         f"{shapes} for {axis.size} ranks")
    return shapes


def _without_autocast(device):
    """A context in which autocast is off on `device` (a ring block's math runs in fp32 whatever the region)."""
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# --- ring attention ----------------------------------------------------------------------------------------------

class _Transfer:
    """A send to the next rank and a receive from the previous one, in flight; wait() returns what was received."""

    def __init__(self, requests, sent, received):
        self.requests, self.sent, self.received = requests, sent, received  # the sent tensor lives until the wait

    def wait(self):
        for request in self.requests:
            request.wait()
        self.sent = None
        return self.received


class _Ring:
    """The cp ranks as a ring: this rank sends to the next (rank + 1) and receives from the previous (rank - 1).
    At step s this rank holds the block of rank - s; blocks have the lengths of the split shapes (tokens per rank)."""

    def __init__(self, axis, shapes):
        self.axis, self.shapes = axis, shapes
        self.next = dist.get_global_rank(axis.group, (axis.rank + 1) % axis.size)
        self.previous = dist.get_global_rank(axis.group, (axis.rank - 1) % axis.size)

    def owner(self, step):
        """The cp rank whose block this rank holds at `step`."""
        return (self.axis.rank - step) % self.axis.size

    def pass_on(self, block, step):
        """Start sending `block` (held at `step`, tokens on dim -2) to the next rank and receiving the block this rank
        holds at step + 1 from the previous one, at its own length. One batch_isend_irecv: NCCL would deadlock on a
        send and a receive issued apart between the same two ranks."""
        shape = list(block.shape)
        shape[-2] = self.shapes[self.owner(step + 1)]
        received = block.new_empty(shape)
        block = block.contiguous()
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, block, self.next, self.axis.group),
                                           dist.P2POp(dist.irecv, received, self.previous, self.axis.group)])
        return _Transfer(requests, block, received)


def block_kernel(q):
    """The kernel a ring block's attention runs in (forward and backward), by device, dtype and the attention kernels
    torch is let run (--sdpa_backend's switches, lifecycle/kernels.py): "cpu_flash", torch's flash attention for CPUs;
    "cuda_efficient", CUDA's memory-efficient attention (fp32, fp16 or bf16, head_dim a multiple of 8: SDPA's own
    conditions for it); else "math", plain math in fp32 (BLOCK_KERNEL off: everywhere)."""
    if not BLOCK_KERNEL:
        return "math"
    if q.device.type == "cpu" and torch.backends.cuda.flash_sdp_enabled():  # the switch covers the CPU's kernel too
        return "cpu_flash"
    if (q.device.type == "cuda" and not torch.version.hip and torch.backends.cuda.mem_efficient_sdp_enabled()
            and q.dtype in (torch.float32, torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0):
        return "cuda_efficient"
    return "math"


def _cpu_flash(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)


def _cpu_flash_backward(q, k, v, grad_out, out, lse, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0,
                                                                                False, scale=scale)


def _cuda_efficient(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                                       scale=scale)[:2]
    return out, lse[..., :q.shape[-2]]  # the kernel pads each row of log-sum-exps to a multiple of 32 queries


def _cuda_efficient_backward(q, k, v, grad_out, out, lse, scale):
    lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the length its forward returns, as torch's own backward is given
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # the kernel reads out as (B, tokens, heads, head_dim)
    no_dropout = torch.empty((), dtype=torch.long)  # dropout's seed and offset, unused at p = 0
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse, no_dropout, no_dropout, 0.0, [True, True, True, False], False,
        scale=scale)[:3]


_KERNELS = {"cpu_flash": (_cpu_flash, _cpu_flash_backward),  # block_kernel's name: (forward, backward)
            "cuda_efficient": (_cuda_efficient, _cuda_efficient_backward)}


def block_attention(q, k, v, scale, kernel=None):
    """Attention of the queries `q` over one block of keys and values: the output (normalised over this block, fp32)
    and the log-sum-exp of each query's scores (B, heads, queries; fp32), which merge_blocks needs. `kernel`: one of
    block_kernel's answers (None: its answer for `q`); "math" is the reference the kernels are tested against."""
    kernel = kernel or block_kernel(q)
    if kernel != "math":
        out, lse = _KERNELS[kernel][0](q, k, v, scale)
        return out.float(), lse
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    lse = torch.logsumexp(scores, dim=-1)  # each row's maximum taken out before the exponentials
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def merge_blocks(out, lse, block_out, block_lse):
    """The running result (`out` normalised to the log-sum-exp `lse` of the blocks merged so far; None: no block yet)
    merged with one more block's: the new log-sum-exp is their log-add-exp (its maximum taken out), and each side is
    rescaled to it. The running side's rescale, exp(lse - new), is the online softmax's step (RESCALE)."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    running = torch.exp(lse - new_lse).unsqueeze(-1) if RESCALE else 1.0
    return out * running + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1), new_lse


def block_gradients(q, k, v, grad_out, out, lse, scale, kernel=None):
    """One block's part of dQ, dK, dV (fp32), given the whole attention's output `out` and log-sum-exp `lse` (not the
    block's own): the softmax probabilities of the block are exp(scores - lse), exact without the other blocks, and
    the softmax backward's term is rowsum(dO * O) of the whole output. A kernel's backward is handed the same two,
    in place of those of its own forward (ring flash attention's way). `kernel`: as block_attention's."""
    kernel = kernel or block_kernel(q)
    if kernel != "math":
        grads = _KERNELS[kernel][1](q, k, v, grad_out, out, lse, scale)
        return tuple(grad.float() for grad in grads)
    q, k, v, grad_out = q.float(), k.float(), v.float(), grad_out.float()
    delta = (grad_out * out.float()).sum(-1)
    probabilities = torch.exp(torch.matmul(q, k.transpose(-2, -1)) * scale - lse.unsqueeze(-1))
    grad_v = torch.matmul(probabilities.transpose(-2, -1), grad_out)
    grad_scores = probabilities * (torch.matmul(grad_out, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * scale
    return grad_q, grad_k, grad_v


def _block_at(step, own, held):
    """The K/V block a forward step computes with: the one held, or (EACH_BLOCK_ONCE off, the twin) the own block
    again at the first step after the own block's (the backward then differentiates a result it did not compute)."""
    return own if step == 1 and not EACH_BLOCK_ONCE else held


class _RingAttention(torch.autograd.Function):
    """Forward: attention over the K/V blocks passed round the cp ring (send/recv), merged by log-sum-exp.
    Backward: the K/V blocks passed round again, each block's dK/dV travelling with it back to its owner (send/recv)."""

    @staticmethod
    def forward(ctx, q, k, v, shapes, axis):
        ring, scale, kernel = _Ring(axis, shapes), q.shape[-1] ** -0.5, block_kernel(q)
        with _without_autocast(q.device):
            own = torch.stack([k, v])  # K and V travel as one message: (2, B, heads, tokens, head_dim)
            held, out, lse = own, None, None
            for step in range(axis.size):
                transfer = ring.pass_on(held, step) if step < axis.size - 1 else None  # in flight meanwhile
                block = _block_at(step, own, held)
                out, lse = merge_blocks(out, lse, *block_attention(q, block[0], block[1], scale, kernel))
                if transfer is not None:
                    held = transfer.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # this rank's block only, and its queries' results
        ctx.ring, ctx.scale, ctx.kernel = ring, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, size = ctx.ring, ctx.scale, ctx.ring.axis.size
        with _without_autocast(q.device):
            grad_out = grad_out.contiguous().to(q.dtype)
            held, grad_q, sums = torch.stack([k, v]), torch.zeros(q.shape, device=q.device), None
            for step in range(size):
                transfer = ring.pass_on(held, step) if step < size - 1 else None
                part_q, part_k, part_v = block_gradients(q, held[0], held[1], grad_out, out, lse, scale, ctx.kernel)
                grad_q += part_q
                grad_kv = torch.stack([part_k, part_v])  # this rank's part of the held block's dK, dV
                if sums is not None:  # the ranks before this one on the ring added theirs: one step behind
                    grad_kv += sums.wait()
                sums = ring.pass_on(grad_kv, step)  # on to the next rank (after the last step: to its owner)
                if transfer is not None:
                    held = transfer.wait()
            grad_k, grad_v = sums.wait()  # the sum over every rank's queries of this rank's own block's dK, dV
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


def ring_attention(q, k, v, shapes, group):
    """Attention of this rank's queries (B, heads, tokens, head_dim) over the whole sequence's keys and values, the
    K/V blocks passed round the ranks of `group` (cp, an Axis or a name); `shapes`: tokens per rank (None: equal).
    On a group of one: scaled_dot_product_attention."""
    axis = axis_of(group)
    if not _active(axis):
        return F.scaled_dot_product_attention(q, k, v)
    return _outside_the_graph(_RingAttention, q, k, v, _shapes_of(axis, shapes, q.shape[-2]), axis)


# --- all-to-all (Ulysses) --------------------------------------------------------------------------------------

def _all_to_all(pieces, received_shapes, axis):
    """pieces[j] sent to rank j of `axis`; returns the tensor received from each rank i, of shape received_shapes[i].
    One all_to_all_single with split sizes (uneven pieces: no padding; gloo and NCCL both take them)."""
    sizes = [int(torch.Size(shape).numel()) for shape in received_shapes]
    send = torch.cat([piece.reshape(-1) for piece in pieces])
    received = send.new_empty(sum(sizes))
    dist.all_to_all_single(received, send, sizes, [piece.numel() for piece in pieces], group=axis.group)
    return [chunk.view(shape) for chunk, shape in zip(received.split(sizes), received_shapes)]


def sequence_to_heads(x, shapes, axis):
    """(..., heads, tokens of this rank, head_dim) -> (..., heads / cp, all tokens, head_dim): head shard j goes to
    cp rank j; the sequence comes back from every rank in rank order."""
    *lead, heads, _, head_dim = x.shape
    local = heads // axis.size
    received = _all_to_all(x.split(local, dim=-3), [(*lead, local, tokens, head_dim) for tokens in shapes], axis)
    return torch.cat(received, dim=-2)


def heads_to_sequence(x, shapes, axis):
    """(..., heads / cp, all tokens, head_dim) -> (..., heads, tokens of this rank, head_dim): sequence chunk i goes
    to cp rank i; the heads come back from every rank in rank order (reversed: HEADS_IN_ORDER off, the twin)."""
    *lead, local, _, head_dim = x.shape
    received = _all_to_all(x.split(shapes, dim=-2), [(*lead, local, shapes[axis.rank], head_dim)] * axis.size, axis)
    return torch.cat(received if HEADS_IN_ORDER else received[::-1], dim=-3)


class _SequenceToHeads(torch.autograd.Function):
    """Forward: all-to-all from sequence shards to head shards. Backward: all-to-all from head shards to sequence."""

    @staticmethod
    def forward(ctx, x, shapes, axis):
        ctx.shapes, ctx.axis = shapes, axis
        return sequence_to_heads(x, shapes, axis)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad, ctx.shapes, ctx.axis), None, None


class _HeadsToSequence(torch.autograd.Function):
    """Forward: all-to-all from head shards to sequence shards. Backward: all-to-all from sequence to head shards."""

    @staticmethod
    def forward(ctx, x, shapes, axis):
        ctx.shapes, ctx.axis = shapes, axis
        return heads_to_sequence(x, shapes, axis)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad, ctx.shapes, ctx.axis), None, None


def all_to_all_attention(q, k, v, shapes, group, dropout_p=0.0):
    """Attention of this rank's queries (B, heads, tokens, head_dim) over the whole sequence: q, k and v (one
    message) swapped to head shards over `group` (cp), scaled_dot_product_attention over every token for heads / cp
    heads, the output swapped back to this rank's tokens. `shapes`: tokens per rank (None: equal)."""
    axis = axis_of(group)
    if not _active(axis):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    if q.shape[-3] % axis.size:
        raise ValueError(f"all-to-all over '{axis.name}' splits {q.shape[-3]} heads over {axis.size} ranks")
    shapes = _shapes_of(axis, shapes, q.shape[-2])
    q, k, v = _outside_the_graph(_SequenceToHeads, torch.stack([q, k, v]), shapes, axis).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    return _outside_the_graph(_HeadsToSequence, out, shapes, axis)
