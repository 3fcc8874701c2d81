"""Data loader selection: the config's `data_loader_config` picks the implementation."""
from utils.errors import UserError

DATA_LOADERS = ("pytorch",)  # 'dali' lands with the DALI loader


def get_data_loader_distributed(params, location, train):
    """(loader, dataset, sampler) for `location`; sampler/dataset may be None for DALI loaders."""
    if params.data_loader_config not in DATA_LOADERS:
        raise UserError(f"data_loader_config '{params.data_loader_config}' is not available yet; "
                        f"use one of: {', '.join(DATA_LOADERS)} (e.g. --data_loader_config pytorch)")
    from utils.data_loader import get_data_loader
    return get_data_loader(params, location, train)
