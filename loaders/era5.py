"""ERA5 with PyTorch: yearly HDF5 files give (x(t), x(t+dt)) pairs, normalised per channel.

`ERA5Dataset` reads the samples (whole batches at a time through __getitems__); `era5_loader` wraps it in the
PyTorch loader every data set shares (loaders/common.py). The DALI loader (loaders/dali_era5.py) reads the same
pairs through the dataset's `position` and `read_into`.
"""
import contextlib
import glob
import logging
import os

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from lifecycle.workers import PLAIN_START
from loaders.common import read_whole_batch, torch_loader
from utils.errors import OneRankError, UserError

SAMPLE_DATA_HINT = ("generate sample data with `python -m sample_data era5 --out data/era5` "
                    "and pass --data_dir data/era5")


def _load_stats(path, n_channels):
    if not os.path.isfile(path):
        raise UserError(f"statistics file '{path}' not found; {SAMPLE_DATA_HINT}")
    stats = np.load(path).astype(np.float32)
    if stats.shape != (1, n_channels, 1, 1):
        raise UserError(f"statistics file '{path}' has shape {stats.shape}, expected "
                        f"(1, {n_channels}, 1, 1): one value per channel")
    return stats[0]


class ERA5Dataset(Dataset):
    """Index i -> year i // T, step i % T; pairs never cross a year (the tutorial's boundary rule)."""

    def __init__(self, params, location, train):
        self.dt = params.dt
        self.n_channels = params.n_in_channels
        self.img_h, self.img_w = params.img_size
        if params.n_out_channels != params.n_in_channels:
            raise UserError("n_in_channels and n_out_channels must be equal for ERA5 "
                            "(input and target are the same fields)")
        if not os.path.isdir(location):
            raise UserError(f"data directory '{location}' does not exist; {SAMPLE_DATA_HINT}")
        self.files_paths = sorted(glob.glob(os.path.join(location, "*.h5")))
        if not self.files_paths:
            raise UserError(f"data directory '{location}' holds no .h5 files; {SAMPLE_DATA_HINT}")

        logging.info(f"Getting file stats from {self.files_paths[0]}")
        for path in self.files_paths:
            self.n_samples_per_year = self._check_file(path, first=(path == self.files_paths[0]))
        logging.info(f"Number of samples per year: {self.n_samples_per_year}")
        if self.n_samples_per_year <= 2 * self.dt:
            raise UserError(f"files in '{location}' hold {self.n_samples_per_year} time steps, "
                            f"too few for dt={self.dt}")

        self.n_samples_total = len(self.files_paths) * self.n_samples_per_year
        limit = params.limit_nsamples if train else params.limit_nsamples_val
        if limit is not None and limit < self.n_samples_total:
            self.n_samples_total = int(limit)
            logging.info(f"Overriding total number of samples to: {self.n_samples_total}")
        self.means = _load_stats(params.global_means_path, self.n_channels)
        self.stds = _load_stats(params.global_stds_path, self.n_channels)
        self.files = [None] * len(self.files_paths)  # opened lazily, once per worker process
        # context parallelism: this rank reads only rows [y0, y1) of each field (distributed/bands.py), else all
        self.rows = slice(*(params.get("read_rows") or (0, self.img_h)))
        if not 0 <= self.rows.start < self.rows.stop <= self.img_h:
            raise UserError(f"read_rows {params.read_rows} do not lie within the {self.img_h} rows of img_size")
        logging.info(f"Found data at path {location}. Number of examples: {self.n_samples_total}. "
                     f"Image Shape: {self.img_h} x {self.img_w} x {self.n_channels}")

    def _check_file(self, path, first):
        try:
            with h5py.File(path, "r") as f:
                if "fields" not in f:
                    raise UserError(f"HDF5 file '{path}' has no dataset 'fields'; ERA5 files hold "
                                    "fields of shape (T, channels, H, W)")
                shape = f["fields"].shape
        except OSError as err:  # truncated or not HDF5 at all
            raise UserError(f"HDF5 file '{path}' cannot be read ({err}); copy it again or regenerate "
                            "the data") from None
        if len(shape) != 4 or shape[1] != self.n_channels:
            raise UserError(f"HDF5 file '{path}' has fields of shape {shape}; expected "
                            f"(T, {self.n_channels}, H, W) with {self.n_channels} channels")
        if shape[2] < self.img_h or shape[3] < self.img_w:
            raise UserError(f"HDF5 file '{path}' has images of {shape[2]} x {shape[3]}, smaller than "
                            f"img_size {self.img_h} x {self.img_w}; lower img_size in the config")
        if not first and shape[0] != self.n_samples_per_year:
            raise UserError(f"HDF5 file '{path}' has {shape[0]} time steps but "
                            f"'{self.files_paths[0]}' has {self.n_samples_per_year}; all years "
                            "must have the same length")
        return shape[0]

    def __len__(self):
        return self.n_samples_total

    def __getstate__(self):
        state = dict(self.__dict__)
        state["files"] = [None] * len(self.files_paths)  # open h5py handles cannot be pickled (spawned workers)
        return state

    @contextlib.contextmanager
    def _fields(self, year_idx, step):
        """The year's `fields` dataset (opened lazily, once per process) to read time step `step` from."""
        try:
            if self.files[year_idx] is None:
                self.files[year_idx] = h5py.File(self.files_paths[year_idx], "r")["fields"]
            yield self.files[year_idx]
        except OSError as err:  # a file truncated or damaged after the start-up check
            raise OneRankError(f"HDF5 file '{self.files_paths[year_idx]}' cannot be read at time step {step} ({err}); "
                            "copy it again or regenerate the data") from None

    def _read(self, year_idx, step):
        with self._fields(year_idx, step) as fields:
            return fields[step, :, self.rows, :self.img_w]

    def position(self, global_idx):
        """(year file index, input time step) of sample `global_idx`."""
        year_idx, local_idx = divmod(global_idx, self.n_samples_per_year)
        # inputs lie in [dt, T - dt): both x(t) and x(t+dt) sit inside the year's file
        local_idx = local_idx % (self.n_samples_per_year - self.dt)
        if local_idx < self.dt:
            local_idx += self.dt
        return year_idx, local_idx

    def describe(self, indices):
        """Where samples `indices` come from, e.g. "2001.h5 time steps 12, 40"."""
        steps = {}
        for index in indices:
            year_idx, step = self.position(index)
            steps.setdefault(self.files_paths[year_idx], []).append(f"{step}(+{self.dt})")
        return "; ".join(f"{path} time steps {', '.join(found)}" for path, found in steps.items())

    def sample_shapes(self):
        """Shapes of one sample's input and target (C, H, W): H the rows read (this cp rank's band, or all)."""
        return ((self.n_channels, self.rows.stop - self.rows.start, self.img_w),) * 2

    def __getitems__(self, indices):
        """A whole batch (inp, tar) (B, C, H, W): see read_batch_into. No per-sample arrays, no temporaries, no
        collate copy (the DataLoader hands the batch on as is); the values are bitwise those of __getitem__
        stacked."""
        return read_whole_batch(self, indices)

    def read_batch_into(self, indices, batch):
        """Samples `indices` read straight into the rows of `batch` (inp, tar) (B, C, H, W) float32 tensors (fresh
        buffers, or a slot of the loader workers' BatchRing), then normalised in place."""
        inp, tar = (tensor.numpy() for tensor in batch)
        for row, index in enumerate(indices):
            year_idx, step = self.position(index)
            for array, at in ((inp, step), (tar, step + self.dt)):
                self.read_into(year_idx, at, array[row])
                # a channel at a time, while the frame just read is still in the cache (fewer passes over memory,
                # which is what workers on every core share)
                for plane, mean, std in zip(array[row], self.means, self.stds):
                    plane -= mean
                    plane /= std

    def read_into(self, year_idx, step, out):
        """Time step `step` of year `year_idx`, unnormalised, read straight into `out` (C, H, W) float32: only the
        rows read (an HDF5 hyperslab: the other rows' bytes are not read from the file)."""
        with self._fields(year_idx, step) as fields:
            fields.read_direct(out, source_sel=np.s_[step, :, self.rows, :self.img_w])

    def __getitem__(self, global_idx):
        year_idx, local_idx = self.position(global_idx)
        inp = (self._read(year_idx, local_idx) - self.means) / self.stds
        tar = (self._read(year_idx, local_idx + self.dt) - self.means) / self.stds
        return torch.from_numpy(inp), torch.from_numpy(tar)


def era5_dataset(params, train):
    """The training or validation ERA5Dataset of a config."""
    return ERA5Dataset(params, params.train_data_path if train else params.valid_data_path, train)


def era5_loader(params, train, worker_start=PLAIN_START):
    """The PyTorch loader of one ERA5 split (`--data_loader_config pytorch`)."""
    return torch_loader(params, era5_dataset(params, train), train, worker_start=worker_start)
