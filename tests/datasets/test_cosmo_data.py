"""Cosmology sample data, the .npy converter and the crop dataset.

Failures point to: sample_data/cosmo.py (file layout, dtype, determinism, overwrite guard, value ranges),
sample_data/convert_to_npy.py (channels-last copies, CLI errors), loaders/cosmo.py (crop rule, crop_plan as a
function of (seed, epoch, index) and CropSampler's keys: crops differ per rank and epoch, not per worker count;
deterministic validation, the rotation group, input/target getting the same transform, the .npy reads of the
dali-lowmem mode).
"""
import argparse
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import numpy.testing  # noqa: F401  here, as numpy < 2.1 runs lscpu on this import: a process tests may not start
import pytest
import torch

import sample_data.convert_to_npy as convert_to_npy
from lifecycle.cli import apply_overrides, training_parser
from loaders import get_data_loader
from loaders.cosmo import ROTATIONS, CosmoDataset, CropPlan, crop_plan, rotate
from sample_data.common import SampleDataError
from sample_data.cosmo import TRAIN_FILE, VALID_FILE, add_cosmo_parser, write_cosmo
from utils.errors import UserError
from utils.YParams import YParams

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_EDGE, VALID_EDGE = 32, 16
COORD_EDGE = 16


@pytest.fixture(scope="module")
def cosmo_dir(tmp_path_factory):
    return write_cosmo(tmp_path_factory.mktemp("cosmo") / "data", train_size=TRAIN_EDGE, valid_size=VALID_EDGE,
                       verbose=False)


@pytest.fixture(scope="module")
def coord_file(tmp_path_factory):
    """A box whose values name their voxel: channels 0-2 = (z, y, x), 3 = flat index, in Nbody and Hydro."""
    z, y, x = np.meshgrid(*[np.arange(COORD_EDGE)] * 3, indexing="ij")
    index = (z * COORD_EDGE + y) * COORD_EDGE + x
    nbody = np.stack([z, y, x, index]).astype(np.float32)
    hydro = np.stack([z, y, x, index, -index]).astype(np.float32)
    path = tmp_path_factory.mktemp("coords") / "coords.h5"
    with h5py.File(path, "w") as f:
        f["Nbody"] = nbody
        f["Hydro"] = hydro
    return str(path)


def _params(train_path, val_path=None, **changes):
    params = YParams("config/UNet.yaml", "tiny")
    params.update({"train_path": str(train_path), "val_path": str(val_path or train_path),
                   "data_loader_config": "inmem", "seed": 0})
    params.update(changes)
    return params


def _read(path, field):
    with h5py.File(path, "r") as f:
        return f[field][:]


def _orientation(inp):
    """3x3 matrix M[i, j] = step of input axis j per step along output axis i, read from coordinate channels."""
    coords = inp[:3].numpy()
    origin = coords[:, 0, 0, 0]
    return np.stack([coords[:, 1, 0, 0] - origin, coords[:, 0, 1, 0] - origin, coords[:, 0, 0, 1] - origin])


def _rotation_matrix(permutation, flipped):
    matrix = np.zeros((3, 3), dtype=int)
    for axis, source in enumerate(permutation):
        matrix[axis, source] = -1 if axis in flipped else 1
    return matrix


# ---------------------------------------------------------------------------------------------- generator

def test_generator_layout_dtype_and_shapes(cosmo_dir):
    for name, edge in ((TRAIN_FILE, TRAIN_EDGE), (VALID_FILE, VALID_EDGE)):
        with h5py.File(cosmo_dir / name, "r") as f:
            assert set(f) == {"Nbody", "Hydro"}
            assert f["Nbody"].shape == (4, edge, edge, edge) and f["Nbody"].dtype == np.float32
            assert f["Hydro"].shape == (5, edge, edge, edge) and f["Hydro"].dtype == np.float32
        basename = name[:-3]
        data = np.load(cosmo_dir / f"{basename}_data.npy")
        label = np.load(cosmo_dir / f"{basename}_label.npy")
        assert data.dtype == np.float32 and label.dtype == np.float32
        np.testing.assert_array_equal(data, _read(cosmo_dir / name, "Nbody").transpose(1, 2, 3, 0))
        np.testing.assert_array_equal(label, _read(cosmo_dir / name, "Hydro").transpose(1, 2, 3, 0))


