"""ERA5 dataset: pairing, boundary rule, normalisation, limits, bad files. Failures point to loaders/era5.py."""
import h5py
import numpy as np
import numpy.testing  # noqa: F401  here, as numpy < 2.1 runs lscpu on this import: a process tests may not start
import pytest
import torch

from loaders.common import ResumableSampler
from loaders.era5 import ERA5Dataset
from utils.errors import UserError
from utils.YParams import YParams

T, C, H, W = 10, 20, 8, 16


def write_year(path, year_offset, channels=C, name="fields"):
    """fields[t, c] = 1000 * year_offset + 10 * t + c/100, constant over the image: values say where they came from."""
    t = np.arange(T, dtype=np.float32)[:, None, None, None]
    c = np.arange(channels, dtype=np.float32)[None, :, None, None] / 100
    fields = np.broadcast_to(1000 * year_offset + 10 * t + c, (T, channels, H, W)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=fields)


@pytest.fixture
def data(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "stats").mkdir()
    for offset, year in enumerate((1990, 1991)):
        write_year(tmp_path / "train" / f"{year}.h5", offset)
    np.save(tmp_path / "stats" / "global_means.npy", np.full((1, C, 1, 1), 5.0, np.float32))
    np.save(tmp_path / "stats" / "global_stds.npy", np.full((1, C, 1, 1), 2.0, np.float32))
    return tmp_path


def make_params(data, **changes):
    params = YParams("config/ViT.yaml", "tiny")
    params.update({"img_size": [H, W], "global_means_path": str(data / "stats/global_means.npy"),
                   "global_stds_path": str(data / "stats/global_stds.npy"), "limit_nsamples": None, **changes})
    return params


def unnormalised(tensor):
    return tensor.numpy() * 2.0 + 5.0


def test_pairs_dt_apart_inside_a_year_with_the_boundary_rule(data):
    dataset = ERA5Dataset(make_params(data, dt=2), str(data / "train"), train=True)
    assert len(dataset) == 2 * T
    for global_idx in range(2 * T):
        inp, tar = dataset[global_idx]
        year, local = divmod(global_idx, T)
        local = local % (T - 2)
        local = local + 2 if local < 2 else local
        assert inp.shape == (C, H, W)
        np.testing.assert_allclose(unnormalised(inp)[:, 0, 0], 1000 * year + 10 * local + np.arange(C) / 100,
                                   rtol=1e-5)
        np.testing.assert_allclose(unnormalised(tar) - unnormalised(inp), 20.0, atol=1e-2)  # dt = 2 steps


def test_normalisation_uses_global_stats(data):
    inp, _ = ERA5Dataset(make_params(data), str(data / "train"), train=True)[3]
    np.testing.assert_allclose(inp.numpy()[0, 0, 0], (10 * 3 - 5.0) / 2.0, rtol=1e-6)


def test_limit_nsamples_takes_the_first_indices(data):
    train = ERA5Dataset(make_params(data, limit_nsamples=7), str(data / "train"), train=True)
    valid = ERA5Dataset(make_params(data, limit_nsamples=7, limit_nsamples_val=3), str(data / "train"), train=False)
    assert (len(train), len(valid)) == (7, 3)


def test_image_is_cropped_to_img_size(data):
    inp, _ = ERA5Dataset(make_params(data, img_size=[4, 8]), str(data / "train"), train=True)[1]
    assert inp.shape == (C, 4, 8)


def test_resumable_sampler_skips_within_an_epoch():
    sampler = ResumableSampler(range(40), num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True)
    sampler.set_epoch(5)
    full = list(sampler)
    sampler.set_epoch(5, skip=6)
    assert list(sampler) == full[6:]
    sampler.set_epoch(6)
    assert list(sampler) != full and len(list(sampler)) == 20


@pytest.mark.parametrize("case, message", [
    ("missing_dir", "does not exist; generate sample data"),
    ("empty_dir", "holds no .h5 files; generate sample data"),
    ("no_fields", "has no dataset 'fields'"),
    ("wrong_channels", r"has fields of shape \(10, 19, 8, 16\); expected \(T, 20, H, W\)"),
    ("bad_stats", r"has shape \(1, 19, 1, 1\), expected \(1, 20, 1, 1\)"),
    ("too_small", "smaller than img_size 16 x 16"),
])
def test_bad_data_is_named(data, case, message):
    location, params = data / "train", make_params(data)
    if case == "missing_dir":
        location = data / "nowhere"
    elif case == "empty_dir":
        location = data / "stats"
    elif case == "no_fields":
        write_year(data / "train" / "1992.h5", 2, name="other")
    elif case == "wrong_channels":
        write_year(data / "train" / "1992.h5", 2, channels=19)
    elif case == "bad_stats":
        np.save(data / "stats" / "global_stds.npy", np.ones((1, 19, 1, 1), np.float32))
    elif case == "too_small":
        params = make_params(data, img_size=[16, 16])
    with pytest.raises(UserError, match=message):
        ERA5Dataset(params, str(location), train=True)


def test_files_open_lazily(data):
    dataset = ERA5Dataset(make_params(data), str(data / "train"), train=True)
    assert dataset.files == [None, None]  # nothing open to be inherited by forked workers
    dataset[T + 3]
    assert dataset.files[0] is None and dataset.files[1] is not None
    assert torch.is_tensor(dataset[0][0])


def test_whole_batch_read_equals_the_per_sample_path_bitwise(data):
    """__getitems__ reads a batch into one buffer and normalises in place; it must return exactly the stacked
    per-sample items (which normalise with temporaries): a difference would be a silent change of the data."""
    dataset = ERA5Dataset(make_params(data), str(data / "train"), train=True)
    indices = [5, 0, 17, 3, len(dataset) - 1]
    inp, tar = dataset.__getitems__(indices)
    assert inp.shape == (5, dataset.n_channels, dataset.img_h, dataset.img_w) and inp.dtype == torch.float32
    assert torch.equal(inp, torch.stack([dataset[i][0] for i in indices]))
    assert torch.equal(tar, torch.stack([dataset[i][1] for i in indices]))
    assert not torch.equal(inp[0], inp[1])  # different samples (the comparison can fail)


def test_bench_loader_reports_every_loader_against_the_raw_rate(tmp_path):
    import json

    from benchmarks import bench_loader
    out = tmp_path / "loader.json"
    assert bench_loader.main(["--data_dir", str(tmp_path / "era5"), "--height", "16", "--width", "32", "--nbatches",
                              "2", "--warmup", "1", "--workers", "0", "--before_workers", "0", "--out", str(out)]) == 0
    rows = {row["loader"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"raw h5py (1 thread)", "per-sample (the loader before), 0 workers", "PyTorch, 0 workers",
                         "DALI, 0 workers"}
    assert all(row["samples_per_sec"] > 0 for row in rows.values())
    assert all(set(row["per_batch"]) == {"user_ms", "system_ms", "page_faults"} for row in rows.values())
    assert rows["PyTorch, 0 workers"]["ratio_to_raw"] == pytest.approx(
        rows["PyTorch, 0 workers"]["samples_per_sec"] / rows["raw h5py (1 thread)"]["samples_per_sec"])
