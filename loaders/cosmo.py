"""PyTorch dataset for the cosmology boxes: random cubic crops of (Nbody, Hydro), rotated alike.

Every item is a random crop: the dataset length `Nsamples` sets the epoch length, and sample `index` of `epoch`
is the crop `crop_plan(seed, train, epoch, index, ...)` names (corner, rotation, flips). That pure function is the
one place crops come from: this dataset and the DALI loader (loaders/dali_cosmo.py) both apply it, so
they return the same arrays; the crops do not depend on the number of loader workers, differ between
data-parallel ranks (each reads its own shard of the indices) and between epochs, and a resumed run sees the same
crops as an uninterrupted one. Validation crops depend on the index only: the same set every epoch.

Modes (`data_loader_config`): 'synthetic' (random normal volumes in memory, no file), 'inmem' (both datasets read
once at construction), 'lowmem' (only the crop window read from the HDF5 file per sample), 'dali-lowmem' (the DALI
loader; this dataset then reads the same windows from the channels-last .npy copies, for the step-0 batch and as
the reference the DALI pipeline is tested against).
"""
import itertools
import logging
import os
from dataclasses import dataclass

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from lifecycle.workers import PLAIN_START
from loaders.common import ResumableSampler, read_whole_batch, torch_loader
from utils.errors import OneRankError, UserError

COSMO_HINT = ("generate sample data with `python -m sample_data cosmo --out data/cosmo` "
              "and pass --data_dir data/cosmo")
NPY_HINT = ("the DALI loader reads the channels-last .npy copies: write them with "
            "`python -m sample_data.convert_to_npy -i FILE.h5 -d Nbody -l Hydro -o DIR` (the sample-data generator "
            "writes them too), or use --data_loader_config lowmem")
LOADER_MODES = ("synthetic", "inmem", "lowmem", "dali-lowmem")
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


@dataclass(frozen=True)
class CropPlan:
    """Where one sample's crop lies and how it is turned (the same for input and target)."""
    corner: tuple  # (z, y, x) of the crop's first voxel in the box
    rotation: int  # index into ROTATIONS
    flips: tuple  # spatial axes (0, 1, 2) = (D, H, W) mirrored after the rotation


def crop_plan(seed, train, epoch, index, box_shape, crop_size, rotations=True, flips=False):
    """The crop of sample `index` in `epoch`: a pure function, so every loader, worker and rank that asks gets the
    same answer. Training draws from (seed, epoch, index); validation from (seed, index) alone and is not turned."""
    if train:
        rng = np.random.default_rng([seed, TRAIN_STREAM, epoch, index])
    else:  # the same set every epoch and for any number of ranks
        rng = np.random.default_rng([seed, VALID_STREAM, index])
    highest = np.array(box_shape) - crop_size
    corner = tuple(int(c) for c in rng.integers(0, highest, endpoint=True))  # every voxel can be reached
    rotation = int(rng.integers(len(ROTATIONS))) if train and rotations else 0
    flipped = tuple(int(axis) for axis in np.flatnonzero(rng.random(3) < 0.5)) if train and flips else ()
    return CropPlan(corner, rotation, flipped)


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


def transform(volume, plan):
    """`plan`'s rotation, then its flips, applied to the spatial axes of a (C, D, H, W) array (a view)."""
    turned = rotate(volume, plan.rotation)
    return np.flip(turned, axis=tuple(axis + 1 for axis in plan.flips)) if plan.flips else turned


# each spatial permutation as a chain of swaps of two adjacent axes: such a swap moves whole rows or 2D planes of
# a 64^3 crop and stays in the caches, where one copy through a 3D permutation that moves the innermost axis
# strides across pages for every voxel (2 to 4 times slower on a 64^3 crop, for the same bits)
_SWAPS = {(0, 1, 2): (), (0, 2, 1): ((0, 2, 1),), (1, 0, 2): ((1, 0, 2),), (1, 2, 0): ((1, 0, 2), (0, 2, 1)),
          (2, 0, 1): ((0, 2, 1), (1, 0, 2)), (2, 1, 0): ((1, 0, 2), (0, 2, 1), (1, 0, 2))}


