"""Tensor- and context-parallel layers: the math of nn.Linear, an MLP, attention and nn.LayerNorm, split.

Tensor parallelism (tp) splits weights: a column-parallel matmul keeps a slice of the output features, the
row-parallel matmul after it a slice of the input features, and one all-reduce per pair restores the output.
Attention heads and the MLP's hidden width are split this way. Context parallelism (cp) splits the sequence:
each rank keeps a chunk of the tokens, and attention reaches the keys and values of the whole sequence by
all-gathering them (the default), passing them round a ring, or swapping sequence shards for head shards with
all-to-all (`cp_method`; the last two in context_parallel.py).
Weights are then shared over cp ranks whose gradients each cover only their tokens: helpers.mark_shared names the
groups over which those gradients are summed (`mark_for_reduction`, see data_parallel.reduce_marked_gradients)
and the groups over which copies must stay equal (`is_shared_mp`, helpers.init_params_for_shared_weights).
Sequence parallelism (`sequence_shapes`: tokens per tp rank) splits the tokens of each cp chunk over tp between
the blocks as well: a column-parallel entry all-gathers them over tp (its backward reduce-scatters) instead of
copying, and the row-parallel exit reduce-scatters them instead of all-reducing (same volume); the norms and the
biases after a row-parallel sum then see this rank's tokens only, and their gradients are summed over tp too.
`load_serial(module)` copies this rank's shard of a serial layer's weights (exact initialisation, tests).

Each layer is given the groups it splits over: Axes of the run's grid (utils/layout.py), handed down by the recipe
(parallelize.py), from which it reads their sizes; or names ("tp", "cp": the original's way, looked up in utils.comm).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed.context_parallel import all_to_all_attention, ring_attention
from distributed.helpers import axis_of, mark_shared
from distributed.mappings import (
    all_gather_from_parallel_region,
    copy_to_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_parallel_region,
)
from utils.layout import DEFAULT_CP_METHOD, Layout


def cast_once_for_autocast(x):
    """`x` in autocast's dtype where autocast is on (else as it is): an input several linears read is then cast
    once, not by each of them (q, k and v: 3.8% of the ViT's bf16 step on an H100, benchmarks/bench_levers.py).
    The devices are named, not asked for (torch.amp.is_autocast_available): torch 2.5's compiler cannot trace that
    question and broke the graph at every attention (a meta tensor, as in a dry run, has no autocast)."""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class DistributedMatmul(nn.Module):
    """y = x W^T + b with W split over the group `out_group` (output features: column-parallel) or `inp_group`
    (input features: row-parallel; the partial products are summed before the bias is added once); `act_group`:
    the group the activations' tokens are split over (cp). With `sequence_shapes` (sequence parallelism) the tokens
    enter all-gathered and leave reduce-scattered over tp."""

    def __init__(self, inp_dim, out_dim, inp_group, out_group, act_group="cp", bias=True, sequence_shapes=None):
        super().__init__()
        self.inp, self.out, self.act = axis_of(inp_group), axis_of(out_group), axis_of(act_group)
        self.sequence_shapes = sequence_shapes  # sequence parallelism: tokens per tp rank between the blocks
        inp_size, out_size = self.inp.size, self.out.size
        if inp_size > 1 and out_size > 1:
            raise ValueError("DistributedMatmul splits either the input or the output features, not both")
        if inp_dim % inp_size or out_dim % out_size:
            raise ValueError(f"features {inp_dim} -> {out_dim} do not divide over {inp_size} x {out_size} ranks")
        self.weight = nn.Parameter(torch.empty(out_dim // out_size, inp_dim // inp_size))
        nn.init.trunc_normal_(self.weight, std=0.02)
        mark_shared(self.weight, [self.act], [self.act])
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(1, 1, out_dim // out_size))
            # after a row-parallel sum the bias is shared over tp; under sequence parallelism it meets only this
            # rank's tokens, so its gradient is summed over tp as well
            summed = [self.inp, self.act] if sequence_shapes else [self.act]
            mark_shared(self.bias, [self.inp, self.act], summed)

    @staticmethod
    def shard(tensor, dim, axis):
        """This rank's chunk (a view) of a serial `tensor` along `dim`, split over the group `axis` (an Axis)."""
        return torch.chunk(tensor, axis.size, dim=dim)[axis.rank]

    @torch.no_grad()
    def load_serial(self, linear):
        """This rank's shard of an nn.Linear's weight and bias."""
        weight = self.shard(self.shard(linear.weight, 0, self.out), 1, self.inp)
        self.weight.copy_(weight)
        if self.bias is not None:
            self.bias.copy_(self.shard(linear.bias, 0, self.out).view(1, 1, -1))

    def enter(self, x):
        """Into a column-parallel matmul: identity forward, the gradient all-reduced over tp backward; under sequence
        parallelism, this rank's tokens all-gathered over tp forward, the gradient reduce-scattered backward."""
        if self.sequence_shapes:
            return all_gather_from_parallel_region(x, 1, self.sequence_shapes, self.out)
        return copy_to_parallel_region(x, self.out)

    def forward(self, x, entered=False):
        """`entered`: x already went through enter() (attention's q, k and v share one entry)."""
        y = F.linear(x if entered else self.enter(x), self.weight)
        if self.sequence_shapes:  # out of a row-parallel matmul: the sum over tp, scattered by tokens
            y = reduce_scatter_to_parallel_region(y, 1, self.sequence_shapes, self.inp)
        else:
            y = reduce_from_parallel_region(y, self.inp)
        return y + self.bias if self.bias is not None else y


class DistributedMLP(nn.Module):
    """fc1 column-parallel (the hidden width split over tp), activation, fc2 row-parallel: one all-reduce."""

    def __init__(self, in_features, hidden_features=None, out_features=None, tp="tp", cp="cp",
                 act_layer=nn.GELU, drop=0.0, sequence_shapes=None):
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.fc1 = DistributedMatmul(in_features, hidden_features, None, tp, cp, sequence_shapes=sequence_shapes)
        self.act = act_layer()
        self.fc2 = DistributedMatmul(hidden_features, out_features, tp, None, cp, sequence_shapes=sequence_shapes)
        self.drop = nn.Dropout(drop)

    def load_serial(self, mlp):
        self.fc1.load_serial(mlp.fc1)
        self.fc2.load_serial(mlp.fc2)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class DistributedAttention(nn.Module):
    """Multi-head attention with the heads split over tp and the sequence over cp: q, k, v column-parallel, proj
    row-parallel; the other cp ranks' keys and values reached as `cp_method` says: "allgather" (gathered over cp),
    "ring" or "alltoall" (context_parallel.py)."""

    def __init__(self, dim, tp="tp", cp="cp", cp_shapes=None, num_heads=8, qkv_bias=False,
                 attn_drop=0.0, proj_drop=0.0, sequence_shapes=None, cp_method=DEFAULT_CP_METHOD):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        tp, self.cp = axis_of(tp), axis_of(cp)
        # each tp rank holds whole heads, and all-to-all splits them again over cp (the layout's rules)
        Layout(tp=tp.size, cp=self.cp.size, cp_method=cp_method).check(num_heads=num_heads)
        self.cp_method = cp_method
        self.num_heads_local = num_heads // tp.size
        self.head_dim = dim // num_heads
        self.cp_shapes = cp_shapes
        self.q, self.k, self.v = (DistributedMatmul(dim, dim, None, tp, self.cp, bias=qkv_bias,
                                                    sequence_shapes=sequence_shapes) for _ in range(3))
        self.attn_drop = attn_drop
        self.proj = DistributedMatmul(dim, dim, tp, None, self.cp, sequence_shapes=sequence_shapes)
        self.proj_drop = nn.Dropout(proj_drop)

    def load_serial(self, attention):
        for name in ("q", "k", "v", "proj"):
            getattr(self, name).load_serial(getattr(attention, name))

    def forward(self, x):
        x = self.q.enter(x)  # one entry for q, k and v (under sequence parallelism: one all-gather of the tokens)
        x = cast_once_for_autocast(x)  # for q, k and v, as the serial Attention
        B, N, _ = x.shape  # N: this rank's tokens (of its cp chunk)

        def heads(t):  # (B, n, local heads * head_dim) -> (B, local heads, n, head_dim)
            return t.view(B, t.shape[1], self.num_heads_local, self.head_dim).transpose(1, 2)

        q, k, v = (heads(layer(x, entered=True)) for layer in (self.q, self.k, self.v))
        attn = self.attend(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(attn.transpose(1, 2).reshape(B, N, self.num_heads_local * self.head_dim)))

    def attend(self, q, k, v, dropout_p):
        """Attention of this rank's queries (B, local heads, tokens, head_dim) over the whole sequence, by the cp
        method (on a cp group of one, each is scaled_dot_product_attention). Dropout is refused with cp > 1."""
        if self.cp_method == "ring":
            return ring_attention(q, k, v, self.cp_shapes, self.cp)
        if self.cp_method == "alltoall":
            return all_to_all_attention(q, k, v, self.cp_shapes, self.cp, dropout_p=dropout_p)
        k = all_gather_from_parallel_region(k, 2, self.cp_shapes, self.cp)  # the whole sequence
        v = all_gather_from_parallel_region(v, 2, self.cp_shapes, self.cp)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


class DistributedLayerNorm(nn.Module):
    """nn.LayerNorm on tokens whose features are whole (replicated over tp) and sequence split over cp: its
    weight and bias are shared over tp and cp, and their gradients are summed over cp (and over tp under sequence
    parallelism, where each tp rank holds other tokens). Default eps is the serial blocks' 1e-6 (upstream's 1e-5
    made the two models differ)."""

    def __init__(self, normalized_shape, eps=1e-6, elementwise_affine=True, bias=True, device=None, dtype=None,
                 tp="tp", cp="cp", sequence_parallel=False):
        super().__init__()
        self.norm = nn.LayerNorm(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                                 device=device, dtype=dtype)
        # under sequence parallelism each tp rank normalises its own tokens: gradients summed over tp as well
        summed = [tp, cp] if sequence_parallel else [cp]
        for param in self.norm.parameters():
            mark_shared(param, [tp, cp], summed)

    @torch.no_grad()
    def load_serial(self, layer_norm):
        self.norm.load_state_dict(layer_norm.state_dict())

    def forward(self, x):
        return self.norm(x)
