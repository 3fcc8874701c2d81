"""NVIDIA DALI loader for ERA5 (`--data_loader_config dali`), behind the same interface as the PyTorch loader.

A DALI pipeline with a parallel external source: `--num_data_workers` Python worker processes read the sample
pairs from the yearly HDF5 files, and DALI normalises them per channel (on the GPU when there is one, else on
the CPU: `device_id=None`) and hands them to PyTorch through its iterator. The order of the samples is the
PyTorch loader's: the same sampler (a seed shared by every rank, reshuffled per epoch, a disjoint shard per
data-parallel rank), so both loaders return the same batches (normalisation within float32 rounding: DALI
multiplies by 1/std). Epoch length, drop_last, limit_nsamples and validation's last partial batch follow the
PyTorch loader; looking at the first batch (step 0) does not consume it.

`SamplerSource` and `PipelineLoader` are the parts every DALI loader here shares (the cosmology boxes' loader,
utils/data_loader_dali_cosmo.py, is the other one): which sampler key DALI's sample i of its epoch e stands for,
and the loader interface around a pipeline (epochs, exact mid-epoch resume, the step-0 batch).
"""
import copy
import math
import warnings

import numpy as np
import torch

from utils.data_loader import batch_indices, read_first_batch
from utils.errors import UserError

DALI_HINT = "install nvidia-dali-cuda120 (requirements.txt)"
TORCH_LOADERS = {"dali": "pytorch", "dali-lowmem": "lowmem"}  # what to use instead without DALI


def _import_dali(config="dali"):
    try:
        import nvidia.dali as dali
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as err:
        raise UserError(f"data_loader_config '{config}' needs NVIDIA DALI, which cannot be imported ({err}); "
                        f"use --data_loader_config {TORCH_LOADERS[config]}, or {DALI_HINT}") from None
    return dali, DALIGenericIterator, LastBatchPolicy


class SamplerSource:
    """The base of a per-sample external-source callback: sample `idx_in_epoch` of DALI's epoch `epoch_idx` is the
    sampler's key at that place in epoch `first_epoch + epoch_idx`, after the `first_skip` steps skipped in the
    first epoch (exact resume). The callback may run in DALI's worker processes: it holds only picklable state."""

    def __init__(self, sampler, batch_size, steps_per_epoch, first_epoch, first_skip):
        self.sampler = copy.copy(sampler)  # its own: set_epoch here must not move the loader's sampler
        self.batch_size, self.steps_per_epoch = batch_size, steps_per_epoch
        self.first_epoch, self.first_skip = first_epoch, first_skip
        self.order_epoch, self.order = None, None

    def _order(self, epoch):
        if epoch != self.order_epoch:
            self.sampler.set_epoch(epoch)
            self.order, self.order_epoch = list(self.sampler), epoch
        return self.order

    def key(self, sample_info):
        """The sampler key of this sample; StopIteration after the epoch's last step."""
        skip = self.first_skip if sample_info.epoch_idx == 0 else 0
        if sample_info.iteration >= self.steps_per_epoch - skip:
            raise StopIteration
        order = self._order(self.first_epoch + sample_info.epoch_idx)
        position = skip * self.batch_size + sample_info.idx_in_epoch
        return order[min(position, len(order) - 1)]  # a last partial batch is padded, then trimmed by the iterator


class ERA5Source(SamplerSource):
    """Reads the pair (x(t), x(t+dt)) of each sample, unnormalised."""

    def __init__(self, dataset, *args):
        super().__init__(*args)
        self.dataset = dataset

    def __call__(self, sample_info):
        year_idx, step = self.dataset._position(self.key(sample_info))
        shape = (self.dataset.n_channels, self.dataset.img_h, self.dataset.img_w)
        inp, tar = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
        self.dataset._read_into(year_idx, step, inp)
        self.dataset._read_into(year_idx, step + self.dataset.dt, tar)
        return inp, tar


class PipelineLoader:
    """The loop's view of a DALI pipeline: the same interface as utils.data_loader.TorchLoader. Subclasses say
    how to build the pipeline (`_pipeline(first_epoch, first_skip)`) and the sample shape."""
    config = None  # the data_loader_config it serves

    def __init__(self, params, dataset, sampler, batch_size, train):
        self.dali, self.iterator_class, self.last_batch_policy = _import_dali(self.config)
        self.dataset, self.sampler, self.batch_size, self.train = dataset, sampler, batch_size, train
        self.workers = params.num_data_workers
        self.seed = params.seed
        self.steps = len(sampler) // batch_size if train else math.ceil(len(sampler) / batch_size)
        self.device_id = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.epoch, self.skip = 0, 0
        self.iterator, self.expected, self.exhausted = None, None, True

    def __len__(self):
        return self.steps

    def set_epoch(self, epoch, skip=0):
        self.epoch, self.skip = epoch, skip

    def _pipeline(self, first_epoch, first_skip):
        raise NotImplementedError

    def _build(self):
        """A pipeline whose first epoch is self.epoch, after self.skip steps, and DALI's iterator over it."""
        pipe = self._pipeline(self.epoch, self.skip)
        pipe.build()
        # training epochs end when the source raises StopIteration (whole batches, drop_last); validation's last
        # batch is padded by the source and trimmed to the rest of the set by the iterator
        size = -1 if self.train else len(self.sampler) - self.skip * self.batch_size
        with warnings.catch_warnings():  # DALI prefers a reader's own sharding; ours is the sampler's (tested)
            warnings.filterwarnings("ignore", message="Please set `reader_name`")
            self.iterator = self.iterator_class([pipe], ["inp", "tar"], size=size, auto_reset=True,
                                                last_batch_policy=self.last_batch_policy.PARTIAL,
                                                prepare_first_batch=False)

    def __iter__(self):
        # a pipeline runs epochs in sequence; start another one for any other (epoch, skip), or after a pass
        # that stopped early (its iterator sits mid-epoch)
        if self.iterator is None or not self.exhausted or (self.epoch, self.skip) != self.expected:
            self._build()
        # training moves on by epochs; validation's order does not depend on the epoch, so its pipeline is reused
        self.expected = (self.epoch + 1, 0) if self.train else (self.epoch, self.skip)
        self.exhausted = False
        for batch in self.iterator:
            yield batch[0]["inp"], batch[0]["tar"]
        self.exhausted = True

    # what the loop needs besides the batches, read without the pipeline (nothing is consumed)
    def first_batch(self):
        return read_first_batch(self.dataset, self.sampler, self.batch_size)

    def describe(self, epoch, step):
        return self.dataset.describe(batch_indices(self.sampler, self.batch_size, epoch, step))


class DALILoader(PipelineLoader):
    """ERA5 through DALI (`--data_loader_config dali`)."""
    config = "dali"

    def _pipeline(self, first_epoch, first_skip):
        dali, fn = self.dali, self.dali.fn
        source = ERA5Source(self.dataset, self.sampler, self.batch_size, self.steps, first_epoch, first_skip)
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
        return (self.dataset.n_channels, self.dataset.img_h, self.dataset.img_w)
