"""PyTorch data loaders: the ERA5 dataset here, the others by name (`dataset` key), one sampler and loader for all.

ERA5 yearly HDF5 files give (x(t), x(t+dt)) pairs, normalised per channel. The training loop sees every loader
through one interface (`TorchLoader` here; the DALI loaders offer the same): iterate one epoch's batches, len()
= steps per epoch, set_epoch(epoch, skip) to start an epoch after `skip` steps (exact resume), sample_shape,
first_batch() for the step-0 values, describe(epoch, step) to name the samples of a batch in error messages.
"""
import contextlib
import copy
import glob
import logging
import os

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate, get_worker_info

from utils import comm
from utils.errors import UserError

SAMPLE_DATA_HINT = ("generate sample data with `python -m utils.sample_data era5 --out data/era5` "
                    "and pass --data_dir data/era5")


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through (resume at the same data position)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_epoch(self, epoch, skip=0):
        """Order of `epoch`; the first `skip` of this rank's samples are left out."""
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])


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
            raise UserError(f"HDF5 file '{self.files_paths[year_idx]}' cannot be read at time step {step} ({err}); "
                            "copy it again or regenerate the data") from None

    def _read(self, year_idx, step):
        with self._fields(year_idx, step) as fields:
            return fields[step, :, :self.img_h, :self.img_w]

    def _position(self, global_idx):
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
            year_idx, step = self._position(index)
            steps.setdefault(self.files_paths[year_idx], []).append(f"{step}(+{self.dt})")
        return "; ".join(f"{path} time steps {', '.join(found)}" for path, found in steps.items())

    def __getitems__(self, indices):
        """A whole batch: every sample read straight into one (B, C, H, W) buffer per output, then normalised in
        place. No per-sample arrays, no temporaries, no collate copy (the DataLoader hands the batch on as is);
        the values are bitwise those of __getitem__ stacked."""
        shape = (len(indices), self.n_channels, self.img_h, self.img_w)
        inp_tensor, tar_tensor = _batch_buffer(shape), _batch_buffer(shape)
        inp, tar = inp_tensor.numpy(), tar_tensor.numpy()
        for row, index in enumerate(indices):
            year_idx, step = self._position(index)
            self._read_into(year_idx, step, inp[row])
            self._read_into(year_idx, step + self.dt, tar[row])
        for batch in (inp, tar):
            batch -= self.means
            batch /= self.stds
        return inp_tensor, tar_tensor

    def _read_into(self, year_idx, step, out):
        with self._fields(year_idx, step) as fields:
            fields.read_direct(out, source_sel=np.s_[step, :, :self.img_h, :self.img_w])

    def __getitem__(self, global_idx):
        year_idx, local_idx = self._position(global_idx)
        inp = (self._read(year_idx, local_idx) - self.means) / self.stds
        tar = (self._read(year_idx, local_idx + self.dt) - self.means) / self.stds
        return torch.from_numpy(inp), torch.from_numpy(tar)


def get_dataset(params, train):
    """The training or validation dataset of the config's `dataset` (era5, cosmo, cifar100, imagefolder)."""
    name = params.get("dataset", "era5")
    if name == "era5":
        if params.data_loader_config == "dali-lowmem":
            raise UserError("data_loader_config 'dali-lowmem' is the cosmology boxes' DALI loader "
                            "(config/UNet.yaml); for ERA5 choose one of: pytorch, dali")
        if params.data_loader_config not in ("pytorch", "dali"):
            raise UserError(f"data_loader_config '{params.data_loader_config}' is unknown for ERA5; choose one of: "
                            "pytorch, dali")
        return ERA5Dataset(params, params.train_data_path if train else params.valid_data_path, train)
    if name == "cosmo":
        from utils.data_loader_cosmo import CosmoDataset
        return CosmoDataset(params, train)
    if name in ("cifar100", "imagefolder"):
        from utils.data_loader_images import get_image_dataset
        # rank 0 first: it may download CIFAR-100 (when the config allows); if it fails, every rank stops
        # with its message instead of waiting for it forever
        dataset = comm.on_rank0(lambda: get_image_dataset(params, train, download_ok=True))
        return dataset if dataset is not None else get_image_dataset(params, train, download_ok=False)
    raise UserError(f"dataset '{name}' is unknown; choose one of: era5, cosmo, cifar100, imagefolder")


