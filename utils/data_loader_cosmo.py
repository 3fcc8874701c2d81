"""PyTorch dataset for the cosmology boxes: random cubic crops of (Nbody, Hydro), rotated alike.

Every item is a fresh random crop (the index only counts samples), so the dataset length `Nsamples` sets the
epoch length. Modes (`data_loader_config`): 'synthetic' (random normal volumes in memory, no file), 'inmem'
(both datasets read once at construction), 'lowmem' (only the crop window read from disk per sample).
"""
import itertools
import logging
import os

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from utils.errors import UserError

COSMO_HINT = ("generate sample data with `python -m utils.sample_data cosmo --out data/cosmo` "
              "and pass --data_dir data/cosmo")
LOADER_MODES = ("synthetic", "inmem", "lowmem")
INPUT_FIELD, TARGET_FIELD = "Nbody", "Hydro"
# first words of the RNG seeds: training, validation and synthetic draws never share a stream
TRAIN_STREAM, VALID_STREAM, SYNTHETIC_STREAM = 0, 1, 2


def _proper_rotations():
    """The 24 rotations of a cube as (permutation, flipped axes) of the spatial axes (0, 1, 2) = (D, H, W).

    Output axis i is input axis permutation[i], then the output axes in `flipped` are reversed. That map
    has determinant sign(permutation) * (-1)^len(flipped); the 24 with +1 are the rotations, the other 24
    of the cube's 48 symmetries are reflections (upstream's table mixed in 8 of those).
    """
    rotations = []
    for permutation in itertools.permutations(range(3)):
        inversions = sum(permutation[i] > permutation[j] for i in range(3) for j in range(i + 1, 3))
        for n_flipped in range(4):
            for flipped in itertools.combinations(range(3), n_flipped):
                if (-1) ** (inversions + n_flipped) == 1:
                    rotations.append((permutation, flipped))
    return rotations


ROTATIONS = _proper_rotations()  # ROTATIONS[0] is the identity


def rotate(volume, k):
    """Rotation k of ROTATIONS applied to the spatial axes of a (C, D, H, W) array (a view, not a copy).

    Only the grid is rotated: the components of vector fields (velocities) are not rotated with it, as
    upstream (a physically exact rotation would also permute and negate the velocity channels).
    """
    permutation, flipped = ROTATIONS[k]
    rotated = volume.transpose(0, *(axis + 1 for axis in permutation))
    if flipped:
        rotated = np.flip(rotated, axis=tuple(axis + 1 for axis in flipped))
    return rotated


