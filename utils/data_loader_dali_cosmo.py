"""NVIDIA DALI loader for the cosmology boxes (`--data_loader_config dali-lowmem`): ROI reads of the .npy copies.

The pipeline, per sample:
  1. an external source gives the crop window and the turn of the sample from `crop_plan` (utils/data_loader_cosmo.py:
     the function the PyTorch loader takes its crops from too), for the key the sampler puts at that place;
  2. DALI's numpy reader (`fn.readers.numpy`) reads only that window (`roi_start`, `roi_end`, `roi_axes` [0, 1, 2])
     of the channels-last `<basename>_data.npy` and `<basename>_label.npy` (D, H, W, C): the box is never loaded;
  3. on the GPU when there is one (`device_id=None` keeps everything on the CPU): one transpose that puts the
     channels first and permutes the spatial axes as the rotation says (a DALI conditional picks one of the 6
     permutations per sample), then one flip of the axes the rotation and the optional `enable_flips` mirror.
A rotation by multiples of 90 degrees is a permutation plus reversals of axes, so the result is bitwise what
CosmoDataset returns for the same key (tested: training and validation, 1 and 2 ranks, a mid-epoch resume).

Epochs, shards, drop_last and validation's last partial batch are the PyTorch loader's (the same sampler);
`--num_data_workers` sets DALI's CPU threads (at least 1). Looking at the step-0 batch does not consume it.
"""
import itertools

import numpy as np

from utils.data_loader_cosmo import ROTATIONS
from utils.data_loader_dali import PipelineLoader, SamplerSource

PERMUTATIONS = list(itertools.permutations(range(3)))  # of the spatial axes (D, H, W)


def dali_turn(plan):
    """(permutation index, flip flags (D, H, W)) of a CropPlan: the rotation's permutation, then the rotation's
    reversals combined with the plan's extra flips (mirroring an axis twice leaves it as it was)."""
    permutation, reversed_axes = ROTATIONS[plan.rotation]
    flags = np.zeros(3, dtype=np.int32)
    for axis in (*reversed_axes, *plan.flips):
        flags[axis] ^= 1
    return PERMUTATIONS.index(permutation), flags


class CropSource(SamplerSource):
    """Per sample: roi_start, roi_end (int32 (3,)), permutation index (int32), flip flags (int32 (3,))."""

    def __init__(self, dataset, *args):
        super().__init__(*args)
        self.dataset = dataset

    def __call__(self, sample_info):
        plan = self.dataset.plan(self.key(sample_info))
        start = np.array(plan.corner, dtype=np.int32)
        permutation, flags = dali_turn(plan)
        return start, start + self.dataset.crop_size, np.array(permutation, dtype=np.int32), flags


def _channels_first_turned(fn, volume, permutation, first=0):
    """volume (D, H, W, C) transposed to (C, D', H', W') by PERMUTATIONS[permutation], chosen per sample: a chain
    of DALI conditionals (transpose's `perm` is one value for the whole batch)."""
    perm = [3, *PERMUTATIONS[first]]
    if first == len(PERMUTATIONS) - 1:
        return fn.transpose(volume, perm=perm, output_layout="CDHW")
    if permutation == first:
        turned = fn.transpose(volume, perm=perm, output_layout="CDHW")
    else:
        turned = _channels_first_turned(fn, volume, permutation, first + 1)
    return turned


def _crop_pipeline(dali, source, paths, on_gpu):
    """The graph (built under `pipeline_def(enable_conditionals=True)`); returns (inp, tar) NCDHW."""
    fn = dali.fn
    start, end, permutation, flags = fn.external_source(source=source, batch=False, num_outputs=4,
                                                        dtype=dali.types.INT32)
    outputs = []
    for path, name in zip(paths, ("data_input", "label_input")):
        volume = fn.readers.numpy(files=[path], roi_start=start, roi_end=end, roi_axes=[0, 1, 2],
                                  cache_header_information=True, name=name)
        if on_gpu:
            volume = volume.gpu()
        volume = _channels_first_turned(fn, volume, permutation)
        outputs.append(fn.flip(volume, depthwise=flags[0], vertical=flags[1], horizontal=flags[2]))
    return tuple(outputs)


class CosmoDALILoader(PipelineLoader):
    """The cosmology crops through DALI (`--data_loader_config dali-lowmem`); the dataset is a CosmoDataset in the
    same mode (it checks the .npy files and reads the step-0 batch with numpy)."""
    config = "dali-lowmem"

    def _pipeline(self, first_epoch, first_skip):
        args = (self.dataset, self.sampler, self.batch_size, self.steps, first_epoch, first_skip)
        options = dict(batch_size=self.batch_size, num_threads=max(1, self.workers), device_id=self.device_id,
                       seed=self.seed, prefetch_queue_depth=2)
        build = self.dali.pipeline_def(_crop_pipeline, enable_conditionals=True)
        return build(self.dali, CropSource(*args), self.dataset.npy_paths, self.device_id is not None, **options)

    @property
    def sample_shape(self):
        return (self.dataset.n_in_channels, *(self.dataset.crop_size,) * 3)
