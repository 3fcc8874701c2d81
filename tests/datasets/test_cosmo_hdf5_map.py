"""The `lowmem` cosmology loader reads a contiguous, uncompressed HDF5 dataset through a numpy memory map at the
dataset's offset in the file, and falls back to h5py for every other layout (chunked, compressed, never written).
Every layout must give the same crops, bitwise, as the whole box read into memory."""
import h5py
import numpy as np
import pytest
import torch

from loaders.cosmo import ROTATIONS, CosmoDataset, contiguous_map
from utils.YParams import YParams

EDGE, CROP = 20, 8


@pytest.fixture(scope="module")
def box():
    rng = np.random.default_rng(7)
    return (rng.standard_normal((4, EDGE, EDGE, EDGE)).astype(np.float32),
            rng.standard_normal((5, EDGE, EDGE, EDGE)).astype(np.float32))


# (name, h5py.File options, create_dataset options, dtype on disk, whether the memory map serves it)
LAYOUTS = [
    ("contiguous", {}, {}, "<f4", True),
    ("user block", {"userblock_size": 4096}, {}, "<f4", True),
    ("big-endian", {}, {}, ">f4", True),
    ("float64", {}, {}, "<f8", True),
    ("chunked", {}, {"chunks": (1, 8, 8, 8)}, "<f4", False),
    ("chunked, gzip", {}, {"chunks": (4, 4, 4, 4), "compression": "gzip", "shuffle": True}, "<f4", False),
]


def _write(path, box, file_options, dataset_options, dtype):
    with h5py.File(path, "w", **file_options) as f:
        for name, volume in zip(("Nbody", "Hydro"), box):
            f.create_dataset(name, data=volume.astype(dtype), **dataset_options)
    return str(path)


def _dataset(path, mode, **changes):
    params = YParams("config/UNet.yaml", "tiny")
    params.update({"train_path": path, "val_path": path, "data_loader_config": mode, "seed": 3, "data_size": CROP,
                   "Nsamples": 48, "enable_flips": True, **changes})
    return CosmoDataset(params, True)


def _batches(dataset):
    keys = [(epoch, index) for epoch in (0, 2) for index in range(24)]
    batched = [dataset.__getitems__(keys[first:first + 8]) for first in range(0, len(keys), 8)]
    single = [dataset[key] for key in keys[:6]]
    return batched, single


def _assert_same(got, expected):
    for (inp, tar), (inp_ref, tar_ref) in zip(got[0] + got[1], expected[0] + expected[1]):
        assert torch.equal(inp, inp_ref) and torch.equal(tar, tar_ref)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_every_layout_gives_the_crops_of_the_box_in_memory(tmp_path, box, layout):
    name, file_options, dataset_options, dtype, mapped = layout
    path = _write(tmp_path / "box.h5", box, file_options, dataset_options, dtype)
    lowmem = _dataset(path, "lowmem")
    got = _batches(lowmem)
    assert all((lowmem._h5map(which) is not None) == mapped for which in (0, 1)), name
    # the crops of the 48 keys turn the box every way there is (so the maps' strided views are all exercised)
    assert len({lowmem.plan((epoch, i)).rotation for epoch in (0, 2) for i in range(24)}) > len(ROTATIONS) // 2
    _assert_same(got, _batches(_dataset(path, "inmem")))


def test_the_map_reads_the_file_in_place(tmp_path, box):
    path = _write(tmp_path / "box.h5", box, {"userblock_size": 1024}, {}, "<f4")
    with h5py.File(path, "r") as f:
        mapped = contiguous_map(path, f["Hydro"])
        assert isinstance(mapped, np.memmap) and mapped.mode == "c"  # copy-on-write: a write never reaches the file
        assert np.array_equal(mapped, box[1])
        mapped[0, 0, 0, 0] += 1
    with h5py.File(path, "r") as f:
        assert np.array_equal(f["Hydro"][:], box[1])


def test_a_dataset_never_written_is_left_to_h5py(tmp_path):
    """Its offset means nothing (h5py gives a number even so): the map must not be used; h5py gives the fill."""
    path = str(tmp_path / "empty.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("Nbody", shape=(4, EDGE, EDGE, EDGE), dtype="f4", fillvalue=2.5)
        f.create_dataset("Hydro", shape=(5, EDGE, EDGE, EDGE), dtype="f4", fillvalue=-1.0)
    with h5py.File(path, "r") as f:
        assert contiguous_map(path, f["Nbody"]) is None
    inp, tar = _dataset(path, "lowmem")[(0, 1)]
    assert torch.all(inp == 2.5) and torch.all(tar == -1.0)


def test_twin_a_map_at_the_wrong_offset_gives_other_crops(tmp_path, box, monkeypatch):
    """The comparison above can fail: a map one float too early gives different crops."""
    path = _write(tmp_path / "box.h5", box, {}, {}, "<f4")
    expected = _batches(_dataset(path, "inmem"))

    def shifted(path, dataset):
        offset = dataset.id.get_offset() - 4
        return np.memmap(path, dtype=dataset.dtype, mode="r", offset=offset, shape=dataset.shape)

    monkeypatch.setattr("loaders.cosmo.contiguous_map", shifted)
    with pytest.raises(AssertionError):
        _assert_same(_batches(_dataset(path, "lowmem")), expected)
