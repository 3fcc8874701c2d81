"""Synthetic ERA5 data: HDF5 year files (train/valid/test) + stats, in the layout the ViT tutorial reads.

`python -m sample_data era5 --out DIR` writes the files; `persistence_error` is the baseline a trained
model has to beat. Any grid works, ERA5's full 0.25-degree one (721 x 1440, both poles) included: the files are
written a few time steps at a time, so memory stays at about 1 GB there; a data set of a GB or more is announced
first (its size and the free space of its file system) and reported as it goes.
"""
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from sample_data.common import SampleDataError
from utils.atomic import atomic_path

# FourCastNet channel order of the real ERA5 files (index = channel in `fields`).
ERA5_CHANNELS = [
    "u10", "v10", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850",
    "v850", "z850", "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv",
]

# Per channel: (global mean, anomaly std, equator-minus-pole difference), in the
# variable's real units, so the files look like the real ones after loading.
_ERA5_UNITS = {
    "u10": (0.5, 5.0, -6.0),
    "v10": (0.2, 4.0, 0.0),
    "t2m": (278.0, 5.0, 45.0),
    "sp": (96_500.0, 1_500.0, 1_500.0),
    "msl": (101_100.0, 1_000.0, 0.0),
    "t850": (274.0, 4.0, 35.0),
    "u1000": (0.5, 6.0, -6.0),
    "v1000": (0.2, 5.0, 0.0),
    "z1000": (900.0, 800.0, 0.0),
    "u850": (1.5, 7.0, -8.0),
    "v850": (0.2, 5.0, 0.0),
    "z850": (13_800.0, 700.0, 1_000.0),
    "u500": (6.0, 10.0, -14.0),
    "v500": (0.0, 8.0, 0.0),
    "z500": (55_500.0, 1_500.0, 6_000.0),
    "t500": (253.0, 4.0, 25.0),
    "z50": (201_000.0, 2_500.0, 8_000.0),
    "r500": (50.0, 15.0, 10.0),
    "r850": (70.0, 12.0, 10.0),
    "tcwv": (25.0, 5.0, 36.0),
}
# Physical bounds; values are clipped after the noise is added.
_ERA5_BOUNDS = {"r500": (0.0, 100.0), "r850": (0.0, 100.0), "tcwv": (0.0, None)}

ERA5_SPLITS = ("train", "valid", "test")
ERA5_STATS = ("global_means.npy", "global_stds.npy", "time_means.npy")
T2M = ERA5_CHANNELS.index("t2m")
DIURNAL_AMPLITUDE_K = 6.0
N_LATENT_FIELDS = 5
# Keep one generated time chunk (float64, all channels) at about 32 MB.
_CHUNK_VALUES = 4_000_000
# ERA5's full 0.25-degree grid (90 to -90 degrees in 721 rows, 1440 columns): one time step is 83 MB of float32,
# a real year (REAL_YEAR_STEPS) about 121 GB, so without --steps_per_year it gets FULL_GRID_STEPS steps a year.
FULL_GRID = (721, 1440)
FULL_GRID_STEPS = 4
DEFAULT_STEPS = 128
REAL_YEAR_STEPS = 1460  # 6-hourly steps in a 365-day year
# A data set this large (bytes) or larger is announced before writing and reported step batch by step batch.
_ANNOUNCE_BYTES = 1e9


@dataclass
class _Wave:
    """One zonal wave A(lat) * cos(k * (lon - speed(lat) * t) + phase) of a latent field."""

    latent: int  # which latent field it belongs to
    k: int  # zonal wavenumber
    amplitude: float
    band_center_deg: float  # latitude where the wave is strongest
    band_width_deg: float
    speed_cells: float  # mean speed in grid cells per step (sign = direction)
    speed_shear: float  # speed change towards the poles, cells per step
    season_phase: float  # when in the year the wave is strongest


