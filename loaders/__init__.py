"""Data loaders: the config's `dataset` picks the data set, its `data_loader_config` the loader of it.

common.py     what every loader shares: the resumable sampler, batch plumbing, the PyTorch loader, the DALI base
era5.py       ERA5 yearly HDF5 files (x(t), x(t+dt)) pairs     dali_era5.py   the same through DALI
cosmo.py      cosmology boxes, random rotated 3D crops          dali_cosmo.py  the same through DALI (ROI reads)
images.py     CIFAR-100 and ImageFolder (torchvision)
synthetic.py  random batches of the config's shapes, no files (ERA5's `synthetic`: measuring a layout)
Every loader offers the training loop the same interface (loaders/common.py). `LOADERS` maps each
(dataset, data_loader_config) to the function that builds the loader of one split; a data set with one loader
(the image data sets) takes any data_loader_config. How the loaders start their worker processes is handed in (a
WorkerStart, lifecycle/workers.py: a training run's keeps the job's stop signals from them, lifecycle/signals.py).
"""
from lifecycle.workers import PLAIN_START
from loaders import common
from loaders.cosmo import cosmo_loader
from loaders.era5 import era5_loader
from loaders.synthetic import SyntheticLoader
from utils.errors import UserError


# imported on first use: their modules need optional packages (DALI; torchvision)
def dali_era5_loader(params, train, worker_start):
    from loaders import dali_era5
    return dali_era5.dali_era5_loader(params, train, worker_start)


def dali_cosmo_loader(params, train, worker_start):
    from loaders import dali_cosmo
    return dali_cosmo.dali_cosmo_loader(params, train, worker_start)


def image_loader(params, train, worker_start):
    from loaders import images
    return images.image_loader(params, train, worker_start)


def synthetic_loader(params, train, worker_start):
    return SyntheticLoader(params, train)  # no workers


# dataset -> {data_loader_config: fn(params, train, worker_start) -> loader}; the key None: whatever
# data_loader_config says
LOADERS = {
    "era5": {"pytorch": era5_loader, "dali": dali_era5_loader, "synthetic": synthetic_loader},
    "cosmo": {"synthetic": cosmo_loader, "inmem": cosmo_loader, "lowmem": cosmo_loader,
              "dali-lowmem": dali_cosmo_loader},
    "cifar100": {None: image_loader},
    "imagefolder": {None: image_loader},
}
DATASET_NAMES = {"era5": "ERA5", "cosmo": "the cosmology boxes"}  # in error messages
# a data_loader_config of another data set, named where it is picked by mistake
MISPLACED = {("era5", "dali-lowmem"): "the cosmology boxes' DALI loader (config/UNet.yaml)"}


def get_data_loader(params, train, worker_start=PLAIN_START):
    """The loader of the training (train=True) or validation split, sharded over the data-parallel ranks; its worker
    processes start as `worker_start` says (default: as multiprocessing starts them)."""
    dataset = params.get("dataset", "era5")
    if dataset not in LOADERS:
        raise UserError(f"dataset '{dataset}' is unknown; choose one of: {', '.join(LOADERS)}")
    variants, config = LOADERS[dataset], params.data_loader_config
    build = variants.get(config, variants.get(None))
    if build is None:
        choices = ", ".join(variants)
        if (dataset, config) in MISPLACED:
            raise UserError(f"data_loader_config '{config}' is {MISPLACED[dataset, config]}; for "
                            f"{DATASET_NAMES[dataset]} choose one of: {choices}")
        raise UserError(f"data_loader_config '{config}' is unknown for {DATASET_NAMES[dataset]}; choose one of: "
                        f"{choices}")
    loader = build(params, train, worker_start)
    if hasattr(loader, "dataset"):  # a synthetic loader's size is its config's, the same everywhere
        common.check_same_size_everywhere(len(loader.dataset), train, worker_start.gather)
    return loader


def get_data_loader_distributed(params, train, worker_start=PLAIN_START):
    """The original tutorial's name for it (its utils/__init__.py): the loader of the training (train=True) or
    validation split, sharded over the data-parallel ranks, with the interface of loaders/common.py (iterate an
    epoch, len(), set_epoch(epoch, skip), sample_shape, first_batch(), describe(epoch, step)). A training script
    passes its run's `worker_start` (lifecycle/run.py's Run)."""
    return get_data_loader(params, train, worker_start)
