"""Vision Transformer for ERA5: patchify 20-channel maps, pre-norm transformer blocks, unpatchify.

Shapes follow the NERSC tutorial's ViT: no class token, learned position embedding, separate
q/k/v projections, fused scaled-dot-product attention, MLP ratio 4 (MLP_RATIO), head back to patches.

The constructor builds the serial model. Tensor (tp) and context (cp) parallelism are applied afterwards by the
recipe (distributed/parallelize.py): it swaps each block's attention, MLP and norms for the distributed layers of
distributed/layers.py, holding this rank's shard of the serial weights, and hands the model its cp and tp groups
(`cp`, `tp`: Axes of the run's grid, size 1 here) with the split shapes and this cp rank's band of image rows: the
forward pass embeds only the band holding this rank's tokens (distributed/bands.py), keeps those tokens, and gathers
the sequence again before the head, no-ops on groups of one. Under pipeline parallelism (distributed/pipeline.py)
a rank keeps one stage: some consecutive blocks, with the patch embedding if it is the first stage (`first_stage`)
and the final norm and head if it is the last (`last_stage`); a stage's input and output are then the tokens passed
between stages.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed.bands import serial_band
from distributed.layers import cast_once_for_autocast
from distributed.mappings import gather_from_parallel_region, scatter_to_parallel_region
from utils.errors import UserError
from utils.layout import Axis, Layout

MLP_RATIO = 4.0  # each block's MLP hidden width over embed_dim (the tutorial's ViT); a config may set mlp_ratio


class DropPath(nn.Module):
    """Stochastic depth: drop a sample's whole residual branch with probability `drop_prob`."""

    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep_prob = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)
        return x * mask / keep_prob


class MLP(nn.Module):
    def __init__(self, in_features, hidden_features, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Attention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, E = x.shape
        x = cast_once_for_autocast(x)  # under autocast q, k and v would each cast x

        def heads(t):  # (B, N, E) -> (B, heads, N, head_dim)
            return t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)

        # attention dropout only while training (upstream applied it in eval too)
        attn = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                              dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(attn.transpose(1, 2).reshape(B, N, E)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim, num_heads, mlp_ratio=MLP_RATIO, drop=0.0, attn_drop=0.0, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, attn_drop=attn_drop, proj_drop=drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLP(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, N, E) tokens, patches in row-major order."""

    def __init__(self, patch_size, in_chans, embed_dim):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        # contiguous: the transposed view would make every residual add and norm after it work on strided tokens
        # (the eager step of `short` took 126.0 ms with the view, 113.2 ms with the copy, on an H100)
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()


class VisionTransformer(nn.Module):
    def __init__(self, img_size, patch_size, in_chans, out_chans, embed_dim, depth, num_heads,
                 mlp_ratio=MLP_RATIO, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0):
        super().__init__()
        self.img_size = tuple(img_size)
        self.patch_size = patch_size
        self.out_chans = out_chans
        self.embed_dim = embed_dim
        self.h = self.img_size[0] // patch_size
        self.w = self.img_size[1] // patch_size
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.h * self.w, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        drop_path_rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, drop_rate, attn_drop_rate, drop_path_rates[i])
            for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, out_chans * patch_size * patch_size, bias=False)

        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.apply(self._init_weights)
        # serial: groups of one; the recipe (distributed/parallelize.split_tokens_and_weights) sets the run's
        self.cp, self.tp = Axis("cp"), Axis("tp")
        self.cp_shapes = [self.h * self.w]  # tokens per cp rank
        self.band = serial_band(self.h, self.w, patch_size)  # this cp rank's tokens and the image rows holding them
        self.sequence_shapes = None  # sequence parallelism: tokens per tp rank of this cp rank's chunk
        self.first_stage = self.last_stage = True  # pipeline: this rank's stage embeds / ends in the head

    def held_blocks(self):
        """The blocks this rank runs: all of them, or its pipeline stage's (distributed/pipeline.py)."""
        return [block for block in self.blocks if isinstance(block, Block)]

    def layout_facts(self):
        """What the layout's rules need to know of this ViT (utils/layout.py): heads and MLP width split over tp,
        tokens over cp, and dropout (refused with cp or sequence parallelism)."""
        block = next((block for block in self.blocks if isinstance(block, Block)), None)  # a stage holds some
        return {"num_heads": block.attn.num_heads if block else None,
                "mlp_hidden": block.mlp.fc1.out_features if block else None,
                "tokens": self.h * self.w, "dropout": self.pos_drop.p, "depth": len(self.blocks)}

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, x):
        B = x.shape[0]
        if self.first_stage:  # (a pipeline stage other than the first receives the tokens)
            # context parallel: only the band of image rows holding this rank's tokens is embedded, then its own
            # tokens are kept (the embedding's gradients are partial, summed over cp); serially the whole field
            x = self.patch_embed(self.band.cut(x)) + self.band.band_of(self.pos_embed)
            x = self.band.own(self.pos_drop(x))
            if self.sequence_shapes:  # sequence parallel: this tp rank's part of them, between the blocks
                x = scatter_to_parallel_region(x, 1, self.tp)
        for block in self.blocks:  # a pipeline stage's other blocks are placeholders that pass x on
            x = block(x)
        if not self.last_stage:  # the tokens go on to the next stage
            return x
        # one function, not a method a part: a graph break at a collective (compile) stays one break
        if self.sequence_shapes:
            x = gather_from_parallel_region(x, 1, self.sequence_shapes, self.tp)
        x = gather_from_parallel_region(self.norm(x), 1, self.cp_shapes, self.cp)
        x = self.head(x)  # (B, N, p*p*C), channel fastest
        p = self.patch_size
        x = x.view(B, self.h, self.w, p, p, self.out_chans).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(B, self.out_chans, self.h * p, self.w * p)


