"""Data loader selection: the config's `dataset` picks the reader, `data_loader_config` its variant (loaders/)."""


def get_data_loader_distributed(params, train):
    """The loader of the training (train=True) or validation split, sharded over the data-parallel ranks: the
    interface of loaders/common.py (iterate an epoch, len(), set_epoch(epoch, skip), sample_shape, first_batch(),
    describe(epoch, step))."""
    from loaders import get_data_loader  # lazy: `python -m sample_data` needs no torch
    return get_data_loader(params, train)
