"""Random batches of the config's shapes, no files (`--data_loader_config synthetic`): for measuring a layout
without the data at hand (`train_mp.py --dry_run`, `make plan ... --measure`). The numbers it trains on mean
nothing; the shapes, the batch size per data-parallel rank and the number of steps are those of the config.
"""
import torch

SYNTHETIC_SAMPLES = 64  # samples in one epoch of each split (a loader of the real data knows its files)


class SyntheticLoader:
    """The loader interface of loaders/common.py over one random batch of this rank (input and target, (B, C, H, W)),
    made on the host once and handed out every step."""

    def __init__(self, params, train):
        height, width = params.img_size
        if params.get("read_rows"):  # this cp rank's band of image rows (distributed/bands.py)
            height = params.read_rows[1] - params.read_rows[0]
        generator = torch.Generator().manual_seed(int(params.get("seed", 0)) + 1000 * params.data_shard_id + train)
        self.batch_size = params.local_batch_size
        self.batch = (torch.randn(self.batch_size, params.n_in_channels, height, width, generator=generator),
                      torch.randn(self.batch_size, params.n_out_channels, height, width, generator=generator))
        self.steps = max(1, SYNTHETIC_SAMPLES // (self.batch_size * params.data_num_shards))
        self.skip = 0

    def __len__(self):
        return self.steps

    def __iter__(self):
        for _ in range(self.skip, self.steps):
            yield self.batch
        self.skip = 0

    def set_epoch(self, epoch, skip=0):
        self.skip = skip

    @property
    def sample_shape(self):
        return tuple(self.batch[0].shape[1:])

    def first_batch(self):
        return self.batch

    def describe(self, epoch, step):
        return "a synthetic batch (random values)"