def mlp_hidden(params):
    """Each block's MLP hidden width, as Block computes it."""
    return int(params.embed_dim * params.get("mlp_ratio", MLP_RATIO))


def layout_facts(params):
    """What the layout's rules need to know of this ViT (utils/layout.py): heads and MLP width split over tp,
    tokens over cp, and dropout (refused with cp or sequence parallelism)."""
    img_h, img_w = params.img_size
    return {"num_heads": params.num_heads, "mlp_hidden": mlp_hidden(params),
            "tokens": (img_h // params.patch_size) * (img_w // params.patch_size), "dropout": params.dropout,
            "depth": params.depth}


def check_vit_params(params, layout=None):
    """Refuse shapes the ViT cannot take, or cannot split as `layout` asks (if given), with a sentence that says
    which numbers to change."""
    img_h, img_w = params.img_size
    if img_h % params.patch_size or img_w % params.patch_size:
        raise UserError(f"img_size {list(params.img_size)} is not divisible by patch_size "
                        f"{params.patch_size}; choose sizes that are multiples of the patch size")
    if params.embed_dim % params.num_heads:
        raise UserError(f"embed_dim {params.embed_dim} is not divisible by num_heads "
                        f"{params.num_heads}; choose num_heads that divides embed_dim")
    (layout or Layout()).check(**layout_facts(params))


def ViT(params, layout=None):
    """The serial ViT described by a config (img_size, patch_size, embed_dim, depth, num_heads, ...); with `layout`,
    refused in one line if it could not be split that way (the recipe, distributed/parallelize.py, splits it)."""
    check_vit_params(params, layout)
    dropout = float(params.dropout)
    return VisionTransformer(img_size=params.img_size, patch_size=params.patch_size,
                             in_chans=params.n_in_channels, out_chans=params.n_out_channels,
                             embed_dim=params.embed_dim, depth=params.depth, num_heads=params.num_heads,
                             mlp_ratio=params.get("mlp_ratio", MLP_RATIO), drop_rate=dropout, attn_drop_rate=dropout,
                             drop_path_rate=dropout)
