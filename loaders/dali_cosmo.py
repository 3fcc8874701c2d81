"""NVIDIA DALI loader for the cosmology boxes (`--data_loader_config dali-lowmem`): ROI reads of the .npy copies.

The pipeline, per sample:
  1. an external source gives the crop window and the turn of the sample from `crop_plan` (loaders/cosmo.py:
     the function the PyTorch loader takes its crops from too), for the key the sampler puts at that place;
  2. DALI's numpy reader (`fn.readers.numpy`) reads only that window (`roi_start`, `roi_end`, `roi_axes` [0, 1, 2])
     of the channels-last `<basename>_data.npy` and `<basename>_label.npy` (D, H, W, C): the box is never loaded;
  3. on the GPU when there is one (`device_id=None` keeps everything on the CPU): one transpose that puts the
     channels first and permutes the spatial axes as the rotation says, then one flip of the axes the rotation and
     the optional `enable_flips` mirror. Transpose takes one `perm` for the whole batch, while each sample needs its
     own permutation; the reshape trick below gives it one without splitting the batch (see `turn_view`).
A rotation by multiples of 90 degrees is a permutation plus reversals of axes, so the result is bitwise what
CosmoDataset returns for the same key (tested: training and validation, 1 and 2 ranks, a mid-epoch resume).

Epochs, shards, drop_last and validation's last partial batch are the PyTorch loader's (the same sampler);
`--num_data_workers` sets DALI's CPU threads (at least 1). Looking at the step-0 batch does not consume it.
"""
import itertools

import numpy as np

from lifecycle.workers import PLAIN_START
from loaders.common import PipelineLoader, SamplerSource, sharded_sampler, split_batch_size
from loaders.cosmo import CosmoDataset, plan_turn

# A per-sample permutation of the spatial axes through one fixed transpose. Reshape the (D, H, W, C) crop to a
# 6-D view (s0, s1, s2, s3, s4, C) in which three of the five slots hold D, H, W in that order (their memory
# order) and the other two have extent 1; reshaping is free, and axes of extent 1 cost nothing to move. One fixed
# transpose then sends slot k to place RANKS[k] (after the channels), so the crop's axes come out in the order of
# their slots' ranks. RANKS = 2 5 3 1 4 holds all six orders of three as subsequences (2 3 4, 2 5 3, 2 1 4,
# 2 5 1, 5 1 4, 5 3 1), so choosing the slots per sample (the view's shape, an input DALI takes per sample)
# chooses any of the six permutations. A chain of DALI conditionals does the same but splits every batch six
# ways; the loader ran 20-25% slower that way on a 2-core CPU.
RANKS = (2, 5, 3, 1, 4)
TRANSPOSE = [5, *sorted(range(5), key=lambda slot: RANKS[slot])]  # channels first, then the slots by rank


def _slots_of_each_permutation():
    """permutation -> the slots (increasing) that D, H, W take for it: the first triple whose ranks order them so."""
    slots = {}
    for triple in itertools.combinations(range(5), 3):
        slots.setdefault(tuple(sorted(range(3), key=lambda axis: RANKS[triple[axis]])), triple)
    return slots


SLOTS = _slots_of_each_permutation()  # all six (tests/datasets/test_dali_cosmo.py)


def turn_view(permutation, crop_size):
    """The 6-D shape to view a (D, H, W, C) crop as, so that TRANSPOSE gives (C, D', H', W') with output spatial
    axis i = input axis permutation[i] (-1: the channels, whatever their number)."""
    return [crop_size if slot in SLOTS[tuple(permutation)] else 1 for slot in range(5)] + [-1]


class CropSource(SamplerSource):
    """Per sample: roi_start, roi_end (int32 (3,)), the view's shape (int32 (6,), see turn_view), flip flags
    (int32 (3,))."""

    def __init__(self, dataset, *args):
        super().__init__(*args)
        self.dataset = dataset

    def __call__(self, sample_info):
        plan = self.dataset.plan(self.key(sample_info))
        start = np.array(plan.corner, dtype=np.int32)
        permutation, mirrored = plan_turn(plan)  # the rotation's reversals and the plan's flips combined
        flags = np.zeros(3, dtype=np.int32)
        flags[list(mirrored)] = 1
        view = np.array(turn_view(permutation, self.dataset.crop_size), dtype=np.int32)
        return start, start + self.dataset.crop_size, view, flags


def _crop_pipeline(dali, source, paths, crop_size, on_gpu):
    """The graph; returns (inp, tar) NCDHW."""
    fn = dali.fn
    start, end, view, flags = fn.external_source(source=source, batch=False, num_outputs=4, dtype=dali.types.INT32)
    outputs = []
    for path, name in zip(paths, ("data_input", "label_input")):
        volume = fn.readers.numpy(files=[path], roi_start=start, roi_end=end, roi_axes=[0, 1, 2],
                                  cache_header_information=True, name=name)
        if on_gpu:
            volume = volume.gpu()
        turned = fn.transpose(fn.reshape(volume, shape=view), perm=TRANSPOSE)
        turned = fn.reshape(turned, shape=[-1, crop_size, crop_size, crop_size], layout="CDHW")
        outputs.append(fn.flip(turned, depthwise=flags[0], vertical=flags[1], horizontal=flags[2]))
    return tuple(outputs)


class CosmoDALILoader(PipelineLoader):
    """The cosmology crops through DALI (`--data_loader_config dali-lowmem`); the dataset is a CosmoDataset in the
    same mode (it checks the .npy files and reads the step-0 batch with numpy)."""
    config = "dali-lowmem"

    def build_pipeline(self, first_epoch, first_skip):
        args = (self.dataset, self.sampler, self.batch_size, self.steps, first_epoch, first_skip,
                self.worker_start.in_worker)
        options = dict(batch_size=self.batch_size, num_threads=max(1, self.workers), device_id=self.device_id,
                       seed=self.seed, prefetch_queue_depth=2)
        build = self.dali.pipeline_def(_crop_pipeline)
        return build(self.dali, CropSource(*args), self.dataset.npy_paths, self.dataset.crop_size,
                     self.device_id is not None, **options)

    @property
    def sample_shape(self):
        return (self.dataset.n_in_channels, *(self.dataset.crop_size,) * 3)


def dali_cosmo_loader(params, train, worker_start=PLAIN_START):
    """The DALI loader of one split of the cosmology crops; the dataset, a CosmoDataset in dali-lowmem mode, checks
    the .npy copies first."""
    dataset = CosmoDataset(params, train)
    return CosmoDALILoader(params, dataset, sharded_sampler(params, dataset, train), split_batch_size(params, train),
                           train, worker_start)
