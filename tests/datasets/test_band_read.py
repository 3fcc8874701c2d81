"""A context-parallel rank reads only its band of image rows (distributed/bands.py, loaders/era5.py's read_rows).

With cp > 1, a rank's tokens (consecutive patches in row-major order) lie in a band of patch rows; its loaders read
only those image rows of each field, inputs and targets alike. Checked here, on 25 x 48 files read as 24 x 48 at
patch 2 (wfm_tiny's shape) and at cp = 1 to 5 (at 5, 58 tokens a rank: bands start and end inside a row of 24
patches): each rank's batch is bitwise the same as a whole read cut to its
rows; the bytes h5py reads from the file for a sample (through a counting file object: benchmarks/bench_band_read.py)
are the band's, so they fall as 1/cp (twin: the whole field read and then cut gives the same tensors, and the count
catches it); the band covers exactly the rank's tokens (its first and last token inside it, at most one partly used
patch row at each end); the synthetic loader hands out batches of the band's shape; rows outside the image are
refused in one line. Failures point to distributed/bands.py (Band.rows) or loaders/era5.py (ERA5Dataset.rows).
"""
import h5py
import numpy as np
import numpy.testing  # noqa: F401  here, as numpy < 2.1 runs lscpu on this import: a process tests may not start
import pytest
import torch

from benchmarks.bench_band_read import counted_dataset
from distributed.bands import Band
from loaders.era5 import ERA5Dataset
from utils.errors import UserError
from utils.layout import Axis
from utils.YParams import YParams

T, C, H, W = 6, 20, 25, 48
IMG, PATCH = (24, 48), 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("band")
    (root / "train").mkdir()
    (root / "stats").mkdir()
    rng = np.random.default_rng(0)
    with h5py.File(root / "train" / "2000.h5", "w") as f:  # contiguous, as FourCastNet's files are
        f.create_dataset("fields", data=rng.standard_normal((T, C, H, W)).astype(np.float32))
    np.save(root / "stats" / "global_means.npy", np.full((1, C, 1, 1), 0.5, np.float32))
    np.save(root / "stats" / "global_stds.npy", np.full((1, C, 1, 1), 2.0, np.float32))
    return root


def make_params(data, rows=None):
    params = YParams("config/ViT.yaml", "wfm_tiny")
    params.update({"img_size": list(IMG), "patch_size": PATCH, "dt": 1, "limit_nsamples": None,
                   "global_means_path": str(data / "stats/global_means.npy"),
                   "global_stds_path": str(data / "stats/global_stds.npy"), "read_rows": rows})
    return params


def bands(cp):
    return [Band.of(IMG, PATCH, Axis("cp", cp, rank)) for rank in range(cp)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_each_rank_reads_its_band_bitwise_as_a_whole_read_cut(data, cp):
    whole = ERA5Dataset(make_params(data), str(data / "train"), train=True)
    indices = [0, 3, 2]
    full_inp, full_tar = whole.__getitems__(indices)
    covered = set()
    for band in bands(cp):
        dataset = ERA5Dataset(make_params(data, band.rows), str(data / "train"), train=True)
        y0, y1 = band.rows or (0, IMG[0])
        inp, tar = dataset.__getitems__(indices)
        assert inp.shape == (3, C, y1 - y0, W) == tar.shape
        assert torch.equal(inp, full_inp[:, :, y0:y1]) and torch.equal(tar, full_tar[:, :, y0:y1])
        assert torch.equal(dataset[2][1], whole[2][1][:, y0:y1])  # the per-sample path too
        covered.update(range(y0, y1))
    assert covered == set(range(IMG[0]))
    assert not torch.equal(full_inp[:, :, :2], full_inp[:, :, 2:4])  # rows differ: a wrong band would be seen


@pytest.mark.parametrize("cp", [2, 3, 4, 5])
def test_a_band_holds_exactly_its_ranks_tokens(cp):
    h, w = IMG[0] // PATCH, IMG[1] // PATCH
    for band in bands(cp):
        (r0, r1), (y0, y1) = band.patch_rows, band.rows
        assert (y0, y1) == (r0 * PATCH, r1 * PATCH)
        assert r0 == band.first // w and (r1 - 1) == (band.stop - 1) // w  # first and last token inside, no more
        assert band.stop - band.first == band.shapes[band.cp.rank]
    assert sum(bands(cp)[0].shapes) == h * w


def bytes_read(params, location):
    dataset, counters = counted_dataset(params, location)
    batch = tuple(torch.empty(1, *shape) for shape in dataset.sample_shapes())
    dataset.read_batch_into([1], batch)
    return sum(counter.bytes_read for counter in counters)


def test_the_bytes_read_fall_as_one_over_cp_and_a_whole_read_is_caught(data):
    location = str(data / "train")
    field = C * W * 4  # bytes of one image row over all channels
    whole = bytes_read(make_params(data), location)
    assert whole >= 2 * IMG[0] * field  # input and target, every row
    for cp in (2, 4):
        for band in bands(cp):
            y0, y1 = band.rows
            got = bytes_read(make_params(data, band.rows), location)
            assert got == pytest.approx(2 * (y1 - y0) * field, rel=0.02), (cp, band.rows, got)
            assert got <= whole / cp * 1.02 + 2 * 2 * PATCH * field  # 1/cp, up to a part row at each end
    # twin: a loader that read the whole field and cut its band would hand out the same tensors; the count says so
    twin = bytes_read(make_params(data, (0, IMG[0])), location)
    assert twin > 3 * bytes_read(make_params(data, bands(4)[1].rows), location)


def test_the_synthetic_loader_hands_out_the_band(data):
    from loaders.synthetic import SyntheticLoader
    params = make_params(data, bands(4)[2].rows)
    params.update({"local_batch_size": 2, "data_shard_id": 0, "data_num_shards": 1})
    inp, tar = SyntheticLoader(params, train=True).first_batch()
    y0, y1 = bands(4)[2].rows
    assert inp.shape[-2:] == (y1 - y0, IMG[1]) and tar.shape[-2:] == (y1 - y0, IMG[1])


def test_rows_outside_the_image_are_refused_in_one_line(data):
    with pytest.raises(UserError, match=r"read_rows \[20, 30\] do not lie within the 24 rows"):
        ERA5Dataset(make_params(data, [20, 30]), str(data / "train"), train=True)


def test_the_committed_benchmark_shows_the_band_read_and_its_twins_fail():
    """bench_results/band_read.json (`make bench-band-read`, 721 x 1440 files at patch 8): bytes per rank fall as
    1/cp, and the band read reaches 0.8x a raw read's GB/s; check() flags a rank that read the whole field or read
    slowly."""
    import copy
    import json

    from benchmarks.bench_band_read import check
    with open("bench_results/band_read.json") as f:
        report = json.load(f)
    rows = report["rows"]
    assert report["file_rows"] == 721 and report["img_size"] == [720, 1440]
    assert sorted({row["cp"] for row in rows}) == [1, 2, 4] and len(rows) == 7
    assert check(rows) == [] == report["failures"]
    whole = rows[0]["bytes_per_sample"]
    assert whole >= 2 * 20 * 720 * 1440 * 4
    assert all(row["bytes_per_sample"] <= whole / row["cp"] * 1.05 for row in rows)
    twin = copy.deepcopy(rows)
    twin[-1]["bytes_per_sample"] = whole  # a cp=4 rank that read the whole field
    twin[1]["ratio_to_raw"] = 0.5  # a slow band read
    assert len(check(twin)) == 2
