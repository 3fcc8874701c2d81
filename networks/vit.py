"""Vision Transformer for ERA5: patchify 20-channel maps, pre-norm transformer blocks, unpatchify.

Shapes follow the NERSC tutorial's ViT: no class token, learned position embedding, separate
q/k/v projections, fused scaled-dot-product attention, MLP ratio 4 (MLP_RATIO), head back to patches.

With tensor (tp) or context (cp) parallelism (process groups "tp", "cp" of utils.comm larger than one rank)
each block's attention, MLP and norms are the distributed layers of distributed/layers.py, holding this rank's
shard of the weights the serial model gets from the same seed; the token sequence is split over cp after the
position embedding and gathered again before the head.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed.helpers import compute_split_shapes, mark_shared
from distributed.layers import DistributedAttention, DistributedLayerNorm, DistributedMLP, cast_once_for_autocast
from distributed.mappings import gather_from_parallel_region, scatter_to_parallel_region
from utils import comm
from utils.errors import UserError

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
                 mlp_ratio=MLP_RATIO, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0,
                 sequence_parallel=False):
        super().__init__()
        self.img_size = tuple(img_size)
        self.patch_size = patch_size
        self.out_chans = out_chans
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
        self.cp_shapes = compute_split_shapes(self.h * self.w, comm.get_size("cp"))
        # sequence parallelism: between the blocks this rank's cp chunk of tokens is split again over tp
        self.sequence_shapes = None
        if sequence_parallel and comm.get_size("tp") > 1:
            self.sequence_shapes = compute_split_shapes(self.cp_shapes[comm.get_rank("cp")], comm.get_size("tp"))
        if comm.get_size("tp") > 1 or comm.get_size("cp") > 1:
            self._distribute(num_heads)

    def _distribute(self, num_heads):
        """Swap each block's attention, MLP and norms for their tp/cp versions, loaded with this rank's shard of
        the serial weights just initialised: the model equals the serial one built with the same seed."""
        with torch.random.fork_rng(devices=[]):  # the distributed layers' own initialisation must not move the RNG
            for block in self.blocks:
                dim, hidden = block.norm1.normalized_shape[0], block.mlp.fc1.out_features
                sequence, split_tokens = {"sequence_shapes": self.sequence_shapes}, bool(self.sequence_shapes)
                replacements = {
                    "norm1": DistributedLayerNorm(dim, eps=block.norm1.eps, sequence_parallel=split_tokens),
                    "attn": DistributedAttention(dim, cp_shapes=self.cp_shapes, num_heads=num_heads, qkv_bias=True,
                                                 attn_drop=block.attn.attn_drop, proj_drop=block.attn.proj_drop.p,
                                                 **sequence),
                    "norm2": DistributedLayerNorm(dim, eps=block.norm2.eps, sequence_parallel=split_tokens),
                    "mlp": DistributedMLP(dim, hidden, drop=block.mlp.drop.p, **sequence),
                }
                for name, layer in replacements.items():
                    layer.load_serial(getattr(block, name))
                    setattr(block, name, layer)
        # the final norm sees only this rank's tokens, so its gradients are partial over cp and are summed there
        # (upstream left them unreduced and the copies drifted apart)
        for param in self.norm.parameters():
            mark_shared(param, ["tp-cp"], ["cp"])

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
        x = self.pos_drop(self.patch_embed(x) + self.pos_embed)
        x = scatter_to_parallel_region(x, 1, "cp")  # context parallel: this rank's tokens
        if self.sequence_shapes:  # sequence parallel: this tp rank's part of them, between the blocks
            x = scatter_to_parallel_region(x, 1, "tp")
        for block in self.blocks:
            x = block(x)
        if self.sequence_shapes:
            x = gather_from_parallel_region(x, 1, self.sequence_shapes, "tp")
        x = gather_from_parallel_region(self.norm(x), 1, self.cp_shapes, "cp")
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
            "tokens": (img_h // params.patch_size) * (img_w // params.patch_size), "dropout": params.dropout}


def check_vit_params(params, layout):
    """Refuse shapes the ViT cannot take, or cannot split as `layout` asks, with a sentence that says which numbers
    to change."""
    img_h, img_w = params.img_size
    if img_h % params.patch_size or img_w % params.patch_size:
        raise UserError(f"img_size {list(params.img_size)} is not divisible by patch_size "
                        f"{params.patch_size}; choose sizes that are multiples of the patch size")
    if params.embed_dim % params.num_heads:
        raise UserError(f"embed_dim {params.embed_dim} is not divisible by num_heads "
                        f"{params.num_heads}; choose num_heads that divides embed_dim")
    layout.check(**layout_facts(params))


def ViT(params, layout=None):
    """The ViT described by a config (img_size, patch_size, embed_dim, depth, num_heads, ...), split as `layout` says
    (default: this run's, comm.get_layout())."""
    layout = layout or comm.get_layout()
    check_vit_params(params, layout)
    dropout = float(params.dropout)
    return VisionTransformer(img_size=params.img_size, patch_size=params.patch_size,
                             in_chans=params.n_in_channels, out_chans=params.n_out_channels,
                             embed_dim=params.embed_dim, depth=params.depth, num_heads=params.num_heads,
                             mlp_ratio=params.get("mlp_ratio", MLP_RATIO), drop_rate=dropout, attn_drop_rate=dropout,
                             drop_path_rate=dropout, sequence_parallel=layout.sequence_parallel)
