"""Checkpoints written atomically: a kill or a full disk at any moment leaves the previous checkpoint intact."""
import os
import random

import numpy as np
import torch

from utils.atomic import atomic_path
from utils.errors import UserError


def save_checkpoint(path, state):
    """torch.save to `<path>.tmp`, flushed to disk, renamed over `path`. A failed write (disk full, quota)
    removes the temporary file, keeps the previous checkpoint and raises a UserError that says so."""
    try:
        with atomic_path(path) as tmp_path, open(tmp_path, "wb") as f:
            torch.save(state, f)
    except OSError as err:
        kept = ("the previous checkpoint is kept" if os.path.isfile(path)
                else "there was no earlier checkpoint")
        raise UserError(f"writing checkpoint '{path}' failed ({err.strerror or err}); the partial file was removed "
                        f"and {kept}; free disk space (or choose another --expdir) and start again to resume") from None


def load_checkpoint(path):
    """The checkpoint dict at `path`, on the CPU."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint '{path}' not found; pass an existing file to --resume")
    try:
        # our own files hold numpy/python RNG states, which weights_only loading refuses
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise UserError(f"checkpoint '{path}' cannot be read ({type(err).__name__}); "
                        "it is not a checkpoint written by train.py") from None


def load_model_state(model, state, path):
    """model.load_state_dict(state), after checking that names and shapes fit; else one line naming the first
    parameter that does not."""
    expected = model.state_dict()
    for name, tensor in expected.items():
        if name not in state:
            raise UserError(f"checkpoint '{path}' has no '{name}'; it was written for another model or config")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise UserError(f"checkpoint '{path}' holds '{name}' of shape {tuple(state[name].shape)}, but this "
                            f"config's model has {tuple(tensor.shape)}; resume with the config that wrote it, "
                            "or start a new --run_num")
    unexpected = [name for name in state if name not in expected]
    if unexpected:
        raise UserError(f"checkpoint '{path}' holds '{unexpected[0]}', which this config's model does not have; "
                        "resume with the config that wrote it, or start a new --run_num")
    model.load_state_dict(state)


def get_rng_states():
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
