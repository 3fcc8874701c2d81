"""ERA5 at its full 0.25-degree grid (721 x 1440): the generator writes it, says its disk use first and its progress as
it goes (4 steps a year unless told), refuses a data set its file system cannot hold, and the loader reads the first
720 rows of it, as the 0.25-degree configs (`wfm_*`, img_size [720, 1440]) ask.

The odd-height crop is checked on small files here (17 x 32 read as 16 x 32) and at the real size in the long tier
(about 1 GB of files). A failure points to sample_data/era5.py (its defaults, announcements or disk check) or to
loaders/era5.py (how img_size crops a file).
"""
import h5py
import numpy as np
import pytest

from lifecycle.cli import apply_overrides, training_parser
from loaders.era5 import era5_dataset
from sample_data.__main__ import main as sample_data_main
from sample_data.era5 import FULL_GRID, FULL_GRID_STEPS, REAL_YEAR_STEPS, era5_bytes, write_era5
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")
ERA5_STEP_BYTES = 20 * 721 * 1440 * 4  # one time step of ERA5's 20 channels at 0.25 degrees, float32


def dataset_of(config, data_dir, **changes):
    """The validation ERA5Dataset of a config of config/ViT.yaml on `data_dir`."""
    params = YParams("config/ViT.yaml", config)
    apply_overrides(params, training_parser("t").parse_args(["--data_dir", str(data_dir)]), dp_size=1, dp_rank=0)
    params.update(changes)
    return era5_dataset(params, train=False)


def normalised(data_dir, year_file, step, rows, columns):
    """Time step `step` of a validation year file, its first rows and columns, normalised as the loader does."""
    means = np.load(data_dir / "stats" / "global_means.npy")[0]
    stds = np.load(data_dir / "stats" / "global_stds.npy")[0]
    with h5py.File(data_dir / "valid" / year_file, "r") as f:
        return (f["fields"][step, :, :rows, :columns] - means) / stds


def check_crop(dataset, data_dir, year_file, rows, columns):
    """Every validation sample's input and target are the file's first rows (the last row, the South Pole's, left
    out), bitwise as the per-sample path reads them; the twin: the file's last rows are not what was read."""
    inp, tar = dataset.__getitems__(list(range(len(dataset))))
    assert tuple(inp.shape[1:]) == (20, rows, columns)
    for index in range(len(dataset)):
        _, step = dataset.position(index)
        assert np.array_equal(inp[index].numpy(), normalised(data_dir, year_file, step, rows, columns))
        assert np.array_equal(tar[index].numpy(), normalised(data_dir, year_file, step + 1, rows, columns))
        single = dataset[index]
        assert np.array_equal(single[0].numpy(), inp[index].numpy())
    with h5py.File(data_dir / "valid" / year_file, "r") as f:
        _, step = dataset.position(0)
        south = (f["fields"][step, :, 1:, :columns] - np.load(data_dir / "stats" / "global_means.npy")[0]) / \
            np.load(data_dir / "stats" / "global_stds.npy")[0]
    assert not np.array_equal(inp[0].numpy(), south)


def test_an_odd_height_is_read_as_its_first_rows(tmp_path):
    data_dir = write_era5(tmp_path / "era5", height=17, width=32, steps_per_year=4, train_years=1, verbose=False)
    with h5py.File(data_dir / "valid" / "2001.h5", "r") as f:
        assert f["fields"].shape == (4, 20, 17, 32)
    dataset = dataset_of("wfm_tiny", data_dir, img_size=[16, 32])
    check_crop(dataset, data_dir, "2001.h5", 16, 32)


def test_the_full_grid_defaults_to_a_few_steps_and_a_real_year_is_121_gb():
    assert FULL_GRID == (721, 1440) and FULL_GRID_STEPS == 4
    assert era5_bytes(721, 1440, REAL_YEAR_STEPS, 1) == (REAL_YEAR_STEPS + 1) * ERA5_STEP_BYTES
    assert round(REAL_YEAR_STEPS * ERA5_STEP_BYTES / 1e9) == 121


def test_a_data_set_the_disk_cannot_hold_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """The full grid's default (4 steps a year, 4 years: 1.41 GB) against a file system with 1 GB free: exit 2, one
    line that names the need, the free space and what to do, nothing written. The twin: with 2 GB free it goes on
    to announce the default and the disk use, then to write (stopped here at the first file)."""
    import shutil
    import types

    import sample_data.era5
    free = {"bytes": 10 ** 9}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=10 ** 12, used=0,
                                                                                 free=free["bytes"]))
    out = tmp_path / "full"
    assert sample_data_main(["era5", "--out", str(out), "--height", "721", "--width", "1440"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
    assert "4 year files of 4 steps at 721 x 1440 need 1.41 GB" in captured.err and "1.00 GB free" in captured.err
    assert "--steps_per_year" in captured.err and not out.exists()

    free["bytes"] = 2 * 10 ** 9

    def first_file(path):
        raise RuntimeError(f"writing {path}")
    monkeypatch.setattr(sample_data.era5, "atomic_path", first_file)
    with pytest.raises(RuntimeError, match="writing .*train/2000.h5"):
        sample_data_main(["era5", "--out", str(out), "--height", "721", "--width", "1440"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "4 time steps a year by default" in lines[0] and "2.0 GB free" in lines[1], lines


@pytest.mark.long
def test_the_full_grid_is_written_announced_and_read_as_720_rows(tmp_path, capsys):
    """721 x 1440 with the default steps (4 a year), one year per split: the files, the stats, the announcement of
    the default and of the disk use before any file, a progress line per step and per file, then wfm_p8's loader
    reading 720 x 1440 of each step."""
    out = tmp_path / "full"
    command = ["era5", "--out", str(out), "--height", "721", "--width", "1440", "--train_years", "1"]
    assert sample_data_main(command) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("[era5] 721 x 1440 is ERA5's full 0.25-degree grid: 4 time steps a year by default")
    assert "about 121 GB" in lines[0]
    assert lines[1].startswith("[era5] writing 3 year files of 4 steps x 20 x 721 x 1440 float32 (83.1 MB a step)")
    assert f"{era5_bytes(721, 1440, 4, 3) / 1e9:.2f} GB in {out}" in lines[1] and "GB free" in lines[1]
    assert lines[2].startswith("[era5]   train/2000.h5: 1/4 steps (83 MB)")
    assert lines[6].startswith("[era5] train/2000.h5 (1/3) 332.2 MB") and len(lines) == 2 + 3 * 5 + 1
    for split, year in (("train", 2000), ("valid", 2001), ("test", 2002)):
        with h5py.File(out / split / f"{year}.h5", "r") as f:
            assert f["fields"].shape == (4, 20, 721, 1440) and f["fields"].dtype == np.float32
    assert np.load(out / "stats" / "time_means.npy").shape == (1, 20, 721, 1440)
    assert np.load(out / "stats" / "global_stds.npy").shape == (1, 20, 1, 1)

    dataset = dataset_of("wfm_p8", out)
    assert (dataset.img_h, dataset.img_w) == (720, 1440)
    check_crop(dataset, out, "2001.h5", 720, 1440)