class TorchLoader:
    """A DataLoader over a ResumableSampler, seen through the interface the training loop uses."""

    def __init__(self, dataset, sampler, loader):
        self.dataset, self.sampler, self.loader = dataset, sampler, loader
        self.batch_size = loader.batch_size

    def __iter__(self):
        return iter(self.loader)

    def __len__(self):
        """Steps in a whole epoch (also right after set_epoch(epoch, skip))."""
        return len(self.loader)

    def set_epoch(self, epoch, skip=0):
        """Next iteration gives the batches of `epoch` (its shuffle order), leaving out its first `skip` steps."""
        self.sampler.set_epoch(epoch, skip=skip * self.batch_size)

    @property
    def sample_shape(self):
        """Shape of one input sample, e.g. (C, H, W)."""
        return tuple(probe_copy(self.dataset)[0][0].shape)

    def first_batch(self):
        """The first batch of epoch 0, as the loop will see it (for the step-0 values)."""
        return read_first_batch(self.dataset, self.sampler, self.batch_size)

    def describe(self, epoch, step):
        """The samples of batch `step` of `epoch` on this rank, by file where the dataset can tell."""
        indices = batch_indices(self.sampler, self.batch_size, epoch, step)
        if hasattr(self.dataset, "describe"):
            return self.dataset.describe(indices)
        return f"sample indices {', '.join(map(str, indices))}"


def read_first_batch(dataset, sampler, batch_size):
    """Batch 0 of epoch 0 of this rank, read from a probe copy (nothing the loader will deliver is consumed)."""
    probe, indices = probe_copy(dataset), batch_indices(sampler, batch_size, 0, 0)
    if hasattr(probe, "__getitems__"):
        return probe.__getitems__(indices)
    return default_collate([probe[i] for i in indices])


def probe_copy(dataset):
    """A copy of a dataset for looking at samples (step 0, shapes) that opens its own files: handles opened here
    must not reach the training copy or a loader's workers. (Samples are functions of their keys, so looking
    draws nothing from any training stream.)"""
    probe = copy.copy(dataset)
    if hasattr(probe, "files"):
        probe.files = [None] * len(probe.files)
    return probe


def batch_indices(sampler, batch_size, epoch, step):
    """The sample indices of batch `step` of `epoch` on this rank (the sampler's own position is kept)."""
    saved = (sampler.epoch, sampler.skip)
    sampler.set_epoch(epoch)
    order = list(sampler)
    sampler.set_epoch(saved[0], skip=saved[1])
    return order[step * batch_size:(step + 1) * batch_size]


def get_data_loader(params, train):
    """The loader of one split (TorchLoader), sharded over the data-parallel ranks."""
    dataset = get_dataset(params, train)
    batch_size = params.local_batch_size if train else params.get("valid_batch_size_per_gpu",
                                                                  params.local_batch_size)
    if train and len(dataset) < params.local_batch_size * params.data_num_shards:
        raise UserError(f"the training data has {len(dataset)} samples, fewer than one global batch of "
                        f"{params.local_batch_size * params.data_num_shards}; lower the batch size")
    # always a sampler, also on one rank: the shuffle order is then a function of (seed, epoch)
    sampler_class = getattr(dataset, "sampler_class", ResumableSampler)  # cosmology: keys (epoch, index)
    sampler = sampler_class(dataset, num_replicas=params.data_num_shards, rank=params.data_shard_id,
                            shuffle=train, seed=params.seed, drop_last=train)
    workers = params.num_data_workers
    # own generator: worker seeds do not draw from the global RNG, so a resumed run's RNG (dropout)
    # follows the same sequence as an uninterrupted one
    if params.data_loader_config == "dali" and params.get("dataset", "era5") == "era5":
        from utils.data_loader_dali import DALILoader
        return DALILoader(params, dataset, sampler, batch_size, train)
    if params.data_loader_config == "dali-lowmem" and params.get("dataset") == "cosmo":
        from utils.data_loader_dali_cosmo import CosmoDALILoader
        return CosmoDALILoader(params, dataset, sampler, batch_size, train)
    # datasets that read whole batches (ERA5: __getitems__) hand them on without a collate copy
    collate_fn = _batched_already if hasattr(dataset, "__getitems__") else None
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                        num_workers=workers, drop_last=train, pin_memory=torch.cuda.is_available(),
                        persistent_workers=workers > 0, worker_init_fn=_seed_worker,
                        generator=torch.Generator().manual_seed(params.seed + params.data_shard_id))
    return TorchLoader(dataset, sampler, loader)


def _batch_buffer(shape):
    """A float32 tensor to read a batch into. In the main process a numpy allocation (numpy asks for huge pages
    for large arrays: 4x fewer page faults than torch.empty here); in a loader worker, shared memory already, so
    that handing the batch to the main process copies nothing (as default_collate does for what it stacks)."""
    if get_worker_info() is None:
        return torch.from_numpy(np.empty(shape, dtype=np.float32))
    storage = torch.UntypedStorage._new_shared(int(np.prod(shape)) * 4)
    return torch.empty(0, dtype=torch.float32).set_(storage, 0, shape)


def _batched_already(batch):
    return batch


def _seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % (2**32 - 1))