def test_generated_values_fit_a_tanh_output_and_follow_the_input(cosmo_dir):
    nbody = _read(cosmo_dir / TRAIN_FILE, "Nbody")
    hydro = _read(cosmo_dir / TRAIN_FILE, "Hydro")
    assert np.all(np.isfinite(nbody)) and np.all(np.isfinite(hydro))
    assert np.abs(hydro).max() < 1.0  # reachable by tanh
    assert np.abs(hydro[0]).max() < 0.5  # exp(14 x) stays a sensible density
    assert np.all(hydro.std(axis=(1, 2, 3)) > 0.05) and np.all(nbody.std(axis=(1, 2, 3)) > 0.1)
    # the targets are (smoothed) functions of the inputs: gas follows dark matter, gas flow follows dm flow
    assert np.corrcoef(nbody[0].ravel(), hydro[0].ravel())[0, 1] > 0.9
    for axis in range(3):
        assert np.corrcoef(nbody[1 + axis].ravel(), hydro[2 + axis].ravel())[0, 1] > 0.9


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    def write(name, seed):
        out = write_cosmo(tmp_path / name, train_size=16, valid_size=16, seed=seed, verbose=False)
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    first = write("a", 0)
    time.sleep(1.1)  # HDF5 timestamps have 1 s resolution: a file that stored them would now differ
    again, other = write("b", 0), write("c", 1)
    assert len(first) == 6 and first == again
    assert first[TRAIN_FILE] != other[TRAIN_FILE]
    # train and validation boxes have different phases even at equal size
    assert not np.array_equal(_read(tmp_path / "a" / TRAIN_FILE, "Nbody"), _read(tmp_path / "a" / VALID_FILE, "Nbody"))


def test_existing_data_is_refused_unless_overwrite(tmp_path):
    write_cosmo(tmp_path, train_size=16, valid_size=16, npy=False, verbose=False)
    with pytest.raises(SampleDataError, match="already holds cosmology sample data.*--overwrite"):
        write_cosmo(tmp_path, train_size=16, valid_size=16, verbose=False)
    write_cosmo(tmp_path, train_size=24, valid_size=16, overwrite=True, verbose=False)
    assert _read(tmp_path / TRAIN_FILE, "Nbody").shape == (4, 24, 24, 24)


@pytest.mark.parametrize("sizes", [{"train_size": 8}, {"valid_size": 20}, {"seed": -1}])
def test_bad_sizes_are_refused(tmp_path, sizes):
    with pytest.raises(SampleDataError):
        write_cosmo(tmp_path, verbose=False, **sizes)
    assert not any(tmp_path.iterdir())


