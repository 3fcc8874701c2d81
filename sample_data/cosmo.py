"""Sample cosmology boxes in the sc21 tutorial's on-disk layout (N-body input -> hydro target).

`python -m sample_data cosmo --out DIR` writes DIR/downsamp_2048crop_train.h5 and
DIR/downsamp_1024crop_valid.h5, each with float32 datasets "Nbody" (4, L, L, L) and "Hydro" (5, L, L, L),
plus the channels-last .npy copies the DALI loader reads.

The content is a toy universe, small enough to generate in seconds and learnable: a Gaussian random field with
a power-law spectrum on a periodic box gives the log dark-matter density and, through Poisson's equation, the
velocities (v = -grad phi). The hydro fields are smooth nonlinear functions of the N-body fields near each
voxel: gas density follows the smoothed dark matter with a saturating bias, temperature follows the gas
density (an equation of state plus shock heating), and the gas moves with the smoothed dark-matter flow,
slowed in dense regions. All values lie in about [-1, 1] because the UNet ends in a tanh.
"""
import time
from pathlib import Path

import h5py
import numpy as np

from sample_data.common import SampleDataError
from utils.atomic import atomic_path

TRAIN_FILE = "downsamp_2048crop_train.h5"
VALID_FILE = "downsamp_1024crop_valid.h5"
NBODY_CHANNELS = ("dm_log_density", "dm_vx", "dm_vy", "dm_vz")
HYDRO_CHANNELS = ("gas_log_density", "temperature", "gas_vx", "gas_vy", "gas_vz")
MIN_EDGE = 16

# Spectrum P(k) ~ k^n exp(-(k r)^2), k in radians per voxel: the same structure per voxel at every box size.
SPECTRAL_INDEX = -1.0
CUTOFF_VOXELS = 1.5  # no structure below a few voxels, so a crop holds many resolved features
LOG_DENSITY_STD = 1.5  # lognormal dark matter: densities span about e^-5 .. e^4 of the mean
GAS_SMOOTHING_VOXELS = 1.0  # pressure smooths the gas below the Jeans scale
VELOCITY_SMOOTHING_VOXELS = 1.5
RHO_LOG_SCALE = 14.0  # Hydro channel 0 = log(rho_gas) / 14, so exp(14 x) is the physical gas density
NBODY_LOG_SCALE = 5.0  # Nbody channel 0 = log(rho_dm) / 5: about [-1, 1]
VELOCITY_RMS = 0.3  # velocities in units where their rms is 0.3


def _wavenumbers(edge):
    """(kz, ky, kx) broadcastable over the rfftn grid of an edge^3 box, radians per voxel."""
    k_full = (2 * np.pi * np.fft.fftfreq(edge)).astype(np.float32)
    k_half = (2 * np.pi * np.fft.rfftfreq(edge)).astype(np.float32)
    return k_full[:, None, None], k_full[None, :, None], k_half[None, None, :]


def _smooth(field, k_squared, radius_voxels):
    """Gaussian smoothing of a periodic real field (done in Fourier space)."""
    kernel = np.exp(-0.5 * k_squared * radius_voxels**2)
    return np.fft.irfftn(np.fft.rfftn(field) * kernel, s=field.shape, axes=(0, 1, 2))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _universe(edge, rng):
    """float32 (Nbody (4, L, L, L), Hydro (5, L, L, L)) for one periodic box."""
    shape = (edge, edge, edge)
    kz, ky, kx = _wavenumbers(edge)
    k_squared = kz**2 + ky**2 + kx**2
    k_squared[0, 0, 0] = 1.0  # the mean mode is removed below; avoids 0 ** negative power
    amplitude = k_squared ** (SPECTRAL_INDEX / 4) * np.exp(-0.5 * k_squared * CUTOFF_VOXELS**2)
    amplitude[0, 0, 0] = 0.0

    white = rng.standard_normal(shape, dtype=np.float32)
    gauss_k = np.fft.rfftn(white) * amplitude
    gauss = np.fft.irfftn(gauss_k, s=shape, axes=(0, 1, 2))
    gauss_std = gauss.std()
    gauss /= gauss_std
    gauss_k /= gauss_std

    # Poisson: laplacian(phi) = delta -> phi_k = -delta_k / k^2; v = -grad(phi) -> v_k = i k delta_k / k^2
    velocity = np.stack([np.fft.irfftn(1j * k * gauss_k / k_squared, s=shape, axes=(0, 1, 2))
                         for k in (kz, ky, kx)])
    velocity *= VELOCITY_RMS / np.sqrt(np.mean(velocity**2))

    log_rho_dm = LOG_DENSITY_STD * gauss - 0.5 * LOG_DENSITY_STD**2  # lognormal with mean density 1
    nbody = np.concatenate([(log_rho_dm / NBODY_LOG_SCALE)[None], velocity])

    # gas: smoothed dark matter, bias saturating at high and low density (feedback, pressure floor)
    log_rho_gas = 3.0 * np.tanh(_smooth(log_rho_dm, k_squared, GAS_SMOOTHING_VOXELS) / 3.0)
    # temperature: T ~ rho^0.6 (photo-heated gas) plus shock heating above ~e times the mean density
    log_temperature = 0.6 * log_rho_gas + 1.5 * _softplus(2.0 * (log_rho_gas - 1.0))
    temperature = np.tanh((log_temperature - 1.0) / 3.0)
    # gas velocity: the smoothed dark-matter flow, slowed where the gas is dense (pressure support)
    slowdown = 1.0 - 0.3 / (1.0 + np.exp(-2.0 * (log_rho_gas - 1.0)))
    gas_velocity = np.stack([np.tanh(_smooth(v, k_squared, VELOCITY_SMOOTHING_VOXELS) * slowdown)
                             for v in velocity])
    hydro = np.concatenate([(log_rho_gas / RHO_LOG_SCALE)[None], temperature[None], gas_velocity])
    return nbody.astype(np.float32), hydro.astype(np.float32)