def plan_turn(plan):
    """(spatial permutation, mirrored output axes) that `transform(volume, plan)` applies: the rotation's
    permutation, then its reversals combined with the plan's flips (an axis mirrored twice is as it was)."""
    permutation, reversed_axes = ROTATIONS[plan.rotation]
    mirrored = set()
    for axis in (*reversed_axes, *plan.flips):
        mirrored ^= {axis}
    return permutation, tuple(sorted(mirrored))


def transform_into(out, volume, plan, scratch):
    """out[...] = transform(volume, plan), bitwise, for a (C, d, d, d) cube: the permutation as a chain of
    adjacent swaps (_SWAPS), the flips folded into the last copy. `scratch` holds two flat float32 buffers of at
    least volume.size elements (intermediate steps); `volume` may be any view (a memory map, channels moved)."""
    permutation, mirrored = plan_turn(plan)
    current = volume
    for step, swap in enumerate(_SWAPS[permutation]):
        view = current.transpose(0, *(axis + 1 for axis in swap))
        if step == len(_SWAPS[permutation]) - 1:
            target = out
        else:
            target = scratch[step % 2][:volume.size].reshape(view.shape)
        if target is out and mirrored:
            view = np.flip(view, axis=tuple(axis + 1 for axis in mirrored))
        np.copyto(target, view)
        current = target
    if current is volume:  # no permutation: one copy, mirrored as the plan says
        np.copyto(out, np.flip(volume, axis=tuple(axis + 1 for axis in mirrored)) if mirrored else volume)


PERMUTATIONS = tuple(itertools.permutations(range(3)))  # the six spatial permutations, in turn codes' order


def turn_code(plan):
    """`plan`'s turn (plan_turn) as one small integer, exact in float32: permutation index * 8 + mirrored-axis bits.
    0 is no turn. A batch read for turning later (CosmoDataset.turn_later) carries one per sample."""
    permutation, mirrored = plan_turn(plan)
    return PERMUTATIONS.index(tuple(permutation)) * 8 + sum(1 << axis for axis in mirrored)