def _era5_structure(seed):
    """Seed-fixed waves and channel mix, shared by all years (so dynamics are the same)."""
    rng = np.random.default_rng([seed, 0, 0])
    waves = []
    for latent in range(N_LATENT_FIELDS):
        n_waves = int(rng.integers(2, 4))
        for k in rng.choice(np.arange(1, 5), size=n_waves, replace=False):
            eastward = rng.random() < 0.75  # mid-latitude weather mostly moves east
            waves.append(_Wave(
                latent=latent,
                k=int(k),
                amplitude=float(rng.uniform(0.5, 1.0)),
                band_center_deg=float(rng.uniform(-60.0, 60.0)),
                band_width_deg=float(rng.uniform(20.0, 40.0)),
                speed_cells=float(rng.uniform(0.9, 1.4)) * (1.0 if eastward else -1.0),
                speed_shear=float(rng.uniform(-0.4, 0.4)),
                season_phase=float(rng.uniform(0.0, 2 * np.pi)),
            ))
    # Scale each latent field to unit rms (measured on a fixed 1-degree grid,
    # so the amplitudes do not depend on the output resolution).
    fine_lat = np.deg2rad(np.linspace(90.0, -90.0, 181))
    for latent in range(N_LATENT_FIELDS):
        members = [w for w in waves if w.latent == latent]
        variance = sum(0.5 * _band(w, fine_lat) ** 2 for w in members)
        rms = float(np.sqrt(variance.mean()))
        for w in members:
            w.amplitude /= rms
    mix = rng.standard_normal((len(ERA5_CHANNELS), N_LATENT_FIELDS))
    mix /= np.linalg.norm(mix, axis=1, keepdims=True)  # unit-variance channel anomalies
    return waves, mix


def _band(wave, lat):
    """Latitude profile of a wave: a smooth band that fades out at the poles."""
    band_center = np.deg2rad(wave.band_center_deg)
    band_width = np.deg2rad(wave.band_width_deg)
    return wave.amplitude * np.cos(lat) * np.exp(-(((lat - band_center) / band_width) ** 2))


def _era5_chunk(waves, mix, phases, steps, steps_per_year, lat, lon):
    """Noise-free fields for the given time steps, float64 (len(steps), 20, H, W)."""
    width = lon.size
    year_fraction = steps / steps_per_year  # (n,)
    season = 2 * np.pi * year_fraction
    radians_per_cell = 2 * np.pi / width

    latents = np.zeros((N_LATENT_FIELDS, steps.size, lat.size, width))
    for wave, phase in zip(waves, phases):
        # Speed in cells per step, so motion looks the same at every resolution.
        speed = (wave.speed_cells + wave.speed_shear * np.cos(2 * lat)) * radians_per_cell
        shift = speed[None, :, None] * steps[:, None, None]  # (n, H, 1) radians of lon
        seasonal = 1.0 + 0.3 * np.cos(season - wave.season_phase)  # (n,)
        amplitude = seasonal[:, None, None] * _band(wave, lat)[None, :, None]
        latents[wave.latent] += amplitude * np.cos(wave.k * (lon[None, None, :] - shift) + phase)

    anomaly_std = np.array([_ERA5_UNITS[name][1] for name in ERA5_CHANNELS])
    fields = np.einsum("cl,lthw->tchw", mix * anomaly_std[:, None], latents)

    # Climatology: equator-to-pole gradient that tilts towards the summer hemisphere.
    channel_mean = np.array([_ERA5_UNITS[name][0] for name in ERA5_CHANNELS])
    equator_minus_pole = np.array([_ERA5_UNITS[name][2] for name in ERA5_CHANNELS])
    profile = (np.cos(lat) ** 2 - 0.5)[None, :] - 0.25 * np.sin(lat)[None, :] * np.cos(season)[:, None]
    fields += channel_mean[None, :, None, None]
    fields += equator_minus_pole[None, :, None, None] * profile[:, None, :, None]

    # Diurnal warm patch under the sun; the sub-solar point moves 90 deg west per
    # 6-hour step (180 deg E at 00 UTC), so the field itself tells the time of day.
    sun_lon = np.pi - 0.5 * np.pi * steps
    fields[:, T2M] += (
        DIURNAL_AMPLITUDE_K
        * np.cos(lat)[None, :, None]
        * np.cos(lon[None, None, :] - sun_lon[:, None, None])
    )
    return fields


def _check_era5_args(height, width, steps_per_year, train_years, valid_years,
                     test_years, first_year, seed, noise):
    minimum = {
        "height": (height, 8), "width": (width, 8), "steps_per_year": (steps_per_year, 4),
        "train_years": (train_years, 1), "valid_years": (valid_years, 1),
        "test_years": (test_years, 1), "first_year": (first_year, 0), "seed": (seed, 0),
    }
    for name, (value, smallest) in minimum.items():
        if value < smallest:
            raise SampleDataError(f"--{name} must be >= {smallest}, got {value}")
    if not noise >= 0:
        raise SampleDataError(f"--noise must be >= 0, got {noise}")


