"""Write small synthetic data sets in the exact on-disk layout the tutorials read.

Lets every tutorial run (and be tested) without downloading the real data:
`python -m sample_data era5 --out DIR` writes ERA5-like HDF5 year files + stats;
`cosmo` the cosmology boxes (HDF5 + .npy), `cifar100` the CIFAR-100 python pickles,
`imagefolder` an ImageNet-style folder tree (sample_data/{era5,cosmo,images}.py;
the command line is sample_data/__main__.py).
"""
from sample_data.common import SampleDataError
from sample_data.cosmo import HYDRO_CHANNELS, NBODY_CHANNELS, TRAIN_FILE, VALID_FILE, write_cosmo
from sample_data.era5 import ERA5_CHANNELS, ERA5_SPLITS, ERA5_STATS, persistence_error, write_era5
from sample_data.images import (
    CIFAR100_COARSE_NAMES,
    CIFAR100_FINE_NAMES,
    CIFAR100_FOLDER,
    FINE_TO_COARSE,
    write_cifar100,
    write_imagefolder,
)

__all__ = [
    "CIFAR100_COARSE_NAMES", "CIFAR100_FINE_NAMES", "CIFAR100_FOLDER", "ERA5_CHANNELS", "ERA5_SPLITS",
    "ERA5_STATS", "FINE_TO_COARSE", "HYDRO_CHANNELS", "NBODY_CHANNELS", "TRAIN_FILE", "VALID_FILE",
    "SampleDataError", "persistence_error", "write_cifar100", "write_cosmo", "write_era5", "write_imagefolder",
]
