"""NVIDIA DALI loader for ERA5 (`--data_loader_config dali`), behind the same interface as the PyTorch loader.

A DALI pipeline with a parallel external source: `--num_data_workers` Python worker processes read the sample
pairs from the yearly HDF5 files (the dataset's `position` and `read_into`), and DALI normalises them per channel
(on the GPU when there is one, else on the CPU: `device_id=None`) and hands them to PyTorch through its iterator.
The order of the samples is the PyTorch loader's (the same sampler, loaders/common.py), so both loaders return the
same batches (normalisation within float32 rounding: DALI multiplies by 1/std). Epoch length, drop_last,
limit_nsamples and validation's last partial batch follow the PyTorch loader; looking at the first batch (step 0)
does not consume it. What every DALI loader shares (the sampler's keys per DALI sample, the loader interface around
a pipeline, exact mid-epoch resume) is in loaders/common.py: `SamplerSource`, `PipelineLoader`.
"""
import numpy as np

from lifecycle.workers import PLAIN_START
from loaders.common import PipelineLoader, SamplerSource, sharded_sampler, split_batch_size
from loaders.era5 import era5_dataset


class ERA5Source(SamplerSource):
    """Reads the pair (x(t), x(t+dt)) of each sample, unnormalised."""

    def __init__(self, dataset, *args):
        super().__init__(*args)
        self.dataset = dataset

    def __call__(self, sample_info):
        year_idx, step = self.dataset.position(self.key(sample_info))
        shape = self.dataset.sample_shapes()[0]  # this cp rank's band of rows, or the whole field
        inp, tar = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
        self.dataset.read_into(year_idx, step, inp)
        self.dataset.read_into(year_idx, step + self.dataset.dt, tar)
        return inp, tar


class DALILoader(PipelineLoader):
    """ERA5 through DALI (`--data_loader_config dali`)."""
    config = "dali"

    def build_pipeline(self, first_epoch, first_skip):
        dali, fn = self.dali, self.dali.fn
        source = ERA5Source(self.dataset, self.sampler, self.batch_size, self.steps, first_epoch, first_skip,
                            self.worker_start.in_worker)
        pipe = dali.Pipeline(batch_size=self.batch_size, num_threads=2, device_id=self.device_id, seed=self.seed,
                             py_num_workers=self.workers, py_start_method="spawn", prefetch_queue_depth=2)
        channels = (-1, 1, 1)
        with pipe:
            # shared-memory chunks sized for a whole sample pair: undersized ones are regrown for every sample
            sample_bytes = 2 * 4 * int(np.prod(self.sample_shape))
            inp, tar = fn.external_source(source=source, batch=False, num_outputs=2, layout=["CHW", "CHW"],
                                          parallel=self.workers > 0, dtype=[dali.types.FLOAT, dali.types.FLOAT],
                                          **({"bytes_per_sample_hint": sample_bytes + 4096} if self.workers else {}))
            if self.device_id is not None:
                inp, tar = inp.gpu(), tar.gpu()
            pipe.set_outputs(*(fn.normalize(x, mean=self.dataset.means.reshape(channels),
                                            stddev=self.dataset.stds.reshape(channels), axes=[1, 2])
                               for x in (inp, tar)))
        if self.workers > 0:
            pipe.start_py_workers()
        return pipe

    @property
    def sample_shape(self):
        return self.dataset.sample_shapes()[0]


def dali_era5_loader(params, train, worker_start=PLAIN_START):
    """The DALI loader of one ERA5 split; without DALI, a UserError that names the PyTorch loader instead."""
    dataset = era5_dataset(params, train)
    return DALILoader(params, dataset, sharded_sampler(params, dataset, train), split_batch_size(params, train),
                      train, worker_start)
