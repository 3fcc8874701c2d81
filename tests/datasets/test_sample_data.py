"""Tests for sample_data/era5.py: a failure here means the synthetic ERA5 files no
longer match the on-disk format the tutorials read, are not reproducible, or stopped
being learnable (no predictable dynamics beyond persistence)."""

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import numpy.testing  # noqa: F401  here, as numpy < 2.1 runs lscpu on this import: a process tests may not start
import pytest

from sample_data.common import SampleDataError
from sample_data.era5 import ERA5_CHANNELS, persistence_error, write_era5

REPO_ROOT = Path(__file__).resolve().parents[2]

SMALL = {"height": 16, "width": 32, "steps_per_year": 12, "train_years": 2, "valid_years": 1,
         "test_years": 1}
YEAR_FILES = {"train": ["2000.h5", "2001.h5"], "valid": ["2002.h5"], "test": ["2003.h5"]}


@pytest.fixture(scope="module")
def era5_dir(tmp_path_factory):
    return write_era5(tmp_path_factory.mktemp("era5") / "data", verbose=False, **SMALL)


def _read_fields(path):
    with h5py.File(path, "r") as f:
        return f["fields"][:]


def _all_file_bytes(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "sample_data", "era5", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )


def test_layout_dtype_and_shapes(era5_dir):
    """Failure: folder/file/dataset names, dtype or shapes differ from the real ERA5 files."""
    assert len(ERA5_CHANNELS) == 20 and ERA5_CHANNELS[2] == "t2m" and ERA5_CHANNELS[19] == "tcwv"
    for split, names in YEAR_FILES.items():
        assert sorted(p.name for p in (era5_dir / split).iterdir()) == names
        for name in names:
            with h5py.File(era5_dir / split / name, "r") as f:
                assert list(f.keys()) == ["fields"]
                assert f["fields"].dtype == np.float32
                assert f["fields"].shape == (12, 20, 16, 32)
    stats = era5_dir / "stats"
    assert sorted(p.name for p in stats.iterdir()) == [
        "global_means.npy", "global_stds.npy", "time_means.npy"]
    for name, shape in [("global_means", (1, 20, 1, 1)), ("global_stds", (1, 20, 1, 1)),
                        ("time_means", (1, 20, 16, 32))]:
        array = np.load(stats / f"{name}.npy")
        assert array.dtype == np.float32 and array.shape == shape, name


def test_stats_match_training_files(era5_dir):
    """Failure: stats/*.npy are not the per-channel / per-pixel stats of the train years."""
    train = np.concatenate([_read_fields(era5_dir / "train" / n) for n in YEAR_FILES["train"]])
    train = train.astype(np.float64)
    expected = {
        "global_means": train.mean(axis=(0, 2, 3), keepdims=True),
        "global_stds": train.std(axis=(0, 2, 3), keepdims=True),
        "time_means": train.mean(axis=0, keepdims=True),
    }
    for name, value in expected.items():
        np.testing.assert_allclose(np.load(era5_dir / "stats" / f"{name}.npy"), value, rtol=1e-4,
                                   err_msg=name)
    # Physical-looking units: t2m in Kelvin, z500 in m^2/s^2, humidity in percent.
    means = expected["global_means"].ravel()
    assert 250 < means[ERA5_CHANNELS.index("t2m")] < 300
    assert 4e4 < means[ERA5_CHANNELS.index("z500")] < 7e4
    r500 = train[:, ERA5_CHANNELS.index("r500")]
    assert r500.min() >= 0 and r500.max() <= 100


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    """Failure: reruns are not byte-identical (timestamps? unseeded RNG?) or seed is ignored."""
    args = {**SMALL, "train_years": 1}
    first = write_era5(tmp_path / "a", seed=3, verbose=False, **args)
    second = write_era5(tmp_path / "b", seed=3, verbose=False, **args)
    other = write_era5(tmp_path / "c", seed=4, verbose=False, **args)
    first_bytes = _all_file_bytes(first)
    assert len(first_bytes) == 6
    assert first_bytes == _all_file_bytes(second)
    other_bytes = _all_file_bytes(other)
    assert first_bytes.keys() == other_bytes.keys()
    for name in first_bytes:
        assert first_bytes[name] != other_bytes[name], name