def default_steps_per_year(height, width):
    """Time steps a year when none are asked for: FULL_GRID_STEPS on the full 0.25-degree grid, else DEFAULT_STEPS."""
    return FULL_GRID_STEPS if (height, width) == FULL_GRID else DEFAULT_STEPS


def era5_bytes(height, width, steps_per_year, years):
    """Bytes of the data set on disk: `years` files of (steps, 20, height, width) float32 and the stats (HDF5's
    and .npy's headers, a few KB, left out)."""
    return (years * steps_per_year + 1) * _step_bytes(height, width)  # time_means.npy is one step's worth


def _step_bytes(height, width):
    return len(ERA5_CHANNELS) * height * width * 4


def _existing_folder(path):
    """`path`, or its nearest ancestor that exists (where the data set's file system can be asked about)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _reclaimed_bytes(out_dir):
    """Bytes of the data set an --overwrite is about to remove from out_dir."""
    return sum(f.stat().st_size for sub in (*ERA5_SPLITS, "stats") for f in (out_dir / sub).rglob("*") if f.is_file())


def _holds_era5(out_dir):
    return all((out_dir / split).is_dir() for split in ERA5_SPLITS) and all(
        (out_dir / "stats" / name).is_file() for name in ERA5_STATS
    )


def _save_npy(path, array):
    """np.save, atomically: a crash never leaves a half-written file."""
    with atomic_path(path) as tmp_path, open(tmp_path, "wb") as f:
        np.save(f, array)


def write_era5(out_dir, height=32, width=64, steps_per_year=None, train_years=2,
               valid_years=1, test_years=1, first_year=2000, seed=0, noise=0.01,
               overwrite=False, verbose=True):
    """Write a synthetic ERA5 data set (train/valid/test year files + stats) to out_dir.

    Each `<split>/<year>.h5` holds one float32 dataset `fields` of shape
    (steps_per_year, 20, height, width), channels in ERA5_CHANNELS order;
    steps_per_year defaults to 128, and to 4 on the full 0.25-degree grid
    (721 x 1440, 83 MB a step). `stats/` holds global_means/global_stds
    (1, 20, 1, 1) and time_means (1, 20, H, W), computed over the training years.
    Raises SampleDataError on bad sizes, if out_dir already holds a data set and
    overwrite is False, or if its file system has too little free space.
    Returns out_dir as a Path.
    """
    defaulted = steps_per_year is None
    if defaulted:
        steps_per_year = default_steps_per_year(height, width)
    _check_era5_args(height, width, steps_per_year, train_years, valid_years,
                     test_years, first_year, seed, noise)
    out_dir = Path(out_dir)
    n_years = train_years + valid_years + test_years
    planned = era5_bytes(height, width, steps_per_year, n_years)
    holds = _holds_era5(out_dir)
    if holds and not overwrite:
        raise SampleDataError(
            f"{out_dir} already holds ERA5 sample data; pass --overwrite to replace it"
        )
    folder = _existing_folder(out_dir)
    free = shutil.disk_usage(folder).free
    reclaimed = _reclaimed_bytes(out_dir) if holds else 0
    if planned > free + reclaimed:
        replaced = f" (and {reclaimed / 1e9:.2f} GB that --overwrite replaces)" if reclaimed else ""
        raise SampleDataError(
            f"{n_years} year files of {steps_per_year} steps at {height} x {width} need {planned / 1e9:.2f} GB, but "
            f"{folder}'s file system has {free / 1e9:.2f} GB free{replaced}; free space, choose another --out, or "
            "write fewer --steps_per_year or years"
        )
    announce = verbose and planned >= _ANNOUNCE_BYTES
    step_mb = _step_bytes(height, width) / 1e6
    if verbose and defaulted and (height, width) == FULL_GRID:
        print(f"[era5] {height} x {width} is ERA5's full 0.25-degree grid: {steps_per_year} time steps a year by "
              f"default (a real year is {REAL_YEAR_STEPS} steps, about "
              f"{era5_bytes(height, width, REAL_YEAR_STEPS, 1) / 1e9:.0f} GB; set --steps_per_year N)", flush=True)
    if announce:
        print(f"[era5] writing {n_years} year files of {steps_per_year} steps x {len(ERA5_CHANNELS)} x {height} x "
              f"{width} float32 ({step_mb:.1f} MB a step) and the stats: {planned / 1e9:.2f} GB in {out_dir}, "
              f"whose file system has {free / 1e9:.1f} GB free", flush=True)
    if holds:
        for sub in (*ERA5_SPLITS, "stats"):  # drop old year files that would not be rewritten
            shutil.rmtree(out_dir / sub, ignore_errors=True)

    n_channels = len(ERA5_CHANNELS)
    lat = np.deg2rad(np.linspace(90.0, -90.0, height))  # row 0 = North Pole
    lon = np.deg2rad(np.arange(width) * 360.0 / width)
    waves, mix = _era5_structure(seed)
    anomaly_std = np.array([_ERA5_UNITS[name][1] for name in ERA5_CHANNELS])
    bounds = [(ERA5_CHANNELS.index(name), low, high) for name, (low, high) in _ERA5_BOUNDS.items()]
    chunk_steps = max(1, _CHUNK_VALUES // (n_channels * height * width))

    years = first_year + np.arange(train_years + valid_years + test_years)
    split_of_year = ["train"] * train_years + ["valid"] * valid_years + ["test"] * test_years

    # Running float64 sums over training data; shifted by a reference value per
    # channel so the variance does not suffer from cancellation (z50 ~ 2e5).
    shift = None
    channel_sum = np.zeros(n_channels)
    channel_sum_sq = np.zeros(n_channels)
    pixel_sum = np.zeros((n_channels, height, width))
    train_steps = 0

    start_time = time.perf_counter()
    for file_index, (year, split) in enumerate(zip(years.tolist(), split_of_year)):
        (out_dir / split).mkdir(parents=True, exist_ok=True)
        path = out_dir / split / f"{year}.h5"
        # Per-year wave phases and noise: years differ, but reruns are identical.
        phases = np.random.default_rng([seed, 1, year]).uniform(0, 2 * np.pi, size=len(waves))
        noise_rng = np.random.default_rng([seed, 2, year])

        # track_order/track_times off: no creation timestamps -> byte-identical reruns.
        with atomic_path(path) as tmp_path, h5py.File(tmp_path, "w", track_order=False) as f:
            dataset = f.create_dataset(
                "fields", shape=(steps_per_year, n_channels, height, width),
                dtype="float32", track_times=False,
            )
            reported = 0  # tenths of the file reported so far
            for first_step in range(0, steps_per_year, chunk_steps):
                steps = np.arange(first_step, min(first_step + chunk_steps, steps_per_year))
                chunk = _era5_chunk(waves, mix, phases, steps.astype(np.float64),
                                    steps_per_year, lat, lon)
                if noise > 0:
                    chunk += (noise * anomaly_std)[None, :, None, None] * noise_rng.standard_normal(chunk.shape)
                for channel, low, high in bounds:
                    np.clip(chunk[:, channel], low, high, out=chunk[:, channel])
                chunk = chunk.astype(np.float32)
                dataset[steps[0]:steps[-1] + 1] = chunk

                if split == "train":
                    values = chunk.astype(np.float64)
                    if shift is None:
                        shift = values.mean(axis=(0, 2, 3))
                    centred = values - shift[None, :, None, None]
                    channel_sum += centred.sum(axis=(0, 2, 3))
                    channel_sum_sq += (centred ** 2).sum(axis=(0, 2, 3))
                    pixel_sum += values.sum(axis=0)
                    train_steps += steps.size
                done = steps[-1] + 1
                if announce and 10 * done // steps_per_year > reported:
                    reported = 10 * done // steps_per_year
                    print(f"[era5]   {split}/{year}.h5: {done}/{steps_per_year} steps "
                          f"({done * step_mb:,.0f} MB), {time.perf_counter() - start_time:.1f} s", flush=True)
        if verbose:
            size_mb = path.stat().st_size / 1e6
            print(f"[era5] {split}/{year}.h5 ({file_index + 1}/{years.size}) {size_mb:.1f} MB", flush=True)

    n_values = train_steps * height * width
    centred_mean = channel_sum / n_values
    global_means = shift + centred_mean
    global_stds = np.sqrt(np.maximum(channel_sum_sq / n_values - centred_mean ** 2, 0.0))
    time_means = pixel_sum / train_steps

    (out_dir / "stats").mkdir(parents=True, exist_ok=True)
    _save_npy(out_dir / "stats" / "global_means.npy",
              global_means.reshape(1, n_channels, 1, 1).astype(np.float32))
    _save_npy(out_dir / "stats" / "global_stds.npy",
              global_stds.reshape(1, n_channels, 1, 1).astype(np.float32))
    _save_npy(out_dir / "stats" / "time_means.npy",
              time_means[None].astype(np.float32))
    if verbose:
        elapsed = time.perf_counter() - start_time
        print(f"[era5] wrote {years.size} year files + stats to {out_dir} in {elapsed:.1f} s", flush=True)
    return out_dir


def persistence_error(data_dir, split="valid", dt=1, img_size=None):
    """Mean relative L2 error of persistence, x(t+dt) predicted by x(t).

    Works in normalised units (x - global_mean) / global_std from data_dir/stats;
    per pair the error is ||x(t+dt) - x(t)|| / ||x(t+dt)|| over all channels and
    pixels, averaged over every (t, t+dt) pair inside each year file of `split`.
    With img_size (rows, columns), only the first rows and columns count, as the
    loader reads them (a config's img_size: 720 x 1440 of a 721 x 1440 file).
    A trained model should beat this number.
    """
    rows, columns = (None, None) if img_size is None else img_size
    data_dir = Path(data_dir)
    means = np.load(data_dir / "stats" / "global_means.npy").astype(np.float64)
    stds = np.load(data_dir / "stats" / "global_stds.npy").astype(np.float64)
    files = sorted((data_dir / split).glob("*.h5"))
    if not files:
        raise FileNotFoundError(f"no .h5 files in {data_dir / split}")

    errors = []
    for path in files:
        with h5py.File(path, "r") as f:
            fields = f["fields"]
            n_steps = fields.shape[0]
            per_step = int(np.prod(fields.shape[1:]))
            chunk_steps = max(1, _CHUNK_VALUES // per_step)
            # Read overlapping blocks so memory stays bounded for full-size years.
            for first in range(0, n_steps - dt, chunk_steps):
                last = min(first + chunk_steps, n_steps - dt)  # exclusive, pairs start here
                block = (fields[first:last + dt, :, :rows, :columns].astype(np.float64) - means) / stds
                now, later = block[:-dt], block[dt:]
                diff_norm = np.sqrt(((later - now) ** 2).sum(axis=(1, 2, 3)))
                target_norm = np.sqrt((later ** 2).sum(axis=(1, 2, 3)))
                errors.append(diff_norm / target_norm)
    if not errors:
        raise ValueError(f"year files in {data_dir / split} have <= {dt} time steps")
    return float(np.concatenate(errors).mean())


def _run_era5(args):
    write_era5(
        args.out, height=args.height, width=args.width, steps_per_year=args.steps_per_year,
        train_years=args.train_years, valid_years=args.valid_years, test_years=args.test_years,
        first_year=args.first_year, seed=args.seed, noise=args.noise, overwrite=args.overwrite,
    )
    return 0


def add_era5_parser(subparsers):
    """Register the `era5` subcommand."""
    parser = subparsers.add_parser(
        "era5", help="synthetic ERA5 year files (train/valid/test/*.h5) + stats",
        description="Write ERA5-like HDF5 year files with learnable, weather-like dynamics. "
                    "Cluster size: --height 360 --width 720 --steps_per_year 1460 (30 GB a year). "
                    "ERA5's full 0.25-degree grid: --height 721 --width 1440 (83 MB a step; a real year of "
                    "1460 steps of 20 x 721 x 1440 float32 is about 121 GB), 4 steps a year unless "
                    "--steps_per_year says otherwise. A data set of 1 GB or more is announced (its size and "
                    "the free space) and reported as it is written; one that does not fit is refused.",
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--height", type=int, default=32, help="latitude rows, +90..-90 (default 32)")
    parser.add_argument("--width", type=int, default=64, help="longitude columns (default 64)")
    parser.add_argument("--steps_per_year", type=int, default=None,
                        help="6-hourly steps per file (default 128; 4 at 721 x 1440, where a real year's 1460 "
                             "steps are about 121 GB)")
    parser.add_argument("--train_years", type=int, default=2)
    parser.add_argument("--valid_years", type=int, default=1)
    parser.add_argument("--test_years", type=int, default=1)
    parser.add_argument("--first_year", type=int, default=2000, help="train years come first, then valid, then test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.01, help="noise std relative to each channel's std")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing data set in --out")
    parser.set_defaults(run=_run_era5)