def turn_batch(volumes, codes):
    """The batch's crops turned as their codes (turn_code) say, bitwise transform() of each: `volumes` (B, C, d, d,
    d) tensors on any device (input and target), `codes` B integers on the host (a list: no device sync). Rows
    that need no turn are returned as read (the whole tensor when none does: a validation batch). On a GPU these
    are a few copies per sample on the stream the batch was copied on, microseconds each."""
    if not any(codes):
        return tuple(volumes)
    turned = []
    for volume in volumes:
        out = torch.empty_like(volume)
        for row, code in enumerate(codes):
            permutation, bits = PERMUTATIONS[code // 8], code % 8
            view = volume[row].permute(0, *(axis + 1 for axis in permutation))
            mirrored = [axis + 1 for axis in range(3) if bits >> axis & 1]
            out[row].copy_(view.flip(mirrored) if mirrored else view)
        turned.append(out)
    return tuple(turned)


def contiguous_map(path, dataset):
    """A numpy memory map (copy-on-write: nothing reaches the file) of HDF5 `dataset` at its byte offset in `path`,
    or None where its values are not one plain C-order array in the file (chunked or compressed, compact, external,
    not yet written, or not plain numbers): h5py's reader serves those. A crop window is then a strided view, and
    copying it out of the page cache costs one memcpy per row, where h5py walks a selection of tens of thousands of
    short rows (docs/loaders.md)."""
    plist = dataset.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() or plist.get_external_count() or \
            dataset.dtype.kind not in "fiu":
        return None
    nbytes = dataset.dtype.itemsize * int(np.prod(dataset.shape))
    offset = dataset.id.get_offset()  # from the file's first byte (a user block included)
    # a dataset never written has no storage (and an offset that means nothing)
    if offset is None or dataset.id.get_storage_size() != nbytes or offset + nbytes > os.path.getsize(path):
        return None
    # copy-on-write ("c"): read as "r" is, but writable in numpy's eyes, so torch can wrap a window without a
    # warning; nothing writes to it
    return np.memmap(path, dtype=dataset.dtype, mode="c", offset=offset, shape=dataset.shape)


class CropSampler(ResumableSampler):
    """The sampler's indices as keys (epoch, index): a crop depends on both, and a loader worker process, which
    never sees set_epoch, gets the epoch with each key."""

    def __iter__(self):
        return iter([(self.epoch, index) for index in super().__iter__()])


class CosmoDataset(Dataset):
    """Items (inp (N_in, d, d, d), tar (N_out, d, d, d)) float32: the same crop and augmentation for both.
    Keys are (epoch, index) (CropSampler); a plain index i means (0, i)."""
    sampler_class = CropSampler  # loaders.common.sharded_sampler shards and shuffles with it
    # set by loaders.common.torch_loader when batches go to a GPU: read_batch_into then reads the crop windows as
    # they lie in the box, with each sample's turn_code in a third tensor, and the loader turns the crops after
    # the host-to-device copy (finish_batch); the host's work per sample is then a plain copy of the window
    turn_later = False

    def __init__(self, params, train):
        self.train = train
        self.mode = params.data_loader_config
        if self.mode not in LOADER_MODES:
            raise UserError(f"data_loader_config '{self.mode}' is unknown for the cosmology boxes; choose one "
                            f"of: {', '.join(LOADER_MODES)}")
        self.n_in_channels = params.get("N_in_channels", 4)
        self.n_out_channels = params.N_out_channels
        self.crop_size = params.data_size
        self.n_samples = params.Nsamples if train else params.Nsamples_val
        self.seed = params.seed
        # augmentation only for training: validation is the same set of crops every epoch
        self.enable_rotations = train and params.get("enable_rotations", True)
        self.enable_flips = train and params.get("enable_flips", False)
        self.path = params.train_path if train else params.val_path
        split = "train" if train else "val"
        self.npy_paths = (params.get(f"{split}_path_npy_data"), params.get(f"{split}_path_npy_label"))
        self.inp = self.tar = None  # whole volumes ('synthetic', 'inmem')
        self.file = None  # open HDF5 file ('lowmem'), opened lazily once per worker process
        self.file_pid = None
        self.scratch = None  # reusable buffers of __getitems__, allocated on first use in each process
        self.memmaps = None  # (pid, memory maps of the .npy copies) in dali-lowmem mode, opened on first use
        self.h5maps = None  # (pid, memory maps of the HDF5 datasets, or None each) in lowmem mode, the same way

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
            box_size = params.box_size[0 if train else 1]
            if self.mode == "dali-lowmem":
                self.path = self.npy_paths[0]  # what error messages and describe() name
                self.box_shape = self._check_npy(box_size)
            else:
                self.box_shape = self._check_file(box_size)
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

    def _check_npy(self, box_size):
        """Spatial shape (D, H, W) of the channels-last .npy pair, after checking both (headers only)."""
        shapes = []
        for path, n_channels in zip(self.npy_paths, (self.n_in_channels, self.n_out_channels)):
            if not path or not os.path.isfile(path):
                raise UserError(f".npy file '{path}' not found; {NPY_HINT}")
            try:
                array = np.load(path, mmap_mode="r")
            except (OSError, ValueError, EOFError) as err:  # truncated or empty, or not a .npy file
                raise UserError(f".npy file '{path}' cannot be read ({err}); {NPY_HINT}") from None
            if array.ndim != 4 or array.shape[3] != n_channels or array.dtype != np.float32 or \
                    not array.flags.c_contiguous:
                raise UserError(f".npy file '{path}' holds {array.dtype} {array.shape}, expected float32 "
                                f"(L, L, L, {n_channels}) channels-last in C order; {NPY_HINT}")
            shapes.append(array.shape[:3])
        if shapes[0] != shapes[1]:
            raise UserError(f".npy files '{self.npy_paths[0]}' {shapes[0]} and '{self.npy_paths[1]}' {shapes[1]} "
                            f"cover different boxes; {NPY_HINT}")
        if tuple(shapes[0]) != (box_size,) * 3:
            logging.info(f"box_size {box_size} in the config differs from '{self.npy_paths[0]}' "
                         f"{shapes[0]}: using the file's shape")
        return tuple(shapes[0])

    def __len__(self):
        return self.n_samples

    def plan(self, key):
        """The CropPlan of key (epoch, index), or of index i in epoch 0."""
        epoch, index = key if isinstance(key, tuple) else (0, key)
        return crop_plan(self.seed, self.train, epoch, index, self.box_shape, self.crop_size,
                         rotations=self.enable_rotations, flips=self.enable_flips)

    def _read(self, starts):
        """(inp, tar) (C, d, d, d) of the crop window at `starts` (D, H, W); views into memory, or of what was read
        from disk."""
        z, y, x = (int(start) for start in starts)
        spatial = (slice(z, z + self.crop_size), slice(y, y + self.crop_size), slice(x, x + self.crop_size))
        window = (slice(None), *spatial)
        if self.mode in ("synthetic", "inmem"):
            return self.inp[window], self.tar[window]
        if self.mode == "dali-lowmem":  # channels-last copies: read the window, then channels first
            return tuple(np.moveaxis(self._memmap(which)[spatial], -1, 0) for which in (0, 1))
        try:
            inp, tar = (self._source(which)[window].astype(np.float32, copy=False) for which in (0, 1))
        except OSError as err:  # damaged after the start-up check
            raise OneRankError(f"HDF5 file '{self.path}' cannot be read at crop {z, y, x} ({err}); copy it again "
                            f"or {COSMO_HINT}") from None
        return inp, tar

    def _field(self, name):
        """Dataset `name` of the HDF5 file, opened lazily once per process."""
        if self.file is None or self.file_pid != os.getpid():  # HDF5 handles do not survive a fork
            self.file = h5py.File(self.path, "r")
            self.file_pid = os.getpid()
        return self.file[name]

    def _source(self, which):
        """What lowmem reads input (0) or target (1) from: the memory map of the HDF5 dataset, or the dataset."""
        h5map = self._h5map(which)
        return h5map if h5map is not None else self._field((INPUT_FIELD, TARGET_FIELD)[which])

    def _h5map(self, which):
        """contiguous_map of input (0) or target (1) in the HDF5 file, or None (read with h5py), once per process."""
        if self.h5maps is None or self.h5maps[0] != os.getpid():
            self.h5maps = (os.getpid(), [contiguous_map(self.path, self._field(name))
                                         for name in (INPUT_FIELD, TARGET_FIELD)])
        return self.h5maps[1][which]

    def _memmap(self, which):
        """Memory map of the .npy copy of input (0) or target (1), opened once per process: a map opened per read
        faults in every page of the window again."""
        if self.memmaps is None or self.memmaps[0] != os.getpid():
            self.memmaps = (os.getpid(), [np.load(path, mmap_mode="r") for path in self.npy_paths])
        return self.memmaps[1][which]

    def _scratch(self, n_elements):
        """Three flat float32 buffers of at least n_elements: a window read from disk, two turning steps."""
        if self.scratch is None or self.scratch[0].size < n_elements:
            self.scratch = [np.empty(n_elements, dtype=np.float32) for _ in range(3)]
        return self.scratch

    def _turn_window_into(self, out, which, plan):
        """out (C, d, d, d) = the crop of `plan` from input (which=0) or target (1): the window is read into `out`
        itself when the crop is not turned, else into a reusable buffer and turned while copied into `out`. In
        lowmem mode h5py's read_direct reads it; in dali-lowmem mode it is copied out of the .npy memory map,
        channels moved first on the way. In lowmem mode a contiguous HDF5 dataset is read through its memory map
        (contiguous_map) and turned straight out of it, where h5py's read_direct serves the others."""
        z, y, x = plan.corner
        d = self.crop_size
        read, *steps = self._scratch(out.size)
        untouched = plan_turn(plan) == ((0, 1, 2), ())
        window = out if untouched else read[:out.size].reshape(out.shape)
        h5map = self._h5map(which) if self.mode == "lowmem" else None
        if h5map is not None:  # the window is a view of the page cache: turned (or copied) from there at once
            source = h5map[:, z:z + d, y:y + d, x:x + d]
            if untouched and source.dtype == out.dtype and source.dtype.isnative and source.flags.writeable:
                # torch's copy of a strided window: about 1.2x numpy's (fewer calls per row of the window)
                torch.from_numpy(out).copy_(torch.from_numpy(source))
            elif untouched:
                np.copyto(out, source, casting="unsafe")
            else:
                transform_into(out, source, plan, steps)
            return
        if self.mode == "dali-lowmem":
            memmap = self._memmap(which)
            np.copyto(window, np.moveaxis(memmap[z:z + d, y:y + d, x:x + d], -1, 0))
        else:
            selection = np.s_[:, z:z + d, y:y + d, x:x + d]
            try:
                dataset = self._field((INPUT_FIELD, TARGET_FIELD)[which])
                if dataset.dtype == np.float32:
                    dataset.read_direct(window, source_sel=selection)
                else:  # converted by numpy, as __getitem__ does
                    np.copyto(window, dataset[selection].astype(np.float32, copy=False))
            except OSError as err:  # damaged after the start-up check
                raise OneRankError(f"HDF5 file '{self.path}' cannot be read at crop {z, y, x} ({err}); copy it "
                                f"again or {COSMO_HINT}") from None
        if not untouched:
            transform_into(out, window, plan, steps)

    def sample_shapes(self):
        """Shapes of one sample's input (N_in, d, d, d) and target (N_out, d, d, d), and of its turn code (1,)
        when the crops are turned later (turn_later)."""
        shapes = tuple((channels, *(self.crop_size,) * 3) for channels in (self.n_in_channels, self.n_out_channels))
        return (*shapes, (1,)) if self.turn_later else shapes

    def __getitems__(self, keys):
        """A whole batch (inp (B, N_in, d, d, d), tar (B, N_out, d, d, d)), turned: see read_batch_into. No
        per-sample arrays and no collate copy (the DataLoader hands the batch on as is). Bitwise __getitem__'s items
        stacked (tested)."""
        batch = read_whole_batch(self, keys)
        return self.finish_batch(batch[:2], batch[2]) if self.turn_later else batch

    def finish_batch(self, volumes, codes):
        """(inp, tar) of a batch read with turn_later, turned (turn_batch) wherever the tensors are; `codes`: the
        batch's (B, 1) turn codes as read, on the host."""
        return turn_batch(volumes, [int(code) for code in codes.view(-1).tolist()])

    def read_batch_into(self, keys, batch):
        """The crops of `keys` read and turned straight into the rows of `batch` (inp, tar) float32 tensors (fresh
        buffers, or a slot of the loader workers' BatchRing); with turn_later, read as they lie and their turn
        codes written into batch[2]."""
        arrays = [tensor.numpy() for tensor in batch[:2]]
        for row, key in enumerate(keys):
            plan = self.plan(key)
            if self.turn_later:
                batch[2][row] = turn_code(plan)
                plan = CropPlan(plan.corner, 0, ())
            if self.mode in ("lowmem", "dali-lowmem"):
                for which, array in enumerate(arrays):
                    self._turn_window_into(array[row], which, plan)
            else:  # views of a volume in memory
                for array, volume in zip(arrays, self._read(plan.corner)):
                    transform_into(array[row], volume, plan, self._scratch(array[row].size)[1:])

    def describe(self, keys):
        """Where samples `keys` come from: the file and each crop's corner, rotation and flips."""
        source = "synthetic volume" if self.mode == "synthetic" else f"'{self.path}'"
        crops = []
        for key in keys:
            plan = self.plan(key)
            flips = f" flips {list(plan.flips)}" if plan.flips else ""
            crops.append(f"({', '.join(map(str, plan.corner))}) rotation {plan.rotation}{flips}")
        return f"crops of {source} at {'; '.join(crops)}"

    def __getitem__(self, key):
        plan = self.plan(key)
        inp, tar = (transform(volume, plan) for volume in self._read(plan.corner))
        # views of a volume in memory or of a memory map, or arrays read by h5py: copied (this is not the loader's
        # path, which reads whole batches with __getitems__)
        inp, tar = np.array(inp, order="C"), np.array(tar, order="C")
        return torch.from_numpy(inp), torch.from_numpy(tar)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["file"] = None  # an open h5py file cannot be pickled to worker processes (spawn)
        state["scratch"] = state["memmaps"] = state["h5maps"] = None  # each process makes its own
        return state


def cosmo_loader(params, train, worker_start=PLAIN_START):
    """The PyTorch loader of one split of the cosmology crops (`--data_loader_config synthetic|inmem|lowmem`)."""
    return torch_loader(params, CosmoDataset(params, train), train, worker_start=worker_start)