class CosmoDataset(Dataset):
    """Items (inp (N_in, d, d, d), tar (N_out, d, d, d)) float32: the same crop and augmentation for both."""

    def __init__(self, params, train):
        self.train = train
        self.mode = params.data_loader_config
        if self.mode not in LOADER_MODES:
            if self.mode.startswith("dali"):
                raise UserError(f"data_loader_config '{self.mode}' is not available yet (the DALI loader has "
                                f"not landed); use one of: {', '.join(LOADER_MODES)}")
            raise UserError(f"data_loader_config '{self.mode}' is unknown; choose one of: "
                            f"{', '.join(LOADER_MODES)}")
        self.n_in_channels = params.get("N_in_channels", 4)
        self.n_out_channels = params.N_out_channels
        self.crop_size = params.data_size
        self.n_samples = params.Nsamples if train else params.Nsamples_val
        self.seed = params.seed
        self.data_shard_id = params.get("data_shard_id", 0)
        # augmentation only for training: validation is the same set of crops every epoch
        self.enable_rotations = train and params.get("enable_rotations", True)
        self.enable_flips = train and params.get("enable_flips", False)
        self.path = params.train_path if train else params.val_path
        self.inp = self.tar = None  # whole volumes ('synthetic', 'inmem')
        self.file = None  # open HDF5 file ('lowmem'), opened lazily once per worker process
        self.file_pid = None
        self.rng = None  # training RNG, created lazily once per process
        self.rng_pid = None

        if self.mode == "synthetic":
            edge = params.get("synthetic_box_size", 128)
            self.box_shape = (edge, edge, edge)
            if self.crop_size > edge:
                raise UserError(f"data_size {self.crop_size} is larger than the synthetic {edge}^3 volume; "
                                "lower data_size or raise synthetic_box_size")
            rng = np.random.default_rng([self.seed, SYNTHETIC_STREAM, int(train)])
            self.inp = rng.standard_normal((self.n_in_channels, *self.box_shape), dtype=np.float32)
            self.tar = rng.standard_normal((self.n_out_channels, *self.box_shape), dtype=np.float32)
            where = f"synthetic {edge}^3 volume"
        else:
            self.box_shape = self._check_file(params.box_size[0 if train else 1])
            if self.crop_size > min(self.box_shape):
                raise UserError(f"data_size {self.crop_size} is larger than the box of '{self.path}' "
                                f"({' x '.join(map(str, self.box_shape))} voxels); lower data_size or "
                                f"{COSMO_HINT} (with --train_size/--valid_size at least {self.crop_size})")
            if self.mode == "inmem":
                with h5py.File(self.path, "r") as f:
                    self.inp = f[INPUT_FIELD][:].astype(np.float32, copy=False)
                    self.tar = f[TARGET_FIELD][:].astype(np.float32, copy=False)
            where = f"'{self.path}' ({' x '.join(map(str, self.box_shape))} voxels)"
        logging.info(f"Cosmo {'train' if train else 'valid'} data ({self.mode}): {where}, "
                     f"{self.n_samples} crops of {self.crop_size}^3 per epoch")

    def _check_file(self, box_size):
        """Spatial shape (D, H, W) of the file's boxes, after checking both datasets."""
        if not os.path.isfile(self.path):
            raise UserError(f"HDF5 file '{self.path}' not found; {COSMO_HINT}")
        shapes = {}
        try:
            with h5py.File(self.path, "r") as f:
                for field, n_channels in ((INPUT_FIELD, self.n_in_channels), (TARGET_FIELD, self.n_out_channels)):
                    if field not in f:
                        raise UserError(f"HDF5 file '{self.path}' has no dataset '{field}'; {COSMO_HINT}")
                    shape = f[field].shape
                    if len(shape) != 4 or shape[0] != n_channels:
                        raise UserError(f"dataset '{field}' in '{self.path}' has shape {shape}, expected "
                                        f"({n_channels}, L, L, L) with {n_channels} channels; {COSMO_HINT}")
                    shapes[field] = shape[1:]
        except OSError as err:  # truncated or not HDF5 at all
            raise UserError(f"HDF5 file '{self.path}' cannot be read ({err}); copy it again or {COSMO_HINT}") from None
        if shapes[INPUT_FIELD] != shapes[TARGET_FIELD]:
            raise UserError(f"datasets '{INPUT_FIELD}' {shapes[INPUT_FIELD]} and '{TARGET_FIELD}' "
                            f"{shapes[TARGET_FIELD]} in '{self.path}' cover different boxes; {COSMO_HINT}")
        if tuple(shapes[INPUT_FIELD]) != (box_size,) * 3:
            logging.info(f"box_size {box_size} in the config differs from '{self.path}' "
                         f"{shapes[INPUT_FIELD]}: using the file's shape")
        return tuple(shapes[INPUT_FIELD])

    def __len__(self):
        return self.n_samples

    def _train_rng(self):
        """One generator per process (rank, loader worker), kept across epochs; never the global numpy RNG."""
        if self.rng is None or self.rng_pid != os.getpid():  # a forked worker must not reuse its parent's
            worker = get_worker_info()
            worker_id = 0 if worker is None else worker.id
            self.rng = np.random.default_rng([self.seed, TRAIN_STREAM, self.data_shard_id, worker_id])
            self.rng_pid = os.getpid()
        return self.rng

    def _read(self, starts):
        """(inp, tar) of the crop window at `starts` (D, H, W); views into memory or fresh arrays from disk."""
        z, y, x = (int(start) for start in starts)
        window = (slice(None), slice(z, z + self.crop_size), slice(y, y + self.crop_size),
                  slice(x, x + self.crop_size))
        if self.mode != "lowmem":
            return self.inp[window], self.tar[window]
        try:
            if self.file is None or self.file_pid != os.getpid():  # HDF5 handles do not survive a fork
                self.file = h5py.File(self.path, "r")
                self.file_pid = os.getpid()
            inp = self.file[INPUT_FIELD][window].astype(np.float32, copy=False)
            tar = self.file[TARGET_FIELD][window].astype(np.float32, copy=False)
        except OSError as err:  # damaged after the start-up check
            raise UserError(f"HDF5 file '{self.path}' cannot be read at crop {z, y, x} ({err}); copy it again "
                            f"or {COSMO_HINT}") from None
        return inp, tar

    def describe(self, indices):
        """Where samples `indices` come from (random crops of one file)."""
        source = "synthetic volume" if self.mode == "synthetic" else f"'{self.path}'"
        return f"{len(indices)} random crops of {source}"

    def __getitem__(self, index):
        # validation crop i depends only on (seed, i): the same set every epoch and for any number of ranks
        rng = self._train_rng() if self.train else np.random.default_rng([self.seed, VALID_STREAM, index])
        highest_starts = np.array(self.box_shape) - self.crop_size
        starts = rng.integers(0, highest_starts, endpoint=True)  # every voxel can be reached
        inp, tar = self._read(starts)
        if self.enable_rotations:
            k = int(rng.integers(len(ROTATIONS)))
            inp, tar = rotate(inp, k), rotate(tar, k)
        if self.enable_flips:
            flip_axes = tuple(1 + np.flatnonzero(rng.random(3) < 0.5))
            if flip_axes:
                inp, tar = np.flip(inp, axis=flip_axes), np.flip(tar, axis=flip_axes)
        if self.mode == "lowmem":  # fresh arrays from disk: copied only if rotated or flipped
            inp, tar = np.ascontiguousarray(inp), np.ascontiguousarray(tar)
        else:  # views of the in-memory volume: always copied, never handed out
            inp, tar = np.array(inp, order="C"), np.array(tar, order="C")
        return torch.from_numpy(inp), torch.from_numpy(tar)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["file"] = None  # an open h5py file cannot be pickled to worker processes (spawn)
        return state