def test_years_differ(era5_dir):
    """Failure: every year repeats the same weather (per-year phases not applied)."""
    time_means = np.load(era5_dir / "stats" / "time_means.npy")
    first = _read_fields(era5_dir / "train" / "2000.h5") - time_means
    second = _read_fields(era5_dir / "train" / "2001.h5") - time_means
    # Year-to-year differences must be as large as the anomalies themselves, not just noise.
    assert np.sqrt(np.mean((first - second) ** 2)) > 0.5 * np.sqrt(np.mean(first ** 2))


@pytest.mark.multiprocess
def test_cli_writes_then_refuses_to_overwrite(tmp_path):
    """Failure: CLI progress output, the overwrite guard (exit 2, one line) or --overwrite broke."""
    out = tmp_path / "cli"
    sizes = ["--height", "16", "--width", "32", "--steps_per_year", "8", "--train_years", "1"]
    result = _run_cli("--out", str(out), *sizes)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("[era5] train/2000.h5 (1/3)") and lines[0].endswith("MB")
    assert len(lines) == 4 and str(out) in lines[-1]
    assert (out / "test" / "2002.h5").is_file()

    refused = _run_cli("--out", str(out), *sizes)
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "--overwrite" in refused.stderr and "Traceback" not in refused.stderr

    replaced = _run_cli("--out", str(out), *sizes, "--seed", "1", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr


@pytest.mark.multiprocess
def test_cli_bad_size_exits_2(tmp_path):
    """Failure: a bad size gives a traceback or a zero exit instead of one clear error line."""
    result = _run_cli("--out", str(tmp_path / "bad"), "--height", "4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "--height" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("bad", [{"width": 7}, {"steps_per_year": 3}, {"train_years": 0},
                                 {"valid_years": 0}, {"noise": -0.1}, {"seed": -1}])
def test_bad_arguments_raise(tmp_path, bad):
    """Failure: write_era5 accepts sizes that cannot make a usable data set."""
    with pytest.raises(SampleDataError):
        write_era5(tmp_path / "bad", verbose=False, **bad)


def test_persistence_is_a_real_baseline(era5_dir):
    """Failure: fields barely change (nothing to learn) or change chaotically step to step."""
    error = persistence_error(era5_dir)
    assert 0.1 < error < 0.8
    assert persistence_error(era5_dir, dt=2) > error  # weather drifts further over 12 h


def test_t2m_diurnal_patch_moves_a_quarter_turn_per_step(era5_dir):
    """Failure: the t2m diurnal cycle is missing or not deterministic (sun must move 90 deg west / 6 h).

    The diurnal patch is the part of t2m that no other channel explains, so take the
    residual of a linear fit of t2m on the other (unclipped) channels and check that it
    moves W/4 columns west per step.
    """
    fields = _read_fields(era5_dir / "valid" / "2002.h5").astype(np.float64)
    n_steps, _, _, width = fields.shape
    t2m = ERA5_CHANNELS.index("t2m")
    clipped = [ERA5_CHANNELS.index(name) for name in ("r500", "r850", "tcwv")]
    others = [c for c in range(len(ERA5_CHANNELS)) if c != t2m and c not in clipped]
    regressors = fields[:, others].transpose(0, 2, 3, 1).reshape(-1, len(others))
    regressors = np.column_stack([regressors, np.ones(len(regressors))])
    target = fields[:, t2m].ravel()
    coefficients, *_ = np.linalg.lstsq(regressors, target, rcond=None)
    diurnal = (target - regressors @ coefficients).reshape(n_steps, -1, width)

    def correlation(a, b):
        return np.corrcoef(a.ravel(), b.ravel())[0, 1]

    moved = [correlation(diurnal[t + 1], np.roll(diurnal[t], -width // 4, axis=-1))
             for t in range(n_steps - 1)]
    unmoved = [correlation(diurnal[t + 1], diurnal[t]) for t in range(n_steps - 1)]
    assert min(moved) > 0.9
    assert max(np.abs(unmoved)) < 0.3
