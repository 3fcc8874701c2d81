"""The one place where the PyTorch versions we serve differ: the pinned one (requirements.txt) and the tutorial
container's (nersc/pytorch:24.08.01, torch 2.5; `make test-compat` runs the compatibility tests on it).

Each entry names the version that changed the behaviour, so it can go when the oldest version we serve has it.
"""
import contextlib

import torch


@contextlib.contextmanager
def lr_tensors_kept(optimizer):
    """Within the block, a schedule that puts a new lr into a param group whose lr is a tensor (torch < 2.6's
    ReduceLROnPlateau assigns a float) has the tensor filled with it instead and put back: a step captured in a CUDA
    graph reads the tensor it was captured with (utils/optim.make_capturable). A no-op for float learning rates."""
    held = [group["lr"] for group in optimizer.param_groups]
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, held):
            if torch.is_tensor(lr) and group["lr"] is not lr:
                lr.fill_(float(group["lr"]))
                group["lr"] = lr
