"""Data loader selection: the config's `dataset` picks the reader, `data_loader_config` its variant."""


def get_data_loader_distributed(params, train):
    """(loader, dataset, sampler) for the training (train=True) or validation split."""
    from utils.data_loader import get_data_loader  # lazy: `python -m utils.sample_data` needs no torch
    return get_data_loader(params, train)