def test_cosmo_subcommand_writes_the_requested_sizes(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_cosmo_parser(parser.add_subparsers(dest="dataset", required=True))
    args = parser.parse_args(["cosmo", "--out", str(tmp_path), "--train_size", "16", "--valid_size", "16",
                              "--seed", "3", "--no_npy"])
    assert args.run(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([TRAIN_FILE, VALID_FILE])
    assert "[cosmo]" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- converter

def _convert_cli(*args, cwd=REPO_ROOT):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "sample_data.convert_to_npy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.multiprocess
def test_converter_cli_end_to_end(cosmo_dir, tmp_path):
    source = cosmo_dir / VALID_FILE
    result = _convert_cli("-i", str(source), "-d", "Nbody", "-l", "Hydro", "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    data = np.load(tmp_path / "out" / "downsamp_1024crop_valid_data.npy")
    np.testing.assert_array_equal(data, _read(source, "Nbody").transpose(1, 2, 3, 0))
    # without -o the files land in the current directory, as upstream
    result = _convert_cli("--input_file", str(source), "--data_field", "Hydro", "--label_field", "Nbody",
                          cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    label = np.load(tmp_path / "downsamp_1024crop_valid_label.npy")
    np.testing.assert_array_equal(label, _read(source, "Nbody").transpose(1, 2, 3, 0))


@pytest.mark.parametrize("field_args, message", [
    (["-i", "missing.h5", "-d", "Nbody", "-l", "Hydro"], "input file 'missing.h5' not found"),
    (["-d", "Nbody", "-l", "Gas"], "has no dataset 'Gas'"),
])
@pytest.mark.multiprocess
def test_converter_cli_bad_input_is_one_line(cosmo_dir, field_args, message):
    if "-i" not in field_args:
        field_args = ["-i", str(cosmo_dir / VALID_FILE), *field_args]
    result = _convert_cli(*field_args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_converter_streams_in_slabs(cosmo_dir, tmp_path, monkeypatch):
    """Slabs of 3 planes (so the last one is partial) give the same file as one big slab."""
    plane_bytes = 5 * TRAIN_EDGE * TRAIN_EDGE * 4
    monkeypatch.setattr(convert_to_npy, "SLAB_BYTES", 3 * plane_bytes)
    _, label_path = convert_to_npy.convert(cosmo_dir / TRAIN_FILE, "Nbody", "Hydro", tmp_path)
    assert Path(label_path).read_bytes() == (cosmo_dir / "downsamp_2048crop_train_label.npy").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["downsamp_2048crop_train_data.npy", Path(label_path).name]


# ---------------------------------------------------------------------------------------------- dataset

def _npy_paths(cosmo_dir):
    return {f"{split}_path_npy_{kind}": str(cosmo_dir / f"{name[:-3]}_{kind}.npy")
            for split, name in (("train", TRAIN_FILE), ("val", VALID_FILE)) for kind in ("data", "label")}


@pytest.mark.parametrize("mode", ["synthetic", "inmem", "lowmem", "dali-lowmem"])
def test_loader_modes_give_float32_crops(cosmo_dir, mode):
    params = _params(cosmo_dir / TRAIN_FILE, cosmo_dir / VALID_FILE, data_loader_config=mode, data_size=16,
                     synthetic_box_size=24, Nsamples=5, Nsamples_val=3, **_npy_paths(cosmo_dir))
    for train, length in ((True, 5), (False, 3)):
        dataset = CosmoDataset(params, train)
        assert len(dataset) == length
        inp, tar = dataset[0]
        assert inp.shape == (4, 16, 16, 16) and tar.shape == (5, 16, 16, 16)
        assert inp.dtype == torch.float32 and tar.dtype == torch.float32
        assert inp.is_contiguous() and tar.is_contiguous()


def test_inmem_lowmem_and_the_npy_copies_give_the_same_crops(cosmo_dir):
    """dali-lowmem's dataset reads the channels-last .npy copies (the step-0 batch, the DALI loader's reference)."""
    items = []
    for mode in ("inmem", "lowmem", "dali-lowmem"):
        dataset = CosmoDataset(_params(cosmo_dir / TRAIN_FILE, data_loader_config=mode, data_size=16,
                                       enable_flips=True, **_npy_paths(cosmo_dir)), True)
        items.append([dataset[(epoch, i)] for epoch in (0, 3) for i in range(4)])
    for (inp_a, tar_a), *others in zip(*items):
        for inp_b, tar_b in others:
            assert torch.equal(inp_a, inp_b) and torch.equal(tar_a, tar_b)


@pytest.mark.parametrize("mode", ["synthetic", "inmem", "lowmem", "dali-lowmem"])
def test_batched_reads_are_the_per_sample_items_bitwise(cosmo_dir, mode, monkeypatch):
    """__getitems__ (the loaders' path: read into one batch buffer, turned by adjacent-axis swaps) against
    __getitem__ stacked: random plans of two epochs, then every one of the 24 rotations with each of the 8 flip
    patterns at moving corners, and validation (never turned)."""
    params = _params(cosmo_dir / TRAIN_FILE, cosmo_dir / VALID_FILE, data_loader_config=mode, data_size=16,
                     synthetic_box_size=24, enable_flips=True, **_npy_paths(cosmo_dir))

    def assert_batches_equal(dataset, keys):
        for first in range(0, len(keys), 4):
            batch = keys[first:first + 4]
            inp, tar = dataset.__getitems__(batch)
            assert inp.shape == (len(batch), 4, 16, 16, 16) and tar.shape == (len(batch), 5, 16, 16, 16)
            assert inp.is_contiguous() and tar.is_contiguous()
            assert torch.equal(inp, torch.stack([dataset[key][0] for key in batch]))
            assert torch.equal(tar, torch.stack([dataset[key][1] for key in batch]))

    assert_batches_equal(CosmoDataset(params, True), [(epoch, i) for epoch in (0, 5) for i in range(12)])
    assert_batches_equal(CosmoDataset(params, False), [(0, i) for i in range(5)])

    def plan(self, key):
        index = key[1]
        flips = tuple(axis for axis in range(3) if (index // len(ROTATIONS)) >> axis & 1)
        edge = self.box_shape[0] - self.crop_size
        return CropPlan((index % (edge + 1), 3 * index % (edge + 1), edge - index % (edge + 1)),
                        index % len(ROTATIONS), flips)

    monkeypatch.setattr(CosmoDataset, "plan", plan)
    assert_batches_equal(CosmoDataset(params, True), [(0, i) for i in range(8 * len(ROTATIONS))])


def test_crops_stay_inside_the_box_and_reach_both_ends(coord_file):
    crop = 6
    dataset = CosmoDataset(_params(coord_file, data_size=crop, enable_rotations=False), True)
    starts = []
    for i in range(300):
        inp, tar = dataset[i]
        start = inp[:3, 0, 0, 0].numpy().astype(int)
        z, y, x = start
        expected_index = (np.arange(z, z + crop)[:, None, None] * COORD_EDGE
                          + np.arange(y, y + crop)[None, :, None]) * COORD_EDGE + np.arange(x, x + crop)
        np.testing.assert_array_equal(inp[3].numpy(), expected_index)  # one contiguous window
        starts.append(start)
    starts = np.array(starts)
    assert starts.min(axis=0).tolist() == [0, 0, 0]
    assert starts.max(axis=0).tolist() == [COORD_EDGE - crop] * 3  # the last voxel is reachable


def test_a_crop_is_a_function_of_seed_epoch_and_index(coord_file):
    dataset = CosmoDataset(_params(coord_file, data_size=4, enable_flips=True), True)
    np.random.seed(123)  # the global numpy RNG plays no part
    plans = {(epoch, i): dataset.plan((epoch, i)) for epoch in (0, 1) for i in range(20)}
    assert plans[(1, 7)] == crop_plan(0, True, 1, 7, (COORD_EDGE,) * 3, 4, rotations=True, flips=True)
    assert dataset.plan(7) == plans[(0, 7)]  # a plain index is epoch 0
    assert len(set(plans.values())) == 40  # another epoch, another crop
    assert crop_plan(1, True, 1, 7, (COORD_EDGE,) * 3, 4, rotations=True, flips=True) != plans[(1, 7)]  # seed
    # the item is the plan's window (channels 0-2 hold each voxel's coordinates; a turn keeps the window's set)
    assert dataset[(1, 7)][0][:3].amin(dim=(1, 2, 3)).tolist() == list(plans[(1, 7)].corner)


def _loader_params(coord_file, dp_size, dp_rank, workers):
    params = YParams("config/UNet.yaml", "tiny")
    args = training_parser("t").parse_args(["--local_batch_size", "2", "--num_data_workers", str(workers)])
    apply_overrides(params, args, dp_size=dp_size, dp_rank=dp_rank)
    params.update({"train_path": coord_file, "data_loader_config": "lowmem", "data_size": 4, "Nsamples": 12})
    return params


@pytest.mark.multiprocess
def test_ranks_and_epochs_draw_different_crops_and_workers_change_nothing(coord_file):
    def corners(params, epoch):
        loader = get_data_loader(params, train=True)
        loader.set_epoch(epoch)
        return [tuple(inp[:3].amin(dim=(1, 2, 3)).tolist()) for batch, _ in loader for inp in batch]

    rank0, rank1 = (corners(_loader_params(coord_file, 2, rank, 0), 0) for rank in (0, 1))
    assert len(rank0) == len(rank1) == 6 and rank0 != rank1  # the two ranks' crops differ (upstream's did not)
    # one rank reads every index each epoch: the next epoch is another set of crops, not the same set reshuffled
    assert set(corners(_loader_params(coord_file, 1, 0, 0), 1)) != set(corners(_loader_params(coord_file, 1, 0, 0), 0))
    # worker processes read other keys of the same plan: 2 workers give exactly the batches of none, all different
    assert corners(_loader_params(coord_file, 2, 0, 2), 0) == rank0 and len(set(rank0)) == 6


def test_validation_crops_are_the_same_for_every_instance_and_order(coord_file):
    first = CosmoDataset(_params(coord_file, data_size=4, Nsamples_val=8), False)
    other_rank = CosmoDataset(_params(coord_file, data_size=4, Nsamples_val=8, data_shard_id=3), False)
    items_first = {i: first[(0, i)] for i in (5, 2)}  # read in another order than below, in another epoch
    items_other = {i: other_rank[(4, i)] for i in (2, 5)}
    for i in (2, 5):
        assert torch.equal(items_first[i][0], items_other[i][0]) and torch.equal(items_first[i][1], items_other[i][1])
    assert not torch.equal(first[2][0], first[5][0])  # different items are different crops
    # validation is not augmented: the crop keeps the file's orientation
    for i in range(8):
        np.testing.assert_array_equal(_orientation(first[i][0]), np.eye(3))


def test_rotation_table_is_the_proper_rotation_group():
    matrices = [_rotation_matrix(*rotation) for rotation in ROTATIONS]
    assert len(ROTATIONS) == 24
    assert len({m.tobytes() for m in matrices}) == 24
    assert all(round(np.linalg.det(m)) == 1 for m in matrices)
    np.testing.assert_array_equal(matrices[0], np.eye(3))
    table = {m.tobytes() for m in matrices}
    assert all((a @ b).tobytes() in table for a, b in itertools.product(matrices, repeat=2))


@pytest.mark.parametrize("k", range(24))
def test_rotate_applies_its_matrix(k):
    edge = 5
    centred = np.arange(edge) - (edge - 1) / 2
    coords = np.stack(np.meshgrid(centred, centred, centred, indexing="ij"))  # (3, D, H, W): each voxel's position
    volume = np.concatenate([coords, np.ones((1, edge, edge, edge))])  # a 4th channel rides along untouched
    rotated = rotate(volume, k)
    matrix = _rotation_matrix(*ROTATIONS[k])
    # the voxel now at position p came from position q with p = matrix @ q
    np.testing.assert_allclose(np.einsum("ij,jdhw->idhw", matrix, rotated[:3]), coords)
    np.testing.assert_array_equal(rotated[3], 1.0)


@pytest.mark.parametrize("flips", [False, True])
def test_input_and_target_get_the_same_crop_and_transform(coord_file, flips):
    dataset = CosmoDataset(_params(coord_file, data_size=5, enable_flips=flips), True)
    determinants, orientations = set(), set()
    for i in range(100):
        inp, tar = dataset[i]
        assert torch.equal(tar[:4], inp[:4])  # Hydro channels 0-3 encode the same coordinates as Nbody
        assert torch.equal(tar[4], -inp[3])
        orientation = _orientation(inp)
        determinants.add(round(np.linalg.det(orientation)))
        orientations.add(orientation.tobytes())
    assert len(orientations) > 12  # augmentation is on and draws many of the rotations
    assert determinants == ({-1, 1} if flips else {1})  # rotations alone never mirror the box


@pytest.mark.parametrize("mode", ["inmem", "lowmem"])
def test_missing_file_is_a_user_error(tmp_path, mode):
    params = _params(tmp_path / "nope.h5", data_loader_config=mode)
    with pytest.raises(UserError, match=r"nope.h5' not found; generate sample data with `python -m sample_data"):
        CosmoDataset(params, True)


def test_missing_or_wrong_dataset_is_a_user_error(tmp_path):
    only_nbody = tmp_path / "only_nbody.h5"
    with h5py.File(only_nbody, "w") as f:
        f["Nbody"] = np.zeros((4, 8, 8, 8), dtype=np.float32)
    with pytest.raises(UserError, match="only_nbody.h5' has no dataset 'Hydro'"):
        CosmoDataset(_params(only_nbody, data_size=8), True)

    three_channels = tmp_path / "three.h5"
    with h5py.File(three_channels, "w") as f:
        f["Nbody"] = np.zeros((3, 8, 8, 8), dtype=np.float32)
        f["Hydro"] = np.zeros((5, 8, 8, 8), dtype=np.float32)
    with pytest.raises(UserError, match=r"'Nbody' in '.*three.h5' has shape \(3, 8, 8, 8\), expected \(4, L, L, L\)"):
        CosmoDataset(_params(three_channels, data_size=8), False)


@pytest.mark.parametrize("mode", ["synthetic", "lowmem"])
def test_crop_larger_than_the_box_is_a_user_error(cosmo_dir, mode):
    params = _params(cosmo_dir / TRAIN_FILE, cosmo_dir / VALID_FILE, data_loader_config=mode, data_size=32,
                     synthetic_box_size=16)
    if mode == "lowmem":
        CosmoDataset(params, True)  # 32 fits the 32^3 training box
    with pytest.raises(UserError, match="data_size 32 is larger than the (box of .*16 x 16 x 16|synthetic 16)"):
        CosmoDataset(params, False)  # but not the 16^3 validation box (or the 16^3 synthetic volume)


@pytest.mark.parametrize("mode", ["pytorch", "dali"])
def test_unknown_loader_mode_is_a_user_error(cosmo_dir, mode):
    with pytest.raises(UserError, match=f"data_loader_config '{mode}' is unknown for the cosmology boxes; choose "
                                        "one of: synthetic, inmem, lowmem, dali-lowmem"):
        CosmoDataset(_params(cosmo_dir / TRAIN_FILE, data_loader_config=mode), True)


@pytest.mark.parametrize("case, message", [
    ("missing", r"_label.npy' not found; the DALI loader reads the channels-last .npy copies: write them with "
                r"`python -m sample_data.convert_to_npy -i FILE.h5 -d Nbody -l Hydro -o DIR`"),
    ("channels_first", r"holds float32 \(4, 16, 16, 16\), expected float32 \(L, L, L, 4\) channels-last"),
    ("truncated", "_data.npy' cannot be read"),
    ("empty", "_data.npy' cannot be read"),  # what an interrupted convert_to_npy leaves
    ("other_box", r"cover different boxes"),
])
def test_bad_npy_copies_are_one_clear_line(tmp_path, case, message):
    data, label = tmp_path / "box_data.npy", tmp_path / "box_label.npy"
    np.save(data, np.zeros((16, 16, 16, 4), dtype=np.float32))
    np.save(label, np.zeros((16, 16, 16, 5), dtype=np.float32))
    if case == "missing":
        label.unlink()
    elif case == "channels_first":
        np.save(data, np.zeros((4, 16, 16, 16), dtype=np.float32))
    elif case == "truncated":
        data.write_bytes(data.read_bytes()[:1000])
    elif case == "empty":
        data.write_bytes(b"")
    else:
        np.save(label, np.zeros((16, 16, 8, 5), dtype=np.float32))
    params = _params(tmp_path / "unused.h5", data_loader_config="dali-lowmem", data_size=8,
                     train_path_npy_data=str(data), train_path_npy_label=str(label))
    with pytest.raises(UserError, match=message):
        CosmoDataset(params, True)