def _check_cosmo_args(train_size, valid_size, seed):
    for name, edge in (("train_size", train_size), ("valid_size", valid_size)):
        if edge < MIN_EDGE or edge % 8:
            raise SampleDataError(f"--{name} must be a multiple of 8 and >= {MIN_EDGE}, got {edge}")
    if seed < 0:
        raise SampleDataError(f"--seed must be >= 0, got {seed}")


def _write_box(path, nbody, hydro):
    """Both datasets into `path`, atomically; no timestamps, so reruns give the same bytes."""
    with atomic_path(path) as tmp_path, h5py.File(tmp_path, "w", track_order=False) as f:
        f.create_dataset("Nbody", data=nbody, track_times=False)
        f.create_dataset("Hydro", data=hydro, track_times=False)


def write_cosmo(out_dir, train_size=64, valid_size=48, seed=0, npy=True, overwrite=False, verbose=True):
    """Write the train (edge train_size) and validation (edge valid_size) boxes to out_dir; return it as a Path.

    Holds a whole box in memory (about 150 bytes per voxel). Raises SampleDataError on bad sizes, or if
    out_dir already holds a cosmology data set and overwrite is False.
    """
    # imported here: the package imports this module, and `python -m sample_data.convert_to_npy` must find its
    # module not yet imported (runpy warns otherwise)
    from sample_data.convert_to_npy import convert

    _check_cosmo_args(train_size, valid_size, seed)
    out_dir = Path(out_dir)
    existing = [name for name in (TRAIN_FILE, VALID_FILE) if (out_dir / name).exists()]
    if existing and not overwrite:
        raise SampleDataError(f"{out_dir} already holds cosmology sample data ({', '.join(existing)}); "
                              "pass --overwrite to replace it")
    out_dir.mkdir(parents=True, exist_ok=True)

    start_time = time.perf_counter()
    for split_index, (name, edge) in enumerate(((TRAIN_FILE, train_size), (VALID_FILE, valid_size))):
        # own stream per split: train and validation boxes have different phases
        nbody, hydro = _universe(edge, np.random.default_rng([seed, split_index]))
        path = out_dir / name
        _write_box(path, nbody, hydro)
        if verbose:
            print(f"[cosmo] {name}: Nbody {nbody.shape}, Hydro {hydro.shape}, "
                  f"{path.stat().st_size / 1e6:.1f} MB", flush=True)
        if npy:
            data_path, label_path = convert(path, "Nbody", "Hydro", out_dir)
            if verbose:
                print(f"[cosmo] {Path(data_path).name}, {Path(label_path).name} (channels-last)", flush=True)
    if verbose:
        print(f"[cosmo] wrote 2 boxes to {out_dir} in {time.perf_counter() - start_time:.1f} s", flush=True)
    return out_dir


def _run_cosmo(args):
    write_cosmo(args.out, train_size=args.train_size, valid_size=args.valid_size, seed=args.seed,
                npy=not args.no_npy, overwrite=args.overwrite)
    return 0


def add_cosmo_parser(subparsers):
    """Register the `cosmo` subcommand."""
    parser = subparsers.add_parser(
        "cosmo", help="synthetic N-body -> hydro boxes (downsamp_*.h5 + channels-last .npy)",
        description="Write cosmology boxes in the sc21 tutorial layout: HDF5 datasets Nbody (4, L, L, L) and "
                    "Hydro (5, L, L, L), plus <basename>_data.npy / _label.npy. The real boxes are 1024^3 and "
                    "512^3; generating one needs about 150 bytes of RAM per voxel (20 GB at 512^3).",
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--train_size", type=int, default=64, help="training box edge (default 64)")
    parser.add_argument("--valid_size", type=int, default=48, help="validation box edge (default 48)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_npy", action="store_true", help="skip the channels-last .npy copies")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing data set in --out")
    parser.set_defaults(run=_run_cosmo)
