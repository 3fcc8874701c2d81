"""Context parallelism from the file up: a cp rank's tokens are a band of image rows, and only that band is read.

The ViT's tokens are its patches in row-major order (h rows of w patches), and cp splits them into consecutive
chunks (compute_split_shapes). A rank's chunk therefore lies in a band of patch rows: the rows its first and last
token fall in, at most one partly used row at each end. So the rank needs only those image rows, of the input and
of the target alike:

    params.read_rows = band.rows   # the loaders read rows [y0, y1) of each field (an HDF5 hyperslab)
    model(inp)                      # the patch embedding sees the band only, then keeps this rank's tokens
    band.whole(tar)                 # the targets' chunks gathered over cp: the loss sees the whole field

At 0.25 degrees a field is 20 x 720 x 1440 float32 (83 MB): read whole on every cp rank, the file system would
serve each sample cp times. A full field handed to the model still works (it cuts the band out itself).
"""
from dataclasses import dataclass

import torch

from distributed.helpers import compute_split_shapes
from distributed.mappings import gather_from_parallel_region
from utils.errors import UserError
from utils.layout import Axis, Layout


@dataclass(frozen=True)
class Band:
    """This cp rank's tokens [first, stop) of an h x w grid of patch x patch patches and the patch rows holding them."""
    h: int
    w: int
    patch: int
    shapes: tuple  # tokens per cp rank
    cp: Axis

    @classmethod
    def of(cls, img_size, patch, cp):
        """The band of rank `cp.rank` for images of `img_size` (H, W) cut into `patch` x `patch` patches."""
        h, w = img_size[0] // patch, img_size[1] // patch
        too_short = Layout(cp=cp.size).refusal(tokens=h * w)  # the layout's rule, before any loader reads a band
        if too_short:
            raise UserError(too_short)
        return cls(h, w, patch, tuple(compute_split_shapes(h * w, cp.size)), cp)

    @classmethod
    def of_config(cls, params, cp):
        """The band of a ViT config's images (img_size, patch_size) on this cp rank."""
        return cls.of(params.img_size, params.get("patch_size") or 1, cp)

    @property
    def first(self):
        return sum(self.shapes[:self.cp.rank])

    @property
    def stop(self):
        return self.first + self.shapes[self.cp.rank]

    @property
    def patch_rows(self):
        """The patch rows [r0, r1) that hold this rank's tokens."""
        return self.first // self.w, -(-self.stop // self.w)

    @property
    def rows(self):
        """The image rows [y0, y1) a loader reads for this rank; None when cp is one rank (the whole field)."""
        if self.cp.size == 1:
            return None
        r0, r1 = self.patch_rows
        return r0 * self.patch, r1 * self.patch

    def cut(self, x):
        """The band's rows of a whole field `x` (..., H, W); a band already cut is returned as it is."""
        y0, y1 = self.rows or (0, self.h * self.patch)
        if x.shape[-2] == y1 - y0:
            return x
        if x.shape[-2] != self.h * self.patch:
            raise UserError(f"an input of {x.shape[-2]} rows is neither the field ({self.h * self.patch} rows: "
                            f"img_size) nor this cp rank's band ({y1 - y0} rows); crop the input to img_size")
        return x[..., y0:y1, :]

    def own(self, tokens):
        """This rank's tokens of the band's tokens (B, (r1 - r0) * w, E), or of the whole sequence's (B, h * w, E)."""
        offset = self.patch_rows[0] * self.w if tokens.shape[1] != self.h * self.w else 0
        return tokens[:, self.first - offset:self.stop - offset]

    def band_of(self, tokens):
        """The band's rows of a whole sequence's tokens (B, h * w, E), e.g. the position embedding."""
        r0, r1 = self.patch_rows
        return tokens[:, r0 * self.w:r1 * self.w]

    @torch.no_grad()
    def whole(self, tar):
        """The whole target field (B, C, H, W) from this rank's band of it: each rank's own patches, in the order the
        model's head lays them out (channel fastest), all-gathered over cp. A whole field is returned as it is."""
        if self.cp.size == 1 or tar.shape[-2] == self.h * self.patch:
            return tar
        (r0, r1), p, w = self.patch_rows, self.patch, self.w
        batch, channels = tar.shape[:2]
        patches = tar.reshape(batch, channels, r1 - r0, p, w, p).permute(0, 2, 4, 3, 5, 1)
        mine = self.own(patches.reshape(batch, (r1 - r0) * w, p * p * channels)).contiguous()
        tokens = gather_from_parallel_region(mine, 1, list(self.shapes), self.cp)
        field = tokens.view(batch, self.h, w, p, p, channels).permute(0, 5, 1, 3, 2, 4)
        return field.reshape(batch, channels, self.h * p, w * p)


def serial_band(h, w, patch):
    """The band of a model that is not split: every token, the whole field (all methods no-ops)."""
    return Band(h, w, patch, (h * w,), Axis("cp"))
